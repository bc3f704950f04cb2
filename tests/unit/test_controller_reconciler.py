"""The reconciler driven through ``step(now)`` on a virtual clock, against an in-memory API server
(tests/fakes/controller_api.py) that keeps Node documents, hands out increasing resourceVersions, applies JSON merge
patches and refuses a stale one with 409. The watch is played by the test: it hands the reconciler the Node as the
server has it now, or an old copy, the way a watch event would.
"""

from __future__ import annotations

import copy
import json
import threading
from typing import Any

import pytest

from plugin.controller.breaker import OPEN, BreakerState
from plugin.controller.leader import LeaderElector
from plugin.controller.nodes import CONTROLLER, Keys
from plugin.controller.policy import CAPACITY_GAP, REBOOT_REQUIRED, UNHEALTHY_DEVICES, Rules
from plugin.controller.reconciler import DRAIN_RECHECK_S, IDLE_WAKE_S, Reconciler, Settings
from tests.conftest import FakeClock
from tests.fakes.controller_api import (
    RANK,
    T0,
    FakeControllerApi,
    FakeLeadership,
    P,
    device,
    gpu_node,
    plain_node,
    rfc,
)

KEYS = Keys(P)
OWN = f"controller.{P}"  # the controller's own record, where the agent's account cannot write
TAINT = f"{P}/quarantine"
OPERATOR_TAINT = {"key": "example.com/maintenance", "value": "disk", "effect": "NoSchedule"}
LABEL = f"{P}/quarantined=true"


def agent(api: FakeControllerApi, name: str, states: dict[int, str], since: float,
          reboot: tuple[int, ...] = ()) -> None:
    """The node agent rewrites some device entries of a Node, and the node state with them."""
    ann = api.node(name)["metadata"]["annotations"]
    patch: dict[str, str] = {}
    for i, st in states.items():
        action = "reboot-node" if i in reboot else ("reset-gpu" if st == "Unhealthy" else "none")
        k, v = device(i, st, action=action, code="xid-79" if i in reboot else "", since=since, node=name)
        patch[k] = v
    merged = {**ann, **patch}
    worst = max((json.loads(v)["state"] for k, v in merged.items() if k.startswith(f"{P}/gpu.")),
                key=lambda s: RANK[s])
    patch[f"{P}/state"] = worst
    api.edit(name, {"metadata": {"annotations": patch}})


class Rig:
    def __init__(self, nodes: list[dict[str, Any]], *, leader: bool = True, lease: dict[str, str] | None = None,
                 **settings: Any) -> None:
        self.clock = FakeClock(T0)
        self.api = FakeControllerApi()
        self.api.clock = self.clock
        for n in nodes:
            self.api.add_node(n)
        self.lead = FakeLeadership(leader, lease)
        self.settings = Settings(keys=KEYS, rules=settings.pop("rules", Rules()), **settings)
        self.rec = Reconciler(self.api, self.settings, self.lead, clock=self.clock)
        self.rec.replace(self.api.list_nodes("")[0])
        self.api.calls.clear()
        if leader:
            self.rec.leadership_changed(True)

    def step(self) -> float:
        return self.rec.step(self.clock.now)

    def run_until(self, end: float) -> None:
        """What the worker thread does: step, then wait for the deadline the step returned."""
        for _ in range(10_000):
            due = self.step()
            if due > self.clock.now:
                if self.clock.now >= end:
                    return
                self.clock.now = min(due, end)
        raise AssertionError("the reconciler never went idle")

    def watch(self, name: str) -> None:
        """A watch event with the Node as it is on the server now."""
        self.rec.upsert(self.api.node(name))

    def agent(self, name: str, states: dict[int, str], since: float, reboot: tuple[int, ...] = ()) -> None:
        """The node agent rewrites some device entries and the node state; the watch delivers it."""
        agent(self.api, name, states, since, reboot)
        self.watch(name)

    def node(self, name: str) -> dict[str, Any]:
        return self.api.node(name)

    def taints(self, name: str) -> list[dict[str, Any]]:
        return list(self.api.node(name)["spec"].get("taints") or [])

    def quarantined(self) -> list[str]:
        return sorted(n for n, d in self.api.nodes.items()
                      if (d["metadata"].get("annotations") or {}).get(f"{OWN}/quarantined-by") == CONTROLLER)

    def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.api.events if reason is None or e["reason"] == reason]


def comparable(doc: dict[str, Any]) -> dict[str, Any]:
    """A Node without what every write changes (the version), with empty and false fields dropped as the API
    server drops them."""
    out = copy.deepcopy(doc)
    del out["metadata"]["resourceVersion"]
    for key in ("taints", "unschedulable"):
        if out["spec"].get(key) in ([], False):
            del out["spec"][key]
    return out


