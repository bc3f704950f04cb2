"""Resources: how physical GPUs (and their MIG slices) become the device IDs one kubelet resource advertises.

A resource is a list of parts. Each part takes the devices of one pool (every GPU, GPUs without MIG slices, the MIG
slices of one profile, ...), optionally narrowed by a selection (or by its complement), and advertises each device
either as itself (ID = GPU or MIG UUID) or as ``replicas`` time-sliced replicas with IDs ``<uuid>::<n>``.

The kubelet-facing health of every advertised device comes from the node state: a replica is backed by its
parent's ``DeviceStatus`` and so takes the parent's health; nothing here computes health.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from api.deviceplugin.v1beta1 import api_pb2
from plugin.health.node_state import DeviceStatus, Snapshot
from plugin.kubelet.allocation import AllocationError, preferred, preferred_gpus, preferred_replicas
from plugin.sharing.model import POOL_ALL_GPUS, POOL_SINGLE, POOL_UNPARTITIONED, Selection, pool_profile

log = logging.getLogger(__name__)

REPLICA_SEP = "::"
MAX_DEVICE_ID = 63  # the kubelet's limit on a device ID


def in_pool(pool: str, d: DeviceStatus) -> bool:
    if pool == POOL_ALL_GPUS:
        return d.mig is None
    if pool == POOL_UNPARTITIONED:
        return d.mig is None and not d.gpu.mig_devices
    if pool == POOL_SINGLE:
        return d.mig is not None or not d.gpu.mig_devices
    profile = pool_profile(pool)
    if profile is not None:
        return d.mig is not None and d.mig.profile == profile
    raise ValueError(f"unknown device pool {pool!r}")


@dataclass(frozen=True)
class KubeletDevice:
    id: str
    health: str
    numa_node: int | None


def _chosen(selection: Selection, members: Sequence[DeviceStatus]) -> set[str]:
    """The IDs of the pool's members a selection names: the first ``count``, or those whose GPU index, GPU UUID
    or own ID is listed."""
    if selection.count is not None:
        return {d.id for d in members[:selection.count]}
    if selection.ids is None:
        return {d.id for d in members}
    wanted = set(selection.ids)
    return {d.id for d in members if d.gpu.index in wanted or d.id in wanted or d.gpu.uuid in wanted}


@dataclass(frozen=True)
class Part:
    pool: str
    selection: Selection = field(default_factory=Selection)
    invert: bool = False  # take the pool's devices the selection does NOT choose
    replicas: int = 0  # 0: the device itself; n >= 1: n time-sliced replicas <id>::0 .. <id>::n-1

    def members(self, snap: Snapshot) -> list[DeviceStatus]:
        pool = [d for d in snap.devices if in_pool(self.pool, d)]
        if self.selection.is_all:
            return [] if self.invert else pool
        chosen = _chosen(self.selection, pool)
        return [d for d in pool if (d.id in chosen) != self.invert]


@dataclass(frozen=True)
class _Plan:
    """One snapshot's resolution of a resource: each backing device with its replica count (0: whole)."""

    snap: Snapshot
    entries: tuple[tuple[DeviceStatus, int], ...]
    by_id: dict[str, tuple[DeviceStatus, int]]
    view: list[tuple[KubeletDevice, ...]] = field(default_factory=list)  # filled lazily, once
    wire: list[bytes] = field(default_factory=list)  # the view as a serialised ListAndWatchResponse, lazily


class Resource(Protocol):
    @property
    def name(self) -> str: ...

    def devices(self, snap: Snapshot) -> tuple[KubeletDevice, ...]:
        """The full ListAndWatch view of this resource in this snapshot."""
        ...

    def backing(self, snap: Snapshot, device_id: str) -> DeviceStatus | None:
        """The status whose health and hardware stand behind one advertised ID; None when unknown."""
        ...

    def response(self, snap: Snapshot) -> api_pb2.ListAndWatchResponse:
        """``devices(snap)`` as the ListAndWatch message."""
        ...

    def check_request(self, snap: Snapshot, ids: Sequence[str], what: str) -> None:
        """Refuse (AllocationError) a container request this resource's settings forbid."""
        ...

    def preferred(self, snap: Snapshot, available: Sequence[str], must: Sequence[str], size: int) -> list[str]:
        """The IDs to prefer; every ID given is known to ``backing``."""
        ...


