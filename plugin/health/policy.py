"""The health policy: a pure function from readings and events to conditions. No clock, no I/O.

Defaults follow NVIDIA's XID classes and DCGM's health-watch thresholds (see docs/health.md); every number and
class can be overridden from the config file's ``health`` section.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum

from plugin.devices.kmsg import PciAddress, pci_text
from plugin.devices.model import EventKind, EventOrigin, GpuEvent, Reading
from plugin.health.config import HealthConfig
from plugin.health.reasons import SPECS, Condition, Source, State, xid_spec

# Replay rate DCGM tolerates per lane per minute, by PCIe generation.
PCIE_REPLAY_PER_LANE_PER_MIN = {1: 0.12, 2: 0.24, 3: 0.48, 4: 0.96, 5: 1.92, 6: 3.84}

# Conditions that fire on a counter's growth between two polls rather than on a level: they are held for
# ``rate_hold_s`` after the growth stops (tracker), since the next clean poll says nothing about the hardware.
RATE_CODES = frozenset({"pcie-replay-rate", "nvlink-errors", "ecc-corrected-rate"})


class Disposition(StrEnum):
    """What the tracker does with a driver event."""

    LATCH = "latch"  # hold the condition until a reset is seen or its hold time passes
    COUNT = "count"  # an application XID: count repeats, latch only beyond the threshold
    POLL = "poll"  # the event only says a poll is due now
    IGNORE = "ignore"


def condition(code: str, message: str, source: Source) -> Condition:
    """A condition for a code with a REASONS row of its own: the row gives its severity and action."""
    spec = SPECS[code]
    return Condition(code, spec.severity, message, source, spec.action)


def _apply_override(c: Condition, cfg: HealthConfig) -> Condition | None:
    o = cfg.overrides.get(c.code)
    if o is None:
        # xid-13-repeated also answers to a rule written for xid-13.
        base = c.code.removesuffix("-repeated")
        o = cfg.overrides.get(base) if base != c.code else None
    if o is None:
        return c
    if o == "ignore":
        return None
    return Condition(c.code, State(o), c.message, c.source, c.action)


def evaluate_reading(reading: Reading, previous: Reading | None, cfg: HealthConfig) -> list[Condition]:
    """Conditions that one poll shows. ``previous`` (the last good poll) drives rate rules."""
    out: list[Condition] = []

    def add(code: str, msg: str) -> None:
        out.append(condition(code, msg, Source.POLL))

    r = reading
    if r.lost:
        add("gpu-lost", "NVML reports the GPU is lost")
        return _filtered(out, cfg)
    if r.reset_required:
        add("reset-required", "NVML reports a GPU reset is required")
    if r.ecc_uncorrected_volatile:
        add("ecc-uncorrected", f"{r.ecc_uncorrected_volatile} volatile uncorrected ECC errors")
    if cfg.ecc_corrected_limit is not None and (r.ecc_corrected_volatile or 0) > cfg.ecc_corrected_limit:
        add("ecc-corrected-high",
            f"{r.ecc_corrected_volatile} volatile corrected ECC errors (limit {cfg.ecc_corrected_limit})")
    if (cfg.ecc_corrected_rate_per_min is not None and previous is not None and r.time > previous.time
            and r.ecc_corrected_volatile is not None and previous.ecc_corrected_volatile is not None):
        grown = r.ecc_corrected_volatile - previous.ecc_corrected_volatile
        per_min = grown / ((r.time - previous.time) / 60.0)
        if grown > 0 and per_min > cfg.ecc_corrected_rate_per_min:
            add("ecc-corrected-rate",
                f"corrected ECC errors at {per_min:.1f}/min (limit {cfg.ecc_corrected_rate_per_min:g}/min)")
    if r.row_remap_failure:
        add("row-remap-failure", "row remapping failed")
    if r.row_remap_pending:
        add("row-remap-pending", "row remap pending until the next GPU reset")
    if r.retired_pages_pending:
        add("retired-pages-pending", "page retirement pending until the next GPU reset")
    if r.retired_pages_count is not None and r.retired_pages_count >= cfg.retired_pages_limit:
        add("retired-pages-limit", f"{r.retired_pages_count} retired pages (limit {cfg.retired_pages_limit})")
    thermal = False
    if r.temperature_c is not None:
        if r.temperature_shutdown_c is not None and r.temperature_c >= r.temperature_shutdown_c:
            add("temperature-shutdown",
                f"{r.temperature_c} C at or above the shutdown threshold {r.temperature_shutdown_c} C")
        elif r.temperature_slowdown_c is not None and r.temperature_c >= r.temperature_slowdown_c:
            thermal = True
            add("thermal-slowdown",
                f"{r.temperature_c} C at or above the slowdown threshold {r.temperature_slowdown_c} C")
    reasons = r.clock_event_reasons or frozenset()
    if not thermal and reasons & {"sw_thermal_slowdown", "hw_thermal_slowdown"}:
        add("thermal-slowdown",
            "thermal clock slowdown active (" + ", ".join(sorted(reasons & {"sw_thermal_slowdown",
                                                                            "hw_thermal_slowdown"})) + ")")
    if "hw_slowdown" in reasons:
        add("hw-slowdown", "hardware clock slowdown active")
    if "hw_power_brake_slowdown" in reasons:
        add("power-brake", "hardware power-brake slowdown active")
    if r.pcie_width is not None and r.pcie_max_width is not None and r.pcie_width < r.pcie_max_width:
        add("pcie-link-degraded", f"PCIe link x{r.pcie_width} of x{r.pcie_max_width}")
    elif (r.pcie_gen is not None and r.pcie_max_gen is not None and r.pcie_gen < r.pcie_max_gen
          and (cfg.check_pcie_gen_when_idle or not r.gpu_idle)):
        # An idle GPU lowers its link generation to save power; only a busy one at a lower gen is degraded.
        add("pcie-link-degraded", f"PCIe link gen{r.pcie_gen} of gen{r.pcie_max_gen}")
    if (previous is not None and r.pcie_replay_count is not None and previous.pcie_replay_count is not None
            and r.time > previous.time):
        grown = r.pcie_replay_count - previous.pcie_replay_count
        minutes = (r.time - previous.time) / 60.0
        lanes = r.pcie_width or r.pcie_max_width or 16
        per_lane = PCIE_REPLAY_PER_LANE_PER_MIN.get(r.pcie_gen or 5, 1.92)
        if grown > 0 and grown / minutes > per_lane * lanes:
            add("pcie-replay-rate", f"PCIe replays at {grown / minutes:.1f}/min (limit {per_lane * lanes:.1f}/min)")
    expected = cfg.nvlink_expected_links.get(r.model) if r.model else None
    untrained = expected is not None and r.nvlink_active_count is not None and r.nvlink_active_count < expected
    if r.nvlink_down or untrained:
        parts = []
        if r.nvlink_down:
            parts.append("link " + ", ".join(map(str, r.nvlink_down)))
        if untrained:
            parts.append(f"{r.nvlink_active_count} of {expected} links active (health.nvlinkExpectedLinks)")
        add("nvlink-down", "NVLink down: " + "; ".join(parts))
    if (previous is not None and r.nvlink_error_count is not None and previous.nvlink_error_count is not None
            and r.nvlink_error_count > previous.nvlink_error_count):
        add("nvlink-errors",
            f"NVLink replay/recovery errors grew by {r.nvlink_error_count - previous.nvlink_error_count}")
    if r.recovery_action in ("gpu_reset", "drain_and_reset", "bus_reset"):
        add("recovery-action-reset", f"driver recovery action {r.recovery_action}")
    elif r.recovery_action in ("node_reboot", "system_reboot"):
        add("recovery-action-reboot", f"driver recovery action {r.recovery_action}")
    elif r.recovery_action == "drain_p2p":
        add("recovery-action-drain-p2p", "driver recovery action drain_p2p")
    elif r.recovery_action == "recover_imex_domain":
        add("recovery-action-imex", "driver recovery action recover_imex_domain")
    elif r.recovery_action == "unknown":
        code = f" {r.recovery_action_code}" if r.recovery_action_code is not None else ""
        add("recovery-action-unknown", f"driver recovery action{code}, unknown to this release")
    if r.fabric_health == "unhealthy":
        add("fabric-unhealthy", "NVSwitch fabric unhealthy")
    elif r.fabric_health == "limited_capacity":
        add("fabric-limited", "NVSwitch fabric at limited capacity")
    return _filtered(out, cfg)


def inventory_condition(on_bus: Iterable[PciAddress] | None, in_nvml: Iterable[PciAddress], nvml_count: int,
                        expected: int | None, cfg: HealthConfig,
                        logged: Mapping[PciAddress, str] | None = None) -> Condition | None:
    """The node's ``gpu-missing``, if the bus, the kernel log or the expected count says a GPU is missing from NVML:
    GPUs on the bus (None: the bus could not be read) that NVML does not list, GPUs the kernel log wrote about
    (``logged``: address -> the kind of line) that NVML does not list, and NVML's count against ``expected``."""
    parts = []
    seen = set(in_nvml)
    missing = sorted(set(on_bus) - seen) if on_bus is not None else []
    if missing:
        shown = ", ".join(pci_text(a) for a in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8
                                                                 else "")
        parts.append(f"{len(missing)} GPU{'' if len(missing) == 1 else 's'} on the PCI bus not seen by NVML: {shown}")
    named = sorted(a for a in (logged or {}) if a not in seen and a not in missing)
    if named:
        parts.append("the kernel log names " + ", ".join(f"{pci_text(a)} ({(logged or {})[a]})" for a in named[:8])
                     + (f" and {len(named) - 8} more" if len(named) > 8 else "") + ", which NVML does not list")
    if expected is not None and nvml_count < expected:
        parts.append(f"NVML sees {nvml_count} of the {expected} GPUs expected")
    if not parts:
        return None
    found = _filtered([condition("gpu-missing", "; ".join(parts), Source.POLL)], cfg)
    return found[0] if found else None


