"""Wiring and lifecycle: build the backend, node state, health engine, outlets and supervisor; stop them in order."""

from __future__ import annotations

import json
import logging
import platform
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING

from plugin.config import Config, option
from plugin.devices.backend import Backend, BackendError
from plugin.devices.kmsg import PciAddress
from plugin.devices.model import Discovery, Gpu, GpuEvent, Reading
from plugin.health.busy import BusyWatch
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.health.store import StateStore
from plugin.kubelet.allocation import AllocationConfig
from plugin.kubelet.sharing import build_resources
from plugin.kubelet.supervisor import Supervisor
from plugin.outlets.health_api import HealthServer, Registration
from plugin.sharing.model import profiles_of
from plugin.startup import StartupError, check_paths, claim_state_dir, read_boot_id

# The optional outlets are imported by their factories, only when the config turns them on: an outlet that is off
# costs no memory (tests/integration/test_startup_imports.py).
if TYPE_CHECKING:
    from plugin.devices.kernellog import KernelLog
    from plugin.devices.nvml import NvmlBackend
    from plugin.dra.mode import DraMode
    from plugin.health.recovery import CommandRecoveryChecker
    from plugin.nvsentinel.deviceapi import DeviceApi
    from plugin.nvsentinel.sender import HealthEventSender
    from plugin.outlets.correlation import Correlator, Resource
    from plugin.outlets.metrics import MetricsServer
    from plugin.outlets.reporter import KubeReporter

log = logging.getLogger(__name__)


