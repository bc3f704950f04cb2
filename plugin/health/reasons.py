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
    CHECK = "check"  # the recovery check (--recovery-check)
    KERNEL_LOG = "kernel-log"  # an event read from the kernel log (--kernel-log), not from NVML's event set
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


class Clear(StrEnum):
    """What takes a reason off a device: the runbook's "clears" column (docs/reasons.md), and the one table the
    tracker asks before it drops a latched reason (``clears_for``)."""

    GONE = "gone"  # the GPU stops showing it (``clearAfterPolls`` clean polls; a rate reason also its hold)
    HOLD = "hold"  # its hold time passes (``latchHoldSeconds`` for its state, ``rateHoldSeconds``, the flap back-off)
    RESET = "reset"  # a GPU reset or driver reload seen: a lost GPU answers, the driver's reset request ends, the GPU
    #                   leaves NVML and comes back
    REBOOT = "reboot"  # the node rebooted (another boot id) and the GPU reads clean
    OPERATOR = "operator"  # ``gpu-health-plugin clear`` while the condition is no longer present
    CHECK = "check"  # the recovery check passes (``--recovery-check``)
    NEVER = "never"  # nothing but replacing the GPU: the GPU itself keeps reporting it


# The order docs/reasons.md lists them in.
CLEARS: tuple[Clear, ...] = tuple(Clear)


def latch_clears(source: Source, action: Action) -> frozenset[Clear]:
    """What clears a latched (event-born) reason: its hold time and the operator always; a reset and a reboot when
    a reset is its remedy; a reboot when that is; nothing else when the hardware needs support (a reset does not
    mend what XID 64 or 95 report, and neither does a reboot). A reason seen both ways (an ECC count and an ECC
    event) is cleared by what clears its latch: the count itself only returns to zero with a reset."""
    out = {Clear.HOLD, Clear.OPERATOR}
    if action == Action.RESET_GPU:
        out |= {Clear.RESET, Clear.REBOOT}
    elif action == Action.REBOOT_NODE:
        out.add(Clear.REBOOT)
    return frozenset(out)


_POLLED = frozenset({Clear.GONE})
_RATE = frozenset({Clear.GONE, Clear.OPERATOR})


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
    todo: str = ""  # the runbook: what an operator does about it
    # What clears it. Empty: derived from source and action (latched rows) or "gone" (polled rows).
    clears: frozenset[Clear] = frozenset()

    def __post_init__(self) -> None:
        if not self.clears:
            derived = latch_clears(self.source, self.action) if self.source in (Source.EVENT, Source.POLL_OR_EVENT) \
                else _POLLED
            object.__setattr__(self, "clears", derived)


