"""The cluster reporter against an HTTP-level fake API server on loopback, through the real client.

Time is virtual: the tests call ``tick(now)`` themselves (the reporter's thread does the same with the real clock),
so debounce, the token bucket, back-off and resync are checked without sleeping. The last tests run the real thread.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from plugin.app import make_reporter
from plugin.config import load
from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from plugin.kube.client import KubeClient
from plugin.kube.errors import ApiFailure
from plugin.outlets.reporter import KubeReporter, ReporterSettings
from tests.conftest import FakeClock
from tests.fakes.fake_apiserver import FakeApiServer
from tests.fakes.node_devices import Node

P = "gpu-health.io"
NODE = "gpu-node-1"
FOREIGN = {"example.com/owner": "ops", f"{P}/note": "set by hand"}
T0 = 1_767_225_600.0


@pytest.fixture()
def api(tmp_path: Path) -> Iterator[FakeApiServer]:
    server = FakeApiServer().start()
    server.add_node(NODE, dict(FOREIGN))
    yield server
    server.stop()


class Harness:
    def __init__(self, api: FakeApiServer, tmp_path: Path, **settings: object) -> None:
        self.api = api
        self.clock = FakeClock(1000.0)
        self.state = NodeState()
        self.node = Node(self.state, n=8)
        kubeconfig = api.kubeconfig(tmp_path)
        self.rep = KubeReporter(self.state, ReporterSettings(node_name=NODE, **settings),  # type: ignore[arg-type]
                                lambda: KubeClient(kubeconfig), clock=self.clock,
                                wall=lambda: T0 + self.clock.now, rng=random.Random(3))

    def at(self, t: float) -> None:
        """Advance the virtual clock to ``t``, calling tick at every deadline on the way (as the thread would)."""
        for _ in range(10_000):
            deadline = self.rep.tick(self.clock.now)
            if self.clock.now >= t:
                return
            self.clock.now = min(max(deadline, self.clock.now), t)
        raise AssertionError("reporter did not settle")

    def set(self, index: int, state: State, *codes: str) -> None:
        self.node.set(index, state, *codes, now=T0 + self.clock.now)

    def patches(self) -> int:
        return self.api.count("PATCH", r"/nodes/")

    def device(self, index: int) -> dict[str, object]:
        value = json.loads(self.api.annotations(NODE)[f"{P}/gpu.{index}"])
        assert isinstance(value, dict)
        return value


def test_reconciles_on_start_removing_stale_keys_and_leaving_others_alone(api: FakeApiServer,
                                                                          tmp_path: Path) -> None:
    api.edit_node(NODE, {f"{P}/gpu.9": '{"state":"Unhealthy"}', f"{P}/summary": "stale"})
    h = Harness(api, tmp_path)
    h.at(1000.5)
    assert api.requests == []  # nothing published yet: writing now would wipe the device keys
    h.node.publish(T0)
    h.at(1000.5)
    assert h.patches() == 0  # debounce
    h.at(1001.5)
    got = api.annotations(NODE)
    assert h.patches() == 1
    assert f"{P}/gpu.9" not in got and got[f"{P}/summary"] == "Healthy: 8 devices (8 Healthy)"
    assert {k: got[k] for k in FOREIGN} == FOREIGN
    assert {f"{P}/gpu.{i}" for i in range(8)} <= set(got) and got[f"{P}/schema"] == "v1"
    patch = next(r for r in api.requests if r.method == "PATCH")
    assert patch.content_type == "application/merge-patch+json"
    assert set(patch.body["metadata"]) == {"annotations", "resourceVersion"}
    assert all(k.startswith(P + "/") for k in patch.body["metadata"]["annotations"])
    status = h.rep.status()
    assert (status.writes, status.reads, status.ok, status.last_error) == (1, 1, True, None)


def test_steady_state_writes_nothing_and_a_burst_is_one_patch(api: FakeApiServer, tmp_path: Path) -> None:
    h = Harness(api, tmp_path)
    h.node.publish(T0)
    h.at(1100.0)
    assert h.patches() == 1
    for i in range(20):  # 20 transitions within one second
        h.clock.now = 1100.0 + i * 0.045
        h.set(i % 8, State.UNHEALTHY if i % 2 == 0 else State.DEGRADED, "xid-79" if i % 2 == 0 else
              "thermal-slowdown")
        h.rep.tick(h.clock.now)
    h.at(1130.0)
    assert h.patches() == 2
    assert h.device(3)["state"] == "Degraded" and h.device(2)["state"] == "Unhealthy"  # the final state
    assert h.rep.status().pending is False


def test_a_change_undone_within_the_debounce_writes_nothing(api: FakeApiServer, tmp_path: Path) -> None:
    """A reason that comes and goes within the debounce window, with no state transition, leaves nothing to write.
    (A state flap does write once: the device's lastTransition moved.)"""
    h = Harness(api, tmp_path)
    h.set(1, State.DEGRADED, "thermal-slowdown")
    h.at(1100.0)
    before = dict(api.annotations(NODE))
    settled = h.node.current[h.node.gpus[1].uuid]
    h.set(1, State.DEGRADED, "thermal-slowdown", "ecc-uncorrected")
    h.at(1100.3)
    h.node.current[settled.id] = settled
    h.node.publish(T0)
    h.at(1200.0)
    assert h.patches() == 1 and api.annotations(NODE) == before
    assert h.state.snapshot().version == 3  # three distinct snapshots were seen


def test_token_bucket_spaces_writes_and_the_latest_state_wins(api: FakeApiServer, tmp_path: Path) -> None:
    h = Harness(api, tmp_path)
    h.node.publish(T0)
    h.at(1001.0)  # the reconcile write at 1001.0
    h.set(0, State.UNHEALTHY, "xid-79")
    h.at(1003.0)
    h.set(0, State.DEGRADED, "thermal-slowdown")
    h.at(1010.9)
    assert h.patches() == 1  # the bucket holds the second write until 10 s after the first
    h.at(1011.0)
    assert h.patches() == 2 and h.device(0)["state"] == "Degraded"


def test_concurrent_edit_gets_409_then_rereads_and_keeps_the_other_edit(api: FakeApiServer,
                                                                        tmp_path: Path) -> None:
    h = Harness(api, tmp_path)
    h.node.publish(T0)
    h.at(1100.0)
    api.edit_node(NODE, {"example.com/owner": "someone-else", f"{P}/gpu.5": "edited by hand"})
    h.set(2, State.UNHEALTHY, "xid-79")
    h.at(1200.0)
    got = api.annotations(NODE)
    assert h.rep.status().conflicts == 1 and api.count("PATCH") == 3  # reconcile, refused, retried
    assert got["example.com/owner"] == "someone-else"  # the other writer's edit survives
    assert json.loads(got[f"{P}/gpu.5"])["state"] == "Healthy"  # our key repaired from the fresh read
    assert h.device(2)["state"] == "Unhealthy"


def test_resync_repairs_manual_edits(api: FakeApiServer, tmp_path: Path) -> None:
    h = Harness(api, tmp_path, resync_s=600.0)
    h.node.publish(T0)
    h.at(1100.0)
    api.edit_node(NODE, {f"{P}/gpu.4": None, f"{P}/state": "Healthy?"})
    h.at(1600.0)
    assert f"{P}/gpu.4" not in api.annotations(NODE)  # not yet: nothing told us
    h.at(1602.0)
    assert api.count("GET") == 2 and h.patches() == 2
    assert api.annotations(NODE)[f"{P}/state"] == "Healthy" and h.device(4)["state"] == "Healthy"
    h.at(2201.9)  # the next resync finds nothing to fix
    assert api.count("GET") == 3 and h.patches() == 2


@pytest.mark.parametrize("status,retry_after", [(503, None), (429, 7), (403, None), (500, None)])
def test_api_trouble_backs_off_shows_in_status_and_converges(api: FakeApiServer, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture, status: int,
                                                             retry_after: int | None) -> None:
    h = Harness(api, tmp_path, backoff_initial_s=1.0)
    api.fail(status, count=4, retry_after=retry_after)
    h.node.publish(T0)
    h.set(6, State.UNHEALTHY, "xid-79")
    with caplog.at_level(logging.WARNING, "plugin.outlets.reporter"):
        h.at(1000.0)
        s = h.rep.status()
        assert not s.ok and s.failures == 1 and f"HTTP {status}" in (s.last_error or "")
        h.at(1200.0)
    s = h.rep.status()
    assert s.ok and s.failures == 4 and s.writes == 1
    assert h.device(6)["state"] == "Unhealthy"
    attempts = [r for r in api.requests if r.method == "GET"]
    assert len(attempts) == 5  # four refused, then the read that led to the write
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4  # once per back-off
    if retry_after:
        assert "retrying in 7.0s" in warnings[0].getMessage()


def test_unreachable_api_server_is_api_trouble_too(tmp_path: Path) -> None:
    server = FakeApiServer().start()
    server.add_node(NODE)
    kubeconfig = server.kubeconfig(tmp_path)
    server.stop()  # the port is closed: connection refused
    state = NodeState()
    Node(state).publish(T0)
    clock = FakeClock(0.0)
    rep = KubeReporter(state, ReporterSettings(node_name=NODE), lambda: KubeClient(kubeconfig), clock=clock)
    deadline = rep.tick(0.0)
    s = rep.status()
    assert not s.ok and s.failures == 1 and "Connect" in (s.last_error or ""), s.last_error
    assert 0.5 <= deadline <= 1.0  # the first back-off, jittered


def test_missing_node_and_missing_config_are_named(api: FakeApiServer, tmp_path: Path) -> None:
    h = Harness(api, tmp_path)
    h.rep.settings = ReporterSettings(node_name="no-such-node")
    h.node.publish(T0)
    h.at(1000.0)
    assert "node no-such-node does not exist" in (h.rep.status().last_error or "")
    with pytest.raises(ApiFailure, match=r"kubeconfig .*nope"):
        KubeClient(tmp_path / "nope")


def test_events_are_posted_on_the_node_and_aggregated(api: FakeApiServer, tmp_path: Path) -> None:
    h = Harness(api, tmp_path)
    h.node.publish(T0)
    h.at(1001.0)
    assert api.events == {}  # devices appearing at start are not news
    for k in range(5):  # gpu.1 flaps five times within 4 s
        h.set(1, State.UNHEALTHY, "xid-79")
        h.at(1002.0 + k * 0.8)
        h.set(1, State.HEALTHY)
        h.at(1002.4 + k * 0.8)
    h.at(1100.0)
    events = list(api.events.values())
    by_reason = {e["reason"]: e for e in events}
    assert sorted(by_reason) == ["GPURecovered", "GPUUnhealthy"] and len(events) == 2
    bad = by_reason["GPUUnhealthy"]
    assert bad["count"] == 5 and bad["type"] == "Warning"
    assert bad["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": f"uid-{NODE}"}
    assert bad["message"].startswith(f"gpu.1 ({h.node.gpus[1].uuid}): Healthy -> Unhealthy: xid-79")
    assert by_reason["GPURecovered"]["type"] == "Normal" and by_reason["GPURecovered"]["count"] == 5
    posts, ev_patches = api.count("POST", "/events"), api.count("PATCH", "/events/")
    assert posts == 2 and ev_patches == 2  # 10 transitions: one create and one count update per key
    assert h.rep.status().events_written == 4


def test_a_driver_reload_across_the_gpus_is_one_event_per_direction(api: FakeApiServer, tmp_path: Path) -> None:
    h = Harness(api, tmp_path)
    h.node.publish(T0)
    h.at(1001.0)
    for g in range(8):  # the rollout's shape: the 8 GPUs go Unknown within 0.5 s, and back 30 s later
        h.at(1001.0 + g / 16)
        h.set(g, State.UNKNOWN, "nvml-error")
    h.at(1001.99)
    assert api.count("POST", "/events") == 0  # the burst window (the debounce) is still open
    h.at(1002.0)
    assert api.count("POST", "/events") == 1  # ... and its Event goes out when it closes, 1 s after the first
    for g in range(8):
        h.at(1031.0 + g / 16)
        h.set(g, State.HEALTHY)
    h.at(1100.0)
    events = sorted(api.events.values(), key=lambda e: str(e["reason"]))
    assert [(e["reason"], e["count"]) for e in events] == [("GPURecovered", 1), ("GPUUnknown", 1)]
    names = ", ".join(f"gpu.{g}" for g in range(8))
    assert events[1]["message"].startswith(f"8 GPUs ({names}): Healthy -> Unknown: nvml-error: ")
    assert events[0]["message"] == f"8 GPUs ({names}): Unknown -> Healthy"
    assert api.count("POST", "/events") == 2 and api.count("PATCH", "/events/") == 0
    assert h.rep.status().events_written == 2


def test_event_that_expired_is_created_again(api: FakeApiServer, tmp_path: Path) -> None:
    h = Harness(api, tmp_path)
    h.node.publish(T0)
    h.at(1001.0)
    h.set(0, State.DEGRADED, "thermal-slowdown")
    h.at(1002.0)
    api.events.clear()  # the API server's event TTL ran out
    h.set(0, State.HEALTHY)
    h.set(0, State.DEGRADED, "thermal-slowdown")
    h.at(1100.0)
    degraded = [e for e in api.events.values() if e["reason"] == "GPUDegraded"]
    assert len(degraded) == 1 and degraded[0]["count"] == 1


def test_node_condition_follows_unhealthy_devices(api: FakeApiServer, tmp_path: Path) -> None:
    h = Harness(api, tmp_path, condition=True, condition_type="GPUHealthy", events=False)
    h.node.publish(T0)
    h.at(1001.0)
    cond = {c["type"]: c for c in api.conditions(NODE)}
    assert cond["GPUHealthy"]["status"] == "True" and cond["Ready"]["status"] == "True"
    first_transition = cond["GPUHealthy"]["lastTransitionTime"]
    h.set(3, State.UNHEALTHY, "ecc-uncorrected")
    h.at(1100.0)
    c = {c["type"]: c for c in api.conditions(NODE)}["GPUHealthy"]
    assert (c["status"], c["reason"]) == ("False", "GPUUnhealthy") and "gpu.3" in c["message"]
    assert c["lastTransitionTime"] != first_transition
    status_patches = [r for r in api.requests if "/status" in r.path]
    assert len(status_patches) == 2
    assert all(r.content_type == "application/strategic-merge-patch+json" for r in status_patches)
    assert [x["type"] for x in status_patches[1].body["status"]["conditions"]] == ["GPUHealthy"]
    h.set(5, State.DEGRADED, "thermal-slowdown")  # not Unhealthy: the condition does not change
    h.at(1200.0)
    assert len([r for r in api.requests if "/status" in r.path]) == 2


def test_node_condition_in_the_eks_style_names_the_xid(api: FakeApiServer, tmp_path: Path) -> None:
    """The EKS node repair recipe (docs/remediation.md): their condition type, their reason names, our message."""
    rep = make_reporter(load({"node_condition": "true", "node_condition_type": "AcceleratedHardwareReady",
                              "node_condition_reasons": "eks"}, {"NODE_NAME": NODE}, None), NodeState())
    assert rep is not None
    h = Harness(api, tmp_path, condition=True, condition_type=rep.settings.condition_type,
                condition_reasons=rep.settings.condition_reasons, events=False)
    h.node.publish(T0)
    h.at(1001.0)
    cond = {c["type"]: c for c in api.conditions(NODE)}
    assert (cond["AcceleratedHardwareReady"]["status"], cond["AcceleratedHardwareReady"]["reason"]) == \
        ("True", "NvidiaGPUIsReady")
    assert "GPUHealthy" not in cond
    h.set(2, State.UNHEALTHY, "ecc-uncorrected")
    h.set(6, State.UNHEALTHY, "xid-79")
    h.at(1100.0)
    c = {c["type"]: c for c in api.conditions(NODE)}["AcceleratedHardwareReady"]
    # XID 79 asks for a node reboot, the heavier action: it names the node; the message names both GPUs.
    assert (c["status"], c["reason"]) == ("False", "NvidiaXID79Error")
    assert "gpu.2" in c["message"] and "gpu.6" in c["message"] and "xid-79" in c["message"]
    h.set(6, State.HEALTHY)
    h.at(1200.0)
    c = {c["type"]: c for c in api.conditions(NODE)}["AcceleratedHardwareReady"]
    assert (c["status"], c["reason"]) == ("False", "NvidiaDoubleBitError")


def test_reporter_thread_converges_without_touching_the_kubelet_path(api: FakeApiServer, tmp_path: Path) -> None:
    """The real thread and clock: an API outage, then recovery, while the node state keeps publishing."""
    state = NodeState()
    node = Node(state)
    kubeconfig = api.kubeconfig(tmp_path)
    rep = KubeReporter(state, ReporterSettings(node_name=NODE, debounce_s=0.05, min_interval_s=0.05,
                                               backoff_initial_s=0.05, backoff_max_s=0.2),
                       lambda: KubeClient(kubeconfig))
    api.fail(503, count=3)
    rep.start()
    try:
        node.publish(T0)
        node.set(7, State.UNHEALTHY, "xid-79", now=T0 + 1)
        assert api.wait_for(lambda: '"Unhealthy"' in (api.nodes[NODE]["metadata"]["annotations"]
                                                      .get(f"{P}/gpu.7", "")))
        assert rep.status().failures == 3 and rep.status().ok
    finally:
        rep.stop(timeout=2.0)
    assert rep._thread is not None and not rep._thread.is_alive()


def test_make_reporter_from_config(tmp_path: Path) -> None:
    assert make_reporter(load({}, {}, None), NodeState()) is None  # no node name: off
    assert make_reporter(load({"annotations": "false", "events": "false"}, {"NODE_NAME": "n"}, None),
                         NodeState()) is None
    rep = make_reporter(load({"node_condition": "true", "annotation_prefix": "gpu.example.com"},
                             {"NODE_NAME": "n"}, None), NodeState())
    assert rep is not None and rep.settings.node_name == "n" and rep.settings.condition
    assert rep.settings.prefix == "gpu.example.com"


def test_a_clearance_at_the_first_poll_after_a_reboot_is_an_event(api: FakeApiServer, tmp_path: Path) -> None:
    # After a reboot the first poll clears the latch before the reporter first looks: that clearance is this run's
    # news (the operator's record of why the GPU came back), unlike a fault reloaded from the state dir.
    from dataclasses import replace

    from plugin.health.node_state import Clearance, Transition
    from plugin.health.reasons import Action, Reason, Source

    state = NodeState()
    old = Reason("xid-79", State.UNHEALTHY, "fatal XID 79", Source.EVENT, Action.REBOOT_NODE, T0 - 600)
    state.restore_history([Transition(7, "GPU-old", "Healthy", "Unhealthy", (old,), T0 - 600)])
    h = Harness.__new__(Harness)
    h.api, h.clock, h.state = api, FakeClock(1000.0), state
    h.node = Node(state, n=8)
    kubeconfig = api.kubeconfig(tmp_path)
    h.rep = KubeReporter(state, ReporterSettings(node_name=NODE), lambda: KubeClient(kubeconfig), clock=h.clock,
                         wall=lambda: T0 + h.clock.now, rng=random.Random(3))
    g = h.node.gpus[1]
    h.node.current[g.uuid] = replace(h.node.current[g.uuid], cleared=Clearance(("xid-79",), "node rebooted", T0))
    h.node.publish(T0)  # the first poll, before the reporter's first look
    h.at(1100.0)
    [event] = list(api.events.values())
    assert event["reason"] == "GPUFaultCleared" and event["type"] == "Normal"
    assert "cleared xid-79: node rebooted" in event["message"] and g.uuid in event["message"]
