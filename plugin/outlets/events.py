"""Events on the Node for transitions into and out of the bad states, aggregated with a count.

Pure bookkeeping: the reporter (``reporter.py``) feeds transitions in and asks which Events are due; it does the I/O.
One aggregation key is (device, Event reason, reason codes): the same thing happening again within the window bumps
``count`` and ``lastTimestamp`` on the existing Event instead of creating a new one, and a key is written at most once
per ``min_interval_s``, so a device flapping at 10 Hz costs one request per key per interval, not one per flap.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from plugin.health.node_state import ABSENT, Transition
from plugin.health.reasons import State
from plugin.kube.events import Involved, event_body, rfc3339, truncate

BAD_STATES = frozenset({State.DEGRADED.value, State.UNHEALTHY.value, State.UNKNOWN.value})

# Event reason for a transition, by the state it goes to.
_INTO = {State.UNHEALTHY.value: "GPUUnhealthy", State.DEGRADED.value: "GPUDegraded",
         State.UNKNOWN.value: "GPUUnknown", State.HEALTHY.value: "GPURecovered", ABSENT: "GPURemoved"}


@dataclass(frozen=True)
class EventSpec:
    device_id: str
    device: str  # the key name, e.g. gpu.3
    reason: str  # GPUUnhealthy, GPURecovered, ...
    type: str  # Warning or Normal
    codes: tuple[str, ...]
    message: str

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        return (self.device_id, self.reason, self.codes)


def event_for(t: Transition, device: str) -> EventSpec | None:
    """The Event a transition deserves, or None when it neither enters nor leaves a bad state."""
    if t.from_state not in BAD_STATES and t.to_state not in BAD_STATES:
        return None
    reason = _INTO.get(t.to_state, "GPUStateChanged")
    kind = "Warning" if t.to_state in BAD_STATES else "Normal"
    reasons = t.reasons
    codes = tuple(r.code for r in reasons)
    msg = f"{device} ({t.id}): {t.from_state} -> {t.to_state}"
    if reasons:
        top = reasons[0]
        msg += f": {top.code}: {top.message} (action: {top.action})"
        if len(reasons) > 1:
            msg += f"; also {', '.join(codes[1:])}"
    # Cut here, not only in the body: a patch of an aggregated Event carries the message too.
    return EventSpec(t.id, device, reason, kind, codes, truncate(msg))


@dataclass
class Entry:
    spec: EventSpec
    first_time: float  # wall clock of the first occurrence written into this Event
    last_time: float  # wall clock of the latest occurrence
    pending: int = 0  # occurrences not yet on the server
    pending_first: float = 0.0  # wall clock of the first of those
    written: int = 0  # the count the server has
    name: str | None = None  # the Event object's name once created
    created_at: float = -math.inf  # monotonic time of the create (the aggregation window starts there)
    last_flush: float = -math.inf  # monotonic


@dataclass
class EventAggregator:
    node: str
    window_s: float = 600.0
    min_interval_s: float = 10.0
    max_keys: int = 256
    entries: OrderedDict[tuple[str, str, tuple[str, ...]], Entry] = field(default_factory=OrderedDict)

    def observe(self, transitions: Iterable[Transition], names: Mapping[str, str]) -> int:
        """Record transitions; returns how many deserved an Event."""
        n = 0
        for t in transitions:
            spec = event_for(t, names.get(t.id, t.id))
            if spec is None:
                continue
            n += 1
            e = self.entries.get(spec.key)
            if e is None:
                e = Entry(spec, first_time=t.time, last_time=t.time)
                self.entries[spec.key] = e
            else:
                e.spec = spec  # the latest message wins
                e.last_time = t.time
            if not e.pending:
                e.pending_first = t.time
            e.pending += 1
            self.entries.move_to_end(spec.key)
        while len(self.entries) > self.max_keys:
            # Forget the oldest key; if it still had unsent occurrences they are lost, which is what bounding
            # memory under a storm of distinct keys means.
            self.entries.popitem(last=False)
        return n

    def due(self, now: float) -> list[Entry]:
        return [e for e in self.entries.values() if e.pending and now >= e.last_flush + self.min_interval_s]

    def next_due(self) -> float:
        waits = [e.last_flush + self.min_interval_s for e in self.entries.values() if e.pending]
        return min(waits, default=math.inf)

    def needs_create(self, e: Entry, now: float) -> bool:
        return e.name is None or now - e.created_at >= self.window_s

    def create_body(self, e: Entry, node_uid: str, namespace: str) -> dict[str, Any]:
        """A core/v1 Event about the Node (``kubectl describe node`` lists it). ``count`` starts at what is
        pending: a flap seen several times before the first write is one Event with that count."""
        return event_body(Involved("Node", self.node, uid=node_uid), namespace, reason=e.spec.reason,
                          type_=e.spec.type, message=e.spec.message, count=e.pending, first=e.pending_first,
                          last=e.last_time, host=self.node)

    def patch_body(self, e: Entry) -> dict[str, Any]:
        return {"count": e.written + e.pending, "lastTimestamp": rfc3339(e.last_time), "message": e.spec.message}

    def created(self, e: Entry, name: str, now: float) -> None:
        e.name, e.created_at, e.written, e.pending, e.last_flush = name, now, e.pending, 0, now
        e.first_time = e.pending_first

    def patched(self, e: Entry, now: float) -> None:
        e.written += e.pending
        e.pending = 0
        e.last_flush = now
