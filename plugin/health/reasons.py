"""Device states, reasons and the one table of reason codes that code and docs share.

REASONS is the only place a code's severity and action are written down: the policy and the tracker look a row up
(``SPECS``, ``xid_spec``) for every condition they emit, and docs/reasons.md is rendered from it.
"""

from __future__ import annotations

from collections.abc import Iterable
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


class KubeletHealth(StrEnum):
    """The two states the kubelet knows; health.kubeletHealth maps each State onto one."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


class Action(StrEnum):
    NONE = "none"
    RESTART_APP = "restart-app"
    DRAIN = "drain"
    RESET_GPU = "reset-gpu"
    REBOOT_NODE = "reboot-node"
    CONTACT_SUPPORT = "contact-support"


# Lightest first: docs/reasons.md lists them in this order, and worst_first ranks equally severe reasons by it.
ACTIONS: tuple[Action, ...] = tuple(Action)
_ACTION_RANK = {a: i for i, a in enumerate(ACTIONS)}


class Source(StrEnum):
    """Where a condition was seen. A condition is one or the other; a table row may document both. ``external``:
    another health provider said it (NVSentinel's device API, docs/nvsentinel.md); no table row, its severity and
    action come with it."""

    EVENT = "event"
    POLL = "poll"
    POLL_OR_EVENT = "poll/event"
    EXTERNAL = "external"


@dataclass(frozen=True)
class Condition:
    """What the policy concludes from one signal: a stable code, the state it asks for, and what to do."""

    code: str
    severity: State
    message: str
    source: Source
    action: Action


@dataclass(frozen=True)
class Reason:
    """A condition as a device carries it: with the time it was first seen."""

    code: str
    severity: State
    message: str
    source: Source
    action: Action
    first_seen: float

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "severity": self.severity.value, "message": self.message,
                "source": self.source, "action": self.action, "first_seen": self.first_seen}

    @staticmethod
    def from_dict(d: dict[str, object]) -> Reason:
        return Reason(code=str(d["code"]), severity=State(str(d["severity"])), message=str(d["message"]),
                      source=Source(str(d["source"])), action=Action(str(d["action"])),
                      first_seen=float(d["first_seen"]))  # type: ignore[arg-type]

    @staticmethod
    def of(c: Condition, first_seen: float) -> Reason:
        return Reason(c.code, c.severity, c.message, c.source, c.action, first_seen)


def reason_order(r: Reason) -> tuple[int, int, float, str]:
    """The one meaning of "worst reason first": the most severe; among equally severe ones the heavier action (what
    an operator must do is set by the heaviest remedy asked for); then the one seen first (the earlier fault is
    more often the cause of a later one); then the code, so that equal reasons still have one order."""
    return (-r.severity.rank, -_ACTION_RANK.get(r.action, 0), r.first_seen, r.code)


def worst_first(reasons: Iterable[Reason]) -> tuple[Reason, ...]:
    """Reasons in :func:`reason_order`. A device's status and its transitions hold their reasons in this order
    (health/node_state.py), so every reader takes ``reasons[0]`` as the worst and never sorts again."""
    return tuple(sorted(reasons, key=reason_order))


@dataclass(frozen=True)
class ReasonSpec:
    code: str
    severity: State
    action: Action
    source: Source
    description: str
    # For the XID rows: the XID class (health.xid) the row documents, so a row is found by what an XID is
    # configured as, not by the state it happens to produce. A row of one XID's own (xid-79) holds only while that
    # XID is in its class: moved to another class, the XID gets that class's row.
    xid_class: str = ""


# The reason-code table. docs/reasons.md is generated from it (scripts/gen_docs.py) so the two cannot drift.
REASONS: tuple[ReasonSpec, ...] = (
    ReasonSpec("xid-<n>", State.UNHEALTHY, Action.RESET_GPU, Source.EVENT,
               "A fatal XID (class `fatal`). Latched until the GPU is seen reset or the Unhealthy hold time passes.",
               "fatal"),
    ReasonSpec("xid-79", State.UNHEALTHY, Action.REBOOT_NODE, Source.EVENT,
               "XID 79, the GPU fell off the bus: only a node reboot brings it back. Latched like every fatal XID.",
               "fatal"),
    ReasonSpec("xid-64", State.UNHEALTHY, Action.CONTACT_SUPPORT, Source.EVENT,
               "XID 64, the GPU could not record a page retirement or row remap: a reset does not mend it. Latched.",
               "fatal"),
    ReasonSpec("xid-95", State.UNHEALTHY, Action.CONTACT_SUPPORT, Source.EVENT,
               "XID 95, an uncontained ECC error: a recurring one means the memory is failing. Latched.",
               "fatal"),
    ReasonSpec("xid-<n>", State.DEGRADED, Action.RESET_GPU, Source.EVENT,
               "A degraded-class XID (63, 92, 94, 156 by default): usable, reset when convenient. Latched.",
               "degraded"),
    ReasonSpec("xid-<n>", State.DEGRADED, Action.CONTACT_SUPPORT, Source.EVENT,
               "An XID in no configured class: the state is `unknownXidState` (Degraded by default). Latched.",
               "unknown"),
    ReasonSpec("xid-<n>-repeated", State.DEGRADED, Action.CONTACT_SUPPORT, Source.EVENT,
               "An application-class XID (13, 31, 43, ...) repeated on one GPU beyond the threshold in the window.",
               "application"),
    ReasonSpec("ecc-uncorrected", State.UNHEALTHY, Action.RESET_GPU, Source.POLL_OR_EVENT,
               "Volatile uncorrected (double-bit) ECC errors, or a double-bit ECC event."),
    ReasonSpec("ecc-corrected-high", State.DEGRADED, Action.NONE, Source.POLL,
               "Volatile corrected ECC count above `eccCorrectedLimit` (off by default)."),
    ReasonSpec("ecc-corrected-rate", State.DEGRADED, Action.NONE, Source.POLL,
               "Corrected ECC errors growing faster than `eccCorrectedRatePerMinute` (off by default); held for "
               "`rateHoldSeconds` after the burst."),
    ReasonSpec("row-remap-pending", State.DEGRADED, Action.RESET_GPU, Source.POLL,
               "A row remap waits for the next GPU reset."),
    ReasonSpec("row-remap-failure", State.UNHEALTHY, Action.CONTACT_SUPPORT, Source.POLL, "Row remapping failed: RMA."),
    ReasonSpec("retired-pages-pending", State.DEGRADED, Action.RESET_GPU, Source.POLL,
               "A page retirement waits for the next GPU reset (pre-Ampere)."),
    ReasonSpec("retired-pages-limit", State.UNHEALTHY, Action.CONTACT_SUPPORT, Source.POLL,
               "Retired pages reached `retiredPagesLimit` (63)."),
    ReasonSpec("thermal-slowdown", State.DEGRADED, Action.NONE, Source.POLL,
               "Temperature at or above the slowdown threshold, or thermal clock slowdown active."),
    ReasonSpec("temperature-shutdown", State.UNHEALTHY, Action.CONTACT_SUPPORT, Source.POLL,
               "Temperature at or above the shutdown threshold."),
    ReasonSpec("hw-slowdown", State.DEGRADED, Action.NONE, Source.POLL, "Hardware clock slowdown active."),
    ReasonSpec("power-brake", State.DEGRADED, Action.NONE, Source.POLL, "Hardware power-brake slowdown active."),
    ReasonSpec("pcie-link-degraded", State.DEGRADED, Action.RESET_GPU, Source.POLL,
               "PCIe link width below its maximum, or generation below its maximum while the GPU is busy."),
    ReasonSpec("pcie-replay-rate", State.DEGRADED, Action.CONTACT_SUPPORT, Source.POLL,
               "PCIe replay counter grows faster than the per-lane rate for the link generation; held for "
               "`rateHoldSeconds` after the growth stops."),
    ReasonSpec("nvlink-down", State.UNHEALTHY, Action.RESET_GPU, Source.POLL,
               "An NVLink link seen active is down (remembered across restarts), or fewer links are active than "
               "`nvlinkExpectedLinks` gives for the GPU model. A link slot never active is topology, not a fault."),
    ReasonSpec("nvlink-errors", State.DEGRADED, Action.CONTACT_SUPPORT, Source.POLL,
               "NVLink replay/recovery error counters grew since the last poll; held for `rateHoldSeconds` after "
               "they stop."),
    ReasonSpec("recovery-action-reset", State.UNHEALTHY, Action.RESET_GPU, Source.POLL,
               "The driver asks for a GPU reset (GPU_RESET, DRAIN_AND_RESET or BUS_RESET)."),
    ReasonSpec("recovery-action-reboot", State.UNHEALTHY, Action.REBOOT_NODE, Source.POLL,
               "The driver asks for a node reboot (NODE_REBOOT or SYSTEM_REBOOT)."),
    ReasonSpec("recovery-action-drain-p2p", State.DEGRADED, Action.DRAIN, Source.POLL,
               "The driver asks to drain peer-to-peer traffic."),
    ReasonSpec("recovery-action-imex", State.UNHEALTHY, Action.DRAIN, Source.POLL,
               "The driver asks to drain the GPU and recover its IMEX domain (RECOVER_IMEX_DOMAIN)."),
    ReasonSpec("recovery-action-unknown", State.UNKNOWN, Action.CONTACT_SUPPORT, Source.POLL,
               "The driver asks for a recovery action this release does not know: never read as none."),
    ReasonSpec("fabric-unhealthy", State.UNHEALTHY, Action.CONTACT_SUPPORT, Source.POLL,
               "NVSwitch fabric reports unhealthy."),
    ReasonSpec("fabric-limited", State.DEGRADED, Action.CONTACT_SUPPORT, Source.POLL,
               "NVSwitch fabric reports limited capacity."),
    ReasonSpec("gpu-lost", State.UNHEALTHY, Action.REBOOT_NODE, Source.POLL,
               "NVML reports the GPU lost (fallen off the bus)."),
    ReasonSpec("gpu-unavailable", State.UNHEALTHY, Action.RESET_GPU, Source.EVENT,
               "The driver reports the GPU unavailable."),
    ReasonSpec("reset-required", State.UNHEALTHY, Action.RESET_GPU, Source.POLL,
               "NVML reports a GPU reset is required."),
    ReasonSpec("nvml-error", State.UNKNOWN, Action.CONTACT_SUPPORT, Source.POLL,
               "NVML calls on this GPU failed for `nvmlErrorPolls` consecutive polls."),
    ReasonSpec("nvml-check-unavailable", State.DEGRADED, Action.CONTACT_SUPPORT, Source.POLL,
               "A health check is skipped on this GPU: its NVML call crashed the plugin before on this GPU model and "
               "driver (`gpu-health-plugin inspect` names the call). The GPU is usable, but that signal is not "
               "watched until the driver changes."),
    ReasonSpec("nvml-stalled", State.UNKNOWN, Action.CONTACT_SUPPORT, Source.POLL,
               "An NVML call has not returned for `stallThreshold` seconds and holds this GPU's reads (a hung "
               "driver); clears when the call returns and the GPU is read again."),
    ReasonSpec("flapping", State.DEGRADED, Action.CONTACT_SUPPORT, Source.POLL,
               "The device changed state more than `flapMax` times in `flapWindowSeconds`; it holds its worst "
               "recent state for `flapBackoffSeconds`."),
)

# Built once: the policy looks a row up for every condition it emits. SPECS holds the codes with a row of their own,
# XID_SPECS the generic XID rows (xid-<n>, xid-<n>-repeated) by the XID class they document.
SPECS: dict[str, ReasonSpec] = {s.code: s for s in REASONS if "<n>" not in s.code}
XID_SPECS: dict[str, ReasonSpec] = {s.xid_class: s for s in REASONS if "<n>" in s.code}


def xid_spec(xid: int, xid_class: str) -> ReasonSpec:
    """The row of XID ``xid`` while it is in ``xid_class``: a row of its own for that class, else the class's row."""
    own = SPECS.get(f"xid-{xid}")
    return own if own is not None and own.xid_class == xid_class else XID_SPECS[xid_class]
