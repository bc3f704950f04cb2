#!/usr/bin/env python3
"""Which API library for the fleet controller (issue 15): kopf, lightkube's watch, or our own client, measured.

Three minimal controllers with the same reaction (a Node whose ``gpu-health.io/state`` becomes ``Unhealthy`` gets
the taint ``gpu-health.io/quarantine=unhealthy-devices:NoSchedule``; one whose state is anything else loses it),
each in its own process against the same fleet (bench/_fleet.py: a real kube-apiserver, N GPU Nodes, kwok keeping
their heartbeats):

- kopf: an ``@kopf.on.field`` handler on the state annotation that sets ``patch.spec["taints"]`` (kopf's defaults:
  its diff-base annotation on every node, Events for handler outcomes);
- lightkube: ``Client.list(Node)``, then ``Client.watch(Node)`` from the list's version, and a JSON merge patch from
  the loop; lightkube-watch: the watch alone (no LIST), as lightkube's examples start one;
- stdlib: our ``plugin.kube.client.KubeClient`` for the patch, plus a minimal LIST + streaming WATCH on
  ``http.client`` written here (the client has no watch yet).

For each: time to sync, the requests it made while starting (from the audit log, by its own service account),
RSS and CPU over ``--idle`` seconds with nothing changing, requests in that window, and annotation change -> taint
latency over ``--changes`` changes (the bench writes the device entry, state and summary as the plugin would, then
watches that node until the taint shows). kopf and lightkube live in a virtual environment of their own under the
cache directory (never the project's); it is made on first use.

    python bench/bench_controller_libs.py --nodes 5000
    python bench/bench_controller_libs.py --nodes 50 --libs stdlib,lightkube --changes 20 --idle 30
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]

ANNOTATION = "gpu-health.io/state"
TAINT_KEY = "gpu-health.io/quarantine"
TAINT_VALUE = "unhealthy-devices"
KOPF_VERSION = "1.45.2"
LIGHTKUBE_VERSION = "1.0.1"
LIBS = ("stdlib", "lightkube", "lightkube-watch", "kopf")  # kopf last: its diff-base annotations stay on the nodes


def _wanted_taints(state: str | None, taints: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The node's new taint list, or None when it already is what it should be."""
    have = any(t.get("key") == TAINT_KEY for t in taints)
    if state == "Unhealthy" and not have:
        return [*taints, {"key": TAINT_KEY, "value": TAINT_VALUE, "effect": "NoSchedule"}]
    if state != "Unhealthy" and have:
        return [t for t in taints if t.get("key") != TAINT_KEY]
    return None


def _say(*words: object) -> None:
    print(*words, flush=True)


# The controllers (each run as: bench_controller_libs.py --controller NAME --kubeconfig FILE --expect N) -----------


def controller_kopf(kubeconfig: Path, expect: int) -> None:
    import kopf  # type: ignore[import-not-found,unused-ignore]  # only in the bench's own environment

    os.environ["KUBECONFIG"] = str(kubeconfig)
    seen: set[str] = set()

    @kopf.on.event("v1", "nodes")  # type: ignore[untyped-decorator,unused-ignore]
    def count(name: str, **_: Any) -> None:
        if name not in seen:
            seen.add(name)
            if len(seen) == expect:
                _say("SYNCED", expect)

    @kopf.on.field("v1", "nodes", field=("metadata", "annotations", ANNOTATION))  # type: ignore[untyped-decorator,unused-ignore]
    def react(new: str | None, spec: Any, patch: Any, **_: Any) -> None:
        taints = _wanted_taints(new, [dict(t) for t in (spec.get("taints") or [])])
        if taints is not None:
            patch.spec["taints"] = taints

    kopf.run(clusterwide=True, standalone=True)


def controller_lightkube(kubeconfig: Path, expect: int, list_first: bool = True) -> None:
    """``list_first``: LIST, then watch from the list's version (how a reflector starts). Without it, the watch
    alone: the server opens it with an ADDED event per node, and lightkube resumes a dropped watch from the version
    of the last object it saw, which for those events is no point in the history at all."""
    from lightkube import Client, KubeConfig  # type: ignore[import-not-found,unused-ignore]
    from lightkube.resources.core_v1 import Node  # type: ignore[import-not-found,unused-ignore]
    from lightkube.types import PatchType  # type: ignore[import-not-found,unused-ignore]

    client = Client(KubeConfig.from_file(str(kubeconfig)), field_manager="bench-lightkube")
    seen: set[str] = set()

    def react(node: Any) -> None:
        meta = node.metadata
        if meta is None or meta.name is None:
            return
        name = meta.name
        if name not in seen:
            seen.add(name)
            if len(seen) == expect:
                _say("SYNCED", expect)
        taints = [t.to_dict() for t in ((node.spec.taints if node.spec else None) or [])]
        wanted = _wanted_taints((meta.annotations or {}).get(ANNOTATION), taints)
        if wanted is not None:
            try:
                client.patch(Node, name, {"metadata": {"resourceVersion": meta.resourceVersion},
                                          "spec": {"taints": wanted}}, patch_type=PatchType.MERGE)
            except Exception as exc:  # a 409: the next event of this node brings the newer version
                _say("PATCH-FAILED", name, exc)

    version = None
    if list_first:
        nodes = client.list(Node, chunk_size=500)
        for node in nodes:
            react(node)
        version = nodes.resourceVersion
    for _kind, node in client.watch(Node, resource_version=version):
        react(node)


