"""MIG instances as DRA devices (``--mode dra --mig-strategy mixed``): the slice publishes a GPU with MIG instances
as one device per instance (named ``gpu-<index>-mig-<gi>-<ci>``, ``type`` mig, its parent's index and topology, its
own memory) and every other GPU whole (``type`` gpu); ``none`` keeps every GPU whole, byte for byte as before.
Health reaches instances through the real monitor: a fault of the GPU taints all its instances, one of an instance
only that one. A layout change is a new slice; the checkpoint and the recovery check's holders know a claim on an
instance holds its GPU. Prepare and unprepare of instances: tests/integration/test_dra_driver.py."""

from __future__ import annotations

import copy
import json
import random
import re
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from plugin.devices.model import Gpu, MigDevice
from plugin.devices.simulated import SimulatedBackend, builtin_node, parse_node
from plugin.dra import slices as rs
from plugin.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice
from plugin.dra.health import HealthSettings, device_health
from plugin.dra.holders import PreparedClaimHolders
from plugin.dra.slicewriter import SliceWriter
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from plugin.health.store import StateStore
from plugin.validation import FieldError
from tests.conftest import FakeClock
from tests.fakes.node_devices import Node, gpu, status
from tests.unit.test_slicewriter import FakeSliceServer

D = rs.DRIVER
NODE = "gpu-node-1"
T0 = 1_767_225_600.0
MIXED = rs.SliceSettings(node_name=NODE, mig_strategy="mixed")
NONE = rs.SliceSettings(node_name=NODE)
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # apimachinery's IsDNS1123Label, written out
GI_1G = range(7, 14)  # the GPU instance ids nvidia-smi gives seven 1g.10gb instances of an H100


def instances(g: Gpu, layout: list[tuple[int, str, int]]) -> Gpu:
    """``g`` with MIG instances (gpu instance id, profile, memory MiB), compute instance 0 each."""
    return replace(g, mig_devices=tuple(
        MigDevice(uuid=f"MIG-{g.index:04d}{gi:04d}-1111-4000-8000-{gi:012d}", parent_uuid=g.uuid,
                  gpu_instance_id=gi, compute_instance_id=0, profile=profile, memory_mib=mib)
        for gi, profile, mib in layout))


def seven_1g(g: Gpu) -> Gpu:
    return instances(g, [(gi, "1g.10gb", 9856) for gi in GI_1G])


def sim_gpus() -> list[Gpu]:
    return [s.gpu for s in parse_node(builtin_node())]


