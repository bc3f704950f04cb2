"""The plugin's options: the ``Config`` dataclass, each field written once with its type, default, parser and help;
plugin/options derives the table from it.

Every option has a flag (``--poll-interval``), an environment variable (``GPU_HEALTH_POLL_INTERVAL``) and a key in
the ``plugin`` section of the file (``plugin.pollInterval``); ``docs/config.md`` and ``run --help`` are generated
from the table, so a new field is documented and settable everywhere at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from plugin.health.config import HealthConfig
from plugin.options.table import Option, listen_address, optional_path, path, spec, table
from plugin.sharing.config import MIG_STRATEGIES, SharingConfig
from plugin.validation import (
    Choice,
    FieldError,
    check_condition_type,
    check_node_name,
    check_prefix,
    is_extended_resource_name,
    parse_bool,
)

ENV_PREFIX = "GPU_HEALTH_"
# One error type for a bad value at a path, whichever section it is in; the old name stays for callers.
ConfigError = FieldError


# Value parsers: each takes what a flag, a variable or the file gave and returns the field's value or raises
# ValueError with the message the user sees after the option's name.

def _number(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError(f"expected a number, got {v!r}")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {v!r}") from None


def positive_float(v: Any) -> float:
    f = _number(v)
    if not f > 0 or f != f or f == float("inf"):
        raise ValueError(f"must be a positive number, got {v!r}")
    return f


def non_negative_float(v: Any) -> float:
    f = _number(v)
    if not f >= 0 or f == float("inf"):
        raise ValueError(f"must be 0 or a positive number, got {v!r}")
    return f


def positive_int(v: Any) -> int:
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"expected a positive integer, got {v!r}")
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ValueError(f"expected a positive integer, got {v!r}") from None
    if n <= 0:
        raise ValueError(f"expected a positive integer, got {v!r}")
    return n


def gpu_count(v: Any) -> int:
    """0 (the default: no particular number) or a count of GPUs."""
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"expected a number of GPUs (0: none expected), got {v!r}")
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number of GPUs (0: none expected), got {v!r}") from None
    if not 0 <= n <= 1024:
        raise ValueError(f"expected a number of GPUs from 0 to 1024, got {v!r}")
    return n


def process_names(v: Any) -> tuple[str, ...]:
    """Process names, comma-separated (or a list in the file); an empty value is none."""
    items = v if isinstance(v, (list, tuple)) else str(v).split(",")
    out = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"expected process names, got {item!r}")
        name = item.strip()
        if "/" in name or len(name) > 255 or any(c.isspace() for c in name):
            raise ValueError(f"expected a process name (no path, no blanks), got {item!r}")
        if name:
            out.append(name)
    return tuple(dict.fromkeys(out))


def _resource(v: Any) -> str:
    s = str(v)
    if not is_extended_resource_name(s):
        raise ValueError(f"expected an extended resource name like nvidia.com/gpu, got {v!r}")
    return s


CORRELATABLE_STATES = ("Degraded", "Unknown", "Unhealthy")


def state_list(v: Any) -> tuple[str, ...]:
    """A comma-separated string or a list of states; ``none`` (or empty) for no states."""
    items = [str(x).strip() for x in v] if isinstance(v, list) else [x.strip() for x in str(v).split(",")]
    items = [x for x in items if x]
    if items in ([], ["none"]):
        return ()
    bad = [x for x in items if x not in CORRELATABLE_STATES]
    if bad:
        raise ValueError(f"expected states among {', '.join(CORRELATABLE_STATES)} (or none), got {bad[0]!r}")
    return tuple(sorted(set(items), key=CORRELATABLE_STATES.index))


def _stripped(check: Callable[[str], str]) -> Callable[[Any], str]:
    return lambda v: check(str(v).strip())


def recovery_check_command(v: Any) -> str:
    """A recovery check command template, refused at load when it could never run (an unknown placeholder, an
    unclosed quote): a typo found at the first fault would keep a repaired GPU out. Empty: no check."""
    if not isinstance(v, str):
        raise ValueError(f"expected a command (a string), got {v!r}")
    s = v.strip()
    if not s:
        return ""
    # Imported here: only a config that sets a check needs the checker's module (and subprocess) to be read.
    from plugin.health.recovery import validate_template
    error = validate_template(s)
    if error is not None:
        raise ValueError(error)
    return s


@dataclass(frozen=True)
class Config:
    mode: str = field(default="device-plugin", metadata=spec(
        Choice("device-plugin", "dra"), "how GPUs reach pods: device-plugin (the extended resource above, "
        "Healthy or Unhealthy per device) or dra (Dynamic Resource Allocation: ResourceSlices with device taints, "
        "reasons in pod status; docs/dra.md). One mode per node, never both"))
    backend: str = field(default="nvml", metadata=spec(
        Choice("nvml", "simulated"), "where device readings come from"))
    simulated_node: Path | None = field(default=None, metadata=spec(
        optional_path, "node description for the simulated backend (JSON); the built-in 8-GPU node when unset", "FILE"))
    device_plugin_dir: Path = field(default=Path("/var/lib/kubelet/device-plugins"), metadata=spec(
        path, "the kubelet's device-plugin directory (kubelet.sock lives here)", "DIR"))
    state_dir: Path = field(default=Path("/var/lib/gpu-health-device-plugin"), metadata=spec(
        path, "where durable health state (latched faults, transitions) is kept", "DIR"))
    boot_id_file: Path = field(default=Path("/proc/sys/kernel/random/boot_id"), metadata=spec(
        path, "the file holding the node's boot id; a latch set under another boot id is cleared at start if its GPU "
        "reads clean (docs/reasons.md)", "FILE"))
    kernel_log: Path | None = field(default=None, metadata=spec(
        optional_path, "read driver events from the kernel log too (normally /dev/kmsg; off when unset): XIDs, "
        "\"fallen off the bus\" and RmInitAdapter failures logged while the plugin was down or starting are seen, "
        "from a cursor kept in the state dir (docs/kernel-log.md)", "PATH"))
    expected_gpus: int = field(default=0, metadata=spec(
        gpu_count, "how many GPUs this node has; fewer in NVML is the node reason gpu-missing. 0: the node's "
        "nvidia.com/gpu.count label when GPU Feature Discovery sets it (read with cluster reporting), else no "
        "particular number", "N"))
    sysfs_root: Path = field(default=Path("/sys"), metadata=spec(
        path, "where sysfs is mounted: NVIDIA GPUs on its PCI bus that NVML does not list are the node reason "
        "gpu-missing (looked at with --backend nvml, or when this is set)", "DIR"))
    busy_grace: float = field(default=300.0, metadata=spec(
        non_negative_float, "seconds compute processes may run on a GPU no pod holds before it is Degraded "
        "busy-unallocated (a leaked or orphaned job); 0 turns the check off", "SECONDS"))
    busy_ignore: tuple[str, ...] = field(default=("nvidia-cuda-mps-server",), metadata=spec(
        process_names, "process names that may run on a GPU no pod holds (comma-separated)", "NAMES"))
    handover: bool = field(default=False, metadata=spec(
        parse_bool, "when another instance holds the state dir (a surge rollout starts the new pod first), serve "
        "the kubelet next to it and take the state dir over once it exits, instead of refusing to start"))
    health_socket: Path | None = field(default=None, metadata=spec(
        optional_path, "unix socket of the node-local health API (default: health.sock in the state dir)", "PATH"))
    dev_root: Path = field(default=Path("/"), metadata=spec(
        path, "root under which the host's /dev/nvidia* nodes are found", "DIR"))
    resource_name: str = field(default="nvidia.com/gpu", metadata=spec(
        _resource, "extended resource advertised to the kubelet", "NAME"))
    mig_strategy: str = field(default="none", metadata=spec(
        Choice(*MIG_STRATEGIES), "MIG devices: none (GPUs whole), single (MIG devices as the resource above) or "
        "mixed (one resource per profile, e.g. nvidia.com/mig-1g.10gb)"))
    cdi: bool = field(default=False, metadata=spec(
        parse_bool, "also return CDI device names (nvidia.com/gpu=<uuid>) from Allocate"))
    allow_unhealthy_allocation: bool = field(default=False, metadata=spec(
        parse_bool, "let Allocate hand out devices the plugin reports Unhealthy (otherwise Allocate fails with "
        "FAILED_PRECONDITION)"))
    poll_interval: float = field(default=5.0, metadata=spec(
        positive_float, "seconds between health polls", "SECONDS"))
    fail_on_init_error: bool = field(default=True, metadata=spec(
        parse_bool, "exit non-zero when NVML cannot start; false keeps serving with no healthy devices"))
    log_format: str = field(default="text", metadata=spec(
        Choice("text", "json"), "log line format"))
    log_level: str = field(default="info", metadata=spec(
        Choice("debug", "info", "warning", "error"), "log verbosity"))
    metrics_address: str = field(default="0.0.0.0:9402", metadata=spec(
        _stripped(listen_address), "HOST:PORT serving /metrics, /healthz and /readyz; off disables", "HOST:PORT"))
    stall_threshold: float = field(default=60.0, metadata=spec(
        positive_float, "seconds a health loop may fall behind (the poller: beyond its interval) before /healthz fails",
        "SECONDS"))
    recovery_check: str = field(default="", metadata=spec(
        recovery_check_command, "a command that must pass before a latched or held fault clears "
        "(docs/recovery-check.md), e.g. dcgmi diag -r 1 -i {index}: split like a shell would but never run by one, "
        "{index}, {uuid} and {pci} replaced by the GPU's; one at a time per node, never on a GPU a pod holds; a "
        "non-zero exit keeps the GPU out (recovery-check-failed). Empty: no check", "COMMAND"))
    recovery_check_timeout: float = field(default=600.0, metadata=spec(
        positive_float, "seconds a recovery check may run; past it its processes are killed and the check fails",
        "SECONDS"))
    correlate_on: tuple[str, ...] = field(default=("Unhealthy",), metadata=spec(
        state_list, "device states that make the plugin find the pods holding the device (PodResources) and post "
        "Events on them; comma-separated, or none", "STATES"))
    pod_resources_socket: Path = field(default=Path("/var/lib/kubelet/pod-resources/kubelet.sock"), metadata=spec(
        path, "the kubelet's PodResources socket", "PATH"))
    annotate_pods: bool = field(default=False, metadata=spec(
        parse_bool, "also annotate pods holding a failing device"))
    remediate: str = field(default="none", metadata=spec(
        Choice("none", "evict"), "evict: evict pods holding a failing device through the eviction API "
        "(PodDisruptionBudgets apply)"))
    # Cluster reporting (plugin/outlets/reporter.py, docs/annotations.md). Reporting is on when a node name is known.
    node_name: str = field(default="", metadata=spec(
        _stripped(check_node_name), "this node's name in the API server (the DaemonSet sets NODE_NAME); empty turns "
        "cluster reporting off", "NAME", env_aliases=("NODE_NAME",)))
    kubeconfig: Path | None = field(default=None, metadata=spec(
        optional_path, "kubeconfig for running outside the cluster (default: the Pod's service account)", "FILE"))
    annotations: bool = field(default=True, metadata=spec(
        parse_bool, "write per-device health annotations onto this node"))
    annotation_prefix: str = field(default="gpu-health.io", metadata=spec(
        _stripped(check_prefix), "DNS subdomain our annotation keys live under (the admission policy allows "
        "the one the chart's plugin.annotationPrefix names; gpu-health.io in manifests/)", "DOMAIN"))
    annotation_max_bytes: int = field(default=65536, metadata=spec(
        positive_int, "cap on the size of our annotations; beyond it device entries are dropped, worst kept, and a "
        "truncation marker is written", "BYTES"))
    events: bool = field(default=True, metadata=spec(
        parse_bool, "post Events on this node for transitions into and out of Degraded/Unhealthy"))
    node_condition: bool = field(default=False, metadata=spec(
        parse_bool, "maintain a node condition (needs nodes/status patch: the node-condition overlay)"))
    node_condition_type: str = field(default="GPUHealthy", metadata=spec(
        _stripped(check_condition_type), "type of that node condition (AcceleratedHardwareReady for EKS node repair: "
        "docs/remediation.md)", "TYPE"))
    node_condition_reasons: str = field(default="ours", metadata=spec(
        Choice("ours", "eks"), "reason style of that node condition: ours (GPUUnhealthy, GPUStateUnknown, "
        "GPUsHealthy) or eks (the EKS node monitoring agent's names, NvidiaXID<N>Error, ...)"))
    report_debounce: float = field(default=1.0, metadata=spec(
        positive_float, "seconds a burst of changes is collected into one write to the node, and alike changes of "
        "several GPUs into one Event", "SECONDS"))
    report_min_interval: float = field(default=10.0, metadata=spec(
        positive_float, "seconds between two writes to the node (token bucket)", "SECONDS"))
    report_resync_interval: float = field(default=600.0, metadata=spec(
        positive_float, "seconds between re-reads of the node that repair manual edits of our keys", "SECONDS"))
    report_backoff_max: float = field(default=300.0, metadata=spec(
        positive_float, "longest wait between retries while the API server is unreachable or refusing (exponential "
        "back-off with jitter up to this)", "SECONDS"))
    # DRA mode (--mode dra, docs/dra.md): the kubelet plugin's sockets, CDI specs, health mapping and taints.
    dra_plugin_dir: Path = field(default=Path("/var/lib/kubelet/plugins/gpu.gpu-health.io"), metadata=spec(
        path, "DRA mode: directory of the DRA service socket (dra.sock); the kubelet connects to it at this path",
        "DIR"))
    dra_registry_dir: Path = field(default=Path("/var/lib/kubelet/plugins_registry"), metadata=spec(
        path, "DRA mode: the kubelet's plugin registration directory", "DIR"))
    cdi_spec_dir: Path = field(default=Path("/var/run/cdi"), metadata=spec(
        path, "DRA mode: where the CDI spec of each prepared claim is written (a directory the container "
        "runtime reads CDI specs from)", "DIR"))
    dra_degraded_health: str = field(default="Healthy", metadata=spec(
        Choice("Healthy", "Unhealthy"), "DRA mode: the health a Degraded device shows in pod status (its reason "
        "is the message either way)"))
    dra_unhealthy_taint_effect: str = field(default="NoSchedule", metadata=spec(
        Choice("NoSchedule", "NoExecute"), "DRA mode: effect of the taint on an Unhealthy device in the "
        "ResourceSlice; NoExecute also evicts the pods using it"))
    dra_degraded_taint: bool = field(default=True, metadata=spec(
        parse_bool, "DRA mode: put a taint with no effect (it only informs) carrying the reason on a Degraded device; "
        "when health.kubeletHealth maps Degraded to Unhealthy it gets a NoSchedule taint whatever this says"))
    # NVSentinel interop (docs/nvsentinel.md): our health into its platform connector and its device API, and other
    # providers' GPU conditions from that API into our engine. All off unless a socket is named.
    nvsentinel_socket: Path | None = field(default=None, metadata=spec(
        optional_path, "unix socket of NVSentinel's platform connector (theirs listens on /var/run/nvsentinel.sock); "
        "set, every device transition is sent there as a health event", "PATH"))
    nvsentinel_store_only: bool = field(default=False, metadata=spec(
        parse_bool, "mark the health events sent to NVSentinel STORE_ONLY (their shadow mode: kept and exported, "
        "never acted on)"))
    device_api_socket: Path | None = field(default=None, metadata=spec(
        optional_path, "unix socket of NVSentinel's device API server (theirs listens on "
        "/var/run/device-api/device.sock); --device-api-provide and --device-api-consume use it", "PATH"))
    device_api_provide: bool = field(default=False, metadata=spec(
        parse_bool, "publish every GPU and its health (state, reason, recommended action) to the device API, "
        "only on change"))
    device_api_consume: bool = field(default=False, metadata=spec(
        parse_bool, "watch the device API and take a condition another provider sets on one of our GPUs as a "
        "reason (code external-<type>)"))
    # The file-only sections, and where each option's value came from.
    health: HealthConfig = field(default_factory=HealthConfig)
    sharing: SharingConfig = field(default_factory=SharingConfig)
    source: dict[str, str] = field(default_factory=dict, compare=False)  # field -> flag/env/file/default
    # field -> the name the user set it under (--state-dir, GPU_HEALTH_STATE_DIR, plugin.stateDir), for messages
    set_by: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def health_socket_path(self) -> Path:
        return self.health_socket or self.state_dir / "health.sock"

    def name_of(self, name: str) -> str:
        """How to name an option in a message: as the user set it, else by its flag."""
        return self.set_by.get(name) or option(name).flag

    def effective(self) -> dict[str, Any]:
        """What is in force, for the start-up log (JSON-safe)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in ("health", "source", "set_by", "sharing"):
                continue
            v = getattr(self, f.name)
            out[f.name] = str(v) if isinstance(v, Path) else v
        out["health_socket"] = str(self.health_socket_path)
        out["sharing"] = self.sharing.effective()
        h = self.health
        out["health"] = {
            "fatal_xids": sorted(h.fatal_xids), "degraded_xids": sorted(h.degraded_xids),
            "application_xids": sorted(h.application_xids), "ignored_xids": sorted(h.ignored_xids),
            "clear_after_polls": h.clear_after_polls, "rate_hold_s": h.rate_hold_s,
            "ecc_corrected_limit": h.ecc_corrected_limit, "ecc_corrected_rate_per_min": h.ecc_corrected_rate_per_min,
            "overrides": h.overrides, "nvlink_expected_links": h.nvlink_expected_links,
            "kubelet_health": {k.value: v for k, v in h.kubelet_health.items()},
        }
        return out


OPTIONS = table(Config, ENV_PREFIX, "plugin")
_BY_NAME = {o.name: o for o in OPTIONS}


def option(name: str) -> Option:
    """The option behind a Config field (KeyError for a field that is not one, such as ``health``)."""
    return _BY_NAME[name]
