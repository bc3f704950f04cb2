"""Events on the Node for transitions into and out of the bad states: one per node and burst, aggregated with a count.

Pure bookkeeping: the reporter (``reporter.py``) feeds transitions in and asks which Events are due; it does the I/O.

A burst: transitions of a node's devices with the same Event reason and the same reason codes that arrive within
``burst_s`` (the reporter passes its annotation debounce, ``--report-debounce``, 1 s by default) of the first one are
one Event. A driver reload takes a node's 8 GPUs Unknown within half a second; that is one ``GPUUnknown`` Event
naming the 8 (``8 GPUs (gpu.0, ..., gpu.7): Healthy -> Unknown: ...``), not 8 Events, as the annotations are one
PATCH. A device alone in its burst gets the per-device Event it always had, message for message. The price is the
wait: a burst's Event goes out ``burst_s`` after its first transition (the window has to close before we know who
is in it), so the first Event of a fault comes up to 1 s later than the transition, as the annotations do.

A clearance (a reboot, a GPU reset, the operator's ``clear``, a passed recovery check) rides on its transition as a
note: a transition that also changes the state carries the note at the end of its message; one that leaves the
state as it was (Unhealthy -> Unhealthy, with one reason fewer), or a device that appears already cleared, is a Normal
``GPUFaultCleared`` Event naming the device, what was cleared and why (the operator's note is in that text). Notes
are part of the burst and aggregation keys: two different clearances are never folded into one Event.

A burst is closed for good when its window ends: a device failing later opens a burst of its own (its own Event, or
a group Event with the devices that fail with it), so an Event already posted is never re-sent nor counted again.

One aggregation key is (Event reason, reason codes, the set of devices): the same thing happening again within the
window (the same devices again, or the same device alone) bumps ``count`` and ``lastTimestamp`` on the existing
Event instead of creating a new one, and a key is written at most once per ``min_interval_s``, so a device flapping
at 10 Hz costs one request per key per interval, not one per flap. A burst counts as often as its most frequent
device moved in it: once for a rollout's 8 GPUs, 3 times for one GPU that flapped 3 times within the window.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from plugin.health.node_state import ABSENT, Transition
from plugin.health.reasons import Reason, State
from plugin.kube.events import Involved, event_body, rfc3339, truncate

BAD_STATES = frozenset({State.DEGRADED.value, State.UNHEALTHY.value, State.UNKNOWN.value})

# Event reason for a transition, by the state it goes to.
_INTO = {State.UNHEALTHY.value: "GPUUnhealthy", State.DEGRADED.value: "GPUDegraded",
         State.UNKNOWN.value: "GPUUnknown", State.HEALTHY.value: "GPURecovered", ABSENT: "GPURemoved"}

# Characters of a group message spent on device names: the rest of the 1,024 is for what happened.
NAMES_BUDGET = 240

CLEARED = "GPUFaultCleared"  # the Event reason of a clearance that changed no state

# The node's own reasons (a GPU missing from NVML) as a transition of this pseudo-device, made by the reporter when
# they change (never in the node state's history: no device moved). Its Events have reasons of their own.
NODE_ID = "node"
_NODE_INTO = {"gpu-missing": "GPUMissing"}
_NODE_OUT = {"gpu-missing": "GPUMissingResolved"}

Key = tuple[str, tuple[str, ...], frozenset[str], str]  # (reason, codes, device ids, note)


@dataclass(frozen=True)
class EventSpec:
    """The Event one transition deserves, as if it were alone."""

    device_id: str
    device: str  # the key name, e.g. gpu.3
    reason: str  # GPUUnhealthy, GPURecovered, ...
    type: str  # Warning or Normal
    codes: tuple[str, ...]
    message: str
    note: str = ""  # the clearance that caused the transition, "" for any other


def _detail(reasons: tuple[Reason, ...]) -> str:
    if not reasons:
        return ""
    top = reasons[0]
    out = f": {top.code}: {top.message} (action: {top.action})"
    if len(reasons) > 1:
        out += f"; also {', '.join(r.code for r in reasons[1:])}"
    return out


def event_for(t: Transition, device: str) -> EventSpec | None:
    """The Event a transition deserves, or None when it neither enters nor leaves a bad state nor clears a fault."""
    codes = tuple(r.code for r in t.reasons)
    changed = t.from_state != t.to_state and (t.from_state in BAD_STATES or t.to_state in BAD_STATES)
    if not changed:
        if not t.note:
            return None
        # A clearance that moved no state (or a device that appeared cleared, after a reboot): still news, and
        # good news, so Normal. What is left on the device follows, so nobody reads it as healthy when it is not.
        left = f"; still {t.to_state}{_detail(t.reasons)}" if t.to_state in BAD_STATES else ""
        return EventSpec(t.id, device, CLEARED, "Normal", codes, truncate(f"{device} ({t.id}): {t.note}{left}"),
                         t.note)
    reason = _INTO.get(t.to_state, "GPUStateChanged")
    kind = "Warning" if t.to_state in BAD_STATES else "Normal"
    msg = f"{device} ({t.id}): {t.from_state} -> {t.to_state}{_detail(t.reasons)}{_noted(t.note)}"
    if t.id == NODE_ID:
        # The reasons are the ones it has after (entering) or had before (leaving, carried in ``note``'s place).
        code = (t.reasons[0].code if t.reasons else t.note)
        reason = (_NODE_INTO if kind == "Warning" else _NODE_OUT).get(code, "GPUNodeStateChanged")
        msg = f"node: {t.from_state} -> {t.to_state}{_detail(t.reasons)}"
        return EventSpec(t.id, device, reason, kind, codes, truncate(msg))
    # Cut here, not only in the body: a patch of an aggregated Event carries the message too.
    return EventSpec(t.id, device, reason, kind, codes, truncate(msg), t.note)


def _noted(note: str) -> str:
    return f" ({note})" if note else ""


@dataclass(frozen=True)
class GroupSpec:
    """What one aggregated Event says: one device's transitions, or a burst of several devices' alike ones."""

    reason: str
    type: str
    codes: tuple[str, ...]
    device_ids: frozenset[str]
    devices: tuple[str, ...]  # key names, gpu.2 before gpu.10
    message: str
    note: str = ""

    @property
    def key(self) -> Key:
        return (self.reason, self.codes, self.device_ids, self.note)

    @property
    def device(self) -> str:
        """The devices for a log line."""
        return name_list(self.devices)


_NUMBERED = re.compile(r"^(.*\D|)(\d+)$")


def _natural(name: str) -> tuple[str, int, str]:
    """gpu.2 before gpu.10; a name whose number has leading zeros (a hash) sorts and stays as it is."""
    m = _NUMBERED.match(name)
    if m is None or str(int(m.group(2))) != m.group(2):
        return (name, -1, name)
    return (m.group(1), int(m.group(2)), name)


def name_list(names: Iterable[str], budget: int = NAMES_BUDGET) -> str:
    """Device names for a message, within ``budget`` characters: all of them when they fit, else runs of 3 or more
    collapsed (``gpu.0-7``), else as many as fit and how many more."""
    ordered = sorted(set(names), key=_natural)
    text = ", ".join(ordered)
    if len(text) <= budget:
        return text
    parts: list[tuple[str, int]] = []  # (text, how many devices it names)
    i = 0
    while i < len(ordered):
        prefix, n, _ = _natural(ordered[i])
        j = i
        while n >= 0 and j + 1 < len(ordered) and _natural(ordered[j + 1])[:2] == (prefix, n + j + 1 - i):
            j += 1
        if j - i >= 2:
            parts.append((f"{ordered[i]}-{n + j - i}", j - i + 1))
        else:
            parts += [(x, 1) for x in ordered[i:j + 1]]
        i = j + 1
    text = ", ".join(p for p, _ in parts)
    if len(text) <= budget:
        return text
    shown: list[str] = []
    covered = 0
    for p, k in parts:
        rest = len(ordered) - covered - k
        if shown and len(", ".join([*shown, p]) + f", ... and {rest} more") > budget:
            break
        shown.append(p)
        covered += k
    rest = len(ordered) - covered
    return ", ".join(shown) + (f", ... and {rest} more" if rest else "")


@dataclass
class Member:
    """One device in an open burst."""

    spec: EventSpec  # of its latest transition in the burst: the latest message wins, as within a key
    from_state: str
    to_state: str
    reasons: tuple[Reason, ...]
    seq: int  # of that transition: the latest member is the one with the highest
    count: int = 1


@dataclass
class Burst:
    opened: float  # monotonic: the window closes at opened + burst_s
    first: float  # wall clock of its first transition
    last: float  # wall clock of its latest
    members: dict[str, Member] = field(default_factory=dict)  # by device id

    def spec(self) -> GroupSpec:
        ms = sorted(self.members.values(), key=lambda m: _natural(m.spec.device))
        one = ms[0].spec
        ids = frozenset(self.members)
        names = tuple(m.spec.device for m in ms)
        if len(ms) == 1:
            return GroupSpec(one.reason, one.type, one.codes, ids, names, one.message, one.note)
        latest = max(ms, key=lambda m: m.seq)
        if one.reason == CLEARED:
            # One clearance of several devices (a reboot, clear --all): the note once, then what is left.
            msg = f"{len(ms)} GPUs ({name_list(names)}): {one.note}"
            if any(m.to_state in BAD_STATES for m in ms):
                msg += f"; still {_states(ms, 'to_state')}"
        else:
            msg = f"{len(ms)} GPUs ({name_list(names)}): {_states(ms, 'from_state')} -> {_states(ms, 'to_state')}"
        details = {_detail(m.reasons) for m in ms}
        if len(details) == 1:
            msg += details.pop()
        else:
            # Same codes, different words (an error count, a temperature): show one and say whose, never a blend.
            msg += f"{_detail(latest.reasons)} (as on {latest.spec.device}; the GPUs' messages differ)"
        if one.reason != CLEARED:
            msg += _noted(one.note)
        return GroupSpec(one.reason, one.type, one.codes, ids, names, truncate(msg), one.note)


def _states(ms: list[Member], attr: str) -> str:
    """The one state they share, or each state with its devices: a group never claims a state some did not have."""
    by: dict[str, list[str]] = {}
    for m in ms:
        by.setdefault(getattr(m, attr), []).append(m.spec.device)
    if len(by) == 1:
        return next(iter(by))
    return ", ".join(f"{s} ({name_list(d, NAMES_BUDGET // len(by))})" for s, d in by.items())


@dataclass
class Entry:
    spec: GroupSpec
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
    burst_s: float = 1.0  # the reporter's debounce_s
    entries: OrderedDict[Key, Entry] = field(default_factory=OrderedDict)
    bursts: OrderedDict[tuple[str, tuple[str, ...], str], Burst] = field(default_factory=OrderedDict)

    def observe(self, transitions: Iterable[Transition], names: Mapping[str, str], now: float) -> int:
        """Record transitions seen at monotonic ``now``; returns how many deserved an Event."""
        self._close(now)
        n = 0
        for t in transitions:
            spec = event_for(t, names.get(t.id, t.id))
            if spec is None:
                continue
            n += 1
            group = (spec.reason, spec.codes, spec.note)
            b = self.bursts.get(group)
            if b is None:
                b = self.bursts[group] = Burst(opened=now, first=t.time, last=t.time)
            b.last = max(b.last, t.time)
            m = b.members.get(t.id)
            if m is None:
                b.members[t.id] = Member(spec, t.from_state, t.to_state, t.reasons, t.seq)
            else:
                m.spec, m.from_state, m.to_state, m.reasons, m.seq = spec, t.from_state, t.to_state, t.reasons, t.seq
                m.count += 1
        while len(self.bursts) > self.max_keys:
            # Close the oldest early rather than drop it: its devices are still told, only in a smaller group.
            self._fold(self.bursts.popitem(last=False)[1])
        self._trim()
        return n

    def _close(self, now: float) -> None:
        for group in [g for g, b in self.bursts.items() if now >= b.opened + self.burst_s]:
            self._fold(self.bursts.pop(group))
        self._trim()

    def _fold(self, b: Burst) -> None:
        spec = b.spec()
        count = max(m.count for m in b.members.values())
        e = self.entries.get(spec.key)
        if e is None:
            e = self.entries[spec.key] = Entry(spec, first_time=b.first, last_time=b.last)
        else:
            e.spec = spec  # the latest message wins
            e.last_time = b.last
        if not e.pending:
            e.pending_first = b.first
        e.pending += count
        self.entries.move_to_end(spec.key)

    def _trim(self) -> None:
        while len(self.entries) > self.max_keys:
            # Forget the oldest key; if it still had unsent occurrences they are lost, which is what bounding
            # memory under a storm of distinct keys means.
            self.entries.popitem(last=False)

    def due(self, now: float) -> list[Entry]:
        self._close(now)
        return [e for e in self.entries.values() if e.pending and now >= e.last_flush + self.min_interval_s]

    def next_due(self) -> float:
        waits = [e.last_flush + self.min_interval_s for e in self.entries.values() if e.pending]
        waits += [b.opened + self.burst_s for b in self.bursts.values()]
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