def _filtered(conditions: list[Condition], cfg: HealthConfig) -> list[Condition]:
    return [c2 for c in conditions if (c2 := _apply_override(c, cfg)) is not None]


def xid_class(xid: int, cfg: HealthConfig) -> str:
    if xid in cfg.ignored_xids:
        return "ignored"
    if xid in cfg.fatal_xids:
        return "fatal"
    if xid in cfg.degraded_xids:
        return "degraded"
    if xid in cfg.application_xids:
        return "application"
    return "unknown"


def classify_event(event: GpuEvent, cfg: HealthConfig) -> tuple[Disposition, Condition | None]:
    """Return (disposition, condition); the condition is None for ``poll`` and ``ignore``. An event read from the
    kernel log is judged exactly as NVML's; only its reason's source says where it was seen."""
    src = Source.KERNEL_LOG if event.origin == EventOrigin.KERNEL_LOG else Source.EVENT
    if event.kind == EventKind.XID:
        xid = event.code
        cls = xid_class(xid, cfg)
        if cls == "ignored":
            return Disposition.IGNORE, None
        if cls == "application":
            spec = xid_spec(xid, cls)
            counted = _apply_override(Condition(f"xid-{xid}-repeated", spec.severity,
                                                f"XID {xid} repeated on this GPU", src, spec.action), cfg)
            return (Disposition.COUNT, counted) if counted is not None else (Disposition.IGNORE, None)
        if xid == 154:
            return Disposition.POLL, None  # "recovery action changed": the recovery-action field says what to do
        spec = xid_spec(xid, cls)
        severity = spec.severity
        if cls == "fatal":
            message = f"fatal XID {xid}"
        elif cls == "degraded":
            message = f"XID {xid}: takes effect at the next GPU reset"
        else:
            # The unknown class's row documents unknownXidState's default; the configured state is what counts.
            severity, message = cfg.unknown_xid_state, f"XID {xid} (not in any configured class)"
        return _latched(Condition(f"xid-{xid}", severity, message, src, spec.action), cfg)
    if event.kind == EventKind.ECC_DBE:
        return _latched(condition("ecc-uncorrected", "double-bit ECC error event", src), cfg)
    if event.kind == EventKind.GPU_UNAVAILABLE:
        return _latched(condition("gpu-unavailable", "driver reports the GPU unavailable", src), cfg)
    if event.kind == EventKind.RECOVERY_ACTION:
        return Disposition.POLL, None
    return Disposition.IGNORE, None


def _latched(c: Condition, cfg: HealthConfig) -> tuple[Disposition, Condition | None]:
    c2 = _apply_override(c, cfg)
    return (Disposition.LATCH, c2) if c2 is not None else (Disposition.IGNORE, None)
