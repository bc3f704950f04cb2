"""Allocatable ⇔ preparable: for every device state, health.kubeletHealth mapping, slice setting and claim
toleration, the scheduler may allocate a device from our ResourceSlice exactly when NodePrepareResources then
prepares it (with ``--allow-unhealthy-allocation``: at least then), and a prepared device's state reaches the pod's
status through the health stream.

The scheduler is played by ``scheduler_allocates``, written here from the resource.k8s.io/v1 API documentation
(DeviceTaint, DeviceToleration) and reading the slice object the writer would publish, not the module's own
decision; the driver is the real one with its CDI specs and checkpoint on disk, the API server's ResourceClaim
faked at the edge with the tolerations the allocation recorded."""

from __future__ import annotations

import itertools
import os
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugin.dra import slices as rs
from plugin.dra.driver import ClaimRef, Driver
from plugin.dra.health import HealthSettings, device_health
from plugin.health.node_state import DeviceStatus, NodeState
from plugin.health.reasons import KubeletHealth, State
from tests.fakes.node_devices import gpu, status

ROOT = Path(__file__).resolve().parents[2]
NODE = "gpu-node-1"
T0 = 1_767_225_600.0
DEV = "gpu-0"
INSTANCE = "gpu-0-mig-1-0"  # the first MIG instance of gpu(0, migs=...) under --mig-strategy mixed
CODES = {State.HEALTHY: (), State.DEGRADED: ("thermal-slowdown",), State.UNKNOWN: ("nvml-error",),
         State.UNHEALTHY: ("xid-79",)}


@pytest.fixture(autouse=True)
def no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of prepares: their durability is test_dra_checkpoint's business, not this file's."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


# The scheduler's side, from the API documentation ----------------------------------------------------------------

def toleration_matches(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """DeviceToleration: an empty key (operator Exists) matches every key; Exists matches any value, Equal (the
    default) the same value; an empty effect matches every effect."""
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return True
    return bool(toleration.get("value", "") == taint.get("value", ""))


def scheduler_allocates(slice_obj: Mapping[str, Any], device: str, tolerations: Sequence[Mapping[str, Any]]) -> bool:
    """A device can be allocated to a request when it is in the slice and every taint of it whose effect keeps
    claims off (NoSchedule, NoExecute; None and effects a consumer does not know only inform) is tolerated."""
    found = [d for d in slice_obj["spec"].get("devices", []) if d["name"] == device]
    if not found:
        return False
    return all(any(toleration_matches(t, taint) for t in tolerations)
               for taint in found[0].get("taints", []) if taint["effect"] in ("NoSchedule", "NoExecute"))


def documented_tolerations() -> list[dict[str, Any]]:
    """The claim tolerations docs/dra.md shows, as a user copies them."""
    text = (ROOT / "docs" / "dra.md").read_text()
    out: list[dict[str, Any]] = []
    for block in re.findall(r"```yaml\n(.*?)```", text, re.S):
        for doc in yaml.safe_load_all(block):
            stack: list[Any] = [doc]
            while stack:
                node = stack.pop()
                if isinstance(node, dict):
                    out.extend(node.get("tolerations") or [])
                    stack.extend(node.values())
                elif isinstance(node, list):
                    stack.extend(node)
    return out


# What claims may carry: nothing, what the docs show, and what a user may well write besides.
TOLERATIONS: dict[str, list[dict[str, Any]]] = {
    "none": [],
    "unknown, NoSchedule (docs)": [{"key": "gpu-health.io/unknown", "operator": "Exists", "effect": "NoSchedule"}],
    "degraded, any effect": [{"key": "gpu-health.io/degraded", "operator": "Exists"}],
    "unhealthy = xid-79": [{"key": "gpu-health.io/unhealthy", "operator": "Equal", "value": "xid-79"}],
    "unhealthy = xid-48": [{"key": "gpu-health.io/unhealthy", "value": "xid-48"}],
    "unhealthy, NoExecute only": [{"key": "gpu-health.io/unhealthy", "operator": "Exists", "effect": "NoExecute"}],
    "everything": [{"operator": "Exists"}],
    "every NoSchedule": [{"operator": "Exists", "effect": "NoSchedule"}],
    "another driver's key": [{"key": "example.com/unknown", "operator": "Exists"}],
}


# One device, one claim -------------------------------------------------------------------------------------------

class FakeClaims:
    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}

    def add(self, name: str, uid: str, tolerations: list[dict[str, Any]], device: str = DEV, share: str = "") -> None:
        result: dict[str, Any] = {"request": "gpus", "driver": rs.DRIVER, "pool": NODE, "device": device}
        if share:
            result["shareID"] = share  # one of several claims on a device the slice lets several hold
        if tolerations:
            result["tolerations"] = tolerations  # the allocation's copy of the request's tolerations
        self.claims[("ns", name)] = {"metadata": {"name": name, "namespace": "ns", "uid": uid},
                                     "status": {"allocation": {"devices": {"results": [result]}}}}

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        return self.claims[(namespace, name)]

    def close(self) -> None:
        pass