def controller_lightkube_watch(kubeconfig: Path, expect: int) -> None:
    controller_lightkube(kubeconfig, expect, list_first=False)


def controller_stdlib(kubeconfig: Path, expect: int) -> None:
    sys.path.insert(0, str(REPO))
    from plugin.kube.client import MERGE_PATCH, KubeClient
    from plugin.kube.errors import ApiFailure

    client = KubeClient(kubeconfig, component="bench-stdlib")
    cache: dict[str, tuple[str | None, list[dict[str, Any]]]] = {}

    def react(obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name = meta.get("name", "")
        state = (meta.get("annotations") or {}).get(ANNOTATION)
        taints = (obj.get("spec") or {}).get("taints") or []
        cache[name] = (state, taints)  # all a controller needs of a node here, not the whole object
        wanted = _wanted_taints(state, taints)
        if wanted is not None:
            body = {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "spec": {"taints": wanted}}
            try:
                client.request("PATCH", f"/api/v1/nodes/{name}", body, MERGE_PATCH)
            except ApiFailure as exc:  # a 409: the next event of this node brings the newer version
                _say("PATCH-FAILED", name, exc)

    rv, cont = "", ""
    while True:  # LIST in pages of 500, as client-go's reflector does
        query = {"limit": "500", **({"continue": cont} if cont else {})}
        page = client.request("GET", "/api/v1/nodes", query=query)
        for item in page.get("items") or []:
            react(item)
        rv = page["metadata"]["resourceVersion"]
        cont = page["metadata"].get("continue") or ""
        if not cont:
            break
    if len(cache) >= expect:
        _say("SYNCED", len(cache))
    while True:
        query = {"allowWatchBookmarks": "true", "timeoutSeconds": "1800", "resourceVersion": rv}
        for event in client.watch("/api/v1/nodes", query, 120):
            obj = event.get("object") or {}
            rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
            if event.get("type") in ("ADDED", "MODIFIED"):
                react(obj)
            elif event.get("type") == "DELETED":
                cache.pop((obj.get("metadata") or {}).get("name", ""), None)
            elif event.get("type") == "ERROR":  # 410 Gone: a full re-LIST would follow in a real controller
                raise RuntimeError(f"watch error: {obj}")


CONTROLLERS = {"kopf": controller_kopf, "lightkube": controller_lightkube,
               "lightkube-watch": controller_lightkube_watch, "stdlib": controller_stdlib}


# The bench ---------------------------------------------------------------------------------------------------------


def bench_venv() -> Path:
    """A virtual environment with kopf and lightkube, under the project's cache directory (made once)."""
    sys.path.insert(0, str(REPO))
    from scripts.gobuild import cache_root

    venv = cache_root() / f"bench-venv-kopf{KOPF_VERSION}-lightkube{LIGHTKUBE_VERSION}"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"kopf=={KOPF_VERSION}",
                        f"lightkube=={LIGHTKUBE_VERSION}"], check=True)
    return python


