"""Wiring and lifecycle: build the backend, node state, health engine, outlets and supervisor; stop them in order."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType

from plugin.config import Config
from plugin.devices.backend import Backend, BackendError
from plugin.devices.model import Discovery, Gpu, GpuEvent, Reading
from plugin.health.monitor import Monitor
from plugin.health.state import NodeState, StateStore
from plugin.kubelet.allocation import AllocationConfig
from plugin.kubelet.supervisor import Supervisor
from plugin.outlets.correlation import make_correlator
from plugin.outlets.health_api import HealthServer
from plugin.outlets.kube import make_reporter
from plugin.outlets.metrics import make_metrics_server
from plugin.sharing import build_resources, profiles_of

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

    def close(self) -> None:
        pass


def make_backend(cfg: Config) -> Backend:
    if cfg.backend == "simulated":
        from plugin.devices.simulated import SimulatedBackend
        return SimulatedBackend(cfg.simulated_node)
    from plugin.devices.nvml import NvmlBackend
    try:
        return NvmlBackend()
    except BackendError as exc:
        if cfg.fail_on_init_error:
            raise
        log.error("NVML unavailable (%s); serving with no devices because --fail-on-init-error=false", exc)
        return UnavailableBackend(str(exc))


class App:
    def __init__(self, cfg: Config, backend: Backend | None = None) -> None:
        self.cfg = cfg
        self.stop = threading.Event()
        self.state = NodeState()
        self.backend = backend if backend is not None else make_backend(cfg)
        self.store = StateStore(cfg.state_dir)
        self.monitor = Monitor(self.backend, self.state, cfg.health, cfg.poll_interval, self.stop, self.store)
        alloc = AllocationConfig(dev_root=cfg.dev_root, cdi=cfg.cdi,
                                 allow_unhealthy=cfg.allow_unhealthy_allocation)
        # One server per resource; MIG profiles (strategy mixed) are read once at discovery, like the topology.
        self.resources = build_resources(cfg.resource_name, cfg.mig_strategy, cfg.sharing,
                                         profiles_of(self.backend.discover().gpus))
        self.supervisor = Supervisor(cfg.device_plugin_dir, list(self.resources), self.state, alloc,
                                     self.stop)
        self.health_server = HealthServer(cfg.health_socket_path, self.state)
        # Cluster reporting (node annotations, Events, node condition): None without a node name.
        self.kube_reporter = make_reporter(cfg, self.state)
        if self.kube_reporter is not None:
            self.health_server.servicer.outlet_errors = self.kube_reporter.outlet_errors
        # Pods on failing devices (PodResources -> Events, annotations, evictions); None with --correlate-on none.
        self.correlator = make_correlator(cfg, self.state, self.resources)
        # /metrics, /healthz, /readyz; None with --metrics-address off.
        self.metrics_server = make_metrics_server(self)

    def start(self) -> None:
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.monitor.start()
        self.health_server.start()
        self.supervisor.start()
        if self.kube_reporter is not None:
            self.kube_reporter.start()  # after the kubelet path: the API server never delays it
        if self.correlator is not None:
            self.correlator.start()
        if self.metrics_server is not None:
            self.metrics_server.start()  # after the first poll, so /healthz is true from the first probe

    def shutdown(self, timeout_s: float = 4.0) -> None:
        deadline = time.monotonic() + timeout_s
        self.stop.set()
        self.state.close()
        self.supervisor.shutdown(timeout_s=1.0)
        if self.kube_reporter is not None:
            self.kube_reporter.stop(timeout=0.5)  # a request in flight is abandoned (daemon thread)
        if self.correlator is not None:
            self.correlator.stop(timeout=0.5)
        if self.metrics_server is not None:
            self.metrics_server.stop()
        self.health_server.stop(grace_s=0.2)
        self.monitor.join(max(0.1, deadline - time.monotonic()))
        self.backend.close()


def run(cfg: Config) -> int:
    log.info("effective config: %s", json.dumps(cfg.effective(), sort_keys=True))
    app = App(cfg)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        app.stop.set()

    # Handlers only set the stop event; the main thread does the shutdown work.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    app.start()
    while not app.stop.wait(1.0):
        pass
    app.shutdown()
    log.info("stopped")
    return 0
