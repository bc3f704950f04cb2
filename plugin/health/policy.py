"""The health policy: a pure function from readings and events to conditions. No clock, no I/O.

Defaults follow NVIDIA's XID classes and DCGM's health-watch thresholds (see docs/health.md); every number and
class can be overridden from the config file's ``health`` section.
"""

from __future__ import annotations

from plugin.devices.model import GpuEvent, Reading
from plugin.health.config import HealthConfig
from plugin.health.reasons import Condition, State

# Replay rate DCGM tolerates per lane per minute, by PCIe generation.
PCIE_REPLAY_PER_LANE_PER_MIN = {1: 0.12, 2: 0.24, 3: 0.48, 4: 0.96, 5: 1.92, 6: 3.84}

# Conditions that fire on a counter's growth between two polls rather than on a level: they are held for
# ``rate_hold_s`` after the growth stops (tracker), since the next clean poll says nothing about the hardware.
RATE_CODES = frozenset({"pcie-replay-rate", "nvlink-errors", "ecc-corrected-rate"})


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

    def add(code: str, sev: State, msg: str, action: str) -> None:
        out.append(Condition(code, sev, msg, "poll", action))

    r = reading
    if r.lost:
        add("gpu-lost", State.UNHEALTHY, "NVML reports the GPU is lost", "reboot-node")
        return _filtered(out, cfg)
    if r.reset_required:
        add("reset-required", State.UNHEALTHY, "NVML reports a GPU reset is required", "reset-gpu")
    if r.ecc_uncorrected_volatile:
        add("ecc-uncorrected", State.UNHEALTHY,
            f"{r.ecc_uncorrected_volatile} volatile uncorrected ECC errors", "reset-gpu")
    if cfg.ecc_corrected_limit is not None and (r.ecc_corrected_volatile or 0) > cfg.ecc_corrected_limit:
        add("ecc-corrected-high", State.DEGRADED,
            f"{r.ecc_corrected_volatile} volatile corrected ECC errors (limit {cfg.ecc_corrected_limit})", "none")
    if (cfg.ecc_corrected_rate_per_min is not None and previous is not None and r.time > previous.time
            and r.ecc_corrected_volatile is not None and previous.ecc_corrected_volatile is not None):
        grown = r.ecc_corrected_volatile - previous.ecc_corrected_volatile
        per_min = grown / ((r.time - previous.time) / 60.0)
        if grown > 0 and per_min > cfg.ecc_corrected_rate_per_min:
            add("ecc-corrected-rate", State.DEGRADED,
                f"corrected ECC errors at {per_min:.1f}/min (limit {cfg.ecc_corrected_rate_per_min:g}/min)", "none")
    if r.row_remap_failure:
        add("row-remap-failure", State.UNHEALTHY, "row remapping failed", "contact-support")
    if r.row_remap_pending:
        add("row-remap-pending", State.DEGRADED, "row remap pending until the next GPU reset", "reset-gpu")
    if r.retired_pages_pending:
        add("retired-pages-pending", State.DEGRADED, "page retirement pending until the next GPU reset",
            "reset-gpu")
    if r.retired_pages_count is not None and r.retired_pages_count >= cfg.retired_pages_limit:
        add("retired-pages-limit", State.UNHEALTHY,
            f"{r.retired_pages_count} retired pages (limit {cfg.retired_pages_limit})", "contact-support")
    thermal = False
    if r.temperature_c is not None:
        if r.temperature_shutdown_c is not None and r.temperature_c >= r.temperature_shutdown_c:
            add("temperature-shutdown", State.UNHEALTHY,
                f"{r.temperature_c} C at or above the shutdown threshold {r.temperature_shutdown_c} C",
                "contact-support")
        elif r.temperature_slowdown_c is not None and r.temperature_c >= r.temperature_slowdown_c:
            thermal = True
            add("thermal-slowdown", State.DEGRADED,
                f"{r.temperature_c} C at or above the slowdown threshold {r.temperature_slowdown_c} C", "none")
    reasons = r.clock_event_reasons or frozenset()
    if not thermal and reasons & {"sw_thermal_slowdown", "hw_thermal_slowdown"}:
        add("thermal-slowdown", State.DEGRADED,
            "thermal clock slowdown active (" + ", ".join(sorted(reasons & {"sw_thermal_slowdown",
                                                                            "hw_thermal_slowdown"})) + ")", "none")
    if "hw_slowdown" in reasons:
        add("hw-slowdown", State.DEGRADED, "hardware clock slowdown active", "none")
    if "hw_power_brake_slowdown" in reasons:
        add("power-brake", State.DEGRADED, "hardware power-brake slowdown active", "none")
    if r.pcie_width is not None and r.pcie_max_width is not None and r.pcie_width < r.pcie_max_width:
        add("pcie-link-degraded", State.DEGRADED, f"PCIe link x{r.pcie_width} of x{r.pcie_max_width}", "reset-gpu")
    elif (r.pcie_gen is not None and r.pcie_max_gen is not None and r.pcie_gen < r.pcie_max_gen
          and (cfg.check_pcie_gen_when_idle or not r.gpu_idle)):
        # An idle GPU lowers its link generation to save power; only a busy one at a lower gen is degraded.
        add("pcie-link-degraded", State.DEGRADED, f"PCIe link gen{r.pcie_gen} of gen{r.pcie_max_gen}", "reset-gpu")
    if (previous is not None and r.pcie_replay_count is not None and previous.pcie_replay_count is not None
            and r.time > previous.time):
        grown = r.pcie_replay_count - previous.pcie_replay_count
        minutes = (r.time - previous.time) / 60.0
        lanes = r.pcie_width or r.pcie_max_width or 16
        per_lane = PCIE_REPLAY_PER_LANE_PER_MIN.get(r.pcie_gen or 5, 1.92)
        if grown > 0 and grown / minutes > per_lane * lanes:
            add("pcie-replay-rate", State.DEGRADED,
                f"PCIe replays at {grown / minutes:.1f}/min (limit {per_lane * lanes:.1f}/min)", "contact-support")
    if r.nvlink_down:
        add("nvlink-down", State.UNHEALTHY, "NVLink down: link " + ", ".join(map(str, r.nvlink_down)), "reset-gpu")
    if (previous is not None and r.nvlink_error_count is not None and previous.nvlink_error_count is not None
            and r.nvlink_error_count > previous.nvlink_error_count):
        add("nvlink-errors", State.DEGRADED,
            f"NVLink replay/recovery errors grew by {r.nvlink_error_count - previous.nvlink_error_count}",
            "contact-support")
    if r.recovery_action in ("gpu_reset", "drain_and_reset"):
        add("recovery-action-reset", State.UNHEALTHY, f"driver recovery action {r.recovery_action}", "reset-gpu")
    elif r.recovery_action == "node_reboot":
        add("recovery-action-reboot", State.UNHEALTHY, "driver recovery action node_reboot", "reboot-node")
    elif r.recovery_action == "drain_p2p":
        add("recovery-action-drain-p2p", State.DEGRADED, "driver recovery action drain_p2p", "drain")
    if r.fabric_health == "unhealthy":
        add("fabric-unhealthy", State.UNHEALTHY, "NVSwitch fabric unhealthy", "contact-support")
    elif r.fabric_health == "limited_capacity":
        add("fabric-limited", State.DEGRADED, "NVSwitch fabric at limited capacity", "contact-support")
    return _filtered(out, cfg)


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


