"""Device statuses for driving NodeState directly (cluster-reporting tests and benchmarks): no backend, no tracker."""

from __future__ import annotations

from plugin.devices.model import Gpu, MigDevice
from plugin.health.config import DEFAULT_KUBELET_HEALTH
from plugin.health.node_state import DeviceStatus, NodeState
from plugin.health.reasons import SPECS, Reason, Source, State

# The codes tests set, with a message each; severity and action come from REASONS.
MESSAGES = {
    "xid-79": "XID 79: GPU has fallen off the bus",
    "ecc-uncorrected": "2 volatile uncorrected ECC errors",
    "thermal-slowdown": "temperature 90C at or above slowdown threshold 87C",
    "nvml-error": "NVML calls failed for 3 consecutive polls",
}


def reason(code: str, first_seen: float) -> Reason:
    spec = SPECS[code]
    return Reason(code, spec.severity, MESSAGES[code], Source.POLL, spec.action, first_seen)


def gpu(index: int, migs: int = 0) -> Gpu:
    uuid = f"GPU-{index:08d}-aaaa-bbbb-cccc-{index:012d}"
    mig = tuple(MigDevice(uuid=f"MIG-{index:04d}-{m}-dddd-eeee-{m:012d}", parent_uuid=uuid, gpu_instance_id=m + 1,
                          compute_instance_id=0, profile="1g.10gb") for m in range(migs))
    return Gpu(uuid=uuid, index=index, name="NVIDIA H100 80GB HBM3", mig_devices=mig)


def status(g: Gpu, state: State = State.HEALTHY, *codes: str, since: float = 1_767_225_600.0,
           mig: MigDevice | None = None) -> DeviceStatus:
    reasons = tuple(reason(c, since) for c in codes)
    return DeviceStatus(mig.uuid if mig else g.uuid, g, state, reasons, since, DEFAULT_KUBELET_HEALTH[state], mig)


class Node:
    """A node of ``n`` GPUs whose states a test sets one device at a time."""

    def __init__(self, state: NodeState, n: int = 8, migs: int = 0) -> None:
        self.state = state
        self.gpus = [gpu(i, migs) for i in range(n)]
        self.current: dict[str, DeviceStatus] = {}
        for g in self.gpus:
            self.current[g.uuid] = status(g)
            for m in g.mig_devices:
                self.current[m.uuid] = status(g, mig=m)

    def publish(self, now: float) -> None:
        self.state.publish(list(self.current.values()), now)

    def set(self, index: int, state: State, *codes: str, now: float) -> None:
        g = self.gpus[index]
        self.current[g.uuid] = status(g, state, *codes, since=now)
        self.publish(now)

    def remove(self, index: int, now: float) -> None:
        del self.current[self.gpus[index].uuid]
        self.publish(now)
