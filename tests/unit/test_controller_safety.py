"""The fleet controller's safety scenarios, each the reproduction of a defect: the breaker's limit holds
whatever a quarantined node looks like now, release takes back what was recorded, the agent cannot forge the
controller's record, the reset flag acts once, back-off is per node, and every write is made while leading. The
invariants themselves are in test_controller_invariants.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from plugin.controller.breaker import OPEN, BreakerState
from plugin.controller.reconciler import Reconciler
from plugin.kube.errors import ApiFailure
from tests.fakes.controller_api import T0, P, controller_sample, device, gpu_node, rfc
from tests.unit.test_controller_reconciler import Rig

NO_GPUS = {"status": {"capacity": {"nvidia.com/gpu": None}, "allocatable": {"nvidia.com/gpu": None}}}


def stock_fleet(n: int = 10) -> list[dict[str, Any]]:
    return [gpu_node(f"n{i}", annotated=False) for i in range(n)]


def gap(rig: Rig, name: str, allocatable: int) -> None:
    rig.api.edit(name, {"status": {"allocatable": {"nvidia.com/gpu": str(allocatable)}}})
    rig.watch(name)


# 1. The limit holds whatever a node looks like now --------------------------------------------------------------


def test_a_quarantined_node_whose_gpus_vanish_still_counts_and_is_not_released() -> None:
    rig = Rig(stock_fleet(), recovery_hold_s=60)
    gap(rig, "n0", 7)
    rig.step()
    assert rig.quarantined() == ["n0"]
    # The device plugin goes away: the kubelet drops the resource from capacity and allocatable.
    rig.api.edit("n0", NO_GPUS)
    rig.watch("n0")
    gap(rig, "n1", 6)
    rig.run_until(T0 + 600)
    assert rig.quarantined() == ["n0"]  # n1 waits behind the breaker: 1 of 10 is the limit
    assert rig.rec.counts()["gpu_nodes"] == 10 and rig.rec.counts()["quarantined"] == 1
    # It comes back whole: fit, and released after the hold; then n1's turn.
    rig.api.edit("n0", {"status": {"capacity": {"nvidia.com/gpu": "8"}, "allocatable": {"nvidia.com/gpu": "8"}}})
    rig.watch("n0")
    rig.lead.lease_annotations["gpu-health.io/breaker-reset"] = "1"
    rig.run_until(T0 + 800)
    assert rig.quarantined() == ["n1"]


def test_a_quarantined_node_that_leaves_the_selector_still_counts_and_is_released_by_name() -> None:
    rig = Rig(stock_fleet(), recovery_hold_s=60)
    gap(rig, "n0", 7)
    rig.step()
    rig.rec.delete(rig.node("n0"))  # the watch's DELETED: a label change took it out of --node-selector
    gap(rig, "n1", 6)
    rig.run_until(T0 + 300)
    assert rig.quarantined() == ["n0"]
    assert rig.rec.counts()["gpu_nodes"] == 10 and rig.rec.counts()["quarantined"] == 1
    assert "get node n0" in rig.api.calls
    # Healthy again, seen only by reading it by name: released.
    rig.api.edit("n0", {"status": {"allocatable": {"nvidia.com/gpu": "8"}}})
    rig.run_until(T0 + 600)
    assert "n0" not in rig.quarantined()
    assert rig.taints("n0") == []


def test_a_new_leader_finds_the_quarantined_nodes_outside_the_selector_through_the_lease() -> None:
    # A fresh process lists through --node-selector and would never see a node we quarantined that left it since:
    # the leader keeps their names on the Lease, and the next one reads them by name.
    rig = Rig(stock_fleet(), recovery_hold_s=60)
    gap(rig, "n0", 7)
    rig.step()
    rig.rec.delete(rig.node("n0"))  # it left the selector
    rig.step()
    fresh = Reconciler(rig.api, rig.settings, rig.lead, clock=rig.clock)
    fresh.replace([n for name, n in rig.api.nodes.items() if name != "n0"])  # its LIST, without n0
    rig.rec = fresh
    fresh.leadership_changed(True)
    gap(rig, "n1", 6)
    rig.run_until(T0 + 300)
    assert "get node n0" in rig.api.calls
    assert rig.quarantined() == ["n0"]  # n1 waits: n0 still counts, 1 of 10 is the limit
    assert fresh.counts()["quarantined"] == 1 and fresh.counts()["gpu_nodes"] == 10
    rig.api.edit("n0", {"status": {"allocatable": {"nvidia.com/gpu": "8"}}})
    rig.run_until(T0 + 600)
    assert "n0" not in rig.quarantined()


def test_a_leader_elected_before_its_first_list_completes_decides_the_nodes_that_were_already_failing() -> None:
    """Found by the SIGTERM storm test on a busy API server: the Lease came before the first LIST's last page. The
    steps the pages woke (leading, not yet synced) dropped the dirty set, the end of the LIST marked nothing, and
    1,000 failing nodes sat undecided until each changed again. A fresh controller (a roll-out, a crash) on a big
    fleet, where the LIST takes tens of seconds and a handed-back Lease is taken at once, met it on every start."""
    failing = [gpu_node(f"n{i}", {0: "Unhealthy"}) for i in range(3)]
    healthy = [gpu_node(f"h{i}") for i in range(3)]
    rig = Rig([*failing, *healthy], leader=False, max_quarantined_fraction=1.0)
    rec = Reconciler(rig.api, rig.settings, rig.lead, clock=rig.clock)  # a new process: nothing listed yet
    rig.lead.leader = True
    rec.leadership_changed(True)  # the Lease first
    pages = rig.api.list_nodes("")[0]
    rec.begin_list()
    for page in (pages[:2], pages[2:4], pages[4:]):
        rec.list_page(page)
        rec.step(rig.clock.now)  # each page wakes the worker, before the LIST is whole
    rec.end_list()
    rec.step(rig.clock.now)
    assert rig.quarantined() == ["n0", "n1", "n2"]


@pytest.mark.xfail(strict=True, reason="known gap, found by test_controller_invariants.py and not fixed: the Lease "
                   "names a node held outside the selector only once the leader's next renewal carries it")
def test_a_node_that_leaves_the_selector_while_the_lease_is_lost_is_known_to_the_next_leader() -> None:
    # n0 leaves the selector; the leader loses the Lease before the renewal that would carry n0's name on it. The next
    # leader is a fresh process (a roll-out replaced the standby that saw n0 go): n0 is in none of its LISTs and on
    # no Lease, so it is held by nobody, and its slot looks free: n1 takes it, two quarantined under a limit of one.
    rig = Rig(stock_fleet(), recovery_hold_s=60)
    gap(rig, "n0", 7)
    rig.step()
    assert rig.quarantined() == ["n0"]
    rig.rec.delete(rig.node("n0"))
    rig.lead.leader = False
    rig.rec.leadership_changed(False)
    rig.step()
    assert "n0" not in rig.lead.lease_annotations.get(f"{P}/quarantined-out-of-sight", "")
    fresh = Reconciler(rig.api, rig.settings, rig.lead, clock=rig.clock)
    fresh.replace([n for name, n in rig.api.nodes.items() if name != "n0"])
    rig.rec = fresh
    rig.lead.leader = True
    fresh.leadership_changed(True)
    gap(rig, "n1", 6)
    rig.run_until(T0 + 300)
    assert rig.quarantined() == ["n0"]  # n1 waits: n0 still counts, 1 of 10 is the limit


def test_a_quarantined_node_missing_from_a_relist_still_counts() -> None:
    rig = Rig(stock_fleet(), recovery_hold_s=60)
    gap(rig, "n0", 7)
    rig.step()
    rig.rec.replace([rig.node(f"n{i}") for i in range(1, 10)])
    gap(rig, "n1", 6)
    rig.run_until(T0 + 300)
    assert rig.quarantined() == ["n0"]
    assert rig.rec.counts()["quarantined"] == 1


def test_a_quarantined_node_deleted_from_the_server_is_forgotten_on_its_404() -> None:
    rig = Rig(stock_fleet(), recovery_hold_s=60)
    gap(rig, "n0", 7)
    rig.step()
    gone = rig.node("n0")
    del rig.api.nodes["n0"]
    rig.rec.delete(gone)
    rig.run_until(T0 + 10)
    assert "n0" not in rig.rec.entries
    assert rig.rec.counts()["gpu_nodes"] == 9 and rig.rec.counts()["quarantined"] == 0


# 3. Release takes back exactly what was added --------------------------------------------------------------------


def test_release_after_a_change_of_the_label_setting_removes_the_label_it_added() -> None:
    rig = Rig([gpu_node("n", {1: "Unhealthy"}, labels={"team.example.com/owner": "alice"})],
              label="gpu-health.io/quarantined=true", recovery_hold_s=60)
    rig.step()
    assert rig.node("n")["metadata"]["labels"]["gpu-health.io/quarantined"] == "true"
    # The controller restarts with another label setting, one whose key an operator already uses on the node.
    settings = replace(rig.settings, label="team.example.com/owner=gpu-health")
    rig.rec = Reconciler(rig.api, settings, rig.lead, clock=rig.clock)
    rig.rec.replace(rig.api.list_nodes("")[0])
    rig.rec.leadership_changed(True)
    rig.agent("n", {1: "Healthy"}, since=rig.clock.now)
    rig.run_until(T0 + 600)
    assert rig.quarantined() == []
    assert rig.node("n")["metadata"]["labels"] == {"team.example.com/owner": "alice"}


def test_a_label_an_operator_changed_during_the_quarantine_is_theirs() -> None:
    rig = Rig([gpu_node("n", {1: "Unhealthy"})], label="gpu-health.io/quarantined=true", recovery_hold_s=60)
    rig.step()
    rig.api.edit("n", {"metadata": {"labels": {"gpu-health.io/quarantined": "keep-for-rma"}}})
    rig.watch("n")
    rig.agent("n", {1: "Healthy"}, since=rig.clock.now)
    rig.run_until(T0 + 600)
    assert rig.quarantined() == []
    assert rig.node("n")["metadata"]["labels"] == {"gpu-health.io/quarantined": "keep-for-rma"}


# 4. The agent cannot forge the controller's record, nor its hold ------------------------------------------------


def test_an_agent_forging_the_old_record_cannot_make_the_controller_uncordon() -> None:
    taint = {"key": "gpu-health.io/quarantine", "value": "unhealthy-devices", "effect": "NoSchedule"}
    forged = {"gpu-health.io/quarantined-by": "gpu-health-controller", "gpu-health.io/quarantine-owns": "cordon,taint",
              "gpu-health.io/quarantine-reason": "unhealthy-devices", "gpu-health.io/quarantined-at": rfc(T0 - 86400)}
    # An operator cordoned the node (and put our taint on by hand); a compromised agent writes the old record and
    # healthy devices that say they recovered a day ago.
    rig = Rig([gpu_node("n", since=T0 - 86400, unschedulable=True, taints=[taint], annotations=forged)],
              recovery_hold_s=60)
    rig.run_until(T0 + 3600)
    assert rig.api.writes() == []
    assert rig.node("n")["spec"]["unschedulable"] is True and rig.taints("n") == [taint]
    assert rig.rec.counts()["quarantined"] == 0


def test_the_recovery_hold_runs_on_the_controllers_clock_not_the_agents_since() -> None:
    rig = Rig([gpu_node("n", {2: "Unhealthy"})], recovery_hold_s=600)
    rig.step()
    rig.clock.now = T0 + 400
    rig.agent("n", {2: "Healthy"}, since=T0 - 86400)  # a since from long ago: not a reason to skip the hold
    rig.run_until(T0 + 999)
    assert rig.quarantined() == ["n"]
    rig.run_until(T0 + 1000)
    assert rig.quarantined() == []


# 5. --reset-breaker acts once per process start ------------------------------------------------------------------


def test_reset_breaker_closes_the_breaker_once_per_process_not_per_leadership() -> None:
    rig = Rig([gpu_node(f"n{i:02}", {0: "Unhealthy"} if i < 5 else None) for i in range(20)], leader=False,
              reset_breaker=True)
    opened = BreakerState(state=OPEN, since=rfc(T0 - 600), limit=2, gpu_nodes=20, quarantined=0, blocked=5)
    rig.lead.lease_annotations[f"{P}/breaker"] = opened.to_json()
    rig.lead.leader = True
    rig.rec.leadership_changed(True)
    assert not rig.rec.breaker.is_open  # the flag closes it at the first acquisition
    rig.step()
    assert len(rig.quarantined()) == 2 and rig.rec.breaker.is_open  # and the limit opened it again
    # A Lease blip: leadership lost and won back (or handed over and back) with the flag still set.
    rig.clock.now = T0 + 30
    rig.lead.leader = False
    rig.rec.leadership_changed(False)
    rig.lead.leader = True
    rig.rec.leadership_changed(True)
    assert rig.rec.breaker.is_open
    rig.run_until(T0 + 60)
    assert len(rig.quarantined()) == 2


# 6. Per-node back-off; a refusal is final for that decision -----------------------------------------------------


def sample(rig: Rig, family: str, **labels: str) -> float:
    return controller_sample(rig.rec, family, **labels)


def flapping(rig: Rig, name: str, until: float, every: float = 5.0) -> None:
    """Another node that fails and recovers again and again: its writes succeed all along (its rig counts no
    repeat offenders, ``repeat_limit=0``, or the fifth quarantine would hold it)."""
    state = "Healthy"
    while rig.clock.now < until:
        state = "Unhealthy" if state == "Healthy" else "Healthy"
        rig.agent(name, {0: state}, since=rig.clock.now)
        rig.run_until(rig.clock.now + every)


def test_a_node_whose_patch_keeps_failing_backs_off_on_its_own() -> None:
    rig = Rig([gpu_node("a", {1: "Unhealthy"}), gpu_node("b"), *(gpu_node(f"ok{i}") for i in range(8))],
              max_quarantined_fraction=1.0, recovery_hold_s=0, repeat_limit=0)
    rig.api.refuse_patches["a"] = ApiFailure(503, "the webhook is not reachable")
    flapping(rig, "b", T0 + 600)
    tries = rig.api.calls.count("patch node a")
    assert rig.api.writes().count("patch node b") >= 100  # b's writes went through all along
    # 1 s doubling to a minute, each wait drawn from the upper half of its step: the first six waits take 31.5 to
    # 63 s, every later one 30 to 60 s, so ten minutes hold 1 + 6 + 8 to 1 + 6 + 18 tries, never one a second.
    assert 15 <= tries <= 25


def test_a_refused_patch_is_not_retried_until_the_node_changes_or_a_resync() -> None:
    rig = Rig([gpu_node("a", {1: "Unhealthy"}), gpu_node("b"), *(gpu_node(f"ok{i}") for i in range(8))],
              max_quarantined_fraction=1.0, recovery_hold_s=0, repeat_limit=0)
    rig.api.refuse_patches["a"] = ApiFailure(403, 'admission webhook "deny.example.com" denied the request')
    flapping(rig, "b", T0 + 600)
    assert rig.api.calls.count("patch node a") == 1
    assert rig.rec.stats.refused_writes == {"quarantine": 1}
    assert sample(rig, "gpu_health_controller_refused_writes", action="quarantine") == 1
    [ev] = rig.events("GPUNodeWriteRefused")
    assert ev["involvedObject"]["name"] == "a" and ev["type"] == "Warning"
    assert "HTTP 403" in ev["message"] and "deny.example.com" in ev["message"]
    # A heartbeat is no change of the decision's inputs: still not retried.
    rig.rec.upsert(rig.api.heartbeat("a", rig.clock.now))
    rig.run_until(rig.clock.now + 60)
    assert rig.api.calls.count("patch node a") == 1
    # A change of the node is a new decision: one more try (refused again: one more Event).
    rig.agent("a", {1: "Unhealthy", 2: "Unhealthy"}, since=rig.clock.now)
    rig.run_until(rig.clock.now + 60)
    assert rig.api.calls.count("patch node a") == 2 and len(rig.events("GPUNodeWriteRefused")) == 2
    # So is a resync's LIST; and once the webhook lets it through, it is quarantined.
    del rig.api.refuse_patches["a"]
    rig.rec.replace(rig.api.list_nodes("")[0])
    rig.run_until(rig.clock.now + 1)
    assert "a" in rig.quarantined()


# 7. The leader asks whether it still leads right before each write ---------------------------------------------


def losing_the_lease_during(rig: Rig, call: str) -> None:
    rig.api.leading = rig.lead.is_leader

    def lease_lost(made: str) -> None:
        if made == call:
            rig.lead.leader = False

    rig.api.on_call = lease_lost


def test_no_event_or_next_patch_after_the_lease_is_lost_during_a_patch() -> None:
    rig = Rig([gpu_node(f"n{i}", {0: "Unhealthy"}) for i in range(4)], max_quarantined_fraction=1.0)
    losing_the_lease_during(rig, "patch node n0")
    rig.step()
    assert rig.api.calls == ["patch node n0"]
    assert rig.api.unled_writes == []


def test_no_eviction_after_the_lease_is_lost_while_listing_pods() -> None:
    from tests.unit.test_controller_reconciler import pod

    rig = Rig([gpu_node("n", {1: "Unhealthy"}), *(gpu_node(f"ok{i}") for i in range(9))], drain=True,
              drain_per_minute=600)
    rig.api.pods["n"] = [pod(f"p{i}") for i in range(3)]
    rig.step()  # quarantined; the drain is due at once
    losing_the_lease_during(rig, "list pods n")
    rig.step()
    assert rig.api.calls[-1] == "list pods n"
    assert rig.api.unled_writes == [] and rig.api.evictions == []


def test_what_an_operator_took_off_and_put_back_is_theirs_even_for_the_next_leader() -> None:
    rig = Rig([gpu_node("n", {1: "Unhealthy"}), *(gpu_node(f"ok{i}") for i in range(9))], cordon=True,
              label="gpu-health.io/quarantined=true", recovery_hold_s=60, no_execute_after_s=30)
    rig.step()
    # The operator uncordons and takes our label off, then puts both back (a maintenance of theirs), in two
    # writes the controller sees one by one before it decides again.
    rig.api.edit("n", {"spec": {"unschedulable": False}, "metadata": {"labels": {"gpu-health.io/quarantined": None}}})
    rig.watch("n")
    rig.api.edit("n", {"spec": {"unschedulable": True}, "metadata": {"labels": {"gpu-health.io/quarantined": "true"}}})
    rig.watch("n")
    rig.run_until(T0 + 40)  # the NoExecute taint goes on; then the operator takes it off
    rig.api.edit("n", {"spec": {"taints": [t for t in rig.taints("n") if t["effect"] != "NoExecute"]}})
    rig.watch("n")
    rig.run_until(T0 + 80)
    assert [t["effect"] for t in rig.taints("n")] == ["NoSchedule"]  # not put back
    # A new leader (fresh process) releases it, from the record alone.
    rig.rec = Reconciler(rig.api, rig.settings, rig.lead, clock=rig.clock)
    rig.rec.replace(rig.api.list_nodes("")[0])
    rig.rec.leadership_changed(True)
    rig.agent("n", {1: "Healthy"}, since=rig.clock.now)
    rig.run_until(T0 + 300)
    doc = rig.node("n")
    assert rig.quarantined() == [] and rig.taints("n") == []
    assert doc["spec"]["unschedulable"] is True and doc["metadata"]["labels"] == {"gpu-health.io/quarantined": "true"}


# A write's answer that the watch has already overtaken ----------------------------------------------------------


def test_a_write_answer_older_than_what_the_watch_delivered_neither_overwrites_it_nor_drops_its_recheck() -> None:
    # Found by bench/bench_fleet.py at 500 nodes: the quarantine's answer reached the worker after the watch had
    # delivered the write's echo and then the agent's "healthy again"; the stale answer replaced the newer facts and
    # cleared the recheck, so the node stayed quarantined until it changed again or the next resync.
    rig = Rig([gpu_node("n", {2: "Unhealthy"})], recovery_hold_s=0)
    patch = rig.api.patch_node

    def overtaken(name: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = patch(name, body)
        rig.watch(name)  # the write's echo
        rig.agent(name, {2: "Healthy"}, since=T0)  # and the agent's next change, both before the answer lands
        return answer

    rig.api.patch_node = overtaken  # type: ignore[method-assign]
    rig.step()
    rig.api.patch_node = patch  # type: ignore[method-assign]
    assert rig.quarantined() == ["n"]
    cached = rig.rec.entries["n"].facts
    assert cached.resource_version == rig.node("n")["metadata"]["resourceVersion"]
    assert cached.node_state == "Healthy"
    rig.run_until(T0 + 1)
    assert rig.quarantined() == []


# A resync LIST that quarantines overtake (issue 35, 2) ----------------------------------------------------------


def test_a_resync_page_older_than_a_quarantine_that_landed_during_the_list_neither_frees_its_slot_nor_blocks_it() -> \
        None:
    # The LIST's snapshot is taken before n0's quarantine lands; its page arrives after. Stored over the newer facts,
    # it showed n0 as never quarantined: its slot looked free, n1 took it (two quarantined under a limit of one), and
    # n0 itself got a false GPUQuarantineBlocked.
    rig = Rig(stock_fleet(), max_quarantined_nodes=1, recovery_hold_s=60)
    snapshot = [rig.node(f"n{i}") for i in range(10)]
    gap(rig, "n0", 7)
    rig.step()
    assert rig.quarantined() == ["n0"]
    rig.rec.begin_list()
    rig.rec.list_page(snapshot)
    rig.rec.end_list()
    assert rig.rec.entries["n0"].facts.quarantine is not None
    gap(rig, "n1", 6)
    rig.run_until(T0 + 300)
    assert rig.quarantined() == ["n0"]
    assert rig.rec.counts()["quarantined"] == 1
    blocked = [e["involvedObject"]["name"] for e in rig.events("GPUQuarantineBlocked")
               if e["involvedObject"]["kind"] == "Node"]
    assert blocked == ["n1"]


def test_a_resync_page_older_than_the_cache_still_counts_as_listed() -> None:
    # Kept facts must not make the node look gone: end_list forgets what the LIST did not name.
    rig = Rig(stock_fleet(3), recovery_hold_s=60)
    snapshot = [rig.node(f"n{i}") for i in range(3)]
    rig.agent("n2", {1: "Degraded"}, since=T0)
    rig.rec.begin_list()
    rig.rec.list_page(snapshot)
    rig.rec.end_list()
    assert sorted(rig.rec.entries) == ["n0", "n1", "n2"]
    assert rig.rec.entries["n2"].facts.resource_version == rig.node("n2")["metadata"]["resourceVersion"]


# One node's annotation must not blind the controller (issue 35, 1) ----------------------------------------------

DEEP = "[" * 1000 + "]" * 1000  # json.loads raises RecursionError on it; the agent's account can write it


def test_a_node_with_a_deep_nested_annotation_in_the_list_neither_stops_it_nor_the_quarantines_after_it() -> None:
    # The LIST died at this node every 5 s before: no sync, no quarantine anywhere, and /readyz said ok.
    bad = gpu_node("n0", {0: "Unhealthy"}, annotations={f"{P}/gpu.3": DEEP})
    rig = Rig([bad, *stock_fleet()[1:], gpu_node("z9", {2: "Unhealthy"})], max_quarantined_nodes=3)
    assert rig.rec.synced and sorted(rig.rec.entries) == sorted([*(f"n{i}" for i in range(10)), "z9"])
    rig.run_until(T0 + 60)
    assert rig.quarantined() == ["z9"]  # the node after the bad one is seen and acted on
    assert rig.rec.counts()["unreadable"] == 1
    told = [e for e in rig.events("GPUAnnotationsUnreadable") if e["involvedObject"]["name"] == "n0"]
    assert len(told) == 1 and f"{P}/gpu.3" in told[0]["message"], told
    # Another device goes Unhealthy, gpu.3 still unreadable: no second Event, still not quarantined.
    rig.api.edit("n0", {"metadata": {"annotations": dict([device(1, "Unhealthy", action="reset-gpu",
                                                                 code="ecc-uncorrected", since=T0, node="n0")])}})
    rig.watch("n0")
    rig.run_until(T0 + 600)
    assert rig.quarantined() == ["z9"] and len(rig.events("GPUAnnotationsUnreadable")) == 1


def test_a_quarantined_node_whose_annotations_turn_unreadable_is_not_released_on_them() -> None:
    rig = Rig([gpu_node("n0", {0: "Unhealthy"}), *stock_fleet()[1:]], recovery_hold_s=0)
    rig.step()
    assert rig.quarantined() == ["n0"]
    rig.api.edit("n0", {"metadata": {"annotations": {f"{P}/gpu.0": DEEP, f"{P}/state": "Healthy"}}})
    rig.watch("n0")
    rig.run_until(T0 + 600)
    assert rig.quarantined() == ["n0"]
    rig.agent("n0", {0: "Healthy"}, since=T0)  # readable again, and healthy: released after the hold
    rig.run_until(T0 + 1200)
    assert rig.quarantined() == [] and rig.rec.counts()["unreadable"] == 0


def test_a_node_the_lease_names_stays_to_be_read_when_a_deleted_event_for_it_comes_first() -> None:
    # Found by the invariant machine: the new leader had n0 from the Lease, not read yet, when a DELETED event for
    # it arrived (it left the selector again); forgetting an unknown Node dropped its mark, and n0 was never read
    # again: held quarantined by nobody, and its slot free for another.
    rig = Rig(stock_fleet(), recovery_hold_s=60)
    gap(rig, "n0", 7)
    rig.step()
    rig.rec.delete(rig.node("n0"))
    rig.step()
    fresh = Reconciler(rig.api, rig.settings, rig.lead, clock=rig.clock)
    fresh.replace([n for name, n in rig.api.nodes.items() if name != "n0"])
    rig.rec = fresh
    fresh.leadership_changed(True)
    fresh.delete(rig.node("n0"))
    gap(rig, "n1", 6)
    rig.run_until(T0 + 300)
    assert "get node n0" in rig.api.calls
    assert rig.quarantined() == ["n0"] and fresh.counts()["quarantined"] == 1
