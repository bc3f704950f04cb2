"""The ResourceSlice writer against the real kube-apiserver (1.37): the server takes the slice as written (with
strict field validation), keeps it byte for byte as far as the writer compares it, so an unchanged node makes no
request at all; a taint-only change is one PUT at the next pool generation and comes back with the taints we sent
(DRADeviceTaints is on in 1.37); a stale PUT gets the server's 409 and the writer recovers.

Requests are counted at the edge, by a wrapper around the real client. Time is driven by hand (``tick``), the API
calls are real.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from plugin.devices.model import Gpu
from plugin.devices.simulated import builtin_node, parse_node
from plugin.dra import slices as rs
from plugin.dra.slicewriter import SliceWriter
from plugin.health.node_state import DeviceStatus, NodeState
from plugin.health.reasons import State
from plugin.kube.client import KubeClient
from plugin.kube.errors import ApiFailure
from plugin.kube.events import rfc3339
from plugin.kube.names import DEFAULT_PREFIX
from plugin.kube.views import NodeView
from tests.conftest import FakeClock
from tests.fakes.node_devices import status

pytestmark = [pytest.mark.conformance, pytest.mark.slow]

T0 = 1_767_225_600.0
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


class Counting:
    """The real client, with every call it makes recorded as (call, HTTP status or "ok")."""

    def __init__(self, kubeconfig: Path) -> None:
        self.client = KubeClient(kubeconfig)
        self.calls: list[tuple[str, int | str | None]] = []

    def _call(self, name: str, *args: Any) -> Any:
        try:
            result = getattr(self.client, name)(*args)
        except ApiFailure as f:
            self.calls.append((name, f.status))
            raise
        self.calls.append((name, "ok"))
        return result

    def get_node(self, name: str) -> NodeView:
        return self._call("get_node", name)  # type: ignore[no-any-return]

    def get_resource_slice(self, name: str) -> dict[str, Any] | None:
        return self._call("get_resource_slice", name)  # type: ignore[no-any-return]

    def create_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._call("create_resource_slice", body)  # type: ignore[no-any-return]

    def update_resource_slice(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._call("update_resource_slice", name, body)  # type: ignore[no-any-return]

    def delete_resource_slice(self, name: str) -> None:
        self._call("delete_resource_slice", name)

    def close(self) -> None:
        self.client.close()


class Writer:
    def __init__(self, apiserver: Any, node_name: str) -> None:
        self.apiserver = apiserver
        self.node_name = node_name
        self.clock = FakeClock(1000.0)
        self.state = NodeState()
        self.gpus: list[Gpu] = [s.gpu for s in parse_node(builtin_node())]
        self.current: dict[str, DeviceStatus] = {g.uuid: status(g, since=T0) for g in self.gpus}
        self.api = Counting(apiserver.kubeconfig)
        self.writer = SliceWriter(self.state, rs.SliceSettings(node_name=node_name), lambda: self.api,
                                  debounce_s=1.0, min_interval_s=10.0, resync_s=600.0, backoff_max_s=60.0,
                                  clock=self.clock, rng=random.Random(3))
        self.name = rs.slice_name(self.writer.settings)

    def publish(self) -> None:
        self.state.publish(list(self.current.values()), T0 + self.clock.now)
        self.writer.tick(self.clock.now)

    def set(self, index: int, state: State, *codes: str) -> None:
        g = next(g for g in self.gpus if g.index == index)
        self.current[g.uuid] = status(g, state, *codes, since=T0 + self.clock.now)
        self.publish()

    def ticks_to(self, t: float) -> int:
        """Tick at each deadline up to ``t``; returns how many ticks it took."""
        for n in range(1, 10_000):
            deadline = self.writer.tick(self.clock.now)
            if self.clock.now >= t:
                return n
            self.clock.now = min(max(deadline, self.clock.now), t)
        raise AssertionError("the writer did not settle")

    def for_(self, seconds: float) -> int:
        return self.ticks_to(self.clock.now + seconds)

    def stored(self) -> dict[str, Any]:
        r = self.apiserver.request("GET", f"{SLICES}/{self.name}")
        assert r.ok, r.message
        return dict(r.body)

    def close(self) -> None:
        self.writer.stop()
        self.api.close()


def taints(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {d["name"]: d["taints"] for d in obj["spec"].get("devices", []) if d.get("taints")}


@pytest.fixture
def writer(apiserver: Any) -> Any:
    name = f"dra-{secrets.token_hex(3)}"
    apiserver.create_node(name)
    w = Writer(apiserver, name)
    yield w
    w.close()


def test_the_slice_is_created_kept_quiet_and_a_taint_change_is_one_put(apiserver: Any, writer: Writer) -> None:
    w = writer
    w.publish()
    w.for_(5)
    assert w.api.calls == [("get_resource_slice", "ok"), ("get_node", "ok"), ("create_resource_slice", "ok")]
    stored = w.stored()
    node_uid = apiserver.request("GET", f"/api/v1/nodes/{w.node_name}").body["metadata"]["uid"]
    assert stored["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": w.node_name, "uid": node_uid, "controller": True}]
    assert stored["spec"]["pool"] == {"name": w.node_name, "generation": 1, "resourceSliceCount": 1}
    # The server's copy says what we want: this is what keeps an idle node from writing.
    assert not rs.slice_changed(stored, rs.desired_slice(w.gpus, w.current, w.writer.settings))
    assert len(stored["spec"]["devices"]) == len(w.gpus)

    # A strict dry run of our body names no field the server does not know (the writer's own create was strict).
    dry = apiserver.request("POST", f"{SLICES}?dryRun=All&fieldValidation=Strict",
                            {**rs.desired_slice(w.gpus, w.current, w.writer.settings),
                             "metadata": {"name": f"{w.name}-dry"}})
    assert dry.ok, dry.message

    w.api.calls.clear()
    ticks = w.for_(60)
    w.publish()  # the same statuses again: no new version
    ticks += w.for_(60)
    assert ticks >= 2 and w.api.calls == [], w.api.calls

    fault_at = T0 + w.clock.now
    w.set(3, State.UNHEALTHY, "xid-79")
    w.for_(30)
    assert w.api.calls == [("update_resource_slice", "ok")]
    stored = w.stored()
    assert stored["spec"]["pool"]["generation"] == 2
    sent = rs.desired_slice(w.gpus, w.current, w.writer.settings)
    assert taints(stored) == taints(sent) == {"gpu-3": [
        {"key": f"{DEFAULT_PREFIX}/unhealthy", "value": "xid-79", "effect": "NoSchedule",
         "timeAdded": rfc3339(fault_at)}]}
    assert w.writer.status().taints_published is True

    w.api.calls.clear()
    w.for_(300)
    assert w.api.calls == []
    w.for_(300)  # the resync: one GET, and the copy still matches
    assert w.api.calls == [("get_resource_slice", "ok")]
    s = w.writer.status()
    assert (s.ok, s.writes, s.failures) == (True, 2, 0)


def test_a_stale_put_gets_the_servers_409_and_the_writer_recovers(apiserver: Any, writer: Writer) -> None:
    w = writer
    w.publish()
    w.for_(15)
    # Someone labels the slice after the writer's last read: its resourceVersion moves on.
    patch = {"metadata": {"labels": {"example.com/owner": "ops"}}}
    r = apiserver.request("PATCH", f"{SLICES}/{w.name}", patch, content_type="application/merge-patch+json")
    assert r.ok, r.message
    w.api.calls.clear()
    w.set(5, State.DEGRADED, "thermal-slowdown")
    w.for_(30)
    assert w.api.calls == [("update_resource_slice", 409), ("get_resource_slice", "ok"),
                           ("update_resource_slice", "ok")]
    stored = w.stored()
    assert stored["metadata"]["labels"]["example.com/owner"] == "ops"
    assert [t["key"] for t in taints(stored)["gpu-5"]] == [f"{DEFAULT_PREFIX}/degraded"]
    assert stored["spec"]["pool"]["generation"] == 2
    s = w.writer.status()
    assert (s.ok, s.conflicts, s.failures) == (True, 1, 0)
    w.api.calls.clear()
    w.for_(120)
    assert w.api.calls == []


def test_stop_leaves_the_slice_and_delete_slice_removes_it(apiserver: Any, writer: Writer) -> None:
    w = writer
    w.publish()
    w.for_(5)
    w.writer.stop()
    assert w.stored()["metadata"]["name"] == w.name
    w.writer.delete_slice()
    assert apiserver.request("GET", f"{SLICES}/{w.name}").status == 404
