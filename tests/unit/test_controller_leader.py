"""Leader election on a Lease, one ``step()`` at a time on a virtual clock, against an in-memory Lease store that
refuses a write carrying an old resourceVersion (409), as the API server does."""

from __future__ import annotations

import random
from typing import Any

import pytest

from plugin.controller.leader import LeaderElector
from tests.conftest import FakeClock
from tests.fakes.controller_api import T0, FakeControllerApi, P

NS = "gpu-health-system"
NAME = "gpu-health-controller"
BREAKER = f"{P}/breaker"
RESET = f"{P}/breaker-reset"


class Replica:
    def __init__(self, api: FakeControllerApi, clock: FakeClock, identity: str) -> None:
        self.changes: list[bool] = []
        self.el = LeaderElector(api, NS, NAME, identity, lease_duration_s=15, renew_deadline_s=10,
                                retry_period_s=2, clock=clock, wall=clock, on_change=self.changes.append)

    def step(self) -> bool:
        self.el.step()
        return self.el.is_leader()


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture()
def api() -> FakeControllerApi:
    return FakeControllerApi()


def lease(api: FakeControllerApi) -> dict[str, Any]:
    return api.leases[(NS, NAME)]


def spec(api: FakeControllerApi) -> dict[str, Any]:
    s: dict[str, Any] = lease(api)["spec"]
    return s


def test_the_first_replica_creates_the_lease_and_leads(api: FakeControllerApi, clock: FakeClock) -> None:
    a = Replica(api, clock, "a")
    assert not a.el.is_leader()
    assert a.step()
    assert api.calls == ["get lease gpu-health-controller", "create lease gpu-health-controller"]
    s = spec(api)
    assert s["holderIdentity"] == "a" and s["leaseDurationSeconds"] == 15 and s["leaseTransitions"] == 0
    assert s["acquireTime"] == s["renewTime"] == "2026-01-01T00:00:00.000000Z"
    assert a.changes == [True] and a.el.holder == "a"


def test_two_replicas_creating_at_once_one_wins(api: FakeControllerApi, clock: FakeClock) -> None:
    a, b = Replica(api, clock, "a"), Replica(api, clock, "b")
    api.fail("get lease", 404, "not found")  # both read before either created it
    api.fail("get lease", 404, "not found")
    assert a.step()
    assert not b.step()  # its create was refused: 409
    assert b.el.failures == 1 and b.changes == []
    clock.advance(2)
    assert not b.step() and b.el.holder == "a"


def test_no_takeover_while_the_holder_renews(api: FakeControllerApi, clock: FakeClock) -> None:
    a, b = Replica(api, clock, "a"), Replica(api, clock, "b")
    a.step()
    for _ in range(60):  # two minutes
        clock.advance(2)
        assert a.step()
        assert not b.step()
    assert spec(api)["holderIdentity"] == "a" and spec(api)["leaseTransitions"] == 0
    assert b.changes == [] and b.el.holder == "a"


def test_takeover_after_lease_duration_of_an_unchanged_record(api: FakeControllerApi, clock: FakeClock) -> None:
    a, b = Replica(api, clock, "a"), Replica(api, clock, "b")
    a.step()
    clock.advance(1)
    b.step()  # b first sees a's record now, at T0+1: its own clock starts here, whatever renewTime says
    seen = clock.now
    # a's process is gone: nobody renews.
    while clock.now < seen + 14:
        clock.advance(2)
        assert not b.step()
    clock.now = seen + 15
    assert b.step()
    s = spec(api)
    assert s["holderIdentity"] == "b" and s["leaseTransitions"] == 1
    assert s["acquireTime"] == s["renewTime"]
    assert b.changes == [True]


def test_the_old_leader_gives_up_before_anyone_may_take_over(api: FakeControllerApi, clock: FakeClock) -> None:
    a, b = Replica(api, clock, "a"), Replica(api, clock, "b")
    a.step()
    b.step()
    api.fail("update lease", None, "timed out", times=100)  # a cannot renew (b only reads)
    for _ in range(4):
        clock.advance(2)
        assert a.step()  # 8 s without a renewal: still within renewDeadline
    clock.advance(1.9)
    assert a.step()
    clock.advance(0.1)  # 10 s
    assert not a.step()
    assert a.changes == [True, False] and a.el.failures == 6
    assert not b.step()  # and b waits 5 s more before the Lease is free
    clock.advance(4.9)
    assert not b.step()
    api.failures.clear()
    clock.advance(0.1)
    assert b.step() and not a.el.is_leader()


