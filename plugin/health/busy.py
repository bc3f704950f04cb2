"""GPUs busy with no pod: compute processes NVML lists on a GPU that no running container holds, for longer than a
grace period (a leaked or orphaned job, the classic "my pod got a GPU that is already full").

Per GPU, on the monitor's clock: the streak starts at the first poll that shows processes (other than the ignored
names, such as the MPS server); once it has lasted the grace, the holders are asked (the kubelet's PodResources API,
or in DRA mode the prepared claims). Held: a pod's work, and the question is asked again a grace later. Held by
nobody: the reason ``busy-unallocated`` (Degraded), asked again every ``recheck_s`` (a pod may be given the GPU).
Gone as soon as a poll shows no such process. The holders are asked only then, so a node whose GPUs all run pods'
work costs one question per busy GPU per grace period, and an idle node none.

A holder that cannot answer counts as holding: "cannot tell" is never reported as busy with no pod. The message is
made when the reason is raised and again only when the set of processes changes, never for the memory they use
growing, so a steady leak is one write.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from plugin.devices.model import ComputeProcess
from plugin.health.reasons import SPECS, Condition, Reason, Source

CODE = "busy-unallocated"


@dataclass
class _Streak:
    since: float
    ask_at: float  # when the holders are asked next
    pids: frozenset[int] = frozenset()
    reason: Reason | None = None


class BusyWatch:
    def __init__(self, grace_s: float, ignore: Iterable[str] = (), recheck_s: float = 60.0) -> None:
        self.grace_s = grace_s
        self.ignore = frozenset(ignore)
        self.recheck_s = recheck_s
        self._streaks: dict[str, _Streak] = {}
        self.asked = 0  # holder questions asked, for tests and the log

    def reason(self, uuid: str) -> Reason | None:
        s = self._streaks.get(uuid)
        return s.reason if s is not None else None

    def forget(self, uuid: str) -> None:
        self._streaks.pop(uuid, None)

    def observe(self, uuid: str, processes: tuple[ComputeProcess, ...] | None, now: float,
                holder: Callable[[], str]) -> Reason | None:
        """Feed one poll's processes of GPU ``uuid`` (None: not read); ``holder()`` says who holds the GPU ("" for
        nobody) and is called only when the answer is due. Returns the GPU's reason now."""
        procs = [p for p in processes or () if p.name not in self.ignore]
        if not procs:
            self._streaks.pop(uuid, None)
            return None
        s = self._streaks.get(uuid)
        if s is None:
            s = self._streaks[uuid] = _Streak(since=now, ask_at=now + self.grace_s)
        if now < s.ask_at:
            return self._refresh(s, procs)
        self.asked += 1
        held_by = holder()
        if held_by:
            s.reason, s.pids = None, frozenset()
            s.since, s.ask_at = now, now + self.grace_s  # a pod's work: ask again a grace later
            return None
        s.ask_at = now + self.recheck_s
        if s.reason is None:
            s.reason = Reason.of(_condition(procs, now - s.since), now)
            s.pids = frozenset(p.pid for p in procs)
        return self._refresh(s, procs)

    def _refresh(self, s: _Streak, procs: list[ComputeProcess]) -> Reason | None:
        if s.reason is not None and frozenset(p.pid for p in procs) != s.pids:
            s.pids = frozenset(p.pid for p in procs)
            fresh = _condition(procs, s.reason.first_seen - s.since)
            s.reason = Reason.of(fresh, s.reason.first_seen)
        return s.reason


def _condition(procs: list[ComputeProcess], held_for_s: float) -> Condition:
    spec = SPECS[CODE]
    used = [p.used_mib for p in procs if p.used_mib is not None]
    names = ", ".join(sorted({p.name or f"pid {p.pid}" for p in procs})[:5])
    memory = f" using {sum(used)} MiB" if used else ""
    n = len(procs)
    held = f"{held_for_s / 60:.0f} min" if held_for_s >= 60 else f"{held_for_s:.1f} s"
    message = f"{n} process{'' if n == 1 else 'es'} ({names}){memory} on a GPU no pod holds, for {held}"
    return Condition(CODE, spec.severity, message, Source.POLL, spec.action)