# What the one device of the node is: a whole GPU, or (--mig-strategy mixed) the MIG instance of a GPU with one,
# its state set on the GPU (an instance's status carries its parent's faults, as the monitor builds it) or on the
# instance alone.
DEVICES = ("gpu", "instance-by-its-gpu", "instance-alone")


class OneGpu:
    """A node of one GPU (or of one MIG instance, ``device``) in a given state, its slice as the writer would
    publish it, and the real driver."""

    def __init__(self, root: Path, settings: rs.SliceSettings, allow_unhealthy: bool, device: str = "gpu") -> None:
        self.state = NodeState()
        self.kind = device
        self.gpu = gpu(0) if device == "gpu" else gpu(0, migs=1)
        self.settings = settings if device == "gpu" else replace(settings, mig_strategy="mixed")
        self.name = DEV if device == "gpu" else INSTANCE
        self.api = FakeClaims()
        self.driver = Driver(self.state, self.api, NODE, root / "cdi", root / "state", str(root / "dev"),
                             allow_unhealthy=allow_unhealthy, slice_settings=lambda: self.settings)
        self.seq = itertools.count()

    def set(self, state: State, kubelet: KubeletHealth, now: float = T0) -> None:
        faulty = replace(status(self.gpu, state, *CODES[state], since=now), kubelet_health=kubelet)
        if self.kind == "gpu":
            self.state.publish([faulty], now)
            return
        [mig] = self.gpu.mig_devices
        own = replace(status(self.gpu, state, *CODES[state], since=now, mig=mig), kubelet_health=kubelet)
        parent = faulty if self.kind == "instance-by-its-gpu" else status(self.gpu, since=now)
        self.state.publish([parent, own], now)

    def status(self) -> DeviceStatus:
        """The status of the published device."""
        return self.state.snapshot().devices[0 if self.kind == "gpu" else 1]

    def slice(self) -> dict[str, Any]:
        snap = self.state.snapshot()
        return rs.desired_slice([self.gpu], rs.device_statuses(snap.devices), self.settings)

    def prepare(self, tolerations: list[dict[str, Any]]) -> tuple[bool, str]:
        """Allocate the device to a new claim with ``tolerations`` and ask the driver to prepare it; unprepared
        again at once so the next claim starts from the same node."""
        name = f"c{next(self.seq)}"
        uid = str(uuid.uuid4())
        self.api.add(name, uid, tolerations, self.name)
        ref = ClaimRef("ns", uid, name)
        result = self.driver.prepare([ref])[uid]
        assert self.driver.unprepare([ref]) == {uid: ""}
        return bool(result.devices), result.error


def check(node: OneGpu, tolerations: list[dict[str, Any]], allow_unhealthy: bool) -> None:
    slice_obj = node.slice()
    assert [d["name"] for d in slice_obj["spec"].get("devices", [])] in ([], [node.name])  # the GPU or its instance
    allocatable = scheduler_allocates(slice_obj, node.name, tolerations)
    prepared, error = node.prepare(tolerations)
    snap = node.state.snapshot()
    where = f"slice {slice_obj['spec'].get('devices')}, tolerations {tolerations}, error {error!r}"
    if allow_unhealthy:
        assert prepared, where  # the opt-in prepares whatever the scheduler hands over
    else:
        assert prepared == allocatable, where
    if prepared:
        # Its state reaches the pod's status: the health stream names the device, with the reason.
        [report] = device_health(snap, None, HealthSettings(pool=NODE, mig_strategy=node.settings.mig_strategy))
        assert report.device == node.name
        d = node.status()
        assert (report.health == "HEALTHY") == (d.state in (State.HEALTHY, State.DEGRADED)), report
        if d.state is not State.HEALTHY:
            assert report.message.startswith(CODES[d.state][0]), report
    else:
        assert "refusing to prepare" in error and node.name in error, error


