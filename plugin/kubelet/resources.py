"""Resources: how physical GPUs (and their MIG slices) become the device IDs one kubelet resource advertises.

The kubelet-facing health of every advertised device comes from the node state, never from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from plugin.health.state import DeviceStatus, Snapshot


@dataclass(frozen=True)
class KubeletDevice:
    id: str
    health: str
    numa_node: int | None


class Resource(Protocol):
    @property
    def name(self) -> str: ...

    def devices(self, snap: Snapshot) -> tuple[KubeletDevice, ...]:
        """The full ListAndWatch view of this resource in this snapshot."""
        ...

    def backing(self, snap: Snapshot, device_id: str) -> DeviceStatus | None:
        """The status whose health and hardware stand behind one advertised ID; None when unknown."""
        ...


@dataclass(frozen=True)
class WholeGpus:
    """One advertised device per physical GPU, ID = GPU UUID (MIG slices are not advertised here)."""

    name: str = "nvidia.com/gpu"

    def devices(self, snap: Snapshot) -> tuple[KubeletDevice, ...]:
        return tuple(KubeletDevice(d.id, d.kubelet_health, d.gpu.numa_node) for d in snap.devices if d.mig is None)

    def backing(self, snap: Snapshot, device_id: str) -> DeviceStatus | None:
        d = snap.get(device_id)
        return d if d is not None and d.mig is None else None
