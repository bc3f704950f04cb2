"""The Node cache's feed: one LIST, then a watch resumed from the last resourceVersion it saw (bookmarks keep that
fresh while nothing changes), a new LIST only when the server says the version is too old (410 Gone) or once per
``resync_s``. Failures back off with jitter, like every other API loop of the project.

A LIST goes to the sink page by page as the pages arrive (``begin_list``, ``list_page`` for each, ``end_list``), and
each page's Nodes are let go before the next page is requested: the sink keeps only what its decisions need, so
the feed's memory is one page of Node JSON (one Node on the watch), whatever the size of the fleet. A LIST that
fails part-way never reaches ``end_list``: what it did deliver is current, and nothing is forgotten on its word.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from plugin.backoff import Backoff
from plugin.controller.api import ControllerApi
from plugin.kube.errors import ApiFailure

log = logging.getLogger(__name__)

# The server ends each watch after a timeout we pick; client-go picks 5 to 10 minutes at random so that the
# controllers of a cluster do not re-watch in step.
WATCH_MIN_S = 300
WATCH_MAX_S = 600


class NodeSink(Protocol):
    def begin_list(self) -> None: ...
    def list_page(self, nodes: list[dict[str, Any]]) -> None: ...
    def end_list(self) -> None: ...
    def upsert(self, node: dict[str, Any]) -> None: ...
    def delete(self, node: dict[str, Any]) -> None: ...


class NodeWatcher:
    def __init__(self, api: ControllerApi, selector: str, sink: NodeSink, *, resync_s: float,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.api = api
        self.selector = selector
        self.sink = sink
        self.resync_s = resync_s
        self._clock = clock
        self._rng = rng or random.Random()
        self._backoff = Backoff(0.5, 30.0, rng=self._rng)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.resource_version = ""
        self.lists = 0
        self.watches = 0
        self.events = 0
        self.failures = 0
        self.last_error = ""
        self._listed_at = 0.0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="node-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.api.close()  # ends a watch blocked in a read
        if self._thread is not None:
            self._thread.join(5.0)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.round()
                self._backoff.reset()
            except ApiFailure as exc:
                if self._stop.is_set():
                    return
                self.failures += 1
                if exc.status == 410:
                    self.resource_version = ""  # too old: list again, at once
                    continue
                delay = self._backoff.next_delay(exc.retry_after)
                self.last_error = str(exc)
                log.warning("node watch: %s; retrying in %.1fs", exc, delay)
                self._stop.wait(delay)
            except Exception as exc:
                # Not the API's: a bug, or a Node no code expected. It counts like any failure (the metric,
                # /readyz through last_error) and backs off the same way: logged and retried in silence, it once
                # left the controller blind while every probe said ok.
                if self._stop.is_set():
                    return
                self.failures += 1
                delay = self._backoff.next_delay()
                self.last_error = f"unexpected error: {type(exc).__name__}: {exc}"
                log.exception("node watch: %s; retrying in %.1fs", self.last_error, delay)
                self._stop.wait(delay)

    def list_all(self) -> None:
        """One LIST of the Nodes into the sink, page by page."""
        rv = ""
        self.sink.begin_list()
        for page in self.api.list_node_pages(self.selector):
            self.sink.list_page(page.items)
            rv = page.resource_version
            del page  # before the next page is requested
        self.sink.end_list()
        self.resource_version, self._listed_at = rv, self._clock()
        self.lists += 1
        self.last_error = ""

    def round(self) -> None:
        """List if needed, then follow one watch until the server ends it."""
        if not self.resource_version or self._clock() - self._listed_at >= self.resync_s:
            self.list_all()
        timeout = self._rng.randint(WATCH_MIN_S, WATCH_MAX_S)
        self.watches += 1
        for event in self.api.watch_nodes(self.selector, self.resource_version, timeout):
            if self._stop.is_set():
                return
            kind = event.get("type")
            obj = event.get("object") or {}
            if kind == "ERROR":
                code = obj.get("code") if isinstance(obj, dict) else None
                raise ApiFailure(code if isinstance(code, int) else None,
                                 str(obj.get("message") if isinstance(obj, dict) else obj))
            rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
            if rv:
                self.resource_version = rv
            self.events += 1
            if kind in ("ADDED", "MODIFIED"):
                self.sink.upsert(obj)
            elif kind == "DELETED":
                self.sink.delete(obj)
            # BOOKMARK: only the version moves
            self.last_error = ""
            if self._clock() - self._listed_at >= self.resync_s:
                return
