"""The Node feed: one LIST (in pages), then watches resumed from the last resourceVersion, bookmarks, 410 Gone and
the resync, into the real reconciler's cache (as a standby, so nothing is written), from an in-memory API server
whose watch streams the test scripts."""

from __future__ import annotations

import random
from typing import Any

import pytest

from plugin.controller.metrics import ControllerProbes
from plugin.controller.nodes import Keys
from plugin.controller.policy import Rules
from plugin.controller.reconciler import Reconciler, Settings
from plugin.controller.watcher import WATCH_MAX_S, WATCH_MIN_S, NodeWatcher
from plugin.kube.errors import ApiFailure
from tests.conftest import FakeClock
from tests.fakes.controller_api import T0, FakeControllerApi, FakeLeadership, P, gpu_node

SELECTOR = "nvidia.com/gpu.present=true"


class Feed:
    def __init__(self, nodes: int = 3, resync_s: float = 3600.0) -> None:
        self.clock = FakeClock(T0)
        self.api = FakeControllerApi()
        self.api.list_page_size = 2  # every LIST of more than two Nodes comes in pages
        for i in range(nodes):
            self.api.add_node(gpu_node(f"n{i}"))
        self.rec = Reconciler(self.api, Settings(keys=Keys(P), rules=Rules()), FakeLeadership(leader=False),
                              clock=self.clock)
        self.w = NodeWatcher(self.api, SELECTOR, self.rec, resync_s=resync_s, clock=self.clock,
                             rng=random.Random(7))
        self.ahead = 0

    def changed(self, name: str, labels: dict[str, str]) -> dict[str, Any]:
        """A watch event's Node: ``name`` with new labels at a version after the store's (which it leaves alone,
        so that a LIST does not know of the change)."""
        self.ahead += 1
        doc = self.api.node(name)
        doc["metadata"]["labels"] = labels
        doc["metadata"]["resourceVersion"] = str(self.api.rv + self.ahead)
        return doc

    def watched_from(self) -> list[str]:
        return [rv for _, rv, _ in self.api.watch_calls]


def event(kind: str, doc: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "object": doc}


def bookmark(rv: int) -> dict[str, Any]:
    return {"type": "BOOKMARK", "object": {"kind": "Node", "metadata": {"resourceVersion": str(rv)}}}


def gone() -> dict[str, Any]:
    return {"type": "ERROR", "object": {"kind": "Status", "status": "Failure", "reason": "Expired", "code": 410,
                                        "message": "too old resource version: 5 (900)"}}


def test_list_then_watch_from_the_lists_version() -> None:
    f = Feed()
    listed = str(f.api.rv)
    n1 = f.changed("n1", {"pool": "b"})
    f.api.streams = [[event("MODIFIED", n1)]]
    f.w.round()
    assert f.api.list_calls == [SELECTOR]
    [(selector, rv, timeout)] = f.api.watch_calls
    assert (selector, rv) == (SELECTOR, listed)
    assert WATCH_MIN_S <= timeout <= WATCH_MAX_S
    assert f.rec.synced and f.rec.counts()["nodes"] == 3
    assert f.rec.entries["n1"].facts.labels == ("pool", "b")
    assert f.w.resource_version == n1["metadata"]["resourceVersion"]
    assert (f.w.lists, f.w.watches, f.w.events) == (1, 1, 1)


def test_events_add_change_and_delete_nodes_in_the_cache() -> None:
    f = Feed(nodes=2)
    added = gpu_node("n9", {0: "Unhealthy"})
    f.ahead += 1
    added["metadata"]["resourceVersion"] = str(f.api.rv + f.ahead)
    n0 = f.changed("n0", {"x": "y"})
    n1 = f.changed("n1", {})
    f.api.streams = [[event("ADDED", added), event("MODIFIED", n0), event("DELETED", n1)]]
    f.w.round()
    assert sorted(f.rec.entries) == ["n0", "n9"]
    assert f.rec.counts()["candidates"] == 1
    assert f.rec.entries["n0"].facts.resource_version == n0["metadata"]["resourceVersion"]
    assert f.w.resource_version == n1["metadata"]["resourceVersion"]


def test_a_bookmark_moves_the_version_and_nothing_else() -> None:
    f = Feed()
    listed = str(f.api.rv)
    versions = {n: d["metadata"]["resourceVersion"] for n, d in f.api.nodes.items()}
    f.api.streams = [[bookmark(150), bookmark(180)], []]
    f.w.round()
    assert f.w.resource_version == "180"
    assert {n: e.facts.resource_version for n, e in f.rec.entries.items()} == versions
    f.w.round()  # the server ended the watch: the next one resumes from the bookmark, with no LIST
    assert f.watched_from() == [listed, "180"]
    assert f.w.lists == 1


