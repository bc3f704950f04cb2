"""The Node LIST page by page, from the API client (plugin/kube/client.py) through the watcher into the real
reconciler's cache: each page is in the cache before the next one is asked for, and no part of its parsed JSON is
still held by then, so the controller's memory holds one page of Node JSON at most, not the whole fleet's.

The edge is the HTTP transport: a stand-in for ``plugin.kube.transport.Transport`` that serves ``GET /api/v1/nodes``
in pages, as the API server does with ``limit`` and ``continue``, and hands out objects whose release a weak
reference can see."""

from __future__ import annotations

import copy
import random
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from plugin.controller.nodes import Keys
from plugin.controller.policy import Rules
from plugin.controller.reconciler import Reconciler, Settings
from plugin.controller.watcher import NodeWatcher
from plugin.kube.client import KubeClient
from plugin.kube.errors import ApiFailure
from tests.conftest import FakeClock
from tests.fakes.controller_api import T0, FakeControllerApi, FakeLeadership, P, gpu_node


class Doc(dict[str, Any]):
    """A JSON object as the client parsed it; unlike a plain dict it can be weakly referenced."""


def parsed(value: Any) -> Any:
    if isinstance(value, dict):
        return Doc({k: parsed(v) for k, v in value.items()})
    if isinstance(value, list):
        return [parsed(v) for v in value]
    return value


class PagedClient:
    def __init__(self, nodes: list[dict[str, Any]], rec: Reconciler) -> None:
        self.nodes = nodes
        self.rec = rec
        self.rv = "500"
        self.pages: list[Mapping[str, str]] = []
        self.fail_page: int | None = None  # the page (1-based, over all LISTs) answered with an error
        # What the reconciler held, and how much of the earlier pages' JSON was still alive, when each page was
        # asked for.
        self.at_request: list[tuple[set[str], bool, int]] = []
        self._refs: list[weakref.ref[Doc]] = []

    def request(self, method: str, path: str, body: Any = None, content_type: str | None = None,
                query: Mapping[str, str] | None = None) -> dict[str, Any]:
        assert (method, path) == ("GET", "/api/v1/nodes")
        q = dict(query or {})
        self.pages.append(q)
        alive = sum(1 for r in self._refs if r() is not None)
        self.at_request.append((set(self.rec.entries), self.rec.synced, alive))
        if self.fail_page == len(self.pages):
            raise ApiFailure(500, "internal error")
        start = int(q.get("continue") or 0)
        end = start + int(q["limit"])
        more = end < len(self.nodes)
        page = parsed({"kind": "NodeList", "metadata": {"resourceVersion": self.rv,
                                                        "continue": str(end) if more else ""},
                       "items": copy.deepcopy(self.nodes[start:end])})
        self._refs.append(weakref.ref(page))
        self._refs.extend(weakref.ref(item) for item in page["items"])
        return page

    def watch(self, path: str, query: Mapping[str, str], read_timeout_s: float) -> Iterator[dict[str, Any]]:
        return iter(())  # the server ends the watch at once

    def close(self) -> None:
        pass


class Rig:
    def __init__(self, nodes: int, page_size: int) -> None:
        self.clock = FakeClock(T0)
        self.rec = Reconciler(FakeControllerApi(), Settings(keys=Keys(P), rules=Rules()),
                              FakeLeadership(leader=False), clock=self.clock)
        self.client = PagedClient([gpu_node(f"n{i}") for i in range(nodes)], self.rec)
        api = KubeClient(transport=self.client, list_page_size=page_size)  # type: ignore[arg-type]
        self.w = NodeWatcher(api, "", self.rec, resync_s=3600.0, clock=self.clock, rng=random.Random(3))


def test_each_page_reaches_the_cache_before_the_next_is_requested_and_its_json_is_gone() -> None:
    rig = Rig(nodes=5, page_size=2)
    rig.w.round()
    assert [p.get("continue", "") for p in rig.client.pages] == ["", "2", "4"]
    assert all(p["limit"] == "2" for p in rig.client.pages)
    held = [(sorted(entries), synced, alive) for entries, synced, alive in rig.client.at_request]
    assert held == [([], False, 0), (["n0", "n1"], False, 0), (["n0", "n1", "n2", "n3"], False, 0)]
    assert sorted(rig.rec.entries) == [f"n{i}" for i in range(5)] and rig.rec.synced
    assert rig.w.resource_version == "500" and rig.w.lists == 1


def test_a_list_that_fails_on_a_later_page_forgets_nothing_and_the_next_one_does() -> None:
    rig = Rig(nodes=5, page_size=2)
    rig.w.round()
    del rig.client.nodes[1]  # n1 left the fleet; its DELETED event is lost
    rig.client.rv = "600"
    rig.client.fail_page = 5  # the second LIST's second page
    rig.w.resource_version = ""  # as after a 410
    with pytest.raises(ApiFailure):
        rig.w.round()
    assert sorted(rig.rec.entries) == [f"n{i}" for i in range(5)]  # a partial LIST is no proof of absence
    assert rig.w.resource_version == "" and rig.w.lists == 1
    rig.w.round()
    assert sorted(rig.rec.entries) == ["n0", "n2", "n3", "n4"]
    assert rig.w.resource_version == "600" and rig.w.lists == 2


def test_the_first_list_marks_the_cache_synced_only_after_its_last_page() -> None:
    rig = Rig(nodes=3, page_size=1)
    rig.client.fail_page = 3
    with pytest.raises(ApiFailure):
        rig.w.round()
    assert not rig.rec.synced  # two nodes of three: the breaker's denominator would be wrong
    rig.w.round()
    assert rig.rec.synced and len(rig.rec.entries) == 3
