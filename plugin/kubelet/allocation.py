"""Pure allocation logic: container responses and preferred device sets. No gRPC, no I/O beyond an injected
``exists`` check for optional device nodes."""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from api.deviceplugin.v1beta1 import api_pb2
from plugin.devices.model import Gpu
from plugin.health.node_state import DeviceStatus
from plugin.health.reasons import State

CONTROL_NODES = ("nvidiactl",)
OPTIONAL_NODES = ("nvidia-uvm", "nvidia-uvm-tools")


class AllocationError(Exception):
    """A request the plugin must refuse; ``code`` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class AllocationConfig:
    dev_root: Path = Path("/")
    cdi: bool = False
    cdi_kind: str = "nvidia.com/gpu"
    allow_unhealthy: bool = False

    @property
    def dev_dir(self) -> str:
        return os.path.join(self.dev_root, "dev")


def check_ids(ids: Sequence[str], lookup: Callable[[str], DeviceStatus | None], allow_unhealthy: bool,
              what: str = "devices_ids") -> list[DeviceStatus]:
    """Validate one container's IDs; return their statuses in request order."""
    if not ids:
        raise AllocationError("INVALID_ARGUMENT", f"{what} is empty: a container must request at least one device")
    seen: set[str] = set()
    out: list[DeviceStatus] = []
    for device_id in ids:
        if device_id in seen:
            raise AllocationError("INVALID_ARGUMENT", f"{what}: device {device_id!r} is listed twice")
        seen.add(device_id)
        status = lookup(device_id)
        if status is None:
            raise AllocationError("INVALID_ARGUMENT", f"{what}: unknown device {device_id!r}")
        if status.kubelet_health != "Healthy" and not allow_unhealthy:
            why = ", ".join(r.code for r in status.reasons) or status.state.value
            raise AllocationError("FAILED_PRECONDITION",
                                  f"device {device_id!r} is {status.state.value} ({why}); refusing to allocate it")
        out.append(status)
    return out


def container_response(devices: Sequence[DeviceStatus], cfg: AllocationConfig,
                       exists: Callable[[str], bool]) -> api_pb2.ContainerAllocateResponse:
    gpus = []
    seen: set[str] = set()
    for d in devices:
        # Replicas and MIG slices of one GPU name the physical GPU once.
        key = d.mig.uuid if d.mig is not None else d.gpu.uuid
        if key not in seen:
            seen.add(key)
            gpus.append(d)
    resp = api_pb2.ContainerAllocateResponse()
    resp.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(d.mig.uuid if d.mig else d.gpu.uuid for d in gpus)
    # Plain strings, not pathlib: this runs on every Allocate and pathlib was half its cost.
    dev = cfg.dev_dir
    nodes = [(f"nvidia{m}", True) for m in sorted({d.gpu.dev_minor for d in gpus})]
    nodes += [(n, True) for n in CONTROL_NODES]
    nodes += [(n, False) for n in OPTIONAL_NODES]
    for name, required in nodes:
        host = f"{dev}/{name}"
        if required or exists(host):
            resp.devices.append(api_pb2.DeviceSpec(container_path=f"/dev/{name}", host_path=host,
                                                   permissions="rw"))
    if cfg.cdi:
        for d in gpus:
            resp.cdi_devices.append(api_pb2.CDIDevice(name=f"{cfg.cdi_kind}={d.mig.uuid if d.mig else d.gpu.uuid}"))
    return resp


# Preferred allocation ---------------------------------------------------------------------------------------------

EXHAUSTIVE_LIMIT = 12  # candidates beyond this use the greedy search (C(12,6) = 924 sets at most)


