#!/usr/bin/env python3
"""DRA mode with MIG instances and shared GPUs (issue 38): what publishing 56 devices instead of 8 costs.

Node shapes, all on the built-in H100 node's topology (plugin/devices/simulated.py ``builtin_node``):

    gpu8                  8 whole GPUs (--mig-strategy none)
    mig56                 8 GPUs x 7 MIG instances of 1g.10gb (--mig-strategy mixed): 56 devices
    mig56-shared          mig56, every instance shared (sharing: nvidia.com/mig-1g.10gb, replicas 4)
    mig56-tainted         mig56, every device tainted (each GPU Unhealthy, xid-79)
    mig56-shared-tainted  both: the largest slice the plugin writes for this node

1. Slice size: the JSON bytes of the ResourceSlice as the writer sends it (compact, as plugin/kube/transport.py
   encodes it), as the API server answers the create (our slice plus what the server adds: uid,
   resourceVersion, managedFields), and the value etcd holds for it (protobuf).
2. Build cost, in process, median over --repeats: the slice from a snapshot's devices (``published_devices`` +
   ``resource_slice``, what the writer computes on a new snapshot) and the comparison with the server's copy
   (``update_body``: unchanged, as the writer finds it after each write, and one GPU's taint changed).
3. Write time against the real kube-apiserver (tests/conformance/apiserver, 1.37): --creates creates (each after a
   delete) and --updates PUTs through the plugin's own KubeClient, alternating a fault on GPU 3 and its recovery.
4. Fault -> taint, in process: the plugin's SliceWriter on its own thread with debounce 0 and min interval 0 (so
   pacing is not what is measured), from ``NodeState.publish`` of GPU 3 Unhealthy to the PUT that stored the taint
   having returned, and to a watch on the slice delivering it; --faults faults, each followed by its recovery.
5. RSS of the plugin process in DRA mode, ``python -m plugin run --mode dra`` on the simulated backend against the
   same API server (8 GPUs with --mig-strategy none, and 8 x 7 instances with mixed, in turn, --runs times):
   VmRSS once the slice is written, after --rss-faults fault + recovery cycles, after --idle s, and VmHWM.

Prints numbers, asserts none. --no-apiserver runs parts 1 (sent bytes) and 2 only, without the API server.

    python bench/bench_dra_mig.py                     # everything, a few minutes on 2 cores
    python bench/bench_dra_mig.py --json              # the same, as JSON
    python bench/bench_dra_mig.py --no-apiserver --repeats 20
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import datetime as dt
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._common import compiled_env, machine, pct, proc_status  # noqa: E402
from plugin.devices.model import Gpu  # noqa: E402
from plugin.devices.simulated import builtin_node, parse_node  # noqa: E402
from plugin.dra import slices as rs  # noqa: E402
from plugin.dra.shares import sharing_dropped  # noqa: E402
from plugin.dra.slicewriter import SliceWriter  # noqa: E402
from plugin.health.node_state import DeviceStatus, NodeState  # noqa: E402
from plugin.health.reasons import State  # noqa: E402
from plugin.kube.client import KubeClient  # noqa: E402
from plugin.sharing.config import SharingConfig, parse_sharing  # noqa: E402
from tests.fakes.node_devices import status  # noqa: E402

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
FAULTY = 3  # the GPU every fault is on
GI_1G = range(7, 14)  # the GPU instance ids nvidia-smi gives seven 1g.10gb instances of an H100
MIB_1G = 9856
MIG_SHARING = {"timeSlicing": {"resources": [{"name": "nvidia.com/mig-1g.10gb", "replicas": 4}]}}
# The manifests' memory request for the plugin (manifests/base/daemonset.yaml, docs/deploy.md): the target.
MEMORY_REQUEST_MIB = 80
WAIT_S = 30.0
SINCE = 1_767_225_600.0  # when the measured states began: the same taints' timeAdded in every build


@dataclass(frozen=True)
class Shape:
    name: str
    mig: bool
    shared: bool = False
    tainted: bool = False  # every GPU (so every device) Unhealthy; the others: GPU 3's fault only

    @property
    def strategy(self) -> str:
        return "mixed" if self.mig else "none"


SHAPES = (Shape("gpu8", False), Shape("mig56", True), Shape("mig56-shared", True, shared=True),
          Shape("mig56-tainted", True, tainted=True), Shape("mig56-shared-tainted", True, True, True))
LATENCY_SHAPES = ("gpu8", "mig56", "mig56-shared")
RSS_SHAPES = ("gpu8", "mig56")


def node_doc(mig: bool) -> dict[str, Any]:
    """The simulated node file: the built-in node, each GPU cut into seven 1g.10gb instances when ``mig``."""
    doc = builtin_node()
    if mig:
        for g in doc["gpus"]:
            g["mig_devices"] = [{"uuid": f"MIG-{g['index']:04d}{gi:04d}-1111-4000-8000-{gi:012d}",
                                 "gpu_instance_id": gi, "compute_instance_id": 0, "profile": "1g.10gb",
                                 "memory_mib": MIB_1G} for gi in GI_1G]
    return doc


def gpus_of(shape: Shape) -> list[Gpu]:
    return [s.gpu for s in parse_node(node_doc(shape.mig))]


def statuses(gpus: Sequence[Gpu], bad: set[int], since: float) -> list[DeviceStatus]:
    """What the monitor publishes: each GPU's status and each instance's, an instance carrying its GPU's fault."""
    out = []
    for g in gpus:
        state, codes = (State.UNHEALTHY, ("xid-79",)) if g.index in bad else (State.HEALTHY, ())
        out.append(status(g, state, *codes, since=since))
        out += [status(g, state, *codes, since=since, mig=m) for m in g.mig_devices]
    return out


