#!/usr/bin/env python3
"""The fleet controller at 50 and at 5,000 GPU Nodes on a real kube-apiserver (issue 15), with kwok keeping the
Nodes' heartbeats like kubelets (bench/_fleet.py). The Nodes are the size of real GPU nodes' objects (50 images,
five conditions, managedFields of two managers: issue 24) unless ``--bare-nodes``; the size of one, as served and
as parsed, is printed.

For each fleet size, one `gpu-health-controller` process (byte-compiled, as in the image; its own service account,
so the audit log tells its requests apart) with the default breaker (0.1), then:

1. **latency**: ``--changes`` times, one device of a random node turns Unhealthy the way the plugin writes it; the
   time from the API server receiving that PATCH to it receiving the controller's taint PATCH for the node (both
   from its audit log, so no client's own delay counts); then the device heals and, the recovery hold being 0 here,
   the controller's release follows (not timed);
2. **idle**: ``--idle`` seconds with nothing changing: the controller's CPU, RSS and every request it made
   (target: only its Lease renewals);
3. **correlated failure**: 20% of the nodes fail at once; how many end up quarantined (target: exactly the limit)
   and how long that took.

Memory: the controller's RSS once ready and its peak (VmHWM) over the run; with two sizes or more, the cost per
Node (RSS once ready at the largest size minus at the one before, over the difference in Nodes). Then the LIST alone:
for each of ``--list-probe`` (pages of N Nodes, or ``whole``: every page kept until the last, as before issue 24), a
fresh process of the controller's own code lists the fleet into a standby reconciler and reports its RSS and peak,
beside one that only imports the same modules.

    python bench/bench_fleet.py                       # 50 and 5,000 nodes
    python bench/bench_fleet.py --nodes 50 --changes 20 --idle 30
    python bench/bench_fleet.py --nodes 500,5000 --list-probe 50,100,500,whole
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import compiled_env, cpu_seconds, machine, pct, rss_mib  # noqa: E402
from bench._fleet import NAMESPACE, Fleet  # noqa: E402
from plugin.controller.config import ControllerConfig  # noqa: E402
from plugin.kube.client import LIST_PAGE, KubeClient  # noqa: E402
from plugin.kube.errors import ApiFailure  # noqa: E402

TAINT = "gpu-health.io/quarantine"
# A large cluster's control plane (--large-control-plane), each setting as docs/benchmarks.md names it: etcd's backend
# quota raised from its 2 GiB default, which 50,000 Nodes of ~20 KB and the revisions kept between the API server's
# 5-minute compactions would fill; the API server's in-flight limits doubled from the bench's 800/400 (a fleet this
# size lists and watches more at once). Everything else is the conformance peer's.
LARGE_ETCD_ARGS = ("--quota-backend-bytes=8589934592",)
LARGE_APISERVER_ARGS = ("--max-requests-inflight=1600", "--max-mutating-requests-inflight=800")
LEASE = "gpu-health-controller"
WRITE_TIMEOUT_S = ControllerConfig().write_timeout_s  # the controller runs with the default


def get_lease(client: KubeClient) -> dict[str, Any]:
    try:
        return client.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{LEASE}")
    except ApiFailure:
        return {}


def breaker_of(client: KubeClient) -> dict[str, Any]:
    raw = ((get_lease(client).get("metadata") or {}).get("annotations") or {}).get("gpu-health.io/breaker")
    return dict(json.loads(raw)) if raw else {}


def count_tainted(client: KubeClient) -> int:
    items = client.request("GET", "/api/v1/nodes", query={"resourceVersion": "0"}).get("items") or []
    return sum(1 for node in items if tainted(node))


def tainted(node: dict[str, Any]) -> bool:
    return any(t.get("key") == TAINT for t in (node.get("spec") or {}).get("taints") or [])


def peak_rss_mib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def node_size(fleet: Fleet) -> dict[str, Any]:
    """One Node as the API server serves it (compact JSON, bytes) and as Python holds it parsed (bytes allocated)."""
    import tracemalloc

    raw = json.dumps(fleet.get_node(fleet.node_names[len(fleet.node_names) // 2]), separators=(",", ":"))
    tracemalloc.start()
    try:
        doc = json.loads(raw)
        parsed = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    managers = sorted({str(m.get("manager")) for m in doc["metadata"].get("managedFields") or []})
    return {"serialized_kb": round(len(raw) / 1000, 1), "parsed_kb": round(parsed / 1000, 1),
            "images": len(doc["status"].get("images") or []), "conditions": len(doc["status"].get("conditions") or []),
            "managers": ",".join(managers)}


class _Standby:
    """The reconciler's view of the elector for a LIST probe: never leading, so nothing is decided or written."""

    def is_leader(self) -> bool:
        return False

    def annotations(self) -> dict[str, str]:
        return {}

    def seen_annotations(self) -> dict[str, str]:
        return {}

    def set_annotation(self, key: str, value: str) -> None:
        pass