class UnavailableBackend:
    """Stands in when NVML cannot start and the operator chose to keep serving: no devices, so nothing looks
    healthy, and the reason is visible on the health API."""

    name = "unavailable"

    def __init__(self, error: str) -> None:
        self.error = error

    def discover(self) -> Discovery:
        return Discovery(error=self.error)

    def read(self, gpu: Gpu) -> Reading:
        return Reading(time=time.time(), lost=True)

    def wait_events(self, timeout_s: float) -> Sequence[GpuEvent]:
        time.sleep(timeout_s)
        return ()

    def watch(self, on_change: Callable[[], None]) -> None:
        pass

    def unwatch(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_backend(cfg: Config) -> Backend:
    if cfg.backend == "simulated":
        from plugin.devices.simulated import SimulatedBackend
        return SimulatedBackend(cfg.simulated_node)
    from plugin.devices.nvml import NvmlBackend
    try:
        # The state dir keeps what NVML showed before a restart: links seen up, calls that crashed the process.
        return NvmlBackend(state_dir=cfg.state_dir)
    except BackendError as exc:
        if cfg.fail_on_init_error:
            raise
        log.error("NVML unavailable (%s); serving with no devices because --fail-on-init-error=false", exc)
        return UnavailableBackend(str(exc))


GPU_COUNT_LABEL = "nvidia.com/gpu.count"  # GPU Feature Discovery's


def expected_from_labels(monitor: Monitor) -> Callable[[dict[str, str]], None]:
    """The node's GPU count label, when GPU Feature Discovery sets it, as the monitor's expected count."""
    def apply(labels: dict[str, str]) -> None:
        value = labels.get(GPU_COUNT_LABEL, "")
        monitor.set_expected_gpus(int(value) if value.isdigit() and 0 < int(value) <= 1024 else None)
    return apply


def make_reporter(cfg: Config, state: NodeState,
                  on_labels: Callable[[dict[str, str]], None] | None = None) -> KubeReporter | None:
    """The reporter the config asks for, or None: reporting needs a node name and at least one outlet on."""
    wanted = cfg.annotations or cfg.events or cfg.node_condition
    if not cfg.node_name:
        if wanted:
            log.info("cluster reporting off: no node name (set --node-name or NODE_NAME)")
        return None
    if not wanted:
        return None
    from plugin.kube.client import KubeClient
    from plugin.outlets.reporter import KubeReporter, ReporterSettings
    settings = ReporterSettings(
        node_name=cfg.node_name, prefix=cfg.annotation_prefix, annotations=cfg.annotations, events=cfg.events,
        condition=cfg.node_condition, condition_type=cfg.node_condition_type,
        condition_reasons=cfg.node_condition_reasons, debounce_s=cfg.report_debounce,
        min_interval_s=cfg.report_min_interval, resync_s=cfg.report_resync_interval,
        max_bytes=cfg.annotation_max_bytes, backoff_max_s=cfg.report_backoff_max)
    kubeconfig = cfg.kubeconfig
    return KubeReporter(state, settings, lambda: KubeClient(kubeconfig), on_labels=on_labels)


def make_correlator(cfg: Config, state: NodeState, resources: Sequence[Resource]) -> Correlator | None:
    """The outlet the config asks for, or None when it is off (no states to act on)."""
    if not cfg.correlate_on:
        return None
    if cfg.mode == "dra":
        # PodResources names devices by extended resource; in DRA mode the pod's own status carries the device's
        # health and reason (the kubelet's health stream), so there is nothing to correlate.
        log.info("pod correlation off in DRA mode: pod status carries each device's health (docs/dra.md)")
        return None
    from plugin.kube.client import KubeClient
    from plugin.outlets.correlation import CorrelationSettings, Correlator, PodResourcesClient
    settings = CorrelationSettings(
        states=frozenset(cfg.correlate_on), resources=tuple(resources), node_name=cfg.node_name,
        annotate=cfg.annotate_pods, evict=cfg.remediate == "evict", annotation_prefix=cfg.annotation_prefix)
    kubeconfig = cfg.kubeconfig
    return Correlator(state, settings, PodResourcesClient(cfg.pod_resources_socket), lambda: KubeClient(kubeconfig))


def make_holders(cfg: Config, state: NodeState, resources: Sequence[Resource]) -> Callable[[Gpu], str]:
    """Who holds a GPU ("" for nobody): the pods the kubelet's PodResources API lists, or in DRA mode the claims the
    driver has prepared. A holder that cannot be asked answers that it cannot tell, which counts as held."""
    if cfg.mode == "dra":
        from plugin.dra.holders import PreparedClaimHolders
        return PreparedClaimHolders(cfg.state_dir)
    made: list[Callable[[Gpu], str]] = []

    def ask(gpu: Gpu) -> str:
        # Imported at the first question (a GPU busy for the grace period, or a recovery check): the PodResources
        # client is the correlation outlet's, which a node with --correlate-on none never loads otherwise.
        if not made:
            from plugin.outlets.holders import PodResourcesHolders
            made.append(PodResourcesHolders(cfg.pod_resources_socket, resources, state.snapshot))
        return made[0](gpu)
    return ask


def make_recovery_checker(cfg: Config, state: NodeState, resources: Sequence[Resource], stop: threading.Event,
                          wake: Callable[[], None]) -> CommandRecoveryChecker | None:
    """The recovery check the config asks for, or None without --recovery-check. Never on a GPU a workload holds:
    the pods the kubelet's PodResources API lists, or in DRA mode the claims the driver has prepared."""
    if not cfg.recovery_check:
        return None
    from plugin.health.recovery import CommandRecoveryChecker
    busy = make_holders(cfg, state, resources)
    # The lock in the state dir keeps one check at a time on the node even while two instances share it (handover).
    return CommandRecoveryChecker(cfg.recovery_check, cfg.recovery_check_timeout, busy, wake, stop,
                                  lock_file=cfg.state_dir / "recovery-check.lock")


def make_dra(cfg: Config, state: NodeState, alloc: AllocationConfig, clock: Callable[[], float]) -> DraMode:
    from plugin.dra.mode import DraMode, DraSettings
    from plugin.kube.client import KubeClient
    from plugin.kube.errors import ApiFailure
    settings = DraSettings(
        node_name=cfg.node_name, plugin_dir=cfg.dra_plugin_dir, registry_dir=cfg.dra_registry_dir,
        cdi_dir=cfg.cdi_spec_dir, state_dir=cfg.state_dir, dev_dir=alloc.dev_dir,
        allow_unhealthy=cfg.allow_unhealthy_allocation, degraded_as=cfg.dra_degraded_health,
        unhealthy_effect=cfg.dra_unhealthy_taint_effect, degraded_taint=cfg.dra_degraded_taint,
        taint_prefix=cfg.annotation_prefix, mig_strategy=cfg.mig_strategy, sharing=cfg.sharing,
        resource_name=cfg.resource_name, debounce_s=cfg.report_debounce,
        min_interval_s=cfg.report_min_interval, resync_s=cfg.report_resync_interval,
        backoff_max_s=cfg.report_backoff_max)
    kubeconfig = cfg.kubeconfig
    # DRA mode cannot prepare a claim without the API server, so a client that can never be built is a start-up
    # error here, where the reporter (which can wait) retries instead.
    try:
        claims = KubeClient(kubeconfig)
    except ApiFailure as exc:
        label = cfg.name_of("kubeconfig") if kubeconfig is not None else "--mode dra"
        raise StartupError(f"{label}: {exc.message}") from None
    return DraMode(settings, state, claims, lambda: KubeClient(kubeconfig), clock,
                   pods=lambda: KubeClient(kubeconfig))


def make_nvsentinel_sender(cfg: Config, state: NodeState) -> HealthEventSender | None:
    """Our health events to NVSentinel's platform connector, or None without --nvsentinel-socket."""
    if cfg.nvsentinel_socket is None:
        return None
    from plugin.nvsentinel.sender import HealthEventSender, SenderSettings
    node_name = cfg.node_name or platform.node()
    if not cfg.node_name:
        log.info("NVSentinel health events name the node %r: no node name set (--node-name or NODE_NAME)",
                 node_name)
    return HealthEventSender(state, SenderSettings(socket=cfg.nvsentinel_socket, node_name=node_name,
                                                   store_only=cfg.nvsentinel_store_only,
                                                   acked_file=cfg.state_dir / "nvsentinel.json"))


class App:
    def __init__(self, cfg: Config, backend: Backend | None = None) -> None:
        self.cfg = cfg
        self.stop = threading.Event()
        self.state = NodeState()
        self.backend = backend if backend is not None else make_backend(cfg)
        self.store = StateStore(cfg.state_dir)
        # One server per resource; MIG profiles (strategy mixed) are read once at discovery, like the topology.
        self.resources = () if cfg.mode == "dra" else build_resources(
            cfg.resource_name, cfg.mig_strategy, cfg.sharing, profiles_of(self.backend.discover().gpus))
        # The recovery check (--recovery-check) a latched or held fault must pass to clear; None when off. It wakes
        # the monitor (built next) when a result is ready.
        self.recovery = make_recovery_checker(cfg, self.state, self.resources, self.stop,
                                              lambda: self.monitor.request_poll())
        # Who holds a GPU, for the busy-with-no-pod check (and the recovery check's own copy above).
        busy = make_holders(cfg, self.state, self.resources) if cfg.busy_grace > 0 else None
        self.monitor = Monitor(self.backend, self.state, cfg.health, cfg.poll_interval, self.stop, self.store,
                               stall_s=cfg.stall_threshold, recovery=self.recovery,
                               boot_id=read_boot_id(cfg.boot_id_file, cfg.name_of("boot_id_file")),
                               inventory=make_inventory(cfg, self.backend),
                               expected_gpus=cfg.expected_gpus or None, busy=busy,
                               busy_watch=BusyWatch(cfg.busy_grace, cfg.busy_ignore) if busy is not None else None)
        alloc = AllocationConfig(dev_root=cfg.dev_root, cdi=cfg.cdi,
                                 allow_unhealthy=cfg.allow_unhealthy_allocation)
        # The kubelet side: the device-plugin supervisor, or in DRA mode the DRA driver with its ResourceSlice.
        # Never both: one mode per node, so a GPU is never offered twice.
        self.supervisor: Supervisor | None = None
        self.dra: DraMode | None = None
        if cfg.mode == "dra":
            self.dra = make_dra(cfg, self.state, alloc, time.monotonic)
        else:
            self.supervisor = Supervisor(cfg.device_plugin_dir, list(self.resources), self.state, alloc,
                                         self.stop)
        # Cluster reporting (node annotations, Events, node condition): None without a node name.
        self.kube_reporter = make_reporter(cfg, self.state, None if cfg.expected_gpus else
                                           expected_from_labels(self.monitor))
        self.health_server = HealthServer(
            cfg.health_socket_path, self.state,
            outlet_errors=self.kube_reporter.outlet_errors if self.kube_reporter is not None else dict,
            clearer=self.monitor,  # the operator's `gpu-health-plugin clear`: the monitor owns the latches
            registration=(cfg.mode, self._registration))  # `status` says whether the kubelet has our GPUs
        # Health events to NVSentinel; None without --nvsentinel-socket.
        self.nvsentinel = make_nvsentinel_sender(cfg, self.state)
        # Pods on failing devices (PodResources -> Events, annotations, evictions); None with --correlate-on none.
        self.correlator = make_correlator(cfg, self.state, self.resources)
        # NVSentinel's device API (docs/nvsentinel.md): our health out, other providers' conditions in; None when off.
        self.device_api = make_device_api(cfg, self.state, self.monitor)
        # The kernel log as a second source of driver events; None without --kernel-log.
        self.kernel_log = make_kernel_log(cfg, self.monitor)
        # /metrics, /healthz, /readyz; None with --metrics-address off.
        self.metrics_server = make_metrics_server(cfg, self.state, self.monitor, self.backend, self.supervisor,
                                                  self.dra, self.kube_reporter, self.correlator, self.nvsentinel,
                                                  self.device_api, self.kernel_log)
        # False while a successor waits for the state dir (start(active=False)); shutdown stops only what started.
        self.active = False

    def _registration(self) -> Registration:
        if self.supervisor is not None:
            return self.supervisor.record
        assert self.dra is not None  # one of the two, by mode
        return self.dra.record

    def start(self, active: bool = True) -> None:
        """Start serving. Not ``active``: a successor (``--handover``) while another instance still holds the state
        dir; it serves the kubelet and its probes, and leaves the state file, the health API and cluster reporting
        to that instance until ``take_over``."""
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.monitor.start(persist=active)
        _log_what_is_watched(self.backend)
        if self.device_api is not None:
            self.device_api.start_consumer()  # a successor serving the kubelet needs the same reasons
        if active:
            self._start_health_api()
            self._start_kernel_log()
        if self.supervisor is not None:
            self.supervisor.start()
        if self.dra is not None:
            self._start_dra()
        if active:
            self._start_reporting()
        if self.metrics_server is not None:
            self.metrics_server.start(busy_ok=not active)  # after the first poll: /healthz true from the first probe
        self.active = active

    def take_over(self) -> None:
        """The previous instance has gone and its state dir is ours: start what it was doing."""
        self.monitor.start_persisting()
        self._start_health_api()
        self._start_kernel_log()
        self._start_reporting()
        # On the host's network the previous instance had our metrics port until it exited.
        if self.metrics_server is not None and self.metrics_server.error is not None:
            self.metrics_server.start()
        self.active = True

    def _start_kernel_log(self) -> None:
        # After the first poll (the GPUs its lines name are known) and only by the state dir's owner (the cursor).
        if self.kernel_log is not None:
            self.kernel_log.start()

    def _start_dra(self) -> None:
        assert self.dra is not None
        try:
            self.dra.start()
        except (OSError, RuntimeError) as exc:  # a failed bind; the message names the socket
            raise StartupError(f"{self.cfg.name_of('dra_plugin_dir')}: cannot serve the DRA driver: "
                               f"{str(exc).split(';')[0]}") from None

    def _start_health_api(self) -> None:
        try:
            self.health_server.start()
        except (OSError, RuntimeError) as exc:  # grpc reports a failed bind as RuntimeError
            label = self.cfg.name_of("health_socket") if self.cfg.health_socket else self.cfg.name_of("state_dir")
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).split(";")[0]
            raise StartupError(f"{label}: cannot serve the health API on {self.cfg.health_socket_path}: "
                               f"{detail}") from None

    def _start_reporting(self) -> None:
        if self.kube_reporter is not None:
            self.kube_reporter.start()  # after the kubelet path: the API server never delays it
        if self.correlator is not None:
            self.correlator.start()
        if self.nvsentinel is not None:
            self.nvsentinel.start()
        if self.device_api is not None:
            self.device_api.start_provider()  # only the instance owning the node writes for it

    def shutdown(self, timeout_s: float = 4.0) -> None:
        deadline = time.monotonic() + timeout_s
        self.stop.set()
        self.state.close()
        if self.supervisor is not None:
            self.supervisor.shutdown(timeout_s=1.0)
        if self.dra is not None:
            self.dra.shutdown(timeout_s=1.0)
        if self.active:
            if self.kube_reporter is not None:
                self.kube_reporter.stop(timeout=0.5)  # a request in flight is abandoned (daemon thread)
            if self.correlator is not None:
                self.correlator.stop(timeout=0.5)
            if self.nvsentinel is not None:
                self.nvsentinel.stop(timeout=0.5)  # a call in flight ends at its deadline (daemon thread)
        if self.device_api is not None:
            self.device_api.stop(timeout=0.5)
        if self.kernel_log is not None:
            self.kernel_log.close(timeout=0.5)
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.active:
            self.health_server.stop(grace_s=0.2)
        if self.recovery is not None:
            self.recovery.join(0.5)  # the stop has killed a running check; no result is taken from it
        self.monitor.join(max(0.1, deadline - time.monotonic()))
        self.backend.close()


