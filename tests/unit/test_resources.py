"""Resources over a real simulated node and monitor: time-slicing replicas, MIG strategies, health of derived
devices, and Allocate / GetPreferredAllocation through the servicer (grpcio-testing)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc_testing
import pytest

from api.deviceplugin.v1beta1 import api_pb2
from plugin.devices.simulated import SimulatedBackend, builtin_node
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.kubelet.allocation import AllocationConfig
from plugin.kubelet.resources import DeviceResource
from plugin.kubelet.server import DevicePluginServicer
from plugin.kubelet.sharing import build_resources
from plugin.kubelet.supervisor import plugin_options
from plugin.sharing.config import parse_sharing
from plugin.sharing.model import profiles_of
from tests.conftest import NodeFile
from tests.listandwatch import field_by_field

SERVICE = api_pb2.DESCRIPTOR.services_by_name["DevicePlugin"]


def mig_node() -> dict[str, Any]:
    """GPUs 0 and 1 partitioned (two 1g.10gb and one 3g.40gb each), GPUs 2-7 whole."""
    doc = copy.deepcopy(builtin_node())
    for g in doc["gpus"][:2]:
        i = g["index"]
        g["mig_devices"] = [
            {"uuid": f"MIG-{i}a", "gpu_instance_id": 7, "compute_instance_id": 0, "profile": "1g.10gb",
             "memory_mib": 9856},
            {"uuid": f"MIG-{i}b", "gpu_instance_id": 8, "profile": "1g.10gb"},
            {"uuid": f"MIG-{i}c", "gpu_instance_id": 2, "profile": "3g.40gb", "memory_mib": 40192},
        ]
    return doc


class Node:
    def __init__(self, path: Path, doc: dict[str, Any] | None = None) -> None:
        self.file = NodeFile(path, doc)
        self.state = NodeState()
        self.backend = SimulatedBackend(path)
        self.monitor = Monitor(self.backend, self.state, HealthConfig(clear_after_polls=1), 5.0, threading.Event())
        self.monitor.poll_once()

    @property
    def u(self) -> list[str]:
        return self.file.uuids

    def resources(self, strategy: str = "none", sharing: dict[str, Any] | None = None) -> dict[str, DeviceResource]:
        rs = build_resources("nvidia.com/gpu", strategy, parse_sharing(sharing),
                             profiles_of(self.backend.discover().gpus))
        return {r.name: r for r in rs}

    def change(self, index: int, **signals: Any) -> None:
        self.file.set(index, **signals)
        assert self.backend.reload()
        self.monitor.poll_once()

    def events(self) -> None:
        self.monitor.handle_events(self.backend.wait_events(1.0))

    def ids(self, r: DeviceResource) -> list[str]:
        return [d.id for d in r.devices(self.state.snapshot())]

    def health(self, r: DeviceResource) -> dict[str, str]:
        return {d.id: d.health for d in r.devices(self.state.snapshot())}


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path / "node.json")
    yield n
    n.backend.close()


@pytest.fixture
def mig(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path / "node.json", mig_node())
    yield n
    n.backend.close()


def shared(replicas: int, **extra: Any) -> dict[str, Any]:
    return {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": replicas, **extra}]}}


# ListAndWatch views ---------------------------------------------------------------------------------------------

def test_replicas_ids_topology_and_parent_health(node: Node) -> None:
    r = node.resources(sharing=shared(4))["nvidia.com/gpu"]
    ids = node.ids(r)
    assert ids == [f"{u}::{n}" for u in node.u for n in range(4)]
    view = r.devices(node.state.snapshot())
    assert [d.numa_node for d in view[::4]] == [0, 0, 0, 0, 1, 1, 1, 1]
    node.change(2, nvlink_down=[0])  # Unhealthy parent: exactly its four replicas turn Unhealthy
    bad = {i for i, h in node.health(r).items() if h != "Healthy"}
    assert bad == {f"{node.u[2]}::{n}" for n in range(4)}
    node.change(3, temperature_c=90)  # Degraded parent: replicas still Healthy to the kubelet
    assert node.health(r)[f"{node.u[3]}::0"] == "Healthy"
    node.change(2, nvlink_down=None)
    assert set(node.health(r).values()) == {"Healthy"}


def test_rename_with_a_count_splits_the_gpus(node: Node) -> None:
    rs = node.resources(sharing=shared(3, rename="nvidia.com/gpu.shared", devices=2))
    assert node.ids(rs["nvidia.com/gpu"]) == node.u[2:]  # not selected: stay whole under the original name
    assert node.ids(rs["nvidia.com/gpu.shared"]) == [f"{u}::{n}" for u in node.u[:2] for n in range(3)]


def test_devices_by_index_and_uuid_without_rename_mix_in_one_resource(node: Node) -> None:
    r = node.resources(sharing=shared(2, devices=[6, node.u[1]]))["nvidia.com/gpu"]
    ids = node.ids(r)
    whole = [u for i, u in enumerate(node.u) if i not in (1, 6)]
    assert ids == [*whole, f"{node.u[1]}::0", f"{node.u[1]}::1", f"{node.u[6]}::0", f"{node.u[6]}::1"]


def test_view_is_reused_until_the_snapshot_changes(node: Node) -> None:
    r = node.resources(sharing=shared(8))["nvidia.com/gpu"]
    snap = node.state.snapshot()
    assert r.devices(snap) is r.devices(snap)
    node.change(5, nvlink_down=[1])
    after = r.devices(node.state.snapshot())
    before = r.devices(snap)
    # Unchanged GPUs' replicas are the very same objects: comparing views stays cheap on 1,024 devices.
    assert all(a is b for a, b in zip(before[:40], after[:40], strict=True))
    assert before != after


def test_backing_accepts_only_advertised_replica_ids(node: Node) -> None:
    r = node.resources(sharing=shared(4, devices=[0]))["nvidia.com/gpu"]
    snap = node.state.snapshot()
    u0 = node.u[0]
    assert r.backing(snap, f"{u0}::3") is snap.get(u0)
    assert r.backing(snap, node.u[1]) is snap.get(node.u[1])  # a GPU left whole
    for bad in (u0, f"{u0}::4", f"{u0}::03", f"{u0}::-1", f"{u0}::", f"{node.u[1]}::0", "nope::0"):
        assert r.backing(snap, bad) is None, bad


def test_replica_ids_beyond_63_characters_are_not_advertised(tmp_path: Path) -> None:
    doc = builtin_node()
    doc["gpus"] = doc["gpus"][:1]
    doc["gpus"][0]["uuid"] = "G" * 60
    doc["gpus"][0]["nvlink_peers"] = []
    n = Node(tmp_path / "node.json", doc)
    r = n.resources(sharing=shared(20))["nvidia.com/gpu"]
    assert n.ids(r) == [f"{'G' * 60}::{k}" for k in range(10)]  # "::10" would make 64 characters
    assert r.backing(n.state.snapshot(), f"{'G' * 60}::12") is None
    n.backend.close()


def test_mig_strategies(mig: Node) -> None:
    none = mig.resources("none")
    assert list(none) == ["nvidia.com/gpu"] and mig.ids(none["nvidia.com/gpu"]) == mig.u
    single = mig.resources("single")["nvidia.com/gpu"]
    assert mig.ids(single) == ["MIG-0a", "MIG-0b", "MIG-0c", "MIG-1a", "MIG-1b", "MIG-1c", *mig.u[2:]]
    mixed = mig.resources("mixed")
    assert list(mixed) == ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"]
    assert mig.ids(mixed["nvidia.com/gpu"]) == mig.u[2:]
    assert mig.ids(mixed["nvidia.com/mig-1g.10gb"]) == ["MIG-0a", "MIG-0b", "MIG-1a", "MIG-1b"]
    assert mig.ids(mixed["nvidia.com/mig-3g.40gb"]) == ["MIG-0c", "MIG-1c"]
    view = mixed["nvidia.com/mig-3g.40gb"].devices(mig.state.snapshot())
    assert [d.numa_node for d in view] == [0, 0]


def test_mig_health_parent_plus_instance_scoped_events(mig: Node) -> None:
    mixed = mig.resources("mixed", {"timeSlicing": {"resources": [{"name": "nvidia.com/mig-1g.10gb",
                                                                   "replicas": 2}]}})
    small = mixed["nvidia.com/mig-1g.10gb"]
    big = mixed["nvidia.com/mig-3g.40gb"]
    assert mig.ids(small)[:2] == ["MIG-0a::0", "MIG-0a::1"]
    mig.change(0, mig_events=[{"gpu_instance_id": 8, "xid": 79}])  # a fatal XID in GPU instance 8 of GPU 0
    mig.events()
    bad = {i for i, h in mig.health(small).items() if h != "Healthy"}
    assert bad == {"MIG-0b::0", "MIG-0b::1"}  # only that instance (and its replicas)
    assert set(mig.health(big).values()) == {"Healthy"}
    assert set(mig.health(mixed["nvidia.com/gpu"]).values()) == {"Healthy"}
    mig.change(1, nvlink_down=[2])  # a parent fault: every MIG device of GPU 1
    assert {i for i, h in mig.health(big).items() if h != "Healthy"} == {"MIG-1c"}
    assert {i for i, h in mig.health(small).items() if h != "Healthy"} == \
        {"MIG-0b::0", "MIG-0b::1", "MIG-1a::0", "MIG-1a::1", "MIG-1b::0", "MIG-1b::1"}


# Through the servicer -------------------------------------------------------------------------------------------

class Served:
    def __init__(self, node: Node, resource: DeviceResource, dev_root: Path) -> None:
        self.servicer = DevicePluginServicer(node.state, resource, AllocationConfig(dev_root=dev_root),
                                             plugin_options())
        self.server = grpc_testing.server_from_dictionary({SERVICE: self.servicer}, grpc_testing.strict_real_time())

    def unary(self, name: str, request: Any) -> tuple[Any, grpc.StatusCode, str]:
        rpc = self.server.invoke_unary_unary(SERVICE.methods_by_name[name], (), request, None)
        response, _, code, details = rpc.termination()
        return response, code, details

    def allocate(self, *containers: list[str]) -> tuple[Any, grpc.StatusCode, str]:
        return self.unary("Allocate", api_pb2.AllocateRequest(container_requests=[
            api_pb2.ContainerAllocateRequest(devices_ids=ids) for ids in containers]))

    def preferred(self, available: list[str], must: list[str], size: int) -> list[str]:
        resp, code, details = self.unary("GetPreferredAllocation", api_pb2.PreferredAllocationRequest(
            container_requests=[api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size)]))
        assert code == grpc.StatusCode.OK, details
        return list(resp.container_responses[0].deviceIDs)


def test_allocate_replicas_names_each_gpu_once(node: Node, dev_root: Path) -> None:
    s = Served(node, node.resources(sharing=shared(4))["nvidia.com/gpu"], dev_root)
    u = node.u
    resp, code, details = s.allocate([f"{u[3]}::0", f"{u[3]}::2", f"{u[5]}::1"])
    assert code == grpc.StatusCode.OK, details
    c = resp.container_responses[0]
    assert c.envs["NVIDIA_VISIBLE_DEVICES"] == f"{u[3]},{u[5]}"
    assert [d.container_path for d in c.devices] == ["/dev/nvidia3", "/dev/nvidia5", "/dev/nvidiactl",
                                                     "/dev/nvidia-uvm"]
    _, code, details = s.allocate([u[3]])  # the whole GPU is not advertised any more
    assert code == grpc.StatusCode.INVALID_ARGUMENT and u[3] in details
    node.change(3, nvlink_down=[0])
    _, code, details = s.allocate([f"{u[3]}::1"])
    assert code == grpc.StatusCode.FAILED_PRECONDITION and f"{u[3]}::1" in details


def test_fail_requests_greater_than_one(node: Node, dev_root: Path) -> None:
    sharing = shared(4, rename="nvidia.com/gpu.shared", failRequestsGreaterThanOne=True)
    s = Served(node, node.resources(sharing=sharing)["nvidia.com/gpu.shared"], dev_root)
    u = node.u
    _, code, details = s.allocate([f"{u[0]}::0", f"{u[1]}::0"])
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "2 devices" in details and "sharing.timeSlicing.resources[0].failRequestsGreaterThanOne" in details
    assert "container_requests[0]" in details
    resp, code, _ = s.allocate([f"{u[0]}::0"], [f"{u[0]}::1"])  # one each, two containers: fine
    assert code == grpc.StatusCode.OK and len(resp.container_responses) == 2


def test_allocate_mig_device(mig: Node, dev_root: Path) -> None:
    s = Served(mig, mig.resources("mixed")["nvidia.com/mig-1g.10gb"], dev_root)
    resp, code, details = s.allocate(["MIG-1a", "MIG-1b"])
    assert code == grpc.StatusCode.OK, details
    c = resp.container_responses[0]
    assert c.envs["NVIDIA_VISIBLE_DEVICES"] == "MIG-1a,MIG-1b"
    assert c.devices[0].container_path == "/dev/nvidia1"
    _, code, _ = s.allocate(["MIG-0c"])  # another profile's slice
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert s.preferred(["MIG-0a", "MIG-1a", "MIG-1b"], [], 2) == ["MIG-1a", "MIG-1b"]  # one parent GPU


def test_preferred_replicas_distributed_and_packed(node: Node, dev_root: Path) -> None:
    u = node.u
    dist = Served(node, node.resources(sharing=shared(4))["nvidia.com/gpu"], dev_root)
    everything = [f"{g}::{n}" for g in u for n in range(4)]
    got = dist.preferred(everything, [], 4)
    assert len({i.split("::")[0] for i in got}) == 4  # spread: four different GPUs
    # GPU 0 has replicas in use elsewhere (absent from available): a single replica goes to an idle GPU.
    busy = [i for i in everything if not i.startswith(u[0]) or i.endswith("::3")]
    assert not dist.preferred(busy, [], 1)[0].startswith(u[0])
    sharing = {"timeSlicing": {"allocationPolicy": "packed", "resources": [{"name": "nvidia.com/gpu",
                                                                            "replicas": 4}]}}
    packed = Served(node, node.resources(sharing=sharing)["nvidia.com/gpu"], dev_root)
    got = packed.preferred(busy, [], 1)
    assert got == [f"{u[0]}::3"]  # packed onto the GPU already in use
    got = packed.preferred(everything, [], 3)
    assert len({i.split("::")[0] for i in got}) == 1


@pytest.mark.parametrize(("strategy", "sharing"), [
    ("none", None),
    ("none", shared(3, devices=[1, 4])),
    ("mixed", {"timeSlicing": {"resources": [{"name": "nvidia.com/mig-1g.10gb", "replicas": 2}]}}),
    ("single", shared(2, rename="nvidia.com/gpu.shared")),
])
def test_cached_encoding_equals_the_message_built_field_by_field(tmp_path: Path, strategy: str,
                                                                  sharing: dict[str, Any] | None) -> None:
    doc = mig_node()
    doc["gpus"][5]["numa_node"] = None  # a device without a NUMA node carries no topology
    n = Node(tmp_path / "node.json", doc)
    rs = n.resources(strategy, sharing).values()
    assert rs, "no resources: the loops below would check nothing"
    for r in rs:
        assert r.response(n.state.snapshot()) == field_by_field(r.devices(n.state.snapshot())), r.name
    n.change(4, nvlink_down=[0])  # after a change, from the partly cached encodings
    for r in rs:
        snap = n.state.snapshot()
        assert r.response(snap) == field_by_field(r.devices(snap)), r.name
        has_gpu4 = not r.name.startswith("nvidia.com/mig-")  # GPU 4 is whole (or replicated) in the others
        assert any(d.health == "Unhealthy" for d in r.response(snap).devices) == has_gpu4, r.name
    n.backend.close()


# Through the NVML backend (the real pynvml on the stand-in): topology and MIG profiles come from discovery -----------

def nvml_node(tmp_path: Path, fail_topology: bool) -> tuple[NodeState, Any]:
    from tests.fakes import nvml_standin

    backend, node = nvml_standin.open_backend(tmp_path / "first", uuid_prefix="GPU-fake-")
    backend.close()  # the node file is written; the backend under test opens on it as changed below
    node.gpu(7)["mig_devices"] = [{"uuid": "MIG-7a", "gpu_instance_id": 1, "profile": "3g.40gb"},
                                  {"uuid": "MIG-7b", "gpu_instance_id": 2, "profile": "3g.40gb"}]
    if fail_topology:  # the driver answers nothing useful about the interconnect
        node.nvml(None, fail={"nvmlDeviceGetTopologyCommonAncestor": "unknown",
                              "nvmlDeviceGetNvLinkRemotePciInfo": "unknown"})
    node.write()
    from plugin.devices.nvml import NvmlBackend

    with nvml_standin.use_node(node.path):
        backend = NvmlBackend()
    state = NodeState()
    Monitor(backend, state, HealthConfig(), 5.0, threading.Event()).poll_once()
    return state, backend


@pytest.mark.parametrize("fail_topology", [False, True])
def test_nvml_discovery_feeds_resources_and_preferred(tmp_path: Path, fail_topology: bool) -> None:
    state, backend = nvml_node(tmp_path, fail_topology)
    rs = {r.name: r for r in build_resources("nvidia.com/gpu", "mixed", parse_sharing(None),
                                             profiles_of(backend.discover().gpus))}
    snap = state.snapshot()
    assert list(rs) == ["nvidia.com/gpu", "nvidia.com/mig-3g.40gb"]
    assert [d.id for d in rs["nvidia.com/mig-3g.40gb"].devices(snap)] == ["MIG-7a", "MIG-7b"]
    gpus = [d.id for d in rs["nvidia.com/gpu"].devices(snap)]
    assert gpus == [f"GPU-fake-{i}" for i in range(7)]
    got = rs["nvidia.com/gpu"].preferred(snap, gpus, ["GPU-fake-4"], 3)
    assert len(got) == 3 and got[0] == "GPU-fake-4"
    if not fail_topology:  # NVLink islands from each link's remote PCI bus id
        assert set(got) == {"GPU-fake-4", "GPU-fake-5", "GPU-fake-6"}
    backend.close()
