"""Per-device state machine: turns conditions over time into a state with reasons.

Polled conditions clear after ``clear_after_polls`` clean polls in a row; rate conditions (a counter growing too fast)
also stay for ``rate_hold_s`` after they were last seen. Event conditions are latched until the GPU
is seen reset or their hold time passes. A device that changes state too often holds its worst recent state for a
back-off period. Time always comes in as an argument, so tests drive a fake clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

from plugin.devices.model import GpuEvent, Reading
from plugin.health.config import HealthConfig
from plugin.health.policy import RATE_CODES, Disposition, classify_event, condition, evaluate_reading
from plugin.health.reasons import SPECS, Condition, Reason, Source, State


class Verdict(NamedTuple):
    state: State
    reasons: tuple[Reason, ...]  # one per code; the DeviceStatus they are published in puts them worst first


@dataclass
class _Polled:
    reason: Reason
    last_seen: float
    clean_polls: int = 0


@dataclass
class _Latched:
    reason: Reason
    last_seen: float


class DeviceTracker:
    def __init__(self, device_id: str, cfg: HealthConfig) -> None:
        self.device_id = device_id
        self.cfg = cfg
        self._polled: dict[str, _Polled] = {}
        self._latched: dict[str, _Latched] = {}
        self._app_xids: dict[int, deque[float]] = {}
        self._error_streak = 0
        self._previous: Reading | None = None
        # Only whether there were more than flap_max changes matters, so that many entries are all we keep.
        self._changes: deque[tuple[float, State]] = deque(maxlen=cfg.flap_max + 1)
        self._backoff_until = 0.0
        self._held = State.HEALTHY
        self.state = State.HEALTHY
        self.since = 0.0

    # Observations ---------------------------------------------------------------------------------------------

    def observe_reading(self, reading: Reading) -> bool:
        """Feed one poll. Returns True when it showed the GPU was reset (which clears latches)."""
        now = reading.time
        reset_seen = self._reset_seen(reading)
        if reset_seen:
            self.clear_latches()
        if reading.errors and not reading.lost:
            self._error_streak += 1
            found = evaluate_reading(reading, None, self.cfg)
            if self._error_streak >= self.cfg.nvml_error_polls:
                what = ", ".join(sorted({s for s, _ in reading.errors}))
                first = reading.errors[0][1]
                found.append(condition("nvml-error",
                                       f"NVML failed {self._error_streak} polls in a row ({what}: {first})",
                                       Source.POLL))
            # A failed read says nothing about signals we could not see: keep what was active, only add.
            for c in found:
                self._raise_polled(c, now)
            return reset_seen
        self._error_streak = 0
        found = evaluate_reading(reading, self._previous, self.cfg)
        self._previous = reading if not reading.lost else None
        seen = {c.code for c in found}
        for c in found:
            self._raise_polled(c, now)
        for code in list(self._polled):
            if code in seen:
                continue
            p = self._polled[code]
            p.clean_polls += 1
            if p.clean_polls >= self.cfg.clear_after_polls and not self._rate_held(p, now):
                del self._polled[code]
        return reset_seen

    def _rate_held(self, p: _Polled, now: float) -> bool:
        # A rate rule only fires while a counter grows, so a burst would vanish a few polls after it ends; hold it
        # for a while so operators (and preferred allocation) still see the link or memory that just misbehaved.
        return p.reason.code in RATE_CODES and now - p.last_seen < self.cfg.rate_hold_s

    def _raise_polled(self, c: Condition, now: float) -> None:
        p = self._polled.get(c.code)
        if p is None:
            self._polled[c.code] = _Polled(Reason.of(c, now), now)
        else:
            # Keep first_seen, refresh the message (counts change), restart the clean-poll count.
            p.reason = Reason.of(c, p.reason.first_seen)
            p.last_seen = now
            p.clean_polls = 0

    def _reset_seen(self, reading: Reading) -> bool:
        if "gpu-lost" in self._polled and not reading.lost and not reading.errors:
            # A lost GPU answering again was reset (or the node rebooted).
            del self._polled["gpu-lost"]
            return True
        prev = self._previous
        if prev is None:
            return False
        # The driver's recovery action returning to none means the reset it asked for happened.
        return prev.recovery_action not in (None, "none") and reading.recovery_action == "none"

    def observe_event(self, event: GpuEvent) -> Disposition:
        """Feed one driver event; returns the policy's disposition (``POLL`` asks the caller to poll now)."""
        disposition, c = classify_event(event, self.cfg)
        now = event.time
        if disposition == Disposition.LATCH and c is not None:
            self._latch(c, now)
        elif disposition == Disposition.COUNT and c is not None:
            times = self._app_xids.setdefault(event.code, deque())
            times.append(now)
            while times and times[0] < now - self.cfg.app_xid_window_s:
                times.popleft()
            if len(times) >= self.cfg.app_xid_repeat_threshold:
                msg = (f"XID {event.code} seen {len(times)} times within "
                       f"{self.cfg.app_xid_window_s / 3600:g} h on this GPU")
                self._latch(Condition(c.code, c.severity, msg, c.source, c.action), now)
        return disposition

    def _latch(self, c: Condition, now: float) -> None:
        old = self._latched.get(c.code)
        first = old.reason.first_seen if old else now
        self._latched[c.code] = _Latched(Reason.of(c, first), now)

    def clear_latches(self) -> None:
        """The GPU was seen reset (or re-appeared): event-born conditions no longer hold."""
        self._latched.clear()
        self._app_xids.clear()
        self._previous = None

    def _expire(self, now: float) -> None:
        for code, latched in list(self._latched.items()):
            hold = self.cfg.latch_hold_s.get(latched.reason.severity)
            if hold is not None and now - latched.last_seen >= hold:
                del self._latched[code]

    # Verdict --------------------------------------------------------------------------------------------------

    def update(self, now: float) -> Verdict:
        """Advance to ``now`` and return the verdict there: expire latches, record a state change for flap damping
        (tripping or ending the back-off), and move ``state`` and ``since``. The one place any of that happens."""
        self._expire(now)
        reasons = self._merged()
        state = State.worst(*(r.severity for r in reasons))
        while self._changes and self._changes[0][0] < now - self.cfg.flap_window_s:
            self._changes.popleft()
        if self._backoff_until and now >= self._backoff_until:
            # The back-off served its purpose; counting the changes that caused it again would re-trip it at once.
            self._changes.clear()
            self._backoff_until = 0.0
        if now < self._backoff_until and self._held.rank > state.rank:
            reasons.append(self._flapping(self._backoff_until - self.cfg.flap_backoff_s))
            state = self._held
        if state != self.state:
            self._changes.append((now, self.state))
            if len(self._changes) > self.cfg.flap_max:
                self._held = State.worst(state, *(s for _, s in self._changes))
                self._backoff_until = now + self.cfg.flap_backoff_s
                if self._held.rank > state.rank:
                    reasons.append(self._flapping(now))
                    state = self._held
            if state != self.state:
                self.state = state
                self.since = now
        if not self.since:
            # First verdict of a device that starts Healthy: it has been in this state since it was first seen,
            # and that instant must not move with every poll (outlets diff on it).
            self.since = now
        return Verdict(self.state, tuple(reasons))

    def _merged(self) -> list[Reason]:
        """Latched and polled reasons, one per code at its worst severity and earliest first_seen."""
        merged: dict[str, Reason] = {}
        for r in [lt.reason for lt in self._latched.values()] + [p.reason for p in self._polled.values()]:
            have = merged.get(r.code)
            if have is None or r.severity.rank > have.severity.rank:
                merged[r.code] = r if have is None else Reason(r.code, r.severity, r.message, r.source, r.action,
                                                               min(r.first_seen, have.first_seen))
        return list(merged.values())

    def _flapping(self, first_seen: float) -> Reason:
        # The table gives the action; the severity is the state held, which is the point of the reason.
        return Reason("flapping", self._held,
                      f"changed state {len(self._changes)} times in {self.cfg.flap_window_s / 60:g} min; "
                      f"holding {self._held.value}", Source.POLL, SPECS["flapping"].action, first_seen)

    # Persistence: only what must survive a restart (a poll re-derives the rest) -----------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "latched": [{**lt.reason.to_dict(), "last_seen": lt.last_seen} for lt in self._latched.values()],
            # Rate conditions cannot be re-derived by a poll after a restart (the counter no longer grows), so the
            # ones still held are kept like latches, until their hold window ends.
            "rate_held": [{**p.reason.to_dict(), "last_seen": p.last_seen}
                          for p in self._polled.values() if p.reason.code in RATE_CODES],
            "app_xids": {str(k): list(v) for k, v in self._app_xids.items()},
            "backoff_until": self._backoff_until,
            "held": self._held.value,
            "state": self.state.value,
            "since": self.since,
        }

    def load(self, d: dict[str, Any]) -> None:
        for item in d.get("latched", []):
            r = Reason.from_dict(item)
            self._latched[r.code] = _Latched(r, float(item.get("last_seen", r.first_seen)))
        for item in d.get("rate_held", []):
            r = Reason.from_dict(item)
            # Restored as already clean: only the hold window keeps it, and a new burst refreshes it.
            self._polled[r.code] = _Polled(r, float(item.get("last_seen", r.first_seen)), self.cfg.clear_after_polls)
        for k, v in d.get("app_xids", {}).items():
            self._app_xids[int(k)] = deque(float(t) for t in v)
        self._backoff_until = float(d.get("backoff_until", 0.0))
        self._held = State(d.get("held", State.HEALTHY.value))
        self.state = State(d.get("state", State.HEALTHY.value))
        self.since = float(d.get("since", 0.0))
