"""The node condition's reason in each style (``--node-condition-reasons``): a pure table from the condition's status
and the worst reason behind it to the reason word written on the Node.

``ours`` (the default) says only which way the condition points: ``GPUUnhealthy``, ``GPUStateUnknown``,
``GPUsHealthy``. ``eks`` names the fault the way the EKS node monitoring agent names its ``AcceleratedHardwareReady``
reasons, which EKS node repair reads: ``NvidiaXID<N>Error`` for a fatal XID, its ``Nvidia...`` names for the faults
it also watches, and a generic name per status for the rest. The message stays ours either way (it names the
devices). docs/remediation.md lists the table.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from plugin.health.reasons import Reason, State, reason_order

STYLES = ("ours", "eks")

# Status -> reason, for ``ours`` and for an ``eks`` condition whose worst reason has no EKS name. The True reason is
# the one the EKS agent writes on a healthy node, so a node reads the same whichever of us set it.
OURS = {"False": "GPUUnhealthy", "Unknown": "GPUStateUnknown", "True": "GPUsHealthy"}
EKS_GENERIC = {"False": "NvidiaGPUUnhealthy", "Unknown": "NvidiaGPUStateUnknown", "True": "NvidiaGPUIsReady"}

# Our reason codes that the EKS agent watches under a name of its own. Row remapping is how Ampere and later GPUs
# retire memory, so both of our memory-retirement families take its page-retirement name; a lost GPU is missing
# from the driver's count, the agent's device-count check. Codes not listed (clock slowdowns, recovery actions,
# NVML errors, flapping, reasons from other sources) take the generic name of the status.
EKS_NAMES: dict[str, str] = {
    "ecc-uncorrected": "NvidiaDoubleBitError",
    "retired-pages-pending": "NvidiaPageRetirement",
    "retired-pages-limit": "NvidiaPageRetirement",
    "row-remap-pending": "NvidiaPageRetirement",
    "row-remap-failure": "NvidiaPageRetirement",
    "thermal-slowdown": "NvidiaThermalError",
    "temperature-shutdown": "NvidiaThermalError",
    "power-brake": "NvidiaPowerError",
    "pcie-link-degraded": "NvidiaPCIeError",
    "pcie-replay-rate": "NvidiaPCIeError",
    "nvlink-down": "NvidiaNVLinkError",
    "nvlink-errors": "NvidiaNVLinkError",
    "fabric-unhealthy": "NvidiaFabricError",
    "fabric-limited": "NvidiaFabricError",
    "gpu-lost": "NvidiaDeviceCountMismatch",
    "gpu-missing": "NvidiaDeviceCountMismatch",
}
# xid-79 and xid-13-repeated: every XID reason code carries its number first.
_XID_CODE = re.compile(r"xid-([0-9]+)(?:-[a-z]+)?")


def eks_name(r: Reason) -> str | None:
    """The EKS agent's name for reason ``r``, or None where it has none. An XID is an ``Error`` when it makes the
    device Unhealthy and a ``Warning`` otherwise, as the agent splits its XID reasons by how fatal they are."""
    if m := _XID_CODE.fullmatch(r.code):
        return f"NvidiaXID{int(m[1])}{'Error' if r.severity is State.UNHEALTHY else 'Warning'}"
    return EKS_NAMES.get(r.code)


def worst_reason(reasons_of_bad_devices: Iterable[tuple[Reason, ...]]) -> Reason | None:
    """The one reason a node with several faulty devices is named by: each device's worst (its reasons are held
    worst-first), then the worst of those by the same order (severity, heavier action, seen first, code)."""
    return min((rs[0] for rs in reasons_of_bad_devices if rs), key=reason_order, default=None)


def condition_reason(style: str, status: str, worst: Reason | None) -> str:
    """The reason written for a condition of ``status`` whose worst reason is ``worst`` (None when healthy, or when
    the devices that set the status carry no reason)."""
    if style == "eks":
        name = eks_name(worst) if worst is not None and status != "True" else None
        return name or EKS_GENERIC[status]
    return OURS[status]