# The reason-code table. docs/reasons.md is generated from it (scripts/gen_docs.py) so the two cannot drift.
REASONS: tuple[ReasonSpec, ...] = (
    ReasonSpec("xid-<n>", State.UNHEALTHY, Action.RESET_GPU, Source.EVENT,
               "A fatal XID (class `fatal`). Latched until the GPU is seen reset or the Unhealthy hold time passes.",
               "fatal",
               todo="Drain the GPU's pods and reset it (`nvidia-smi -r -i <index>`) or reboot the node: it returns "
                    "once the reset or the reboot is seen."),
    ReasonSpec("xid-79", State.UNHEALTHY, Action.REBOOT_NODE, Source.EVENT,
               "XID 79, the GPU fell off the bus: only a node reboot brings it back. Latched like every fatal XID.",
               "fatal",
               todo="Reboot the node: the GPU returns if it reads clean after the boot. Still lost after a reboot: "
                    "reseat or replace it."),
    ReasonSpec("xid-64", State.UNHEALTHY, Action.CONTACT_SUPPORT, Source.EVENT,
               "XID 64, the GPU could not record a page retirement or row remap: a reset does not mend it. Latched.",
               "fatal",
               todo="Open a support case with the GPU's serial number: neither a reset nor a reboot mends it. Clear "
                    "it by hand once the GPU is replaced or declared fit."),
    ReasonSpec("xid-95", State.UNHEALTHY, Action.CONTACT_SUPPORT, Source.EVENT,
               "XID 95, an uncontained ECC error: a recurring one means the memory is failing. Latched.",
               "fatal",
               todo="Reset the GPU to contain it; if it recurs, open a support case. A reset or reboot does not "
                    "clear the record: clear it by hand."),
    ReasonSpec("xid-<n>", State.DEGRADED, Action.RESET_GPU, Source.EVENT,
               "A degraded-class XID (63, 92, 94, 156 by default): usable, reset when convenient. Latched.",
               "degraded",
               todo="Reset the GPU when its work allows (drain it first); it stays schedulable until then."),
    ReasonSpec("xid-<n>", State.DEGRADED, Action.CONTACT_SUPPORT, Source.EVENT,
               "An XID in no configured class: the state is `unknownXidState` (Degraded by default). Latched.",
               "unknown",
               todo="Look the XID up in NVIDIA's XID catalogue and give it a class in `health.xid`; clear it by hand "
                    "if it is harmless."),
    ReasonSpec("xid-<n>-repeated", State.DEGRADED, Action.CONTACT_SUPPORT, Source.EVENT,
               "An application-class XID (13, 31, 43, ...) repeated on one GPU beyond the threshold in the window.",
               "application",
               todo="Compare the workloads that hit it: the same application XID on one GPU and not on its peers "
                    "points at the GPU."),
    ReasonSpec("ecc-uncorrected", State.UNHEALTHY, Action.RESET_GPU, Source.POLL_OR_EVENT,
               "Volatile uncorrected (double-bit) ECC errors, or a double-bit ECC event.",
               todo="Drain and reset the GPU (the volatile count starts from zero); recurring after resets: open a "
                    "support case."),
    ReasonSpec("ecc-corrected-high", State.DEGRADED, Action.NONE, Source.POLL,
               "Volatile corrected ECC count above `eccCorrectedLimit` (off by default).",
               todo="Watch the trend; a reset starts the volatile count from zero."),
    ReasonSpec("ecc-corrected-rate", State.DEGRADED, Action.NONE, Source.POLL,
               "Corrected ECC errors growing faster than `eccCorrectedRatePerMinute` (off by default); held for "
               "`rateHoldSeconds` after the burst.",
               todo="Watch whether bursts recur; recurring ones precede uncorrected errors.", clears=_RATE),
    ReasonSpec("row-remap-pending", State.DEGRADED, Action.RESET_GPU, Source.POLL,
               "A row remap waits for the next GPU reset.",
               todo="Reset the GPU (drain it first) to apply the remap."),
    ReasonSpec("row-remap-failure", State.UNHEALTHY, Action.CONTACT_SUPPORT, Source.POLL, "Row remapping failed: RMA.",
               todo="Replace the GPU (RMA): the GPU keeps reporting it.", clears=frozenset({Clear.NEVER})),
    ReasonSpec("retired-pages-pending", State.DEGRADED, Action.RESET_GPU, Source.POLL,
               "A page retirement waits for the next GPU reset (pre-Ampere).",
               todo="Reset the GPU (drain it first) to apply the retirement."),
    ReasonSpec("retired-pages-limit", State.UNHEALTHY, Action.CONTACT_SUPPORT, Source.POLL,
               "Retired pages reached `retiredPagesLimit` (63).",
               todo="Replace the GPU (RMA): the retired pages stay retired.", clears=frozenset({Clear.NEVER})),
    ReasonSpec("thermal-slowdown", State.DEGRADED, Action.NONE, Source.POLL,
               "Temperature at or above the slowdown threshold, or thermal clock slowdown active.",
               todo="Check the cooling: airflow, fans, inlet temperature."),
    ReasonSpec("temperature-shutdown", State.UNHEALTHY, Action.CONTACT_SUPPORT, Source.POLL,
               "Temperature at or above the shutdown threshold.",
               todo="Check the cooling now: the GPU is about to shut itself down."),
    ReasonSpec("hw-slowdown", State.DEGRADED, Action.NONE, Source.POLL, "Hardware clock slowdown active.",
               todo="Check the power supply and the cooling: the board asserted the slowdown."),
    ReasonSpec("power-brake", State.DEGRADED, Action.NONE, Source.POLL, "Hardware power-brake slowdown active.",
               todo="Check the power supply: the system asserted the power brake."),
    ReasonSpec("pcie-link-degraded", State.DEGRADED, Action.RESET_GPU, Source.POLL,
               "PCIe link width below its maximum, or generation below its maximum while the GPU is busy.",
               todo="Reset the GPU; a link still narrow or slow after that: reseat the card, check the riser and "
                    "slot."),
    ReasonSpec("pcie-replay-rate", State.DEGRADED, Action.CONTACT_SUPPORT, Source.POLL,
               "PCIe replay counter grows faster than the per-lane rate for the link generation; held for "
               "`rateHoldSeconds` after the growth stops.",
               todo="Check the PCIe path (riser, slot, cable); recurring: open a support case.", clears=_RATE),
    ReasonSpec("nvlink-down", State.UNHEALTHY, Action.RESET_GPU, Source.POLL,
               "An NVLink link seen active is down (remembered across restarts), or fewer links are active than "
               "`nvlinkExpectedLinks` gives for the GPU model. A link slot never active is topology, not a fault.",
               todo="Reset the GPU (or the fabric); a link still down after that needs support. After removing links "
                    "on purpose, delete `nvml.json` in the state dir."),
    ReasonSpec("nvlink-errors", State.DEGRADED, Action.CONTACT_SUPPORT, Source.POLL,
               "NVLink replay/recovery error counters grew since the last poll; held for `rateHoldSeconds` after "
               "they stop.",
               todo="Watch whether the errors recur; recurring ones on one link: open a support case.", clears=_RATE),
    ReasonSpec("recovery-action-reset", State.UNHEALTHY, Action.RESET_GPU, Source.POLL,
               "The driver asks for a GPU reset (GPU_RESET, DRAIN_AND_RESET or BUS_RESET).",
               todo="Drain and reset the GPU, as the driver asks."),
    ReasonSpec("recovery-action-reboot", State.UNHEALTHY, Action.REBOOT_NODE, Source.POLL,
               "The driver asks for a node reboot (NODE_REBOOT or SYSTEM_REBOOT).",
               todo="Drain and reboot the node, as the driver asks."),
    ReasonSpec("recovery-action-drain-p2p", State.DEGRADED, Action.DRAIN, Source.POLL,
               "The driver asks to drain peer-to-peer traffic.",
               todo="Drain the workloads that use peer-to-peer transfers."),
    ReasonSpec("recovery-action-imex", State.UNHEALTHY, Action.DRAIN, Source.POLL,
               "The driver asks to drain the GPU and recover its IMEX domain (RECOVER_IMEX_DOMAIN).",
               todo="Drain the GPU and recover its IMEX domain."),
    ReasonSpec("recovery-action-unknown", State.UNKNOWN, Action.CONTACT_SUPPORT, Source.POLL,
               "The driver asks for a recovery action this release does not know: never read as none.",
               todo="Read the driver's release notes for the code and upgrade the plugin."),
    ReasonSpec("fabric-unhealthy", State.UNHEALTHY, Action.CONTACT_SUPPORT, Source.POLL,
               "NVSwitch fabric reports unhealthy.",
               todo="Check the fabric manager and its log; open a support case if it stays."),
    ReasonSpec("fabric-limited", State.DEGRADED, Action.CONTACT_SUPPORT, Source.POLL,
               "NVSwitch fabric reports limited capacity.",
               todo="Check the fabric manager and the NVSwitch trays; open a support case if it stays."),
    ReasonSpec("gpu-lost", State.UNHEALTHY, Action.REBOOT_NODE, Source.POLL,
               "NVML reports the GPU lost (fallen off the bus).",
               todo="Reboot the node; a GPU still lost after that: reseat or replace it."),
    ReasonSpec("gpu-missing", State.UNHEALTHY, Action.REBOOT_NODE, Source.POLL,
               "The node's, not a device's: an NVIDIA GPU on the PCI bus, bound to the nvidia driver or to none, that "
               "NVML does not list (it fell off the bus or never initialised: RmInitAdapter; one bound to vfio-pci "
               "is a VM's and left out), a GPU the kernel log (`--kernel-log`) writes about at an address NVML "
               "does not list, or fewer GPUs in NVML than `--expected-gpus` or the node's `nvidia.com/gpu.count` "
               "label. The GPUs that are there keep their own states; the node is short of one. Seen in two polls "
               "in a row; clears after "
               "`clearAfterPolls` polls with every GPU there.",
               todo="Reboot the node (the fleet controller's `gpu-missing` rule does, after its grace period); a GPU "
                    "still missing after that: reseat or replace it (the message names its PCI address)."),
    ReasonSpec("busy-unallocated", State.DEGRADED, Action.NONE, Source.POLL,
               "Compute processes NVML lists on the GPU that no running container holds (the kubelet's PodResources "
               "API; in DRA mode the prepared claims) for longer than `--busy-grace`: a leaked or orphaned job. The "
               "message gives their count, names and memory. The preferred allocation avoids the GPU. A kubelet that "
               "cannot be asked counts as holding it.",
               todo="Find the processes (`nvidia-smi`, the names in the message) and stop them; a process that belongs "
                    "there (the MPS server) goes into `--busy-ignore`."),
    ReasonSpec("gpu-unavailable", State.UNHEALTHY, Action.RESET_GPU, Source.EVENT,
               "The driver reports the GPU unavailable.",
               todo="Reset the GPU or reboot the node."),
    ReasonSpec("reset-required", State.UNHEALTHY, Action.RESET_GPU, Source.POLL,
               "NVML reports a GPU reset is required.",
               todo="Drain and reset the GPU."),
    ReasonSpec("nvml-error", State.UNKNOWN, Action.CONTACT_SUPPORT, Source.POLL,
               "NVML calls on this GPU failed for `nvmlErrorPolls` consecutive polls.",
               todo="Read the plugin's log for the NVML error and check the driver (`nvidia-smi`)."),
    ReasonSpec("nvml-check-unavailable", State.DEGRADED, Action.CONTACT_SUPPORT, Source.POLL,
               "A health check is skipped on this GPU: its NVML call crashed the plugin before on this GPU model and "
               "driver (`gpu-health-plugin inspect` names the call). The GPU is usable, but that signal is not "
               "watched until the driver changes.",
               todo="Update the driver: the check is tried again with another driver version. `gpu-health-plugin "
                    "inspect` names the call."),
    ReasonSpec("nvml-stalled", State.UNKNOWN, Action.CONTACT_SUPPORT, Source.POLL,
               "An NVML call has not returned for `stallThreshold` seconds and holds this GPU's reads (a hung "
               "driver); clears when the call returns and the GPU is read again.",
               todo="Look at the kernel log (`dmesg`) for the hung driver; reboot the node if the call never returns."),
    ReasonSpec("flapping", State.DEGRADED, Action.CONTACT_SUPPORT, Source.POLL,
               "The device changed state more than `flapMax` times in `flapWindowSeconds`; it holds its worst "
               "recent state for `flapBackoffSeconds`.",
               todo="Find out why the device keeps changing state (its other reasons, the kernel log).",
               clears=frozenset({Clear.HOLD, Clear.OPERATOR})),
    ReasonSpec("recovery-check-failed", State.UNHEALTHY, Action.RESET_GPU, Source.CHECK,
               "The recovery check (`--recovery-check`) failed when a fault was about to clear; the message holds the "
               "end of its output.",
               todo="Run the check by hand on the GPU and read its output; reset or replace the GPU. A reset or a "
               "reboot runs the check again; `clear --reason recovery-check-failed` returns the GPU without it.",
               clears=frozenset({Clear.RESET, Clear.REBOOT, Clear.OPERATOR})),
    ReasonSpec("recovery-check-pending", State.UNHEALTHY, Action.NONE, Source.CHECK,
               "A fault cleared and the recovery check has not passed yet: the device keeps the state the fault "
               "gave it (the severity here is the usual one) until it does.",
               todo="Nothing: it returns when the check passes. A GPU a pod holds is not checked until the pod ends.",
               clears=frozenset({Clear.CHECK, Clear.OPERATOR})),
)

