"""The node state: the one owner of what is true now about every device.

Writers publish whole device lists; the node state diffs them, numbers every state change as a transition, keeps
a bounded history for resuming watchers, and wakes subscribers. Readers get immutable snapshots and never hold the
lock while they do I/O.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from plugin.devices.model import Gpu, MigDevice
from plugin.health.reasons import KubeletHealth, Reason, State, worst_first

ABSENT = "Absent"  # the pseudo-state of a device before it appears and after it is gone


def _ordered(reasons: tuple[Reason, ...]) -> tuple[Reason, ...]:
    return worst_first(reasons) if len(reasons) > 1 else tuple(reasons)


@dataclass(frozen=True)
class Clearance:
    """Reasons taken off a device, and why: a reboot, a reset, the operator (with their note), a passed check."""

    codes: tuple[str, ...]
    why: str
    time: float

    @property
    def text(self) -> str:
        return f"cleared {', '.join(self.codes)}: {self.why}"

    def to_dict(self) -> dict[str, Any]:
        return {"codes": list(self.codes), "why": self.why, "time": self.time}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Clearance:
        return Clearance(tuple(str(c) for c in d["codes"]), str(d["why"]), float(d["time"]))


@dataclass(frozen=True)
class DeviceStatus:
    id: str
    gpu: Gpu  # the physical GPU (a MIG device's parent)
    state: State
    reasons: tuple[Reason, ...]  # worst first (reasons.worst_first), whatever order the writer gave
    since: float
    kubelet_health: KubeletHealth
    mig: MigDevice | None = None
    cleared: Clearance | None = None  # the device's latest clearance; a new one is a transition of its own

    def __post_init__(self) -> None:
        # Ordered where it is published, once: annotations, Events, the condition, DRA, the health API and the CLI
        # all read reasons[0] as the worst, and none of them sorts.
        object.__setattr__(self, "reasons", _ordered(self.reasons))

    @property
    def parent_id(self) -> str:
        return self.gpu.uuid


@dataclass(frozen=True)
class Transition:
    seq: int
    id: str
    from_state: str
    to_state: str
    reasons: tuple[Reason, ...]  # worst first, as in DeviceStatus (a saved one may predate the order)
    time: float
    # Why reasons left the device, when a clearance caused this transition ("cleared xid-79: node rebooted"). A
    # clearance that leaves the state as it was is a transition too (from == to), so the history keeps it.
    note: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "reasons", _ordered(self.reasons))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"seq": self.seq, "id": self.id, "from": self.from_state, "to": self.to_state,
                             "reasons": [r.to_dict() for r in self.reasons], "time": self.time}
        if self.note:
            d["note"] = self.note
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Transition:
        return Transition(seq=int(d["seq"]), id=str(d["id"]), from_state=str(d["from"]), to_state=str(d["to"]),
                          reasons=tuple(Reason.from_dict(r) for r in d.get("reasons", [])), time=float(d["time"]),
                          note=str(d.get("note", "")))


@dataclass(frozen=True)
class Snapshot:
    version: int
    seq: int
    devices: tuple[DeviceStatus, ...]
    backend_error: str | None = None
    by_id: dict[str, DeviceStatus] = field(default_factory=dict, compare=False, repr=False)
    # The node's own reasons, no device's (gpu-missing: a GPU on the bus that NVML does not list), worst first.
    node_reasons: tuple[Reason, ...] = ()

    def get(self, device_id: str) -> DeviceStatus | None:
        return self.by_id.get(device_id)


def _make_snapshot(version: int, seq: int, devices: Iterable[DeviceStatus], error: str | None,
                   node_reasons: tuple[Reason, ...] = ()) -> Snapshot:
    devs = tuple(devices)
    return Snapshot(version, seq, devs, error, {d.id: d for d in devs}, node_reasons)


def _keep_since(d: DeviceStatus, before: DeviceStatus | None) -> DeviceStatus:
    if before is not None and before.state == d.state and before.since != d.since:
        return replace(d, since=before.since)
    return d


class NodeState:
    def __init__(self, history: int = 1024) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._history: deque[Transition] = deque(maxlen=history)
        self._seq = 0
        self._snapshot = _make_snapshot(0, 0, (), None)
        self._closed = False

    # Writers --------------------------------------------------------------------------------------------------

    def publish(self, devices: Iterable[DeviceStatus], now: float, backend_error: str | None = None,
                node_reasons: tuple[Reason, ...] = ()) -> list[Transition]:
        """Replace the device list and the node's own reasons. Bumps the version only when something a reader can
        see changed. The node's reasons make no transition: no device moved (the outlets that speak of the node,
        its annotations, condition and Events, read them from the snapshot)."""
        node_reasons = _ordered(node_reasons)
        with self._cond:
            old = self._snapshot
            # ``since`` is when a device entered its current state: while the state holds, the first value stays,
            # whatever a writer computes now (outlets diff on it, so a moving ``since`` would be a write per poll).
            devs = tuple(_keep_since(d, old.by_id.get(d.id)) for d in devices)
            if devs == old.devices and backend_error == old.backend_error and node_reasons == old.node_reasons:
                return []
            new_ids = {d.id for d in devs}
            transitions: list[Transition] = []
            for d in devs:
                before = old.by_id.get(d.id)
                prev = before.state.value if before else ABSENT
                # Clearances are made in this process (never restored), so one new to the snapshot happened now,
                # also on a device's first appearance (a reboot's clearance comes with the first poll).
                note = d.cleared.text if d.cleared is not None and (before is None or before.cleared != d.cleared) \
                    else ""
                if prev != d.state.value or note:
                    self._seq += 1
                    transitions.append(Transition(self._seq, d.id, prev, d.state.value, d.reasons, now, note))
            for d in old.devices:
                if d.id not in new_ids:
                    self._seq += 1
                    transitions.append(Transition(self._seq, d.id, d.state.value, ABSENT, (), now))
            self._history.extend(transitions)
            self._snapshot = _make_snapshot(old.version + 1, self._seq, devs, backend_error, node_reasons)
            self._cond.notify_all()
            return transitions

    def restore_history(self, transitions: Iterable[Transition]) -> None:
        """Seed the history from the state dir so sequence numbers keep growing across restarts."""
        with self._cond:
            for t in transitions:
                self._history.append(t)
                self._seq = max(self._seq, t.seq)
            s = self._snapshot
            self._snapshot = _make_snapshot(s.version, self._seq, s.devices, s.backend_error)

    def close(self) -> None:
        """Wake every waiter for good: streams end when the process stops."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # Readers --------------------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def snapshot(self) -> Snapshot:
        return self._snapshot  # replaced whole under the lock; reading a reference needs none

    def wait_for_change(self, since_version: int, timeout: float | None,
                        abort: Callable[[], bool] | None = None) -> Snapshot:
        """Return a snapshot newer than ``since_version``, or the current one after ``timeout``, on close, or
        once ``abort()`` is true (checked whenever someone calls ``poke``)."""
        with self._cond:
            self._cond.wait_for(lambda: self._snapshot.version != since_version or self._closed
                                or (abort is not None and abort()), timeout)
            return self._snapshot

    def follow(self, since_version: int, until: Callable[[], bool],
               recheck_s: float = 1.0) -> Iterator[Snapshot]:
        """A stream's view of the state: the snapshot at every wake-up (at once if newer than ``since_version``,
        then after each publish, and every ``recheck_s`` anyway) until ``until()`` holds or the state closes.

        After a recheck the snapshot may be the one yielded last: each stream decides what is news to its client.
        ``until`` is re-checked whenever someone calls ``poke``, so whoever makes it true must poke; the recheck
        only bounds a missed wake-up.
        """
        version = since_version
        while True:
            snap = self.wait_for_change(version, recheck_s, abort=until)
            if until() or self._closed:
                return
            version = snap.version
            yield snap

    def poke(self) -> None:
        """Wake waiters so they re-check their abort condition (a stream's client left, a server stops)."""
        with self._cond:
            self._cond.notify_all()

    def transitions_since(self, seq: int) -> list[Transition] | None:
        """Transitions after ``seq``; None when ``seq`` is older than the bounded history (resync needed)."""
        with self._cond:
            if seq > self._seq:
                return None  # a number from a future we never issued (another epoch): resync
            if seq == self._seq:
                return []
            if not self._history or self._history[0].seq > seq + 1:
                return None
            return [t for t in self._history if t.seq > seq]

    def history(self) -> list[Transition]:
        with self._cond:
            return list(self._history)
