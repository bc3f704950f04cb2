"""Our node state as NVSentinel health events: the one table from our reason codes to its checks, and the events a
snapshot asks for (docs/nvsentinel.md, "Our health into NVSentinel"; its mapping table is generated from here).

NVSentinel keeps one verdict per (agent, check, entity): an event with ``isHealthy`` false opens it, one with
``isHealthy`` true for the same check and entities closes it. So we send one check per family of our reasons per
physical GPU, not one per reason code: a GPU whose ECC counters cross two thresholds has one memory fault open in
NVSentinel, whose codes list both, and it closes when the last of them clears.

Pure: the snapshot, the node name and the time are arguments; the sender (``sender.py``) does the I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from api.nvsentinel.platformconnector import health_event_pb2 as pb
from plugin.devices.model import Gpu
from plugin.health.node_state import Snapshot
from plugin.health.reasons import REASONS, Action, Reason, State, worst_first

AGENT = "gpu-health-device-plugin"  # what an operator's fault-quarantine rule matches (event.agent)
COMPONENT_CLASS = "GPU"
EVENT_VERSION = 1
# A reason another provider gave us through NVSentinel's device API (code external-<type>) is NVSentinel's own news:
# sending it back would make a loop, so those codes are never sent.
EXTERNAL_PREFIX = "external-"

# The checks, one per family of reasons. The names are ours, CamelCase like NVSentinel's own check names, and
# prefixed so a rule can tell them from another monitor's.
XID = "GpuHealthXid"
MEMORY = "GpuHealthMemory"
THERMAL = "GpuHealthThermal"
CLOCKS = "GpuHealthClocks"
PCIE = "GpuHealthPcie"
NVLINK = "GpuHealthNvlink"
FABRIC = "GpuHealthFabric"
DRIVER = "GpuHealthDriver"
NVML = "GpuHealthNvml"
FLAPPING = "GpuHealthFlapping"
RECOVERY_CHECK = "GpuHealthRecoveryCheck"
BUSY = "GpuHealthBusyUnallocated"

# Every code of REASONS has a row here (tests/unit/test_nvsentinel_events.py fails on a new code without one), so a
# new reason cannot go unmapped silently. The generic XID rows cover every XID number.
CHECKS: Mapping[str, str] = {
    "xid-<n>": XID, "xid-79": XID, "xid-64": XID, "xid-95": XID, "xid-<n>-repeated": XID,
    "ecc-uncorrected": MEMORY, "ecc-corrected-high": MEMORY, "ecc-corrected-rate": MEMORY,
    "row-remap-pending": MEMORY, "row-remap-failure": MEMORY,
    "retired-pages-pending": MEMORY, "retired-pages-limit": MEMORY,
    "thermal-slowdown": THERMAL, "temperature-shutdown": THERMAL,
    "hw-slowdown": CLOCKS, "power-brake": CLOCKS,
    "pcie-link-degraded": PCIE, "pcie-replay-rate": PCIE,
    "nvlink-down": NVLINK, "nvlink-errors": NVLINK,
    "fabric-unhealthy": FABRIC, "fabric-limited": FABRIC,
    "recovery-action-reset": DRIVER, "recovery-action-reboot": DRIVER, "recovery-action-drain-p2p": DRIVER,
    "recovery-action-imex": DRIVER, "recovery-action-unknown": DRIVER, "nvml-stalled": NVML,
    "nvml-check-unavailable": NVML,
    "gpu-lost": DRIVER, "gpu-unavailable": DRIVER, "reset-required": DRIVER, "gpu-missing": DRIVER,
    "nvml-error": NVML,
    "flapping": FLAPPING,
    "recovery-check-failed": RECOVERY_CHECK, "recovery-check-pending": RECOVERY_CHECK,
    "busy-unallocated": BUSY,
}
CHECK_NAMES: tuple[str, ...] = tuple(dict.fromkeys(CHECKS.values()))

# What NVSentinel's remediation should do for each of our actions. Only the remedies it performs itself are named:
# restart-app is the workload's business and drain (of peer-to-peer traffic) has no NVSentinel equivalent, and any
# action but NONE could start a remediation that is not what the driver asked for. Our action still travels in the
# metadata ("action") for an operator's rule or a custom remediation.
RECOMMENDED: Mapping[Action, pb.RecommendedAction.ValueType] = {
    Action.NONE: pb.NONE,
    Action.RESTART_APP: pb.NONE,
    Action.DRAIN: pb.NONE,
    Action.RESET_GPU: pb.COMPONENT_RESET,
    Action.REBOOT_NODE: pb.RESTART_BM,
    Action.CONTACT_SUPPORT: pb.CONTACT_SUPPORT,
}

_XID = re.compile(r"^xid-(\d+)(-repeated)?$")


def row_of(code: str) -> str | None:
    """The table row a code a device carries falls under (``xid-13`` under ``xid-<n>``); None for a code with no
    row (an external one, or one from a newer table)."""
    if code in CHECKS:
        return code
    m = _XID.match(code)
    if m:
        return "xid-<n>-repeated" if m.group(2) else "xid-<n>"
    return None


def check_of(code: str) -> str | None:
    """The check a reason code is reported under; None when it is not sent (``external-``, or unknown)."""
    if code.startswith(EXTERNAL_PREFIX):
        return None
    row = row_of(code)
    return CHECKS[row] if row is not None else None


def error_code(code: str) -> str:
    """The errorCode of one reason: the XID number for an XID, as NVSentinel's own monitors send it; else our
    code."""
    m = _XID.match(code)
    return m.group(1) if m else code


def is_fatal(severity: State) -> bool:
    """Only Unhealthy is fatal. Degraded is a GPU still fit for work (NVSentinel records the event, its default
    quarantine rules ignore it); Unknown means our NVML calls failed, not that the GPU did."""
    return severity is State.UNHEALTHY


@dataclass(frozen=True)
class CheckState:
    """What one check of one physical GPU says now: the content of one health event, without the time.

    Two states are the same verdict when everything but the message is equal: a message that only moves with the
    reading (a temperature) is no news to NVSentinel, so it is not sent again for that."""

    gpu_uuid: str
    pci_bus_id: str
    check: str
    state: State  # the worst severity among the check's reasons; Healthy when it has none
    codes: tuple[str, ...] = ()  # our reason codes, worst first
    action: Action = Action.NONE  # the worst reason's
    message: str = field(default="", compare=False)
    gpu_index: int = field(default=0, compare=False)  # NVSentinel's GPU entity; fixed for a UUID while we run

    @property
    def healthy(self) -> bool:
        return not self.codes

    @property
    def key(self) -> tuple[str, str]:
        return (self.gpu_uuid, self.check)

    def recovered(self) -> CheckState:
        """The event that closes this check in NVSentinel: the same check and entities, healthy."""
        return CheckState(self.gpu_uuid, self.pci_bus_id, self.check, State.HEALTHY,
                          message=f"{self.check}: no fault on this GPU any more", gpu_index=self.gpu_index)


def to_record(checks: Iterable[CheckState]) -> dict[str, Any]:
    """What NVSentinel holds open from us, as the sender keeps it in the state dir across restarts."""
    return {"version": 1, "checks": [
        {"gpu": c.gpu_uuid, "pci": c.pci_bus_id, "index": c.gpu_index, "check": c.check, "state": c.state.value,
         "codes": list(c.codes), "action": c.action.value} for c in checks]}


def from_record(doc: Any) -> dict[tuple[str, str], CheckState]:
    """The checks of :func:`to_record`; ValueError for a document this release cannot read."""
    if not isinstance(doc, dict) or doc.get("version") != 1 or not isinstance(doc.get("checks"), list):
        raise ValueError("not a version 1 record of acknowledged checks")
    out: dict[tuple[str, str], CheckState] = {}
    for item in doc["checks"]:
        try:
            c = CheckState(str(item["gpu"]), str(item["pci"]), str(item["check"]), State(item["state"]),
                           tuple(str(x) for x in item["codes"]), Action(item["action"]), "", int(item["index"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a check entry that does not read: {exc}") from None
        out[c.key] = c
    return out


def gpu_checks(snapshot: Snapshot) -> tuple[set[str], dict[tuple[str, str], CheckState]]:
    """The physical GPUs of a snapshot, and every check that has a reason on one of them now (a check not listed is
    healthy). A MIG device's reasons count for its parent GPU: NVSentinel knows GPUs (its entities are the GPU UUID
    and PCI address), and quarantining or resetting acts on the whole GPU anyway."""
    gpus: dict[str, Gpu] = {}
    reasons: dict[tuple[str, str], list[Reason]] = {}
    for d in snapshot.devices:
        gpus[d.gpu.uuid] = d.gpu
        for r in d.reasons:
            check = check_of(r.code)
            if check is not None:
                reasons.setdefault((d.gpu.uuid, check), []).append(r)
    out: dict[tuple[str, str], CheckState] = {}
    for (uuid, check), rs in reasons.items():
        ordered = _distinct(worst_first(rs))
        worst = ordered[0]
        more = f" (+{len(ordered) - 1} more)" if len(ordered) > 1 else ""
        out[(uuid, check)] = CheckState(uuid, gpus[uuid].pci_bus_id, check, worst.severity,
                                        tuple(r.code for r in ordered), worst.action, worst.message + more,
                                        gpus[uuid].index)
    return set(gpus), out


def _distinct(ordered: Iterable[Reason]) -> tuple[Reason, ...]:
    # A parent's reason is carried by each of its MIG devices too: one per code, the worst copy.
    seen: dict[str, Reason] = {}
    for r in ordered:
        seen.setdefault(r.code, r)
    return tuple(seen.values())


def pci_address(bus_id: str) -> str:
    """A PCI address as NVSentinel writes it: NVML's bus id with the domain cut to four hex digits, in lower case
    (``00000000:17:00.0`` -> ``0000:17:00.0``), so our entities match the ones its other monitors send."""
    parts = bus_id.split(":")
    if len(parts) != 3:
        return bus_id.lower()
    return ":".join((parts[0][-4:], parts[1], parts[2])).lower()


def to_event(c: CheckState, *, node_name: str, now: float, store_only: bool) -> pb.HealthEvent:
    """The health event for one check at ``now`` (unix seconds)."""
    ts = Timestamp()
    ts.FromNanoseconds(int(now * 1e9))
    # As NVSentinel's own GPU monitor names a GPU: its index, its PCI address and its UUID. The UUID entity is what
    # its drain and GPU-reset remediation act on (COMPONENT_RESET without it fails there), and its quarantine
    # closes a check only on a healthy event with exactly the same entities, so these never vary for one GPU.
    entities = [pb.Entity(entityType="GPU", entityValue=str(c.gpu_index))]
    if c.pci_bus_id:
        entities.append(pb.Entity(entityType="PCI", entityValue=pci_address(c.pci_bus_id)))
    entities.append(pb.Entity(entityType="GPU_UUID", entityValue=c.gpu_uuid))
    return pb.HealthEvent(
        version=EVENT_VERSION, agent=AGENT, componentClass=COMPONENT_CLASS, checkName=c.check,
        isFatal=is_fatal(c.state), isHealthy=c.healthy, message=c.message,
        recommendedAction=RECOMMENDED[c.action] if not c.healthy else pb.NONE,
        errorCode=list(dict.fromkeys(error_code(code) for code in c.codes)), entitiesImpacted=entities,
        metadata={"state": c.state.value, "codes": ",".join(c.codes), "action": c.action.value},
        generatedTimestamp=ts, nodeName=node_name,
        processingStrategy=pb.STORE_ONLY if store_only else pb.EXECUTE_REMEDIATION)


def changes(acked: Mapping[tuple[str, str], CheckState], gpus: set[str],
            wanted: Mapping[tuple[str, str], CheckState], *, everything: bool = False) -> list[CheckState]:
    """The checks to send so NVSentinel holds ``wanted``, given what it acknowledged (``acked``, the non-healthy
    checks it holds from us). ``everything`` sends every non-healthy check again, changed or not (NVSentinel may
    have restarted). A check of a GPU no longer in the snapshot is left as NVSentinel has it: we cannot say it
    recovered, and it is sent again if the GPU comes back."""
    out = [c for k, c in wanted.items() if everything or acked.get(k) != c]
    out += [c.recovered() for k, c in acked.items() if k not in wanted and c.gpu_uuid in gpus]
    return out


@dataclass(frozen=True)
class MappingRow:
    """One row of the mapping table in docs/nvsentinel.md: a REASONS row and the event it becomes by default."""

    code: str
    severity: State
    action: Action
    check: str
    is_fatal: bool
    recommended: str
    error_code: str


def mapping_rows() -> list[MappingRow]:
    """The table docs/nvsentinel.md shows, one row per REASONS row (scripts/gen_docs.py renders it)."""
    return [MappingRow(s.code, s.severity, s.action, CHECKS[s.code], is_fatal(s.severity),
                       pb.RecommendedAction.Name(RECOMMENDED[s.action]),
                       "the XID number" if s.code.startswith("xid-") else s.code) for s in REASONS]
