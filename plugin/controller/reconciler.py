"""The reconciler: the Node cache, the decisions and the writes.

The watcher feeds Nodes in; each change that matters to a decision (not a heartbeat) marks the Node dirty. One
worker thread takes dirty Nodes in the order they changed and, while this replica leads, decides for each: quarantine
it (if the breaker allows), add the NoExecute taint once its grace is over, drain it, or release it once it has been
fit for the recovery hold. Deadlines (a hold ending, a grace ending, a drain to look at again) sit in a heap and mark
their Node dirty when due, so an idle fleet costs no work and no request.

A write's answer goes into the cache at once, so counts (and the breaker) are exact before the watch echoes it; the
echo, and any older event still in flight, is recognised by its resourceVersion and ignored. Every write carries
the resourceVersion it was decided on; a 409 means the Node moved, and it is read again and decided again.

Given writer clients (``writers``, each its own connection), a quarantine's two requests (the Node PATCH and its
GPUNodeQuarantined Event) are made on a writer thread while the worker goes on deciding: a correlated storm is
hundreds of quarantines at once, each one round trip after another on a single connection. Only quarantines fan out:
releases trickle in one by one as Nodes pass their hold, the NoExecute taints follow their quarantines by a grace,
and the drain is paced by its eviction rate anyway. The decisions stay on the worker, in the same order, and the
breaker stays exact: a candidate's slot is reserved under the lock before its write is handed off and counted with
the quarantined until the answer is stored (or the write failed); a candidate the limit refuses while writes are in
flight waits for them first, so that it is refused on the same counts the inline path would have seen. A step waits
for all its writes before it settles the breaker and returns, so no Node is decided while its write is in flight.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from plugin.backoff import Backoff
from plugin.controller import patches, repeat
from plugin.controller.api import ControllerApi
from plugin.controller.breaker import Breaker, BreakerState
from plugin.controller.nodes import (
    CONTROLLER,
    NO_EXECUTE_REMOVED,
    OWN_NO_EXECUTE,
    Keys,
    NodeFacts,
    Quarantine,
    facts_of,
    shared,
)
from plugin.controller.policy import GPU_MISSING, Assessment, Rules, assess
from plugin.kube.errors import ApiFailure
from plugin.kube.events import Involved, event_body, rfc3339
from plugin.kube.ratelimit import TokenBucket
from plugin.options.durations import format_duration

log = logging.getLogger(__name__)

EVENT_NAMESPACE = "default"  # where Node events go (the kubelet's choice): kubectl describe node lists them
DRAIN_RECHECK_S = 10.0  # how often a drain looks again at pods it could not evict yet (a PDB said no)
# How often a Node we hold quarantined but no longer see through the watch (it left --node-selector, or a LIST went
# without it) is read again by name: the only way to learn that it recovered, or that it is gone (404).
OUT_OF_SIGHT_RECHECK_S = 60.0
UNREADABLE_LOG_S = 60.0  # the log line about Nodes whose agent annotations cannot be read, at most this often
LOST_RETRY_S = 5.0  # a Node the Lease names as ours and out of sight, whose read by name failed: try again soon
IDLE_WAKE_S = 60.0
RETRY_INITIAL_S = 1.0  # one Node's back-off after a failed request: 1 s doubling to a minute
RETRY_MAX_S = 60.0


def permanent(status: int | None) -> bool:
    """A refusal that asking again will not change (403 from RBAC or a webhook, 422, 400): final for the decision
    it answered. 409 (moved on), 429 (throttled or a budget), 408 (timed out) and 404 (gone) are not."""
    return status is not None and 400 <= status < 500 and status not in (404, 408, 409, 429)


class NotLeading(Exception):
    """The Lease was lost (or its renewal is overdue) just before a write: the write is not made."""


class Stopping(NotLeading):
    """The process is stopping (SIGTERM): no write starts any more; the Lease is handed back once those in flight
    are done."""


class Refused(Exception):
    """A write the API server refused for good (see :func:`permanent`)."""

    def __init__(self, action: str, failure: ApiFailure) -> None:
        super().__init__(f"{action}: {failure}")
        self.action = action
        self.failure = failure


class Leadership(Protocol):
    def is_leader(self) -> bool: ...
    def annotations(self) -> dict[str, str]: ...
    def seen_annotations(self) -> dict[str, str]: ...
    def set_annotation(self, key: str, value: str) -> None: ...


@dataclass(frozen=True)
class Settings:
    keys: Keys
    rules: Rules
    recovery_hold_s: float = 600.0
    gpu_missing_grace_s: float = 600.0
    repeat_limit: int = 5  # 0: off
    repeat_window_s: float = 7 * 86400.0
    no_execute_after_s: float = 0.0
    cordon: bool = False
    label: str = ""
    drain: bool = False
    drain_per_minute: float = 10.0
    max_quarantined_fraction: float = 0.1
    max_quarantined_nodes: int = 0
    dry_run: bool = False
    reset_breaker: bool = False
    namespace: str = "gpu-health-system"  # the Lease's, for the breaker's Events
    lease_name: str = "gpu-health-controller"
    identity: str = ""


# One per Node of the fleet (50,000 of them, issue 27): slots, and nothing allocated until it is needed (the empty
# frozensets are one shared object; an eviction refused or an owned item removed makes a new one).
@dataclass(slots=True)
class Entry:
    facts: NodeFacts
    assessment: Assessment
    # When this process first saw it fit, by its own clock: the recovery hold counts from here, never from a time
    # the node agent wrote (its account can write any device `since`). A new leader starts the hold over.
    fit_seen: float | None = None
    # When this process first saw the node report a GPU missing, by its own clock: the gpu-missing rule waits its
    # grace from here (a GPU reset takes a GPU out of NVML for a while, and the agent's times are its word).
    missing_seen: float | None = None
    dry: Quarantine | None = None  # what --dry-run pretends it applied
    drained_logged: bool = False
    blocked_told: bool = False  # its GPUQuarantineBlocked Event went out (once while it waits)
    held_told: bool = False  # its GPUNodeRepeatOffender Event went out (once, when it is fit but held)
    unreadable_told: bool = False  # its GPUAnnotationsUnreadable Event went out (once while they stay so)
    refused: frozenset[str] = frozenset()  # its pods a PodDisruptionBudget held back (429)
    # Each Node backs off on its own: other Nodes' successes say nothing about why this one's requests fail.
    backoff: Backoff = field(default_factory=lambda: Backoff(RETRY_INITIAL_S, RETRY_MAX_S))
    # A write refused for good: the decision's inputs and the LIST generation it was refused at. Not retried until
    # either moves (the Node changed, or a resync listed it again).
    refusal: tuple[object, ...] | None = None
    # What our record says we added that someone took off since (seen event by event, so a removal and a re-add
    # between two decisions is still seen); struck from the record at the next decision.
    disowned: frozenset[str] = frozenset()
    watched: bool = True  # the watch (or the last LIST) shows it; False: ours, kept and read again by name
    read_at: float | None = None  # when an out-of-sight Node was last read by name

    @property
    def ours(self) -> bool:
        return self.facts.quarantine is not None or self.dry is not None


@dataclass
class Stats:
    actions: dict[str, int] = field(default_factory=dict)
    api_failures: dict[str, int] = field(default_factory=dict)
    conflicts: int = 0
    refused_writes: dict[str, int] = field(default_factory=dict)  # by action: refused for good (403, 422, ...)
    events_posted: int = 0
    event_failures: int = 0
    evictions_blocked: int = 0
    decisions: int = 0  # Nodes the leader looked at (worker thread only): proof of a loop at work, for probes
    last_error: str = ""
    # The writer threads count too (their requests, their Events): one read-modify-write at a time.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, table: dict[str, int], key: str) -> None:
        with self._lock:
            table[key] = table.get(key, 0) + 1

    def posted(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self.events_posted += 1
            else:
                self.event_failures += 1


@dataclass(frozen=True)
class _Written:
    """A quarantine write handed to a writer thread: what the worker does with its outcome once it is back (None:
    written; else the exception the inline path would have raised)."""

    name: str
    outcome: Exception | None


class Reconciler:
    def __init__(self, api: ControllerApi, settings: Settings, leader: Leadership,
                 clock: Callable[[], float] = time.time, writers: Sequence[ControllerApi] = ()) -> None:
        self.api = api
        self.s = settings
        self.leader = leader
        self.clock = clock
        self.entries: dict[str, Entry] = {}
        self.gpu_nodes: set[str] = set()
        self.quarantined: set[str] = set()
        self.candidates: set[str] = set()
        self.out_of_sight: set[str] = set()  # quarantined by us, no longer shown by the watch: read by name
        self.unreadable: set[str] = set()  # shown by the watch, with agent annotations past the codec's bounds
        self._unreadable_logged = float("-inf")
        self.breaker = Breaker(settings.max_quarantined_fraction, max_nodes=settings.max_quarantined_nodes)
        self.stats = Stats()
        self.synced = False
        self.last_step_at = 0.0
        self._dirty: dict[str, None] = {}  # an ordered set: decide in the order things changed
        self._timers: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._leading = False
        self._poked = False
        self._lease_events: list[dict[str, Any]] = []
        self._breaker_written = ""
        self._reset_flag_used = False  # --reset-breaker acts at the first acquisition only
        self._out_of_sight_written = ""
        self._lost: set[str] = set()  # out-of-sight Nodes the Lease names that this process has not read yet
        self._lists = 0  # LISTs fed in (start, resync, after 410): a refused write is tried again after one
        self._listed: set[str] = set()  # the Nodes the LIST under way has named so far
        # The drain rate, over all nodes: one eviction per interval, none saved up beyond one.
        self._evictions = TokenBucket(60.0 / settings.drain_per_minute)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The quarantine writers (none: every write inline on ``api``). A writer client is taken for each write and
        # given back with its outcome, so at most len(writers) writes are in flight and each has a connection.
        self._writers = len(writers)
        self._free: list[ControllerApi] = list(writers)
        self._pool = (ThreadPoolExecutor(self._writers, thread_name_prefix="quarantine-write") if writers
                      else None)
        self._reserved: set[str] = set()  # candidates whose quarantine is in flight: they count as quarantined
        self._written: list[_Written] = []  # outcomes back from the writers, for the worker to act on
        self._handed: set[str] = set()  # the Nodes this step handed to a writer (worker thread only)
        self._halted = False  # a writer found the Lease lost: no further write starts in this step
        # When the watch delivered the change that made a dirty Node so (``clock``): a quarantine's log line says how
        # long the controller held it before its PATCH went out. Only dirty Nodes are here: nothing per Node at rest.
        self._seen: dict[str, float] = {}

    # The feed (watcher thread) ----------------------------------------------------------------------------------

    def begin_list(self) -> None:
        """A LIST starts: its pages follow as they arrive (each page's JSON is let go once its facts are kept)."""
        with self._cond:
            self._lists += 1  # a resync: a write refused for good gets one more try (see _store)
            self._listed = set()

    def list_page(self, nodes: list[dict[str, Any]]) -> None:
        with self._cond:
            for doc in nodes:
                name = self._store(doc, force=True)
                if name:
                    self._listed.add(name)
            self._cond.notify_all()

    def end_list(self) -> None:
        """The LIST is complete: what it did not name is gone (its DELETED event was lost), and the cache is synced.
        A LIST that failed part-way never gets here, so nothing is forgotten on a partial one's word."""
        with self._cond:
            seen, self._listed = self._listed, set()
            self._forget_unseen(seen)
            if not self.synced and self._leading:
                # Led before the cache was whole: the steps the pages woke dropped what they marked (a step that
                # may not act keeps nothing), so everything is looked at once now, as at a leadership change.
                self._dirty.update(dict.fromkeys(self.gpu_nodes))
                self._dirty.update(dict.fromkeys(self._lost))
            self.synced = True
            self._cond.notify_all()

    def _forget_unseen(self, seen: set[str]) -> None:
        for gone in [n for n in self.entries if n not in seen]:
            self._forget(gone)

    def replace(self, nodes: list[dict[str, Any]]) -> None:
        """A whole LIST in one page (tests, and callers that have one)."""
        self.begin_list()
        self.list_page(nodes)
        self.end_list()

    def upsert(self, node: dict[str, Any]) -> None:
        with self._cond:
            name = self._store(node, force=False)
            if name:
                self._seen.setdefault(name, self.clock())
                self._cond.notify_all()

    def delete(self, node: dict[str, Any]) -> None:
        with self._cond:
            name = str((node.get("metadata") or {}).get("name") or "")
            self._forget(name)
            self._cond.notify_all()

    def _store(self, doc: dict[str, Any], force: bool, watched: bool = True) -> str:
        """Keep a Node's facts; mark it dirty when a decision may change. Returns its name when it was dirtied
        (or, with ``force``, whenever it is known). ``watched`` False: the Node as read by name (a GET, a write's
        answer), which says nothing about whether the watch still shows it."""
        f = facts_of(doc, self.s.keys)
        if not f.name:
            return ""
        old = self.entries.get(f.name)
        stale = old is not None and _older(f.resource_version, old.facts.resource_version)
        if stale and not force:
            return ""  # the echo of a write whose answer we already hold, or an older event still in flight
        sighted = watched and old is not None and not old.watched
        if sighted:
            assert old is not None
            old.watched = True
        # A LIST page is a snapshot taken when the LIST began: a quarantine that landed since (its answer, its
        # echo) is newer, and storing the page over it would free its slot in the breaker. The cached facts stand;
        # the node still counts as listed.
        if old is not None and (stale or old.facts.decision_key() == f.decision_key()):
            if not stale:
                old.facts = f  # only the version moved (a heartbeat): nothing to decide
            if sighted:
                self._count(f.name)
            if old.refusal is not None and old.refusal[1] != self._lists:
                self._dirty[f.name] = None  # a resync listed it again: a refused write gets its one more try
            return f.name if force else ""
        a = shared(assess(f, self.s.rules))  # most of a fleet's assessments read the same
        if old is None:
            e = self.entries[f.name] = Entry(f, a, watched=watched)
        else:
            e = old
            e.facts, e.assessment = f, a
        if f.quarantine is None:
            e.disowned = frozenset()
        else:
            e.disowned = (e.disowned | patches.missing(f, self.s.keys)) & f.quarantine.owns
        self._count(f.name)
        if f.name not in self.entries:
            return ""
        self._dirty[f.name] = None
        return f.name

    def _store_answer(self, doc: dict[str, Any]) -> bool:
        """Keep a Node as a request by name answered it (a write, a GET), unless the watch has already delivered a
        newer version: that one's facts, and the recheck it queued, stand (False)."""
        name = str((doc.get("metadata") or {}).get("name") or "")
        old = self.entries.get(name)
        rv = str((doc.get("metadata") or {}).get("resourceVersion") or "")
        if old is not None and _older(rv, old.facts.resource_version):
            return False
        self._store(doc, force=True, watched=False)
        return True

    def _forget(self, name: str) -> None:
        """The watch or a LIST no longer shows the Node: it was deleted, or it left --node-selector. A Node we
        hold quarantined is kept (it counts against the limit until we release it) and read again by name; a 404
        then forgets it."""
        e = self.entries.get(name)
        if e is not None and e.ours:
            if e.watched:
                e.watched, e.read_at = False, None
                self._count(name)
                self._dirty[name] = None
            return
        if e is None and name in self._lost:
            return  # named by the Lease and not read yet: it is read by name all the same (a 404 forgets it)
        self._drop(name)

    def _drop(self, name: str) -> None:
        self.entries.pop(name, None)
        self._dirty.pop(name, None)
        self._seen.pop(name, None)
        for s in (self.gpu_nodes, self.quarantined, self.candidates, self.out_of_sight, self.unreadable):
            s.discard(name)

    def _count(self, name: str) -> None:
        """The breaker's sets. The denominator is the GPU nodes the watch shows plus every Node we hold
        quarantined, whatever it looks like now: a quarantine counts against the limit until we release it."""
        e = self.entries[name]
        f = e.facts
        q = e.ours
        (self.unreadable.add if f.unreadable and e.watched else self.unreadable.discard)(name)
        if not q and not (e.watched and f.is_gpu_node):
            if not e.watched:
                self._drop(name)  # released (or its record removed) while out of sight: no longer ours to track
                return
            for s in (self.gpu_nodes, self.quarantined, self.candidates, self.out_of_sight):
                s.discard(name)
            return
        self.gpu_nodes.add(name)
        (self.quarantined.add if q else self.quarantined.discard)(name)
        (self.out_of_sight.add if q and not e.watched else self.out_of_sight.discard)(name)
        (self.candidates.add if e.assessment.reason and not q else self.candidates.discard)(name)

    # Leadership -------------------------------------------------------------------------------------------------

    def leadership_changed(self, leading: bool) -> None:
        with self._cond:
            self._leading = leading
            if leading:
                # Whatever happened while another replica led (or nobody did), every Node is looked at once.
                for name in self.gpu_nodes:
                    self._dirty[name] = None
                seen = self.leader.seen_annotations()
                state = BreakerState.from_json(seen.get(self._breaker_key))
                # Quarantined Nodes outside the selector are in no LIST of ours: the Lease names them, and each is
                # read by name before anything is decided, so they count against the limit from the start.
                self._out_of_sight_written = seen.get(self._out_of_sight_key, "")
                for name in self._out_of_sight_written.split(","):
                    if name and name not in self.entries:
                        self._lost.add(name)
                        self._dirty[name] = None
                self.breaker = Breaker(self.s.max_quarantined_fraction, state, self.s.max_quarantined_nodes)
                self._breaker_written = state.to_json()
                if self.s.reset_breaker and not self._reset_flag_used:
                    # Once per process start: a Lease blip or a hand-over and back must not close, again, a breaker
                    # that opened since.
                    self._reset_flag_used = True
                    self.breaker.reset(rfc3339(self.clock()), f"--reset-breaker at {rfc3339(self.clock())}")
            self._cond.notify_all()

    def lease_changed(self) -> None:
        """The Lease's annotations changed (an operator's breaker reset): look at them now, not at the next wake."""
        with self._cond:
            self._poked = True
            self._cond.notify_all()

    @property
    def _breaker_key(self) -> str:
        # A dry run's breaker counts pretend quarantines: kept apart, so a real leader never starts from it.
        return self.s.keys.breaker + ("-dry-run" if self.s.dry_run else "")

    @property
    def _out_of_sight_key(self) -> str:
        return self.s.keys.out_of_sight + ("-dry-run" if self.s.dry_run else "")

    # The worker -------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="reconcile", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """No write starts from now on; wait up to ``timeout_s`` for the worker to finish its step, the writes in
        flight landing or failing within their client timeout. True when nothing is in flight any more (the Lease
        may be handed back); False when something still is (it must not: the Lease then lapses by itself)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                if self._pool is not None:
                    self._pool.shutdown(wait=False, cancel_futures=True)
                return False
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)  # idle by now: the step awaited its writes
        return True

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                deadline = self.step(self.clock())
            except Exception:
                log.exception("reconcile: unexpected error; retrying in 5s")
                deadline = self.clock() + 5.0
            with self._cond:
                if not self._dirty and not self._poked and not self._stop.is_set():
                    self._cond.wait(max(0.0, min(deadline - self.clock(), IDLE_WAKE_S)))
                self._poked = False

    def step(self, now: float) -> float:
        """Decide for every dirty or due Node; return when a timer is next due."""
        self.last_step_at = now
        with self._cond:
            self._log_unreadable(now)
            while self._timers and self._timers[0][0] <= now:
                _, name = heapq.heappop(self._timers)
                if name in self.entries or name in self._lost:
                    self._dirty[name] = None
            if not (self.synced and self._leading and self.leader.is_leader()):
                self._dirty.clear()  # a new leader looks at everything anyway
                self._seen.clear()
                return self._next_timer(now)
            self._check_reset(now)
            # The Nodes the Lease names as ours and out of sight are read first: they count before anyone is decided.
            todo = sorted(self._dirty, key=lambda n: n not in self._lost)
            self._dirty.clear()
            self._halted = False
        self._handed.clear()
        self._flush_lease_events()
        try:
            for name in todo:
                if self._halted or self._stop.is_set() or not self.leader.is_leader():
                    break  # lost the Lease mid-batch, or stopping: no further write starts
                try:
                    self.stats.decisions += 1
                    self._decide(name, now)
                    e = self.entries.get(name)
                    if e is not None and name not in self._handed:  # a handed write resets it when it lands
                        e.backoff.reset()
                except Stopping:
                    log.info("reconcile %s: stopping; no further write starts", name)
                    break
                except NotLeading:
                    log.info("reconcile %s: no longer the leader; stopping before the next write", name)
                    break
                except Refused as exc:
                    self._refused(name, exc, now)
                except ApiFailure as exc:
                    self._failed(name, exc, now)
                with self._cond:
                    self._seen.pop(name, None)
                self._flush_lease_events()
        finally:
            # Every write of this step lands (or fails) before the breaker settles and before the next step, which
            # then sees exact counts and never decides a Node whose write is still in flight.
            self._await_writes(0, now)
        with self._cond:
            self._settle(now)
            # Work queued by this step (a re-read after a 409, candidates the closed breaker lets go) is due now.
            due = now if self._dirty else self._next_timer(now)
        self._flush_lease_events()
        return due

    def _log_unreadable(self, now: float) -> None:
        """One line a minute at most, on every replica, while some Nodes' annotations cannot be read."""
        if not self.unreadable or now - self._unreadable_logged < UNREADABLE_LOG_S:
            return
        self._unreadable_logged = now
        names = sorted(self.unreadable)
        e = self.entries.get(names[0])
        log.warning("%d node(s) with node agent annotations that cannot be read, neither quarantined nor released "
                    "on them: %s%s (%s)", len(names), ", ".join(names[:5]), " ..." if len(names) > 5 else "",
                    e.facts.unreadable if e is not None else "?")

    def _next_timer(self, now: float) -> float:
        return self._timers[0][0] if self._timers else now + IDLE_WAKE_S

    def _at(self, due: float, name: str) -> None:
        with self._cond:
            heapq.heappush(self._timers, (due, name))

    def _failed(self, name: str, exc: ApiFailure, now: float) -> None:
        self.stats.last_error = f"{name}: {exc}"
        with self._cond:
            e = self.entries.get(name)
        if e is None:
            return
        if exc.status == 409:
            self.stats.conflicts += 1
            try:
                node = self.api.get_node_doc(name)
            except ApiFailure as again:
                self.stats.count(self.stats.api_failures, "get")
                if again.status == 404:
                    with self._cond:
                        self._drop(name)
                    return
                self._at(now + e.backoff.next_delay(again.retry_after), name)
                return
            with self._cond:
                if self._store_answer(node):
                    self._dirty[name] = None
            return
        if exc.status == 404:
            with self._cond:
                self._drop(name)  # gone from the server (a read or a write by name said so): nothing left to hold
            return
        delay = e.backoff.next_delay(exc.retry_after)
        log.warning("reconcile %s: %s; trying again in %.1fs", name, exc, delay)
        self._at(now + delay, name)

    def _refused(self, name: str, exc: Refused, now: float) -> None:
        """Logged once, one Event, counted; the Node waits for a change or a resync."""
        self.stats.last_error = f"{name}: {exc.failure}"
        with self._cond:
            e = self.entries.get(name)
            if e is None:
                return
            e.refusal = (e.facts.decision_key(), self._lists)
            f = e.facts
        self.stats.count(self.stats.refused_writes, exc.action)
        log.warning("reconcile %s: %s refused: %s; not retried until the node changes or the next resync", name,
                    exc.action, exc.failure)
        self._event(f, "GPUNodeWriteRefused", "Warning", f"{exc.action} refused by the API server: {exc.failure}; "
                    f"not retried until the node changes or the next resync", now)

    # Decisions --------------------------------------------------------------------------------------------------

    def _decide(self, name: str, now: float) -> None:
        with self._cond:
            e = self.entries.get(name)
            lost = e is None and name in self._lost
            if e is None and not lost:
                return
            stale = lost or (e is not None and not e.watched and
                             (e.read_at is None or now - e.read_at >= OUT_OF_SIGHT_RECHECK_S))
        if stale:
            try:
                node = self.api.get_node_doc(name)
            except ApiFailure as exc:
                self.stats.count(self.stats.api_failures, "get")
                if lost:
                    with self._cond:
                        if exc.status == 404:
                            self._lost.discard(name)
                        else:
                            heapq.heappush(self._timers, (now + LOST_RETRY_S, name))
                    return
                raise  # a 404 forgets it (_failed)
            with self._cond:
                self._lost.discard(name)
                if self._store_answer(node):
                    self._dirty.pop(name, None)
                e = self.entries.get(name)
                if e is not None and not e.watched:
                    e.read_at = now
                    heapq.heappush(self._timers, (now + OUT_OF_SIGHT_RECHECK_S, name))
        with self._cond:
            if e is None or name not in self.gpu_nodes:
                return
            f, a = e.facts, e.assessment
            if e.refusal is not None:
                if e.refusal == (f.decision_key(), self._lists):
                    return  # refused for good on these very inputs
                e.refusal = None
            tell_unreadable = bool(f.unreadable) and not e.unreadable_told
            e.unreadable_told = bool(f.unreadable)
        if tell_unreadable:
            self._event(f, "GPUAnnotationsUnreadable", "Warning", f"the node agent's annotations cannot be read "
                        f"({f.unreadable}): this node is neither quarantined nor released on them until its agent "
                        f"writes values it can read; check the plugin pod on this node", now)
        q = f.quarantine or e.dry
        if q is None:
            e.fit_seen = None
            e.held_told = False
            if f.release_request is not None and not self.s.dry_run:
                # An operator's release request on a node we do not hold: its count starts over, and the request
                # is used up now, not left to release its next repeat-offender quarantine unasked.
                self._write(e, "reset-count", patches.reset_count(f, self.s.keys))
                log.info("%s: quarantine count reset at an operator's request (%s=%r)", name, self.s.keys.release,
                         f.release_request)
                self._event(f, "GPUNodeQuarantineCountReset", "Normal", f"quarantine count reset at an operator's "
                            f"request ({self.s.keys.release}={f.release_request!r})", now)
                self._decide(name, now)  # on the record as it is now
                return
            if a.reason != GPU_MISSING:
                e.missing_seen = None
            if a.reason is None:
                e.blocked_told = False
                return
            if a.reason == GPU_MISSING and self.s.gpu_missing_grace_s > 0:
                if e.missing_seen is None:
                    e.missing_seen = now
                due = e.missing_seen + self.s.gpu_missing_grace_s
                if now < due:
                    self._at(due, name)
                    return
            if self._pool is not None and not self.s.dry_run:
                self._await_writes(self._writers - 1, now)  # a writer free before a slot is reserved for it
            allowed = self._reserve(name)
            if not allowed and self._reserved:
                # Refused only on settled counts: a write in flight may yet fail and give its slot back, as it
                # would have before this Node was looked at on the inline path.
                self._await_writes(0, now)
                allowed = self._reserve(name)
            if self._halted or self._stop.is_set():
                with self._cond:
                    self._reserved.discard(name)
                raise Stopping() if self._stop.is_set() else NotLeading()
            if allowed:
                self._quarantine(e, a, now)
                if name not in self._handed:
                    e.blocked_told = False
                return
            with self._cond:
                self._trip(now)
            if not e.blocked_told:
                e.blocked_told = True
                self._event(f, "GPUQuarantineBlocked", "Warning", f"not quarantined ({a.reason}: {a.message}): the "
                            f"circuit breaker is open: {self.breaker.state.reason}", now)
            return
        if e.disowned and e.dry is None:
            gone = e.disowned
            log.info("%s: %s taken off by someone else during the quarantine: no longer ours to take back", name,
                     ", ".join(sorted(gone)))
            self._write(e, "disown", patches.disown(f, self.s.keys, gone))
            self._decide(name, now)  # on the record as it is now
            return
        if a.reason is not None:
            e.fit_seen = None
            if (self.s.no_execute_after_s > 0 and not q.owns & {OWN_NO_EXECUTE, NO_EXECUTE_REMOVED}
                    and e.dry is None):
                due = (q.at or now) + self.s.no_execute_after_s
                if now >= due:
                    self._write(e, "noexecute", patches.no_execute(f, self.s.keys, reason=q.reason, now=rfc3339(now)))
                else:
                    self._at(due, name)
            if self.s.drain and not q.drained and e.dry is None:
                self._drain(e, now)
            return
        if not a.fit:
            e.fit_seen = None  # Unknown, or still a bad device below the thresholds: the hold starts over
            return
        if e.fit_seen is None:
            e.fit_seen = now
        due = e.fit_seen + self.s.recovery_hold_s
        if now < due:
            self._at(due, name)
            return
        if q.reason == repeat.REPEAT_OFFENDER and self.s.repeat_limit and f.release_request is None:
            # Fit again, as it was after each of its earlier quarantines in the window: only an operator lets it
            # back (with the count off, --repeat-limit 0, it is released like any other).
            if not e.held_told:
                e.held_told = True
                log.info("%s: fit for %.0f min but held: a repeat offender, released only at an operator's request "
                         "(%s)", name, (now - e.fit_seen) / 60.0, self.s.keys.release)
                self._event(f, "GPUNodeRepeatOffender", "Warning",
                            f"fit for {(now - e.fit_seen) / 60.0:.0f} min but held: quarantined {self.s.repeat_limit} "
                            f"times within {format_duration(self.s.repeat_window_s)} ({q.reason}); an operator "
                            f"releases it: {release_hint(f.name, self.s.keys)}", now)
            return
        self._release(e, now)

    def _quarantine(self, e: Entry, a: Assessment, now: float) -> None:
        f = e.facts
        assert a.reason is not None
        reason, message, history = a.reason, a.message, None
        if self.s.repeat_limit:
            # This quarantine's time goes into the record with it (one patch): the count on the Node is what any
            # leader, this one after a restart included, decides from.
            times = repeat.record(repeat.parse_history(f.history), now, self.s.repeat_window_s, self.s.repeat_limit)
            history = repeat.format_history(times)
            if repeat.is_repeat(times, self.s.repeat_limit):
                reason = repeat.REPEAT_OFFENDER
                message = (f"quarantined {len(times)} times in {format_duration(self.s.repeat_window_s)} "
                           f"(--repeat-limit {self.s.repeat_limit}), held until an operator releases it; this time "
                           f"{a.reason}: {a.message}")
        what = [f"taint {self.s.keys.taint}={reason}:NoSchedule"]
        if self.s.cordon and not f.unschedulable:
            what.append("cordon")
        if self.s.label:
            what.append(f"label {self.s.label}")
        if self.s.dry_run:
            e.dry = Quarantine(reason=reason, at=now, owns=frozenset(), drained=False)
            with self._cond:
                self._count(f.name)
            self.stats.count(self.stats.actions, "dry-run")
            self._event(f, "GPUQuarantineDryRun", "Normal",
                        f"would quarantine ({', '.join(what)}): {reason}: {message}", now)
            log.info("dry run: would quarantine %s: %s: %s", f.name, reason, message)
            return
        patch = patches.quarantine(f, self.s.keys, reason=reason, message=message[:256], now=rfc3339(now),
                                   cordon=self.s.cordon, label=self.s.label, history=history)
        event = self._event_body(f, "GPUNodeQuarantined", "Warning",
                                 f"quarantined ({', '.join(what)}): {reason}: {message}", now)
        said = f"quarantined {f.name}: {reason}: {message}"
        with self._cond:
            seen = self._seen.get(f.name)
        if self._pool is not None:
            with self._cond:
                api = self._free.pop()  # _decide waited for one
            try:
                self._pool.submit(self._write_out, api, e, patch, event, said, seen)
            except RuntimeError:  # the pool was shut down: stop() gave up waiting for this step
                with self._cond:
                    self._free.append(api)
                    self._reserved.discard(f.name)
                raise Stopping() from None
            self._handed.add(f.name)
            return
        self._send_quarantine(e, patch, event, said, seen, self.api)
        self._quarantined(e, now)

    def _send_quarantine(self, e: Entry, patch: dict[str, Any], event: dict[str, Any], said: str,
                         seen: float | None, api: ControllerApi) -> None:
        """A quarantine's requests, on the worker's connection or a writer's: the PATCH, then its Event."""
        said += _lag(seen, self.clock())
        self._write(e, "quarantine", patch, api=api)
        log.info("%s", said)
        self._post(EVENT_NAMESPACE, event, api=api)

    def _quarantined(self, e: Entry, now: float) -> None:
        """What follows a quarantine's write: the timers of its next stages."""
        if self.s.no_execute_after_s > 0:
            self._at(now + self.s.no_execute_after_s, e.facts.name)
        if self.s.drain:
            self._at(now, e.facts.name)

    # The quarantine writers -------------------------------------------------------------------------------------

    def _reserve(self, name: str) -> bool:
        """Whether the breaker lets one more quarantine through; with writers, the slot is taken at once."""
        with self._cond:
            # A Node the Lease names as ours but not read yet counts as quarantined until it is.
            allowed = self.breaker.allows(self._held() + len(self._lost), len(self.gpu_nodes) + len(self._lost))
            if allowed and self._pool is not None and not self.s.dry_run:
                self._reserved.add(name)
            return allowed

    def _held(self) -> int:
        """Quarantined, or about to be (in flight); a Node whose echo came before its answer counts once."""
        return len(self.quarantined) + sum(1 for n in self._reserved if n not in self.quarantined)

    def _waiting(self) -> int:
        return len(self.candidates) - sum(1 for n in self._reserved if n in self.candidates)

    def _write_out(self, api: ControllerApi, e: Entry, patch: dict[str, Any], event: dict[str, Any],
                   said: str, seen: float | None) -> None:
        """A writer thread: the quarantine's PATCH and Event on its own connection. Its slot is given back when
        the answer is stored (it is quarantined then) or when the write failed."""
        name = e.facts.name
        outcome: Exception | None = None
        try:
            if self._halted:
                raise NotLeading()
            self._send_quarantine(e, patch, event, said, seen, api)
        except NotLeading as exc:
            outcome = exc
            with self._cond:
                self._halted = True
        except Exception as exc:  # the worker acts on it as the inline path would on its own thread
            outcome = exc
        finally:
            with self._cond:
                self._reserved.discard(name)
                self._free.append(api)
                self._written.append(_Written(name, outcome))
                self._cond.notify_all()

    def _await_writes(self, most: int, now: float) -> None:
        """Wait until at most ``most`` quarantine writes are in flight, then act on the outcomes back so far, on
        this (the worker's) thread, as the inline path acts on a write's success or failure."""
        if self._pool is None:
            return
        with self._cond:
            while self._writers - len(self._free) > most:
                self._cond.wait()
            written, self._written = self._written, []
        for w in written:
            e = self.entries.get(w.name)
            if w.outcome is None:
                if e is not None:
                    e.blocked_told = False
                    e.backoff.reset()
                    self._quarantined(e, now)
            elif isinstance(w.outcome, Stopping):
                log.info("reconcile %s: stopping; its quarantine was not written", w.name)
            elif isinstance(w.outcome, NotLeading):
                log.info("reconcile %s: no longer the leader; no further write in this step", w.name)
            elif isinstance(w.outcome, Refused):
                self._refused(w.name, w.outcome, now)
            elif isinstance(w.outcome, ApiFailure):
                self._failed(w.name, w.outcome, now)
            else:
                log.error("reconcile %s: unexpected error in its quarantine write: %r", w.name, w.outcome)
                if e is not None:
                    self._at(now + e.backoff.next_delay(), w.name)
            self._flush_lease_events()

    def _release(self, e: Entry, now: float) -> None:
        f = e.facts
        held = (now - (e.fit_seen if e.fit_seen is not None else now)) / 60.0
        if e.dry is not None:
            e.dry = None
            with self._cond:
                self._count(f.name)
            self.stats.count(self.stats.actions, "dry-run")
            self._event(f, "GPUQuarantineDryRun", "Normal", f"would release: fit for {held:.0f} min", now)
            return
        assert f.quarantine is not None
        reason = f.quarantine.reason
        asked = f.release_request
        self._write(e, "release", patches.release(f, self.s.keys, e.disowned, reset=asked is not None))
        e.held_told = False
        by = ("" if asked is None else
              f"; at an operator's request ({self.s.keys.release}={asked!r}), its quarantine count reset")
        log.info("released %s (quarantined for %s, fit for %.0f min)%s", f.name, reason, held, by)
        self._event(f, "GPUNodeReleased", "Normal",
                    f"released: fit for {held:.0f} min (recovery hold {self.s.recovery_hold_s:.0f}s); was "
                    f"quarantined for {reason}{by}", now)

    def _must_lead(self) -> None:
        """Asked right before each write: a Lease lost since the last question (a renewal overdue while an earlier
        request was in flight) stops the writes here, not at the next Node; so does a stop."""
        if not self.leader.is_leader():
            raise NotLeading()
        if self._stop.is_set():  # after the question: a stop that lands while it is asked is seen
            raise Stopping()

    def _write(self, e: Entry, action: str, patch: dict[str, Any], api: ControllerApi | None = None) -> None:
        self._must_lead()
        try:
            node = (api or self.api).patch_node(e.facts.name, patch)
        except ApiFailure as exc:
            self.stats.count(self.stats.api_failures, "patch")
            if permanent(exc.status):
                raise Refused(action, exc) from None
            raise
        self.stats.count(self.stats.actions, action)
        with self._cond:
            if self._store_answer(node):
                self._dirty.pop(e.facts.name, None)
            # A quarantine in flight is in ``quarantined`` now: its reserved slot goes in the same breath.
            self._reserved.discard(e.facts.name)

    def _drain(self, e: Entry, now: float) -> None:
        f = e.facts
        try:
            pods = self.api.list_pods_on(f.name)
        except ApiFailure:
            self.stats.count(self.stats.api_failures, "list-pods")
            raise
        left = [p for p in pods if _evictable(p)]
        if not left:
            self._write(e, "drained", patches.drained(f, self.s.keys, now=rfc3339(now)))
            self._event(f, "GPUNodeDrained", "Normal", "drained: no evictable pods left", now)
            e.refused = frozenset()
            return
        # Pods a budget refused go last, so that one PodDisruptionBudget does not hold up the rest of the drain.
        left.sort(key=lambda p: _pod_key(p) in e.refused)
        wait = DRAIN_RECHECK_S
        for pod in left:
            key = _pod_key(pod)
            if not self._evictions.take(now):
                if key not in e.refused:
                    # The rate is what holds it back: look again with the next token.
                    wait = self._evictions.available_at(now) - now
                break
            meta = pod.get("metadata") or {}
            self._must_lead()
            try:
                self.api.evict_pod(str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid") or ""))
                self.stats.count(self.stats.actions, "evict")
                e.refused -= {key}
            except ApiFailure as exc:
                if exc.status == 429:  # a PodDisruptionBudget says not now
                    self.stats.evictions_blocked += 1
                    e.refused |= {key}
                elif exc.status != 404:
                    self.stats.count(self.stats.api_failures, "evict")
        self._at(now + wait, f.name)

    # The breaker ------------------------------------------------------------------------------------------------

    def _trip(self, now: float) -> None:
        opened = self.breaker.trip(rfc3339(now), self._held(), self._waiting(), len(self.gpu_nodes))
        if opened:
            st = self.breaker.state
            log.warning("circuit breaker open: %s; no more quarantines until it closes or an operator resets it "
                        "(annotate lease %s/%s %s)", st.reason, self.s.namespace, self.s.lease_name,
                        self.s.keys.breaker_reset)
            self._lease_event("GPUQuarantineBlocked", "Warning",
                              f"circuit breaker open: {st.reason}; quarantines stop until the demand fits the limit "
                              f"again or an operator resets it", now)

    def _settle(self, now: float) -> None:
        if self.breaker.settle(rfc3339(now), self._held(), self._waiting(), len(self.gpu_nodes)):
            log.info("circuit breaker closed: %s", self.breaker.state.reason)
            for name in self.candidates:  # held back while it was open: nothing else would look at them again
                self._dirty[name] = None
            self._lease_event("GPUQuarantineResumed", "Normal", f"circuit breaker closed: "
                              f"{self.breaker.state.reason}", now)
        raw = self.breaker.state.to_json()
        if raw != self._breaker_written:
            self.leader.set_annotation(self._breaker_key, raw)  # rides on the next renewal: no request of its own
            self._breaker_written = raw
        names = ",".join(sorted(self.out_of_sight | self._lost))
        if names != self._out_of_sight_written:
            self.leader.set_annotation(self._out_of_sight_key, names)
            self._out_of_sight_written = names

    def _check_reset(self, now: float) -> None:
        token = self.leader.annotations().get(self.s.keys.breaker_reset, "")
        if token and self.breaker.reset(rfc3339(now), token):
            log.info("circuit breaker reset by an operator (%s=%s)", self.s.keys.breaker_reset, token)
            for name in self.candidates:
                self._dirty[name] = None
            self._lease_event("GPUQuarantineResumed", "Normal", f"circuit breaker reset by an operator ({token})",
                              now)

    # Events -----------------------------------------------------------------------------------------------------

    def _event(self, f: NodeFacts, reason: str, type_: str, message: str, now: float) -> None:
        self._post(EVENT_NAMESPACE, self._event_body(f, reason, type_, message, now))

    def _event_body(self, f: NodeFacts, reason: str, type_: str, message: str, now: float) -> dict[str, Any]:
        return event_body(Involved("Node", f.name, uid=f.uid), EVENT_NAMESPACE, reason=reason, type_=type_,
                          message=message, count=1, first=now, last=now, host=self.s.identity,
                          component=CONTROLLER)

    def _lease_event(self, reason: str, type_: str, message: str, now: float) -> None:
        body = event_body(Involved("Lease", self.s.lease_name, namespace=self.s.namespace), self.s.namespace,
                          reason=reason, type_=type_, message=message, count=1, first=now, last=now,
                          host=self.s.identity, component=CONTROLLER)
        body["involvedObject"]["apiVersion"] = "coordination.k8s.io/v1"
        # Decided under the lock (the breaker's counts), posted after it: the watch feed never waits on a request.
        self._lease_events.append(body)

    def _flush_lease_events(self) -> None:
        events, self._lease_events = self._lease_events, []
        for body in events:
            self._post(self.s.namespace, body)

    def _post(self, namespace: str, body: dict[str, Any], api: ControllerApi | None = None) -> None:
        if not self.leader.is_leader():
            # Only the leader speaks for the controller; the Node's record says what was done.
            log.info("event %s not posted: no longer the leader", body.get("reason"))
            return
        if self._stop.is_set():
            log.info("event %s not posted: stopping", body.get("reason"))
            return
        try:
            (api or self.api).create_event(namespace, body)
            self.stats.posted(True)
        except ApiFailure as exc:
            # The Node's annotations are the record; a lost Event is logged and counted, never retried.
            self.stats.posted(False)
            log.warning("event %s: %s", body.get("reason"), exc)

    # Views ------------------------------------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        with self._cond:
            return {"gpu_nodes": len(self.gpu_nodes), "quarantined": len(self.quarantined),
                    "candidates": len(self.candidates), "limit": self.breaker.limit(len(self.gpu_nodes)),
                    "nodes": len(self.entries), "unreadable": len(self.unreadable)}

    def quarantined_by_reason(self) -> dict[str, int]:
        with self._cond:
            out: dict[str, int] = {}
            for name in self.quarantined:
                e = self.entries[name]
                q = e.facts.quarantine or e.dry
                if q is not None:
                    out[q.reason] = out.get(q.reason, 0) + 1
            return out


def release_hint(node: str, keys: Keys) -> str:
    """How an operator releases a repeat offender (docs/fleet.md, "Repeat offenders")."""
    return (f"kubectl gpu-health fleet release {node} --note TEXT (or kubectl annotate node {node} "
            f"{keys.release}=TEXT)")


def _lag(seen: float | None, now: float) -> str:
    """How long the controller held a quarantine, from the watch event that made the Node a candidate to its PATCH
    going out: the controller's own part of annotation-to-taint, apart from the API server's (issue 27)."""
    if seen is None:
        return ""  # decided on a read by name, a timer or a resync, not on a watch event
    return f" (PATCH sent {(now - seen) * 1000:.1f} ms after its watch event)"


def _older(rv: str, than: str) -> bool:
    """resourceVersions are opaque to clients, but the etcd-backed API server hands out increasing integers; only
    then can an event be told to be older than what the cache holds."""
    try:
        return int(rv) < int(than)
    except ValueError:
        return False


def _pod_key(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return str(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}")


def _evictable(pod: dict[str, Any]) -> bool:
    """What ``kubectl drain`` would evict: not finished, not already going, not a mirror pod, not a DaemonSet's
    (its controller would put it straight back and it tolerates our taint anyway)."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return False
    if "kubernetes.io/config.mirror" in (meta.get("annotations") or {}):
        return False
    if any(o.get("kind") == "DaemonSet" for o in meta.get("ownerReferences") or [] if isinstance(o, dict)):
        return False
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


__all__ = ["CONTROLLER", "Reconciler", "Settings"]
