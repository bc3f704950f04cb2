"""Per-device state machine: turns conditions over time into a state with reasons.

Polled conditions clear after ``clear_after_polls`` clean polls in a row; rate conditions (a counter growing too fast)
also stay for ``rate_hold_s`` after they were last seen. Event conditions are latched until what their row of the
reason table says clears them (``reasons.clears_for``): a reset seen, a reboot (another boot id at start and a clean
read), their hold time, the operator. With a recovery check configured, a latch about to clear waits for the check
instead. A device that changes state too often holds its worst recent state for a back-off period. Time always comes
in as an argument, so tests drive a fake clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

from plugin.devices.model import GpuEvent, Reading
from plugin.health.config import HealthConfig
from plugin.health.node_state import Clearance
from plugin.health.policy import RATE_CODES, Disposition, classify_event, condition, evaluate_reading
from plugin.health.reasons import SPECS, Action, Clear, Condition, Reason, Source, State, clears_for

# The driver's recovery actions that ask for a reset: their return to none means the reset happened.
_RESET_ACTIONS = frozenset({"gpu_reset", "drain_and_reset", "bus_reset"})
# What a GPU must not show for a reboot to count as having mended it.
_NOT_MENDED = frozenset({Action.RESET_GPU, Action.REBOOT_NODE})


class ClearRefused(Exception):
    """An operator's clear that cannot be done; the message is one line for them."""


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
    boot_id: str = ""  # the node's boot when it was (last) set: a reboot is another boot id


