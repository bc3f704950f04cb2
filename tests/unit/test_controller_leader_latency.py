"""Two replicas of the leader elector on the real clock, against one Lease store behind a slow network: requests
reach the store late, answers come back late, a renewal can hang. Each replica has an actor that writes only
after ``is_leader()`` said yes, as the reconciler does before each Node write.

The property, for every write: when the actor decided to write (its time is taken *before* it asks
``is_leader()``), the last holder the store had committed was the writer itself. So no replica acts once another
has taken the Lease over, and between two replicas no write of one starts inside the other's term. It holds by
construction when the renew deadline counts from when the renewal was sent: a standby takes over only after it has
seen the record unchanged for ``lease_duration`` by its own clock, counted from an answer that came after the
commit, so after the old leader's deadline (``renew_deadline`` < ``lease_duration``) has passed. A write decided
before a takeover may still be in flight when it lands: that is what the check before each write cannot prevent,
and what the resourceVersion precondition of every Node patch is for.

Timings are short (lease 2 s, renew deadline 1.5 s, retry 0.2 s); the tests wait on events with generous bounds and
assert nothing about how long anything took.
"""

from __future__ import annotations

import bisect
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plugin.controller.leader import LeaderElector
from plugin.kube.errors import ApiFailure
from tests.fakes.controller_api import FakeControllerApi

NS = "gpu-health-system"
NAME = "gpu-health-controller"
LEASE_S, DEADLINE_S, RETRY_S = 2.0, 1.5, 0.2
BOUND_S = 18.0  # a guard against a hang, not a timing assertion


@dataclass(frozen=True)
class Delay:
    before: float = 0.0  # from sending to the store applying it
    after: float = 0.0  # from the store's answer to the replica reading it
    stall: bool = False  # never applied; fails once another replica holds the Lease


Plan = Callable[[str, str], Delay]  # (identity, verb) -> how that request travels