# Rules, writes, Events ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("node", "reason"), [
    (gpu_node("bad", {2: "Unhealthy"}), UNHEALTHY_DEVICES),
    (gpu_node("bad", reboot=(5,)), REBOOT_REQUIRED),
    (gpu_node("bad", annotated=False, allocatable=7), CAPACITY_GAP),
])
def test_each_rule_quarantines_with_its_reason_and_an_event(node: dict[str, Any], reason: str) -> None:
    rig = Rig([node, gpu_node("good"), gpu_node("stock", annotated=False), plain_node("cpu")])
    rig.step()
    assert rig.api.writes() == ["patch node bad"]
    doc = rig.node("bad")
    assert doc["spec"]["taints"] == [{"key": TAINT, "value": reason, "effect": "NoSchedule"}]
    ann = doc["metadata"]["annotations"]
    assert ann[f"{OWN}/quarantined-by"] == CONTROLLER and ann[f"{OWN}/quarantine-reason"] == reason
    assert ann[f"{OWN}/quarantined-at"] == rfc(T0) and ann[f"{OWN}/quarantine-owns"] == "taint"
    assert ann[f"{OWN}/quarantine-message"]
    [ev] = rig.events()
    assert ev["reason"] == "GPUNodeQuarantined" and ev["type"] == "Warning" and ev["namespace"] == "default"
    assert ev["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "bad", "uid": "uid-bad"}
    assert ev["source"]["component"] == CONTROLLER
    assert f": {reason}: " in ev["message"]
    assert rig.rec.counts() == {"gpu_nodes": 3, "quarantined": 1, "candidates": 0, "limit": 1, "nodes": 4,
                                 "unreadable": 0}
    assert rig.rec.stats.actions == {"quarantine": 1}


def test_an_idle_fleet_costs_no_request() -> None:
    rig = Rig([gpu_node(f"n{i}") for i in range(5)])
    assert rig.step() == T0 + IDLE_WAKE_S
    for _ in range(3):
        rig.step()
    assert rig.api.calls == []


def test_a_quarantine_says_how_long_the_controller_held_it_after_its_watch_event(
        caplog: pytest.LogCaptureFixture) -> None:
    """The controller's own part of annotation-to-taint, apart from the API server's: from the watch event that made
    the Node a candidate to its PATCH. The earliest undecided change counts; a Node decided on a LIST says nothing;
    nothing is kept per Node once it is decided."""
    rig = Rig([gpu_node("listed", {0: "Unhealthy"}), gpu_node("a"), gpu_node("b")], max_quarantined_fraction=1.0)
    caplog.set_level("INFO", logger="plugin.controller.reconciler")
    rig.step()
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("quarantined listed:")]
    assert "after its watch event" not in line  # decided on the LIST, not on a watch event
    rig.agent("a", {1: "Unhealthy"}, since=T0)
    rig.clock.now += 0.004
    rig.watch("a")  # a later event of the same undecided change: the first one's time counts
    rig.clock.now += 0.0015
    rig.step()
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("quarantined a:")]
    assert line.endswith("(PATCH sent 5.5 ms after its watch event)")
    rig.agent("b", {0: "Healthy"}, since=T0)  # a change that decides nothing
    rig.step()
    assert rig.rec._seen == {}


def test_cordon_and_label_when_configured() -> None:
    rig = Rig([gpu_node("bad", {0: "Unhealthy"})], cordon=True, label=LABEL)
    rig.step()
    doc = rig.node("bad")
    assert doc["spec"]["unschedulable"] is True
    assert doc["metadata"]["labels"] == {f"{P}/quarantined": "true"}
    assert doc["metadata"]["annotations"][f"{OWN}/quarantine-owns"] == "taint,cordon,label"
    assert "(taint gpu-health.io/quarantine=unhealthy-devices:NoSchedule, cordon, label " in rig.events()[0]["message"]


def test_a_custom_prefix_writes_its_own_keys() -> None:
    keys = Keys("example.com")
    node = gpu_node("bad", annotated=False, allocatable=6)
    clock = FakeClock(T0)
    api = FakeControllerApi()
    api.add_node(node)
    rec = Reconciler(api, Settings(keys=keys, rules=Rules()), FakeLeadership(), clock=clock)
    rec.replace(api.list_nodes("")[0])
    rec.leadership_changed(True)
    rec.step(clock.now)
    doc = api.node("bad")
    assert doc["spec"]["taints"][0]["key"] == "example.com/quarantine"
    assert doc["metadata"]["annotations"]["controller.example.com/quarantined-by"] == CONTROLLER


# Release ----------------------------------------------------------------------------------------------------------


