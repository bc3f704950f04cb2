"""The circuit breaker: the limit, opening on the first refused candidate, staying open through releases, closing
when the demand fits or an operator resets it, and its state on the Lease annotation, which a new leader starts
from."""

from __future__ import annotations

import json

import pytest

from plugin.controller.breaker import CLOSED, OPEN, Breaker, BreakerState, limit_for
from plugin.controller.nodes import Keys
from plugin.controller.policy import Rules
from plugin.controller.reconciler import Reconciler, Settings
from tests.conftest import FakeClock
from tests.fakes.controller_api import T0, FakeControllerApi, FakeLeadership, P, controller_sample, gpu_node, rfc

KEYS = Keys(P)


@pytest.mark.parametrize(("fraction", "nodes", "limit"), [
    (0.1, 0, 0), (0.1, 1, 1), (0.1, 9, 1), (0.1, 10, 1), (0.1, 19, 1), (0.1, 20, 2), (0.1, 100, 10),
    (0.1, 5000, 500), (1.0, 7, 7), (0.5, 3, 1),
    # Decimal fractions are not exact in binary: 0.29 * 100 is 28.999999999999996, still a limit of 29.
    (0.29, 100, 29), (0.57, 100, 57), (0.07, 100, 7),
])
def test_the_limit_is_the_fraction_rounded_down_but_one_at_least(fraction: float, nodes: int, limit: int) -> None:
    assert limit_for(fraction, nodes) == limit
    assert Breaker(fraction).limit(nodes) == limit


def offer(b: Breaker, candidates: int, quarantined: int, gpu_nodes: int, now: str) -> int:
    """The reconciler's loop over candidates: quarantine while allowed, else trip. Returns the new count."""
    waiting = candidates
    for _ in range(candidates):
        if b.allows(quarantined, gpu_nodes):
            quarantined += 1
            waiting -= 1
        else:
            b.trip(now, quarantined, waiting, gpu_nodes)
    return quarantined


def test_thirty_of_a_hundred_failing_quarantines_exactly_ten_and_opens() -> None:
    b = Breaker(0.1)
    assert offer(b, 30, 0, 100, rfc(T0)) == 10
    assert b.is_open and b.trips == 1
    st = b.state
    assert (st.state, st.since, st.limit, st.gpu_nodes, st.quarantined, st.blocked) == (OPEN, rfc(T0), 10, 100, 10,
                                                                                        20)
    assert "30 GPU nodes call for quarantine, 10 already are; the limit is 10 of 100 (10%" in st.reason
    assert not b.settle(rfc(T0), 10, 20, 100)
    assert b.is_open


def test_trip_reports_the_opening_once_and_keeps_its_time() -> None:
    b = Breaker(0.1)
    assert b.trip(rfc(T0), 10, 1, 100) is True
    assert b.trip(rfc(T0 + 60), 10, 5, 100) is False
    assert b.trips == 1 and b.state.since == rfc(T0) and b.state.blocked == 5


def test_a_release_while_open_quarantines_nothing_new() -> None:
    b = Breaker(0.1)
    offer(b, 30, 0, 100, rfc(T0))
    # Two quarantined nodes recovered and were released: room for two, but the failure has not receded.
    assert not b.settle(rfc(T0 + 600), 8, 20, 100)
    assert not b.allows(8, 100)
    assert offer(b, 20, 8, 100, rfc(T0 + 600)) == 8


def test_demand_under_the_limit_closes_it_and_candidates_are_then_allowed() -> None:
    b = Breaker(0.1)
    offer(b, 30, 0, 100, rfc(T0))
    assert not b.settle(rfc(T0 + 60), 10, 1, 100)  # 11 > 10: still too many
    assert b.settle(rfc(T0 + 120), 7, 3, 100) is True  # 10 <= 10
    st = b.state
    assert (st.state, st.since, st.blocked) == (CLOSED, rfc(T0 + 120), 0)
    assert st.reason == "demand 10 fits the limit 10 again"
    assert b.allows(7, 100)
    assert offer(b, 3, 7, 100, rfc(T0 + 120)) == 10 and not b.is_open
    assert not b.settle(rfc(T0 + 180), 10, 0, 100)  # closed already: no second report