def devices(obj: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = obj["spec"].get("devices", [])
    return found


def attr(device: dict[str, Any], name: str) -> Any:
    return next(iter(device["attributes"][f"{D}/{name}"].values()))


def by_name(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in devices(obj)}


# The slice -------------------------------------------------------------------------------------------------------

def test_eight_gpus_of_seven_instances_are_56_devices_with_the_attributes_claims_select_on() -> None:
    gpus = [seven_1g(g) for g in sim_gpus()]
    obj = rs.desired_slice(gpus, {}, MIXED)
    kubernetes_validate.validate(obj, "1.37.0", strict=True)
    devs = devices(obj)
    assert len(devs) == 56 <= rs.MAX_DEVICES
    assert [d["name"] for d in devs] == [f"gpu-{i}-mig-{gi}-0" for i in range(8) for gi in GI_1G]
    g5 = gpus[5]
    m = g5.mig_devices[2]
    assert by_name(obj)["gpu-5-mig-9-0"] == {
        "name": "gpu-5-mig-9-0",
        "attributes": {
            f"{D}/uuid": {"string": m.uuid},
            f"{D}/type": {"string": "mig"},
            f"{D}/index": {"int": 5},  # the parent's: an index selector picks a GPU's instances
            f"{D}/parentUUID": {"string": g5.uuid},
            f"{D}/profile": {"string": "1g.10gb"},
            f"{D}/gpuInstance": {"int": 9},
            f"{D}/computeInstance": {"int": 0},
            f"{D}/productName": {"string": "NVIDIA H100 80GB HBM3"},
            f"{D}/numaNode": {"int": 1},
            f"{D}/nvlinkIsland": {"int": 4},
            f"{D}/pcieSwitch": {"string": "sw2"},
            f"{D}/pciBusID": {"string": g5.pci_bus_id},
        },
        "capacity": {f"{D}/memory": {"value": "9856Mi"}},  # the instance's memory, not the GPU's
    }
    for d in devs:
        assert DNS_LABEL.fullmatch(d["name"]) and len(d["name"]) <= 63
        assert len(d["attributes"]) + len(d.get("capacity", {})) <= rs.MAX_ATTRIBUTES
        assert attr(d, "type") == "mig" and "taints" not in d
    assert len({attr(d, "uuid") for d in devs}) == 56
    # Every instance of a GPU says so by its index and parent.
    assert {attr(d, "parentUUID") for d in devs if attr(d, "index") == 3} == {gpus[3].uuid}


def test_a_node_with_some_gpus_in_mig_mode_publishes_those_as_instances_and_the_rest_whole() -> None:
    plain = sim_gpus()
    gpus = [instances(plain[0], [(1, "3g.40gb", 40192), (2, "3g.40gb", 40192)]), seven_1g(plain[1]), *plain[2:]]
    obj = rs.desired_slice(list(reversed(gpus)), {}, MIXED)  # discovery order does not matter
    kubernetes_validate.validate(obj, "1.37.0", strict=True)
    assert [(d["name"], attr(d, "type"), attr(d, "index")) for d in devices(obj)] == [
        ("gpu-0-mig-1-0", "mig", 0), ("gpu-0-mig-2-0", "mig", 0),
        *((f"gpu-1-mig-{gi}-0", "mig", 1) for gi in GI_1G),
        *((f"gpu-{i}", "gpu", i) for i in range(2, 8))]
    assert attr(by_name(obj)["gpu-0-mig-2-0"], "profile") == "3g.40gb"
    assert by_name(obj)["gpu-0-mig-2-0"]["capacity"] == {f"{D}/memory": {"value": "40192Mi"}}
    # A whole GPU is as it always was, with its type.
    assert by_name(obj)["gpu-2"] == devices(rs.desired_slice(plain, {}, NONE))[2]
    assert attr(by_name(obj)["gpu-2"], "type") == "gpu" and attr(by_name(obj)["gpu-2"], "uuid") == plain[2].uuid
    # An instance without a memory reading has no capacity rather than a zero one.
    bare = rs.desired_slice([instances(plain[0], [(3, "1g.10gb", 0)])], {}, MIXED)
    assert "capacity" not in devices(bare)[0]


def test_none_publishes_every_gpu_whole_even_in_mig_mode_exactly_as_before() -> None:
    plain = sim_gpus()
    gpus = [seven_1g(g) if g.index < 3 else g for g in plain]
    st = {g.uuid: status(g, since=T0) for g in gpus}
    st[gpus[1].uuid] = status(gpus[1], State.UNHEALTHY, "xid-79", since=T0)
    got = rs.desired_slice(gpus, st, NONE)
    assert got == rs.desired_slice(plain, st, NONE)
    assert [d["name"] for d in devices(got)] == [f"gpu-{i}" for i in range(8)]
    assert {attr(d, "type") for d in devices(got)} == {"gpu"}


def test_more_devices_than_a_slice_holds_is_an_error_naming_them_not_a_partial_slice() -> None:
    gpus = [seven_1g(Gpu(uuid=f"GPU-{i}", index=i)) for i in range(10)]
    assert len(devices(rs.desired_slice(gpus[:9], {}, MIXED))) == 63
    with pytest.raises(ValueError, match=r"70 devices \(0 whole GPUs, 70 MIG instances\).*at most 64"):
        rs.desired_slice(gpus, {}, MIXED)
    with pytest.raises(ValueError, match=r"65 devices \(2 whole GPUs, 63 MIG instances\)"):
        rs.desired_slice([*gpus[:9], Gpu(uuid="GPU-a", index=10), Gpu(uuid="GPU-b", index=11)], {}, MIXED)
    assert len(devices(rs.desired_slice(gpus, {}, NONE))) == 10  # whole, the same GPUs fit


def test_instance_names_fall_back_to_a_hash_where_they_would_clash_or_be_no_label() -> None:
    a = instances(gpu(0), [(1, "1g.10gb", 0), (2, "1g.10gb", 0)])
    twice = replace(a, mig_devices=(a.mig_devices[0], replace(a.mig_devices[1], gpu_instance_id=1)))
    b, c = instances(gpu(1), [(1, "1g.10gb", 0)]), instances(replace(gpu(2), index=1), [(2, "1g.10gb", 0)])
    odd = instances(replace(gpu(3), index=-1), [(1, "1g.10gb", 0)])
    negative = replace(instances(gpu(4), [(1, "1g.10gb", 0)]), mig_devices=(
        replace(instances(gpu(4), [(1, "1g.10gb", 0)]).mig_devices[0], compute_instance_id=-2),))
    devs = rs.slice_devices([twice, b, c, odd, negative, gpu(5)], {}, "mixed")
    names = {d.uuid: d.name for d in devs}
    # Two instances with the same ids (a broken discovery): both hashed, by their own UUIDs.
    assert names[twice.mig_devices[0].uuid] == rs.hashed_name(twice.mig_devices[0].uuid)
    assert names[twice.mig_devices[1].uuid] == rs.hashed_name(twice.mig_devices[1].uuid)
    # Parents sharing an index: their instances do not say which GPU they are on, so they are hashed too.
    assert names[b.mig_devices[0].uuid] == rs.hashed_name(b.mig_devices[0].uuid)
    assert names[c.mig_devices[0].uuid] == rs.hashed_name(c.mig_devices[0].uuid)
    assert names[odd.mig_devices[0].uuid] == rs.hashed_name(odd.mig_devices[0].uuid)
    assert names[negative.mig_devices[0].uuid] == rs.hashed_name(negative.mig_devices[0].uuid)
    assert names[gpu(5).uuid] == "gpu-5"
    assert len(set(names.values())) == len(names) and all(DNS_LABEL.fullmatch(n) for n in names.values())
    # Stable: the same devices in any discovery order get the same names.
    assert {d.uuid: d.name for d in rs.slice_devices([gpu(5), negative, odd, c, b, twice], {}, "mixed")} == names


def test_single_is_refused_saying_to_use_mixed() -> None:
    with pytest.raises(FieldError) as exc:
        rs.SliceSettings(node_name=NODE, mig_strategy="single")
    assert exc.value.field == "mig_strategy" and "use mixed" in str(exc.value)
    with pytest.raises(FieldError):
        rs.slice_devices([gpu(0)], {}, "Mixed")


# Health through the real monitor -----------------------------------------------------------------------------------

class MonitoredNode:
    """The built-in simulated node with MIG instances on GPUs 0 and 1, the real backend and monitor, polled by
    hand on a fake clock."""

    def __init__(self, tmp: Path) -> None:
        self.file = tmp / "node.json"
        self.doc = builtin_node()
        for i, layout in ((0, [(1, "3g.40gb"), (2, "3g.40gb")]), (1, [(gi, "1g.10gb") for gi in GI_1G])):
            self.doc["gpus"][i]["mig_devices"] = [
                {"uuid": f"MIG-{i:04d}{gi:04d}-1111-4000-8000-{gi:012d}", "gpu_instance_id": gi, "profile": p,
                 "memory_mib": 9856} for gi, p in layout]
        self.file.write_text(json.dumps(self.doc))
        self.clock = FakeClock(T0)
        self.backend = SimulatedBackend(self.file, clock=self.clock)
        self.state = NodeState()
        self.monitor = Monitor(self.backend, self.state, HealthConfig(), 5.0, threading.Event(),
                               StateStore(tmp / "state"), clock=self.clock)
        self.poll()

    def signal(self, index: int, **signals: Any) -> None:
        self.doc["gpus"][index]["signals"].update(signals)
        self.file.write_text(json.dumps(self.doc))
        assert self.backend.reload()
        events = self.backend.wait_events(0)
        if events:
            self.monitor.handle_events(events)
        self.poll()

    def poll(self) -> None:
        self.clock.advance(5)
        self.monitor.poll_once()

    def slice(self, settings: rs.SliceSettings = MIXED) -> dict[str, Any]:
        snap = self.state.snapshot()
        return rs.resource_slice(rs.published_devices(snap.devices, settings.mig_strategy), settings)

    def taints(self, settings: rs.SliceSettings = MIXED) -> dict[str, tuple[str, str, str]]:
        return {d["name"]: (t["key"], t.get("value", ""), t["effect"])
                for d in devices(self.slice(settings)) for t in d.get("taints", [])}


def test_a_fault_of_the_gpu_taints_every_instance_of_it_and_only_those(tmp_path: Path) -> None:
    node = MonitoredNode(tmp_path)
    assert [d["name"] for d in devices(node.slice())][:9] == [
        "gpu-0-mig-1-0", "gpu-0-mig-2-0", *(f"gpu-1-mig-{gi}-0" for gi in GI_1G)]
    assert node.taints() == {}
    node.signal(1, xid_events=[79])
    unhealthy = ("gpu-health.io/unhealthy", "xid-79", "NoSchedule")
    assert node.taints() == {f"gpu-1-mig-{gi}-0": unhealthy for gi in GI_1G}
    # The health stream says the same of the same names.
    reports = {r.device: r for r in device_health(node.state.snapshot(), None,
                                                  HealthSettings(pool=NODE, mig_strategy="mixed"))}
    assert [n for n, r in reports.items() if r.health != "HEALTHY"] == [f"gpu-1-mig-{gi}-0" for gi in GI_1G]
    assert reports["gpu-1-mig-9-0"].message.startswith("xid-79: ")
    assert reports["gpu-0-mig-1-0"].health == reports["gpu-2"].health == "HEALTHY"
    # Under none the same fault is the whole GPU's taint.
    assert node.taints(NONE) == {"gpu-1": unhealthy}


def test_a_fault_of_one_instance_taints_that_instance_alone(tmp_path: Path) -> None:
    node = MonitoredNode(tmp_path)
    node.signal(0, mig_events=[{"gpu_instance_id": 2, "xid": 79}])
    assert node.taints() == {"gpu-0-mig-2-0": ("gpu-health.io/unhealthy", "xid-79", "NoSchedule")}
    assert node.taints(NONE) == {}  # the GPU itself is not faulty: whole, it carries no taint


def test_a_layout_change_is_a_new_slice(tmp_path: Path) -> None:
    node = MonitoredNode(tmp_path)
    before = [d["name"] for d in devices(node.slice())]
    node.doc["gpus"][0]["mig_devices"] = [{"uuid": "MIG-00000005-1111-4000-8000-000000000005",
                                           "gpu_instance_id": 5, "profile": "4g.40gb", "memory_mib": 40192}]
    node.doc["gpus"][1].pop("mig_devices")
    node.signal(0)
    after = [d["name"] for d in devices(node.slice())]
    assert before[:9] == ["gpu-0-mig-1-0", "gpu-0-mig-2-0", *(f"gpu-1-mig-{gi}-0" for gi in GI_1G)]
    assert after == ["gpu-0-mig-5-0", *(f"gpu-{i}" for i in range(1, 8))]


# The writer ------------------------------------------------------------------------------------------------------

def test_the_writer_republishes_the_slice_when_the_mig_layout_changes_and_not_otherwise() -> None:
    state, clock, server = NodeState(), FakeClock(1000.0), FakeSliceServer()
    nd = Node(state, n=2, migs=2)
    writer = SliceWriter(state, MIXED, lambda: server, debounce_s=1.0, min_interval_s=10.0, clock=clock,
                         rng=random.Random(7))

    def run(seconds: float) -> None:
        end = clock.now + seconds
        while clock.now < end:
            clock.now = min(max(writer.tick(clock.now), clock.now + 0.5), end)

    nd.publish(T0)
    run(30)
    stored = server.slices[f"{NODE}-{D}"]
    assert [d["name"] for d in devices(stored)] == ["gpu-0-mig-1-0", "gpu-0-mig-2-0", "gpu-1-mig-1-0",
                                                    "gpu-1-mig-2-0"]
    generation = stored["spec"]["pool"]["generation"]
    server.calls.clear()
    nd.publish(T0 + 30)  # the same layout and states: nothing to write
    run(60)
    assert server.writes() == []
    # GPU 1's instances are destroyed and one larger one made; GPU 0 leaves MIG mode.
    g0, g1 = nd.gpus
    new = MigDevice(uuid="MIG-0001-9-dddd-eeee-000000000009", parent_uuid=g1.uuid, gpu_instance_id=3,
                    compute_instance_id=0, profile="4g.40gb", memory_mib=40192)
    nd.gpus = [replace(g0, mig_devices=()), replace(g1, mig_devices=(new,))]
    nd.current = {nd.gpus[0].uuid: status(nd.gpus[0]), nd.gpus[1].uuid: status(nd.gpus[1]),
                  new.uuid: status(nd.gpus[1], mig=new)}
    nd.publish(T0 + 90)
    run(30)
    assert server.writes() == [("update", 200)]
    stored = server.slices[f"{NODE}-{D}"]
    assert [(d["name"], attr(d, "uuid")) for d in devices(stored)] == [("gpu-0", g0.uuid),
                                                                      ("gpu-1-mig-3-0", new.uuid)]
    assert stored["spec"]["pool"]["generation"] == generation + 1
    assert devices(stored)[1]["capacity"] == {f"{D}/memory": {"value": "40192Mi"}}


# The checkpoint and who holds a GPU ------------------------------------------------------------------------------

U1 = "6b1f0c2e-3d4a-4b5c-8d6e-7f8091a2b3c4"


def test_an_instance_is_checkpointed_with_its_parent_and_an_older_checkpoint_still_loads(tmp_path: Path) -> None:
    g = instances(gpu(0), [(1, "1g.10gb", 0)])
    m = g.mig_devices[0]
    inst = PreparedDevice(request_names=("mig",), pool=NODE, device="gpu-0-mig-1-0", uuid=m.uuid, minor=0,
                          cdi_ids=(f"{D}/gpu={U1}-gpu-0-mig-1-0",), parent_uuid=g.uuid)
    whole = PreparedDevice(request_names=("gpus",), pool=NODE, device="gpu-1", uuid=gpu(1).uuid, minor=1,
                           cdi_ids=(f"{D}/gpu={U1}-gpu-1",))
    cp = Checkpoint(tmp_path)
    cp.save({U1: PreparedClaim(U1, "ns", "c", (inst, whole))})
    doc = json.loads((tmp_path / Checkpoint.FILE).read_text())
    entries = doc["claims"][U1]["devices"]
    assert entries[0]["parent_uuid"] == g.uuid and "parent_uuid" not in entries[1]  # a whole GPU's is as before
    assert cp.load()[U1].devices == (inst, whole)
    # A checkpoint an older plugin wrote (no parent_uuid anywhere) reads as it always did.
    old = copy.deepcopy(doc)
    del old["claims"][U1]["devices"][0]["parent_uuid"]
    (tmp_path / Checkpoint.FILE).write_text(json.dumps(old))
    assert Checkpoint(tmp_path).load()[U1].devices == (replace(inst, parent_uuid=""), whole)
    # A parent_uuid of the wrong type is damage like any other field's.
    bad = copy.deepcopy(doc)
    bad["claims"][U1]["devices"][0]["parent_uuid"] = 7
    (tmp_path / Checkpoint.FILE).write_text(json.dumps(bad))
    assert Checkpoint(tmp_path).load() == {}
    assert (tmp_path / "dra-checkpoint.corrupt").exists()


def test_a_claim_on_an_instance_holds_its_gpu_also_once_the_instance_is_gone(tmp_path: Path) -> None:
    g = instances(gpu(0), [(1, "1g.10gb", 0), (2, "1g.10gb", 0)])
    m = g.mig_devices[1]
    busy = PreparedClaimHolders(tmp_path)
    dev = PreparedDevice(("mig",), NODE, "gpu-0-mig-2-0", m.uuid, 0, (f"{D}/gpu={U1}-gpu-0-mig-2-0",),
                         parent_uuid=g.uuid)
    Checkpoint(tmp_path).save({U1: PreparedClaim(U1, "ml", "infer", (dev,))})
    assert busy(g) == "held by claim ml/infer"
    assert busy(replace(g, mig_devices=())) == "held by claim ml/infer"  # destroyed, the pod may still run
    assert busy(gpu(1)) == ""
    # An entry without its parent still holds the GPU that lists the instance.
    Checkpoint(tmp_path).save({U1: PreparedClaim(U1, "ml", "infer", (replace(dev, parent_uuid=""),))})
    assert busy(g) == "held by claim ml/infer"
