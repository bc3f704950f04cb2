"""Time-sliced GPUs in DRA mode: which published devices may be allocated to several claims at once, and how the
ResourceSlice says so. Pure functions over the slice's device dicts, like ``slices.py``.

The config is the device-plugin mode's ``sharing.timeSlicing`` section (docs/sharing.md): an entry names a resource
(``nvidia.com/gpu`` for whole GPUs, ``nvidia.com/mig-<profile>`` for MIG instances under ``--mig-strategy mixed``),
how many ``replicas`` and which ``devices``. Device-plugin mode advertises each replica as a device of its own; DRA
(KEP-5075, consumable capacity) can say it of the device itself: ``allowMultipleAllocations: true`` and a capacity
``<driver>/shares`` of ``replicas``, of which each claim's request takes one unless it asks for more. The scheduler
then places at most ``replicas`` claims on the device, every one of them names the same device, and its health (the
taint, the kubelet's health stream) reaches every pod that holds it.

With allowMultipleAllocations every capacity of the device is consumable, and a request that names none consumes
all of it, so the memory capacity gets a policy of its own: a claim takes none of it unless it asks (then the
scheduler keeps the sum of what claims asked under the GPU's memory).

An API server without the DRAConsumableCapacity gate (off by default before 1.36) drops both fields. The writer
sees that (``sharing_dropped``), says it once and publishes plain devices: one claim per device, which pods share by
naming one ResourceClaim (docs/dra.md, "Shared GPUs").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plugin.sharing.config import SharingConfig
from plugin.sharing.model import Selection, mig_resource

SHARES = "shares"  # the capacity a claim's request consumes one of by default


@dataclass(frozen=True)
class Shareable:
    """What a sharing entry can select a published device by: the resource it stands for, the GPU index, and its
    UUIDs (the GPU's, and a MIG instance's own)."""

    name: str  # the device name in the slice
    resource: str  # nvidia.com/gpu, or nvidia.com/mig-<profile>
    index: int
    uuids: tuple[str, ...]


def resource_of(resource_name: str, profile: str | None) -> str:
    """The resource a published device stands for, as device-plugin mode's ``mixed`` strategy names it."""
    return resource_name if profile is None else mig_resource(resource_name, profile)


def _selected(sel: Selection, device: Shareable, position: int) -> bool:
    if sel.is_all:
        return True
    if sel.count is not None:
        return position < sel.count
    for want in sel.ids or ():
        if isinstance(want, int) and not isinstance(want, bool):
            if want == device.index:
                return True
        elif str(want).lower() in (u.lower() for u in device.uuids):
            return True
    return False


def replicas(devices: Sequence[Shareable], sharing: SharingConfig) -> dict[str, int]:
    """Device name -> how many claims may hold it at once, for every device an entry selects (the others: one).
    A count selects the first devices of its resource in the order given (the slice's order). Where two entries
    select one device the first wins, as in device-plugin mode."""
    out: dict[str, int] = {}
    for entry in sharing.resources:
        position = 0
        for d in devices:
            if d.resource != entry.name:
                continue
            if _selected(entry.devices, d, position) and d.name not in out and entry.replicas > 1:
                out[d.name] = entry.replicas
            position += 1
    return out


def share(device: dict[str, Any], count: int, domain: str) -> None:
    """Make ``device`` (a slice device dict) allocatable to ``count`` claims at once, each taking one share unless
    its request asks the capacity for more."""
    device["allowMultipleAllocations"] = True
    capacity = device.setdefault("capacity", {})
    capacity[f"{domain}/{SHARES}"] = {
        "value": str(count),
        "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": str(count), "step": "1"}},
    }
    for key, value in capacity.items():
        if key != f"{domain}/{SHARES}" and isinstance(value, dict) and "requestPolicy" not in value:
            # A request that names no memory takes none of it; one that asks is held to the GPU's total.
            value["requestPolicy"] = {"default": "0", "validRange": {"min": "0"}}


def _shared_count(obj: Mapping[str, Any]) -> int:
    devices: Iterable[Any] = (obj.get("spec") or {}).get("devices") or ()
    return sum(1 for d in devices if isinstance(d, dict) and d.get("allowMultipleAllocations") is True)


def sharing_dropped(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    """Whether the API server dropped every ``allowMultipleAllocations`` we sent: it does so while the
    DRAConsumableCapacity gate is off. The writer then stops sharing (one log line) instead of rewriting a slice
    that can never match."""
    return _shared_count(sent) > 0 and _shared_count(stored) == 0