class _NodeWatch:
    """Events of one node after its current version (nothing replayed): a watch by field selector, opened here,
    before the caller changes the node, so no event of the change can be missed."""

    def __init__(self, fleet: Any, node: str) -> None:
        import http.client
        import ssl

        peer = fleet.peer
        # The list's version, not the node's: a node last written minutes ago has a version the watch cache may
        # have dropped already (410 Gone).
        rv = fleet.list_nodes(f"fieldSelector=metadata.name%3D{node}")["metadata"]["resourceVersion"]
        host, port = peer.url.removeprefix("https://").rsplit(":", 1)
        self._conn = http.client.HTTPSConnection(host, int(port), timeout=60,
                                                 context=ssl.create_default_context(cafile=str(peer.ca_file)))
        self._conn.request("GET", f"/api/v1/nodes?watch=1&fieldSelector=metadata.name%3D{node}&resourceVersion={rv}",
                           headers={"Authorization": f"Bearer {peer.admin_token}", "User-Agent": "bench-observer"})
        self._resp = self._conn.getresponse()
        if self._resp.status != 200:
            raise RuntimeError(f"watch {node}: HTTP {self._resp.status}")

    def wait_taint(self, present: bool, timeout: float) -> float | None:
        """monotonic() when the node's taint is ``present`` (or gone), None after ``timeout``."""
        result: list[float] = []

        def run() -> None:
            try:
                for line in iter(self._resp.readline, b""):
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        print(f"observer: watch error: {event.get('object')}", file=sys.stderr, flush=True)
                        return
                    if _has_taint(event.get("object") or {}) == present:
                        result.append(time.monotonic())
                        return
            except (OSError, ValueError):  # closed below after a timeout
                pass

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout)
        self._conn.close()
        return result[0] if result else None


def _has_taint(obj: dict[str, Any]) -> bool:
    return any(t.get("key") == TAINT_KEY for t in (obj.get("spec") or {}).get("taints") or [])


def measure_latency(fleet: Any, changes: int, seed: int = 1) -> dict[str, Any]:
    from bench._common import summary_ms

    rng = random.Random(seed)
    names = fleet.node_names
    taint_s: list[float] = []
    release_s: list[float] = []
    timeouts = 0
    for i in range(changes):
        node = names[(i * 7919) % len(names)]  # spread over the fleet
        index = rng.randrange(8)
        watch = _NodeWatch(fleet, node)
        sent = fleet.set_device_state(node, index, "Unhealthy", "reboot-node", "xid-79", "fatal XID 79")
        seen = watch.wait_taint(True, 30.0)
        if seen is None:
            timeouts += 1
        else:
            taint_s.append(seen - sent)
        watch = _NodeWatch(fleet, node)
        sent = fleet.set_device_state(node, index, "Healthy")
        gone = watch.wait_taint(False, 30.0)
        if gone is not None:
            release_s.append(gone - sent)
        time.sleep(rng.uniform(0.1, 0.4))  # no lock-step with anything periodic
    return {"taint": summary_ms(taint_s), "untaint": summary_ms(release_s), "timeouts": timeouts}