def test_release_waits_the_recovery_hold_from_when_the_controller_saw_it_fit() -> None:
    rig = Rig([gpu_node("n", {2: "Unhealthy"})], recovery_hold_s=600)
    rig.step()
    before = rig.node("n")
    # GPU 2 recovered at T0+100 (its since says so), but the controller only hears of it at T0+400 (a restart,
    # a slow watch): the hold ends at T0+1000. The since is the agent's word, which its account can forge.
    rig.clock.now = T0 + 400
    rig.agent("n", {2: "Healthy"}, since=T0 + 100)
    assert rig.step() == T0 + 1000
    rig.clock.now = T0 + 999
    rig.step()
    assert rig.api.writes() == ["patch node n"]
    rig.run_until(T0 + 1000)
    assert rig.api.writes() == ["patch node n", "patch node n"]
    after = rig.node("n")
    assert "taints" not in after["spec"] or after["spec"]["taints"] == []
    assert set(after["metadata"]["annotations"]) == set(before["metadata"]["annotations"]) - set(KEYS.ours())
    [ev] = rig.events("GPUNodeReleased")
    assert ev["type"] == "Normal" and "fit for 10 min" in ev["message"] and "unhealthy-devices" in ev["message"]
    assert rig.rec.counts()["quarantined"] == 0


def test_without_since_the_hold_counts_from_when_the_controller_saw_it_fit() -> None:
    rig = Rig([gpu_node("n", annotated=False, allocatable=6)], recovery_hold_s=600)
    rig.step()
    rig.clock.now = T0 + 100
    rig.api.edit("n", {"status": {"allocatable": {"nvidia.com/gpu": "8"}}})
    rig.watch("n")
    rig.run_until(T0 + 699)
    assert rig.quarantined() == ["n"]
    rig.run_until(T0 + 700)
    assert rig.quarantined() == [] and rig.taints("n") == []


def test_a_relapse_during_the_hold_starts_it_over() -> None:
    rig = Rig([gpu_node("n", annotated=False, allocatable=6)], recovery_hold_s=600)
    rig.step()
    rig.clock.now = T0 + 100
    rig.api.edit("n", {"status": {"allocatable": {"nvidia.com/gpu": "8"}}})
    rig.watch("n")
    rig.run_until(T0 + 300)
    rig.api.edit("n", {"status": {"allocatable": {"nvidia.com/gpu": "7"}}})
    rig.watch("n")
    rig.run_until(T0 + 400)
    rig.api.edit("n", {"status": {"allocatable": {"nvidia.com/gpu": "8"}}})
    rig.watch("n")
    rig.run_until(T0 + 999)
    assert rig.quarantined() == ["n"]
    assert rig.api.writes() == ["patch node n"]  # the relapse was no new quarantine: it still was one
    rig.run_until(T0 + 1000)
    assert rig.quarantined() == []


def test_an_unknown_device_keeps_the_node_in() -> None:
    rig = Rig([gpu_node("n", {2: "Unhealthy"})], recovery_hold_s=60)
    rig.step()
    rig.agent("n", {2: "Unknown"}, since=T0 + 10)
    rig.run_until(T0 + 3600)
    assert rig.quarantined() == ["n"]


def test_release_takes_back_only_what_the_quarantine_owns() -> None:
    mine = {"key": TAINT, "value": "manual", "effect": "NoSchedule"}
    theirs = gpu_node("theirs", {1: "Unhealthy"}, taints=[OPERATOR_TAINT, mine], unschedulable=True,
                      labels={f"{P}/quarantined": "by-hand", "pool": "a"})
    ours = gpu_node("ours", {1: "Unhealthy"}, taints=[OPERATOR_TAINT], labels={"pool": "a"})
    rig = Rig([theirs, ours, *(gpu_node(f"ok{i}") for i in range(8))], cordon=True, label=LABEL,
              recovery_hold_s=60, max_quarantined_fraction=0.5)
    before = {n: rig.node(n) for n in ("theirs", "ours")}
    rig.step()
    assert rig.quarantined() == ["ours", "theirs"]
    assert rig.node("theirs")["metadata"]["annotations"][f"{OWN}/quarantine-owns"] == ""
    assert rig.taints("theirs") == [OPERATOR_TAINT, mine]
    assert rig.node("ours")["spec"]["unschedulable"] is True
    for n in ("theirs", "ours"):
        rig.agent(n, {1: "Healthy"}, since=T0 + 5)
    rig.run_until(T0 + 65)
    assert rig.quarantined() == []
    for n in ("theirs", "ours"):
        after = comparable(rig.node(n))
        want = comparable(before[n])
        want["metadata"]["annotations"] = after["metadata"]["annotations"]  # the agent's own keys moved
        assert after == want, n
        assert not any(k in after["metadata"]["annotations"] for k in KEYS.ours())
    assert rig.taints("theirs") == [OPERATOR_TAINT, mine]
    assert rig.node("theirs")["spec"]["unschedulable"] is True


