"""The probes: ``/healthz`` says whether the process's loops are alive, ``/readyz`` whether it is registered."""

from __future__ import annotations

import time
from collections.abc import Callable

from plugin.outlets.metrics.sources import HealthLoops, SupervisorLoop


class Probes:
    """``/healthz``: the process, its health loops and the supervisor loop are alive. The event loop goes round
    every fraction of a second and the poller once per interval; either falling behind by more than ``stall_s``
    means a stuck thread (a hung driver call, a deadlock), which only a restart fixes, as does a supervisor loop
    that died. ``/readyz``: registered with the kubelet."""

    def __init__(self, monitor: HealthLoops | None, supervisor: SupervisorLoop | None, stall_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.monitor = monitor
        self.supervisor = supervisor
        self.stall_s = stall_s
        self.clock = clock

    def liveness(self) -> tuple[bool, str]:
        # A dead supervisor loop never re-registers after a kubelet restart: only a pod restart brings it back.
        dead = self.supervisor.failure() if self.supervisor is not None else None
        if dead is not None:
            return False, f"supervisor loop died: {dead}"
        m = self.monitor
        if m is None:
            return True, "ok: no health loops configured"
        now = self.clock()
        problems: list[str] = []
        notes: list[str] = []
        for loop, last, limit in (("poll", m.last_poll_at, m.poll_interval_s + self.stall_s),
                                  ("events", m.last_event_loop_at, self.stall_s)):
            if last <= 0:
                problems.append(f"{loop} loop has not run yet")
                continue
            age = now - last
            if age > limit:
                problems.append(f"{loop} loop stalled: last ran {age:.1f}s ago (limit {limit:.1f}s)")
            else:
                notes.append(f"{loop} loop ran {max(age, 0.0):.1f}s ago")
        if problems:
            return False, "; ".join(problems)
        return True, "ok: " + "; ".join(notes)

    def readiness(self) -> tuple[bool, str]:
        sup = self.supervisor
        if sup is None:
            return False, "not registered: no kubelet supervisor"
        rec = sup.record
        if rec.registered:
            return True, f"ok: registered with the kubelet ({rec.registrations} registrations)"
        why = f": {rec.last_error}" if rec.last_error else ""
        return False, f"not registered with the kubelet{why}"
