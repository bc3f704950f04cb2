"""Pure allocation logic: container responses and preferred device sets. No gRPC, no I/O beyond an injected
``exists`` check for optional device nodes."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from api.deviceplugin.v1beta1 import api_pb2
from plugin.health.state import DeviceStatus
from plugin.health.states import State

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
                       exists: Callable[[Path], bool]) -> api_pb2.ContainerAllocateResponse:
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
    dev = cfg.dev_root / "dev"
    nodes = []
    minors = sorted({d.gpu.dev_minor for d in gpus})
    nodes += [(f"nvidia{m}", True) for m in minors]
    nodes += [(n, True) for n in CONTROL_NODES]
    nodes += [(n, False) for n in OPTIONAL_NODES]
    for name, required in nodes:
        host = dev / name
        if required or exists(host):
            resp.devices.append(api_pb2.DeviceSpec(container_path=f"/dev/{name}", host_path=str(host),
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
            links += 1  # replicas of one GPU are the best-connected pair there is
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