def test_an_operators_change_during_the_quarantine_survives_the_release() -> None:
    rig = Rig([gpu_node("n", {1: "Unhealthy"})], cordon=True, recovery_hold_s=60)
    rig.step()
    lifecycle = {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"}
    rig.api.edit("n", {"spec": {"taints": [*rig.taints("n"), lifecycle]}, "metadata": {"labels": {"x": "y"}}})
    rig.watch("n")
    rig.agent("n", {1: "Healthy"}, since=T0 + 1)
    rig.run_until(T0 + 61)
    doc = rig.node("n")
    assert doc["spec"]["taints"] == [lifecycle] and doc["spec"].get("unschedulable") is False
    assert doc["metadata"]["labels"] == {"x": "y"}


# NoExecute, dry run -------------------------------------------------------------------------------------------------


def test_no_execute_is_added_once_after_the_grace_and_released_with_the_rest() -> None:
    rig = Rig([gpu_node("n", reboot=(0,))], no_execute_after_s=300, recovery_hold_s=60)
    assert rig.step() == T0 + 300
    rig.run_until(T0 + 299)
    assert [t["effect"] for t in rig.taints("n")] == ["NoSchedule"]
    rig.run_until(T0 + 300)
    assert rig.taints("n")[1] == {"key": TAINT, "value": REBOOT_REQUIRED, "effect": "NoExecute",
                                  "timeAdded": rfc(T0 + 300)}
    assert rig.node("n")["metadata"]["annotations"][f"{OWN}/quarantine-owns"] == "noexecute,taint"
    rig.run_until(T0 + 3600)
    assert rig.api.writes() == ["patch node n"] * 2
    assert rig.rec.stats.actions == {"quarantine": 1, "noexecute": 1}
    rig.agent("n", {0: "Healthy"}, since=T0 + 3600)
    rig.run_until(T0 + 3660)
    assert rig.taints("n") == []


def test_no_execute_grace_counts_from_quarantined_at_across_a_restart() -> None:
    first = Rig([gpu_node("n", {3: "Unhealthy"})], no_execute_after_s=300)
    first.step()
    # A new controller (new process, empty memory) starts at T0+200 from the Node as it is.
    clock = FakeClock(T0 + 200)
    rec = Reconciler(first.api, first.settings, FakeLeadership(), clock=clock)
    rec.replace(first.api.list_nodes("")[0])
    rec.leadership_changed(True)
    first.api.calls.clear()
    assert rec.step(clock.now) == T0 + 300
    assert first.api.writes() == []
    rec.step(clock.advance(100))
    assert first.api.writes() == ["patch node n"]
    assert [t["effect"] for t in first.taints("n")] == ["NoSchedule", "NoExecute"]


def test_dry_run_posts_events_only_and_still_respects_the_breaker() -> None:
    nodes = [gpu_node(f"n{i:02}", {0: "Unhealthy"} if i < 5 else None) for i in range(20)]
    rig = Rig(nodes, dry_run=True, recovery_hold_s=60, no_execute_after_s=10, drain=True)
    rig.run_until(T0 + 120)
    assert rig.api.writes() == []
    assert {c.split()[0] + " " + c.split()[1] for c in rig.api.calls} == {"create event"}
    dry = rig.events("GPUQuarantineDryRun")
    assert [e["involvedObject"]["name"] for e in dry] == ["n00", "n01"]  # the limit: 10% of 20
    assert dry[0]["message"].startswith("would quarantine (taint gpu-health.io/quarantine=unhealthy-devices")
    [blocked] = [e for e in rig.events("GPUQuarantineBlocked") if e["involvedObject"]["kind"] == "Lease"]
    assert blocked["involvedObject"]["name"] == "gpu-health-controller"
    assert rig.rec.breaker.is_open
    assert rig.rec.counts()["quarantined"] == 2 and rig.rec.quarantined_by_reason() == {UNHEALTHY_DEVICES: 2}
    # A pretend quarantine is released like a real one, in words only.
    rig.agent("n00", {0: "Healthy"}, since=rig.clock.now)
    rig.run_until(rig.clock.now + 60)
    assert rig.events("GPUQuarantineDryRun")[-1]["message"] == "would release: fit for 1 min"
    assert rig.api.writes() == []
    # Its pretend breaker is kept apart from the real one, which a real leader would load.
    assert "gpu-health.io/breaker" not in rig.lead.lease_annotations
    assert '"state":"open"' in rig.lead.lease_annotations["gpu-health.io/breaker-dry-run"]


# Conflicts, heartbeats, stale events, failures -----------------------------------------------------------------


def test_a_conflict_reads_the_node_again_and_decides_on_what_it_finds() -> None:
    rig = Rig([gpu_node("n", {1: "Unhealthy"})])

    def operator(name: str) -> None:  # between the controller's read and its write
        rig.api.edit(name, {"spec": {"taints": [OPERATOR_TAINT]}})

    rig.api.before_patch = operator
    assert rig.step() == T0  # decided again at once, not at the next timer
    assert rig.api.calls == ["patch node n", "get node n"]
    assert rig.rec.stats.conflicts == 1 and rig.events() == []
    rig.step()
    assert rig.api.calls[2:] == ["patch node n", "create event GPUNodeQuarantined"]
    assert rig.taints("n") == [OPERATOR_TAINT, {"key": TAINT, "value": UNHEALTHY_DEVICES, "effect": "NoSchedule"}]


def test_a_conflict_that_made_the_node_fit_quarantines_nothing() -> None:
    rig = Rig([gpu_node("n", {1: "Unhealthy"})])
    healthy = dict([device(1, "Healthy", node="n")])

    def agent_recovers(name: str) -> None:
        rig.api.edit(name, {"metadata": {"annotations": {**healthy, f"{P}/state": "Healthy"}}})

    rig.api.before_patch = agent_recovers
    rig.step()
    rig.step()
    assert rig.api.writes() == ["patch node n"] and rig.quarantined() == []


def test_a_heartbeat_causes_no_decision_and_no_request() -> None:
    rig = Rig([gpu_node("bad", {1: "Unhealthy"}), gpu_node("good")], recovery_hold_s=600)
    rig.step()
    rig.agent("bad", {1: "Healthy"}, since=T0)
    due = rig.step()
    rig.api.calls.clear()
    for t in range(10, 500, 10):
        rig.clock.now = T0 + t
        for n in ("bad", "good"):
            rig.rec.upsert(rig.api.heartbeat(n, rig.clock.now))
        assert rig.step() == due
    assert rig.api.calls == []
    # The newest version is still kept: the release patch carries it, so it is not refused.
    rig.run_until(due)
    assert rig.api.calls == ["patch node bad", "create event GPUNodeReleased"]


def test_a_stale_watch_event_does_not_roll_the_cache_back() -> None:
    rig = Rig([gpu_node("n", {1: "Unhealthy"}), *(gpu_node(f"ok{i}") for i in range(9))])
    old = rig.node("n")
    rig.step()
    echo = rig.node("n")
    rig.rec.upsert(old)  # an event from before our write, still in flight
    rig.rec.upsert(echo)  # and the echo of our write
    assert rig.rec.counts()["quarantined"] == 1
    assert rig.rec.entries["n"].facts.resource_version == echo["metadata"]["resourceVersion"]
    rig.api.calls.clear()
    rig.step()
    assert rig.api.calls == []
    # A relist is the truth, whatever its versions: a Node gone from it is forgotten, unless we hold it
    # quarantined (it counts until released: test_controller_safety.py).
    rig.rec.replace([rig.node(f"ok{i}") for i in range(1, 9)])
    assert rig.rec.counts()["gpu_nodes"] == 9 and rig.rec.counts()["quarantined"] == 1
    assert "ok0" not in rig.rec.entries


def test_a_deleted_node_is_forgotten() -> None:
    rig = Rig([gpu_node("n", {1: "Unhealthy"}), gpu_node("m")])
    rig.step()
    gone = rig.node("n")
    del rig.api.nodes["n"]
    rig.rec.delete(gone)
    # Quarantined: held until a read by name says 404 (test_controller_safety.py), then forgotten.
    assert rig.rec.counts()["quarantined"] == 1
    rig.step()
    assert rig.rec.counts() == {"gpu_nodes": 1, "quarantined": 0, "candidates": 0, "limit": 1, "nodes": 1,
                                 "unreadable": 0}
    rig.rec.delete(rig.node("m"))
    assert rig.rec.counts()["nodes"] == 0


def test_a_failed_write_is_retried_after_a_back_off() -> None:
    rig = Rig([gpu_node("a", {1: "Unhealthy"}), gpu_node("b", {1: "Unhealthy"})], max_quarantined_fraction=1.0)
    rig.api.fail("patch node", 503, "etcd leader changed", times=2)
    due = rig.step()
    assert rig.quarantined() == [] and rig.rec.stats.api_failures == {"patch": 2}
    assert T0 + 0.5 <= due <= T0 + 1.0  # the first failure's back-off, with jitter
    assert rig.rec.stats.last_error == "b: HTTP 503: etcd leader changed"
    rig.step()
    assert rig.api.calls == ["patch node a", "patch node b"]  # nothing before the back-off is over
    rig.run_until(T0 + 10)
    assert rig.quarantined() == ["a", "b"] and rig.api.writes().count("patch node a") == 2


def test_a_node_gone_from_the_server_is_forgotten_on_its_404() -> None:
    rig = Rig([gpu_node("a", {1: "Unhealthy"}), gpu_node("b")], max_quarantined_fraction=1.0, recovery_hold_s=0)
    rig.step()
    rig.agent("a", {1: "Healthy"}, since=T0)
    del rig.api.nodes["a"]  # deleted, and the watch has not said so yet
    rig.step()
    assert "a" not in rig.rec.entries and rig.rec.counts()["gpu_nodes"] == 1


def test_a_lost_event_does_not_undo_the_quarantine() -> None:
    rig = Rig([gpu_node("n", {1: "Unhealthy"})])
    rig.api.fail("create event", 403, "events is forbidden")
    rig.step()
    assert rig.quarantined() == ["n"] and rig.rec.stats.event_failures == 1
    rig.step()
    assert rig.api.writes() == ["patch node n"]


# Leadership -------------------------------------------------------------------------------------------------------


def test_a_standby_never_writes() -> None:
    nodes = [gpu_node("bad", {1: "Unhealthy"}), gpu_node("stock", annotated=False, allocatable=1)]
    rig = Rig(nodes, leader=False, max_quarantined_fraction=1.0)
    rig.rec.leadership_changed(False)
    rig.run_until(T0 + 3600)
    rig.agent("bad", {1: "Unhealthy", 2: "Unhealthy"}, since=T0 + 3600)
    rig.run_until(T0 + 7200)
    assert rig.api.calls == []
    assert rig.rec.counts()["candidates"] == 2  # it knows: it is ready to take over
    # Leading by the callback but past its renew deadline (is_leader false): still nothing.
    rig.rec.leadership_changed(True)
    rig.step()
    assert rig.api.calls == []
    rig.lead.leader = True
    rig.rec.leadership_changed(True)
    rig.step()
    assert sorted(rig.api.writes()) == ["patch node bad", "patch node stock"]


class Expiring(FakeLeadership):
    """Leads for the first ``n`` questions, then has lost the Lease."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def is_leader(self) -> bool:
        self.n -= 1
        return self.n >= 0


def test_losing_the_lease_mid_batch_stops_writing_at_once() -> None:
    clock = FakeClock(T0)
    api = FakeControllerApi()
    for i in range(4):
        api.add_node(gpu_node(f"n{i}", {0: "Unhealthy"}))
    rec = Reconciler(api, Settings(keys=KEYS, rules=Rules(), max_quarantined_fraction=1.0), Expiring(7),
                     clock=clock)
    rec.replace(api.list_nodes("")[0])
    rec.leadership_changed(True)
    # One question before the batch, then one before each Node, and one right before each write (patch, Event).
    rec.step(clock.now)
    assert api.writes() == ["patch node n0", "patch node n1"]
    assert api.calls[1:] == ["patch node n0", "create event GPUNodeQuarantined",  # after the LIST
                             "patch node n1", "create event GPUNodeQuarantined"]


def test_a_new_leader_looks_at_every_node_once() -> None:
    rig = Rig([gpu_node("bad", {1: "Unhealthy"})], leader=False)
    rig.step()
    rig.lead.leader = True
    rig.step()
    assert rig.api.calls == []  # not told yet
    rig.rec.leadership_changed(True)
    rig.step()
    assert rig.api.writes() == ["patch node bad"]


def test_leader_hand_over_with_real_electors_acts_once_per_node() -> None:
    clock = FakeClock(T0)
    api = FakeControllerApi()
    for i in range(10):
        api.add_node(gpu_node(f"n{i}"))
    replicas: list[tuple[LeaderElector, Reconciler]] = []
    for ident in ("a", "b"):
        settings = Settings(keys=KEYS, rules=Rules(), identity=ident, max_quarantined_fraction=0.5)
        holder: list[Reconciler] = []

        def told(leading: bool, h: list[Reconciler] = holder) -> None:
            h[0].leadership_changed(leading)

        el = LeaderElector(api, settings.namespace, settings.lease_name, ident, lease_duration_s=15,
                           renew_deadline_s=10, retry_period_s=2, clock=clock, wall=clock, on_change=told)
        rec = Reconciler(api, settings, el, clock=clock)
        holder.append(rec)
        rec.replace(api.list_nodes("")[0])
        replicas.append((el, rec))
    (ea, _), (eb, _) = replicas

    def tick(*alive: tuple[LeaderElector, Reconciler]) -> None:
        for el, rec in alive:
            el.step()
            for name in list(api.nodes):
                rec.upsert(api.node(name))  # both watch the same Nodes
            rec.step(clock.now)
        clock.advance(2)

    tick(*replicas)
    assert ea.is_leader() and not eb.is_leader()
    agent(api, "n1", {0: "Unhealthy"}, since=clock.now)
    for _ in range(3):
        tick(*replicas)
    assert api.writes().count("patch node n1") == 1
    # Replica a dies (no more steps, no hand-back); n2 fails while nobody leads.
    agent(api, "n2", {0: "Unhealthy"}, since=clock.now)
    died = clock.now
    while not eb.is_leader():
        assert "patch node n2" not in api.writes()
        tick(replicas[1])
    assert clock.now - died >= 15
    tick(replicas[1])
    patched = [c for c in api.writes() if c.startswith("patch")]
    assert patched == ["patch node n1", "patch node n2"]
    lease = api.leases[("gpu-health-system", "gpu-health-controller")]
    assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1
    saved = BreakerState.from_json(lease["metadata"]["annotations"][f"{P}/breaker"])
    assert saved.quarantined == 2 and saved.state != OPEN and saved.limit == 5


# The breaker through the reconciler -------------------------------------------------------------------------------


def fleet(failing: int, total: int = 100) -> list[dict[str, Any]]:
    return [gpu_node(f"n{i:03}", {0: "Unhealthy"} if i < failing else None) for i in range(total)]


def test_a_correlated_failure_of_thirty_percent_quarantines_exactly_the_limit() -> None:
    rig = Rig(fleet(30), recovery_hold_s=60)
    rig.step()
    assert rig.quarantined() == [f"n{i:03}" for i in range(10)]
    assert rig.rec.breaker.is_open
    assert rig.rec.counts() == {"gpu_nodes": 100, "quarantined": 10, "candidates": 20, "limit": 10,
                                 "nodes": 100, "unreadable": 0}
    lease_events = [e for e in rig.events("GPUQuarantineBlocked") if e["involvedObject"]["kind"] == "Lease"]
    assert len(lease_events) == 1
    ev = lease_events[0]
    assert ev["namespace"] == "gpu-health-system" and ev["type"] == "Warning"
    assert ev["involvedObject"] == {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                    "namespace": "gpu-health-system", "name": "gpu-health-controller"}
    assert "30 GPU nodes call for quarantine, 10 already are; the limit is 10 of 100" in ev["message"]
    node_events = [e["involvedObject"]["name"] for e in rig.events("GPUQuarantineBlocked")
                   if e["involvedObject"]["kind"] == "Node"]
    assert node_events == [f"n{i:03}" for i in range(10, 30)]
    saved = BreakerState.from_json(rig.lead.lease_annotations[f"{P}/breaker"])
    assert (saved.state, saved.quarantined, saved.blocked, saved.limit) == (OPEN, 10, 20, 10)
    # More failing nodes, more steps: still ten, and each blocked node is told once.
    rig.agent("n050", {0: "Unhealthy"}, since=T0 + 5)
    rig.run_until(T0 + 30)
    assert len(rig.quarantined()) == 10
    assert len([e for e in rig.events("GPUQuarantineBlocked") if e["involvedObject"]["kind"] == "Node"]) == 21
    assert len([e for e in rig.events("GPUQuarantineBlocked") if e["involvedObject"]["kind"] == "Lease"]) == 1


def test_a_release_while_open_quarantines_nothing_new() -> None:
    rig = Rig(fleet(30), recovery_hold_s=60)
    rig.step()
    for i in range(3):
        rig.agent(f"n{i:03}", {0: "Healthy"}, since=T0 + 1)
    rig.run_until(T0 + 120)
    assert rig.quarantined() == [f"n{i:03}" for i in range(3, 10)]
    assert rig.rec.breaker.is_open
    assert rig.events("GPUQuarantineResumed") == []


def test_when_the_failure_recedes_the_breaker_closes_and_candidates_are_quarantined() -> None:
    rig = Rig(fleet(30), recovery_hold_s=60)
    rig.step()
    # The bad driver is rolled back on most nodes: 4 of the quarantined and 2 of the waiting still fail.
    for i in [*range(4, 10), *range(12, 30)]:
        rig.agent(f"n{i:03}", {0: "Healthy"}, since=T0 + 10)
    rig.clock.now = T0 + 10
    rig.step()
    assert rig.rec.breaker.is_open  # 10 quarantined (six of them recovering) and 2 waiting: over the limit still
    rig.run_until(T0 + 69)
    assert rig.quarantined() == [f"n{i:03}" for i in range(10)]
    rig.clock.now = T0 + 70
    # The hold is over: six released, the demand fits, the breaker closes, and the two waiting are due at once.
    assert rig.step() == T0 + 70
    assert rig.quarantined() == ["n000", "n001", "n002", "n003"] and not rig.rec.breaker.is_open
    rig.step()
    assert rig.quarantined() == ["n000", "n001", "n002", "n003", "n010", "n011"]
    rig.run_until(T0 + 200)
    assert rig.quarantined() == ["n000", "n001", "n002", "n003", "n010", "n011"]
    assert not rig.rec.breaker.is_open
    [resumed] = rig.events("GPUQuarantineResumed")
    assert resumed["message"] == "circuit breaker closed: demand 6 fits the limit 10 again"


def test_an_operator_reset_closes_the_breaker_and_it_may_open_again() -> None:
    rig = Rig(fleet(30), recovery_hold_s=60)
    rig.step()
    for i in range(5):
        rig.agent(f"n{i:03}", {0: "Healthy"}, since=T0)
    rig.run_until(T0 + 100)
    assert len(rig.quarantined()) == 5 and rig.rec.breaker.is_open
    rig.lead.lease_annotations[f"{P}/breaker-reset"] = "1767225700"
    rig.step()
    assert len(rig.quarantined()) == 10  # the room the releases made is used
    assert rig.rec.breaker.is_open and rig.rec.breaker.trips == 2  # and the limit opened it again
    [resumed] = rig.events("GPUQuarantineResumed")
    assert resumed["message"] == "circuit breaker reset by an operator (1767225700)"
    rig.run_until(T0 + 200)
    assert len(rig.quarantined()) == 10 and len(rig.events("GPUQuarantineResumed")) == 1  # a token acts once


# Drain --------------------------------------------------------------------------------------------------------------


def pod(name: str, *, owner: str = "ReplicaSet", phase: str = "Running", mirror: bool = False,
        terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": "team", "name": name, "uid": f"uid-{name}",
                            "ownerReferences": [{"kind": owner, "name": "o"}]}
    if mirror:
        meta["annotations"] = {"kubernetes.io/config.mirror": "x"}
    if terminating:
        meta["deletionTimestamp"] = rfc(T0)
    return {"metadata": meta, "status": {"phase": phase}}


def drain_rig(per_minute: float, pods: list[dict[str, Any]]) -> Rig:
    rig = Rig([gpu_node("n", {1: "Unhealthy"}), *(gpu_node(f"ok{i}") for i in range(9))], drain=True,
              drain_per_minute=per_minute)
    rig.api.pods["n"] = pods
    return rig


def test_drain_evicts_the_pods_drain_would_at_the_rate_and_marks_the_node() -> None:
    keep = [pod("ds", owner="DaemonSet"), pod("static", mirror=True), pod("done", phase="Succeeded"),
            pod("going", terminating=True)]
    rig = drain_rig(60.0, [pod(f"p{i}") for i in range(5)] + keep)
    rig.run_until(T0 + 60)
    assert rig.api.evictions == [(T0 + i, f"team/p{i}") for i in range(5)]
    assert rig.api.pods["n"] == keep
    ann = rig.node("n")["metadata"]["annotations"]
    assert ann[f"{OWN}/quarantine-drained"] == rfc(T0 + 4 + DRAIN_RECHECK_S)
    [ev] = rig.events("GPUNodeDrained")
    assert ev["message"] == "drained: no evictable pods left"
    # Drained is final: no more pod lists for it.
    calls = len(rig.api.calls)
    rig.run_until(T0 + 600)
    assert len(rig.api.calls) == calls


@pytest.mark.parametrize("per_minute", [2.0, 7.0, 45.0, 600.0])
def test_drain_keeps_to_any_rate_and_reaches_it(per_minute: float) -> None:
    rig = drain_rig(per_minute, [pod(f"p{i}") for i in range(4)])
    rig.run_until(T0 + 4 * 60 / per_minute + 60)
    gap = 60 / per_minute
    assert [t for t, _ in rig.api.evictions] == pytest.approx([T0 + i * gap for i in range(4)], abs=1e-6)


def test_a_pod_its_budget_holds_back_is_retried_and_does_not_hold_up_the_others() -> None:
    rig = drain_rig(60.0, [pod("a"), pod("b"), pod("c")])
    rig.api.refuse_evictions["a"] = 3
    rig.run_until(T0 + 120)
    assert rig.api.evictions[:2] == [(T0 + 1, "team/b"), (T0 + 2, "team/c")]
    assert [n for _, n in rig.api.evictions] == ["team/b", "team/c", "team/a"]
    assert rig.rec.stats.evictions_blocked == 3
    assert rig.api.calls.count("evict pod team/a") == 4
    # A refused pod is asked again no faster than the drain recheck.
    assert rig.api.evictions[2][0] >= T0 + 2 + 2 * DRAIN_RECHECK_S
    assert f"{OWN}/quarantine-drained" in rig.node("n")["metadata"]["annotations"]


def test_no_drain_without_the_option() -> None:
    rig = Rig([gpu_node("n", {1: "Unhealthy"})])
    rig.api.pods["n"] = [pod("p")]
    rig.run_until(T0 + 600)
    assert not any(c.startswith(("list pods", "evict")) for c in rig.api.calls)


def test_the_worker_thread_wakes_on_a_change_and_stops() -> None:
    api = FakeControllerApi()
    api.add_node(gpu_node("n"))
    rec = Reconciler(api, Settings(keys=KEYS, rules=Rules()), FakeLeadership())
    rec.replace(api.list_nodes("")[0])
    rec.leadership_changed(True)
    patching = threading.Event()
    api.before_patch = lambda name: patching.set()
    rec.start()
    try:
        assert rec.alive()
        agent(api, "n", {4: "Unhealthy"}, since=T0)
        rec.upsert(api.node("n"))  # the worker sleeps up to a minute; the change must wake it
        assert patching.wait(10.0), "the worker did not act on the change"
    finally:
        rec.stop()
    assert not rec.alive()
    assert api.writes() == ["patch node n"] and rec.counts()["quarantined"] == 1
