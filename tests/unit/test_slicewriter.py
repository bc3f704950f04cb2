"""The ResourceSlice writer (plugin/dra/slicewriter.py) on a virtual clock, against a fake API server at the edge
that keeps the slice as a server would: a resourceVersion bumped on every write, 409 for a stale one, 404 for a
missing object, immutable fields refused, and, when told, taints dropped (the DRADeviceTaints gate off) or the
whole resource.k8s.io/v1 group not served."""

from __future__ import annotations

import copy
import logging
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from plugin.dra import slices as rs
from plugin.dra.slicewriter import SliceWriter
from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from plugin.kube.errors import ApiFailure
from plugin.kube.events import rfc3339
from plugin.kube.names import DEFAULT_PREFIX
from plugin.kube.views import NodeView
from plugin.sharing.config import parse_sharing
from tests.conftest import FakeClock
from tests.fakes.node_devices import Node

NODE = "gpu-node-1"
NAME = f"{NODE}-{rs.DRIVER}"
T0 = 1_767_225_600.0
P = DEFAULT_PREFIX


@dataclass
class FakeSliceServer:
    """The API server's side of the calls SliceApi makes; every call is recorded as (verb, outcome)."""

    drop_taints: bool = False
    drop_sharing: bool = False  # as an API server with DRAConsumableCapacity off stores a shared device
    served: bool = True
    node_uid: str = "uid-node-1"
    slices: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[tuple[str, int]] = field(default_factory=list)
    rv: int = 100
    closed: int = 0
    created: threading.Event = field(default_factory=threading.Event)

    def _fail(self, verb: str, status: int, message: str) -> ApiFailure:
        self.calls.append((verb, status))
        return ApiFailure(status, message)

    def _store(self, name: str, body: Mapping[str, Any], uid: str) -> dict[str, Any]:
        obj = copy.deepcopy(dict(body))
        self.rv += 1
        obj["metadata"].update({"resourceVersion": str(self.rv), "uid": uid,
                                "creationTimestamp": "2026-01-01T00:00:00Z"})
        if self.drop_taints:
            for d in obj["spec"].get("devices", []):
                d.pop("taints", None)
        if self.drop_sharing:
            for d in obj["spec"].get("devices", []):
                d.pop("allowMultipleAllocations", None)
                for cap in (d.get("capacity") or {}).values():
                    cap.pop("requestPolicy", None)
        self.slices[name] = obj
        return copy.deepcopy(obj)

    def get_node(self, name: str) -> NodeView:
        if name != NODE:
            raise self._fail("get_node", 404, f'nodes "{name}" not found')
        self.calls.append(("get_node", 200))
        return NodeView(name, self.node_uid, "1", {})

    def get_resource_slice(self, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", 200 if name in self.slices else 404))
        return copy.deepcopy(self.slices.get(name))

    def create_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if not self.served:
            raise self._fail("create", 404, "the server could not find the requested resource")
        name = body["metadata"]["name"]
        if name in self.slices:
            raise self._fail("create", 409, f'resourceslices "{name}" already exists')
        if "resourceVersion" in body["metadata"]:
            raise self._fail("create", 400, "resourceVersion should not be set on objects to be created")
        self.calls.append(("create", 201))
        stored = self._store(name, body, f"uid-slice-{self.rv}")
        self.created.set()
        return stored

    def update_resource_slice(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        current = self.slices.get(name)
        if current is None:
            raise self._fail("update", 404, f'resourceslices "{name}" not found')
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            raise self._fail("update", 409, "the object has been modified; please apply your changes to the "
                                             "latest version and try again")
        for key in ("driver", "nodeName"):
            if body["spec"][key] != current["spec"][key]:
                raise self._fail("update", 422, f"spec.{key}: field is immutable")
        if body["spec"]["pool"]["name"] != current["spec"]["pool"]["name"]:
            raise self._fail("update", 422, "spec.pool.name: field is immutable")
        self.calls.append(("update", 200))
        return self._store(name, body, current["metadata"]["uid"])

    def delete_resource_slice(self, name: str) -> None:
        self.calls.append(("delete", 200 if self.slices.pop(name, None) is not None else 404))

    def close(self) -> None:
        self.closed += 1

    def writes(self) -> list[tuple[str, int]]:
        return [c for c in self.calls if c[0] in ("create", "update", "delete")]

    def foreign_edit(self, name: str = NAME) -> None:
        """Another writer (kubectl label) changes the slice behind the writer's back."""
        self.rv += 1
        meta = self.slices[name]["metadata"]
        meta["labels"] = {**meta.get("labels", {}), "example.com/owner": "ops"}
        meta["resourceVersion"] = str(self.rv)


class Harness:
    def __init__(self, server: FakeSliceServer | None = None, settings: rs.SliceSettings | None = None,
                 **kwargs: Any) -> None:
        self.server = server or FakeSliceServer()
        self.clock = FakeClock(1000.0)
        self.state = NodeState()
        self.node = Node(self.state, n=8)
        self.writer = SliceWriter(self.state, settings or rs.SliceSettings(node_name=NODE), lambda: self.server,
                                  **{"debounce_s": 1.0, "min_interval_s": 10.0, "resync_s": 600.0,
                                     "backoff_max_s": 300.0, **kwargs},
                                  clock=self.clock, rng=random.Random(7))

    def run_to(self, t: float) -> None:
        """Tick as the thread would, jumping to each deadline the writer returns, up to virtual time ``t``."""
        for _ in range(10_000):
            deadline = self.writer.tick(self.clock.now)
            if self.clock.now >= t:
                return
            self.clock.now = min(max(deadline, self.clock.now), t)
        raise AssertionError("the writer did not settle")

    def for_(self, seconds: float) -> None:
        self.run_to(self.clock.now + seconds)

    def set(self, index: int, state: State, *codes: str) -> None:
        self.node.set(index, state, *codes, now=T0 + self.clock.now)
        self.writer.tick(self.clock.now)  # the thread wakes on every state change

    def stored(self) -> dict[str, Any]:
        return self.server.slices[NAME]

    def taints(self) -> dict[str, list[dict[str, str]]]:
        return {d["name"]: d["taints"] for d in self.stored()["spec"].get("devices", []) if d.get("taints")}


def started() -> Harness:
    h = Harness()
    h.node.publish(T0)
    h.for_(5)
    h.server.calls.clear()
    return h


def test_nothing_is_written_before_the_first_snapshot() -> None:
    h = Harness()
    h.for_(60)
    assert h.server.calls == []


def test_the_first_write_creates_the_slice_owned_by_the_node() -> None:
    h = Harness()
    h.node.publish(T0)
    h.for_(0.5)
    assert h.server.writes() == []  # the debounce: a burst at start is one write
    h.for_(1)
    assert h.server.calls == [("get", 404), ("get_node", 200), ("create", 201)]
    settings = rs.SliceSettings(node_name=NODE, node_uid="uid-node-1")
    want = rs.desired_slice([g for g in h.node.gpus], {}, settings)
    got = copy.deepcopy(h.stored())
    for key in ("resourceVersion", "uid", "creationTimestamp"):
        del got["metadata"][key]
    assert got == want
    assert got["metadata"]["ownerReferences"][0]["uid"] == "uid-node-1"
    s = h.writer.status()
    assert (s.ok, s.writes, s.failures, s.last_error, s.taints_published) == (True, 1, 0, None, True)


def test_a_restart_finds_the_slice_as_written_and_writes_nothing() -> None:
    h = started()
    again = Harness(server=h.server)
    again.node.publish(T0)
    again.for_(60)
    assert h.server.calls == [("get", 200), ("get_node", 200)]


def test_an_unchanged_node_makes_no_request_until_the_resync_and_then_only_a_get() -> None:
    h = started()
    h.for_(60)
    assert h.server.calls == []
    h.node.publish(T0 + 60)  # the same statuses published again: no new version, no work
    h.for_(600)
    assert h.server.calls == [("get", 200)]
    assert h.writer.status().writes == 1


def test_a_fault_is_one_put_at_the_next_generation_with_the_taint() -> None:
    h = started()
    rv = h.stored()["metadata"]["resourceVersion"]
    h.set(3, State.UNHEALTHY, "xid-79")
    h.for_(30)
    assert h.server.calls == [("update", 200)]
    assert h.stored()["spec"]["pool"]["generation"] == 2
    assert h.stored()["metadata"]["resourceVersion"] != rv
    assert h.taints() == {"gpu-3": [{"key": f"{P}/unhealthy", "value": "xid-79", "effect": "NoSchedule",
                                     "timeAdded": rfc3339(T0 + 1005)}]}
    h.set(3, State.HEALTHY)
    h.for_(30)
    assert h.server.calls == [("update", 200), ("update", 200)]
    assert h.taints() == {} and h.stored()["spec"]["pool"]["generation"] == 3


def test_twenty_transitions_in_a_second_are_one_write_with_the_last_state() -> None:
    h = started()
    states = [State.UNHEALTHY, State.HEALTHY, State.UNKNOWN, State.DEGRADED]
    for i in range(20):
        h.clock.now += 0.05
        h.set(2, states[i % 4], *(("thermal-slowdown",) if states[i % 4] is State.DEGRADED else ()))
    h.for_(30)
    assert h.server.writes() == [("update", 200)]
    assert [t["key"] for t in h.taints()["gpu-2"]] == [f"{P}/degraded"]


def test_the_token_bucket_spaces_writes_of_separate_changes() -> None:
    h = started()
    h.for_(10)  # the create's token is back
    h.set(1, State.UNHEALTHY, "xid-79")
    h.for_(1.5)
    assert len(h.server.writes()) == 1
    h.set(1, State.UNKNOWN, "nvml-error")
    h.for_(8)
    assert len(h.server.writes()) == 1  # the bucket holds the second write: one per 10 s
    h.for_(2)
    assert len(h.server.writes()) == 2 and [t["key"] for t in h.taints()["gpu-1"]] == [f"{P}/unknown"]


def test_a_stale_put_gets_409_and_the_writer_rereads_and_writes_once_more() -> None:
    h = started()
    h.server.foreign_edit()
    h.set(4, State.UNHEALTHY, "ecc-uncorrected")
    h.for_(30)
    assert h.server.calls == [("update", 409), ("get", 200), ("update", 200)]
    assert h.stored()["metadata"]["labels"]["example.com/owner"] == "ops"  # the other writer's label kept
    assert list(h.taints()) == ["gpu-4"]
    s = h.writer.status()
    assert (s.ok, s.conflicts, s.writes, s.failures) == (True, 1, 2, 0)


def test_a_slice_deleted_behind_the_writers_back_is_created_again_at_the_resync() -> None:
    h = started()
    del h.server.slices[NAME]
    h.for_(600)
    assert h.server.calls == [("get", 404), ("get_node", 200), ("create", 201)]


def listed(h: Harness) -> list[str]:
    return [d["name"] for d in h.stored()["spec"].get("devices", [])]


def test_taints_dropped_by_the_server_are_one_warning_and_the_devices_they_kept_off_leave_the_slice(
        caplog: pytest.LogCaptureFixture) -> None:
    """Without device taints (the DRADeviceTaints gate off) an untainted device is allocatable: one the mapping keeps
    from pods is left out of the slice until it recovers, at once, not after the next token."""
    h = started()
    h.server.drop_taints = True
    with caplog.at_level(logging.WARNING, logger="plugin.dra.slicewriter"):
        h.set(3, State.UNHEALTHY, "xid-79")
        h.for_(30)
        # The tainted write comes back without taints; the rewrite leaves the device out in the same step.
        assert h.server.calls == [("update", 200), ("update", 200)]
        assert listed(h) == [f"gpu-{i}" for i in range(8) if i != 3] and h.taints() == {}
        h.set(5, State.UNKNOWN, "nvml-error")  # Unknown maps to Unhealthy by default: out as well
        h.for_(30)
        assert listed(h) == ["gpu-0", "gpu-1", "gpu-2", "gpu-4", "gpu-6", "gpu-7"]
        h.set(4, State.DEGRADED, "thermal-slowdown")  # mapped Healthy: stays, with no taint to say why
        h.set(3, State.HEALTHY)
        h.for_(30)
        assert listed(h) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-6", "gpu-7"]
        before = len(h.server.writes())
        h.for_(1200)
    assert len(h.server.writes()) == before  # settled: no write per poll against the stored copy
    warnings = [r for r in caplog.records if "DRADeviceTaints" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, caplog.records
    assert "left out of the slice" in warnings[0].getMessage()
    assert h.writer.status().taints_published is False and h.writer.settings.taints is False


def _shared_two() -> rs.SliceSettings:
    return rs.SliceSettings(node_name=NODE, sharing=parse_sharing(
        {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4, "devices": [2, 5]}]}}))