def test_a_renewal_is_exactly_one_request(api: FakeControllerApi, clock: FakeClock) -> None:
    a = Replica(api, clock, "a")
    a.step()
    api.calls.clear()
    for i in range(1, 31):
        clock.advance(2)
        a.step()
        assert api.calls == ["update lease gpu-health-controller"] * i
    assert a.el.requests == 32  # the get and the create, then the renewals
    assert spec(api)["renewTime"] == "2026-01-01T00:01:00.000000Z"
    assert spec(api)["acquireTime"] == "2026-01-01T00:00:00.000000Z"  # kept, not moved by renewals


def test_annotations_ride_on_the_next_renewal(api: FakeControllerApi, clock: FakeClock) -> None:
    a = Replica(api, clock, "a")
    a.step()
    api.calls.clear()
    a.el.set_annotation(BREAKER, '{"state":"open"}')
    assert api.calls == []  # no request of its own
    assert a.el.annotations()[BREAKER] == '{"state":"open"}'  # but visible at once
    clock.advance(2)
    a.step()
    assert api.calls == ["update lease gpu-health-controller"]
    assert lease(api)["metadata"]["annotations"] == {BREAKER: '{"state":"open"}'}
    a.el.set_annotation(BREAKER, '{"state":"closed"}')
    clock.advance(2)
    a.step()
    assert lease(api)["metadata"]["annotations"] == {BREAKER: '{"state":"closed"}'}
    assert a.el.annotations() == {BREAKER: '{"state":"closed"}'}
    assert a.el.seen_annotations() == {BREAKER: '{"state":"closed"}'}


def test_an_operator_annotation_is_read_after_one_conflict_and_kept(api: FakeControllerApi,
                                                                   clock: FakeClock) -> None:
    a = Replica(api, clock, "a")
    a.el.set_annotation(BREAKER, "v1")
    a.step()
    api.annotate_lease(NS, NAME, RESET, "1767225605")  # kubectl annotate --overwrite: the version moves
    clock.advance(2)
    a.step()  # the renewal carried the old version: 409
    assert a.el.failures == 1 and a.el.is_leader()
    clock.advance(2)
    a.step()  # reads it again and renews on top of it
    assert a.el.is_leader() and a.changes == [True]
    assert a.el.annotations() == {BREAKER: "v1", RESET: "1767225605"}
    assert lease(api)["metadata"]["annotations"] == {BREAKER: "v1", RESET: "1767225605"}
    assert spec(api)["leaseTransitions"] == 0


def test_release_on_stop_lets_a_standby_take_over_at_once(api: FakeControllerApi, clock: FakeClock) -> None:
    a, b = Replica(api, clock, "a"), Replica(api, clock, "b")
    a.step()
    b.step()
    a.el.set_annotation(BREAKER, "last")
    clock.advance(1)
    a.el.stop(release=True)
    assert not a.el.is_leader()
    s = spec(api)
    assert s["holderIdentity"] == "" and s["leaseDurationSeconds"] == 1
    assert lease(api)["metadata"]["annotations"] == {BREAKER: "last"}  # flushed
    clock.advance(1)
    assert b.step()  # no wait for the duration: nobody holds it
    assert b.el.seen_annotations() == {BREAKER: "last"}


def test_stop_without_release_leaves_the_lease_to_expire(api: FakeControllerApi, clock: FakeClock) -> None:
    a, b = Replica(api, clock, "a"), Replica(api, clock, "b")
    a.step()
    b.step()
    api.calls.clear()
    a.el.stop(release=False)
    assert api.calls == [] and spec(api)["holderIdentity"] == "a"
    clock.advance(2)
    assert not b.step()


def test_a_standby_does_not_release(api: FakeControllerApi, clock: FakeClock) -> None:
    a, b = Replica(api, clock, "a"), Replica(api, clock, "b")
    a.step()
    b.step()
    api.calls.clear()
    b.el.stop(release=True)
    assert api.calls == [] and spec(api)["holderIdentity"] == "a"


def test_a_restarted_leader_of_the_same_name_renews_its_own_lease(api: FakeControllerApi,
                                                                 clock: FakeClock) -> None:
    Replica(api, clock, "a").step()
    clock.advance(3)
    again = Replica(api, clock, "a")
    assert again.step()
    assert spec(api)["leaseTransitions"] == 0 and spec(api)["acquireTime"] == "2026-01-01T00:00:00.000000Z"


