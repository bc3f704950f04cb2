#!/usr/bin/env python3
"""Writes to the Node by the cluster reporter in three scenarios (issue 5), and what cluster reporting costs at
import.

The real reporter (plugin/outlets/reporter.py, its real API client plugin/kube/client.py, real HTTP) writes to
the loopback fake API server of tests/fakes/fake_apiserver.py; time is a virtual clock, so "10 minutes" takes a
few seconds. Each scenario starts after the start-up reconcile and counts node PATCHes (annotations) until the
reporter has settled:

    (a) 10 minutes steady state, the real health engine (plugin/health/monitor.py over the simulated backend)
        polling every --poll-interval seconds (default 0.3; one resync read falls inside): target 0 writes
    (b) 20 transitions within 1 s, on 8 devices: target 1 write
    (c) one device flapping Healthy <-> Unhealthy at 10 Hz for 60 s: target at most 7 writes

    python bench/bench_annotations.py            # all, default settings (debounce 1 s, 1 write / 10 s)
    python bench/bench_annotations.py --no-import-cost
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from plugin.devices.simulated import SimulatedBackend  # noqa: E402
from plugin.health.config import HealthConfig  # noqa: E402
from plugin.health.monitor import Monitor  # noqa: E402
from plugin.health.node_state import NodeState  # noqa: E402
from plugin.health.reasons import State  # noqa: E402
from plugin.kube.client import KubeClient  # noqa: E402
from plugin.outlets.reporter import KubeReporter, ReporterSettings  # noqa: E402
from tests.fakes.fake_apiserver import FakeApiServer  # noqa: E402
from tests.fakes.node_devices import Node  # noqa: E402

NODE = "bench-node"
T0 = 1_767_225_600.0


class Run:
    def __init__(self, api: FakeApiServer, kubeconfig: Path) -> None:
        api.nodes.clear()
        api.add_node(NODE, {"example.com/owner": "ops"})
        self.api = api
        self.now = 0.0
        self.state = NodeState()
        self.node = Node(self.state, n=8)
        self.rep = KubeReporter(self.state, ReporterSettings(node_name=NODE, events=False),
                                lambda: KubeClient(kubeconfig), clock=lambda: self.now,
                                wall=lambda: T0 + self.now, rng=random.Random(1))

    def drive(self, actions: list[tuple[float, Callable[[], None]]], until: float,
              poll: Callable[[], None] | None = None, poll_interval: float = 0.0) -> None:
        """Call tick at every state change and every deadline, as the reporter's thread would; with ``poll``,
        also run a health poll every ``poll_interval`` seconds, as the poller thread would."""
        actions = sorted(actions, key=lambda a: a[0])
        i = 0
        next_poll = self.now + poll_interval if poll is not None else float("inf")
        deadline = self.rep.tick(self.now)
        while True:
            nxt = min(actions[i][0] if i < len(actions) else float("inf"), deadline, until, next_poll)
            self.now = max(self.now, nxt)
            while i < len(actions) and actions[i][0] <= self.now:
                actions[i][1]()
                i += 1
            if poll is not None and self.now >= next_poll:
                poll()
                next_poll = self.now + poll_interval
            deadline = self.rep.tick(self.now)
            if self.now >= until and i >= len(actions):
                return

    def patches(self) -> int:
        return self.api.count("PATCH", "/nodes/")


def steady(api: FakeApiServer, kubeconfig: Path, poll_interval: float) -> dict[str, object]:
    """Scenario (a): nothing changes on a node whose health engine keeps polling. Every poll publishes what it
    computed; the reporter must find nothing new to write."""
    r = Run(api, kubeconfig)
    backend = SimulatedBackend(clock=lambda: T0 + r.now)  # the built-in 8-GPU node, all healthy
    monitor = Monitor(backend, r.state, HealthConfig(), poll_interval, threading.Event(), clock=lambda: T0 + r.now)
    polls = 0

    def poll() -> None:
        nonlocal polls
        polls += 1
        monitor.poll_once()

    poll()
    r.drive([], 20.0, poll, poll_interval)  # the start-up reconcile, and a full token bucket again
    base_patches, base_gets, base_version = r.patches(), api.count("GET"), r.state.snapshot().version
    start, polls = r.now, 0
    wall = time.perf_counter()
    r.drive([], start + 601.0, poll, poll_interval)
    return {"scenario": "a-steady-10min", "transitions": 0, "polls": polls,
            "snapshot_versions": r.state.snapshot().version - base_version,
            "node_writes": r.patches() - base_patches, "node_reads": api.count("GET") - base_gets,
            "virtual_s": round(r.now - start, 1), "wall_ms": round((time.perf_counter() - wall) * 1000, 1),
            "final_matches": r.rep.status().pending is False}


def scenario(api: FakeApiServer, kubeconfig: Path, name: str) -> dict[str, object]:
    """Scenarios (b) and (c): transitions published straight into the node state at the given times, to measure
    the reporter's own pacing (the health engine would add its hysteresis and flap damping on top)."""
    r = Run(api, kubeconfig)
    r.node.publish(T0)
    r.drive([], 20.0)  # the start-up reconcile, and a full token bucket again
    base_patches, base_gets = r.patches(), api.count("GET")
    start = r.now
    wall = time.perf_counter()
    transitions = 0

    def setter(index: int, state: State, *codes: str) -> Callable[[], None]:
        def go() -> None:
            nonlocal transitions
            transitions += 1
            r.node.set(index, state, *codes, now=T0 + r.now)
        return go

    if name == "b-20-transitions-in-1s":
        acts = [(start + i * 0.05, setter(i % 8, State.UNHEALTHY if (i // 8) % 2 == 0 else State.HEALTHY,
                                          *(("xid-79",) if (i // 8) % 2 == 0 else ())))
                for i in range(20)]
        r.drive(acts, start + 60.0)
    elif name == "c-flap-10hz-60s":
        acts = [(start + i * 0.1, setter(3, State.UNHEALTHY if i % 2 == 0 else State.HEALTHY,
                                         *(("xid-79",) if i % 2 == 0 else ())))
                for i in range(600)]
        r.drive(acts, start + 60.0 + 30.0)  # 60 s of flapping, then until the last write is out
    return {"scenario": name, "transitions": transitions, "node_writes": r.patches() - base_patches,
            "node_reads": api.count("GET") - base_gets, "virtual_s": round(r.now - start, 1),
            "wall_ms": round((time.perf_counter() - wall) * 1000, 1),
            "final_matches": r.rep.status().pending is False}


def import_cost(runs: int) -> dict[str, object]:
    """RSS and start-up time of a fresh interpreter importing the plugin, with and without what cluster reporting
    loads (the reporter, its pure parts and the API client; the App imports them only when reporting is on)."""
    base = "import plugin.app"
    with_lk = base + "; import plugin.outlets.reporter, plugin.kube.client"
    probe = "; import resource, sys; sys.stdout.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))"
    out: dict[str, object] = {}
    for label, code in (("without", base), ("with_reporting", with_lk)):
        rss, secs = [], []
        for _ in range(runs):
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", code + probe], capture_output=True, text=True, cwd=REPO,
                                  check=True)
            secs.append(time.perf_counter() - t)
            rss.append(int(proc.stdout) / 1024)
        out[label] = {"rss_mib_median": round(statistics.median(rss), 1),
                      "startup_ms_median": round(statistics.median(secs) * 1000, 1)}
    w, wo = out["with_reporting"], out["without"]
    assert isinstance(w, dict) and isinstance(wo, dict)
    out["delta"] = {"rss_mib": round(w["rss_mib_median"] - wo["rss_mib_median"], 1),
                    "startup_ms": round(w["startup_ms_median"] - wo["startup_ms_median"], 1)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-import-cost", action="store_true")
    ap.add_argument("--import-runs", type=int, default=7)
    ap.add_argument("--poll-interval", type=float, default=0.3, help="health poll interval of scenario (a)")
    args = ap.parse_args()
    api = FakeApiServer().start()
    results: dict[str, object] = {}
    try:
        with tempfile.TemporaryDirectory() as d:
            kubeconfig = api.kubeconfig(Path(d))
            scenarios = [steady(api, kubeconfig, args.poll_interval)]
            scenarios += [scenario(api, kubeconfig, n) for n in ("b-20-transitions-in-1s", "c-flap-10hz-60s")]
    finally:
        api.stop()
    targets = {"a-steady-10min": 0, "b-20-transitions-in-1s": 1, "c-flap-10hz-60s": 7}
    for s in scenarios:
        s["target_max"] = targets[str(s["scenario"])]
        s["pass"] = int(str(s["node_writes"])) <= targets[str(s["scenario"])]
    results["scenarios"] = scenarios
    if not args.no_import_cost:
        results["import_cost"] = import_cost(args.import_runs)
    print(json.dumps(results, indent=2))
    return 0 if all(s["pass"] for s in scenarios) else 1


if __name__ == "__main__":
    sys.exit(main())
