"""Policy tables: each signal maps to the documented reason code and state; overrides and classes apply."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from plugin.devices.model import EventKind, GpuEvent, Reading
from plugin.health.config import APPLICATION_XIDS, DEGRADED_XIDS, FATAL_XIDS, HealthConfig
from plugin.health.policy import Disposition, classify_event, evaluate_reading, inventory_condition, xid_class
from plugin.health.reasons import (
    ACTIONS,
    REASONS,
    SPECS,
    XID_SPECS,
    Action,
    Condition,
    Reason,
    ReasonSpec,
    Source,
    State,
)
from plugin.health.tracker import DeviceTracker

CFG = HealthConfig()
T = 1000.0


def codes(reading: Reading, previous: Reading | None = None, cfg: HealthConfig = CFG) -> dict[str, State]:
    return {c.code: c.severity for c in evaluate_reading(reading, previous, cfg)}


BASE = dict(temperature_c=40, temperature_slowdown_c=87, temperature_shutdown_c=92, pcie_gen=5, pcie_width=16,
            pcie_max_gen=5, pcie_max_width=16, recovery_action="none")


POLLED_TABLE: list[tuple[dict[str, object], dict[str, State]]] = [
    ({}, {}),
    ({"ecc_uncorrected_volatile": 2}, {"ecc-uncorrected": State.UNHEALTHY}),
    ({"ecc_corrected_volatile": 10_000}, {}),  # corrected errors alone are not a fault by default
    ({"row_remap_pending": True}, {"row-remap-pending": State.DEGRADED}),
    ({"row_remap_failure": True}, {"row-remap-failure": State.UNHEALTHY}),
    ({"retired_pages_pending": True}, {"retired-pages-pending": State.DEGRADED}),
    ({"retired_pages_count": 63}, {"retired-pages-limit": State.UNHEALTHY}),
    ({"retired_pages_count": 62}, {}),
    ({"temperature_c": 87}, {"thermal-slowdown": State.DEGRADED}),
    ({"temperature_c": 92}, {"temperature-shutdown": State.UNHEALTHY}),
    ({"clock_event_reasons": frozenset({"hw_thermal_slowdown"})}, {"thermal-slowdown": State.DEGRADED}),
    ({"clock_event_reasons": frozenset({"sw_thermal_slowdown"})}, {"thermal-slowdown": State.DEGRADED}),
    ({"clock_event_reasons": frozenset({"hw_slowdown"})}, {"hw-slowdown": State.DEGRADED}),
    ({"clock_event_reasons": frozenset({"hw_power_brake_slowdown"})}, {"power-brake": State.DEGRADED}),
    ({"pcie_width": 8}, {"pcie-link-degraded": State.DEGRADED}),
    ({"pcie_gen": 3}, {"pcie-link-degraded": State.DEGRADED}),
    ({"pcie_gen": 3, "gpu_idle": True}, {}),  # idle GPUs lower their link generation to save power
    ({"nvlink_down": (2,)}, {"nvlink-down": State.UNHEALTHY}),
    ({"recovery_action": "gpu_reset"}, {"recovery-action-reset": State.UNHEALTHY}),
    ({"recovery_action": "drain_and_reset"}, {"recovery-action-reset": State.UNHEALTHY}),
    ({"recovery_action": "node_reboot"}, {"recovery-action-reboot": State.UNHEALTHY}),
    ({"recovery_action": "drain_p2p"}, {"recovery-action-drain-p2p": State.DEGRADED}),
    ({"recovery_action": "bus_reset"}, {"recovery-action-reset": State.UNHEALTHY}),
    ({"recovery_action": "system_reboot"}, {"recovery-action-reboot": State.UNHEALTHY}),
    ({"recovery_action": "recover_imex_domain"}, {"recovery-action-imex": State.UNHEALTHY}),
    ({"recovery_action": "unknown", "recovery_action_code": 9}, {"recovery-action-unknown": State.UNKNOWN}),
    ({"nvlink_active_count": 16, "model": "NVIDIA H100 80GB HBM3"}, {}),
    ({"fabric_health": "unhealthy"}, {"fabric-unhealthy": State.UNHEALTHY}),
    ({"fabric_health": "limited_capacity"}, {"fabric-limited": State.DEGRADED}),
    ({"reset_required": True}, {"reset-required": State.UNHEALTHY}),
    ({"lost": True}, {"gpu-lost": State.UNHEALTHY}),
]


@pytest.mark.parametrize(("signals", "expected"), POLLED_TABLE)
def test_polled_signal_table(signals: dict[str, object], expected: dict[str, State]) -> None:
    assert codes(Reading(time=T, **{**BASE, **signals})) == expected  # type: ignore[arg-type]


def test_not_supported_signals_are_not_faults() -> None:
    assert codes(Reading(time=T)) == {}


def test_pcie_replay_rate_uses_per_lane_limit_for_the_generation() -> None:
    prev = Reading(time=T, **{**BASE, "pcie_replay_count": 0})  # type: ignore[arg-type]
    # Gen5 x16 tolerates 1.92 * 16 = 30.72 replays per minute.
    slow = Reading(time=T + 60, **{**BASE, "pcie_replay_count": 30})  # type: ignore[arg-type]
    fast = Reading(time=T + 60, **{**BASE, "pcie_replay_count": 31})  # type: ignore[arg-type]
    assert "pcie-replay-rate" not in codes(slow, prev)
    assert codes(fast, prev)["pcie-replay-rate"] == State.DEGRADED


def test_nvlink_error_counter_growth() -> None:
    prev = Reading(time=T, nvlink_error_count=5)
    assert codes(Reading(time=T + 5, nvlink_error_count=5), prev) == {}
    assert codes(Reading(time=T + 5, nvlink_error_count=6), prev) == {"nvlink-errors": State.DEGRADED}


def test_expected_link_count_per_model_catches_a_link_that_never_trained() -> None:
    cfg = HealthConfig(nvlink_expected_links={"NVIDIA H100 80GB HBM3": 18})
    short = Reading(time=T, model="NVIDIA H100 80GB HBM3", nvlink_active_count=16, nvlink_down=())
    [c] = evaluate_reading(short, None, cfg)
    assert (c.code, c.severity, c.message) == ("nvlink-down", State.UNHEALTHY,
                                               "NVLink down: 16 of 18 links active (health.nvlinkExpectedLinks)")
    assert codes(Reading(time=T, model="NVIDIA H100 80GB HBM3", nvlink_active_count=18), cfg=cfg) == {}
    # Another model, or a backend that cannot count links, is not held to it.
    assert codes(Reading(time=T, model="NVIDIA L40S", nvlink_active_count=0), cfg=cfg) == {}
    assert codes(Reading(time=T, model="NVIDIA H100 80GB HBM3"), cfg=cfg) == {}


def test_corrected_ecc_limit_when_configured() -> None:
    cfg = HealthConfig(ecc_corrected_limit=100)
    assert codes(Reading(time=T, ecc_corrected_volatile=101), cfg=cfg) == {"ecc-corrected-high": State.DEGRADED}


def test_overrides_change_or_drop_a_reason() -> None:
    cfg = HealthConfig(overrides={"pcie-link-degraded": "Unhealthy", "thermal-slowdown": "ignore"})
    r = Reading(time=T, **{**BASE, "pcie_width": 4, "temperature_c": 88})  # type: ignore[arg-type]
    assert codes(r, cfg=cfg) == {"pcie-link-degraded": State.UNHEALTHY}


@pytest.mark.parametrize(("xid", "disposition", "code", "severity", "action"), [
    (79, "latch", "xid-79", State.UNHEALTHY, "reboot-node"),
    (48, "latch", "xid-48", State.UNHEALTHY, "reset-gpu"),
    (64, "latch", "xid-64", State.UNHEALTHY, "contact-support"),
    (63, "latch", "xid-63", State.DEGRADED, "reset-gpu"),
    (94, "latch", "xid-94", State.DEGRADED, "reset-gpu"),
    (13, "count", "xid-13-repeated", State.DEGRADED, "contact-support"),
    (31, "count", "xid-31-repeated", State.DEGRADED, "contact-support"),
    (999, "latch", "xid-999", State.DEGRADED, "contact-support"),
])
def test_xid_classes(xid: int, disposition: str, code: str, severity: State, action: str) -> None:
    d, c = classify_event(GpuEvent("GPU-x", "xid", xid, T), CFG)
    assert d == disposition
    assert c is not None and (c.code, c.severity, c.action, c.source) == (code, severity, action, "event")


def test_xid_154_asks_for_a_poll_and_ignored_xids_do_nothing() -> None:
    assert classify_event(GpuEvent("GPU-x", "xid", 154, T), CFG) == ("poll", None)
    cfg = HealthConfig(ignored_xids=frozenset({79}), fatal_xids=frozenset())
    assert classify_event(GpuEvent("GPU-x", "xid", 79, T), cfg) == ("ignore", None)


def test_configured_classes_move_an_xid() -> None:
    cfg = HealthConfig(fatal_xids=frozenset({13}), application_xids=frozenset())
    d, c = classify_event(GpuEvent("GPU-x", "xid", 13, T), cfg)
    assert d == "latch" and c is not None and c.severity == State.UNHEALTHY


def test_ecc_and_unavailable_events() -> None:
    d, c = classify_event(GpuEvent("GPU-x", "ecc-dbe", 0, T), CFG)
    assert d == "latch" and c is not None and c.code == "ecc-uncorrected"
    d, c = classify_event(GpuEvent("GPU-x", "gpu-unavailable", 0, T), CFG)
    assert d == "latch" and c is not None and c.code == "gpu-unavailable"


def _spec(c: Condition, cfg: HealthConfig = CFG) -> ReasonSpec:
    """The REASONS row that documents ``c``. XID codes carry their number; the row is chosen by the XID's class
    (not by the severity under test, which would make the comparison circular)."""
    m = re.fullmatch(r"xid-(\d+)(-repeated)?", c.code)
    rows = [s for s in REASONS if s.code == c.code]  # a row of its own (xid-79) wins over its class's row
    if m is not None and not rows:
        cls = xid_class(int(m.group(1)), cfg)
        generic = "xid-<n>-repeated" if m.group(2) else "xid-<n>"
        rows = [s for s in REASONS if s.code == generic and s.xid_class == cls]
    assert len(rows) == 1, f"{c.code}: {len(rows)} rows in REASONS document it"
    return rows[0]


def _emitted() -> list[tuple[str, Condition]]:
    """Every condition the default policy can produce, with the scenario that produced it."""
    out: list[tuple[str, Condition]] = []
    for signals, _ in POLLED_TABLE:
        for c in evaluate_reading(Reading(time=T, **{**BASE, **signals}), None, CFG):  # type: ignore[arg-type]
            out.append((f"poll {signals}", c))
    rates = [  # rules that need a previous reading: (name, previous, current)
        ("pcie replays", Reading(time=T, **{**BASE, "pcie_replay_count": 0}),  # type: ignore[arg-type]
         Reading(time=T + 60, **{**BASE, "pcie_replay_count": 1000})),  # type: ignore[arg-type]
        ("nvlink errors", Reading(time=T, nvlink_error_count=5), Reading(time=T + 5, nvlink_error_count=6)),
    ]
    for name, prev, cur in rates:
        out += [(f"rate {name}", c) for c in evaluate_reading(cur, prev, CFG)]
    opt_in = HealthConfig(ecc_corrected_limit=100, ecc_corrected_rate_per_min=10.0)  # rules off by default
    out += [("corrected ECC rules", c) for c in evaluate_reading(
        Reading(time=T + 60, ecc_corrected_volatile=101), Reading(time=T, ecc_corrected_volatile=0), opt_in)]
    events = [GpuEvent("GPU-x", "xid", x, T) for x in sorted(FATAL_XIDS | DEGRADED_XIDS | APPLICATION_XIDS)]
    events += [GpuEvent("GPU-x", "xid", 999, T), GpuEvent("GPU-x", "ecc-dbe", 0, T),
               GpuEvent("GPU-x", "gpu-unavailable", 0, T)]
    for e in events:
        _, ec = classify_event(e, CFG)
        assert ec is not None, f"{e.kind} {e.code} produced no condition"
        out.append((f"event {e.kind} {e.code}", ec))
    missing = inventory_condition([(0, 0x18, 0), (0, 0x28, 0)], [(0, 0x18, 0)], 1, None, CFG)
    assert missing is not None
    out.append(("inventory: a GPU on the bus that NVML does not list", missing))
    return out


EMITTED = _emitted()
# Codes whose REASONS row (docs/reasons.md) is known to disagree with the policy: strict xfails, so a fix turns them
# red here. Empty since issue 12 gave xid-79, xid-64, xid-95 and unclassified XIDs rows of their own.
KNOWN_MISMATCH: dict[str, str] = {}


def test_every_policy_code_is_in_reasons_and_every_reason_row_is_reachable() -> None:
    emitted = {c.code for _, c in EMITTED}
    assert set(KNOWN_MISMATCH) <= emitted  # else the entry is stale: drop it
    reached = {_spec(c) for _, c in EMITTED if c.code not in KNOWN_MISMATCH}
    # nvml-error and flapping come from the tracker (test_every_tracker_code_has_a_reasons_row), nvml-stalled from the
    # monitor (its stall watch, the backend's skipped checks: tests/unit/test_nvml_realpynvml.py), the recovery-check
    # rows from the tracker's gate (tests/unit/test_return_to_service.py), busy-unallocated from the monitor's busy
    # watch (tests/unit/test_busy_unallocated.py), not the policy.
    unreached = {s.code for s in REASONS if s not in reached} - {"nvml-error", "flapping", "nvml-stalled",
                                                                 "nvml-check-unavailable", "recovery-check-failed",
                                                                 "recovery-check-pending", "busy-unallocated"}
    assert not unreached, f"REASONS rows no policy scenario produces: {sorted(unreached)}"


@pytest.mark.parametrize(("scenario", "condition"), [
    pytest.param(s, c, id=f"{c.code}:{s}", marks=[pytest.mark.xfail(strict=True, reason=KNOWN_MISMATCH[c.code])]
                 if c.code in KNOWN_MISMATCH else []) for s, c in EMITTED])
def test_emitted_severity_action_and_source_match_reasons(scenario: str, condition: Condition) -> None:
    spec = _spec(condition)
    assert (condition.severity, condition.action) == (spec.severity, spec.action), (
        f"{scenario}: policy gives {condition.code} {condition.severity.value}/{condition.action}, "
        f"REASONS (docs/reasons.md) says {spec.severity.value}/{spec.action}")
    assert condition.source in spec.source.split("/")
    assert spec.action in ACTIONS


# REASONS is the only source of a code's severity and action -----------------------------------------------------

def _tracker_emitted() -> list[tuple[str, Reason]]:
    """The reasons only the tracker makes (nvml-error, flapping), each from the scenario that makes it."""
    out: list[tuple[str, Reason]] = []
    t = DeviceTracker("g", HealthConfig(nvml_error_polls=2))
    for now in (1.0, 2.0):
        t.observe_reading(Reading(time=now, errors=(("temperature", "NVML_ERROR_UNKNOWN"),)))
    out += [("nvml errors", r) for r in t.update(2.0).reasons]
    t = DeviceTracker("g", HealthConfig(clear_after_polls=1, flap_max=1, flap_window_s=600, flap_backoff_s=300))
    for now, down in ((1.0, (0,)), (2.0, ()), (3.0, (0,)), (4.0, ())):
        t.observe_reading(Reading(time=now, **{**BASE, "nvlink_down": down}))  # type: ignore[arg-type]
        verdict = t.update(now)
    out += [("flapping link", r) for r in verdict.reasons]
    return out


def test_every_tracker_code_has_a_reasons_row() -> None:
    emitted = {r.code for _, r in _tracker_emitted()}
    assert emitted == {"nvml-error", "flapping"}
    for code in emitted:
        assert (SPECS[code].action, SPECS[code].source) == (Action.CONTACT_SUPPORT, Source.POLL)


def test_the_index_holds_every_row_once() -> None:
    assert sorted(map(repr, [*SPECS.values(), *XID_SPECS.values()])) == sorted(map(repr, REASONS))


def _shifted(spec: ReasonSpec) -> ReasonSpec:
    """The row with another severity (never Healthy) and another action than it has."""
    states = [State.DEGRADED, State.UNKNOWN, State.UNHEALTHY]
    severity = states[(states.index(spec.severity) + 1) % len(states)] if spec.severity in states else states[0]
    return replace(spec, severity=severity, action=ACTIONS[(ACTIONS.index(spec.action) + 1) % len(ACTIONS)])


def test_severity_and_action_are_read_from_reasons_not_written_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # Change every row: a severity or action written again in the policy or the tracker keeps its old value here.
    for index in (SPECS, XID_SPECS):
        for key, spec in index.items():
            monkeypatch.setitem(index, key, _shifted(spec))
    for scenario, c in _emitted():
        want = _shifted(_spec(c))
        severity = CFG.unknown_xid_state if want.xid_class == "unknown" else want.severity
        assert (c.severity, c.action) == (severity, want.action), f"{scenario}: {c}"
    tracked = _tracker_emitted()
    assert {r.code for _, r in tracked} == {"nvml-error", "flapping"}
    for scenario, r in tracked:
        want = _shifted(next(s for s in REASONS if s.code == r.code))  # the row as written, not as patched
        assert r.action == want.action, f"{scenario}: {r}"
        if r.code == "nvml-error":  # flapping holds the worst recent state instead: its row documents the default
            assert r.severity == want.severity, f"{scenario}: {r}"


def test_overrides_still_apply_after_the_row() -> None:
    cfg = HealthConfig(overrides={"xid-79": "Degraded", "gpu-unavailable": "ignore"})
    d, c = classify_event(GpuEvent("GPU-x", EventKind.XID, 79, T), cfg)
    assert d is Disposition.LATCH and c is not None
    assert (c.severity, c.action) == (State.DEGRADED, SPECS["xid-79"].action)
    assert classify_event(GpuEvent("GPU-x", EventKind.GPU_UNAVAILABLE, 0, T), cfg) == (Disposition.IGNORE, None)


def test_an_xid_moved_out_of_its_rows_class_gets_its_new_class_row() -> None:
    cfg = HealthConfig(fatal_xids=FATAL_XIDS - {79}, degraded_xids=DEGRADED_XIDS | {79})
    _, c = classify_event(GpuEvent("GPU-x", EventKind.XID, 79, T), cfg)
    assert c is not None and (c.severity, c.action) == (XID_SPECS["degraded"].severity, XID_SPECS["degraded"].action)


def test_unknown_xid_state_sets_the_unknown_class_severity() -> None:
    _, c = classify_event(GpuEvent("GPU-x", EventKind.XID, 999, T), HealthConfig(unknown_xid_state=State.UNHEALTHY))
    assert c is not None and (c.severity, c.action) == (State.UNHEALTHY, XID_SPECS["unknown"].action)


def test_values_read_back_are_the_enum_members() -> None:
    r = Reason("xid-79", State.UNHEALTHY, "m", Source.EVENT, Action.REBOOT_NODE, 1.0)
    back = Reason.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r and back.source is Source.EVENT and back.action is Action.REBOOT_NODE
    assert json.dumps(r.to_dict()) == ('{"code": "xid-79", "severity": "Unhealthy", "message": "m", "source": "event", '
                                       '"action": "reboot-node", "first_seen": 1.0}')


@pytest.mark.parametrize(("rule", "expected"), [
    ({"xid-13": "ignore"}, None),
    ({"xid-13-repeated": "ignore"}, None),
    ({"xid-13": "Unhealthy"}, State.UNHEALTHY),
    ({"xid-13-repeated": "Unhealthy"}, State.UNHEALTHY),
    ({}, State.DEGRADED),
])
def test_overrides_reach_repeated_application_xids(rule: dict[str, str], expected: State | None) -> None:
    """docs/config.md: a rule for xid-13 also covers xid-13-repeated. The repeat counter once bypassed overrides,
    so neither an ignore nor a changed state had any effect on application XIDs."""
    cfg = replace(CFG, overrides=rule)
    tracker = DeviceTracker("g", cfg)
    for i in range(cfg.app_xid_repeat_threshold):
        tracker.observe_event(GpuEvent("g", EventKind.XID, 13, T + i))
    state, reasons = tracker.update(T + 10)
    codes = {r.code: r.severity for r in reasons}
    if expected is None:
        assert "xid-13-repeated" not in codes and state is State.HEALTHY
    else:
        assert codes["xid-13-repeated"] is expected and state is expected