def classify_event(event: GpuEvent, cfg: HealthConfig) -> tuple[str, Condition | None]:
    """Return (disposition, condition). Disposition: ``latch`` (hold the condition), ``count`` (application XID:
    the tracker counts repeats), ``poll`` (the event only says a poll is due now), ``ignore``."""
    if event.kind == "xid":
        xid = event.code
        cls = xid_class(xid, cfg)
        if cls == "ignored":
            return "ignore", None
        if cls == "application":
            return "count", Condition(f"xid-{xid}-repeated", State.DEGRADED,
                                      f"XID {xid} repeated on this GPU", "event", "contact-support")
        if xid == 154:
            return "poll", None  # "recovery action changed": the recovery-action field says what to do
        if cls == "fatal":
            action = "reboot-node" if xid == 79 else ("contact-support" if xid in (64, 95) else "reset-gpu")
            c = Condition(f"xid-{xid}", State.UNHEALTHY, f"fatal XID {xid}", "event", action)
        elif cls == "degraded":
            c = Condition(f"xid-{xid}", State.DEGRADED, f"XID {xid}: takes effect at the next GPU reset",
                          "event", "reset-gpu")
        else:
            c = Condition(f"xid-{xid}", cfg.unknown_xid_state, f"XID {xid} (not in any configured class)",
                          "event", "contact-support")
        c2 = _apply_override(c, cfg)
        return ("latch", c2) if c2 is not None else ("ignore", None)
    if event.kind == "ecc-dbe":
        c2 = _apply_override(Condition("ecc-uncorrected", State.UNHEALTHY, "double-bit ECC error event", "event",
                                       "reset-gpu"), cfg)
        return ("latch", c2) if c2 is not None else ("ignore", None)
    if event.kind == "gpu-unavailable":
        c2 = _apply_override(Condition("gpu-unavailable", State.UNHEALTHY, "driver reports the GPU unavailable",
                                       "event", "reset-gpu"), cfg)
        return ("latch", c2) if c2 is not None else ("ignore", None)
    if event.kind == "recovery-action":
        return "poll", None
    return "ignore", None