def test_a_broken_stream_resumes_from_the_last_version_without_a_list() -> None:
    f = Feed()
    listed = str(f.api.rv)
    n0 = f.changed("n0", {"a": "1"})
    f.api.streams = [[event("MODIFIED", n0), ApiFailure(None, "watch stream broke: ConnectionResetError")]]
    with pytest.raises(ApiFailure, match="stream broke"):
        f.w.round()
    n1 = f.changed("n1", {"b": "2"})
    f.api.streams = [[event("MODIFIED", n1)]]
    f.w.round()
    assert f.w.lists == 1
    assert f.watched_from() == [listed, n0["metadata"]["resourceVersion"]]
    assert f.rec.entries["n0"].facts.labels == ("a", "1") and f.rec.entries["n1"].facts.labels == ("b", "2")


def test_an_error_event_becomes_the_api_failure_it_reports() -> None:
    f = Feed()
    f.api.streams = [[gone()]]
    with pytest.raises(ApiFailure) as info:
        f.w.round()
    assert info.value.status == 410 and "too old resource version" in info.value.message
    f.api.streams = [[{"type": "ERROR", "object": "garbage"}]]
    with pytest.raises(ApiFailure) as info:
        f.w.round()
    assert info.value.status is None and info.value.message == "garbage"


def test_resync_lists_again_after_its_interval() -> None:
    f = Feed(resync_s=600)
    f.api.streams = [[], []]
    f.w.round()
    f.clock.advance(599)
    f.w.round()
    assert f.w.lists == 1
    f.clock.advance(1)
    f.api.streams = [[]]
    f.w.round()
    assert f.w.lists == 2 and len(f.api.list_calls) == 2


def test_a_watch_open_past_the_resync_ends_at_the_next_event() -> None:
    f = Feed(resync_s=600)
    f.api.streams = [[bookmark(800), lambda: f.clock.advance(600), bookmark(900), bookmark(950)], []]
    f.w.round()
    assert f.w.resource_version == "900"  # 950 was never read: the round ended for the resync
    f.w.round()
    assert f.w.lists == 2


def test_a_relist_forgets_nodes_deleted_while_it_was_not_watching() -> None:
    f = Feed()
    f.api.streams = [[]]
    f.w.round()
    del f.api.nodes["n2"]  # the DELETED event was in the history the server no longer has
    f.api.rv += 1
    f.w.resource_version = ""  # what the loop does on 410
    f.api.streams = [[]]
    f.w.round()
    assert sorted(f.rec.entries) == ["n0", "n1"] and f.w.lists == 2


def test_the_loop_lists_again_at_once_on_410_and_resumes_after_other_failures() -> None:
    f = Feed()
    listed = str(f.api.rv)
    n0 = f.changed("n0", {"a": "1"})
    f.api.streams = [
        # A change whose event the server has compacted away, then 410: list again, at once.
        [event("MODIFIED", n0), lambda: f.api.edit("n2", {"metadata": {"labels": {"lost": "event"}}}), gone()],
        # Any other failure: back off, then watch from where it was, without a LIST.
        [ApiFailure(500, "internal error")],
    ]
    f.w.start()
    try:
        assert f.api.idle.wait(10.0), "the watcher never reached its third watch"
    finally:
        f.w.stop()
    assert not f.w.alive()
    relisted = str(f.api.rv)
    assert f.w.lists == 2 and f.watched_from() == [listed, relisted, relisted]
    assert f.rec.entries["n2"].facts.labels == ("lost", "event")
    assert f.w.failures == 2 and f.w.last_error == "HTTP 500: internal error"


def test_an_unexpected_error_counts_as_a_failure_and_makes_the_controller_unready_until_a_round_goes_through() -> \
        None:
    # Before: logged as "unexpected error" and nothing else: failures 0, last_error "", /readyz ok, while the
    # watch never resumed (issue 35, 1).
    f = Feed()
    probes = ControllerProbes(f.rec, f.w, clock=f.clock)
    f.api.streams = [[RuntimeError("a bug in the sink")], [RuntimeError("a bug in the sink")]]
    f.w.start()
    try:
        assert f.api.idle.wait(10.0), "the watcher never came back to watch after the unexpected errors"
        # The next watch is open and quiet (nothing changed): the errors stand until a round goes through.
        assert f.w.failures == 2 and "a bug in the sink" in f.w.last_error
        ready, why = probes.readiness()
        assert not ready and "a bug in the sink" in why, why
    finally:
        f.w.stop()


def test_a_watch_event_after_an_unexpected_error_makes_the_controller_ready_again() -> None:
    f = Feed()
    probes = ControllerProbes(f.rec, f.w, clock=f.clock)
    f.api.streams = [[RuntimeError("a bug in the sink")], [event("MODIFIED", f.changed("n0", {"a": "1"}))]]
    f.w.start()
    try:
        assert f.api.idle.wait(10.0), "the watcher never reached its third watch"
    finally:
        f.w.stop()
    assert f.w.failures == 1 and f.w.last_error == ""
    assert probes.readiness()[0], probes.readiness()
