"""Hysteresis, latches, escalation and flap damping on a fake clock: no test here sleeps."""

from __future__ import annotations

from plugin.devices.model import GpuEvent, Reading
from plugin.health.config import HealthConfig
from plugin.health.reasons import Clear, State
from plugin.health.tracker import DeviceTracker

OK = dict(temperature_c=40, temperature_slowdown_c=87, temperature_shutdown_c=92, recovery_action="none")


def poll(t: DeviceTracker, now: float, **signals: object) -> State:
    t.observe_reading(Reading(time=now, **{**OK, **signals}))  # type: ignore[arg-type]
    return t.update(now)[0]


def test_polled_condition_clears_after_n_clean_polls() -> None:
    t = DeviceTracker("g", HealthConfig(clear_after_polls=3))
    assert poll(t, 0, temperature_c=90) == State.DEGRADED
    assert poll(t, 5) == State.DEGRADED
    assert poll(t, 10) == State.DEGRADED
    assert poll(t, 15) == State.HEALTHY
    assert t.since == 15


def test_reappearing_condition_restarts_the_clean_count_and_keeps_first_seen() -> None:
    t = DeviceTracker("g", HealthConfig(clear_after_polls=2))
    poll(t, 0, nvlink_down=(1,))
    poll(t, 5)
    poll(t, 10, nvlink_down=(1,))
    assert poll(t, 15) == State.UNHEALTHY
    _state, reasons = t.update(15)
    assert reasons[0].code == "nvlink-down" and reasons[0].first_seen == 0
    assert poll(t, 20) == State.HEALTHY


def test_fatal_xid_is_latched_until_reset_seen() -> None:
    t = DeviceTracker("g", HealthConfig())
    poll(t, 0)
    t.observe_event(GpuEvent("g", "xid", 48, 1))
    for i in range(2, 50):
        assert poll(t, i * 1000.0) == State.UNHEALTHY  # no hold time for fatal: polls do not heal it
    # The driver asks for a reset, then the action returns to none: the reset happened.
    assert poll(t, 60_000, recovery_action="gpu_reset") == State.UNHEALTHY
    t.observe_reading(Reading(time=60_005, **OK))  # type: ignore[arg-type]
    # The recovery-action condition itself is polled and clears after its clean polls.
    for i in range(3):
        state = poll(t, 60_010 + i)
    assert state == State.HEALTHY


def test_degraded_xid_latch_expires_after_hold_time() -> None:
    t = DeviceTracker("g", HealthConfig(latch_hold_s={State.DEGRADED: 100.0, State.UNHEALTHY: None}))
    t.observe_event(GpuEvent("g", "xid", 63, 0))
    assert t.update(50)[0] == State.DEGRADED
    t.observe_event(GpuEvent("g", "xid", 63, 80))  # a new event restarts the hold
    assert t.update(150)[0] == State.DEGRADED
    assert t.update(180)[0] == State.HEALTHY


def test_application_xid_escalates_only_when_repeated_in_window() -> None:
    t = DeviceTracker("g", HealthConfig(app_xid_repeat_threshold=3, app_xid_window_s=3600))
    for now in (0, 2000, 4000):  # three, but never three within one hour
        t.observe_event(GpuEvent("g", "xid", 13, now))
        assert t.update(now)[0] == State.HEALTHY
    t.observe_event(GpuEvent("g", "xid", 13, 4500))
    state, reasons = t.update(4500)
    assert state == State.DEGRADED and reasons[0].code == "xid-13-repeated"


def test_nvml_errors_make_unknown_after_consecutive_failures_only() -> None:
    t = DeviceTracker("g", HealthConfig(nvml_error_polls=3, clear_after_polls=1))
    err = (("temperature", "NVML_ERROR_UNKNOWN"),)
    assert poll(t, 0, errors=err) == State.HEALTHY
    assert poll(t, 1, errors=err) == State.HEALTHY
    assert poll(t, 2) == State.HEALTHY  # a good poll resets the streak
    for i in range(3):
        state = poll(t, 3 + i, errors=err)
    assert state == State.UNKNOWN
    assert t.update(5)[1][0].code == "nvml-error"
    assert poll(t, 6) == State.HEALTHY


def test_failed_reads_do_not_count_as_clean_polls() -> None:
    t = DeviceTracker("g", HealthConfig(clear_after_polls=1, nvml_error_polls=100))
    poll(t, 0, row_remap_pending=True)
    assert poll(t, 1, errors=(("row_remap", "boom"),)) == State.DEGRADED
    assert poll(t, 2) == State.HEALTHY


def test_lost_gpu_answering_again_clears_the_latches_a_reset_mends() -> None:
    t = DeviceTracker("g", HealthConfig())
    t.observe_event(GpuEvent("g", "xid", 48, 0))
    t.observe_reading(Reading(time=1, lost=True))
    assert t.update(1)[0] == State.UNHEALTHY
    applied = t.observe_reading(Reading(time=2, **OK))  # type: ignore[arg-type]
    assert [kind for kind, _ in applied] == [Clear.RESET]
    assert t.update(2)[0] == State.HEALTHY
    assert t.cleared is not None and t.cleared.codes == ("xid-48",) and "answers again" in t.cleared.why


def test_flapping_device_holds_its_worst_state_for_the_backoff() -> None:
    cfg = HealthConfig(clear_after_polls=1, flap_max=3, flap_window_s=600, flap_backoff_s=300)
    t = DeviceTracker("g", cfg)
    now = 0.0
    assert poll(t, now, nvlink_down=(0,)) == State.UNHEALTHY  # change 1
    now += 10
    assert poll(t, now) == State.HEALTHY  # change 2
    now += 10
    assert poll(t, now, nvlink_down=(0,)) == State.UNHEALTHY  # change 3
    now += 10
    # A fourth change within the window would exceed flap_max: it stays Unhealthy though the link is back.
    assert poll(t, now) == State.UNHEALTHY
    state, reasons = t.update(now)
    assert state == State.UNHEALTHY
    assert [r.code for r in reasons] == ["flapping"]
    # After the back-off, with the cause gone, it recovers.
    now += 301
    assert poll(t, now) == State.HEALTHY


def test_persisted_tracker_keeps_latches_across_restart() -> None:
    cfg = HealthConfig()
    t = DeviceTracker("g", cfg)
    t.observe_event(GpuEvent("g", "xid", 48, 10))
    t.update(10)
    saved = t.to_dict()
    t2 = DeviceTracker("g", cfg)
    t2.load(saved)
    t2.observe_reading(Reading(time=20, **OK))  # type: ignore[arg-type]
    state, reasons = t2.update(20)
    assert state == State.UNHEALTHY and reasons[0].code == "xid-48" and reasons[0].first_seen == 10
    assert t2.since == 10  # restored, not reset by the restart
