"""Which pods hold a GPU, from the kubelet's PodResources API: the recovery check's "busy" answer in device-plugin
mode (plugin/health/recovery.py). A diagnostic never runs under a workload, and never under one we cannot see: when
the kubelet cannot be asked, the GPU counts as held and the answer says why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from plugin.devices.model import Gpu
from plugin.health.node_state import Snapshot
from plugin.outlets.correlation import Holding, PodLister, PodResourcesClient, PodResourcesError, Resource

# How a time-sliced replica's ID ends (<uuid>::<n>): ours (plugin/kubelet/resources.py) and NVIDIA's device plugin's.
REPLICA_SEP = "::"


def pods_holding(gpu: Gpu, held: Iterable[Holding], snap: Snapshot, resources: Sequence[Resource]) -> list[str]:
    """``namespace/name`` of each pod with a container holding ``gpu``: by its UUID, a replica of it or one of its MIG
    devices, under any resource (another device plugin's too: it is the same GPU), or an ID one of our resources maps
    back to it."""
    ids = {gpu.uuid.lower(), *(m.uuid.lower() for m in gpu.mig_devices)}
    ours = {r.name: r for r in resources}
    pods: set[str] = set()
    for h in held:
        hit = h.device_id.partition(REPLICA_SEP)[0].lower() in ids
        resource = ours.get(h.resource)
        if not hit and resource is not None:
            backing = resource.backing(snap, h.device_id)
            hit = backing is not None and backing.parent_id == gpu.uuid
        if hit:
            pods.add(f"{h.namespace}/{h.pod}")
    return sorted(pods)


class PodResourcesHolders:
    """``busy(gpu)`` for the recovery check: "" when no pod holds the GPU, else "held by pod ns/name". Each answer
    is a fresh PodResources List (a check is rare; a pod may have started a second ago) on a channel of its own, closed
    after it, so the checker's thread shares nothing with the correlation outlet's."""

    def __init__(self, socket_path: Path, resources: Sequence[Resource], snapshot: Callable[[], Snapshot],
                 lister: Callable[[], PodLister] | None = None) -> None:
        self.socket_path = socket_path
        self.resources = tuple(resources)
        self._snapshot = snapshot
        self._lister = lister or (lambda: PodResourcesClient(socket_path))

    def __call__(self, gpu: Gpu) -> str:
        lister = self._lister()
        try:
            held = lister.list()
        except PodResourcesError as exc:
            return f"cannot tell which pods hold it: {exc}"
        finally:
            lister.close()
        pods = pods_holding(gpu, held, self._snapshot(), self.resources)
        if not pods:
            return ""
        more = f" and {len(pods) - 1} more" if len(pods) > 1 else ""
        return f"held by pod {pods[0]}{more}"
