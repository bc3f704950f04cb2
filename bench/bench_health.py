#!/usr/bin/env python3
"""Health-engine benchmarks, in process, through the real NVML backend code over the fake pynvml module.

    python bench/bench_health.py                     # everything, prints JSON
    python bench/bench_health.py --events 200 --idle-seconds 60 --transitions 100000

- event (XID 48 from NVML's event set) to the ListAndWatch message that shows the GPU Unhealthy, and to the health
  stream's transition, p50/p99 (200 events, each GPU reset in between through the recovery-action path);
- polled fault (NVLink down) to ListAndWatch with a 0.5 s poll interval, against the interval + 10 ms budget;
- poll cost: CPU per GPU per poll cycle (fake NVML and simulated backend);
- idle CPU of the real plugin process on 8 simulated GPUs at the default 5 s interval, as % of one core;
- RSS growth of the health engine after 100,000 transitions (after a warm-up).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from api.deviceplugin.v1beta1 import api_pb2  # noqa: E402
from api.gpuhealth.v1alpha1 import health_pb2  # noqa: E402
from bench._common import cpu_seconds, machine, pct, rss_mib, summary_ms  # noqa: E402
from plugin.devices.nvml import NvmlBackend  # noqa: E402
from plugin.devices.simulated import SimulatedBackend  # noqa: E402
from plugin.health.config import HealthConfig  # noqa: E402
from plugin.health.monitor import Monitor  # noqa: E402
from plugin.health.node_state import NodeState  # noqa: E402
from plugin.health.store import StateStore  # noqa: E402
from plugin.kubelet.allocation import AllocationConfig  # noqa: E402
from plugin.kubelet.resources import WholeGpus  # noqa: E402
from plugin.kubelet.server import DevicePluginServicer  # noqa: E402
from plugin.kubelet.supervisor import plugin_options  # noqa: E402
from plugin.outlets.health_api import HealthServicer  # noqa: E402
from tests.fakes.fake_pynvml import eight_gpu_node  # noqa: E402

# Every toggle must show: one clean poll clears, and a zero flap window turns the damper (which would hold them) off.
CFG = HealthConfig(clear_after_polls=1, flap_window_s=0.0)


class Ctx:
    """The part of grpc.ServicerContext the streaming handlers use."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def add_callback(self, cb: Callable[[], None]) -> bool:
        self.callbacks.append(cb)
        return True

    def leave(self) -> None:
        for cb in self.callbacks:
            cb()


class Recorder:
    """Consumes a stream in a thread, stamping each message's arrival."""

    def __init__(self, stream: Iterator[Any]) -> None:
        self.items: list[tuple[float, Any]] = []
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self.thread.start()

    def _run(self, stream: Iterator[Any]) -> None:
        for msg in stream:
            with self.cond:
                self.items.append((time.perf_counter(), msg))
                self.cond.notify_all()

    def wait(self, pred: Callable[[Any], bool], after: int, timeout: float = 10.0) -> tuple[float, int]:
        with self.cond:
            found: list[tuple[float, int]] = []

            def check() -> bool:
                for i in range(after, len(self.items)):
                    if pred(self.items[i][1]):
                        found.append((self.items[i][0], i + 1))
                        return True
                return False

            if not self.cond.wait_for(check, timeout):
                raise TimeoutError("stream did not deliver")
            return found[0]


def law_health(msg: api_pb2.ListAndWatchResponse, uuid: str) -> str:
    return {d.ID: d.health for d in msg.devices}[uuid]


def bench_events(n: int) -> dict[str, Any]:
    nv = eight_gpu_node()
    backend = NvmlBackend(nv)
    state = NodeState()
    stop = threading.Event()
    monitor = Monitor(backend, state, CFG, 3600.0, stop, event_wait_s=0.25)
    monitor.start()
    law_ctx, watch_ctx = Ctx(), Ctx()
    servicer = DevicePluginServicer(state, WholeGpus(), AllocationConfig(), plugin_options())
    law = Recorder(servicer.ListAndWatch(api_pb2.Empty(), law_ctx))  # type: ignore[arg-type]
    watch = Recorder(HealthServicer(state).Watch(health_pb2.WatchRequest(), watch_ctx))  # type: ignore[arg-type]
    law.wait(lambda m: True, 0)
    watch.wait(lambda m: True, 0)
    law_pos, watch_pos = 1, 1
    to_law, to_watch = [], []
    for i in range(n):
        g = i % 8
        uuid = f"GPU-fake-{g}"
        t0 = time.perf_counter()
        nv.inject_event(g, 0x8, 48)  # reset-gpu: the reset below clears it (XID 79 waits for a reboot)
        t_law, law_pos = law.wait(lambda m, u=uuid: law_health(m, u) == "Unhealthy", law_pos)  # type: ignore
        t_w, watch_pos = watch.wait(lambda m, u=uuid: m.transition.id == u and m.transition.to_state == "Unhealthy",
                                    watch_pos)  # type: ignore[misc]
        to_law.append(t_law - t0)
        to_watch.append(t_w - t0)
        # Reset the GPU the way the driver reports it: recovery action set, then back to none.
        nv.gpus[g].recovery = 1
        monitor.poll_once()
        nv.gpus[g].recovery = 0
        monitor.poll_once()
        monitor.poll_once()
        _, law_pos = law.wait(lambda m, u=uuid: law_health(m, u) == "Healthy", law_pos)  # type: ignore[misc]
    law_ctx.leave()
    watch_ctx.leave()
    stop.set()
    monitor.join(2)
    servicer.close()
    return {"event_to_list_and_watch": summary_ms(to_law), "event_to_health_stream": summary_ms(to_watch)}


