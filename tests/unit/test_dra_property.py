"""Allocatable ⇔ preparable as a stateful property: random device states, health.kubeletHealth mappings, slice
settings, clusters with and without device taints, claims with random tolerations, driver restarts. After every
step, with the slice writer settled on the (fake) API server:

- the slice the server holds lets the scheduler allocate a device to a toleration set exactly when the rule
  Prepare applies (``resourceslices.allocatable``) says so;
- a claim that tolerates nothing may be allocated exactly the devices health.kubeletHealth maps to Healthy;
- a claim the scheduler allocates is prepared, one it would not allocate (allocated earlier, or forged) is refused,
  unless ``--allow-unhealthy-allocation`` prepares everything;
- every prepared claim's devices are named in the health stream, so their state reaches the pod's status.

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

from plugin.dra import slices as rs
from plugin.dra.driver import ClaimRef, Driver
from plugin.dra.health import HealthSettings, device_health
from plugin.dra.slicewriter import SliceWriter
from plugin.health.node_state import NodeState
from plugin.health.reasons import KubeletHealth, State
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
        # Durability is test_dra_checkpoint's business: thousands of prepares here need no fsync.
        self._fsync = os.fsync
        os.fsync = lambda fd: None

    @initialize(mapping=st.fixed_dictionaries({s: st.sampled_from(list(KubeletHealth))
                                               for s in (State.DEGRADED, State.UNKNOWN, State.UNHEALTHY)}),
                unhealthy_effect=st.sampled_from(rs.TAINT_EFFECTS), unknown_effect=st.sampled_from(rs.TAINT_EFFECTS),
                degraded_taint=st.booleans(), gate_on=st.booleans(), allow_unhealthy=st.booleans())
    def start(self, mapping: dict[State, KubeletHealth], unhealthy_effect: str, unknown_effect: str,
              degraded_taint: bool, gate_on: bool, allow_unhealthy: bool) -> None:
        self.mapping = {State.HEALTHY: KubeletHealth.HEALTHY, **mapping}
        self.allow_unhealthy = allow_unhealthy
        self.server = FakeSliceServer(drop_taints=not gate_on)
        self.writer = SliceWriter(self.state, rs.SliceSettings(node_name=NODE, unhealthy_effect=unhealthy_effect,
                                                               unknown_effect=unknown_effect,
                                                               degraded_taint=degraded_taint),
                                  lambda: self.server, clock=self.clock, rng=random.Random(0))
        self.current = {g.uuid: status(g, since=T0) for g in self.gpus}
        self._publish()
        self.driver = self._driver()

    def _driver(self) -> Driver:
        return Driver(self.state, self.api, NODE, self.root / "cdi", self.root / "state", str(self.root / "dev"),
                      allow_unhealthy=self.allow_unhealthy, slice_settings=lambda: self.writer.settings)

    def _publish(self) -> None:
        self.state.publish(list(self.current.values()), T0 + self.clock.now)
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

    @rule(index=st.integers(0, GPUS - 1), tol=tolerations, scheduled=st.booleans())
    def claim(self, index: int, tol: list[dict[str, Any]], scheduled: bool) -> None:
        """A claim for one device: ``scheduled``, the scheduler picked it from the slice (only if it may);
        otherwise it was allocated before the device changed (or forged), and the driver alone decides."""
        device = f"gpu-{index}"
        allocatable = scheduler_allocates(self._slice(), device, tol)
        if scheduled and not allocatable:
            return
        name, uid = f"c{next(self.names)}", str(uuid.uuid4())
        self.api.add(name, uid, tol, device)
        ref = ClaimRef("ns", uid, name)
        result = self.driver.prepare([ref])[uid]
        prepared = bool(result.devices)
        if self.allow_unhealthy:
            assert prepared, result.error
        else:
            assert prepared == allocatable, (device, tol, self._slice()["spec"].get("devices"), result.error)
        if prepared:
            self.prepared[uid] = (ref, device)

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
    def the_published_slice_and_prepare_agree(self) -> None:
        if not hasattr(self, "writer"):
            return
        slice_obj, now = self._slice(), self.writer.settings
        by_name = {f"gpu-{d.gpu.index}": d for d in self.state.snapshot().devices}
        for device, st_ in by_name.items():
            for tol in PROBES:
                assert scheduler_allocates(slice_obj, device, tol) == rs.allocatable(st_, now, tol), \
                    (device, st_.state, st_.kubelet_health, tol, slice_obj["spec"].get("devices"))

    @invariant()
    def the_mapping_decides_for_claims_that_tolerate_nothing(self) -> None:
        """health.kubeletHealth says which devices pods get: a claim without tolerations is allocated exactly the
        devices it maps to Healthy; one it maps to Unhealthy only to a claim that tolerates its taint."""
        if not hasattr(self, "writer"):
            return
        slice_obj = self._slice()
        for d in self.state.snapshot().devices:
            usable = d.kubelet_health is KubeletHealth.HEALTHY
            assert scheduler_allocates(slice_obj, f"gpu-{d.gpu.index}", []) == usable, (d.state, d.kubelet_health)

    @invariant()
    def prepared_devices_are_in_the_health_stream(self) -> None:
        if not hasattr(self, "writer"):
            return
        reports = {r.device: r for r in device_health(self.state.snapshot(), None, HealthSettings(pool=NODE))}
        for _, device in self.prepared.values():
            assert device in reports

    def teardown(self) -> None:
        os.fsync = self._fsync
        shutil.rmtree(self.root, ignore_errors=True)


DraNode.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
TestDraAllocatableIffPreparable = DraNode.TestCase