def bad_gpus(shape: Shape, fault: bool) -> set[int]:
    others = set(range(8)) - {FAULTY} if shape.tainted else set()
    return others | {FAULTY} if fault else others


def settings_of(shape: Shape, node_name: str, node_uid: str = "") -> rs.SliceSettings:
    sharing = parse_sharing(MIG_SHARING) if shape.shared else SharingConfig()
    return rs.SliceSettings(node_name=node_name, node_uid=node_uid, mig_strategy=shape.strategy, sharing=sharing)


def build(devices: Sequence[DeviceStatus], settings: rs.SliceSettings) -> dict[str, Any]:
    """What the writer computes from a snapshot: its published devices, then the slice."""
    return rs.resource_slice(rs.published_devices(devices, settings.mig_strategy), settings)


def size(obj: Mapping[str, Any]) -> int:
    return len(json.dumps(obj, separators=(",", ":")).encode())


def measured_fault(shape: Shape) -> bool:
    """Whether GPU 3's fault is on in the state a shape's size stands for: every device tainted is the tainted
    shapes' point; the others are measured healthy."""
    return shape.tainted


def taint_of(obj: Mapping[str, Any], gpu: int) -> list[Any]:
    """The taints of GPU ``gpu``'s devices (the whole GPU, or each of its instances), in slice order."""
    prefix = f"gpu-{gpu}"
    return [(d.get("taints") or None) for d in (obj.get("spec") or {}).get("devices") or ()
            if d["name"] == prefix or d["name"].startswith(prefix + "-mig-")]


def tainted(obj: Mapping[str, Any], gpu: int) -> bool:
    t = taint_of(obj, gpu)
    return bool(t) and all(t)


def untainted(obj: Mapping[str, Any], gpu: int) -> bool:
    t = taint_of(obj, gpu)
    return bool(t) and not any(t)


def ms(values_s: Sequence[float], digits: int = 3) -> dict[str, float]:
    v = [x * 1000 for x in values_s]
    return {"n": len(v), "p50_ms": round(statistics.median(v), digits), "p99_ms": round(pct(v, 99), digits),
            "max_ms": round(max(v), digits)}


# 1 and 2: in process -----------------------------------------------------------------------------------------

def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def as_stored(body: Mapping[str, Any]) -> dict[str, Any]:
    """A stand-in for the server's copy where there is no server: what we sent, with a resourceVersion."""
    current = copy.deepcopy(dict(body))
    current["metadata"]["resourceVersion"] = "1"
    return current