def set_score(chosen: Sequence[DeviceStatus]) -> tuple[int, int, int, int]:
    """Higher is better: fewer degraded GPUs, then NVLink links inside the set, then pairs behind one PCIe switch,
    then pairs on one NUMA node."""
    degraded = sum(1 for d in chosen if d.state != State.HEALTHY)
    links = switches = numa = 0
    for a, b in itertools.combinations(chosen, 2):
        ga, gb = a.gpu, b.gpu
        if ga.uuid == gb.uuid:
            # Slices or replicas of one GPU are the best-connected pair there is: they share everything, and count
            # as two links so that no pair of distinct GPUs (NVLink, one switch, one NUMA node) ties with them.
            links += 2
            switches += 1
            numa += 1
            continue
        if gb.index in ga.nvlink_peers or ga.index in gb.nvlink_peers:
            links += 1
        if ga.pcie_switch is not None and ga.pcie_switch == gb.pcie_switch:
            switches += 1
        if ga.numa_node is not None and ga.numa_node == gb.numa_node:
            numa += 1
    return (-degraded, links, switches, numa)


def preferred(available: Sequence[DeviceStatus], must: Sequence[DeviceStatus], size: int) -> list[str]:
    """Pick ``size`` devices including ``must`` from ``available``: exhaustive on small sets, greedy beyond."""
    must_ids = {d.id for d in must}
    rest = [d for d in available if d.id not in must_ids]
    need = size - len(must)
    if need <= 0:
        return [d.id for d in must][:max(size, len(must))]
    if need >= len(rest):
        return [d.id for d in must] + [d.id for d in rest]
    order = {d.id: i for i, d in enumerate(available)}
    if len(rest) <= EXHAUSTIVE_LIMIT:
        best = max(itertools.combinations(rest, need),
                   key=lambda combo: (set_score(list(must) + list(combo)),
                                      [-order[d.id] for d in combo]))
        return [d.id for d in must] + [d.id for d in best]
    chosen = list(must)
    pool = list(rest)
    for _ in range(need):
        pick = max(pool, key=lambda d: (set_score([*chosen, d]), -order[d.id]))
        chosen.append(pick)
        pool.remove(pick)
    return [d.id for d in chosen]


# Whole GPUs: an exact search over a per-topology score table -------------------------------------------------------

TABLE_LIMIT = 12  # GPUs on the node up to which every subset's interconnect score is tabulated (4096 entries)


@dataclass(frozen=True)
class _Topology:
    pos: dict[str, int]  # GPU UUID -> bit
    scores: tuple[int, ...] | None  # subset mask -> packed (links, switches, numa); None beyond TABLE_LIMIT
    base: int  # the packing radix: one more than the number of pairs


@functools.lru_cache(maxsize=8)
def _topology(gpus: tuple[Gpu, ...]) -> _Topology:
    """Built once per discovered topology (the GPUs are read once at discovery), so a request costs only a walk
    over candidate sets and a table lookup each."""
    n = len(gpus)
    pos = {g.uuid: i for i, g in enumerate(gpus)}
    base = n * (n - 1) // 2 + 1
    if n > TABLE_LIMIT or len(pos) != n:
        return _Topology(pos, None, base)
    nv = [0] * n
    sw = [0] * n
    nu = [0] * n
    for i, a in enumerate(gpus):
        for j, b in enumerate(gpus):
            if i == j:
                continue
            if b.index in a.nvlink_peers or a.index in b.nvlink_peers:
                nv[i] |= 1 << j
            if a.pcie_switch is not None and a.pcie_switch == b.pcie_switch:
                sw[i] |= 1 << j
            if a.numa_node is not None and a.numa_node == b.numa_node:
                nu[i] |= 1 << j
    scores = [0] * (1 << n)
    for mask in range(1, 1 << n):
        low = mask & -mask
        i = low.bit_length() - 1
        rest = mask ^ low
        # Adding GPU i to the set ``rest`` adds its pairs with every member; the fields never exceed ``base``.
        scores[mask] = scores[rest] + ((nv[i] & rest).bit_count() * base + (sw[i] & rest).bit_count()) * base \
            + (nu[i] & rest).bit_count()
    return _Topology(pos, tuple(scores), base)


