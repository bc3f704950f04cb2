#!/usr/bin/env python3
"""Core device-plugin benchmarks over the real unix socket, the plugin running as its own process.

    python bench/bench_core.py                    # everything, prints JSON
    python bench/bench_core.py --calls 500 --changes 100 --restarts 20

Measures, in one run:
- Allocate and the empty RPC (PreStartContainer: no work at all) latency at 1, 16 and 64 concurrent callers
  (closed loop: each caller issues its next call when the last returns), p50/p99, and Allocate p50 / empty p50;
  and 16 callers paced at 20 calls/s each (open loop, 320 calls/s in all);
- node-file change (atomic rename) to the ListAndWatch update the kubelet stand-in receives, p50/p99;
- re-registration after a kubelet restart: from the new kubelet.sock appearing (the old one and every plugin
  socket wiped first) to the plugin's Register arriving, p50/p99;
- RSS of the plugin process after start on 8 simulated GPUs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc  # noqa: E402
from bench._common import compiled_env, machine, rss_mib, summary_ms  # noqa: E402
from plugin.devtools.standin import KubeletStandin  # noqa: E402
from tests.conftest import NodeFile  # noqa: E402


def start_plugin(root: Path, poll_interval: str = "5") -> subprocess.Popen[bytes]:
    # One clean poll clears a polled fault and flap damping is off, so every file change in the change benchmark
    # flips kubelet health (with defaults the damper would, rightly, hold the toggled GPU Unhealthy).
    (root / "config.yaml").write_text("version: v1\nhealth:\n  clearAfterPolls: 1\n  flap:\n    windowSeconds: 0\n")
    return subprocess.Popen(
        [sys.executable, "-m", "plugin", "run", "--backend", "simulated", "--simulated-node", str(root / "node.json"),
         "--device-plugin-dir", str(root / "dp"), "--state-dir", str(root / "state"), "--dev-root", str(root),
         "--poll-interval", poll_interval, "--log-level", "warning", "--config", str(root / "config.yaml")],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=compiled_env(REPO))


def closed_loop(stub: api_pb2_grpc.DevicePluginStub, make_call: object, callers: int, calls: int) -> list[float]:
    lat: list[float] = []
    lock = threading.Lock()
    per = max(1, calls // callers)
    start = threading.Barrier(callers)

    def worker() -> None:
        mine = []
        start.wait()
        for _ in range(per):
            t0 = time.perf_counter()
            make_call(stub)  # type: ignore[operator]
            mine.append(time.perf_counter() - t0)
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat


def paced(stub: api_pb2_grpc.DevicePluginStub, make_call: object, callers: int, rate_per_caller: float,
          seconds: float) -> list[float]:
    """Open loop: each caller starts a call every 1/rate seconds whether or not the system keeps up."""
    lat: list[float] = []
    lock = threading.Lock()
    start = time.monotonic() + 0.05

    def worker(offset: float) -> None:
        mine = []
        period = 1.0 / rate_per_caller
        k = 0
        while True:
            due = start + offset + k * period
            if due - start > seconds:
                break
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # pacing the load generator, not waiting for a result
            t0 = time.perf_counter()
            make_call(stub)  # type: ignore[operator]
            mine.append(time.perf_counter() - t0)
            k += 1
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=worker, args=(i / (callers * rate_per_caller),)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="calls per RPC and concurrency level")
    ap.add_argument("--changes", type=int, default=200, help="node-file changes to time")
    ap.add_argument("--restarts", type=int, default=30, help="kubelet restarts to time")
    args = ap.parse_args()
    out: dict[str, object] = {"machine": machine(), "command": "python bench/bench_core.py " + " ".join(sys.argv[1:])}
    with tempfile.TemporaryDirectory(prefix="ghdp-bench-") as tmp:
        root = Path(tmp)
        (root / "dev").mkdir()
        for name in [f"nvidia{i}" for i in range(8)] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]:
            (root / "dev" / name).touch()
        node = NodeFile(root / "node.json")
        kubelet = KubeletStandin(root / "dp")
        kubelet.start()
        proc = start_plugin(root)
        try:
            assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8), 30), "plugin did not register"
            time.sleep(1.0)  # let start-up allocations settle before reading RSS
            out["rss_after_start_mib"] = round(rss_mib(proc.pid), 1)
            endpoint = root / "dp" / kubelet.registrations[-1][2]
            uuids = node.uuids
            alloc_req = api_pb2.AllocateRequest(container_requests=[
                api_pb2.ContainerAllocateRequest(devices_ids=uuids[:2])])
            empty_req = api_pb2.PreStartContainerRequest()
            rpc: dict[str, object] = {}
            with grpc.insecure_channel(f"unix://{endpoint}") as ch:
                stub = api_pb2_grpc.DevicePluginStub(ch)
                closed_loop(stub, lambda s: s.PreStartContainer(empty_req), 4, 400)  # warm-up
                for callers in (1, 16, 64):
                    # Interleave the two RPCs' runs so drift on a shared machine hits both alike.
                    empty = closed_loop(stub, lambda s: s.PreStartContainer(empty_req), callers, args.calls)
                    alloc = closed_loop(stub, lambda s: s.Allocate(alloc_req), callers, args.calls)
                    e, a = summary_ms(empty), summary_ms(alloc)
                    rpc[str(callers)] = {"empty": e, "allocate": a,
                                         "allocate_p50_over_empty_p50": round(a["p50_ms"] / e["p50_ms"], 2)}
                # The kubelet admits pods one at a time; a paced load of 16 callers x 20/s is far above that.
                e = summary_ms(paced(stub, lambda s: s.PreStartContainer(empty_req), 16, 20.0, 5.0))
                a = summary_ms(paced(stub, lambda s: s.Allocate(alloc_req), 16, 20.0, 5.0))
                rpc["16_paced_20_per_s_each"] = {"empty": e, "allocate": a,
                                                 "allocate_p50_over_empty_p50": round(a["p50_ms"] / e["p50_ms"], 2)}
            out["rpc_latency"] = rpc

            # Node-file change -> ListAndWatch update seen by the kubelet stand-in.
            view = kubelet.view()
            assert view is not None
            lat = []
            for i in range(args.changes):
                before = view.updates
                t0 = time.perf_counter()
                node.set(3, nvlink_down=[0] if i % 2 == 0 else None)
                assert kubelet.wait_for(lambda b=before: view.updates > b, 10), "no update"  # type: ignore
                lat.append(time.perf_counter() - t0)
            out["node_file_change_to_list_and_watch"] = summary_ms(lat)

            # Kubelet restart -> re-registration.
            lat = []
            for _ in range(args.restarts):
                n = len(kubelet.registrations)
                kubelet.restart()  # returns once the new kubelet.sock exists (renamed into place last)
                t0 = time.monotonic()
                assert kubelet.wait_for(lambda n=n: len(kubelet.registrations) > n, 10), "no re-registration"
                # registrations[][0] is stamped inside Register, before the dial-back: the plugin's part.
                lat.append(max(0.0, kubelet.registrations[-1][0] - t0))
                v = kubelet.view()
                assert v is not None and kubelet.wait_for(lambda v=v: v.updates > 0, 10)  # type: ignore
            out["kubelet_restart_to_registration"] = summary_ms(lat)
            out["registrations_per_restart"] = round((len(kubelet.registrations) - 1) / args.restarts, 2)
            out["rss_after_bench_mib"] = round(rss_mib(proc.pid), 1)
        finally:
            proc.terminate()
            proc.wait(10)
            kubelet.stop()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
