"""The runbook's "Clears" column (docs/reasons.md, REASONS[...].clears) held to the tracker, row by row.

Every row is raised on a tracker the way the GPU raises it (an event, or a poll showing the signal), then each way of
clearing is tried: the signal gone, the hold time passed, a reset seen, a reboot (another boot id at start), the
operator's clear. What the column lists must clear it, and what it does not list must leave it on the device. On a
fake clock: nothing here sleeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from plugin.devices.model import EventOrigin, GpuEvent, Reading
from plugin.health.config import HealthConfig
from plugin.health.policy import xid_class
from plugin.health.reasons import REASONS, Clear, ReasonSpec, Source, State, clears_for, xid_spec
from plugin.health.tracker import ClearRefused, DeviceTracker

OK: dict[str, Any] = dict(temperature_c=40, temperature_slowdown_c=87, temperature_shutdown_c=92,
                          recovery_action="none", pcie_gen=5, pcie_max_gen=5, pcie_width=16, pcie_max_width=16)
HOLD_S = 100.0
BOOT = "boot-1"


@dataclass(frozen=True)
class Row:
    """How a GPU raises one row: events, or the signals of a poll (``grows``: a counter that must grow each poll)."""

    code: str
    xid_class: str = ""
    events: tuple[tuple[str, int], ...] = ()
    signals: dict[str, Any] = field(default_factory=dict)
    grows: str = ""
    cfg: dict[str, Any] = field(default_factory=dict)


ROWS = (
    Row("xid-<n>", "fatal", events=(("xid", 48),)),
    Row("xid-79", "fatal", events=(("xid", 79),)),
    Row("xid-64", "fatal", events=(("xid", 64),)),
    Row("xid-95", "fatal", events=(("xid", 95),)),
    Row("xid-<n>", "degraded", events=(("xid", 63),)),
    Row("xid-<n>", "unknown", events=(("xid", 999),)),
    Row("xid-<n>-repeated", "application", events=(("xid", 13),) * 3),
    Row("ecc-uncorrected", events=(("ecc-dbe", 0),)),
    Row("gpu-unavailable", events=(("gpu-unavailable", 0),)),
    Row("ecc-corrected-high", signals={"ecc_corrected_volatile": 101}, cfg={"ecc_corrected_limit": 100}),
    Row("ecc-corrected-rate", grows="ecc_corrected_volatile", cfg={"ecc_corrected_rate_per_min": 1.0}),
    Row("row-remap-pending", signals={"row_remap_pending": True}),
    Row("row-remap-failure", signals={"row_remap_failure": True}),
    Row("retired-pages-pending", signals={"retired_pages_pending": True}),
    Row("retired-pages-limit", signals={"retired_pages_count": 63}),
    Row("thermal-slowdown", signals={"temperature_c": 88}),
    Row("temperature-shutdown", signals={"temperature_c": 95}),
    Row("hw-slowdown", signals={"clock_event_reasons": frozenset({"hw_slowdown"})}),
    Row("power-brake", signals={"clock_event_reasons": frozenset({"hw_power_brake_slowdown"})}),
    Row("pcie-link-degraded", signals={"pcie_width": 8}),
    Row("pcie-replay-rate", grows="pcie_replay_count"),
    Row("nvlink-down", signals={"nvlink_down": (1,)}),
    Row("nvlink-errors", grows="nvlink_error_count"),
    Row("recovery-action-reset", signals={"recovery_action": "gpu_reset"}),
    Row("recovery-action-reboot", signals={"recovery_action": "node_reboot"}),
    Row("recovery-action-drain-p2p", signals={"recovery_action": "drain_p2p"}),
    Row("recovery-action-imex", signals={"recovery_action": "recover_imex_domain"}),
    Row("recovery-action-unknown", signals={"recovery_action": "unknown"}),
    Row("fabric-unhealthy", signals={"fabric_health": "unhealthy"}),
    Row("fabric-limited", signals={"fabric_health": "limited_capacity"}),
    Row("gpu-lost", signals={"lost": True}),
    Row("reset-required", signals={"reset_required": True}),
    Row("nvml-error", signals={"errors": (("temperature", "NVML_ERROR_UNKNOWN"),)}, cfg={"nvml_error_polls": 1}),
)
# Rows the tracker does not hold: the monitor makes them from what it sees itself, and each clears with its cause
# (tests/unit/test_nvml_realpynvml.py, tests/unit/test_return_to_service.py for the operator's refusal).
MONITOR_ROWS = {"nvml-stalled", "nvml-check-unavailable",
                "gpu-missing",  # the node's, no tracker's: tests/unit/test_gpu_missing.py raises and clears it
                "busy-unallocated"}  # the busy watch's: tests/unit/test_busy_unallocated.py
# Rows with drivers of their own below.
SPECIAL_ROWS = {"flapping", "recovery-check-failed", "recovery-check-pending"}


def spec_of(row: Row) -> ReasonSpec:
    if row.events and row.events[0][0] == "xid":
        xid = row.events[0][1]
        return xid_spec(xid, xid_class(xid, HealthConfig()))
    return next(s for s in REASONS if s.code == row.code)


def code_of(row: Row) -> str:
    if row.code.startswith("xid-<n>"):
        return row.code.replace("<n>", str(row.events[0][1]))
    return row.code


class Gpu:
    """One tracker on a fake clock, fed the way the monitor feeds it."""

    def __init__(self, row: Row, *, hold: float | None = None, boot: str = BOOT,
                 tracker: DeviceTracker | None = None, origin: EventOrigin = EventOrigin.NVML) -> None:
        self.row = row
        self.origin = origin
        self.cfg = HealthConfig(**{"clear_after_polls": 2, "rate_hold_s": 30.0,
                                   "latch_hold_s": {State.DEGRADED: hold, State.UNHEALTHY: hold}, **row.cfg})
        self.t = tracker or DeviceTracker("GPU-0", self.cfg, boot_id=boot)
        self.now = 1000.0
        self.counter = 0

    def poll(self, showing: bool, dt: float = 60.0, **extra: Any) -> None:
        self.now += dt
        signals = dict(OK)
        if self.row.grows:
            if showing:
                self.counter += 100_000
            signals[self.row.grows] = self.counter
        elif showing:
            signals.update(self.row.signals)
        signals.update(extra)
        self.t.observe_reading(Reading(time=self.now, **signals))

    def raise_it(self) -> None:
        self.poll(False)
        for kind, code in self.row.events:
            self.now += 1
            self.t.observe_event(GpuEvent("GPU-0", kind, code, self.now, origin=self.origin))
        if not self.row.events:
            self.poll(True)
        assert self.has(), f"{self.row.code}: not raised"

    def has(self) -> bool:
        return code_of(self.row) in self.codes()

    def codes(self) -> set[str]:
        return {r.code for r in self.t.update(self.now).reasons}

    def signal_stays(self) -> bool:
        return not self.row.events


def raised(row: Row, **kw: Any) -> Gpu:
    g = Gpu(row, **kw)
    g.raise_it()
    return g


ALL_ROWS = [pytest.param(r, id=f"{r.code}:{r.xid_class}" if r.xid_class else r.code) for r in ROWS]


def test_every_row_is_driven_here() -> None:
    driven = {(s.code, s.xid_class) for s in map(spec_of, ROWS)}
    left = {(s.code, s.xid_class) for s in REASONS} - driven
    assert {c for c, _ in left} == MONITOR_ROWS | SPECIAL_ROWS


EVENT_ROWS = [p for p in ALL_ROWS if p.values[0].events]  # type: ignore[union-attr]


@pytest.mark.parametrize("row", EVENT_ROWS)
def test_a_reason_read_from_the_kernel_log_clears_as_the_same_from_nvml(row: Row) -> None:
    """The kernel log is one source more of the same events: its reasons latch and clear by the same rows."""
    nvml, klog = raised(row), raised(row, origin=EventOrigin.KERNEL_LOG)
    [a] = [r for r in nvml.t.update(nvml.now).reasons if r.code == code_of(row)]
    [b] = [r for r in klog.t.update(klog.now).reasons if r.code == code_of(row)]
    assert (a.source, b.source) == (Source.EVENT, Source.KERNEL_LOG)
    assert clears_for(b) == clears_for(a) == spec_of(row).clears
    for g in (nvml, klog):  # and a reboot, the one way every event row but the support-only ones clears, does
        saved = g.t.to_dict()
        after = Gpu(row, boot="boot-2", tracker=DeviceTracker("GPU-0", g.cfg, boot_id="boot-2"))
        after.t.load(saved)
        after.now = g.now + 600
        after.poll(False)
        assert (not after.has()) is (Clear.REBOOT in spec_of(row).clears)


@pytest.mark.parametrize("row", ALL_ROWS)
def test_gone(row: Row) -> None:
    g = raised(row)
    for _ in range(3):
        g.poll(False)
    g.now += 60  # past the rate hold
    g.poll(False)
    spec = spec_of(row)
    # A NEVER row clears like any polled one once the GPU stops showing it: the hardware is what never stops.
    expected = Clear.GONE in spec.clears or Clear.NEVER in spec.clears
    assert (not g.has()) is expected, sorted(spec.clears)


@pytest.mark.parametrize("row", ALL_ROWS)
def test_hold(row: Row) -> None:
    g = raised(row, hold=HOLD_S)
    # The condition stays present (a polled one keeps showing; an event is not repeated) past every hold.
    for _ in range(4):
        g.poll(g.signal_stays(), dt=HOLD_S)
    assert (not g.has()) is (Clear.HOLD in spec_of(row).clears)


@pytest.mark.parametrize("row", ALL_ROWS)
def test_reset(row: Row) -> None:
    g = raised(row)
    # A reset: the GPU lost, then answering again (a polled condition a reset does not mend shows again).
    g.poll(False, lost=True)
    g.poll(g.signal_stays())
    g.poll(g.signal_stays())  # a rate is measured between two polls
    assert (not g.has()) is (Clear.RESET in spec_of(row).clears)


@pytest.mark.parametrize("row", ALL_ROWS)
def test_reboot(row: Row) -> None:
    g = raised(row)
    saved = g.t.to_dict()
    after = Gpu(row, boot="boot-2", tracker=DeviceTracker("GPU-0", g.cfg, boot_id="boot-2"))
    after.t.load(saved)
    after.now = g.now + 600
    after.poll(g.signal_stays())
    after.poll(g.signal_stays())  # a rate is measured between two polls
    assert (not after.has()) is (Clear.REBOOT in spec_of(row).clears)


# gpu-lost leaves at the first poll that reaches the GPU: there is never a lost GPU no longer present to clear
# (the operator's refusal while it is lost: below).
@pytest.mark.parametrize("row", [p for p in ALL_ROWS if p.id != "gpu-lost"])
def test_operator(row: Row) -> None:
    g = raised(row)
    g.poll(False)  # no longer present, still held by the clean-poll count (or latched)
    allowed = Clear.OPERATOR in spec_of(row).clears
    if allowed:
        assert g.t.operator_clear(frozenset({code_of(row)}), "ticket 1", g.now) == (code_of(row),)
        assert not g.has()
        assert g.t.cleared is not None and g.t.cleared.why == "by the operator: ticket 1"
    else:
        with pytest.raises(ClearRefused, match=code_of(row)):
            g.t.operator_clear(frozenset({code_of(row)}), "ticket 1", g.now)
        assert g.has()


@pytest.mark.parametrize("row", [pytest.param(r, id=r.code) for r in ROWS if not r.events and r.code != "gpu-lost"])
def test_the_operator_cannot_clear_what_the_last_poll_still_showed(row: Row) -> None:
    g = raised(row)
    g.poll(True)
    with pytest.raises(ClearRefused, match="still present"):
        g.t.operator_clear(frozenset({code_of(row)}), "ticket 1", g.now)
    assert g.has()


def test_a_reboot_clears_nothing_while_the_gpu_is_still_lost_and_a_plugin_restart_clears_nothing() -> None:
    row = next(r for r in ROWS if r.code == "xid-79")
    g = raised(row)
    # A plugin restart without a reboot: the same boot id.
    same = DeviceTracker("GPU-0", g.cfg, boot_id=BOOT)
    same.load(g.t.to_dict())
    same.observe_reading(Reading(time=g.now + 10, **OK))
    assert "xid-79" in {r.code for r in same.update(g.now + 10).reasons}
    # A reboot after which the GPU is still lost: kept, until it answers.
    after = DeviceTracker("GPU-0", g.cfg, boot_id="boot-2")
    after.load(g.t.to_dict())
    after.observe_reading(Reading(time=g.now + 20, lost=True))
    assert "xid-79" in {r.code for r in after.update(g.now + 20).reasons}
    with pytest.raises(ClearRefused, match="still lost"):
        after.operator_clear(None, "x", g.now + 20)


# The rows that are not one signal: the flap back-off, and the recovery check's two.

def test_flapping_clears_with_its_back_off_or_the_operator_and_nothing_else() -> None:
    spec = next(s for s in REASONS if s.code == "flapping")
    assert spec.clears == {Clear.HOLD, Clear.OPERATOR}

    def flapping() -> Gpu:
        g = Gpu(Row("thermal-slowdown", signals={"temperature_c": 88},
                    cfg={"flap_max": 2, "flap_backoff_s": 300.0, "clear_after_polls": 1}))
        for showing in (True, False, True, False):
            g.poll(showing, dt=1)
            g.codes()  # the verdict after each poll, as the monitor takes it
        assert "flapping" in g.codes()
        return g

    g = flapping()
    g.poll(False, lost=True)
    g.poll(False)
    assert "flapping" in g.codes()  # a reset does not end a back-off
    g.poll(False, dt=300)
    assert "flapping" not in g.codes()  # its hold
    g = flapping()
    assert g.t.operator_clear(frozenset({"flapping"}), "seen to", g.now) == ("flapping",)
    assert "flapping" not in g.codes()


def gated(boot: str = BOOT) -> Gpu:
    g = Gpu(Row("xid-<n>", "fatal", events=(("xid", 48),)))
    g.t = DeviceTracker("GPU-0", g.cfg, boot_id=boot, gated=True)
    g.raise_it()
    return g


def test_recovery_check_pending_waits_for_the_check_or_the_operator() -> None:
    spec = next(s for s in REASONS if s.code == "recovery-check-pending")
    assert spec.clears == {Clear.CHECK, Clear.OPERATOR}
    g = gated()
    g.poll(False, lost=True)
    g.poll(False)  # the reset is seen: xid-48 waits for the check
    state, reasons = g.t.update(g.now)
    assert [r.code for r in reasons] == ["recovery-check-pending"] and state is State.UNHEALTHY
    assert "xid-48" in reasons[0].message
    for _ in range(5):
        g.poll(False, dt=HOLD_S)
    assert g.codes() == {"recovery-check-pending"}  # no time or poll ends the wait
    g.t.check_result(True, "exit 0", g.now)
    assert g.codes() == set()
    assert g.t.cleared is not None and g.t.cleared.codes == ("xid-48",) and "recovery check passed" in g.t.cleared.why
    g = gated()
    g.poll(False, lost=True)
    g.poll(False)
    assert g.t.operator_clear(frozenset({"recovery-check-pending"}), "checked by hand", g.now) \
        == ("recovery-check-pending",)
    assert g.codes() == set()


def failed_check() -> Gpu:
    g = gated()
    g.poll(False, lost=True)
    g.poll(False)
    g.t.check_result(False, "exit 1: memory test failed", g.now)
    state, reasons = g.t.update(g.now)
    assert [r.code for r in reasons] == ["recovery-check-failed"] and state is State.UNHEALTHY
    assert "memory test failed" in reasons[0].message
    return g


def test_recovery_check_failed_clears_by_reset_reboot_or_operator_each_but_the_operator_checking_again() -> None:
    spec = next(s for s in REASONS if s.code == "recovery-check-failed")
    assert spec.clears == {Clear.RESET, Clear.REBOOT, Clear.OPERATOR}
    g = failed_check()
    for _ in range(5):
        g.poll(False, dt=HOLD_S)
    assert g.codes() == {"recovery-check-failed"}  # time and clean polls do nothing
    g.poll(False, lost=True)
    g.poll(False)
    assert g.codes() == {"recovery-check-pending"}  # a reset: the check runs again
    g = failed_check()
    after = DeviceTracker("GPU-0", g.cfg, boot_id="boot-2", gated=True)
    after.load(g.t.to_dict())
    after.observe_reading(Reading(time=g.now + 600, **OK))
    assert {r.code for r in after.update(g.now + 600).reasons} == {"recovery-check-pending"}
    g = failed_check()
    assert g.t.operator_clear(frozenset({"recovery-check-failed"}), "override", g.now) == ("recovery-check-failed",)
    assert g.codes() == set()