class DeviceTracker:
    def __init__(self, device_id: str, cfg: HealthConfig, boot_id: str = "", gated: bool = False) -> None:
        self.device_id = device_id
        self.cfg = cfg
        self.boot_id = boot_id
        # With a recovery check: latches about to clear wait in _awaiting (with why) until check_result.
        self.gated = gated
        self._awaiting: dict[str, Reason] = {}
        self._awaiting_why = ""
        self._awaiting_since = 0.0
        self._reboot_pending = False  # latches from another boot wait for the first good read
        self.lost = False
        self.cleared: Clearance | None = None  # the latest clearance, for the outlets
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

    def observe_reading(self, reading: Reading) -> tuple[tuple[Clear, str], ...]:
        """Feed one poll. Returns what it showed clearing latches (a reset seen, a reboot judged), with why, so the
        caller can apply the same to the GPU's MIG devices."""
        now = reading.time
        applied: list[tuple[Clear, str]] = []
        reset_why = self._reset_seen(reading)
        if reset_why:
            self.clear_by(Clear.RESET, reset_why, now)
            applied.append((Clear.RESET, reset_why))
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
            return tuple(applied)
        self._error_streak = 0
        self.lost = reading.lost
        found = evaluate_reading(reading, self._previous, self.cfg)
        if self._reboot_pending and not reading.lost:
            applied.extend(self._judge_reboot(found, now))
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
        return tuple(applied)

    def judge_reboot(self, reading: Reading) -> bool:
        """A MIG device's latches after a reboot, judged on its GPU's first good read. True when any cleared."""
        if not self._reboot_pending or reading.lost or reading.errors:
            return False
        return bool(self._judge_reboot(evaluate_reading(reading, None, self.cfg), reading.time))

    def _judge_reboot(self, found: list[Condition], now: float) -> list[tuple[Clear, str]]:
        """The first good read after a reboot: latches from before it that a reboot mends clear, unless the GPU
        still shows something a reset or reboot is asked for. Either way the judgement is made once: what stays is
        stamped with this boot, so a later plugin restart (no reboot) never clears it."""
        self._reboot_pending = False
        blocking = sorted({c.code for c in found if c.action in _NOT_MENDED})
        applied: list[tuple[Clear, str]] = []
        if blocking:
            for lt in self._latched.values():
                if lt.boot_id != self.boot_id and Clear.REBOOT in clears_for(lt.reason):
                    lt.reason = _noted(lt.reason,
                                       f"kept across a node reboot: the GPU still shows {', '.join(blocking)}")
        else:
            why = "node rebooted"
            if self.clear_by(Clear.REBOOT, why, now, older_boot_only=True):
                applied.append((Clear.REBOOT, why))
        for lt in self._latched.values():
            if lt.boot_id != self.boot_id and Clear.REBOOT not in clears_for(lt.reason):
                lt.reason = _noted(lt.reason, "kept across a node reboot: a reboot does not clear it")
            lt.boot_id = self.boot_id
        return applied

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

    def _reset_seen(self, reading: Reading) -> str:
        """Why this poll shows the GPU was reset since the last one, or ""."""
        if "gpu-lost" in self._polled and not reading.lost and not reading.errors:
            # A lost GPU answering again was reset (a reboot is judged at start, by the boot id).
            del self._polled["gpu-lost"]
            return "GPU reset: the lost GPU answers again"
        prev = self._previous
        if prev is None:
            return ""
        if prev.recovery_action in _RESET_ACTIONS and reading.recovery_action == "none":
            return f"GPU reset: the driver's recovery action went from {prev.recovery_action} to none"
        return ""

    def observe_event(self, event: GpuEvent) -> Disposition:
        """Feed one driver event; returns the policy's disposition (``POLL`` asks the caller to poll now)."""
        disposition, c = classify_event(event, self.cfg)
        now = event.time
        if disposition == Disposition.LATCH and c is not None:
            self._latch(c, now)
        elif disposition == Disposition.COUNT and c is not None:
            times = self._app_xids.setdefault(event.code, deque())
            # A folded flood counts as many records as it had, but never more than the threshold needs.
            times.extend([now] * min(max(1, event.repeats), self.cfg.app_xid_repeat_threshold))
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
        self._latched[c.code] = _Latched(Reason.of(c, first), now, self.boot_id)

    def clear_by(self, kind: Clear, why: str, now: float, older_boot_only: bool = False) -> tuple[str, ...]:
        """Take off every latch that ``kind`` clears by its row of the table; returns their codes. With a recovery
        check they wait for it instead (``awaiting_check``)."""
        gone = [code for code, lt in self._latched.items()
                if kind in clears_for(lt.reason) and not (older_boot_only and lt.boot_id == self.boot_id)]
        if kind in (Clear.RESET, Clear.REBOOT):
            # Counts of application XIDs belong to the GPU's life before it: a reset or reboot starts them over.
            self._app_xids.clear()
            self._previous = None
        if not gone:
            return ()
        reasons = {code: self._latched.pop(code).reason for code in gone}
        if self.gated:
            self._await_check(reasons, why, now)
        else:
            self.cleared = Clearance(tuple(sorted(reasons)), why, now)
        return tuple(sorted(reasons))

    def _await_check(self, reasons: dict[str, Reason], why: str, now: float) -> None:
        # recovery-check-failed waits too: what clears it (a reset, a reboot) is what calls for a new check.
        if not self._awaiting:
            self._awaiting_since = now
        self._awaiting.update(reasons)
        self._awaiting_why = why if not self._awaiting_why else f"{self._awaiting_why}; {why}"

    @property
    def awaiting_check(self) -> bool:
        return bool(self._awaiting)

    def check_result(self, passed: bool, detail: str, now: float) -> None:
        """The recovery check's verdict on what waits for it: passed, it clears for good; failed, the device is
        kept out with ``recovery-check-failed`` and the check's words."""
        if not self._awaiting:
            return
        codes = tuple(sorted(self._awaiting))
        why = self._awaiting_why
        self._awaiting.clear()
        self._awaiting_why = ""
        if passed:
            self.cleared = Clearance(codes, f"{why}; recovery check passed", now)
        else:
            c = condition("recovery-check-failed", f"recovery check failed: {detail}", Source.CHECK)
            self._latched[c.code] = _Latched(Reason.of(c, now), now, self.boot_id)

    def operator_clear(self, codes: frozenset[str] | None, note: str, now: float) -> tuple[str, ...]:
        """``gpu-health-plugin clear``: take off what the operator names (everything clearable when None). Refused,
        changing nothing, while the condition is still present or when a named reason is not there to clear."""
        if self.lost:
            raise ClearRefused(f"{self.device_id}: the GPU is still lost (NVML cannot reach it)")
        present = {code for code, p in self._polled.items() if p.clean_polls == 0}
        clearable: dict[str, str] = {}  # code -> where it lives
        for code in self._latched:
            clearable[code] = "latched"
        for code, p in self._polled.items():
            if code not in present and Clear.OPERATOR in clears_for(p.reason):
                clearable.setdefault(code, "polled")
        if self._awaiting:
            clearable["recovery-check-pending"] = "awaiting"
        if self._backoff_until:
            clearable["flapping"] = "flap"
        if codes is not None:
            for code in sorted(codes):
                if code in present:
                    raise ClearRefused(f"{self.device_id}: {code} is still present (seen by the last poll); it "
                                       "clears by itself once the GPU stops showing it")
                if code not in clearable:
                    known = code in self._polled or (code in SPECS and Clear.OPERATOR not in SPECS[code].clears)
                    why = "it clears only when the GPU stops showing it" if known else "the device has no such reason"
                    raise ClearRefused(f"{self.device_id}: {code} cannot be cleared: {why}")
            chosen = sorted(codes)
        else:
            chosen = sorted(clearable)
            if not chosen:
                still = f": {', '.join(sorted(present))} still present" if present else ""
                raise ClearRefused(f"{self.device_id}: nothing to clear{still}")
        for code in chosen:
            where = clearable[code]
            if where == "latched":
                del self._latched[code]
            elif where == "polled":
                del self._polled[code]
            elif where == "awaiting":
                self._awaiting.clear()
                self._awaiting_why = ""
            elif where == "flap":
                self._backoff_until = 0.0
                self._changes.clear()
        self.cleared = Clearance(tuple(chosen), f"by the operator: {note}", now)
        return tuple(chosen)

    def _expire(self, now: float) -> None:
        expired: dict[str, Reason] = {}
        for code, latched in list(self._latched.items()):
            hold = self.cfg.latch_hold_s.get(latched.reason.severity)
            if hold is not None and now - latched.last_seen >= hold:
                expired[code] = self._latched.pop(code).reason
        if not expired:
            return
        why = "its hold time passed with no new event"
        if self.gated:
            self._await_check(expired, why, now)
        else:
            self.cleared = Clearance(tuple(sorted(expired)), why, now)

    # Verdict --------------------------------------------------------------------------------------------------

    def update(self, now: float) -> Verdict:
        """Advance to ``now`` and return the verdict there: expire latches, record a state change for flap damping
        (tripping or ending the back-off), and move ``state`` and ``since``. The one place any of that happens."""
        self._expire(now)
        reasons = self._merged()
        if self._awaiting:
            reasons.append(self._pending_reason())
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

    def _pending_reason(self) -> Reason:
        # The device stays as the cleared reasons had it until the check passes: the severity is theirs.
        held = State.worst(*(r.severity for r in self._awaiting.values()))
        spec = SPECS["recovery-check-pending"]
        return Reason(spec.code, held, f"{', '.join(sorted(self._awaiting))} cleared ({self._awaiting_why}); waiting "
                      "for the recovery check", spec.source, spec.action, self._awaiting_since)

    def _flapping(self, first_seen: float) -> Reason:
        # The table gives the action; the severity is the state held, which is the point of the reason.
        return Reason("flapping", self._held,
                      f"changed state {len(self._changes)} times in {self.cfg.flap_window_s / 60:g} min; "
                      f"holding {self._held.value}", Source.POLL, SPECS["flapping"].action, first_seen)

    # Persistence: only what must survive a restart (a poll re-derives the rest) -----------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "latched": [{**lt.reason.to_dict(), "last_seen": lt.last_seen, "boot_id": lt.boot_id}
                        for lt in self._latched.values()],
            "awaiting": [r.to_dict() for r in self._awaiting.values()],
            "awaiting_why": self._awaiting_why,
            "awaiting_since": self._awaiting_since,
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
            # An entry from a release that kept no boot id is taken as this boot's: the next reboot clears it.
            boot = str(item.get("boot_id") or self.boot_id)
            self._latched[r.code] = _Latched(r, float(item.get("last_seen", r.first_seen)), boot)
            if boot != self.boot_id:
                self._reboot_pending = True
        for item in d.get("awaiting", []):
            r = Reason.from_dict(item)
            self._awaiting[r.code] = r
        self._awaiting_why = str(d.get("awaiting_why", ""))
        self._awaiting_since = float(d.get("awaiting_since", 0.0))
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


def _noted(r: Reason, note: str) -> Reason:
    if note in r.message:
        return r
    return Reason(r.code, r.severity, f"{r.message}; {note}", r.source, r.action, r.first_seen)