def probe_main(mode: str, kubeconfig: Path) -> None:
    """In a process of its own: the controller's modules, then (unless ``mode`` is ``imports``) one LIST of the
    fleet into a standby reconciler the way the controller's watcher does it; prints RSS and peak as JSON."""
    from plugin.controller.nodes import CONTROLLER, Keys
    from plugin.controller.policy import Rules
    from plugin.controller.reconciler import Reconciler, Settings
    from plugin.controller.watcher import NodeWatcher

    out: dict[str, Any] = {"mode": mode}
    if mode != "imports":
        api = KubeClient(kubeconfig, 300.0, component=CONTROLLER,
                         list_page_size=LIST_PAGE if mode == "whole" else int(mode))
        rec = Reconciler(api, Settings(keys=Keys("gpu-health.io"), rules=Rules()), _Standby())
        t0 = time.monotonic()
        if mode == "whole":  # what the controller did before issue 24: every page kept until the last
            items: list[dict[str, Any]] = []
            for page in api.list_node_pages(""):
                items.extend(page.items)
            rec.replace(items)
            del items
        else:
            NodeWatcher(api, "", rec, resync_s=3600.0).list_all()
        out.update(nodes=len(rec.entries), list_s=round(time.monotonic() - t0, 2))
        api.close()
    out.update(rss_mib=round(rss_mib(), 1), peak_mib=round(peak_rss_mib(), 1))
    print(json.dumps(out))