def in_process(shape: Shape, repeats: int, stored: Mapping[str, Any] | None = None,
               settings: rs.SliceSettings | None = None) -> dict[str, Any]:
    """Sizes and build costs of one shape. ``stored``: the API server's answer to the create of this shape's
    slice with ``settings`` (compared against as the writer compares against its last read); else what was
    sent."""
    gpus = gpus_of(shape)
    settings = settings or settings_of(shape, f"bench-{shape.name}")
    here = measured_fault(shape)
    devices = statuses(gpus, bad_gpus(shape, here), SINCE)
    flipped = statuses(gpus, bad_gpus(shape, not here), SINCE + 60)
    body = build(devices, settings)
    current = dict(stored) if stored is not None else as_stored(body)
    changed = build(flipped, settings)
    if rs.update_body(current, body) is not None or rs.update_body(current, changed) is None:
        raise RuntimeError(f"{shape.name}: the stored copy does not compare as the writer expects")
    published = rs.published_devices(devices, settings.mig_strategy)
    return {
        "devices": len(published),
        "tainted_devices": sum(1 for d in body["spec"]["devices"] if d.get("taints")),
        "shared_devices": sum(1 for d in body["spec"]["devices"] if d.get("allowMultipleAllocations")),
        "sent_bytes": size(body),
        "build_ms": round(timed(lambda: build(devices, settings), repeats) * 1000, 3),
        "published_devices_ms": round(timed(lambda: rs.published_devices(devices, settings.mig_strategy),
                                            repeats) * 1000, 3),
        "update_body_unchanged_ms": round(timed(lambda: rs.update_body(current, body), repeats) * 1000, 3),
        "update_body_changed_ms": round(timed(lambda: rs.update_body(current, changed), repeats) * 1000, 3),
    }


# The API server ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def apiserver(workdir: Path) -> Iterator[Any]:
    """The conformance peer's kube-apiserver + etcd (built once into the user's cache, then reused)."""
    from tests.conformance.apiserver import _binaries
    from tests.conformance.apiserver.apiserver_peer import ApiServerPeer

    try:
        binaries = _binaries.build_all()
    except _binaries.BuildErrors as exc:
        raise SystemExit(f"bench: the API server's binaries are not in the cache and could not be built ({exc}); "
                         "build them with `python tests/conformance/apiserver/_binaries.py`, or run with "
                         "--no-apiserver for the in-process figures only") from None
    attempts = iter(range(3))
    peer = ApiServerPeer.start_retrying(binaries, lambda: workdir / f"apiserver-{next(attempts)}")
    try:
        yield peer
    finally:
        peer.stop()


def etcd_bytes(peer: Any, name: str) -> int:
    """The size of the slice's value in etcd: what the API server really stores (protobuf, not JSON)."""
    key = f"/registry/resourceslices/{name}".encode()
    r = peer.request("POST", f"{peer.etcd_url}/v3/kv/range", {"key": base64.b64encode(key).decode()})
    kvs = r.body.get("kvs") if r.ok and isinstance(r.body, dict) else None
    if not kvs:
        raise RuntimeError(f"etcd has no {key.decode()} ({r.status})")
    return len(base64.b64decode(kvs[0]["value"]))


def node_uid(peer: Any, name: str) -> str:
    return str(peer.create_node(name)["metadata"]["uid"])


def write_times(peer: Any, shape: Shape, creates: int,
                updates: int) -> tuple[dict[str, Any], dict[str, Any], rs.SliceSettings]:
    """(figures, the server's answer to the last create, the settings written with) for one shape, through the
    plugin's KubeClient."""
    name = f"bench-{shape.name}"
    settings = settings_of(shape, name, node_uid(peer, name))
    gpus = gpus_of(shape)
    here = measured_fault(shape)
    client = KubeClient(peer.kubeconfig)
    try:
        body = build(statuses(gpus, bad_gpus(shape, here), SINCE), settings)
        create_s = []
        stored: dict[str, Any] = {}
        for _ in range(creates):
            client.delete_resource_slice(rs.slice_name(settings))
            sent = rs.update_body(None, body)
            assert sent is not None
            t = time.perf_counter()
            stored = client.create_resource_slice(sent)
            create_s.append(time.perf_counter() - t)
        kept = {"taints": not rs.taints_dropped(body, stored), "sharing": not sharing_dropped(body, stored),
                "devices": len(stored["spec"].get("devices") or ()) == len(body["spec"].get("devices") or ())}
        first = stored
        in_etcd = etcd_bytes(peer, rs.slice_name(settings))
        put_s, total_s = [], []
        current = stored
        for k in range(updates):
            fault = (k % 2 == 0) != here
            t0 = time.perf_counter()
            desired = build(statuses(gpus, bad_gpus(shape, fault), time.time()), settings)
            put = rs.update_body(current, desired)
            assert put is not None
            t1 = time.perf_counter()
            current = client.update_resource_slice(rs.slice_name(settings), put)
            t2 = time.perf_counter()
            put_s.append(t2 - t1)
            total_s.append(t2 - t0)
            if tainted(current, FAULTY) != fault:
                raise RuntimeError(f"{shape.name}: update {k} came back without GPU {FAULTY}'s change")
    finally:
        client.close()
    return {"stored_bytes": size(first), "etcd_bytes": in_etcd, "server_kept": kept, "create": ms(create_s),
            "put": ms(put_s), "build_and_put": ms(total_s)}, first, settings


