#!/usr/bin/env python3
"""Observability benchmarks (issue 8): what /metrics costs, and what having it on costs an idle plugin.

    python bench/bench_metrics.py                      # prints JSON
    python bench/bench_metrics.py --scrapes 1000 --idle 30

Measures, in one run:
- scrape latency of /metrics over HTTP (one keep-alive connection, as Prometheus scrapes) with 8 simulated GPUs,
  p50/p99, next to /healthz on the same server (the HTTP floor) and the collectors with the text encoder alone in
  process (``encode_text``), with the ratios scrape/healthz and scrape/collector from the same run; the body size;
- the plugin as its own process (8 simulated GPUs, default 5 s poll, registered with a kubelet stand-in), once with
  metrics on and once with ``--metrics-address off``: CPU used over ``--idle`` seconds of idling, as % of one core,
  and RSS after start; then with metrics on again while scraped every second (a busy Prometheus; 15-30 s is usual).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import cpu_seconds, machine, rss_mib, simulated_plugin, summary_ms  # noqa: E402
from plugin.devices.simulated import SimulatedBackend  # noqa: E402
from plugin.health.config import HealthConfig  # noqa: E402
from plugin.health.monitor import Monitor  # noqa: E402
from plugin.health.node_state import NodeState  # noqa: E402
from plugin.kubelet.allocation import AllocationConfig  # noqa: E402
from plugin.kubelet.resources import WholeGpus  # noqa: E402
from plugin.kubelet.supervisor import Supervisor  # noqa: E402
from plugin.outlets.metrics import MetricsServer, Probes, Sources, build_registry  # noqa: E402
from plugin.serve.exposition import encode_text  # noqa: E402
from tests.conftest import NodeFile  # noqa: E402


def timed_gets(conn: http.client.HTTPConnection, path: str, n: int) -> tuple[list[float], int]:
    out = []
    size = 0
    for _ in range(n):
        t0 = time.perf_counter()
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        out.append(time.perf_counter() - t0)
        size = len(body)
    return out, size


def scrape_cost(n: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="ghdp-bench-") as tmp:
        root = Path(tmp)
        node = NodeFile(root / "node.json")
        backend = SimulatedBackend(node.path)
        state = NodeState()
        stop = threading.Event()
        monitor = Monitor(backend, state, HealthConfig(), 5.0, stop)
        monitor.poll_once()
        # Some history to count: a fault and a recovery on two GPUs, and XIDs, so every family has series.
        node.set(2, row_remap_failure=True)
        node.set(5, temperature_c=89)
        backend.reload()
        monitor.poll_once()
        sup = Supervisor(root / "dp", [WholeGpus()], state, AllocationConfig(dev_root=root), stop)
        sup.record.registered = True
        registry = build_registry(Sources(state, monitor, supervisor=sup))  # simulated: no NVML counters
        monitor.last_event_loop_at = monitor.last_poll_at
        server = MetricsServer("127.0.0.1:0", registry, Probes(monitor, sup, 60.0))
        server.start()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            timed_gets(conn, "/metrics", 50)  # warm-up
            scrapes: list[float] = []
            probes: list[float] = []
            inproc: list[float] = []
            size = 0
            for _ in range(max(1, n // 50)):
                # Interleaved in rounds so drift on a shared machine hits all three alike.
                s, size = timed_gets(conn, "/metrics", 50)
                scrapes += s
                probes += timed_gets(conn, "/healthz", 50)[0]
                for _ in range(50):
                    t0 = time.perf_counter()
                    encode_text(registry)
                    inproc.append(time.perf_counter() - t0)
        finally:
            conn.close()
            server.stop()
            backend.close()
        sm, sp, si = summary_ms(scrapes), summary_ms(probes), summary_ms(inproc)
        return {"gpus": 8, "metrics_http": sm, "healthz_http": sp, "collector_in_process": si,
                "body_bytes": size,
                "p50_ratio_metrics_to_healthz": round(sm["p50_ms"] / sp["p50_ms"], 2),
                "p50_ratio_metrics_to_collector": round(sm["p50_ms"] / si["p50_ms"], 2)}


def idle_run(metrics: bool, idle_s: float, scrape_every_s: float | None) -> dict[str, object]:
    with simulated_plugin(REPO, metrics) as (proc, port):
        time.sleep(2.0)  # start-up work (imports, first polls) is not idle time
        rss = rss_mib(proc.pid)
        c0, t0 = cpu_seconds(proc.pid), time.monotonic()
        scrapes = 0
        if scrape_every_s:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            while time.monotonic() - t0 < idle_s:
                conn.request("GET", "/metrics")
                conn.getresponse().read()
                scrapes += 1
                time.sleep(scrape_every_s)
            conn.close()
        else:
            time.sleep(idle_s)
        cpu = cpu_seconds(proc.pid) - c0
        wall = time.monotonic() - t0
    return {"metrics": metrics, "scrapes": scrapes, "seconds": round(wall, 1),
            "cpu_pct_of_one_core": round(100 * cpu / wall, 3), "rss_after_start_mib": round(rss, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scrapes", type=int, default=1000, help="scrapes to time (in rounds of 50)")
    ap.add_argument("--idle", type=float, default=30.0, help="seconds of idling to measure CPU over, per run")
    args = ap.parse_args()
    out: dict[str, object] = {"machine": machine(),
                              "command": "python bench/bench_metrics.py " + " ".join(sys.argv[1:])}
    out["scrape"] = scrape_cost(args.scrapes)
    on = idle_run(True, args.idle, None)
    off = idle_run(False, args.idle, None)
    busy = idle_run(True, args.idle, 1.0)
    out["idle"] = {"metrics_on": on, "metrics_off": off, "metrics_on_scraped_every_1s": busy,
                   "rss_delta_mib": round(float(on["rss_after_start_mib"]) - float(off["rss_after_start_mib"]), 1)}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
