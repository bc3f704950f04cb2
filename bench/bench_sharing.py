#!/usr/bin/env python3
"""Sharing and topology benchmarks (issue 7), in one process, the servers on real unix sockets.

    python bench/bench_sharing.py                  # prints JSON
    python bench/bench_sharing.py --changes 300 --calls 2000 --preferred-calls 300

Measures, in one run:
- ListAndWatch with 8 GPUs x 128 replicas (1,024 devices): for each health change of one GPU published to the node
  state, (a) the snapshot work in process: the resource's view plus the ListAndWatchResponse built and serialised,
  and (b) publish to the full 1,024-device message received by a client over the socket; p50/p99;
- GetPreferredAllocation over the built-in 8-GPU node (NVLink islands, PCIe switch pairs, 2 NUMA nodes), every
  size 1..8 with random available sets and must-includes: in process (the resource's choice) and over the socket;
  p50/p99 per size and over all sizes; plus the one-off cost of building the topology's score table;
- Allocate of replicas over the socket (1 replica; 4 replicas of 2 GPUs), 1 caller, with the empty RPC
  (PreStartContainer) of the same server as the baseline: p50/p99 and the p50 ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc  # noqa: E402
from bench._common import machine, summary_ms  # noqa: E402
from plugin.devices.simulated import SimulatedBackend  # noqa: E402
from plugin.health.config import HealthConfig  # noqa: E402
from plugin.health.monitor import Monitor  # noqa: E402
from plugin.health.node_state import DeviceStatus, NodeState  # noqa: E402
from plugin.health.reasons import State  # noqa: E402
from plugin.kubelet import allocation  # noqa: E402
from plugin.kubelet.allocation import AllocationConfig  # noqa: E402
from plugin.kubelet.resources import DeviceResource  # noqa: E402
from plugin.kubelet.server import DevicePluginServicer  # noqa: E402
from plugin.kubelet.sharing import build_resources  # noqa: E402
from plugin.kubelet.supervisor import PluginServer, plugin_options  # noqa: E402
from plugin.sharing.config import parse_sharing  # noqa: E402
from tests.listandwatch import field_by_field  # noqa: E402


def node_state() -> tuple[NodeState, list[DeviceStatus]]:
    state = NodeState()
    backend = SimulatedBackend()  # the built-in 8-GPU node
    Monitor(backend, state, HealthConfig(), 5.0, threading.Event()).poll_once()
    backend.close()
    return state, list(state.snapshot().devices)


def flip(devices: list[DeviceStatus], i: int, bad: bool) -> list[DeviceStatus]:
    out = list(devices)
    out[i] = dataclasses.replace(out[i], state=State.UNHEALTHY if bad else State.HEALTHY,
                                 kubelet_health="Unhealthy" if bad else "Healthy")
    return out


def serve(root: Path, state: NodeState, resource: DeviceResource) -> tuple[PluginServer, grpc.Channel,
                                                                             api_pb2_grpc.DevicePluginStub]:
    servicer = DevicePluginServicer(state, resource, AllocationConfig(dev_root=root), plugin_options())
    server = PluginServer(root, resource, servicer)
    server.start()
    ch = grpc.insecure_channel(f"unix://{server.path}")
    return server, ch, api_pb2_grpc.DevicePluginStub(ch)


def bench_list_and_watch(root: Path, changes: int) -> dict[str, object]:
    state, devices = node_state()
    resource = build_resources("nvidia.com/gpu", "none", parse_sharing(
        {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 128}]}}))[0]
    server, ch, stub = serve(root, state, resource)
    received: list[tuple[float, int]] = []
    cond = threading.Condition()

    def reader() -> None:
        try:
            for msg in stub.ListAndWatch(api_pb2.Empty()):
                with cond:
                    received.append((time.perf_counter(), len(msg.devices)))
                    cond.notify_all()
        except grpc.RpcError:
            pass

    threading.Thread(target=reader, daemon=True).start()
    with cond:
        cond.wait_for(lambda: len(received) == 1, 10)
    assert received[0][1] == 1024, received
    in_process: list[float] = []
    cold: list[float] = []
    generic: list[float] = []
    end_to_end: list[float] = []
    sharing = parse_sharing({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 128}]}})
    # A second, long-lived resource like the stream's: times the same work alone, outside gRPC.
    shadow = build_resources("nvidia.com/gpu", "none", sharing)[0]
    shadow.devices(state.snapshot())
    now = time.time()
    for k in range(changes):
        devices = flip(devices, k % 8, bad=(k // 8) % 2 == 0)
        with cond:
            before = len(received)
        t0 = time.perf_counter()
        state.publish(devices, now)
        with cond:
            cond.wait_for(lambda before=before: len(received) > before, 10)  # type: ignore[misc]
            t_recv, count = received[-1]
        end_to_end.append(t_recv - t0)
        assert count == 1024
        snap = state.snapshot()
        t1 = time.perf_counter()
        shadow.devices(snap)  # what the stream does per snapshot: the view (compared with the last one) ...
        shadow.response(snap).SerializeToString()  # ... then the message, serialised by gRPC
        in_process.append(time.perf_counter() - t1)
        # Worst case: a resource that has never seen any of these devices (every replica object built anew).
        fresh = build_resources("nvidia.com/gpu", "none", sharing)[0]
        t2 = time.perf_counter()
        fresh.devices(snap)
        fresh.response(snap).SerializeToString()
        cold.append(time.perf_counter() - t2)
        # For comparison: the same message built field by field (the servicer's field_by_field oracle).
        t3 = time.perf_counter()
        field_by_field(shadow.devices(snap)).SerializeToString()
        generic.append(time.perf_counter() - t3)
    ch.close()
    server.stop()
    return {"devices": 1024, "changes": changes, "snapshot_in_process": summary_ms(in_process),
            "snapshot_in_process_cold": summary_ms(cold), "snapshot_field_by_field": summary_ms(generic),
            "publish_to_client": summary_ms(end_to_end)}


def bench_preferred(root: Path, calls: int) -> dict[str, object]:
    state, devices = node_state()
    snap = state.snapshot()
    gpus = tuple(d.gpu for d in devices)
    allocation._topology.cache_clear()
    t0 = time.perf_counter()
    allocation._topology(gpus)
    table_ms = (time.perf_counter() - t0) * 1000
    resource = build_resources("nvidia.com/gpu", "none", parse_sharing(None))[0]
    server, ch, stub = serve(root, state, resource)
    rng = random.Random(7)
    ids = [d.id for d in devices]
    per_size: dict[str, object] = {}
    all_in: list[float] = []
    all_rpc: list[float] = []
    empty: list[float] = []
    for size in range(1, 9):
        in_proc: list[float] = []
        rpc: list[float] = []
        for _ in range(calls):
            available = rng.sample(ids, rng.randint(size, 8))
            must = rng.sample(available, rng.randint(0, min(1, size)))
            t1 = time.perf_counter()
            resource.preferred(snap, available, must, size)
            in_proc.append(time.perf_counter() - t1)
            req = api_pb2.PreferredAllocationRequest(container_requests=[api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size)])
            t2 = time.perf_counter()
            stub.GetPreferredAllocation(req, timeout=10)
            rpc.append(time.perf_counter() - t2)
            t3 = time.perf_counter()
            stub.PreStartContainer(api_pb2.PreStartContainerRequest(), timeout=10)  # baseline, interleaved
            empty.append(time.perf_counter() - t3)
        per_size[str(size)] = {"in_process": summary_ms(in_proc), "rpc": summary_ms(rpc)}
        all_in += in_proc
        all_rpc += rpc
    ch.close()
    server.stop()
    return {"table_build_ms": round(table_ms, 3), "all_sizes_in_process": summary_ms(all_in),
            "all_sizes_rpc": summary_ms(all_rpc), "empty_rpc_same_server": summary_ms(empty), "per_size": per_size}


def bench_allocate(root: Path, calls: int) -> dict[str, object]:
    state, devices = node_state()
    resource = build_resources("nvidia.com/gpu", "none", parse_sharing(
        {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 128}]}}))[0]
    server, ch, stub = serve(root, state, resource)
    u = [d.id for d in devices]
    one = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[f"{u[3]}::7"])])
    four = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(
        devices_ids=[f"{u[1]}::0", f"{u[1]}::5", f"{u[6]}::9", f"{u[6]}::127"])])
    empty = api_pb2.PreStartContainerRequest()
    for _ in range(200):  # warm up
        stub.Allocate(one, timeout=10)
        stub.PreStartContainer(empty, timeout=10)
    lat: dict[str, list[float]] = {"empty": [], "allocate_1_replica": [], "allocate_4_replicas": []}
    for _ in range(calls):  # interleaved, so noise on the shared machine hits all three alike
        for name, call in (("empty", lambda: stub.PreStartContainer(empty, timeout=10)),
                           ("allocate_1_replica", lambda: stub.Allocate(one, timeout=10)),
                           ("allocate_4_replicas", lambda: stub.Allocate(four, timeout=10))):
            t0 = time.perf_counter()
            call()
            lat[name].append(time.perf_counter() - t0)
    resp = stub.Allocate(four, timeout=10)
    assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == f"{u[1]},{u[6]}"
    ch.close()
    server.stop()
    out: dict[str, object] = {k: summary_ms(v) for k, v in lat.items()}
    base = out["empty"]["p50_ms"]  # type: ignore[index]
    out["ratio_p50_allocate_1_to_empty"] = round(out["allocate_1_replica"]["p50_ms"] / base, 2)  # type: ignore
    out["ratio_p50_allocate_4_to_empty"] = round(out["allocate_4_replicas"]["p50_ms"] / base, 2)  # type: ignore
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--changes", type=int, default=300, help="health changes for the ListAndWatch measurement")
    ap.add_argument("--preferred-calls", type=int, default=300, help="GetPreferredAllocation calls per size")
    ap.add_argument("--calls", type=int, default=2000, help="Allocate calls per kind")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bsh-") as d:
        root = Path(d)
        (root / "dev").mkdir()
        for name in [f"nvidia{i}" for i in range(8)] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]:
            (root / "dev" / name).touch()
        report = {
            "machine": machine(),
            "list_and_watch_8x128": bench_list_and_watch(root, args.changes),
            "preferred_8_gpus": bench_preferred(root, args.preferred_calls),
            "allocate_replicas": bench_allocate(root, args.calls),
        }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