def preferred_gpus(gpus: tuple[Gpu, ...], available: Sequence[DeviceStatus], must: Sequence[DeviceStatus],
                   size: int) -> list[str]:
    """Whole GPUs: the set of ``size`` with the best ``set_score`` (fewest degraded, then NVLink pairs, then pairs
    behind one PCIe switch, then pairs on one NUMA node), exact for nodes up to TABLE_LIMIT GPUs. ``gpus`` are
    every GPU of the node (the table's key); ties go to the set listed first in ``available``."""
    topo = _topology(gpus)
    must_ids = {d.id for d in must}
    rest = [d for d in available if d.id not in must_ids]
    need = size - len(must)
    if need <= 0 or need >= len(rest) or topo.scores is None or \
            any(d.gpu.uuid not in topo.pos for d in (*rest, *must)):
        return preferred(available, must, size)
    pos = topo.pos
    table = topo.scores
    weight = topo.base ** 3  # one degraded GPU outweighs any interconnect difference
    must_mask = 0
    for d in must:
        must_mask |= 1 << pos[d.gpu.uuid]
    degraded = 0
    for d in (*rest, *must):
        if d.state != State.HEALTHY:
            degraded |= 1 << pos[d.gpu.uuid]
    bits = [1 << pos[d.gpu.uuid] for d in rest]
    best = max(itertools.combinations(range(len(rest)), need),
               key=lambda c: _key(table, must_mask, degraded, weight, [bits[k] for k in c]))
    return [d.id for d in must] + [rest[k].id for k in best]


def _key(table: tuple[int, ...], must_mask: int, degraded: int, weight: int, bits: list[int]) -> int:
    mask = must_mask | sum(bits)
    return table[mask] - (mask & degraded).bit_count() * weight


# Replicas: distributed or packed over their GPUs ------------------------------------------------------------------

def preferred_replicas(available: Sequence[tuple[str, DeviceStatus, int]],
                       must: Sequence[tuple[str, DeviceStatus, int]], size: int, policy: str) -> list[str]:
    """Items are (advertised ID, backing device, replicas of that device; 1 for a whole device). ``distributed``
    spreads the request over devices, fewest replicas in use first; ``packed`` fills devices that are already in
    use, so untouched GPUs stay free. Healthy devices come before degraded ones in both."""
    chosen = [i for i, _, _ in must]
    taken = set(chosen)
    need = size - len(chosen)
    if need <= 0:
        return chosen
    free: dict[str, list[str]] = {}
    total: dict[str, int] = {}
    degraded: dict[str, bool] = {}
    first: dict[str, int] = {}
    for k, (i, d, n) in enumerate(available):
        if i in taken:
            continue
        free.setdefault(d.id, []).append(i)
        total[d.id] = n
        degraded[d.id] = d.state != State.HEALTHY
        first.setdefault(d.id, k)
    # In use = replicas the kubelet no longer offers (held by other pods) plus the must-include ones, which are
    # left out of ``free`` above.
    used = {g: total[g] - len(ids) for g, ids in free.items()}
    cursor = dict.fromkeys(free, 0)

    def left(g: str) -> int:
        return len(free[g]) - cursor[g]

    def take(g: str, count: int) -> None:
        chosen.extend(free[g][cursor[g]:cursor[g] + count])
        cursor[g] += count
        used[g] += count

    while need > 0:
        open_groups = [g for g in free if left(g) > 0]
        if not open_groups:
            break
        if policy == "packed":
            fits = [g for g in open_groups if left(g) >= need]
            if fits:
                g = min(fits, key=lambda g: (degraded[g], -used[g], left(g), first[g]))
                take(g, need)
                break
            g = min(open_groups, key=lambda g: (degraded[g], -used[g], -left(g), first[g]))
            count = left(g)
        else:
            g = min(open_groups, key=lambda g: (degraded[g], used[g], -left(g), first[g]))
            count = 1
        take(g, count)
        need -= count
    return chosen