class DeviceResource:
    """A resource built from parts. Thread-safe: the per-snapshot plan is replaced whole, never mutated after
    its view is filled, and the expansion cache only ever gains equal values."""

    def __init__(self, name: str, parts: Sequence[Part] | None = None, policy: str = "distributed",
                 fail_requests_greater_than_one: bool = False, fail_setting: str = "") -> None:
        self.name = name
        self.parts = tuple(parts) if parts is not None else (Part(POOL_ALL_GPUS),)  # default: whole GPUs
        self.policy = policy
        self.fail_requests_greater_than_one = fail_requests_greater_than_one
        self.fail_setting = fail_setting
        self._plan_cache: _Plan | None = None
        # (device id, kubelet health, NUMA node, replicas) -> advertised devices. Reusing the same objects makes
        # the servicer's "did the view change" comparison an identity check for unchanged devices.
        self._expanded: dict[tuple[str, str, int | None, int], tuple[tuple[KubeletDevice, ...], bytes]] = {}
        self._too_long: set[str] = set()

    def __repr__(self) -> str:
        return f"DeviceResource({self.describe()})"

    def describe(self) -> str:
        def one(p: Part) -> str:
            sel = "" if p.selection.is_all else f" {'not ' if p.invert else ''}{p.selection.describe()}"
            return f"{p.pool}{sel}" + (f" x{p.replicas} replicas" if p.replicas else "")
        return f"{self.name}: " + ", ".join(one(p) for p in self.parts)

    @property
    def shares(self) -> bool:
        return any(p.replicas for p in self.parts)

    # Resolution -------------------------------------------------------------------------------------------------

    def _plan(self, snap: Snapshot) -> _Plan:
        cached = self._plan_cache
        if cached is not None and cached.snap is snap:
            return cached
        entries: list[tuple[DeviceStatus, int]] = []
        for part in self.parts:
            entries.extend((d, part.replicas) for d in part.members(snap))
        plan = _Plan(snap, tuple(entries), {d.id: (d, r) for d, r in entries})
        self._plan_cache = plan
        return plan

    def _expand(self, d: DeviceStatus, replicas: int) -> tuple[tuple[KubeletDevice, ...], bytes]:
        """The advertised devices of one backing device, and their ListAndWatchResponse encoding."""
        key = (d.id, d.kubelet_health, d.gpu.numa_node, replicas)
        cached = self._expanded.get(key)
        if cached is not None:
            return cached
        devs: tuple[KubeletDevice, ...]
        if replicas == 0:
            devs = (KubeletDevice(d.id, d.kubelet_health, d.gpu.numa_node),)
        else:
            ids = [f"{d.id}{REPLICA_SEP}{n}" for n in range(replicas)]
            if len(ids[-1]) > MAX_DEVICE_ID:
                if d.id not in self._too_long:
                    self._too_long.add(d.id)
                    log.error("%s: replica IDs of %s would exceed the kubelet's %d characters; replicas beyond "
                              "that are not advertised", self.name, d.id, MAX_DEVICE_ID)
                ids = [i for i in ids if len(i) <= MAX_DEVICE_ID]
            devs = tuple(KubeletDevice(i, d.kubelet_health, d.gpu.numa_node) for i in ids)
        # Building 1,024 protobuf messages field by field costs ~1.7 ms in Python; concatenated encodings of
        # messages are the encoding of their merge, so a snapshot's message is a join of cached bytes plus one parse.
        msg = api_pb2.ListAndWatchResponse()
        for k in devs:
            dev = msg.devices.add(ID=k.id, health=k.health)
            if k.numa_node is not None:
                dev.topology.nodes.add(ID=k.numa_node)
        entry = (devs, msg.SerializeToString())
        if len(self._expanded) > 4096:  # devices come and go (simulated files, GPUs lost): stay bounded
            self._expanded.clear()
        self._expanded[key] = entry
        return entry

    # Resource protocol ------------------------------------------------------------------------------------------

    def devices(self, snap: Snapshot) -> tuple[KubeletDevice, ...]:
        plan = self._plan(snap)
        if plan.view:
            return plan.view[0]
        out: list[KubeletDevice] = []
        wire: list[bytes] = []
        for d, replicas in plan.entries:
            devs, encoded = self._expand(d, replicas)
            out.extend(devs)
            wire.append(encoded)
        view = tuple(out)
        plan.wire.append(b"".join(wire))
        plan.view.append(view)
        return view

    def response(self, snap: Snapshot) -> api_pb2.ListAndWatchResponse:
        plan = self._plan(snap)
        if not plan.wire:
            self.devices(snap)
        return api_pb2.ListAndWatchResponse.FromString(plan.wire[0])

    def _lookup(self, snap: Snapshot, device_id: str) -> tuple[DeviceStatus, int] | None:
        """(backing status, replica count of its part) for an advertised ID; None when not advertised."""
        plan = self._plan(snap)
        whole = plan.by_id.get(device_id)
        if whole is not None:
            return whole if whole[1] == 0 else None
        base, sep, n = device_id.rpartition(REPLICA_SEP)
        if not sep:
            return None
        entry = plan.by_id.get(base)
        # "07" or "+1" must not alias replica 7 or 1: the kubelet compares IDs as strings.
        if entry is None or entry[1] == 0 or not n.isdigit() or str(int(n)) != n or int(n) >= entry[1]:
            return None
        if len(device_id) > MAX_DEVICE_ID:
            return None
        return entry

    def backing(self, snap: Snapshot, device_id: str) -> DeviceStatus | None:
        entry = self._lookup(snap, device_id)
        return entry[0] if entry is not None else None

    def check_request(self, snap: Snapshot, ids: Sequence[str], what: str) -> None:
        if not self.fail_requests_greater_than_one or len(ids) <= 1:
            return
        replicas = [i for i in ids if (e := self._lookup(snap, i)) is not None and e[1] > 0]
        if replicas:
            raise AllocationError(
                "INVALID_ARGUMENT",
                f"{what}: {len(ids)} devices of {self.name} requested ({', '.join(list(ids)[:4])}"
                f"{', ...' if len(ids) > 4 else ''}), but {self.fail_setting or 'failRequestsGreaterThanOne'} "
                f"is true: request 1 (replicas share one GPU's time; more of them add no capacity)")

    def preferred(self, snap: Snapshot, available: Sequence[str], must: Sequence[str], size: int) -> list[str]:
        avail = [(i, e) for i in available if (e := self._lookup(snap, i)) is not None]
        need = [(i, e) for i in must if (e := self._lookup(snap, i)) is not None]
        if any(e[1] > 0 for _, e in avail + need):
            items = [(i, e[0], max(e[1], 1)) for i, e in avail]
            must_items = [(i, e[0], max(e[1], 1)) for i, e in need]
            return preferred_replicas(items, must_items, size, self.policy)
        a_st = [e[0] for _, e in avail]
        m_st = [e[0] for _, e in need]
        if all(d.mig is None for d in a_st + m_st):
            gpus = tuple(d.gpu for d in snap.devices if d.mig is None)
            return preferred_gpus(gpus, a_st, m_st, size)
        return preferred(a_st, m_st, size)


class WholeGpus(DeviceResource):
    """One advertised device per physical GPU, ID = GPU UUID (MIG slices are not advertised here)."""

    def __init__(self, name: str = "nvidia.com/gpu") -> None:
        super().__init__(name)