def bench_polled(n: int, interval: float) -> dict[str, Any]:
    nv = eight_gpu_node()
    backend = NvmlBackend(nv)
    state = NodeState()
    stop = threading.Event()
    monitor = Monitor(backend, state, CFG, interval, stop, event_wait_s=0.25)
    monitor.start()
    ctx = Ctx()
    law = Recorder(DevicePluginServicer(state, WholeGpus(), AllocationConfig(), plugin_options())
                   .ListAndWatch(api_pb2.Empty(), ctx))  # type: ignore[arg-type]
    law.wait(lambda m: True, 0)
    pos = 1
    lat = []
    for i in range(n):
        want = "Unhealthy" if i % 2 == 0 else "Healthy"
        t0 = time.perf_counter()
        nv.gpus[2].nvlinks[0] = (0 if want == "Unhealthy" else 1, nv.gpus[2].nvlinks[0][1])
        t, pos = law.wait(lambda m, w=want: law_health(m, "GPU-fake-2") == w, pos)  # type: ignore[misc]
        lat.append(t - t0)
        time.sleep(0.137 * (i % 3))  # vary the phase against the poll clock (load pacing, not a wait)
    ctx.leave()
    stop.set()
    monitor.join(2)
    budget = interval + 0.010
    return {"poll_interval_s": interval, "polled_fault_to_list_and_watch": summary_ms(lat),
            "within_interval_plus_10ms": sum(1 for v in lat if v <= budget), "n": n}


def bench_poll_cost(cycles: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, backend in (("fake_nvml", NvmlBackend(eight_gpu_node())), ("simulated", SimulatedBackend())):
        monitor = Monitor(backend, NodeState(), HealthConfig(), 5.0, threading.Event())  # type: ignore[arg-type]
        for _ in range(20):
            monitor.poll_once()
        samples = []
        for _ in range(cycles):
            c0 = time.process_time()
            monitor.poll_once()
            samples.append((time.process_time() - c0) / 8)
        out[name] = {"cpu_ms_per_gpu_per_cycle_p50": round(pct(samples, 50) * 1000, 3),
                     "cpu_ms_per_gpu_per_cycle_p99": round(pct(samples, 99) * 1000, 3)}
    return out


def bench_idle(seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ghdp-idle-") as tmp:
        root = Path(tmp)
        from plugin.devtools.standin import KubeletStandin

        kubelet = KubeletStandin(root / "dp")
        kubelet.start()
        proc = subprocess.Popen([sys.executable, "-m", "plugin", "run", "--backend", "simulated",
                                 "--device-plugin-dir", str(root / "dp"), "--state-dir", str(root / "state"),
                                 "--log-level", "warning"], cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8), 30)
            time.sleep(2.0)  # let start-up work finish before the idle window
            c0, t0 = cpu_seconds(proc.pid), time.monotonic()
            time.sleep(seconds)  # the measurement window itself
            c1, t1 = cpu_seconds(proc.pid), time.monotonic()
            rss = rss_mib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(10)
            kubelet.stop()
    return {"idle_seconds": seconds, "idle_cpu_percent_of_core": round(100 * (c1 - c0) / (t1 - t0), 3),
            "rss_mib": round(rss, 1)}


def bench_transitions(total: int) -> dict[str, Any]:
    nv = eight_gpu_node()
    with tempfile.TemporaryDirectory(prefix="ghdp-rss-") as tmp:
        stop = threading.Event()
        state = NodeState()
        monitor = Monitor(NvmlBackend(nv), state, CFG, 3600.0, stop, StateStore(Path(tmp)))
        assert monitor.persister is not None
        monitor.persister.start()

        def run(n: int) -> None:
            hot = False
            start = state.snapshot().seq
            while state.snapshot().seq - start < n:
                hot = not hot
                for g in nv.gpus:
                    g.temperature = 90 if hot else 40
                monitor.poll_once()

        run(5000)  # warm-up: histories fill to their bounds
        before = rss_mib()
        t0 = time.perf_counter()
        run(total)
        took = time.perf_counter() - t0
        after = rss_mib()
        stop.set()
        monitor.persister.join(2)
    return {"transitions": total, "rss_before_mib": round(before, 2), "rss_after_mib": round(after, 2),
            "rss_growth_mib": round(after - before, 2), "transitions_per_s": round(total / took)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--polled", type=int, default=20)
    ap.add_argument("--poll-cycles", type=int, default=500)
    ap.add_argument("--idle-seconds", type=float, default=60.0)
    ap.add_argument("--transitions", type=int, default=100_000)
    args = ap.parse_args()
    out: dict[str, Any] = {"machine": machine(), "command": "python bench/bench_health.py " + " ".join(sys.argv[1:])}
    out.update(bench_events(args.events))
    out.update(bench_polled(args.polled, 0.5))
    out["poll_cost"] = bench_poll_cost(args.poll_cycles)
    out["idle"] = bench_idle(args.idle_seconds)
    out["rss_after_transitions"] = bench_transitions(args.transitions)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
