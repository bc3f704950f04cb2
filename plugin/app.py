"""Wiring and lifecycle: build the backend, node state, health engine, outlets and supervisor; stop them in order."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from plugin.config import Config
from plugin.devices.backend import Backend, BackendError
from plugin.devices.model import Discovery, Gpu, GpuEvent, Reading
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.health.store import StateStore
from plugin.kubelet.allocation import AllocationConfig
from plugin.kubelet.sharing import build_resources, profiles_of
from plugin.kubelet.supervisor import Supervisor
from plugin.outlets.correlation import make_correlator
from plugin.outlets.health_api import HealthServer
from plugin.outlets.kube import make_reporter
from plugin.outlets.metrics import make_metrics_server
from plugin.sockets import UNIX_PATH_MAX

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


class StartupError(Exception):
    """Something the plugin needs at start cannot be had (a path, the state dir's lock); the message is one line
    naming the option as the user set it, the path and the OS error."""


LOCK_FILE = "plugin.lock"


def _problem(label: str, path: Path | str, doing: str, exc: OSError) -> StartupError:
    return StartupError(f"{label} {path}: {doing}: {exc.strerror or exc}")


def _usable_dir(path: Path, label: str, file: Path | None = None) -> None:
    """Create the directory if needed and prove that files can be created in it (a read-only mount, a path
    under a regular file or a pseudo filesystem fail here, at start, not in a worker thread later). ``file``:
    the option names a file in that directory rather than the directory itself."""
    where = f"{label} {file}: its directory {path}" if file is not None else f"{label} {path}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise StartupError(f"{where}: exists and is not a directory") from None
    except OSError as exc:
        raise StartupError(f"{where}: cannot create the directory: {exc.strerror or exc}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".gpu-health-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise StartupError(f"{where}: cannot create files in it: {exc.strerror or exc}") from None


class InstanceLock:
    """One plugin per state dir: an exclusive ``flock`` on ``plugin.lock`` there, holding the owner's pid. The
    kernel drops it when the holder dies, however it dies, so a stale file never blocks a restart."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, state_dir: Path, label: str) -> InstanceLock:
        path = state_dir / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise _problem(label, state_dir, f"cannot open {LOCK_FILE}", exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise StartupError(f"{label} {state_dir} is in use by another gpu-health-plugin ({holder}); stop it "
                               f"or give this one its own {label}") from None
        except OSError as exc:
            os.close(fd)
            raise _problem(label, state_dir, f"cannot lock {LOCK_FILE}", exc) from None
        # Host name too: in a pod it is the pod's name, and the pid alone is ambiguous across pid namespaces.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)  # drops the lock; the file stays, so no one can lock a file that is about to be unlinked


def _holder(fd: int) -> str:
    try:
        words = os.pread(fd, 256, 0).decode(errors="replace").split()
    except OSError:
        words = []
    if not words:
        return "pid unknown: it is still starting"
    return f"pid {words[0]}" + (f" on {words[1]}" if len(words) > 1 else "")


def check_paths(cfg: Config) -> None:
    """Every path option, checked before anything serves, so a bad one is one line at start (exit 1)."""
    _usable_dir(cfg.device_plugin_dir, cfg.name_of("device_plugin_dir"))
    sock = cfg.health_socket_path
    label = cfg.name_of("health_socket") if cfg.health_socket is not None else cfg.name_of("state_dir")
    if len(os.fsencode(sock)) > UNIX_PATH_MAX:
        raise StartupError(f"{label}: the health socket path {sock} is {len(os.fsencode(sock))} bytes; a unix "
                           f"socket path has at most {UNIX_PATH_MAX}")
    if cfg.health_socket is not None:
        _usable_dir(sock.parent, label, file=sock)
    if sock.is_dir():
        raise StartupError(f"{label}: the health socket path {sock} is a directory")
    if not cfg.dev_root.is_dir():
        why = "does not exist" if not cfg.dev_root.exists() else "is not a directory"
        raise StartupError(f"{cfg.name_of('dev_root')} {cfg.dev_root}: {why}")
    if cfg.kubeconfig is not None:
        try:
            with cfg.kubeconfig.open("rb"):
                pass
        except OSError as exc:
            raise _problem(cfg.name_of("kubeconfig"), cfg.kubeconfig, "cannot read it", exc) from None


def claim_state_dir(cfg: Config) -> InstanceLock:
    """Make the state dir usable and take its lock: first, before anything reads state.json or binds a socket."""
    label = cfg.name_of("state_dir")
    _usable_dir(cfg.state_dir, label)
    return InstanceLock.acquire(cfg.state_dir, label)


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
        try:
            self.health_server.start()
        except (OSError, RuntimeError) as exc:  # grpc reports a failed bind as RuntimeError
            label = self.cfg.name_of("health_socket") if self.cfg.health_socket else self.cfg.name_of("state_dir")
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).split(";")[0]
            raise StartupError(f"{label}: cannot serve the health API on {self.cfg.health_socket_path}: "
                               f"{detail}") from None
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
    """The plugin process: raises StartupError (and the backend's errors) when it cannot start."""
    log.info("effective config: %s", json.dumps(cfg.effective(), sort_keys=True))
    lock = claim_state_dir(cfg)
    try:
        check_paths(cfg)
        app = App(cfg)

        def on_signal(signum: int, frame: FrameType | None) -> None:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            app.stop.set()

        # Handlers only set the stop event; the main thread does the shutdown work.
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            app.start()
        except BaseException:
            try:
                app.shutdown(timeout_s=1.0)
            except Exception as exc:  # the start-up error is the one to report
                log.warning("clean-up after the failed start: %s", exc)
            raise
        while not app.stop.wait(1.0):
            pass
        app.shutdown()
        log.info("stopped")
        return 0
    finally:
        lock.release()
