#!/usr/bin/env python3
"""Footprint and soak of the plugin process with every feature on.

    python bench/soak.py --minutes 5 --idle          # footprint: idle RSS and CPU over 5 minutes
    python bench/soak.py --minutes 30                # soak: faults, recoveries, kubelet restarts, streams, scrapes

The plugin runs as its own process on 8 simulated GPUs with everything on: metrics and probes, cluster reporting
(annotations, Events, the node condition) against the loopback fake API server, pod correlation against a
PodResources stand-in, CDI. The kubelet stand-in, the fakes and the load run in this process. Every 10 s it samples
the plugin's RSS, CPU, file descriptors and threads; it reports the first and last samples (after a warm-up), the
peak, and the least-squares slope of RSS per hour, so growth shows as a number rather than a feeling.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc  # noqa: E402
from bench._common import compiled_env, cpu_seconds, fd_count, machine, rss_mib, thread_count  # noqa: E402
from plugin.devtools.standin import KubeletStandin  # noqa: E402
from tests.conftest import NodeFile  # noqa: E402
from tests.fakes.fake_apiserver import FakeApiServer  # noqa: E402
from tests.fakes.podresources import PodResourcesServer  # noqa: E402

NODE = "soak-node"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slope_per_hour(samples: list[tuple[float, float]]) -> float:
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 0.0 if var == 0 else sum((t - mt) * (v - mv) for t, v in samples) / var * 3600


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--idle", action="store_true", help="no activity: the footprint of an idle node")
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds before the first counted sample")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    out: dict[str, Any] = {"machine": machine(), "command": "python bench/soak.py " + " ".join(sys.argv[1:]),
                           "mode": "idle" if args.idle else "soak", "minutes": args.minutes}
    with tempfile.TemporaryDirectory(prefix="ghdp-soak-") as tmp:
        root = Path(tmp)
        (root / "dev").mkdir()
        node = NodeFile(root / "node.json")
        api = FakeApiServer().start()
        api.add_node(NODE)
        kubeconfig = api.kubeconfig(root)
        pods = PodResourcesServer(root / "pod-resources.sock")
        for i, uuid in enumerate(node.uuids):
            pods.assign("jobs", f"train-{i}", "main", "nvidia.com/gpu", uuid)
        pods.start()
        kubelet = KubeletStandin(root / "dp")
        kubelet.start()
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "plugin", "run", "--backend", "simulated", "--simulated-node", str(node.path),
             "--device-plugin-dir", str(root / "dp"), "--state-dir", str(root / "state"), "--dev-root", str(root),
             "--node-name", NODE, "--kubeconfig", str(kubeconfig), "--node-condition", "true", "--cdi", "true",
             "--pod-resources-socket", str(root / "pod-resources.sock"), "--correlate-on", "Unhealthy",
             "--metrics-address", f"127.0.0.1:{port}", "--log-level", "warning"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=compiled_env(REPO))
        samples: list[dict[str, float]] = []
        counts = {"faults": 0, "recoveries": 0, "kubelet_restarts": 0, "streams": 0, "scrapes": 0}
        try:
            assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8), 30), "plugin did not register"
            t_start = time.monotonic()
            cpu0 = None
            next_sample = t_start + args.warmup
            end = t_start + args.warmup + args.minutes * 60
            faulted: set[int] = set()
            while time.monotonic() < end:
                now = time.monotonic()
                if now >= next_sample:
                    cpu = cpu_seconds(proc.pid)
                    if cpu0 is None:
                        cpu0, t_cpu0 = cpu, now
                    samples.append({"t": now - t_start, "rss_mib": rss_mib(proc.pid), "fds": fd_count(proc.pid),
                                    "threads": thread_count(proc.pid), "cpu_s": cpu})
                    next_sample += 10.0
                if not args.idle:
                    action = rng.random()
                    if action < 0.5:
                        g = rng.randrange(8)
                        if g in faulted:
                            node.clear(g)
                            faulted.discard(g)
                            counts["recoveries"] += 1
                        else:
                            node.set(g, **rng.choice([{"nvlink_down": [0]}, {"temperature_c": 90},
                                                      {"row_remap_pending": True}, {"ecc_uncorrected_volatile": 1}]))
                            faulted.add(g)
                            counts["faults"] += 1
                    elif action < 0.55:
                        kubelet.restart()
                        counts["kubelet_restarts"] += 1
                        kubelet.wait_for(lambda: kubelet.view() is not None and kubelet.view().connected, 10)  # type: ignore
                    elif action < 0.8 and kubelet.registrations:
                        ep = root / "dp" / kubelet.registrations[-1][2]
                        with grpc.insecure_channel(f"unix://{ep}") as ch:
                            s = api_pb2_grpc.DevicePluginStub(ch).ListAndWatch(api_pb2.Empty())
                            next(s)
                            s.cancel()
                        counts["streams"] += 1
                    else:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                            r.read()
                        counts["scrapes"] += 1
                time.sleep(2.0 if not args.idle else 1.0)  # pacing the scripted load, not awaiting a result
            cpu1, t_cpu1 = cpu_seconds(proc.pid), time.monotonic()
        finally:
            proc.terminate()
            rc = proc.wait(15)
            kubelet.stop()
            pods.stop()
            api.stop()
    first, last = samples[0], samples[-1]
    out.update({
        "activity": counts,
        "exit_code": rc,
        "rss_mib": {"first": round(first["rss_mib"], 1), "last": round(last["rss_mib"], 1),
                    "peak": round(max(s["rss_mib"] for s in samples), 1),
                    "slope_mib_per_hour": round(slope_per_hour([(s["t"], s["rss_mib"]) for s in samples]), 2)},
        "fds": {"first": first["fds"], "last": last["fds"], "peak": max(s["fds"] for s in samples)},
        "threads": {"first": first["threads"], "last": last["threads"], "peak": max(s["threads"] for s in samples)},
        "cpu_percent_of_core": round(100 * (cpu1 - (cpu0 or 0)) / max(1e-9, t_cpu1 - t_cpu0), 3),
        "api_writes": api.count("PATCH", r"^/api/v1/nodes/"),
        "samples": len(samples),
    })
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
