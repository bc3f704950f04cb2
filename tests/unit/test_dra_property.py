"""Allocatable ⇔ preparable as a stateful property: random device states, health.kubeletHealth mappings, slice
settings, clusters with and without device taints, claims with random tolerations, driver restarts. After every
step, with the slice writer settled on the (fake) API server:

- the slice the server holds lets the scheduler allocate a device to a toleration set exactly when the rule
  Prepare applies (``resourceslices.allocatable``) says so;
- a claim that tolerates nothing may be allocated exactly the devices health.kubeletHealth maps to Healthy;
- a claim the scheduler allocates is prepared, one it would not allocate (allocated earlier, or forged) is refused,
  unless ``--allow-unhealthy-allocation`` prepares everything;
- every prepared claim's devices are named in the health stream, so their state reaches the pod's status (while
  the device exists: a destroyed MIG instance is reported no more, and the kubelet then shows it Unknown).

Some GPUs (and their instances) are shared by the sharing section, on clusters that keep allowMultipleAllocations
and on ones that drop it (the DRAConsumableCapacity gate off): the slice says so of exactly those devices while the
cluster keeps it, the scheduler places at most that many claims on one (one on any other device), each prepared with
its shareID, and a shared device's state reaches every claim on it like any other's.

Nodes have GPUs with MIG instances, published whole (``--mig-strategy none``) or as their instances (``mixed``);
an instance's state is its own combined with its GPU's, as the monitor publishes it, and the MIG layout changes
under prepared claims. The devices a claim may name, and the names the slice must use, are written out here
(``gpu-<index>``, ``gpu-<index>-mig-<gi>-<ci>``), not taken from the module under test.

The scheduler is ``scheduler_allocates`` from test_dra_allocatable.py, written from the API documentation."""

from __future__ import annotations

import itertools
import os
import random
import shutil
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from plugin.devices.model import Gpu, MigDevice
from plugin.dra import slices as rs
from plugin.dra.driver import ClaimRef, Driver
from plugin.dra.health import HealthSettings, device_health
from plugin.dra.slicewriter import SliceWriter
from plugin.health.node_state import DeviceStatus, NodeState
from plugin.health.reasons import KubeletHealth, State
from plugin.sharing.config import parse_sharing
from tests.conftest import FakeClock
from tests.fakes.node_devices import gpu, status
from tests.unit.test_dra_allocatable import CODES, FakeClaims, scheduler_allocates
from tests.unit.test_slicewriter import FakeSliceServer

NODE = "gpu-node-1"
NAME = f"{NODE}-{rs.DRIVER}"
GPUS = 4
T0 = 1_767_225_600.0
PREFIX = "gpu-health.io"

# Tolerations as users write them, valid by the API's rules (an empty key only with operator Exists).
toleration = st.fixed_dictionaries(
    {"key": st.sampled_from(["", f"{PREFIX}/unhealthy", f"{PREFIX}/unknown", f"{PREFIX}/degraded",
                             "example.com/unhealthy"]),
     "operator": st.sampled_from(["Exists", "Equal"])},
    optional={"value": st.sampled_from(["xid-79", "nvml-error", "thermal-slowdown", "xid-48"]),
              "effect": st.sampled_from(["NoSchedule", "NoExecute"])},
).filter(lambda t: bool(t["key"]) or t["operator"] == "Exists").map(
    lambda t: {k: v for k, v in t.items() if not (k == "value" and t["operator"] == "Exists")})
tolerations = st.lists(toleration, max_size=3)
# A few fixed sets the invariant checks every device against after every step.
PROBES: list[list[dict[str, Any]]] = [
    [], [{"operator": "Exists"}], [{"key": f"{PREFIX}/unknown", "operator": "Exists", "effect": "NoSchedule"}],
    [{"key": f"{PREFIX}/unhealthy", "operator": "Equal", "value": "xid-79"}],
    [{"key": f"{PREFIX}/degraded", "operator": "Exists", "effect": "NoExecute"}],
]


MAX_INSTANCES = 3


