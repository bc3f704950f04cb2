"""The kubelet side of sharing: the ``sharing`` section and the MIG strategy (plugin/sharing/) as the list of
resources the supervisor serves, one gRPC server and socket per resource. ``docs/sharing.md`` is the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from plugin.kubelet.resources import DeviceResource, Part
from plugin.sharing.config import SharingConfig, TimeSlicedResource
from plugin.sharing.model import base_pools

log = logging.getLogger(__name__)


def build_resources(resource_name: str, mig_strategy: str, sharing: SharingConfig,
                    profiles: Sequence[str] = ()) -> list[DeviceResource]:
    """The resources to serve. ``profiles`` are the MIG profiles seen at discovery (strategy mixed): like the
    topology, they are read once; a profile that appears later is advertised after a plugin restart."""
    by_name: dict[str, TimeSlicedResource] = {r.name: r for r in sharing.resources}
    parts: dict[str, list[Part]] = {}
    shared: dict[str, TimeSlicedResource] = {}
    for name, pool in base_pools(resource_name, mig_strategy, profiles):
        ts = by_name.get(name)
        if ts is None:
            parts.setdefault(name, []).append(Part(pool))
            continue
        target = ts.advertised_as
        shared[target] = ts
        if ts.devices.is_all and ts.rename is not None:
            parts.setdefault(target, []).append(Part(pool, ts.devices, replicas=ts.replicas))
            continue
        # The devices the entry does not select stay whole under the original name.
        parts.setdefault(name, []).append(Part(pool, ts.devices, invert=True))
        parts.setdefault(target, []).append(Part(pool, ts.devices, replicas=ts.replicas))
    out = []
    for name, ps in parts.items():
        ts = shared.get(name)
        out.append(DeviceResource(
            name=name, parts=tuple(p for p in ps if not (p.invert and p.selection.is_all)),
            policy=sharing.policy,
            fail_requests_greater_than_one=ts.fail_requests_greater_than_one if ts else False,
            fail_setting=f"{ts.where}.failRequestsGreaterThanOne" if ts else ""))
    for r in out:
        log.info("resource %s", r.describe())
    return out
