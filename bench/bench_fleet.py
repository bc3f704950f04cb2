#!/usr/bin/env python3
"""The fleet controller at 50 and at 5,000 GPU Nodes on a real kube-apiserver (issue 15), with kwok keeping the
Nodes' heartbeats like kubelets (bench/_fleet.py).

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

    python bench/bench_fleet.py                       # 50 and 5,000 nodes
    python bench/bench_fleet.py --nodes 50 --changes 20 --idle 30
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import compiled_env, cpu_seconds, machine, pct, rss_mib  # noqa: E402
from bench._fleet import NAMESPACE, Fleet  # noqa: E402
from plugin.outlets.kubeapi import ApiFailure, KubeClient  # noqa: E402

TAINT = "gpu-health.io/quarantine"
LEASE = "gpu-health-controller"


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_controller(fleet: Fleet, workdir: Path, kubeconfig: Path, port: int) -> subprocess.Popen[bytes]:
    config = {"version": "v1", "kubeconfig": str(kubeconfig), "namespace": NAMESPACE, "identity": "bench",
              "metricsAddress": f"127.0.0.1:{port}", "release": {"recoveryHold": "0s"},
              "breaker": {"maxQuarantinedFraction": 0.1}}
    path = workdir / "controller.yaml"
    path.write_text(json.dumps(config))
    log = open(workdir / "controller.log", "wb")  # noqa: SIM115 (kept open for the process's life)
    return subprocess.Popen([sys.executable, "-m", "plugin.controller.main", "--config", str(path)], cwd=REPO,
                            env=compiled_env(REPO), stdout=log, stderr=subprocess.STDOUT)


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


def _patches(fleet: Fleet, node: str, since: float) -> list[Any]:
    return [r for r in fleet.requests(since=since) if r.verb == "patch" and r.resource == "nodes" and r.name == node
            and not r.subresource]


def _wait_patch(fleet: Fleet, node: str, user: str, since: float, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        mine = [r for r in _patches(fleet, node, since) if r.user == user]
        if mine:
            return mine[0]
        time.sleep(0.02)  # the audit log is another process's file: nothing to wait on but the next look
    raise TimeoutError(f"{node}: no patch by {user} within {timeout_s:.0f}s")


def latency(fleet: Fleet, changes: int, rng: random.Random) -> tuple[list[float], list[float]]:
    """Annotation change -> taint, on the API server's clock: from the audit entry of the plugin-like PATCH of the
    annotations to that of the controller's quarantine PATCH of the same node (no client in between). Also, apart,
    the part after the server had answered the annotation PATCH (what the watch and the controller take)."""
    controller = fleet.user_of("controller")
    out, after = [], []
    names = fleet.node_names
    for _ in range(changes):
        name = rng.choice(names)
        since = time.time() - 1.0
        fleet.set_device_state(name, 2, "Unhealthy", "reset-gpu", "ecc-uncorrected")
        taint = _wait_patch(fleet, name, controller, since)
        change = next(r for r in _patches(fleet, name, since) if r.user != controller)
        out.append(taint.time - change.time)
        after.append(taint.time - change.completed)
        since = taint.time
        fleet.set_device_state(name, 2, "Healthy")
        _wait_patch(fleet, name, controller, since + 1e-6)  # the release (recovery hold 0 here)
    return out, after


def correlated(fleet: Fleet, client: KubeClient, share: float, rng: random.Random) -> dict[str, Any]:
    failing = rng.sample(fleet.node_names, round(share * len(fleet.node_names)))
    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda n: fleet.set_device_state(n, 5, "Unhealthy", "reset-gpu", "ecc-uncorrected"), failing))
    sent_s = time.monotonic() - t0
    limit = int(0.1 * len(fleet.node_names))
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
    breaker = breaker_of(client)
    return {"failing": len(failing), "limit": limit, "quarantined": count_tainted(client),
            "max_seen": max(counts) if counts else 0, "patches_sent_s": round(sent_s, 2),
            "limit_reached_s": round(reached, 2) if reached is not None else None, "breaker": breaker.get("state"),
            "blocked": breaker.get("blocked")}


def run(n: int, changes: int, idle_s: float, seed: int, lease_duration_s: int) -> dict[str, Any]:
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix=f"bench-fleet-{n}-"))
    with Fleet(n, work / "fleet", lease_duration_s=lease_duration_s) as fleet:
        kubeconfig = fleet.kubeconfig_for("controller")
        port = free_port()
        proc = start_controller(fleet, work, kubeconfig, port)
        try:
            client = KubeClient(fleet.kubeconfig)
            sync_s = wait_synced(client, proc, port)
            lat, after = latency(fleet, changes, rng)
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
            storm = correlated(fleet, client, 0.2, rng)
            rss_after = round(rss_mib(proc.pid), 1)
        finally:
            proc.terminate()
            proc.wait(20)
    return {"nodes": n, "node_lease_duration_s": lease_duration_s, "sync_s": round(sync_s, 1),
            "latency_samples_ms": [round(v * 1000, 1) for v in lat],
            "after_answer_samples_ms": [round(v * 1000, 1) for v in after],
            "after_answer": {"p50_ms": round(statistics.median(after) * 1000, 1),
                             "p99_ms": round(pct(after, 99) * 1000, 1)},
            "latency": {"n": len(lat), "p50_ms": round(statistics.median(lat) * 1000, 1),
                        "p99_ms": round(pct(lat, 99) * 1000, 1), "max_ms": round(max(lat) * 1000, 1)},
            "idle": idle, "fleet_idle": fleet_cpu, "correlated_20pct": storm, "rss_after_storm_mib": rss_after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="50,5000", help="comma-separated fleet sizes (default 50,5000)")
    ap.add_argument("--changes", type=int, default=50, help="timed annotation changes per size (default 50)")
    ap.add_argument("--idle", type=float, default=60.0, help="seconds of the idle window (default 60)")
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--node-lease-duration", type=int, default=40,
                    help="the simulated kubelets' node Lease duration, renewed at a quarter of it (default 40 s, the "
                         "kubelet's: 500 Lease writes/s at 5,000 nodes)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    results = [run(int(n), args.changes, args.idle, args.seed, args.node_lease_duration)
               for n in args.nodes.split(",")]
    print(f"machine: {machine()}")
    for r in results:
        lat, idle, storm = r["latency"], r["idle"], r["correlated_20pct"]
        print(f"{r['nodes']:>5} nodes: sync {r['sync_s']}s; annotation -> taint p50 {lat['p50_ms']} ms, p99 "
              f"{lat['p99_ms']} ms, max {lat['max_ms']} ms ({lat['n']} changes; after the server answered the "
              f"change: p50 {r['after_answer']['p50_ms']} ms, p99 {r['after_answer']['p99_ms']} ms); "
              f"idle {idle['seconds']:.0f}s: CPU "
              f"{idle['cpu_pct']}%, RSS {idle['rss_mib']} MiB, {idle['requests_per_min']} requests/min "
              f"{idle['requests']}, node writes {idle['node_writes']}; 20% failing: {storm['failing']} nodes -> "
              f"{storm['quarantined']} quarantined (limit {storm['limit']}, most seen {storm['max_seen']}, limit "
              f"reached in {storm['limit_reached_s']}s, breaker {storm['breaker']}, blocked {storm['blocked']}); "
              f"RSS after {r['rss_after_storm_mib']} MiB")
    if len(results) >= 2:
        small, big = results[0]["latency"]["p99_ms"], results[-1]["latency"]["p99_ms"]
        print(f"p99 at {results[-1]['nodes']} / p99 at {results[0]['nodes']}: {big / small:.2f}x")
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