def _requests_by_verb(fleet: Any, user: str, since: float, until: float | None = None) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in fleet.requests(since, until):
        if r.user == user:
            key = f"{r.verb} {r.resource}{'/' + r.subresource if r.subresource else ''}"
            if r.code is not None and not 200 <= r.code < 300:
                key += f" ({r.code})"
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def _quiet(fleet: Any, user: str, quiet_s: float, timeout: float) -> float:
    """Seconds until ``user`` made no request for ``quiet_s`` (its open watches aside), at most ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        now = time.time()
        recent = [r for r in fleet.requests(now - quiet_s) if r.user == user and r.verb != "watch"]
        if not recent and time.monotonic() - start >= quiet_s:
            return time.monotonic() - start - quiet_s
        time.sleep(1.0)
    return timeout


def run_one(fleet: Any, lib: str, python: Path, args: argparse.Namespace) -> dict[str, Any]:
    from bench._common import cpu_seconds, rss_mib

    kubeconfig = fleet.kubeconfig_for(f"bench-{lib}")
    user = fleet.user_of(f"bench-{lib}")
    log = open(args.workdir / f"controller-{lib}.log", "w+b")  # noqa: SIM115 - closed below
    started_wall, started = time.time(), time.monotonic()
    proc = subprocess.Popen([str(python), str(HERE), "--controller", lib, "--kubeconfig", str(kubeconfig),
                             "--expect", str(fleet.n_nodes)], stdout=subprocess.PIPE, stderr=log,
                            cwd=REPO, start_new_session=True)
    stdout = proc.stdout
    assert stdout is not None
    out: dict[str, Any] = {"lib": lib}
    try:
        synced = None
        for raw in iter(stdout.readline, b""):
            if raw.startswith(b"SYNCED"):
                synced = time.monotonic() - started
                break
        if synced is None:
            raise RuntimeError(f"{lib} exited ({proc.wait()}) before it synced; log: {log.name}")
        # Keep reading, so a controller that prints never blocks on a full pipe.
        said: list[bytes] = []
        threading.Thread(target=lambda: said.extend(iter(stdout.readline, b"")), daemon=True).start()
        out["sync_s"] = round(synced, 2)
        out["settle_s"] = round(synced + _quiet(fleet, user, 10.0, args.settle_timeout), 1)
        out["startup_requests"] = _requests_by_verb(fleet, user, started_wall)
        idle_wall, cpu0 = time.time(), cpu_seconds(proc.pid)
        load0 = os.getloadavg()[0]
        time.sleep(args.idle)
        out["idle_cpu_pct"] = round(100 * (cpu_seconds(proc.pid) - cpu0) / args.idle, 2)
        out["idle_rss_mib"] = round(rss_mib(proc.pid), 1)
        out["peak_rss_mib"] = round(_hwm_mib(proc.pid), 1)
        idle_requests = _requests_by_verb(fleet, user, idle_wall)
        out["idle_requests_per_min"] = round(sum(idle_requests.values()) * 60 / args.idle, 1)
        out["idle_requests"] = idle_requests
        out["loadavg_idle"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
        lat_wall = time.time()
        out["latency"] = measure_latency(fleet, args.changes)
        out["latency_requests"] = _requests_by_verb(fleet, user, lat_wall)
        out["patch_failures_reported"] = sum(1 for line in said if line.startswith(b"PATCH-FAILED"))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    return out


def _hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def table(results: Sequence[dict[str, Any]]) -> str:
    rows = ["| library | sync s | settle s | start-up writes (refused) | RSS idle MiB | peak RSS MiB | CPU idle % | "
            "idle req/min | taint p50 ms | taint p99 ms | timeouts | writes per change |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        def writes(requests: dict[str, int], refused: bool = False) -> int:
            return sum(v for k, v in requests.items()
                       if k.split()[0] in ("create", "patch", "update") and (not refused or k.endswith(")")))
        lat = r["latency"]["taint"]
        per_change = writes(r["latency_requests"]) / max(1, 2 * (lat["n"] + r["latency"]["timeouts"]))
        rows.append(f"| {r['lib']} | {r['sync_s']} | {r['settle_s']} | {writes(r['startup_requests'])} "
                    f"({writes(r['startup_requests'], True)}) | {r['idle_rss_mib']} | {r['peak_rss_mib']} | "
                    f"{r['idle_cpu_pct']} | {r['idle_requests_per_min']} | {lat['p50_ms']} | {lat['p99_ms']} | "
                    f"{r['latency']['timeouts']} | {per_change:.1f} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--controller", choices=sorted(CONTROLLERS), help=argparse.SUPPRESS)
    ap.add_argument("--kubeconfig", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--expect", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--libs", default=",".join(LIBS), help="comma list of: " + ", ".join(LIBS))
    ap.add_argument("--changes", type=int, default=50, help="annotation changes timed per library")
    ap.add_argument("--idle", type=float, default=60.0, help="seconds of idle measurement per library")
    ap.add_argument("--settle-timeout", type=float, default=900.0,
                    help="most seconds to wait for a controller's start-up requests to stop")
    ap.add_argument("--workdir", type=Path, help="where the fleet and the controllers' logs go (default: a new "
                    "temporary dir)")
    ap.add_argument("--output", type=Path, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    if args.controller:
        CONTROLLERS[args.controller](args.kubeconfig, args.expect)
        return 0
    libs = [x for x in args.libs.split(",") if x]
    bad = [x for x in libs if x not in LIBS]
    if bad or not libs:
        ap.error(f"--libs: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(LIBS)}")
    if args.nodes < 1 or args.changes < 1 or args.idle <= 0:
        ap.error("--nodes and --changes: at least 1; --idle: above 0")

    sys.path.insert(0, str(REPO))
    from bench._common import machine
    from bench._fleet import Fleet

    venv_python = bench_venv() if set(libs) - {"stdlib"} else Path(sys.executable)
    pythons = {"kopf": venv_python, "lightkube": venv_python, "lightkube-watch": venv_python,
               "stdlib": Path(sys.executable)}
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-health-controller-libs-"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = []
    with Fleet(args.nodes, args.workdir / "fleet") as fleet:
        fleet_idle = fleet.measure_idle(args.idle)
        print(f"fleet idle (no controller): {json.dumps(fleet_idle)}", file=sys.stderr, flush=True)
        for lib in sorted(libs, key=LIBS.index):
            print(f"{lib}: starting", file=sys.stderr, flush=True)
            result = run_one(fleet, lib, pythons[lib], args)
            print(f"{lib}: {json.dumps(result)}", file=sys.stderr, flush=True)
            results.append(result)
        doc = {"machine": machine(), "nodes": args.nodes, "changes": args.changes, "idle_s": args.idle,
               "fleet_timings_s": fleet.timings, "fleet_idle": fleet_idle,
               "versions": {"kopf": KOPF_VERSION, "lightkube": LIGHTKUBE_VERSION}, "results": results}
    print(table(results))
    print(json.dumps(doc, indent=2))
    if args.output:
        args.output.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