class DraNode(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="dra-prop-"))
        self.gpus = [gpu(i) for i in range(GPUS)]
        self.state = NodeState()
        self.api = FakeClaims()
        self.clock = FakeClock(1000.0)
        self.prepared: dict[str, tuple[ClaimRef, str]] = {}  # uid -> (claim, device)
        self.names = itertools.count()
        self.layouts = itertools.count()
        self.gone: set[str] = set()  # names of MIG instances destroyed since
        # Durability is test_dra_checkpoint's business: thousands of prepares here need no fsync.
        self._fsync = os.fsync
        os.fsync = lambda fd: None

    @initialize(mapping=st.fixed_dictionaries({s: st.sampled_from(list(KubeletHealth))
                                               for s in (State.DEGRADED, State.UNKNOWN, State.UNHEALTHY)}),
                unhealthy_effect=st.sampled_from(rs.TAINT_EFFECTS), unknown_effect=st.sampled_from(rs.TAINT_EFFECTS),
                degraded_taint=st.booleans(), gate_on=st.booleans(), allow_unhealthy=st.booleans(),
                mig_strategy=st.sampled_from(rs.MIG_STRATEGIES),
                instances=st.lists(st.integers(0, MAX_INSTANCES), min_size=GPUS, max_size=GPUS),
                shared=st.sets(st.integers(0, GPUS - 1), max_size=2), replicas=st.integers(2, 3),
                consumable_on=st.booleans())
    def start(self, mapping: dict[State, KubeletHealth], unhealthy_effect: str, unknown_effect: str,
              degraded_taint: bool, gate_on: bool, allow_unhealthy: bool, mig_strategy: str,
              instances: list[int], shared: set[int], replicas: int, consumable_on: bool) -> None:
        self.mapping = {State.HEALTHY: KubeletHealth.HEALTHY, **mapping}
        self.allow_unhealthy = allow_unhealthy
        self.mig_strategy = mig_strategy
        self.gpus = [self._layout(g, n) for g, n in zip(self.gpus, instances, strict=True)]
        self.shared, self.replicas, self.consumable_on = shared, replicas, consumable_on
        self.server = FakeSliceServer(drop_taints=not gate_on, drop_sharing=not consumable_on)
        ids = sorted(shared)
        sharing = parse_sharing({"timeSlicing": {"resources": [
            {"name": "nvidia.com/gpu", "replicas": replicas, "devices": ids},
            {"name": "nvidia.com/mig-1g.10gb", "replicas": replicas, "devices": ids}]}} if ids else None)
        self.writer = SliceWriter(self.state, rs.SliceSettings(node_name=NODE, unhealthy_effect=unhealthy_effect,
                                                               unknown_effect=unknown_effect,
                                                               degraded_taint=degraded_taint,
                                                               mig_strategy=mig_strategy, sharing=sharing),
                                  lambda: self.server, clock=self.clock, rng=random.Random(0))
        self.current = {g.uuid: status(g, since=T0) for g in self.gpus}  # each GPU's own status
        self.own: dict[str, DeviceStatus] = {}  # a MIG instance's own fault, by its UUID
        self._publish()
        self.driver = self._driver()

    def _layout(self, g: Gpu, n: int) -> Gpu:
        """``g`` with ``n`` MIG instances, new ones each time (new UUIDs): a layout change destroys and creates."""
        layout = next(self.layouts)
        migs = tuple(MigDevice(uuid=f"MIG-{g.index:04d}-{layout:04d}-{k}-eeee-{k:012d}", parent_uuid=g.uuid,
                               gpu_instance_id=k + 1 + layout % 2, compute_instance_id=0, profile="1g.10gb",
                               memory_mib=9856)
                     for k in range(n))
        return replace(g, mig_devices=migs)

    def _driver(self) -> Driver:
        return Driver(self.state, self.api, NODE, self.root / "cdi", self.root / "state", str(self.root / "dev"),
                      allow_unhealthy=self.allow_unhealthy, slice_settings=lambda: self.writer.settings)

    def _statuses(self) -> list[DeviceStatus]:
        """Every device's status as the monitor publishes them: a GPU's own, and each of its instances with the
        worst of its own state and its GPU's, its own reasons first."""
        out: list[DeviceStatus] = []
        for g in self.gpus:
            parent = replace(self.current[g.uuid], gpu=g)
            out.append(parent)
            for m in g.mig_devices:
                own = self.own.get(m.uuid)
                state = State.worst(parent.state, own.state) if own is not None else parent.state
                reasons = (own.reasons if own is not None else ()) + parent.reasons
                since = max(parent.since, own.since) if own is not None else parent.since
                out.append(DeviceStatus(m.uuid, g, state, reasons, since, self.mapping[state], m))
        return out

    def _devices(self) -> dict[str, DeviceStatus]:
        """The devices the slice must publish under their names, written out from the rule, with their statuses."""
        snap = self.state.snapshot()
        out: dict[str, DeviceStatus] = {}
        for g in self.gpus:
            if self.mig_strategy == "mixed" and g.mig_devices:
                for m in g.mig_devices:
                    d = snap.get(m.uuid)
                    assert d is not None
                    out[f"gpu-{g.index}-mig-{m.gpu_instance_id}-{m.compute_instance_id}"] = d
            else:
                d = snap.get(g.uuid)
                assert d is not None
                out[f"gpu-{g.index}"] = d
        return out

    def _publish(self) -> None:
        self.state.publish(self._statuses(), T0 + self.clock.now)
        self._settle()

    def _settle(self) -> None:
        """Run the writer on its virtual clock until it has nothing left to write."""
        end = self.clock.now + 60
        while self.clock.now < end:
            deadline = self.writer.tick(self.clock.now)
            self.clock.now = min(max(deadline, self.clock.now + 0.5), end)

    def _slice(self) -> dict[str, Any]:
        return self.server.slices[NAME]

    # Steps ----------------------------------------------------------------------------------------------------

    @rule(index=st.integers(0, GPUS - 1), state=st.sampled_from(list(State)))
    def device_changes_state(self, index: int, state: State) -> None:
        g = self.gpus[index]
        self.current[g.uuid] = replace(status(g, state, *CODES[state], since=T0 + self.clock.now),
                                       kubelet_health=self.mapping[state])
        self._publish()

    @precondition(lambda self: any(g.mig_devices for g in self.gpus))
    @rule(data=st.data(), state=st.sampled_from(list(State)))
    def instance_changes_state(self, data: st.DataObject, state: State) -> None:
        """A fault of one MIG instance alone (an XID scoped to its GPU instance), or its recovery."""
        g, m = data.draw(st.sampled_from([(g, m) for g in self.gpus for m in g.mig_devices]))
        self.own[m.uuid] = status(g, state, *CODES[state], since=T0 + self.clock.now, mig=m)
        self._publish()

    @rule(index=st.integers(0, GPUS - 1), instances=st.integers(0, MAX_INSTANCES))
    def mig_layout_changes(self, index: int, instances: int) -> None:
        """The node's MIG layout changes under whatever is prepared: the GPU's instances are destroyed and
        ``instances`` new ones made (none: the GPU leaves MIG mode)."""
        g = self.gpus[index]
        if self.mig_strategy == "mixed":
            # What the slice stops publishing: the old instances, or the whole GPU that now has instances.
            self.gone |= {f"gpu-{index}-mig-{m.gpu_instance_id}-{m.compute_instance_id}" for m in g.mig_devices}
            if not g.mig_devices and instances:
                self.gone.add(f"gpu-{index}")
        for m in g.mig_devices:
            self.own.pop(m.uuid, None)
        self.gpus[index] = self._layout(g, instances)
        self._publish()

    @rule(data=st.data(), tol=tolerations, scheduled=st.booleans())
    def claim(self, data: st.DataObject, tol: list[dict[str, Any]], scheduled: bool) -> None:
        """A claim for one device: ``scheduled``, the scheduler picked it from the slice (only if it may);
        otherwise it was allocated before the device changed (or forged, or its instance destroyed since), and
        the driver alone decides."""
        published = self._devices()
        candidates = sorted(set(published) | self.gone | {f"gpu-{i}" for i in range(GPUS)})
        device = data.draw(st.sampled_from(candidates))
        allocatable = scheduler_allocates(self._slice(), device, tol)
        room = self._room(device)
        if scheduled and not (allocatable and room):
            return
        share = str(uuid.uuid4()) if scheduled and self._capacity(device) > 1 else ""
        name, uid = f"c{next(self.names)}", str(uuid.uuid4())
        self.api.add(name, uid, tol, device, share=share)
        ref = ClaimRef("ns", uid, name)
        result = self.driver.prepare([ref])[uid]
        prepared = bool(result.devices)
        if device not in published:
            # Not a device of the node now (a GPU published as its instances, an instance destroyed): never
            # prepared, whatever the opt-in, and never allocatable.
            assert not prepared and not allocatable and "is not a GPU or MIG instance" in result.error, result
        elif self.allow_unhealthy:
            assert prepared, result.error
        else:
            assert prepared == allocatable, (device, tol, self._slice()["spec"].get("devices"), result.error)
        if prepared:
            [got] = result.devices
            d = published[device]
            # What NVIDIA_VISIBLE_DEVICES will name: the instance's own UUID, or the whole GPU's.
            assert got.uuid == (d.mig.uuid if d.mig is not None else d.gpu.uuid)
            assert got.minor == d.gpu.dev_minor
            assert got.share_id == share  # the kubelet keys a share by it
            self.prepared[uid] = (ref, device)

    def _capacity(self, device: str) -> int:
        """How many claims the scheduler may place on ``device`` as the slice publishes it: its shares where it
        may be allocated more than once, else one."""
        for d in self._slice()["spec"].get("devices", []):
            if d["name"] == device and d.get("allowMultipleAllocations"):
                return int(d["capacity"][f"{rs.DRIVER}/shares"]["value"])
        return 1

    def _room(self, device: str) -> bool:
        return sum(1 for _, dev in self.prepared.values() if dev == device) < self._capacity(device)

    @precondition(lambda self: bool(self.prepared))
    @rule(data=st.data())
    def unprepare(self, data: st.DataObject) -> None:
        uid = data.draw(st.sampled_from(sorted(self.prepared)))
        ref, _ = self.prepared.pop(uid)
        assert self.driver.unprepare([ref]) == {uid: ""}

    @rule()
    def driver_restarts(self) -> None:
        self.driver = self._driver()
        assert set(self.driver.prepared()) == set(self.prepared)

    # After every step -----------------------------------------------------------------------------------------

    @invariant()
    def the_slice_publishes_exactly_the_nodes_devices(self) -> None:
        """Each device under its name, of its type, naming the UUID a pod will see; nothing else."""
        if not hasattr(self, "writer"):
            return
        published = self._devices()
        for dev in self._slice()["spec"].get("devices", []):
            d = published[dev["name"]]
            attrs = {k.split("/", 1)[1]: next(iter(v.values())) for k, v in dev["attributes"].items()}
            if d.mig is None:
                assert (attrs["type"], attrs["uuid"], attrs["index"]) == ("gpu", d.gpu.uuid, d.gpu.index)
            else:
                assert (attrs["type"], attrs["uuid"], attrs["index"], attrs["parentUUID"]) == \
                    ("mig", d.mig.uuid, d.gpu.index, d.gpu.uuid)

    @invariant()
    def exactly_the_shared_devices_take_several_claims_while_the_cluster_keeps_it(self) -> None:
        """A GPU the sharing section names, or an instance of one, is published for ``replicas`` claims, each
        taking one share and no memory unless it asks; every other device, and every device on a cluster that drops
        allowMultipleAllocations, for one."""
        if not hasattr(self, "writer"):
            return
        published = self._devices()
        for dev in self._slice()["spec"].get("devices", []):
            want = self.consumable_on and published[dev["name"]].gpu.index in self.shared
            assert bool(dev.get("allowMultipleAllocations")) == want, (dev["name"], dev)
            shares = (dev.get("capacity") or {}).get(f"{rs.DRIVER}/shares")
            if want:
                assert shares is not None and shares["value"] == str(self.replicas)
                assert shares["requestPolicy"]["default"] == "1"
                memory = dev["capacity"].get(f"{rs.DRIVER}/memory")
                assert memory is None or memory["requestPolicy"]["default"] == "0"
            else:
                assert shares is None

    @invariant()
    def the_published_slice_and_prepare_agree(self) -> None:
        if not hasattr(self, "writer"):
            return
        slice_obj, now = self._slice(), self.writer.settings
        for device, st_ in self._devices().items():
            for tol in PROBES:
                assert scheduler_allocates(slice_obj, device, tol) == rs.allocatable(st_, now, tol), \
                    (device, st_.state, st_.kubelet_health, tol, slice_obj["spec"].get("devices"))

    @invariant()
    def the_mapping_decides_for_claims_that_tolerate_nothing(self) -> None:
        """health.kubeletHealth says which devices pods get: a claim without tolerations is allocated exactly the
        devices it maps to Healthy; one it maps to Unhealthy only to a claim that tolerates its taint. An
        instance's state is its own combined with its GPU's, so the mapping of that decides."""
        if not hasattr(self, "writer"):
            return
        slice_obj = self._slice()
        for device, d in self._devices().items():
            usable = d.kubelet_health is KubeletHealth.HEALTHY
            assert scheduler_allocates(slice_obj, device, []) == usable, (device, d.state, d.kubelet_health)

    @invariant()
    def prepared_devices_are_in_the_health_stream(self) -> None:
        if not hasattr(self, "writer"):
            return
        settings_ = HealthSettings(pool=NODE, mig_strategy=self.mig_strategy)
        reports = {r.device: r for r in device_health(self.state.snapshot(), None, settings_)}
        published = self._devices()
        assert set(reports) == set(published)  # every device of the slice, listed or left out, and no other
        for _, device in self.prepared.values():
            assert device in reports or device in self.gone, device

    def teardown(self) -> None:
        os.fsync = self._fsync
        shutil.rmtree(self.root, ignore_errors=True)


DraNode.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
TestDraAllocatableIffPreparable = DraNode.TestCase