def test_an_operator_reset_closes_it_once_per_token_and_it_may_open_again() -> None:
    b = Breaker(0.1)
    offer(b, 30, 0, 100, rfc(T0))
    assert b.reset(rfc(T0 + 30), "1767225630") is True
    st = b.state
    assert (st.state, st.since, st.reset_seen) == (CLOSED, rfc(T0 + 30), "1767225630")
    assert "reset by an operator (1767225630)" in st.reason
    assert b.reset(rfc(T0 + 40), "1767225630") is False  # the same annotation seen again: no second reset
    # Still 20 candidates over a full limit: the next one opens it again, a second trip.
    assert b.allows(9, 100)
    assert offer(b, 20, 10, 100, rfc(T0 + 50)) == 10
    assert b.is_open and b.trips == 2 and b.state.since == rfc(T0 + 50)
    assert b.reset(rfc(T0 + 60), "1767225660") is True and not b.is_open


def test_a_reset_while_closed_is_remembered_and_changes_nothing_else() -> None:
    b = Breaker(0.1, BreakerState(state=CLOSED, since=rfc(T0), reason="demand 3 fits the limit 10 again"))
    assert b.reset(rfc(T0 + 5), "tok") is False
    assert b.state == BreakerState(state=CLOSED, since=rfc(T0), reason="demand 3 fits the limit 10 again",
                                   reset_seen="tok")


def test_the_state_round_trips_through_its_json() -> None:
    b = Breaker(0.1)
    offer(b, 30, 0, 100, rfc(T0))
    b.reset(rfc(T0 + 1), "t1")
    b.trip(rfc(T0 + 2), 10, 20, 100)
    raw = b.state.to_json()
    doc = json.loads(raw)
    assert set(doc) == {"state", "since", "limit", "gpuNodes", "quarantined", "blocked", "reason", "resetSeen",
                         "maxNodes"}
    assert " " not in raw.replace(doc["reason"], "")  # compact: it lives in an annotation
    assert BreakerState.from_json(raw) == b.state


@pytest.mark.parametrize("raw", [None, "", "not json", "[1]", '"open"', '{"state": "ajar"}',
                                 '{"state": "open", "limit": true, "blocked": "3"}'])
def test_a_missing_or_broken_state_reads_as_closed_with_what_is_usable(raw: str | None) -> None:
    st = BreakerState.from_json(raw)
    assert st.limit == 0 and st.blocked == 0
    assert st.state == (OPEN if raw and '"open"' in raw and raw.startswith("{") else CLOSED)


# The state on the Lease, through the reconciler ------------------------------------------------------------------


def reconciler(api: FakeControllerApi, lead: FakeLeadership, clock: FakeClock) -> Reconciler:
    rec = Reconciler(api, Settings(keys=KEYS, rules=Rules(), max_quarantined_fraction=0.1), lead, clock=clock)
    rec.replace(api.list_nodes("")[0])
    return rec


def test_the_leader_persists_the_state_and_a_new_leader_starts_from_it() -> None:
    clock = FakeClock(T0)
    api = FakeControllerApi()
    for i in range(20):
        api.add_node(gpu_node(f"n{i:02}", {0: "Unhealthy"} if i < 6 else None))
    lease = FakeLeadership()
    first = reconciler(api, lease, clock)
    first.leadership_changed(True)
    first.step(clock.now)
    assert first.counts()["quarantined"] == 2  # the limit: 10% of 20
    saved = BreakerState.from_json(lease.lease_annotations[f"{P}/breaker"])
    assert (saved.state, saved.limit, saved.gpu_nodes, saved.quarantined, saved.blocked) == (OPEN, 2, 20, 2, 4)
    assert [k for k, _ in lease.set_calls] == [f"{P}/breaker"]  # once: it changed once
    first.step(clock.advance(5))
    assert len(lease.set_calls) == 1  # unchanged state is not written again

    # A replica that takes over (the old one died) reads the Lease and keeps the breaker open.
    lease.set_calls.clear()
    api.calls.clear()
    second = reconciler(api, lease, clock)
    second.leadership_changed(True)
    assert second.breaker.is_open and second.breaker.state == saved
    second.step(clock.advance(5))
    assert api.writes() == [] and second.counts()["quarantined"] == 2
    assert lease.set_calls == []


