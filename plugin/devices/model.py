"""What the plugin knows about GPUs: discovered devices, polled readings and driver events.

Every backend produces these same immutable values, so the health policy never knows where they came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# nvml.h's nvmlGpuRecoveryAction_t 0-7 in order, then "unknown" for a value a later driver may add.
RECOVERY_ACTIONS = ("none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset", "recover_imex_domain",
                    "bus_reset", "system_reboot", "unknown")
CLOCK_EVENT_REASONS = ("hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
FABRIC_HEALTH = ("healthy", "unhealthy", "limited_capacity")


@dataclass(frozen=True)
class MigDevice:
    """A MIG slice of a parent GPU; its health follows the parent plus events scoped to its GPU instance."""

    uuid: str
    parent_uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    profile: str  # e.g. "1g.10gb"
    memory_mib: int = 0


@dataclass(frozen=True)
class Gpu:
    uuid: str
    index: int
    name: str = "NVIDIA GPU"
    minor: int | None = None  # /dev/nvidia<minor>; the simulated node uses the index
    numa_node: int | None = None
    memory_mib: int = 0
    pci_bus_id: str = ""
    nvlink_peers: tuple[int, ...] = ()
    pcie_switch: str | None = None
    mig_devices: tuple[MigDevice, ...] = ()

    @property
    def dev_minor(self) -> int:
        return self.index if self.minor is None else self.minor


@dataclass(frozen=True)
class ComputeProcess:
    """A process with a compute context on a GPU, as NVML lists it: its host PID, the GPU memory it holds (None
    when NVML cannot say) and its name ("" when NVML cannot name it)."""

    pid: int
    used_mib: int | None = None
    name: str = ""


@dataclass(frozen=True)
class Reading:
    """One poll of one GPU. ``None`` means the signal does not exist on this GPU (NVML NotSupported)."""

    time: float
    model: str = ""  # the GPU's product name, for per-model expectations (health.nvlinkExpectedLinks)
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    ecc_corrected_aggregate: int | None = None
    row_remap_pending: bool | None = None
    row_remap_failure: bool | None = None
    retired_pages_pending: bool | None = None
    retired_pages_count: int | None = None
    temperature_c: int | None = None
    temperature_slowdown_c: int | None = None
    temperature_shutdown_c: int | None = None
    clock_event_reasons: frozenset[str] | None = None
    gpu_idle: bool = False
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_max_gen: int | None = None
    pcie_max_width: int | None = None
    pcie_replay_count: int | None = None
    # Links seen active (now or before a restart) that are not active now: a link never active is topology.
    nvlink_down: tuple[int, ...] | None = None
    nvlink_active_count: int | None = None
    nvlink_error_count: int | None = None  # replay + recovery counters summed over links
    nvlink_crc_count: int | None = None
    recovery_action: str | None = None
    recovery_action_code: int | None = None  # the number NVML gave, for an "unknown" action's message
    fabric_health: str | None = None
    lost: bool = False
    reset_required: bool = False
    # The processes computing on the GPU; None when not read (NotSupported, or a GPU in MIG mode).
    compute_processes: tuple[ComputeProcess, ...] | None = None
    # Signals whose read failed with an NVML error other than NotSupported: (signal, message).
    errors: tuple[tuple[str, str], ...] = ()


class EventOrigin(StrEnum):
    """Where a driver event was read: NVML's event set, or the kernel log (``--kernel-log``)."""

    NVML = "nvml"
    KERNEL_LOG = "kernel-log"


class EventKind(StrEnum):
    XID = "xid"  # the event's code carries the XID
    ECC_DBE = "ecc-dbe"
    GPU_UNAVAILABLE = "gpu-unavailable"
    RECOVERY_ACTION = "recovery-action"


@dataclass(frozen=True)
class GpuEvent:
    """A driver event; ``code`` carries the XID of an XID event and the action of a recovery-action one.
    ``repeats``: how many identical records the kernel log reader folded into this one (a flood is one event)."""

    uuid: str
    kind: EventKind
    code: int
    time: float
    gpu_instance_id: int | None = None  # None: the whole GPU
    compute_instance_id: int | None = None
    origin: EventOrigin = EventOrigin.NVML
    repeats: int = 1


@dataclass(frozen=True)
class Discovery:
    """A consistent snapshot of the devices a backend sees; ``error`` set when discovery itself failed."""

    gpus: tuple[Gpu, ...] = ()
    driver_version: str = ""
    error: str | None = None
