"""What the node agent's paced writers to the API server share (the node reporter, plugin/outlets/reporter.py, and the
ResourceSlice writer, plugin/dra/slicewriter.py): the status they show, read by other threads (metrics, the health
stream) under a lock; the API client, built lazily and again after a failure; one warning per failed attempt (the
back-off paces the attempts, so this cannot flood the log) and one line on recovery; the bounded re-read after a
409; and ``step``, the name the worker thread calls, as ``tick``, the name tests and benchmarks drive.

A subclass mixes this in before its worker thread class and keeps what is its own: what to write, when it is due,
what a read brings back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from plugin.kube.errors import ApiFailure
from plugin.kube.protocols import Closeable
from plugin.kube.ratelimit import WriteScheduler

# Re-reads after a refused write, in one step: a conflict that keeps coming back is someone else's write loop, and
# the next step (paced by the scheduler) tries again.
MAX_CONFLICT_RETRIES = 3


@dataclass(frozen=True, kw_only=True)
class WriterStatus:
    """For metrics and the health stream. Times are wall-clock seconds."""

    ok: bool = True  # false while the last attempt failed
    last_error: str | None = None
    last_error_at: float | None = None
    writes: int = 0  # successful writes
    reads: int = 0  # successful reads
    conflicts: int = 0  # 409s answered by a re-read
    failures_by_kind: Mapping[str, int] = field(default_factory=dict)  # failed requests, by what failed

    @property
    def failures(self) -> int:
        """Failed requests of any kind (and failed attempts to build the client)."""
        return sum(self.failures_by_kind.values())


S = TypeVar("S", bound=WriterStatus)
A = TypeVar("A", bound=Closeable)


class PacedWriter(Generic[S, A]):
    RECOVERED = "API server reachable again"  # the recovery line's words, after the label

    def __init__(self, status: S, sched: WriteScheduler, api_factory: Callable[[], A], wall: Callable[[], float],
                 *, label: str, log: logging.Logger) -> None:
        self._status = status
        self._status_lock = threading.Lock()
        self._sched = sched
        self._api_factory = api_factory
        self._api: A | None = None
        self._wall = wall
        self._label = label  # starts the log lines, as the worker thread's do
        self._log = log
        self._logged_error: str | None = None  # the error of the failure streak under way

    def tick(self, now: float) -> float:
        """Do whatever is due at ``now``; return when to be called next (or sooner, on a state change)."""
        raise NotImplementedError

    def step(self, now: float) -> float:
        return self.tick(now)

    def status(self) -> S:
        with self._status_lock:
            return self._status

    def _update(self, **changes: Any) -> None:
        with self._status_lock:
            self._status = replace(self._status, **changes)

    def _clients(self) -> Iterable[Closeable | None]:
        return (self._api,)

    def _connect(self, now: float) -> float | None:
        """Build the API client unless there is one: None once there is, else when to try again."""
        if self._api is not None:
            return None
        if self._sched.blocked(now):
            return self._sched.blocked_until
        try:
            self._api = self._api_factory()
        except ApiFailure as f:
            self._failed("building the API client", f, self._sched.failed(now), "client")
            return self._sched.blocked_until
        return None

    def _failed(self, what: str, f: ApiFailure, delay: float, kind: str) -> None:
        """Count a failed request under ``kind`` and say so, with ``delay``, the back-off before the next try."""
        self._count_failure(what, f, kind)
        self._log.warning("%s: %s failed (%s); retrying in %.1fs", self._label, what, f, delay)
        self._logged_error = str(f)

    def _count_failure(self, what: str, f: ApiFailure, kind: str) -> None:
        s = self.status()
        by_kind = {**s.failures_by_kind, kind: s.failures_by_kind.get(kind, 0) + 1}
        self._update(ok=False, last_error=f"{what}: {f}", last_error_at=self._wall(), failures_by_kind=by_kind)

    def _recovered(self) -> None:
        if self._logged_error is not None:
            self._log.info("%s: %s (last error: %s)", self._label, self.RECOVERED, self._logged_error)
            self._logged_error = None
        self._update(ok=True)

    def _until_settled(self, attempt: Callable[[], bool], reread: Callable[[], bool],
                       retry: frozenset[int] = frozenset({409})) -> bool:
        """Call ``attempt`` (True: nothing is left to write) again until it settles, at most
        ``MAX_CONFLICT_RETRIES + 1`` times. A refusal with a status in ``retry`` re-reads and tries again: the write
        was refused whole, so nothing stale reached the server, and the next attempt is computed from what the
        server has. False when that re-read failed (it recorded why); any other failure raises."""
        for n in range(MAX_CONFLICT_RETRIES + 1):
            try:
                if attempt():
                    return True
            except ApiFailure as f:
                if f.status not in retry or n == MAX_CONFLICT_RETRIES:
                    raise
                if f.status == 409:  # someone changed the object since our read
                    self._update(conflicts=self.status().conflicts + 1)
                if not reread():
                    return False
        return True