def shared(h: Harness) -> dict[str, int]:
    return {d["name"]: int(d["capacity"][f"{rs.DRIVER}/shares"]["value"])
            for d in h.stored()["spec"].get("devices", []) if d.get("allowMultipleAllocations")}


def test_the_gpus_the_sharing_section_names_are_published_for_that_many_claims_and_a_fault_keeps_it() -> None:
    h = Harness(settings=_shared_two())
    h.node.publish(T0)
    h.for_(5)
    assert shared(h) == {"gpu-2": 4, "gpu-5": 4}
    h.set(2, State.UNHEALTHY, "xid-79")
    h.for_(30)
    # The taint lands on the shared device as on any other: every claim holding it sees the same state.
    assert shared(h) == {"gpu-2": 4, "gpu-5": 4} and list(h.taints()) == ["gpu-2"]
    before = len(h.server.writes())
    h.for_(1200)
    assert len(h.server.writes()) == before  # the stored copy matches: an unchanged shared node writes nothing


def test_sharing_dropped_by_the_server_is_one_warning_and_the_devices_are_published_plain(
        caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(server=FakeSliceServer(drop_sharing=True), settings=_shared_two())
    with caplog.at_level(logging.WARNING, logger="plugin.dra.slicewriter"):
        h.node.publish(T0)
        h.for_(5)
        # The shared write comes back plain; the plain slice follows in the same step, then nothing more.
        assert [c[0] for c in h.server.writes()] == ["create", "update"]
        assert shared(h) == {} and all(f"{rs.DRIVER}/shares" not in (d.get("capacity") or {})
                                       for d in h.stored()["spec"]["devices"])
        before = len(h.server.writes())
        h.for_(1200)
    assert len(h.server.writes()) == before
    warnings = [r for r in caplog.records if "DRAConsumableCapacity" in r.getMessage()]
    assert len(warnings) == 1 and "one claim each" in warnings[0].getMessage()
    assert h.writer.status().sharing_published is False and h.writer.settings.consumable is False
    assert h.writer.status().taints_published is True  # the other gate is judged on its own


def test_an_api_server_without_resource_v1_is_one_error_line_and_retries_at_the_cap(
        caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(server=FakeSliceServer(served=False))
    h.node.publish(T0)
    with caplog.at_level(logging.INFO, logger="plugin.dra.slicewriter"):
        h.for_(2)
        first = len(h.server.calls)
        assert h.server.writes() == [("create", 404)]
        h.for_(297)  # the create was at 1001: the next one is due at 1301
        assert len(h.server.calls) == first  # nothing before the cap
        h.run_to(2000)
        assert h.server.writes() == [("create", 404)] * 4  # at 1001, 1301, 1601 and 1901
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == [
            next(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)]
        assert "resource.k8s.io/v1" in caplog.records[0].getMessage()
        s = h.writer.status()
        assert not s.ok and s.writes == 0 and s.failures == 4 and "not served" in (s.last_error or "")
        h.server.served = True
        h.for_(300)
    assert h.server.writes()[-1] == ("create", 201)
    assert h.writer.status().ok
    assert any("now serves" in r.getMessage() for r in caplog.records)


def test_failures_back_off_with_one_line_each(caplog: pytest.LogCaptureFixture) -> None:
    h = started()
    fail = {"n": 3}
    real = h.server.update_resource_slice

    def flaky(name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        if fail["n"]:
            fail["n"] -= 1
            raise h.server._fail("update", 503, "etcdserver: request timed out")
        return real(name, body)

    h.server.update_resource_slice = flaky  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="plugin.dra.slicewriter"):
        h.set(0, State.UNHEALTHY, "xid-79")
        h.for_(60)
    updates = [c for c in h.server.calls if c[0] == "update"]
    assert updates == [("update", 503)] * 3 + [("update", 200)]
    assert len([r for r in caplog.records if "retrying in" in r.getMessage()]) == 3
    assert h.writer.status().ok and h.writer.status().failures == 3


def test_a_missing_node_is_a_failure_naming_it_and_nothing_is_written() -> None:
    h = Harness(settings=rs.SliceSettings(node_name="not-there"))
    h.node.publish(T0)
    h.for_(30)
    assert h.server.writes() == []
    assert "node not-there does not exist" in (h.writer.status().last_error or "")


def test_a_changed_pool_name_deletes_and_creates_past_the_old_generation() -> None:
    h = started()
    h.set(1, State.UNHEALTHY, "xid-79")
    h.for_(30)
    again = Harness(server=h.server, settings=rs.SliceSettings(node_name=NODE, pool="gpus"))
    h.server.calls.clear()
    again.node.publish(T0)
    again.for_(30)
    assert h.server.writes() == [("delete", 200), ("create", 201)]
    assert h.stored()["spec"]["pool"] == {"name": "gpus", "generation": 3, "resourceSliceCount": 1}


def test_resync_now_rereads_at_the_next_step() -> None:
    h = started()
    h.for_(10)
    del h.server.slices[NAME]  # the kubelet removed it while the plugin was away
    h.writer.resync_now()
    h.writer.tick(h.clock.now)
    assert h.server.calls == [("get", 404), ("get_node", 200)]
    h.for_(2)
    assert h.server.calls == [("get", 404), ("get_node", 200), ("create", 201)]


def test_a_kubelet_that_wipes_the_slices_after_it_took_us_gets_the_slice_back_within_seconds() -> None:
    # A starting kubelet deletes the node's ResourceSlices from a goroutine of its own that first waits for its
    # Node (retrying 1, 2, 4, ... s): the delete can land well after our registration and our re-read, which then
    # found the old slice still there. Found by CI (story 23: the slice never came back).
    h = started()
    h.writer.resync_now()
    h.for_(1)
    assert h.server.calls == [("get", 200)]
    for late in (3, 40, 100):
        h.server.calls.clear()
        del h.server.slices[NAME]
        h.for_(late)
        assert NAME not in h.server.slices or h.server.writes() == [("create", 201)]
        h.for_(12)  # the next re-read (every 10 s) and the debounce
        assert NAME in h.server.slices, f"a wipe {late} s later"
    # Past the watchful minutes after a registration, an unchanged node is back to one GET a resync.
    h.for_(200)
    h.server.calls.clear()
    h.for_(1200)
    assert h.server.calls == [("get", 200)] * 2


def test_the_thread_wakes_for_resync_now_stops_leaving_the_slice_and_delete_slice_removes_it() -> None:
    server = FakeSliceServer()
    state = NodeState()
    Node(state, n=2).publish(T0)
    writer = SliceWriter(state, rs.SliceSettings(node_name=NODE), lambda: server, debounce_s=0.0,
                         min_interval_s=0.01, resync_s=3600.0)
    writer.start()
    assert server.created.wait(10)
    server.created.clear()
    del server.slices[NAME]
    writer.resync_now()  # without the wake-up the thread would sleep until the hour's resync
    assert server.created.wait(10)
    writer.stop(5)
    assert NAME in server.slices and server.closed == 1
    writer.delete_slice()
    assert NAME not in server.slices
    writer.tick(writer._clock() + 1000)
    assert NAME not in server.slices
    writer.delete_slice()  # already gone: fine
