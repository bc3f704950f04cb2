"""Device states, reasons and the one table of reason codes that code and docs share."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class State(StrEnum):
    HEALTHY = "Healthy"
    DEGRADED = "Degraded"
    UNKNOWN = "Unknown"
    UNHEALTHY = "Unhealthy"

    @property
    def rank(self) -> int:
        # Unknown sits between Degraded and Unhealthy: not knowing is worse than a known, usable fault.
        return _RANK[self]

    @staticmethod
    def worst(*states: State) -> State:
        return max(states, key=lambda s: s.rank, default=State.HEALTHY)


_RANK = {State.HEALTHY: 0, State.DEGRADED: 1, State.UNKNOWN: 2, State.UNHEALTHY: 3}

ACTIONS = ("none", "restart-app", "drain", "reset-gpu", "reboot-node", "contact-support")


@dataclass(frozen=True)
class Condition:
    """What the policy concludes from one signal: a stable code, the state it asks for, and what to do."""

    code: str
    severity: State
    message: str
    source: str  # "event" or "poll"
    action: str = "none"


@dataclass(frozen=True)
class Reason:
    """A condition as a device carries it: with the time it was first seen."""

    code: str
    severity: State
    message: str
    source: str
    action: str
    first_seen: float

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "severity": self.severity.value, "message": self.message,
                "source": self.source, "action": self.action, "first_seen": self.first_seen}

    @staticmethod
    def from_dict(d: dict[str, object]) -> Reason:
        return Reason(code=str(d["code"]), severity=State(str(d["severity"])), message=str(d["message"]),
                      source=str(d["source"]), action=str(d["action"]),
                      first_seen=float(d["first_seen"]))  # type: ignore[arg-type]

    @staticmethod
    def of(c: Condition, first_seen: float) -> Reason:
        return Reason(c.code, c.severity, c.message, c.source, c.action, first_seen)


@dataclass(frozen=True)
class ReasonSpec:
    code: str
    severity: State
    action: str
    source: str
    description: str
    # For the generic XID rows: the XID class (health.xid) the row documents, so a row is found by what an XID is
    # configured as, not by the state it happens to produce.
    xid_class: str = ""


# The reason-code table. docs/reasons.md is generated from it (scripts/gen_docs.py) so the two cannot drift.
REASONS: tuple[ReasonSpec, ...] = (
    ReasonSpec("xid-<n>", State.UNHEALTHY, "reset-gpu", "event",
               "A fatal XID (class `fatal`). Latched until the GPU is seen reset or the Unhealthy hold time passes.",
               "fatal"),
    ReasonSpec("xid-79", State.UNHEALTHY, "reboot-node", "event",
               "XID 79, the GPU fell off the bus: only a node reboot brings it back. Latched like every fatal XID."),
    ReasonSpec("xid-64", State.UNHEALTHY, "contact-support", "event",
               "XID 64, the GPU could not record a page retirement or row remap: a reset does not mend it. Latched."),
    ReasonSpec("xid-95", State.UNHEALTHY, "contact-support", "event",
               "XID 95, an uncontained ECC error: a recurring one means the memory is failing. Latched."),
    ReasonSpec("xid-<n>", State.DEGRADED, "reset-gpu", "event",
               "A degraded-class XID (63, 92, 94, 156 by default): usable, reset when convenient. Latched.",
               "degraded"),
    ReasonSpec("xid-<n>", State.DEGRADED, "contact-support", "event",
               "An XID in no configured class: the state is `unknownXidState` (Degraded by default). Latched.",
               "unknown"),
    ReasonSpec("xid-<n>-repeated", State.DEGRADED, "contact-support", "event",
               "An application-class XID (13, 31, 43, ...) repeated on one GPU beyond the threshold in the window.",
               "application"),
    ReasonSpec("ecc-uncorrected", State.UNHEALTHY, "reset-gpu", "poll/event",
               "Volatile uncorrected (double-bit) ECC errors, or a double-bit ECC event."),
    ReasonSpec("ecc-corrected-high", State.DEGRADED, "none", "poll",
               "Volatile corrected ECC count above `eccCorrectedLimit` (off by default)."),
    ReasonSpec("ecc-corrected-rate", State.DEGRADED, "none", "poll",
               "Corrected ECC errors growing faster than `eccCorrectedRatePerMinute` (off by default); held for "
               "`rateHoldSeconds` after the burst."),
    ReasonSpec("row-remap-pending", State.DEGRADED, "reset-gpu", "poll", "A row remap waits for the next GPU reset."),
    ReasonSpec("row-remap-failure", State.UNHEALTHY, "contact-support", "poll", "Row remapping failed: RMA."),
    ReasonSpec("retired-pages-pending", State.DEGRADED, "reset-gpu", "poll",
               "A page retirement waits for the next GPU reset (pre-Ampere)."),
    ReasonSpec("retired-pages-limit", State.UNHEALTHY, "contact-support", "poll",
               "Retired pages reached `retiredPagesLimit` (63)."),
    ReasonSpec("thermal-slowdown", State.DEGRADED, "none", "poll",
               "Temperature at or above the slowdown threshold, or thermal clock slowdown active."),
    ReasonSpec("temperature-shutdown", State.UNHEALTHY, "contact-support", "poll",
               "Temperature at or above the shutdown threshold."),
    ReasonSpec("hw-slowdown", State.DEGRADED, "none", "poll", "Hardware clock slowdown active."),
    ReasonSpec("power-brake", State.DEGRADED, "none", "poll", "Hardware power-brake slowdown active."),
    ReasonSpec("pcie-link-degraded", State.DEGRADED, "reset-gpu", "poll",
               "PCIe link width below its maximum, or generation below its maximum while the GPU is busy."),
    ReasonSpec("pcie-replay-rate", State.DEGRADED, "contact-support", "poll",
               "PCIe replay counter grows faster than the per-lane rate for the link generation; held for "
               "`rateHoldSeconds` after the growth stops."),
    ReasonSpec("nvlink-down", State.UNHEALTHY, "reset-gpu", "poll", "One or more NVLink links are down."),
    ReasonSpec("nvlink-errors", State.DEGRADED, "contact-support", "poll",
               "NVLink replay/recovery error counters grew since the last poll; held for `rateHoldSeconds` after "
               "they stop."),
    ReasonSpec("recovery-action-reset", State.UNHEALTHY, "reset-gpu", "poll",
               "The driver asks for a GPU reset (GPU_RESET or DRAIN_AND_RESET)."),
    ReasonSpec("recovery-action-reboot", State.UNHEALTHY, "reboot-node", "poll",
               "The driver asks for a node reboot."),
    ReasonSpec("recovery-action-drain-p2p", State.DEGRADED, "drain", "poll",
               "The driver asks to drain peer-to-peer traffic."),
    ReasonSpec("fabric-unhealthy", State.UNHEALTHY, "contact-support", "poll", "NVSwitch fabric reports unhealthy."),
    ReasonSpec("fabric-limited", State.DEGRADED, "contact-support", "poll",
               "NVSwitch fabric reports limited capacity."),
    ReasonSpec("gpu-lost", State.UNHEALTHY, "reboot-node", "poll", "NVML reports the GPU lost (fallen off the bus)."),
    ReasonSpec("gpu-unavailable", State.UNHEALTHY, "reset-gpu", "event", "The driver reports the GPU unavailable."),
    ReasonSpec("reset-required", State.UNHEALTHY, "reset-gpu", "poll", "NVML reports a GPU reset is required."),
    ReasonSpec("nvml-error", State.UNKNOWN, "contact-support", "poll",
               "NVML calls on this GPU failed for `nvmlErrorPolls` consecutive polls."),
    ReasonSpec("flapping", State.DEGRADED, "contact-support", "poll",
               "The device changed state more than `flapMax` times in `flapWindowSeconds`; it holds its worst "
               "recent state for `flapBackoffSeconds`."),
)
