"""The pools a MIG strategy cuts a node's devices into, and the selection of devices a sharing entry names.

Pure values: which physical device belongs to a pool, or is chosen by a selection, is decided on the kubelet side
against a snapshot of the node (plugin/kubelet/resources.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plugin.devices.model import Gpu

POOL_ALL_GPUS = "gpus"  # every physical GPU, partitioned or not (MIG strategy none)
POOL_UNPARTITIONED = "unpartitioned"  # physical GPUs without MIG slices (the base resource of strategy mixed)
POOL_SINGLE = "single"  # MIG slices, and GPUs without any (strategy single)
_MIG_POOL = "mig:"


def mig_pool(profile: str) -> str:
    """The pool of MIG slices of one profile (strategy mixed: one resource per profile)."""
    return _MIG_POOL + profile


def pool_profile(pool: str) -> str | None:
    """The MIG profile of a ``mig_pool``; None for every other pool."""
    return pool[len(_MIG_POOL):] if pool.startswith(_MIG_POOL) else None


def mig_prefix(resource_name: str) -> str:
    """MIG profile resources live in the base resource's domain: nvidia.com/gpu -> nvidia.com/mig-<profile>."""
    return resource_name.split("/")[0] + "/mig-"


def mig_resource(resource_name: str, profile: str) -> str:
    """The resource of a MIG profile's instances: nvidia.com/mig-1g.10gb. A ``+`` (the media-extension profiles,
    ``1g.10gb+me``) is no character of a resource name, and the kubelet would refuse the whole registration, so it
    becomes ``.`` as NVIDIA's plugin and our DRA DeviceClasses name it: nvidia.com/mig-1g.10gb.me."""
    return mig_prefix(resource_name) + profile.replace("+", ".")


def base_pools(resource_name: str, mig_strategy: str, profiles: Sequence[str]) -> list[tuple[str, str]]:
    """(resource name, pool) for each resource the MIG strategy produces, before any sharing."""
    if mig_strategy == "none":
        return [(resource_name, POOL_ALL_GPUS)]
    if mig_strategy == "single":
        return [(resource_name, POOL_SINGLE)]
    return [(resource_name, POOL_UNPARTITIONED)] + [(mig_resource(resource_name, p), mig_pool(p))
                                                     for p in sorted(set(profiles))]


def profiles_of(gpus: Sequence[Gpu]) -> list[str]:
    """MIG profiles present on these GPUs, in first-seen order."""
    seen: dict[str, None] = {}
    for g in gpus:
        for m in g.mig_devices:
            seen.setdefault(m.profile, None)
    return list(seen)


@dataclass(frozen=True)
class Selection:
    """Which devices of a pool: all (both fields None), the first ``count`` in node order, or ``ids`` (GPU
    indices, GPU UUIDs (with every MIG slice of that GPU) or MIG UUIDs)."""

    count: int | None = None
    ids: tuple[int | str, ...] | None = None

    @property
    def is_all(self) -> bool:
        return self.count is None and self.ids is None

    def describe(self) -> str | int | list[int | str]:
        if self.count is not None:
            return self.count
        return "all" if self.ids is None else list(self.ids)