def make_inventory(cfg: Config, backend: Backend) -> Callable[[], Sequence[PciAddress] | None] | None:
    """The NVIDIA GPUs on the PCI bus, to find those NVML does not list: on a real node (the NVML backend), or
    wherever --sysfs-root was set (a simulated node has no bus of its own)."""
    if backend.name != "nvml" and cfg.sysfs_root == option("sysfs_root").default:
        return None
    from plugin.devices.inventory import PciInventory
    return PciInventory(cfg.sysfs_root).gpus


def make_kernel_log(cfg: Config, monitor: Monitor) -> KernelLog | None:
    if cfg.kernel_log is None:
        return None
    from plugin.devices.kernellog import KernelLog
    return KernelLog(cfg.kernel_log, cfg.state_dir, monitor.boot_id, monitor.gpu_for_pci, monitor.handle_events,
                     unknown_gpu=monitor.note_unknown_gpu)


def make_device_api(cfg: Config, state: NodeState, monitor: Monitor) -> DeviceApi | None:
    if not (cfg.device_api_provide or cfg.device_api_consume) or cfg.device_api_socket is None:
        return None
    from plugin.nvsentinel.deviceapi import DeviceApi, DeviceApiSettings
    settings = DeviceApiSettings(socket=cfg.device_api_socket, label=cfg.name_of("device_api_socket"),
                                 provide=cfg.device_api_provide, consume=cfg.device_api_consume)
    return DeviceApi(state, monitor, settings)