def list_probe(kubeconfig: Path, modes: list[str]) -> list[dict[str, Any]]:
    out = []
    env = compiled_env(REPO)
    for mode in ["imports", *modes]:
        run = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--probe", mode, "--probe-kubeconfig",
                              str(kubeconfig)], cwd=REPO, env=env, capture_output=True, text=True, check=True)
        out.append(json.loads(run.stdout.strip().splitlines()[-1]))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_controller(fleet: Fleet, workdir: Path, kubeconfig: Path, port: int,
                     breaker: float = 0.1, writers: int = 0, nice: int = 0) -> subprocess.Popen[bytes]:
    config: dict[str, Any] = {"version": "v1", "kubeconfig": str(kubeconfig), "namespace": NAMESPACE,
                              "identity": "bench", "metricsAddress": f"127.0.0.1:{port}",
                              "release": {"recoveryHold": "0s"}, "breaker": {"maxQuarantinedFraction": breaker}}
    if writers:
        config["quarantine"] = {"writeConcurrency": writers}
    path = workdir / "controller.yaml"
    path.write_text(json.dumps(config))
    log = open(workdir / "controller.log", "wb")  # noqa: SIM115 (kept open for the process's life)
    proc = subprocess.Popen([sys.executable, "-m", "plugin.controller.main", "--config", str(path)], cwd=REPO,
                            env=compiled_env(REPO), stdout=log, stderr=subprocess.STDOUT)
    if nice:
        # Its own share of the CPU, as on a node of its own: here it shares two cores with the API server, etcd and
        # the simulated kubelets (a negative value needs root).
        os.setpriority(os.PRIO_PROCESS, proc.pid, nice)
    return proc


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def wait_synced(client: KubeClient, proc: subprocess.Popen[bytes], port: int, timeout_s: float = 300.0) -> float:
    """Until the controller holds its Lease and its /readyz says the Node cache is filled."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"controller exited with {proc.returncode}")
        if ready(port) and (get_lease(client).get("spec") or {}).get("holderIdentity") == "bench":
            return time.monotonic() - t0
        time.sleep(0.2)
    raise TimeoutError("controller did not sync")


def _patches(fleet: Fleet, node: str, since: float, start: int = 0) -> list[Any]:
    return [r for r in fleet.requests(since=since, start=start) if r.verb == "patch" and r.resource == "nodes"
            and r.name == node and not r.subresource]


def _wait_patch(fleet: Fleet, node: str, user: str, since: float, start: int, timeout_s: float = 60.0) -> Any:
    # From a mark of the audit log: at 50,000 Nodes the log holds hundreds of thousands of entries, and filtering
    # them all every 20 ms took a good part of a core from the machine under test (issue 27's profile).
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        mine = [r for r in _patches(fleet, node, since, start) if r.user == user]
        if mine:
            return mine[0]
        time.sleep(0.02)  # the audit log is another process's file: nothing to wait on but the next look
    raise TimeoutError(f"{node}: no patch by {user} within {timeout_s:.0f}s")


class DeliveryProbe:
    """A second watcher of one Node (a field selector on its name): the wall-clock time the API server delivered the
    next change of its annotations to watchers. Set beside the controller's PATCH it splits "after the server
    answered" into the watch delivery (the API server's) and the controller's part. The watch starts without a
    version, so the server first sends the Node as it is (ADDED): the probe is in place, and knows the annotations
    before, when the constructor returns. The arrival is stamped by a thread of this process, which also runs the
    status reports: a busy moment here makes the delivery look later and the controller's part smaller, never the
    other way."""

    def __init__(self, client: KubeClient, node: str, timeout_s: float = 60.0) -> None:
        self.delivered: float | None = None
        self._before: dict[str, Any] | None = None
        self._ready, self._done = threading.Event(), threading.Event()
        query = {"fieldSelector": f"metadata.name={node}", "timeoutSeconds": str(int(timeout_s))}
        self._stream = client.watch("/api/v1/nodes", query, timeout_s)
        threading.Thread(target=self._run, daemon=True).start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"{node}: the probe's watch sent nothing in {timeout_s:.0f}s")

    def _run(self) -> None:
        try:
            for event in self._stream:
                at = time.time()
                annotations = ((event.get("object") or {}).get("metadata") or {}).get("annotations") or {}
                if self._before is None:
                    self._before = annotations
                    self._ready.set()
                elif event.get("type") == "MODIFIED" and annotations != self._before:
                    self.delivered = at
                    return
        except ApiFailure:
            return
        finally:
            self._ready.set()
            self._done.set()

    def wait(self, timeout_s: float = 60.0) -> float | None:
        self._done.wait(timeout_s)
        return self.delivered


def latency(fleet: Fleet, changes: int, rng: random.Random, heal_after_s: float,
            client: KubeClient | None = None) -> tuple[list[float], list[float], list[float]]:
    """Annotation change -> taint, on the API server's clock: from the audit entry of the plugin-like PATCH of the
    annotations to that of the controller's quarantine PATCH of the same node (no client in between). Also, apart,
    the part after the server had answered the annotation PATCH (what the watch and the controller take) and, with
    ``client``, the part of that after a second watcher got the change (:class:`DeliveryProbe`)."""
    controller = fleet.user_of("controller")
    out, after, ours = [], [], []
    names = fleet.node_names
    # Distinct nodes while the fleet has enough, so no sample follows the same node's own release.
    picks = rng.sample(names, changes) if changes <= len(names) else [rng.choice(names) for _ in range(changes)]
    for name in picks:
        probe = DeliveryProbe(client, name) if client is not None else None
        since, mark = time.time() - 1.0, fleet.audit_mark()
        fleet.set_device_state(name, 2, "Unhealthy", "reset-gpu", "ecc-uncorrected")
        taint = _wait_patch(fleet, name, controller, since, mark)
        # The change is the latest PATCH by someone else before the taint: the first one since ``since`` could be
        # older (in a small fleet made a moment ago, the node's creation-time annotation PATCH).
        change = max((r for r in _patches(fleet, name, since, mark) if r.user != controller
                      and r.time <= taint.time), key=lambda r: r.time)
        out.append(taint.time - change.time)
        after.append(taint.time - change.completed)
        delivered = probe.wait() if probe is not None else None
        if delivered is not None:
            ours.append(taint.time - delivered)
        since = taint.time
        time.sleep(heal_after_s)  # the device heals this long after the server received the taint (not timed)
        mark = fleet.audit_mark()
        fleet.set_device_state(name, 2, "Healthy")
        _wait_patch(fleet, name, controller, since + 1e-6, mark)  # the release (recovery hold 0 here)
    return out, after, ours


def correlated(fleet: Fleet, client: KubeClient, share: float, breaker: float, rng: random.Random,
               proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """``share`` of the nodes fail at once; the breaker (``breaker`` of the fleet) must stop the quarantines at its
    limit. Also the controller's own requests per second and CPU from the first failure to the end of the window."""
    failing = rng.sample(fleet.node_names, round(share * len(fleet.node_names)))
    user = fleet.user_of("controller")
    cpu0, w0 = cpu_seconds(proc.pid), time.time()
    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda n: fleet.set_device_state(n, 5, "Unhealthy", "reset-gpu", "ecc-uncorrected"), failing))
    sent_s = time.monotonic() - t0
    limit = int(breaker * len(fleet.node_names))
    counts: list[int] = []
    reached = None
    # Progress from the breaker's own count on the Lease (one small GET); the truth from the Nodes at the end.
    while time.monotonic() - t0 < 300:
        n = int(breaker_of(client).get("quarantined") or 0)
        counts.append(n)
        if n >= limit and reached is None:
            reached = time.monotonic() - t0
        if reached is not None and time.monotonic() - t0 > reached + 10:
            break  # ten more seconds at the limit: it stopped there (or went on, which the count shows)
        time.sleep(0.5)
    cpu1, w1 = cpu_seconds(proc.pid), time.time()
    window = fleet.requests(since=w0 - 1.0, until=w1)
    reqs = [r for r in window if r.user == user and r.time >= w0]
    # Annotation -> taint for each node the storm got quarantined, on the API server's clock as for single faults.
    hit = set(failing)
    changed = {r.name: r.time for r in window if r.verb == "patch" and r.resource == "nodes" and not r.subresource
               and r.user != user and r.name in hit}
    lat = sorted(r.time - changed[r.name] for r in window if r.user == user and r.verb == "patch"
                 and r.resource == "nodes" and not r.subresource and r.name in changed)
    writes = [r for r in reqs if r.verb not in ("get", "list", "watch")]
    state = breaker_of(client)
    return {"share": share, "failing": len(failing), "limit": limit, "quarantined": count_tainted(client),
            "taint_latency": {"n": len(lat), "p50_ms": round(statistics.median(lat) * 1000, 1) if lat else None,
                              "p99_ms": round(pct(lat, 99) * 1000, 1) if lat else None},
            "window_s": round(w1 - w0, 1), "requests_per_s": round(len(reqs) / (w1 - w0), 2),
            "writes_per_s": round(len(writes) / (w1 - w0), 2), "cpu_pct": round(100 * (cpu1 - cpu0) / (w1 - w0), 1),
            "max_seen": max(counts) if counts else 0, "patches_sent_s": round(sent_s, 2),
            "limit_reached_s": round(reached, 2) if reached is not None else None, "breaker": state.get("state"),
            "blocked": state.get("blocked")}


