"""The DevicePlugin servicer driven in-process by grpcio-testing: every RPC, good and bad input."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc_testing
import pytest

from api.deviceplugin.v1beta1 import api_pb2
from plugin.devices.simulated import SimulatedBackend
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.kubelet.allocation import AllocationConfig
from plugin.kubelet.resources import WholeGpus
from plugin.kubelet.server import DevicePluginServicer
from plugin.kubelet.supervisor import plugin_options
from tests.conftest import NodeFile

SERVICE = api_pb2.DESCRIPTOR.services_by_name["DevicePlugin"]


def method(name: str) -> Any:
    return SERVICE.methods_by_name[name]


class Harness:
    def __init__(self, node_file: NodeFile, dev_root: Path, **alloc: Any) -> None:
        self.node = node_file
        self.state = NodeState()
        self.backend = SimulatedBackend(node_file.path)
        self.monitor = Monitor(self.backend, self.state, HealthConfig(clear_after_polls=1), 5.0, threading.Event())
        self.monitor.poll_once()
        self.servicer = DevicePluginServicer(self.state, WholeGpus(), AllocationConfig(dev_root=dev_root, **alloc),
                                             plugin_options())
        self.server = grpc_testing.server_from_dictionary({SERVICE: self.servicer}, grpc_testing.strict_real_time())

    def fault(self, index: int, **signals: Any) -> None:
        self.node.set(index, **signals)
        assert self.backend.reload()
        self.monitor.poll_once()

    def unary(self, name: str, request: Any) -> tuple[Any, grpc.StatusCode, str]:
        rpc = self.server.invoke_unary_unary(method(name), (), request, None)
        response, _, code, details = rpc.termination()
        return response, code, details

    def allocate(self, *containers: list[str]) -> tuple[Any, grpc.StatusCode, str]:
        req = api_pb2.AllocateRequest(container_requests=[
            api_pb2.ContainerAllocateRequest(devices_ids=ids) for ids in containers])
        return self.unary("Allocate", req)

    def preferred(self, available: list[str], must: list[str], size: int) -> tuple[Any, grpc.StatusCode, str]:
        req = api_pb2.PreferredAllocationRequest(container_requests=[api_pb2.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size)])
        return self.unary("GetPreferredAllocation", req)


@pytest.fixture
def h(node_file: NodeFile, dev_root: Path) -> Iterator[Harness]:
    harness = Harness(node_file, dev_root)
    yield harness
    harness.servicer.close()  # ends any stream a failed test left open
    harness.backend.close()


def test_options_are_the_registered_ones(h: Harness) -> None:
    resp, code, _ = h.unary("GetDevicePluginOptions", api_pb2.Empty())
    assert code == grpc.StatusCode.OK
    assert resp == plugin_options()
    assert resp.get_preferred_allocation_available and not resp.pre_start_required


def test_list_and_watch_sends_full_snapshots_only_on_kubelet_visible_change(h: Harness) -> None:
    rpc = h.server.invoke_unary_stream(method("ListAndWatch"), (), api_pb2.Empty(), None)
    first = rpc.take_response()
    assert [d.ID for d in first.devices] == h.node.uuids
    assert all(d.health == "Healthy" for d in first.devices)
    assert [d.topology.nodes[0].ID for d in first.devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    h.fault(2, temperature_c=90)  # Degraded: the kubelet still sees Healthy, so nothing is sent
    h.fault(3, nvlink_down=[1])  # Unhealthy: one new full snapshot
    second = rpc.take_response()
    assert len(second.devices) == 8
    assert {d.ID: d.health for d in second.devices}[h.node.uuids[3]] == "Unhealthy"
    assert sum(d.health == "Healthy" for d in second.devices) == 7  # GPU 2 Degraded still reports Healthy
    h.node.doc["gpus"].pop()  # a GPU disappears: the next snapshot omits it
    for g in h.node.doc["gpus"]:
        g["nvlink_peers"] = [p for p in g["nvlink_peers"] if p != 7]
    h.node.write()
    assert h.backend.reload()
    h.monitor.poll_once()
    third = rpc.take_response()
    assert len(third.devices) == 7
    assert h.servicer.open_streams == 1
    rpc.cancel()
    assert h.servicer.wait_for_streams(0, timeout=5)  # the stream's thread and its wait are released


def test_closing_the_servicer_ends_its_streams(h: Harness) -> None:
    rpc = h.server.invoke_unary_stream(method("ListAndWatch"), (), api_pb2.Empty(), None)
    rpc.take_response()
    h.servicer.close()
    _, code, _ = rpc.termination()
    assert code == grpc.StatusCode.OK
    assert h.servicer.open_streams == 0


def test_allocate_response_shape(h: Harness, dev_root: Path) -> None:
    resp, code, _ = h.allocate(h.node.uuids[:2], [h.node.uuids[5]])
    assert code == grpc.StatusCode.OK
    c0, c1 = resp.container_responses
    assert c0.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(h.node.uuids[:2])
    assert [(d.container_path, d.host_path, d.permissions) for d in c0.devices] == [
        ("/dev/nvidia0", str(dev_root / "dev/nvidia0"), "rw"),
        ("/dev/nvidia1", str(dev_root / "dev/nvidia1"), "rw"),
        ("/dev/nvidiactl", str(dev_root / "dev/nvidiactl"), "rw"),
        ("/dev/nvidia-uvm", str(dev_root / "dev/nvidia-uvm"), "rw"),  # uvm-tools is absent: skipped
    ]
    assert c1.envs["NVIDIA_VISIBLE_DEVICES"] == h.node.uuids[5]
    assert not c0.cdi_devices


def test_allocate_with_cdi(node_file: NodeFile, dev_root: Path) -> None:
    h = Harness(node_file, dev_root, cdi=True)
    resp, code, _ = h.allocate([h.node.uuids[1]])
    assert code == grpc.StatusCode.OK
    assert [c.name for c in resp.container_responses[0].cdi_devices] == [f"nvidia.com/gpu={h.node.uuids[1]}"]
    h.backend.close()


@pytest.mark.parametrize(("containers", "needle"), [
    ([["GPU-nope"]], "GPU-nope"),
    ([[]], "empty"),
    ([["@0", "@0"]], "listed twice"),
    ([["@1"], ["GPU-bad-second"]], "container_requests[1]"),
])
def test_allocate_rejects_bad_ids(h: Harness, containers: list[list[str]], needle: str) -> None:
    resolved = [[h.node.uuids[int(i[1:])] if i.startswith("@") else i for i in c] for c in containers]
    _, code, details = h.allocate(*resolved)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in details


def test_allocate_rejects_no_containers(h: Harness) -> None:
    _, code, details = h.unary("Allocate", api_pb2.AllocateRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "container_requests" in details


def test_allocate_refuses_unhealthy_unless_allowed(node_file: NodeFile, dev_root: Path) -> None:
    h = Harness(node_file, dev_root)
    h.fault(4, ecc_uncorrected_volatile=3)
    _, code, details = h.allocate([h.node.uuids[4]])
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert h.node.uuids[4] in details and "ecc-uncorrected" in details
    h.fault(5, temperature_c=88)  # Degraded is still allocatable
    _, code, _ = h.allocate([h.node.uuids[5]])
    assert code == grpc.StatusCode.OK
    h.backend.close()
    permissive = Harness(node_file, dev_root, allow_unhealthy=True)
    _, code, _ = permissive.allocate([h.node.uuids[4]])
    assert code == grpc.StatusCode.OK
    permissive.backend.close()


def test_preferred_allocation_keeps_nvlink_islands_together(h: Harness) -> None:
    u = h.node.uuids
    resp, code, _ = h.preferred(u, [u[0]], 4)
    assert code == grpc.StatusCode.OK
    assert set(resp.container_responses[0].deviceIDs) == set(u[:4])
    resp, _, _ = h.preferred(u, [u[5]], 2)
    ids = list(resp.container_responses[0].deviceIDs)
    assert ids[0] == u[5] and ids[1] in (u[4],)  # NVLink and the same PCIe switch
    resp, _, _ = h.preferred([u[0], u[4], u[5]], [], 2)
    assert set(resp.container_responses[0].deviceIDs) == {u[4], u[5]}


def test_preferred_allocation_prefers_healthy_over_degraded(h: Harness) -> None:
    u = h.node.uuids
    h.fault(1, row_remap_pending=True)
    resp, _, _ = h.preferred(u[:4], [u[0]], 3)
    assert u[1] not in resp.container_responses[0].deviceIDs
    resp, _, _ = h.preferred(u[:2], [], 2)  # nothing else fits: the degraded GPU is still used
    assert set(resp.container_responses[0].deviceIDs) == {u[0], u[1]}


def test_preferred_allocation_works_around_unknown_ids_and_rejects_bad_sizes(h: Harness) -> None:
    u = h.node.uuids
    resp, code, _ = h.preferred(["GPU-unknown", u[0], u[1]], [], 2)
    assert code == grpc.StatusCode.OK and set(resp.container_responses[0].deviceIDs) == {u[0], u[1]}
    resp, code, _ = h.preferred(u[:2], [], 5)  # more than available: return what there is
    assert code == grpc.StatusCode.OK and len(resp.container_responses[0].deviceIDs) == 2
    _, code, details = h.preferred(u, [], 0)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "allocation_size" in details and "0" in details
    _, code, details = h.preferred(u, u[:3], 2)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "must-include" in details


def test_pre_start_container_is_a_no_op(h: Harness) -> None:
    resp, code, _ = h.unary("PreStartContainer", api_pb2.PreStartContainerRequest(devices_ids=["x"]))
    assert code == grpc.StatusCode.OK and resp == api_pb2.PreStartContainerResponse()