def _log_what_is_watched(backend: Backend) -> None:
    """After the first poll, one line per GPU: what NVML reported and the checks that are off or unavailable (the
    day-one answer to "what will this plugin not see here"; `gpu-health-plugin inspect` prints the same)."""
    nvml = _nvml(backend)
    if nvml is None:
        return
    for g in nvml.describe():
        off = {s: how for s, how in g["checks"].items() if how != "on"}
        log.info("GPU %d %s: %s (%s, driver %s), NVLink %d/%d active, ECC %s, MIG %s, fabric %s; checks off: %s",
                 g["index"], g["uuid"], g["name"], g["architecture"], g["driver"], g["links_active"],
                 g["link_slots"], g["ecc_mode"], g["mig_mode"], g["fabric_state"],
                 "; ".join(f"{s} ({how})" for s, how in off.items()) or "none")


def make_metrics_server(cfg: Config, state: NodeState, monitor: Monitor, backend: Backend,
                        supervisor: Supervisor | None, dra: DraMode | None, reporter: KubeReporter | None,
                        correlator: Correlator | None, nvsentinel: HealthEventSender | None = None,
                        device_api: DeviceApi | None = None,
                        kernel_log: KernelLog | None = None) -> MetricsServer | None:
    """/metrics, /healthz and /readyz as the config asks (None with ``--metrics-address off``), with a collector for
    each part that exists: an outlet that is off has no series."""
    if cfg.metrics_address == "off":
        return None
    from plugin.outlets.metrics import MetricsServer, Probes, Sources, build_registry
    sources = Sources(state, monitor, backend=_nvml(backend), supervisor=supervisor,
                      annotations=reporter.status if reporter is not None else None,
                      correlation=(lambda: correlator.stats) if correlator is not None else None,
                      registration=dra, slice_writer=dra.slice_writer.status if dra is not None else None,
                      pod_conditions=dra.pod_conditions.status
                      if dra is not None and dra.pod_conditions is not None else None,
                      claims=dra.driver if dra is not None else None,
                      health_streams=dra.server if dra is not None else None,
                      nvsentinel=nvsentinel.status if nvsentinel is not None else None,
                      device_api=device_api.stats if device_api is not None else None,
                      kernel_log=kernel_log.stats if kernel_log is not None else None)
    probes = Probes(monitor, supervisor if supervisor is not None else dra, cfg.stall_threshold,
                    clock=monitor.clock)
    return MetricsServer(cfg.metrics_address, build_registry(sources), probes)