# Built once: the policy looks a row up for every condition it emits. SPECS holds the codes with a row of their own,
# XID_SPECS the generic XID rows (xid-<n>, xid-<n>-repeated) by the XID class they document.
SPECS: dict[str, ReasonSpec] = {s.code: s for s in REASONS if "<n>" not in s.code}
XID_SPECS: dict[str, ReasonSpec] = {s.xid_class: s for s in REASONS if "<n>" in s.code}


def clears_for(r: Reason) -> frozenset[Clear]:
    """What may take reason ``r`` off its device. A latched reason is judged by how it was seen and by its action,
    not by its code's row: an XID moved to another class carries that class's action, and so its remedy. An event
    read from the kernel log latches exactly as NVML's does."""
    if r.source in (Source.EVENT, Source.POLL_OR_EVENT, Source.KERNEL_LOG):
        return latch_clears(r.source, r.action)
    spec = SPECS.get(r.code)
    return spec.clears if spec is not None else frozenset()


def xid_spec(xid: int, xid_class: str) -> ReasonSpec:
    """The row of XID ``xid`` while it is in ``xid_class``: a row of its own for that class, else the class's row."""
    own = SPECS.get(f"xid-{xid}")
    return own if own is not None and own.xid_class == xid_class else XID_SPECS[xid_class]