class StatusChurn:
    """Kubelet status reports without kwok: ``rate`` Node status PATCHes per second, round-robin over the fleet, from
    a few threads, until stopped. A kubelet reports every 5 minutes when nothing changed, so a fleet of N nodes makes
    N / 300 a second; the controller receives each as a whole modified Node and must parse and drop it."""

    def __init__(self, fleet: Fleet, rate: float, workers: int = 4) -> None:
        self.fleet, self.rate, self.workers = fleet, rate, workers
        self.sent = 0
        self.late = 0  # reports sent more than a second behind their schedule (the API server could not keep up)
        self.failed = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._next = 0

    def start(self) -> StatusChurn:
        if self.rate > 0:
            t0 = time.monotonic()
            for w in range(self.workers):
                t = threading.Thread(target=self._run, args=(t0, w), daemon=True)
                t.start()
                self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _run(self, t0: float, worker: int) -> None:
        names = self.fleet.node_names
        k = worker
        while not self._stop.is_set():
            due = t0 + k / self.rate
            wait = due - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                return
            try:
                self.fleet.report_status(names[k % len(names)])
            except (OSError, RuntimeError):
                with self._lock:
                    self.failed += 1
            else:
                with self._lock:
                    self.sent += 1
                    self.late += time.monotonic() - due > 1.0
            k += self.workers