STATES_AND_MAPPINGS = [(s, k) for s in State for k in KubeletHealth
                       if not (s is State.HEALTHY and k is KubeletHealth.UNHEALTHY)]  # config refuses that one


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("allow_unhealthy", [False, True], ids=["strict", "allow-unhealthy"])
@pytest.mark.parametrize("degraded_taint", [True, False], ids=["degraded-taint", "no-degraded-taint"])
@pytest.mark.parametrize("effect", ["NoSchedule", "NoExecute"])
@pytest.mark.parametrize("taints", [True, False], ids=["taints", "gate-off"])
@pytest.mark.parametrize(("state", "kubelet"), STATES_AND_MAPPINGS, ids=[f"{s}-as-{k}" for s, k in STATES_AND_MAPPINGS])
def test_allocatable_iff_preparable_for_every_combination(tmp_path: Path, state: State, kubelet: KubeletHealth,
                                                         taints: bool, effect: str, degraded_taint: bool,
                                                         allow_unhealthy: bool, device: str) -> None:
    settings = rs.SliceSettings(node_name=NODE, unhealthy_effect=effect, unknown_effect=effect,
                                degraded_taint=degraded_taint, taints=taints)
    node = OneGpu(tmp_path, settings, allow_unhealthy, device)
    node.set(state, kubelet)
    # The mapping decides for a claim that tolerates nothing: it gets the device exactly when the mapping says
    # pods may use it; a claim gets a device the mapping keeps from pods only by tolerating its taint.
    assert scheduler_allocates(node.slice(), node.name, []) == (kubelet is KubeletHealth.HEALTHY)
    for tolerations in TOLERATIONS.values():
        check(node, tolerations, allow_unhealthy)


def test_the_docs_toleration_gets_an_unknown_device_prepared_with_unknown_in_pod_status(tmp_path: Path) -> None:
    """docs/dra.md's example, as written there: a claim tolerating the Unknown taint is allocated an Unknown
    device (Unknown maps to Unhealthy by default) and the driver prepares it."""
    tolerations = documented_tolerations()
    assert tolerations == [{"key": "gpu-health.io/unknown", "operator": "Exists", "effect": "NoSchedule"}]
    node = OneGpu(tmp_path, rs.SliceSettings(node_name=NODE), allow_unhealthy=False)
    node.set(State.UNKNOWN, KubeletHealth.UNHEALTHY)
    assert scheduler_allocates(node.slice(), DEV, tolerations)
    assert not scheduler_allocates(node.slice(), DEV, [])
    assert node.prepare(tolerations) == (True, "")
    [report] = device_health(node.state.snapshot(), None, HealthSettings(pool=NODE))
    assert (report.health, report.message.split(":")[0]) == ("UNKNOWN", "nvml-error")
    assert node.prepare([])[0] is False


def test_a_degraded_device_kept_from_pods_by_the_mapping_is_not_allocatable(tmp_path: Path) -> None:
    """health.kubeletHealth.Degraded=Unhealthy: the driver will not prepare a Degraded device for a claim that
    does not ask for one, so the slice must not let the scheduler allocate it (an effect-None taint would)."""
    node = OneGpu(tmp_path, rs.SliceSettings(node_name=NODE), allow_unhealthy=False)
    node.set(State.DEGRADED, KubeletHealth.UNHEALTHY)
    prepared, error = node.prepare([])
    assert not prepared and "Degraded (thermal-slowdown)" in error
    assert not scheduler_allocates(node.slice(), DEV, [])


def test_every_promise_in_docs_dra_names_tests_that_exist() -> None:
    text = (ROOT / "docs" / "dra.md").read_text()
    section = text[text.index("## Promises"):text.index("## Proof")]
    promises = section.split("\n- ")[1:]
    assert len(promises) >= 10
    for promise in promises:
        cited = re.findall(r"`((?:tests/[a-z_/]+/)?test_[a-z_0-9]+\.py)(?:::([a-z_0-9]+))?`", promise)
        assert cited, promise
        for path, name in cited:
            file = ROOT / (path if path.startswith("tests/") else f"tests/unit/{path}")
            assert file.is_file(), path
            assert not name or f"def {name}(" in file.read_text(), f"{path}::{name}"