@pytest.mark.parametrize("reset", [False, True])
def test_a_new_leader_with_reset_breaker_closes_it_once(reset: bool) -> None:
    clock = FakeClock(T0)
    api = FakeControllerApi()
    for i in range(20):
        api.add_node(gpu_node(f"n{i:02}", {0: "Unhealthy"} if i < 3 else None))
    open_state = BreakerState(state=OPEN, since=rfc(T0 - 600), limit=2, gpu_nodes=20, quarantined=0, blocked=3)
    lease = FakeLeadership(annotations={f"{P}/breaker": open_state.to_json()})
    rec = Reconciler(api, Settings(keys=KEYS, rules=Rules(), reset_breaker=reset), lease, clock=clock)
    rec.replace(api.list_nodes("")[0])
    rec.leadership_changed(True)
    assert rec.breaker.is_open is not reset
    rec.step(clock.now)
    # Three candidates over a limit of two: without the reset nothing moves; with it two go, and the third opens
    # the breaker again.
    assert api.writes() == (["patch node n00", "patch node n01"] if reset else [])
    saved = BreakerState.from_json(lease.lease_annotations[f"{P}/breaker"])
    assert saved.state == OPEN and saved.blocked == (1 if reset else 3)
    assert saved.reset_seen.startswith("--reset-breaker at ") is reset


# The absolute cap (--max-quarantined-nodes) ----------------------------------------------------------------------


@pytest.mark.parametrize(("fraction", "cap", "nodes", "limit"), [
    (0.5, 0, 100, 50), (0.5, 3, 100, 3), (0.1, 30, 100, 10), (0.1, 1, 9, 1), (1.0, 5, 3, 3), (0.1, 4, 0, 0),
])
def test_the_absolute_cap_and_the_fraction_the_smaller_wins(fraction: float, cap: int, nodes: int,
                                                            limit: int) -> None:
    assert limit_for(fraction, nodes, cap) == limit
    assert Breaker(fraction, max_nodes=cap).limit(nodes) == limit


def test_the_cap_is_named_in_the_reason_and_kept_in_the_state() -> None:
    b = Breaker(0.5, max_nodes=3)
    assert b.trip(rfc(T0), 3, 7, 100)
    assert b.state.reason == ("10 GPU nodes call for quarantine, 3 already are; the limit is 3 of 100 "
                              "(--max-quarantined-nodes 3; --max-quarantined-fraction 50% would allow 50)")
    assert json.loads(b.state.to_json())["maxNodes"] == 3
    assert BreakerState.from_json(b.state.to_json()) == b.state
    fraction_bound = Breaker(0.1, max_nodes=30)
    fraction_bound.trip(rfc(T0), 10, 5, 100)
    assert fraction_bound.state.reason.endswith("the limit is 10 of 100 (10%, --max-quarantined-fraction)")


def test_the_reconciler_keeps_to_the_cap_and_its_metrics_show_it() -> None:
    clock = FakeClock(T0)
    api = FakeControllerApi()
    for i in range(100):
        api.add_node(gpu_node(f"n{i:03}", {0: "Unhealthy"} if i < 10 else None))
    lead = FakeLeadership()
    rec = Reconciler(api, Settings(keys=KEYS, rules=Rules(), max_quarantined_fraction=0.5,
                                   max_quarantined_nodes=3), lead, clock=clock)
    rec.replace(api.list_nodes("")[0])
    rec.leadership_changed(True)
    rec.step(clock.now)
    assert rec.counts()["quarantined"] == 3 and rec.counts()["limit"] == 3 and rec.breaker.is_open
    [opened] = [e for e in api.events if e["involvedObject"]["kind"] == "Lease"]
    assert "--max-quarantined-nodes 3" in opened["message"]

    assert controller_sample(rec, "gpu_health_controller_quarantine_limit") == 3
    assert controller_sample(rec, "gpu_health_controller_quarantine_max_nodes") == 3
