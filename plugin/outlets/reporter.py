"""The cluster reporter: writes node annotations, the node condition and Events through the Kubernetes API.

A thin writer around pure parts (the annotation codec in plugin/schema/annotations.py, ``condition.py``,
``events.py``), on the paced-writer base (plugin/kube/writer.py) and the write scheduler (plugin/kube/ratelimit.py)
it shares with the ResourceSlice writer. It runs in its own thread, reads the node state (never holding its lock
during I/O) and keeps the API server calm:

- only on change: it compares what it wants with what the server has, and writes nothing when they agree;
- a burst is coalesced: a write happens ``debounce_s`` after the first unwritten change, with the state of that
  moment, so 20 transitions within a second are one merge PATCH, and alike transitions of several devices within
  the same window are one Event naming them (``events.py``);
- a per-node token bucket (one token per ``min_interval_s``) bounds writes to the Node: a flapping device costs at
  most one write per 10 s by default;
- failures back off exponentially with jitter (``Retry-After`` honoured on 429), are logged once per back-off and
  shown in :meth:`KubeReporter.status`; the kubelet path never waits on any of it;
- every annotation PATCH carries the ``resourceVersion`` it was computed from, so a write based on a stale view is
  refused (409) instead of undoing someone else's edit; on 409 it re-reads and recomputes at once;
- on start it reads the Node and reconciles our keys, and it re-reads every ``resync_s`` to repair manual edits.

Time is passed in (``tick(now)``), so tests and benchmarks drive it on a virtual clock.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from plugin.backoff import Backoff
from plugin.health.node_state import NodeState, Snapshot, Transition
from plugin.health.reasons import State
from plugin.kube.errors import ApiFailure
from plugin.kube.names import DEFAULT_PREFIX
from plugin.kube.protocols import KubeApi
from plugin.kube.ratelimit import WriteScheduler
from plugin.kube.views import NodeView
from plugin.kube.writer import PacedWriter, WriterStatus
from plugin.outlets.condition import DesiredCondition, desired_condition, find_condition
from plugin.outlets.events import NODE_ID, Entry, EventAggregator
from plugin.outlets.worker import OutletThread
from plugin.schema.annotations import (
    DEFAULT_MAX_BYTES,
    desired_annotations,
    device_names,
    last_transitions,
    merge_patch,
    node_state,
)

log = logging.getLogger(__name__)

LABEL = "cluster reporting"
# What a failed request was, besides a failure of any kind: each has its own counter.
FailureKind = Literal["write", "read", "event", "client"]


# The reporter -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ReporterSettings:
    node_name: str
    prefix: str = DEFAULT_PREFIX
    annotations: bool = True
    events: bool = True
    condition: bool = False
    condition_type: str = "GPUHealthy"
    condition_reasons: str = "ours"  # the reason style (condition_reasons.py)
    debounce_s: float = 1.0
    min_interval_s: float = 10.0
    resync_s: float = 600.0
    max_bytes: int = DEFAULT_MAX_BYTES
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 300.0
    event_namespace: str = "default"  # where the kubelet puts Node events too
    event_min_interval_s: float = 10.0
    event_window_s: float = 600.0


@dataclass(frozen=True, kw_only=True)
class ReporterStatus(WriterStatus):
    """For metrics (issue 8) and the health stream. ``writes`` are annotation and condition patches of the Node;
    ``failures`` are write_, read_, client_ and event_failures together."""

    node: str
    last_write_at: float | None = None
    pending: bool = False  # a change waits to be written
    truncated: int = 0  # device entries dropped by the size cap in the current desired state
    events_written: int = 0

    @property
    def write_failures(self) -> int:
        """Failed writes to the Node (annotation or condition patches)."""
        return self._failures_of("write")

    @property
    def read_failures(self) -> int:
        """Failed reads of the Node."""
        return self._failures_of("read")

    @property
    def client_failures(self) -> int:
        """Failed attempts to build the API client (kubeconfig, service account)."""
        return self._failures_of("client")

    @property
    def event_failures(self) -> int:
        return self._failures_of("event")

    def _failures_of(self, kind: FailureKind) -> int:
        return self.failures_by_kind.get(kind, 0)


class KubeReporter(PacedWriter[ReporterStatus, KubeApi], OutletThread):
    def __init__(self, state: NodeState, settings: ReporterSettings, api_factory: Callable[[], KubeApi],
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 rng: random.Random | None = None,
                 on_labels: Callable[[dict[str, str]], None] | None = None) -> None:
        # Told the Node's labels at each read (start and resync): how the expected GPU count reaches the monitor.
        self._on_labels = on_labels
        OutletThread.__init__(self, state, clock, version=0, thread_name="kube-reporter", label=LABEL, log=log)
        self.settings = s = settings
        rng = rng or random.Random()
        sched = WriteScheduler(s.debounce_s, s.min_interval_s, Backoff(s.backoff_initial_s, s.backoff_max_s, rng=rng),
                               clock())
        PacedWriter.__init__(self, ReporterStatus(node=s.node_name), sched, api_factory, wall, label=LABEL, log=log)
        self._ev_backoff = Backoff(s.backoff_initial_s, s.backoff_max_s, rng=rng)
        self._ev_blocked_until = -math.inf
        # One Event per node and burst takes the annotations' burst window: a rollout's GPUs, collected into one
        # PATCH, are one Event too, and neither waits longer than the other (events.py).
        self._events = EventAggregator(s.node_name, s.event_window_s, s.event_min_interval_s, burst_s=s.debounce_s)
        self._seq: int | None = None
        # Where the history restored from the state dir ends: what comes after it happened in this run.
        self._born_seq = state.snapshot().seq
        self._last: dict[str, Transition] = {}
        self._names: dict[str, str] = {NODE_ID: NODE_ID}
        self._node_codes: tuple[str, ...] = ()  # the node's own reasons last seen, for its Events
        self._desired: dict[str, str] = {}
        self._desired_cond: DesiredCondition | None = None
        self._remote: NodeView | None = None
        self._need_read = True
        self._next_resync = math.inf

    def outlet_errors(self) -> dict[str, str]:
        """For the health stream's ListResponse.outlet_errors: our last error while the last attempt failed."""
        s = self.status()
        return {"kube": s.last_error} if not s.ok and s.last_error else {}

    # One step -------------------------------------------------------------------------------------------------

    def tick(self, now: float) -> float:
        """Do whatever is due at ``now``; return when to be called next (or sooner, on a state change)."""
        snap = self.state.snapshot()
        if snap.version == 0:
            return math.inf  # nothing published yet: writing now would wipe the node's device keys
        if snap.version != self._version:
            self._on_snapshot(snap, now)
        retry_at = self._connect(now)
        if retry_at is not None:
            return retry_at
        deadlines = [math.inf]
        s = self.settings
        if s.annotations or s.condition or s.events:
            if (self._need_read or now >= self._next_resync) and not self._sched.blocked(now):
                self._read(now)
            self._check_pending(now)
            if self._remote is not None and (s.annotations or s.condition) and self._sched.try_start(now):
                self._write(now)
            self._update(pending=self._sched.pending_since is not None)
            deadlines += [self._sched.due_at(now), self._next_resync]
            if self._need_read:
                deadlines.append(max(now, self._sched.blocked_until))
        if s.events:
            self._flush_events(now)
            deadlines.append(max(self._events.next_due(), self._ev_blocked_until))
        return min(deadlines)

    def _on_snapshot(self, snap: Snapshot, now: float) -> None:
        first = self._seq is None
        news: list[Transition] | None = [] if first else self.state.transitions_since(self._seq or 0)
        if news is None or first:
            # First look, or we fell behind the bounded history: take the last transitions from what is left.
            self._last.update(last_transitions(self.state.history()))
        else:
            self._last.update(last_transitions(news))
        self._names.update(device_names(snap.devices))
        if self.settings.events:
            # Only transitions seen while running: the ones before our first look (e.g. a latched fault reloaded
            # at start) are on the annotations already and would repeat an Event on every restart. A clearance is
            # the exception: the first poll after a reboot makes it before we look, and it is this run's news.
            if first:
                news = [t for t in self.state.history() if t.seq > self._born_seq and t.note]
            news = [*(news or []), *self._node_transition(snap, now)]
            if news:
                self._events.observe(news, self._names, now)
        self._seq = snap.seq
        self._version = snap.version
        s = self.settings
        if s.annotations:
            desired = desired_annotations(snap, self._last, s.prefix, s.max_bytes)
            self._desired = desired.annotations
            if desired.truncated != self.status().truncated:
                if desired.truncated:
                    log.warning("cluster reporting: annotations over the %d-byte cap; %d device entries omitted",
                                s.max_bytes, desired.truncated)
                self._update(truncated=desired.truncated)
        if s.condition:
            self._desired_cond = desired_condition(snap, s.condition_type, s.condition_reasons)
        present = {d.id for d in snap.devices}
        self._last = {k: v for k, v in self._last.items() if k in present}

    def _node_transition(self, snap: Snapshot, now: float) -> list[Transition]:
        """The node's own reasons changing (a GPU gone missing, or back) as a transition of the node, for an Event.
        Seen at the first look too: a GPU missing at start is news (it is no latched fault reloaded)."""
        codes = tuple(r.code for r in snap.node_reasons)
        if codes == self._node_codes:
            return []
        before, self._node_codes = self._node_codes, codes
        state = node_state(snap).value if codes else State.HEALTHY.value
        if codes:
            return [Transition(0, NODE_ID, State.HEALTHY.value if not before else state, state, snap.node_reasons,
                               now)]
        return [Transition(0, NODE_ID, State.UNHEALTHY.value, state, (), now, note=before[0])]

    def _annotation_patch(self) -> dict[str, str | None]:
        if not self.settings.annotations or self._remote is None:
            return {}
        return merge_patch(self._remote.annotations, self._desired, self.settings.prefix)

    def _condition_needed(self) -> bool:
        if self._desired_cond is None or self._remote is None:
            return False
        return not self._desired_cond.same_as(find_condition(self._remote.conditions, self._desired_cond.type))

    def _check_pending(self, now: float) -> None:
        if self._remote is None:
            return
        if self._annotation_patch() or self._condition_needed():
            self._sched.changed(now)
        else:
            self._sched.settled()

    def _read(self, now: float) -> bool:
        assert self._api is not None
        try:
            self._remote = self._api.get_node(self.settings.node_name)
        except ApiFailure as f:
            what = f"reading node {self.settings.node_name}"
            if f.status == 404:
                f = ApiFailure(404, f"node {self.settings.node_name} does not exist (check --node-name)")
            self._failed(what, f, self._sched.failed(now, f.retry_after), "read")
            return False
        self._need_read = False
        self._next_resync = now + self.settings.resync_s
        if self._on_labels is not None:
            self._on_labels(self._remote.labels)
        self._update(reads=self.status().reads + 1)
        self._recovered()
        return True

    def _write(self, now: float) -> None:
        assert self._api is not None and self._remote is not None
        api = self._api
        node = self.settings.node_name
        writes = 0

        def patch_annotations() -> bool:
            nonlocal writes
            patch = self._annotation_patch()
            if patch and self._remote is not None:
                self._remote = api.patch_node_annotations(node, patch, self._remote.resource_version)
                writes += 1
            return True

        try:
            if not self._until_settled(patch_annotations, lambda: self._read(now)):
                return
            if self._condition_needed() and self._desired_cond is not None:
                current = find_condition(self._remote.conditions, self._desired_cond.type)
                item = self._desired_cond.to_patch_item(current, self._wall())
                self._remote = self._api.patch_node_condition(node, item)
                writes += 1
        except ApiFailure as f:
            self._need_read = True  # converge from what the server really has once it answers again
            self._failed(f"writing node {node}", f, self._sched.failed(now, f.retry_after), "write")
            if writes:
                self._update(writes=self.status().writes + writes, last_write_at=self._wall())
            return
        self._sched.succeeded()
        self._recovered()
        if writes:
            self._update(writes=self.status().writes + writes, last_write_at=self._wall())
        self._check_pending(now)  # a change that arrived while the write was in flight stays pending

    def _flush_events(self, now: float) -> None:
        if now < self._ev_blocked_until or self._api is None:
            return
        uid = self._remote.uid if self._remote is not None and self._remote.uid else self.settings.node_name
        ns = self.settings.event_namespace
        for e in self._events.due(now):
            try:
                self._post_event(e, uid, ns, now)
            except ApiFailure as f:
                delay = self._ev_backoff.next_delay(f.retry_after)
                self._ev_blocked_until = now + delay
                self._failed(f"posting Event {e.spec.reason} for {e.spec.device}", f, delay, "event")
                return
            self._ev_backoff.reset()
            self._update(events_written=self.status().events_written + 1)

    def _post_event(self, e: Entry, uid: str, ns: str, now: float) -> None:
        assert self._api is not None
        if not self._events.needs_create(e, now) and e.name is not None:
            try:
                self._api.patch_event(ns, e.name, self._events.patch_body(e))
                self._events.patched(e, now)
                return
            except ApiFailure as f:
                if f.status != 404:
                    raise
                # The Event expired (the API server keeps them an hour by default): start a new one.
        name = self._api.create_event(ns, self._events.create_body(e, uid, ns))
        self._events.created(e, name, now)