HELD = re.compile(r"quarantined \S+: .*\(PATCH sent ([0-9.]+) ms after its watch event\)")


def held_ms(log: Path) -> list[float]:
    """What the controller's own log says of each quarantine so far: from the watch event that made the Node a
    candidate to its PATCH going out (plugin/controller/reconciler.py), the part of annotation-to-taint that is
    the controller's alone."""
    return [float(m.group(1)) for m in HELD.finditer(log.read_text(errors="replace"))]


def profiler(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling the controller (all its threads, idle ones left out) until SIGINT, into ``out`` as collapsed
    stacks: one line per stack with its sample count, to sum by function."""
    out.parent.mkdir(parents=True, exist_ok=True)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw", "--threads",
                             "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run(n: int, changes: int, idle_s: float, seed: int, lease_duration_s: int, realistic: bool,
        probes: list[str], heal_after_s: float, storm: float = 0.2, breaker: float = 0.1, heartbeats: bool = True,
        large: bool = False, status_rate: float = 0.0, profile: Path | None = None,
        delivery: bool = False, writers: int = 0, nice: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix=f"bench-fleet-{n}-"))
    started = time.monotonic()
    with Fleet(n, work / "fleet", lease_duration_s=lease_duration_s, realistic=realistic, kwok=heartbeats,
               extra_apiserver_args=LARGE_APISERVER_ARGS if large else (),
               extra_etcd_args=LARGE_ETCD_ARGS if large else ()) as fleet:
        fleet_s = time.monotonic() - started
        size = node_size(fleet)
        print(f"{n} nodes: one Node object is {size['serialized_kb']} KB served, {size['parsed_kb']} KB parsed "
              f"({size['images']} images, {size['conditions']} conditions, managedFields of {size['managers']})",
              file=sys.stderr, flush=True)
        kubeconfig = fleet.kubeconfig_for("controller")
        port = free_port()
        proc = start_controller(fleet, work, kubeconfig, port, breaker, writers, nice)
        try:
            # The bench's own reads include whole-fleet LISTs (about 1 GB at 50,000 Nodes): a call's timeout bounds
            # the whole call, so this client gets minutes, not the default 10 s.
            client = KubeClient(fleet.kubeconfig, timeout_s=300.0)
            sync_s = wait_synced(client, proc, port)
            memory = {"rss_ready_mib": round(rss_mib(proc.pid), 1), "peak_ready_mib": round(peak_rss_mib(proc.pid), 1)}
            churn = StatusChurn(fleet, status_rate).start()
            spy = profiler(proc.pid, profile / f"controller-{n}.txt") if profile else None
            pids = {**fleet.pids(), "controller": proc.pid, "bench": os.getpid()}
            busy0, t_busy = {k: cpu_seconds(v) for k, v in pids.items()}, time.monotonic()
            lat, after, ours = latency(fleet, changes, rng, heal_after_s, client if delivery else None)
            t_busy = time.monotonic() - t_busy
            held = held_ms(work / "controller.log")
            # Who had the machine while the single faults were timed: the share each process took of the 2 cores is
            # what the latency's growth with the fleet is made of (the API server's watch fan-out and status
            # reports, etcd, our parsing of the reports, the benchmark's own load generator).
            latency_cpu = {k: round((cpu_seconds(v) - busy0[k]) / t_busy, 3) for k, v in pids.items()}
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(60)
            time.sleep(3)  # the last release settles before the idle window opens
            user = fleet.user_of("controller")
            cpu0, w0 = cpu_seconds(proc.pid), time.time()
            time.sleep(idle_s)
            cpu1, w1 = cpu_seconds(proc.pid), time.time()
            reqs = [r for r in fleet.requests(since=w0, until=w1) if r.user == user]
            by_kind: dict[str, int] = {}
            for r in reqs:
                key = f"{r.verb} {r.resource}"
                by_kind[key] = by_kind.get(key, 0) + 1
            idle = {"seconds": idle_s, "cpu_pct": round(100 * (cpu1 - cpu0) / (w1 - w0), 2),
                    "rss_mib": round(rss_mib(proc.pid), 1), "requests_per_min": round(60 * len(reqs) / (w1 - w0), 1),
                    "requests": by_kind, "node_writes": sum(v for k, v in by_kind.items() if k.endswith(" nodes")
                                                            and not k.startswith(("get", "list", "watch")))}
            fleet_cpu = fleet.measure_idle(10)
            storm = correlated(fleet, client, storm, breaker, rng, proc)
            churn.stop()
            rss_after = round(rss_mib(proc.pid), 1)
            memory["peak_end_mib"] = round(peak_rss_mib(proc.pid), 1)
            fencing = write_times(fleet, user, work / "controller.log")
        finally:
            proc.terminate()
            proc.wait(20)
        list_probes = list_probe(kubeconfig, probes) if probes else []
    return {"nodes": n, "heartbeats": "kwok" if heartbeats else "none", "large_control_plane": large,
            "write_concurrency": writers or "default", "controller_nice": nice,
            "fleet_setup_s": round(fleet_s, 1), "breaker_fraction": breaker,
            "status_reports": {"rate_per_s": round(status_rate, 1), "sent": churn.sent, "late": churn.late,
                               "failed": churn.failed},
            "node_lease_duration_s": lease_duration_s, "node_object": size, "memory": memory,
            "list_probes": list_probes, "sync_s": round(sync_s, 1),
            "latency_samples_ms": [round(v * 1000, 1) for v in lat],
            "after_answer_samples_ms": [round(v * 1000, 1) for v in after],
            "latency_phase_cpu_cores": latency_cpu,
            "controller_held": ({"n": len(held), "p50_ms": round(statistics.median(held), 1),
                                 "p99_ms": round(pct(held, 99), 1), "max_ms": round(max(held), 1)}
                                if held else None),
            "after_delivery": ({"n": len(ours), "p50_ms": round(statistics.median(ours) * 1000, 1),
                                "p99_ms": round(pct(ours, 99) * 1000, 1), "max_ms": round(max(ours) * 1000, 1)}
                               if ours else None),
            "after_answer": {"p50_ms": round(statistics.median(after) * 1000, 1),
                             "p99_ms": round(pct(after, 99) * 1000, 1)},
            "latency": {"n": len(lat), "p50_ms": round(statistics.median(lat) * 1000, 1),
                        "p99_ms": round(pct(lat, 99) * 1000, 1), "max_ms": round(max(lat) * 1000, 1)},
            "idle": idle, "fleet_idle": fleet_cpu, "storm": storm, "rss_after_storm_mib": rss_after,
            "fencing": fencing}


def write_times(fleet: Fleet, user: str, log: Path) -> dict[str, Any]:
    """How long the API server took over each of the controller's writes (received to answered, from the audit
    log) over the whole run, storm included, against the fencing bound: every call is given up at --write-timeout
    (4 s by default, under lease duration - renew deadline); a write the server took longer over would be one the
    controller dropped. And the calls the controller did give up (TimeoutError in its log)."""
    took = sorted(r.completed - r.time for r in fleet.requests() if r.user == user and r.completed
                  and r.verb in ("create", "update", "patch", "delete"))
    over = sum(1 for t in took if t >= WRITE_TIMEOUT_S)
    return {"writes": len(took), "p50_ms": round(statistics.median(took) * 1000, 1) if took else None,
            "p99_ms": round(pct(took, 99) * 1000, 1) if took else None,
            "max_ms": round(took[-1] * 1000, 1) if took else None, "over_timeout": over,
            "timeout_s": WRITE_TIMEOUT_S, "given_up": log.read_text(errors="replace").count("TimeoutError")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="50,5000", help="comma-separated fleet sizes (default 50,5000)")
    ap.add_argument("--changes", type=int, default=50, help="timed annotation changes per size (default 50)")
    ap.add_argument("--idle", type=float, default=60.0, help="seconds of the idle window (default 60)")
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--node-lease-duration", type=int, default=40,
                    help="the simulated kubelets' node Lease duration, renewed at a quarter of it (default 40 s, the "
                         "kubelet's: 500 Lease writes/s at 5,000 nodes)")
    ap.add_argument("--bare-nodes", action="store_true",
                    help="Node objects with only what the controller reads (the fleet of issue 15), not real-sized")
    ap.add_argument("--list-probe", default="",
                    help="comma-separated LIST probes after each size: a page size, or 'whole' (default: none)")
    ap.add_argument("--heal-after", type=float, default=0.0,
                    help="seconds between the taint and the timed device's healing (default 0: at once)")
    ap.add_argument("--storm", type=float, default=0.2,
                    help="share of the nodes that fail at once in the correlated-failure step (default 0.2)")
    ap.add_argument("--breaker", type=float, default=0.1,
                    help="the controller's maxQuarantinedFraction (default 0.1, its own default)")
    ap.add_argument("--heartbeats", choices=("kwok", "none"), default="kwok",
                    help="kwok keeps every node's Lease and status like a kubelet (default), or none: Node objects "
                         "only, for fleets whose heartbeats alone would saturate this machine")
    ap.add_argument("--large-control-plane", action="store_true",
                    help="etcd and kube-apiserver set as a large cluster's are (LARGE_ETCD_ARGS, "
                         "LARGE_APISERVER_ARGS)")
    ap.add_argument("--status-reports", default="0",
                    help="Node status reports per second while the controller runs, as kubelets make them without kwok "
                         "(a number, or 'kubelet': the fleet's size / 300, one report per node every 5 minutes; "
                         "default 0)")
    ap.add_argument("--profile", type=Path,
                    help="sample the controller with py-spy while the single faults are timed, into "
                         "PROFILE/controller-N.txt (collapsed stacks; py-spy must be installed)")
    ap.add_argument("--delivery-probe", action="store_true",
                    help="a second watcher per timed change, to split the time after the server's answer into the "
                         "watch delivery and the controller's part (one more watch and GET per change)")
    ap.add_argument("--write-concurrency", type=int, default=0,
                    help="the controller's quarantine.writeConcurrency (default: its own default)")
    ap.add_argument("--controller-nice", type=int, default=0,
                    help="the controller process's nice value (e.g. -10: its own share of the CPU, as on a node of "
                         "its own; default 0)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--probe-kubeconfig", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        probe_main(args.probe, args.probe_kubeconfig)
        return
    probes = [p for p in args.list_probe.split(",") if p]
    for p in probes:
        if p != "whole" and not (p.isdigit() and int(p) > 0):
            ap.error(f"--list-probe: {p!r} is neither a page size nor 'whole'")
    if not 0 <= args.write_concurrency <= 32:
        ap.error(f"--write-concurrency: {args.write_concurrency} is not in 1..32 (0: the controller's default)")
    if not -20 <= args.controller_nice <= 19:
        ap.error(f"--controller-nice: {args.controller_nice} is not in -20..19")
    if args.heal_after < 0:
        ap.error(f"--heal-after: {args.heal_after} is negative")
    for name in ("storm", "breaker"):
        if not 0 < getattr(args, name) <= 1:
            ap.error(f"--{name}: {getattr(args, name)} is not a share in (0, 1]")
    if args.status_reports != "kubelet":
        try:
            if float(args.status_reports) < 0:
                raise ValueError
        except ValueError:
            ap.error(f"--status-reports: {args.status_reports!r} is neither a rate >= 0 nor 'kubelet'")

    def status_rate(n: int) -> float:
        return n / 300 if args.status_reports == "kubelet" else float(args.status_reports)

    results = [run(int(n), args.changes, args.idle, args.seed, args.node_lease_duration, not args.bare_nodes, probes,
                   args.heal_after, args.storm, args.breaker, args.heartbeats == "kwok", args.large_control_plane,
                   status_rate(int(n)), args.profile, args.delivery_probe, args.write_concurrency,
                   args.controller_nice)
               for n in args.nodes.split(",")]
    print(f"machine: {machine()}")
    for r in results:
        lat, idle, storm = r["latency"], r["idle"], r["storm"]
        print(f"{r['nodes']:>5} nodes: sync {r['sync_s']}s; annotation -> taint p50 {lat['p50_ms']} ms, p99 "
              f"{lat['p99_ms']} ms, max {lat['max_ms']} ms ({lat['n']} changes; after the server answered the "
              f"change: p50 {r['after_answer']['p50_ms']} ms, p99 {r['after_answer']['p99_ms']} ms); "
              f"idle {idle['seconds']:.0f}s: CPU "
              f"{idle['cpu_pct']}%, RSS {idle['rss_mib']} MiB, {idle['requests_per_min']} requests/min "
              f"{idle['requests']}, node writes {idle['node_writes']}; {storm['share']:.0%} failing: "
              f"{storm['failing']} nodes -> "
              f"{storm['quarantined']} quarantined (limit {storm['limit']}, most seen {storm['max_seen']}, limit "
              f"reached in {storm['limit_reached_s']}s, breaker {storm['breaker']}, blocked {storm['blocked']}; "
              f"annotation -> taint p50 {storm['taint_latency']['p50_ms']} ms, p99 {storm['taint_latency']['p99_ms']} "
              f"ms over {storm['taint_latency']['n']}; "
              f"controller {storm['requests_per_s']} requests/s, {storm['writes_per_s']} writes/s, CPU "
              f"{storm['cpu_pct']}% over {storm['window_s']}s); "
              f"RSS after {r['rss_after_storm_mib']} MiB")
        fe = r["fencing"]
        print(f"{r['nodes']:>5} nodes: the controller's writes on the API server (received -> answered), "
              f"{fe['writes']} writes: p50 {fe['p50_ms']} ms, p99 {fe['p99_ms']} ms, max {fe['max_ms']} ms; "
              f"{fe['over_timeout']} took {fe['timeout_s']:g} s (the write timeout) or more; {fe['given_up']} calls "
              f"given up by the controller")
        sr = r["status_reports"]
        if sr["rate_per_s"]:
            print(f"{r['nodes']:>5} nodes: {sr['rate_per_s']} status reports/s while the controller ran: {sr['sent']} "
                  f"sent, {sr['late']} more than 1 s late, {sr['failed']} failed")
        if r["controller_held"]:
            h = r["controller_held"]
            print(f"{r['nodes']:>5} nodes: inside the controller, from the watch event to the taint PATCH going out "
                  f"(its log): p50 {h['p50_ms']} ms, p99 {h['p99_ms']} ms, max {h['max_ms']} ms over {h['n']}")
        if r["after_delivery"]:
            d = r["after_delivery"]
            print(f"{r['nodes']:>5} nodes: from a second watcher's receipt of the change to the controller's taint "
                  f"(the controller's part): p50 {d['p50_ms']} ms, p99 {d['p99_ms']} ms, max {d['max_ms']} ms "
                  f"over {d['n']}")
        print(f"{r['nodes']:>5} nodes: CPU (cores) while the single faults were timed: "
              + ", ".join(f"{k} {v}" for k, v in sorted(r["latency_phase_cpu_cores"].items())))
        size, mem = r["node_object"], r["memory"]
        print(f"{r['nodes']:>5} nodes: Node object {size['serialized_kb']} KB served, {size['parsed_kb']} KB parsed; "
              f"controller RSS once ready {mem['rss_ready_mib']} MiB (peak {mem['peak_ready_mib']}), peak over the run "
              f"{mem['peak_end_mib']} MiB")
        for p in r["list_probes"]:
            print(f"{r['nodes']:>5} nodes: LIST probe {p['mode']}: RSS {p['rss_mib']} MiB, peak {p['peak_mib']} MiB"
                  + (f", {p['nodes']} nodes in {p['list_s']}s" if "nodes" in p else ""))
    if len(results) >= 2:
        small, big = results[0]["latency"]["p99_ms"], results[-1]["latency"]["p99_ms"]
        print(f"p99 at {results[-1]['nodes']} / p99 at {results[0]['nodes']}: {big / small:.2f}x")
        lo, hi = results[-2], results[-1]  # the two largest: the interpreter and the modules cancel out
        per_node = (hi["memory"]["rss_ready_mib"] - lo["memory"]["rss_ready_mib"]) * 1024 / (hi["nodes"] - lo["nodes"])
        print(f"controller RSS per Node (once ready, {hi['nodes']} vs {lo['nodes']}): {per_node:.1f} KiB")
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
