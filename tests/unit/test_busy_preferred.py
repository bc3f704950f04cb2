"""The preferred allocation avoids a GPU busy with no pod (issue 36): a leaked process on GPU 1, read through the real
pynvml on the NVML stand-in by the monitor's busy watch past its grace, makes the GPU ``busy-unallocated``
(Degraded); the kubelet's GetPreferredAllocation, asked through the real DevicePlugin servicer, leaves it out while
anything else will do, gives it only when nothing else is left, and prefers it normally again once the process is
gone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc_testing
import pytest

from api.deviceplugin.v1beta1 import api_pb2
from plugin.health.busy import CODE
from plugin.health.reasons import State
from plugin.kubelet.allocation import AllocationConfig
from plugin.kubelet.resources import WholeGpus
from plugin.kubelet.server import DevicePluginServicer
from plugin.kubelet.supervisor import plugin_options
from tests.fakes import nvml_standin
from tests.unit.test_busy_unallocated import GRACE, Holders, T, engine
from tests.unit.test_servicer import SERVICE, method


class Plugin:
    """The monitor over the stand-in with its busy watch, and the servicer the kubelet asks, over one node state."""

    def __init__(self, backend: Any, node: Any, dev_root: Path) -> None:
        self.node = node
        self.clock, self.holders = [T], Holders()
        self.monitor, self.state = engine(backend, self.clock, self.holders)
        self.servicer = DevicePluginServicer(self.state, WholeGpus(), AllocationConfig(dev_root=dev_root),
                                             plugin_options())
        self.server = grpc_testing.server_from_dictionary({SERVICE: self.servicer}, grpc_testing.strict_real_time())

    def poll(self, after_s: float) -> None:
        self.clock[0] += after_s
        self.monitor.poll_once()

    def preferred(self, available: list[str], size: int, must: tuple[str, ...] = ()) -> set[str]:
        req = api_pb2.PreferredAllocationRequest(container_requests=[api_pb2.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size)])
        rpc = self.server.invoke_unary_unary(method("GetPreferredAllocation"), (), req, None)
        resp, _, code, details = rpc.termination()
        assert code == grpc.StatusCode.OK, details
        ids = list(resp.container_responses[0].deviceIDs)
        assert len(ids) == len(set(ids)) == min(size, len(available))
        return set(ids)

    def state_of(self, uuid: str) -> tuple[State, list[str]]:
        d = self.state.snapshot().get(uuid)
        assert d is not None
        return d.state, [r.code for r in d.reasons]


@pytest.fixture
def plugin(tmp_path: Path, dev_root: Path) -> Iterator[Plugin]:
    backend, node = nvml_standin.open_backend(tmp_path / "nvml")
    p = Plugin(backend, node, dev_root)
    yield p
    p.servicer.close()
    backend.close()


def test_the_preferred_allocation_avoids_a_gpu_busy_with_no_pod_until_its_processes_are_gone(plugin: Plugin) -> None:
    u = plugin.node.uuids
    plugin.monitor.poll_once()
    # What the kubelet is told while every GPU is idle: GPU 1 is in the NVLink island and behind GPU 0's switch.
    questions: list[tuple[list[str], int, tuple[str, ...]]] = [
        (u[:6], 4, ()),  # the whole island 0-3
        ([u[0], u[1], u[4]], 2, ()),  # 0 and 1: NVLink and one PCIe switch
        (u[:4], 3, (u[0],)),
    ]
    normal = [plugin.preferred(*q) for q in questions]
    assert normal[0] == set(u[:4]) and normal[1] == {u[0], u[1]}
    assert all(u[1] in n for n in normal[:2])

    # A process no pod holds starts on GPU 1 (the pod on GPU 3 has its own: held, so fine).
    plugin.node.set(1, compute_processes=[{"pid": 4242, "used_mib": 30000, "name": "python3"}])
    plugin.node.set(3, compute_processes=[{"pid": 5151, "used_mib": 1000, "name": "python3"}])
    plugin.holders.by_uuid[u[3]] = "held by pod ml/train-0"
    plugin.poll(5)
    plugin.poll(GRACE - 1)  # within the grace: nothing yet, and the kubelet hears the same as before
    assert plugin.state_of(u[1]) == (State.HEALTHY, [])
    assert [plugin.preferred(*q) for q in questions] == normal
    plugin.poll(1)  # the grace is over: nobody holds GPU 1
    assert plugin.state_of(u[1]) == (State.DEGRADED, [CODE])
    assert plugin.state_of(u[3]) == (State.HEALTHY, [])

    # Avoided whenever enough other GPUs are there, even at the cost of the NVLink island and the shared switch.
    busy = [plugin.preferred(*q) for q in questions]
    assert all(u[1] not in b for b in busy), busy
    assert busy[1] == {u[0], u[4]} and busy[2] == {u[0], u[2], u[3]}
    assert plugin.preferred(u, 7) == set(u) - {u[1]}
    # Given only when nothing else is left (the kubelet's choice, not ours), or when the kubelet must include it.
    assert plugin.preferred([u[0], u[1]], 2) == {u[0], u[1]}
    assert plugin.preferred([u[1], u[4], u[5]], 3) == {u[1], u[4], u[5]}
    assert plugin.preferred([u[1]], 1) == {u[1]}
    assert plugin.preferred(u, 8) == set(u)
    assert u[1] in plugin.preferred(u, 2, (u[1],))

    # The leaked process is killed: the reason goes at the next poll, and GPU 1 is preferred as before.
    plugin.node.set(1, compute_processes=None)
    plugin.poll(5)
    assert plugin.state_of(u[1]) == (State.HEALTHY, [])
    assert [plugin.preferred(*q) for q in questions] == normal
    assert plugin.preferred(u, 7) != set(u) - {u[1]}  # no longer the one left out
