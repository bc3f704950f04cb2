"""A storm's quarantines written by writer threads (``Reconciler(writers=...)``), each with its own client, against
the in-memory API server (tests/fakes/controller_api.py), which can hold Node patches in flight until released.

What must hold: several writes really are in flight at once, never more than there are writers; the breaker's limit
is never passed, not even for an instant, however many candidates arrive at once; failures give their reserved
slots back and are retried as on the inline path; a lost Lease stops every write not yet started; and the
outcome (the Nodes, the Events, the breaker) is the inline path's.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

from plugin.controller.breaker import CLOSED, OPEN, BreakerState
from plugin.controller.nodes import CONTROLLER, Keys
from plugin.controller.policy import Rules
from plugin.controller.reconciler import Reconciler, Settings
from plugin.kube.errors import ApiFailure
from tests.conftest import FakeClock
from tests.fakes.controller_api import T0, FakeControllerApi, FakeLeadership, P, gpu_node

KEYS = Keys(P)
OWN = f"controller.{P}"


class Storm:
    """A fleet of ``bad + good`` GPU nodes, the first ``bad`` failing at once, and a reconciler with ``writers``
    writer clients (0: today's inline path) and a limit of ``cap`` quarantines."""

    def __init__(self, writers: int, *, bad: int, good: int, cap: int,
                 lead: FakeLeadership | None = None) -> None:
        self.clock = FakeClock(T0)
        self.api = FakeControllerApi()
        self.api.clock = self.clock
        for i in range(bad + good):
            self.api.add_node(gpu_node(f"n{i:03}", {0: "Unhealthy"} if i < bad else None))
        self.lead = lead or FakeLeadership()
        settings = Settings(keys=KEYS, rules=Rules(), max_quarantined_fraction=1.0, max_quarantined_nodes=cap)
        self.rec = Reconciler(self.api, settings, self.lead, clock=self.clock, writers=[self.api] * writers)
        self.rec.replace(self.api.list_nodes("")[0])
        self.api.calls.clear()
        self.rec.leadership_changed(True)

    def step_in_background(self) -> threading.Thread:
        t = threading.Thread(target=self.rec.step, args=(self.clock.now,), daemon=True)
        t.start()
        return t

    def run_until(self, end: float) -> None:
        for _ in range(1_000):
            due = self.rec.step(self.clock.now)
            if due > self.clock.now:
                if self.clock.now >= end:
                    return
                self.clock.now = min(due, end)
        raise AssertionError("the reconciler never went idle")

    def ours(self) -> list[str]:
        """The API server's truth: the Nodes carrying our record."""
        return sorted(n for n, d in self.api.snapshot().items()
                      if (d["metadata"].get("annotations") or {}).get(f"{OWN}/quarantined-by") == CONTROLLER)

    def patches(self, name: str = "") -> list[str]:
        return [c for c in self.api.calls if c.startswith(f"patch node {name}")]

    def events(self, reason: str) -> list[str]:
        return sorted(e["involvedObject"]["name"] for e in self.api.events if e["reason"] == reason)

    def breaker(self) -> BreakerState:
        return BreakerState.from_json(self.lead.lease_annotations[f"{P}/breaker"])


def finish(t: threading.Thread) -> None:
    t.join(10.0)
    assert not t.is_alive(), "the step never returned"


def test_a_storm_goes_out_four_writes_at_once_and_never_past_the_limit() -> None:
    limit = 6
    storm = Storm(4, bad=3 * limit, good=42, cap=limit)
    seen: list[tuple[int, int]] = []  # (the reconciler's quarantined count, the server's) at every request

    def observe(_call: str) -> None:
        seen.append((storm.rec.counts()["quarantined"], len(storm.ours())))

    storm.api.on_call = observe
    storm.api.hold_patches.clear()
    t = storm.step_in_background()
    assert storm.api.wait_patches_in_flight(4), "four writers, but fewer than four PATCHes were ever in flight"
    storm.api.hold_patches.set()
    finish(t)

    assert storm.api.most_patches_in_flight == 4  # never more than there are writers
    assert len(storm.patches()) == limit  # 18 candidates, and not one PATCH beyond the limit
    assert storm.ours() == [f"n{i:03}" for i in range(limit)]  # the first six in the order they were seen
    assert seen and max(max(s) for s in seen) <= limit
    assert storm.rec.counts()["quarantined"] == limit
    st = storm.breaker()
    assert (st.state, st.quarantined, st.blocked) == (OPEN, limit, 2 * limit)
    assert storm.events("GPUNodeQuarantined") == storm.ours()
    assert len(storm.events("GPUQuarantineBlocked")) == 2 * limit + 1  # each node held back, and the Lease once


def outcome(storm: Storm) -> dict[str, Any]:
    nodes = storm.api.snapshot()
    for doc in nodes.values():
        del doc["metadata"]["resourceVersion"]  # the order of the writes differs, so do their versions
    return {"nodes": nodes, "events": sorted((e["reason"], e["involvedObject"]["name"], e["message"])
                                             for e in storm.api.events),
            "breaker": storm.lead.lease_annotations, "counts": storm.rec.counts(),
            "actions": storm.rec.stats.actions, "events_posted": storm.rec.stats.events_posted}


def test_writers_decide_what_the_inline_path_decides() -> None:
    inline, fanned = Storm(0, bad=18, good=42, cap=6), Storm(4, bad=18, good=42, cap=6)
    for storm in (inline, fanned):
        storm.run_until(T0 + 30)
    assert outcome(fanned) == outcome(inline)


@pytest.mark.parametrize("writers", [0, 4])
def test_failures_mid_batch_give_their_slots_back_and_are_retried_as_inline(writers: int) -> None:
    """n001 answers 409 (the Node moved), n002 500, n003 403 for good, while the rest land."""
    storm = Storm(writers, bad=8, good=52, cap=8)
    moved = threading.Event()

    def racer(call: str) -> None:
        if call == "patch node n001" and not moved.is_set():
            moved.set()
            storm.api.heartbeat("n001", storm.clock.now)

    storm.api.on_call = racer
    storm.api.fail("patch node n002", 500)
    storm.api.refuse_patches["n003"] = ApiFailure(403, 'admission webhook "deny.example.com" denied it')

    storm.rec.step(storm.clock.now)
    assert storm.ours() == ["n000", "n004", "n005", "n006", "n007"]
    assert storm.rec.counts()["quarantined"] == 5  # the three failures' slots are back, none counted twice
    assert storm.breaker().state == CLOSED and storm.breaker().quarantined == 5
    assert storm.rec.stats.conflicts == 1 and storm.rec.stats.refused_writes == {"quarantine": 1}

    storm.run_until(T0 + 30)  # the 409 at once, the 500 after its back-off
    assert storm.ours() == ["n000", "n001", "n002", "n004", "n005", "n006", "n007"]
    assert storm.rec.counts()["quarantined"] == 7 and storm.rec.counts()["candidates"] == 1
    assert Counter(storm.patches()) == {"patch node n001": 2, "patch node n002": 2, "patch node n003": 1,
                                        **{f"patch node n00{i}": 1 for i in (0, 4, 5, 6, 7)}}
    assert storm.events("GPUNodeWriteRefused") == ["n003"]  # refused once, one Event, not retried
    assert storm.breaker().state == CLOSED and storm.breaker().quarantined == 7


def test_no_write_starts_once_the_lease_is_lost_with_writes_in_flight() -> None:
    storm = Storm(4, bad=12, good=48, cap=12)
    storm.api.leading = lambda: storm.lead.leader
    storm.api.hold_patches.clear()
    t = storm.step_in_background()
    assert storm.api.wait_patches_in_flight(4)
    storm.lead.leader = False  # the renewal deadline passed while four PATCHes were under way
    storm.api.hold_patches.set()
    finish(t)

    assert len(storm.patches()) == 4 and storm.api.unled_writes == []  # no PATCH, no Event after it
    assert storm.rec.counts()["quarantined"] == len(storm.ours()) == 4  # the four that landed are counted
    storm.rec.leadership_changed(False)
    storm.lead.leader = True  # leads again (every Node looked at once): the rest go, none twice
    storm.rec.leadership_changed(True)
    storm.run_until(T0 + 5)
    assert Counter(storm.patches()) == {f"patch node n{i:03}": 1 for i in range(12)}


@pytest.mark.parametrize("writers", [0, 4])
def test_a_stop_mid_storm_starts_no_write_and_returns_once_those_in_flight_are_done(writers: int) -> None:
    """Issue 35, 5: SIGTERM while 1,000 candidates wait and the server holds every PATCH. The stop waits for the
    writes in flight, starts none (no further PATCH, no Event), and says the Lease may go. Before the fix the worker
    went on for up to 10 s, then the pool was shut under it and stop() returned with writes in flight."""
    storm = Storm(writers, bad=1000, good=0, cap=0)
    storm.api.hold_patches.clear()
    storm.rec.start()
    in_flight = max(1, writers)
    assert storm.api.wait_patches_in_flight(in_flight)
    result: list[bool] = []
    stopper = threading.Thread(target=lambda: result.append(storm.rec.stop(timeout_s=30.0)))
    stopper.start()
    assert storm.rec._stop.wait(10.0)  # the stop flag is up
    storm.api.hold_patches.set()  # the slow answers come back
    stopper.join(30.0)
    assert result == [True] and not storm.rec.alive()
    assert len(storm.patches()) == in_flight  # those in flight landed; not one started after the stop
    assert len(storm.ours()) == in_flight
    assert storm.events("GPUNodeQuarantined") == []  # an Event is a write too: the Node's record has it


def test_a_stop_that_gives_up_on_a_hung_write_says_the_lease_must_not_go_and_starts_nothing_after() -> None:
    storm = Storm(4, bad=1000, good=0, cap=0)
    storm.api.hold_patches.clear()
    storm.rec.start()
    assert storm.api.wait_patches_in_flight(4)
    assert storm.rec.stop(timeout_s=0.2) is False  # the writes are still held: the Lease must lapse by itself
    storm.api.hold_patches.set()
    assert storm.rec._thread is not None
    storm.rec._thread.join(30.0)
    assert not storm.rec.alive()
    assert len(storm.patches()) == 4 and len(storm.rec._free) == 4  # every writer client back, none lost


class Countdown(FakeLeadership):
    """Leads for the first ``questions`` answers of is_leader(), whichever thread asks, then never again."""

    def __init__(self, questions: int) -> None:
        super().__init__()
        self.left = questions
        self._lock = threading.Lock()

    def is_leader(self) -> bool:
        with self._lock:
            if self.left <= 0:
                self.leader = False
            self.left -= 1
            return self.leader


@pytest.mark.parametrize("questions", range(0, 40, 3))
def test_a_writer_that_finds_the_lease_lost_stops_the_step(questions: int) -> None:
    lead = Countdown(questions)
    storm = Storm(4, bad=12, good=48, cap=12, lead=lead)
    storm.api.leading = lambda: lead.leader
    lead.left = questions  # counted from the step on
    storm.rec.step(storm.clock.now)
    assert storm.api.unled_writes == []
    assert storm.rec.counts()["quarantined"] == len(storm.ours()) <= 12
    assert len(storm.patches()) == len(storm.ours())  # every PATCH that started landed; none after the loss


@pytest.mark.parametrize("writers", [0, 8])
def test_a_candidate_at_the_limit_waits_for_the_writes_in_flight_before_it_is_refused(writers: int) -> None:
    """Four slots, five candidates, and the first write fails (503): inline, the fifth takes the slot it gave back;
    with writers, the fifth is not refused on the count of writes that may yet fail."""
    storm = Storm(writers, bad=5, good=35, cap=4)
    storm.api.refuse_patches["n000"] = ApiFailure(503, "etcdserver: leader changed")
    storm.api.hold_patches.clear()
    t = storm.step_in_background()
    assert storm.api.wait_patches_in_flight(1 if writers == 0 else 4)
    storm.api.hold_patches.set()
    finish(t)
    assert storm.ours() == ["n001", "n002", "n003", "n004"]
    assert storm.breaker().state == CLOSED and storm.events("GPUQuarantineBlocked") == []
    assert storm.rec.counts()["quarantined"] == 4


def test_a_writer_says_how_long_the_controller_held_the_quarantine_after_its_watch_event(
        caplog: pytest.LogCaptureFixture) -> None:
    storm = Storm(4, bad=0, good=3, cap=3)
    caplog.set_level("INFO", logger="plugin.controller.reconciler")
    storm.api.edit("n001", {"metadata": {"annotations": gpu_node("n001", {0: "Unhealthy"})["metadata"]["annotations"]}})
    storm.rec.upsert(storm.api.node("n001"))
    storm.clock.now += 0.002
    storm.rec.step(storm.clock.now)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("quarantined n001:")]
    assert line.endswith("(PATCH sent 2.0 ms after its watch event)")
    assert storm.ours() == ["n001"] and storm.rec._seen == {}