class Stamped:
    """The plugin's KubeClient, with the moment each slice write returned and the answer it returned."""

    def __init__(self, kubeconfig: Path, on_stored: Callable[[dict[str, Any], float], None]) -> None:
        self.client = KubeClient(kubeconfig)
        self._on_stored = on_stored

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def create_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        stored = self.client.create_resource_slice(body)
        self._on_stored(stored, time.perf_counter())
        return stored

    def update_resource_slice(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        stored = self.client.update_resource_slice(name, body)
        self._on_stored(stored, time.perf_counter())
        return stored


class Seen:
    """The slices a source delivered, each with when; ``wait`` for the first one after ``t0`` that satisfies."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: list[tuple[float, dict[str, Any]]] = []

    def add(self, obj: dict[str, Any], at: float) -> None:
        with self._cond:
            self._items.append((at, obj))
            self._cond.notify_all()

    def wait(self, t0: float, ok: Callable[[dict[str, Any]], bool], what: str) -> float:
        deadline = time.monotonic() + WAIT_S
        with self._cond:
            while True:
                for at, obj in self._items:
                    if at >= t0 and ok(obj):
                        return at - t0
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{what}: not within {WAIT_S:.0f} s")
                self._cond.wait(left)

    def clear(self) -> None:
        with self._cond:
            self._items.clear()


def watch(kubeconfig: Path, name: str, seen: Seen, stop: threading.Event) -> threading.Thread:
    """A watch on the one slice, on a connection of its own, feeding ``seen`` as each event arrives."""
    client = KubeClient(kubeconfig)

    def run() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):  # a broken stream is opened again; the figures show any gap
                for event in client.watch(SLICES, {"fieldSelector": f"metadata.name={name}"}, 60.0):
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        seen.add(event["object"], time.perf_counter())
                    if stop.is_set():
                        return

    thread = threading.Thread(target=run, name="bench-watch", daemon=True)
    thread.start()
    thread.client = client  # type: ignore[attr-defined]
    return thread


def latency(peer: Any, shape: Shape, faults: int) -> dict[str, Any]:
    name = f"lat-{shape.name}"
    settings = settings_of(shape, name, node_uid(peer, name))
    gpus = gpus_of(shape)
    stored, watched = Seen(), Seen()
    state = NodeState()
    writer = SliceWriter(state, settings, lambda: Stamped(peer.kubeconfig, stored.add), debounce_s=0.0,
                         min_interval_s=0.0)
    stop = threading.Event()
    watcher = watch(peer.kubeconfig, rs.slice_name(settings), watched, stop)
    to_stored, to_watch, back_stored = [], [], []
    try:
        t = time.perf_counter()
        state.publish(statuses(gpus, bad_gpus(shape, False), time.time()), time.time())
        writer.start()
        stored.wait(t, lambda o: untainted(o, FAULTY), "the first write")
        watched.wait(t, lambda o: untainted(o, FAULTY), "the first write on the watch")
        for k in range(faults):
            stored.clear()
            watched.clear()
            # Made before the clock starts: the monitor has its statuses when it publishes them.
            faulted = statuses(gpus, bad_gpus(shape, True), time.time())
            t0 = time.perf_counter()
            state.publish(faulted, time.time())
            to_stored.append(stored.wait(t0, lambda o: tainted(o, FAULTY), f"fault {k}: stored"))
            to_watch.append(watched.wait(t0, lambda o: tainted(o, FAULTY), f"fault {k}: watch"))
            healthy = statuses(gpus, bad_gpus(shape, False), time.time())
            t1 = time.perf_counter()
            state.publish(healthy, time.time())
            back_stored.append(stored.wait(t1, lambda o: untainted(o, FAULTY), f"recovery {k}: stored"))
            watched.wait(t1, lambda o: untainted(o, FAULTY), f"recovery {k}: watch")
    finally:
        stop.set()
        writer.stop()
        watcher.client.close()  # type: ignore[attr-defined]
        watcher.join(5)
    st = writer.status()  # once stopped: a write's count lands after the answer the waits above saw
    return {"fault_to_stored": ms(to_stored, 1), "fault_to_watch": ms(to_watch, 1),
            "recovery_to_stored": ms(back_stored, 1), "writes": st.writes, "conflicts": st.conflicts,
            "failures": st.failures}


# 5: the plugin process ---------------------------------------------------------------------------------------

def write_node(path: Path, doc: Mapping[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def wait_slice(client: KubeClient, name: str, ok: Callable[[dict[str, Any]], bool], proc: subprocess.Popen[bytes],
               what: str) -> None:
    deadline = time.monotonic() + WAIT_S * 2
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: the plugin exited with {proc.returncode}")
        obj = client.get_resource_slice(name)
        if obj is not None and ok(obj):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {WAIT_S * 2:.0f} s")
        time.sleep(0.1)


def rss_run(peer: Any, shape: Shape, run: int, faults: int, idle_s: float, env: dict[str, str]) -> dict[str, Any]:
    name = f"rss-{shape.name}-{run}"
    node_uid(peer, name)
    n_devices = 56 if shape.mig else 8
    with tempfile.TemporaryDirectory(prefix="ghmig-") as tmp_s:
        tmp = Path(tmp_s)
        (tmp / "dev").mkdir()
        doc = node_doc(shape.mig)
        write_node(tmp / "node.json", doc)
        args = [sys.executable, "-m", "plugin", "run", "--mode", "dra", "--backend", "simulated",
                "--simulated-node", str(tmp / "node.json"), "--mig-strategy", shape.strategy,
                "--node-name", name, "--kubeconfig", str(peer.kubeconfig), "--state-dir", str(tmp / "state"),
                "--dev-root", str(tmp), "--dra-plugin-dir", str(tmp / "plugins"),
                "--dra-registry-dir", str(tmp / "registry"), "--cdi-spec-dir", str(tmp / "cdi"),
                "--metrics-address", "off", "--log-format", "json", "--poll-interval", "0.2",
                # Pacing shortened so a fault cycle takes seconds, not the 10 s bucket twice; what the process
                # holds does not depend on when it writes.
                "--report-debounce", "0.1", "--report-min-interval", "0.5"]
        client = KubeClient(peer.kubeconfig)
        slice_name = rs.slice_name(rs.SliceSettings(node_name=name))
        t0 = time.monotonic()
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, env=env)
        try:
            wait_slice(client, slice_name, lambda o: len(o["spec"].get("devices") or ()) == n_devices, proc,
                       "the first slice")
            written_s = time.monotonic() - t0
            time.sleep(2.0)  # the reporter's first Node write and the polls that follow the start
            ready = proc_status(proc.pid)
            gpus = doc["gpus"]
            for i in range(faults):
                g = i % len(gpus)
                gpus[g]["signals"] = {"nvlink_down": [0]}
                write_node(tmp / "node.json", doc)
                wait_slice(client, slice_name, functools.partial(tainted, gpu=g), proc, f"fault {i}")
                gpus[g]["signals"] = {}
                write_node(tmp / "node.json", doc)
                wait_slice(client, slice_name, functools.partial(untainted, gpu=g), proc, f"recovery {i}")
            after = proc_status(proc.pid)
            time.sleep(idle_s)  # nothing to await: the point is to let time pass
            end = proc_status(proc.pid)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
            client.close()
    return {"slice_written_s": round(written_s, 2), "rss_ready_mib": round(ready["VmRSS"] / 1024, 1),
            "rss_after_faults_mib": round(after["VmRSS"] / 1024, 1), "rss_end_mib": round(end["VmRSS"] / 1024, 1),
            "hwm_mib": round(end["VmHWM"] / 1024, 1), "threads": end["Threads"]}


def rss(peer: Any, runs: int, faults: int, idle_s: float) -> dict[str, Any]:
    env = compiled_env(REPO)
    per: dict[str, list[dict[str, Any]]] = {s: [] for s in RSS_SHAPES}
    for run in range(runs):
        for s in RSS_SHAPES:  # alternated, so a drift of the machine falls on both alike
            per[s].append(rss_run(peer, next(x for x in SHAPES if x.name == s), run, faults, idle_s, env))
    out: dict[str, Any] = {}
    for s, rows in per.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out[s] = {"runs": rows, "median": med,
                  "within_request": max(med["rss_end_mib"], med["hwm_mib"]) <= MEMORY_REQUEST_MIB}
    out["memory_request_mib"] = MEMORY_REQUEST_MIB
    return out


# Output -----------------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    started = dt.datetime.now(dt.UTC)
    out: dict[str, Any] = {"bench": "dra_mig", "machine": machine(), "date": started.strftime("%Y-%m-%d %H:%M UTC"),
                           "command": "python bench/bench_dra_mig.py " + " ".join(sys.argv[1:]),
                           "settings": {k: v for k, v in vars(args).items() if k != "json"}}
    shapes: dict[str, Any] = {}
    if args.no_apiserver:
        for s in SHAPES:
            shapes[s.name] = in_process(s, args.repeats)
        out["shapes"] = shapes
        return out
    with tempfile.TemporaryDirectory(prefix="ghmig-api-") as work, apiserver(Path(work)) as peer:
        out["etcd"] = peer.etcd_version
        for s in SHAPES:
            writes, stored, settings = write_times(peer, s, args.creates, args.updates)
            shapes[s.name] = {**in_process(s, args.repeats, stored, settings), **writes}
        out["shapes"] = shapes
        out["latency"] = {n: latency(peer, next(s for s in SHAPES if s.name == n), args.faults)
                          for n in LATENCY_SHAPES}
        if args.runs:
            out["rss"] = rss(peer, args.runs, args.rss_faults, args.idle)
    out["seconds"] = round((dt.datetime.now(dt.UTC) - started).total_seconds(), 1)
    return out


def table(d: dict[str, Any]) -> str:
    lines = [f"machine: {d['machine']}; {d['date']}", "",
             "shape                 devices  sent B  answer B  etcd B  build ms  cmp= ms  cmp!= ms  create ms  "
             "put p50/p99 ms"]
    for name, s in d["shapes"].items():
        put = s.get("put")
        lines.append(f"{name:<21} {s['devices']:>7}  {s['sent_bytes']:>6}  {s.get('stored_bytes', '-'):>8}  "
                     f"{s.get('etcd_bytes', '-'):>6}  "
                     f"{s['build_ms']:>8}  {s['update_body_unchanged_ms']:>7}  {s['update_body_changed_ms']:>8}  "
                     f"{s['create']['p50_ms'] if put else '-':>9}  "
                     + (f"{put['p50_ms']}/{put['p99_ms']}" if put else "-"))
    for name, lat in d.get("latency", {}).items():
        f, w, r = lat["fault_to_stored"], lat["fault_to_watch"], lat["recovery_to_stored"]
        lines.append(f"fault -> taint {name}: stored p50 {f['p50_ms']} p99 {f['p99_ms']} max {f['max_ms']} ms; "
                     f"watch p50 {w['p50_ms']} p99 {w['p99_ms']} max {w['max_ms']} ms; recovery stored p99 "
                     f"{r['p99_ms']} ms ({lat['writes']} writes, {lat['failures']} failures)")
    r = d.get("rss")
    if r:
        for name in RSS_SHAPES:
            m = r[name]["median"]
            lines.append(f"RSS {name}: slice written {m['slice_written_s']} s after start; ready "
                         f"{m['rss_ready_mib']} after faults {m['rss_after_faults_mib']} end {m['rss_end_mib']} "
                         f"VmHWM {m['hwm_mib']} MiB, {m['threads']} threads; within the "
                         f"{r['memory_request_mib']} MiB request: {r[name]['within_request']}")
    return "\n".join(lines)


def positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"at least 1, not {n}")
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=positive, default=200, help="in-process builds and comparisons per figure")
    ap.add_argument("--creates", type=positive, default=5, help="creates of each shape's slice (a delete before each)")
    ap.add_argument("--updates", type=positive, default=50, help="PUTs per shape, fault and recovery in turn")
    ap.add_argument("--faults", type=positive, default=50, help="faults (each then recovered) per latency shape")
    ap.add_argument("--runs", type=int, default=3, help="plugin processes per RSS shape (0: no RSS part)")
    ap.add_argument("--rss-faults", type=int, default=4, help="fault + recovery cycles per plugin process")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds the plugin idles after its faults")
    ap.add_argument("--no-apiserver", action="store_true", help="in-process figures only (parts 1 and 2)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args()
    if args.runs < 0 or args.rss_faults < 0 or args.idle < 0:
        ap.error("--runs, --rss-faults and --idle: at least 0")
    d = run(args)
    print(json.dumps(d, indent=1) if args.json else table(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