def test_a_deposed_leader_does_not_write_its_stale_annotations_later(api: FakeControllerApi,
                                                                    clock: FakeClock) -> None:
    a, b = Replica(api, clock, "a"), Replica(api, clock, "b")
    a.el.set_annotation(BREAKER, "a-1")
    a.step()
    b.step()
    # a is cut off from the API server; a breaker change waits for a renewal that does not come.
    api.down = True
    a.el.set_annotation(BREAKER, "a-2")
    for _ in range(8):
        clock.advance(2)
        a.el.step()
        api.down = False
        b.step()
        api.down = True
    assert b.el.is_leader() and not a.el.is_leader()
    api.down = False
    b.el.set_annotation(BREAKER, "b-1")
    clock.advance(2)
    b.step()
    a.el.step()  # back: its renewal is refused (409), and it reads b's Lease
    clock.advance(2)
    a.el.step()
    assert a.el.holder == "b"
    b.el.stop(release=True)
    clock.advance(2)
    assert a.step()
    assert lease(api)["metadata"]["annotations"] == {BREAKER: "b-1"}
    assert a.el.seen_annotations() == {BREAKER: "b-1"}


def test_never_two_leaders_at_once(api: FakeControllerApi, clock: FakeClock) -> None:
    """Three replicas whose steps are delayed, dropped and cut off at random; at no moment do two lead."""
    rng = random.Random(15)
    replicas = [Replica(api, clock, n) for n in "abc"]
    cut: set[str] = set()
    leaders_seen: set[str] = set()
    for _ in range(3000):
        clock.advance(rng.choice((0.5, 1.0, 2.0)))
        for r in replicas:
            if rng.random() < 0.02:
                cut ^= {r.el.identity}  # a partition starts or heals
            if rng.random() < 0.3:
                continue  # this one's thread did not run this time
            api.down = r.el.identity in cut
            r.el.step()
            api.down = False
        leading = [r.el.identity for r in replicas if r.el.is_leader()]
        assert len(leading) <= 1, (clock.now, leading)
        leaders_seen.update(leading)
    assert len(leaders_seen) >= 2  # the test did make it change hands


class SlowAnswers(FakeControllerApi):
    """Lease writes that the server applies at once but whose answers reach the replica ``answer_s`` later (on
    the test's clock): a congested connection, a slow proxy."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock_ = clock
        self.answer_s = 0.0

    def update_lease(self, namespace: str, name: str, body: Any) -> dict[str, Any]:
        out = super().update_lease(namespace, name, body)
        self.clock_.advance(self.answer_s)
        return out

    def create_lease(self, namespace: str, body: Any) -> dict[str, Any]:
        out = super().create_lease(namespace, body)
        self.clock_.advance(self.answer_s)
        return out


def test_the_renew_deadline_counts_from_when_the_renewal_was_sent(clock: FakeClock) -> None:
    """A renewal whose answer comes late must not lead longer: another replica's clock started when the server
    applied it, which is before the answer arrived."""
    api = SlowAnswers(clock)
    a, b = Replica(api, clock, "a"), Replica(api, clock, "b")
    api.answer_s = 6
    assert a.step()  # created at T0, answered at T0+6: leads until T0+10, not T0+16
    clock.now = T0 + 9.9
    assert a.el.is_leader()
    clock.now = T0 + 10
    assert not a.el.is_leader()
    assert not b.step()
    sent = clock.now
    api.answer_s = 7
    assert a.step()  # a renewal sent now and answered 7 s later
    assert clock.now == sent + 7
    clock.now = sent + 9.9
    assert a.el.is_leader()
    clock.now = sent + 10
    assert not a.el.is_leader()


def test_a_takeover_answered_late_leads_from_when_it_was_sent(clock: FakeClock) -> None:
    api = SlowAnswers(clock)
    a, b = Replica(api, clock, "a"), Replica(api, clock, "b")
    a.step()
    b.step()
    clock.advance(15)
    api.answer_s = 4
    sent = clock.now
    assert b.step()  # a never renewed: b takes over, and hears so 4 s later
    assert spec(api)["holderIdentity"] == "b"
    clock.now = sent + 10
    assert not b.el.is_leader()