class LeaseStore:
    """The API server: the fake's Lease rules (404, 409 on a stale resourceVersion), plus a record of who held the
    Lease from when, stamped with ``time.monotonic()`` just before each commit that changed the holder."""

    def __init__(self, plan: Plan) -> None:
        self.api = FakeControllerApi()
        self.plan = plan
        self.cond = threading.Condition()
        self.holders: list[tuple[float, str]] = []
        self.answered: list[tuple[str, str]] = []  # (identity, verb) of every request the store applied
        self.closing = False
        self.closed = threading.Event()

    def holder(self) -> str:
        lease = self.api.leases.get((NS, NAME))
        return str(lease["spec"].get("holderIdentity") or "") if lease else ""

    def holder_at(self, t: float) -> str:
        i = bisect.bisect_right([at for at, _ in self.holders], t)
        return self.holders[i - 1][1] if i else ""

    def handovers(self) -> list[str]:
        with self.cond:
            return [h for _, h in self.holders]

    def call(self, identity: str, verb: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        d = self.plan(identity, verb)
        if d.stall:
            with self.cond:
                self.cond.wait_for(lambda: self.closing or self.holder() not in ("", identity), BOUND_S)
            raise ApiFailure(None, "TimeoutError: timed out")
        self.closed.wait(d.before)  # the request on its way (cut short when the test ends)
        failure: ApiFailure | None = None
        out: dict[str, Any] = {}
        with self.cond:
            stamp = time.monotonic()
            try:
                out = fn()
            except ApiFailure as exc:
                failure = exc
            self.answered.append((identity, verb))
            holder = self.holder()
            if holder and (not self.holders or self.holders[-1][1] != holder):
                self.holders.append((stamp, holder))
            self.cond.notify_all()
        self.closed.wait(d.after)  # the answer on its way
        if failure is not None:
            raise failure
        return out

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.closed.set()
            self.cond.notify_all()


class Link:
    """One replica's view of the store: the three Lease calls the elector makes, each through the plan."""

    def __init__(self, store: LeaseStore, identity: str) -> None:
        self.store = store
        self.identity = identity

    def get_lease(self, namespace: str, name: str) -> dict[str, Any]:
        return self.store.call(self.identity, "get", lambda: self.store.api.get_lease(namespace, name))

    def create_lease(self, namespace: str, body: Any) -> dict[str, Any]:
        return self.store.call(self.identity, "create", lambda: self.store.api.create_lease(namespace, body))

    def update_lease(self, namespace: str, name: str, body: Any) -> dict[str, Any]:
        return self.store.call(self.identity, "update", lambda: self.store.api.update_lease(namespace, name, body))


@dataclass(frozen=True)
class Write:
    replica: str
    decided: float  # taken before is_leader() was asked
    done: float


class Replica:
    def __init__(self, store: LeaseStore, identity: str, write_s: Callable[[], float]) -> None:
        self.identity = identity
        self.leading = threading.Event()
        self.el = LeaderElector(Link(store, identity), NS, NAME, identity, lease_duration_s=LEASE_S,
                                renew_deadline_s=DEADLINE_S, retry_period_s=RETRY_S, on_change=self._changed)
        self.writes: list[Write] = []
        self._write_s = write_s
        self._stop = threading.Event()
        self._actor = threading.Thread(target=self._act, name=f"actor-{identity}", daemon=True)

    def _changed(self, leading: bool) -> None:
        (self.leading.set if leading else self.leading.clear)()

    def start(self) -> None:
        self.el.start()
        self._actor.start()

    def _act(self) -> None:
        while not self._stop.is_set():
            decided = time.monotonic()
            if self.el.is_leader():
                time.sleep(self._write_s())  # the write's own round trip
                self.writes.append(Write(self.identity, decided, time.monotonic()))
            else:
                self._stop.wait(0.01)  # the next look, as a worker loop would take it

    def stop(self) -> None:
        self._stop.set()
        self._actor.join(5.0)
        self.el.stop(release=False)


def acted_without_the_lease(store: LeaseStore, replicas: list[Replica]) -> list[tuple[Write, str]]:
    """Every write decided while the store's last committed holder was someone else (or nobody)."""
    return [(w, store.holder_at(w.decided)) for r in replicas for w in r.writes
            if store.holder_at(w.decided) != w.replica]


def stop_all(store: LeaseStore, replicas: list[Replica]) -> None:
    store.close()  # a hanging renewal fails now, so the elector's thread can end
    for r in replicas:
        r.stop()


def test_a_late_answer_and_a_hung_renewal_do_not_make_two_leaders() -> None:
    """a renews; the store applies it at once but the answer takes 1.4 s, and a's next renewal hangs. b, whose
    reads are fast, sees that record unchanged for 2 s and takes over. Counting a's deadline from the answer would
    let a act until 2.9 s after that renewal was sent, past b's takeover; counted from the send, a stops at 1.5 s."""
    state = {"slow": False, "hung": False}
    lock = threading.Lock()

    def plan(identity: str, verb: str) -> Delay:
        if identity != "a" or verb != "update":
            return Delay(after=0.02)
        with lock:
            if state["hung"]:
                return Delay(stall=True)
            if state["slow"]:
                state["hung"] = True
                return Delay(after=1.4)
        return Delay()

    store = LeaseStore(plan)
    a = Replica(store, "a", lambda: 0.02)
    b = Replica(store, "b", lambda: 0.02)
    try:
        a.start()
        assert a.leading.wait(BOUND_S)
        b.start()
        with store.cond:  # b has read a's Lease at least once
            assert store.cond.wait_for(lambda: ("b", "get") in store.answered and len(a.writes) > 0, BOUND_S)
        with lock:
            state["slow"] = True
        assert b.leading.wait(BOUND_S), "b never took over"
        with store.cond:
            assert store.cond.wait_for(lambda: len(b.writes) > 0, BOUND_S)
    finally:
        stop_all(store, [a, b])
    assert store.handovers() == ["a", "b"]
    assert acted_without_the_lease(store, [a, b]) == []
    assert a.writes and b.writes


def test_two_replicas_on_a_slow_network_never_both_act() -> None:
    """Every request's answer is late by 0.3 to 1.5 s (in all, with the way there); once a leader's actor has
    written three times in its term, its next renewal hangs until the other replica has taken the Lease: a -> b -> a
    at least (the slow answers can add hand-overs of their own)."""
    rng = random.Random(24)
    lock = threading.Lock()
    replicas: dict[str, Replica] = {}

    def plan(identity: str, verb: str) -> Delay:
        if verb == "update" and store.holder() == identity:
            with store.cond:
                since = max(t for t, h in store.holders if h == identity)
            if sum(1 for w in replicas[identity].writes if w.decided >= since) >= 3:
                return Delay(stall=True)
        with lock:
            total = rng.uniform(0.3, 1.5)
            before = rng.uniform(0.0, min(0.3, total))
        return Delay(before=before, after=total - before)

    store = LeaseStore(plan)

    def write_s() -> float:
        with lock:
            return rng.uniform(0.01, 0.05)

    a, b = Replica(store, "a", write_s), Replica(store, "b", write_s)
    replicas.update(a=a, b=b)
    try:
        a.start()
        assert a.leading.wait(BOUND_S)
        b.start()
        with store.cond:
            assert store.cond.wait_for(lambda: len(store.holders) >= 3, BOUND_S), store.holders
    finally:
        stop_all(store, [a, b])
    assert acted_without_the_lease(store, [a, b]) == []
    assert a.writes and b.writes  # both acted, each in its own terms