def _nvml(backend: Backend) -> NvmlBackend | None:
    """The backend if it is the NVML one, the only kind that counts failed NVML calls."""
    if backend.name != "nvml":
        return None  # without asking isinstance: that would load plugin.devices.nvml for every other backend
    from plugin.devices.nvml import NvmlBackend
    return backend if isinstance(backend, NvmlBackend) else None


def run(cfg: Config) -> int:
    """The plugin process: raises StartupError (and the backend's errors) when it cannot start. Returns 0 after
    SIGTERM (the kubelet's stop), 130 after SIGINT (Ctrl-C, as a shell reports it)."""
    log.info("effective config: %s", json.dumps(cfg.effective(), sort_keys=True))
    lock = claim_state_dir(cfg)
    try:
        check_paths(cfg)
        app = App(cfg)
        received: list[int] = []

        def on_signal(signum: int, frame: FrameType | None) -> None:
            if not received:  # a second Ctrl-C while stopping changes nothing, so it says nothing
                log.info("received %s, shutting down", signal.Signals(signum).name)
            received.append(signum)
            app.stop.set()

        # Handlers only set the stop event; the main thread does the shutdown work.
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        if not lock.held:
            log.warning("%s %s is held by another gpu-health-plugin (%s): serving the kubelet next to it "
                        "(--handover) and taking the state dir over when it exits",
                        cfg.name_of("state_dir"), cfg.state_dir, lock.holder)
        try:
            app.start(active=lock.held)
            # A successor looks for the lock twice a second: the old instance releases it as its last act.
            while not app.stop.wait(1.0 if app.active else 0.5):
                if not app.active and lock.try_take():
                    log.info("took the state dir %s over from the previous instance", cfg.state_dir)
                    app.take_over()
        except BaseException:
            try:
                app.shutdown(timeout_s=1.0)
            except Exception as exc:  # the start-up error is the one to report
                log.warning("clean-up after the failed start: %s", exc)
            raise
        app.shutdown()
        if received[:1] == [signal.SIGINT]:
            return 130  # Ctrl-C at a terminal: the line that said so is the one line it gets
        log.info("stopped")
        return 0
    finally:
        lock.release()
