"""The sockets of DRA mode: the driver's services (DRAPlugin, DRAResourceHealth) on one socket in the plugin dir,
the kubelet's plugin registration on another in its plugins_registry dir, and keeping both there.

The kubelet finds us by scanning plugins_registry (also after it restarts), so nothing needs re-creating when the
kubelet comes back; but if either socket is deleted it is served afresh: the kubelet drops a registration whose
socket is deleted and registers the new one it sees appear, and reconnects to the endpoint by path. A watchdog on
both dirs wakes the audit at once; the audit also runs every second in case an event was missed.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from api.pluginregistration.v1 import api_pb2_grpc as registration_grpc
from plugin.dra.driver import Driver, add_dra_services
from plugin.dra.health import HealthServicers, HealthSettings, add_health_services
from plugin.dra.registration import RegistrationServicer
from plugin.dra.slices import DRIVER
from plugin.health.node_state import NodeState
from plugin.sockets import UnixGrpcServer

log = logging.getLogger(__name__)

DRA_SOCKET = "dra.sock"
AUDIT_S = 1.0
MODE = 0o600  # the kubelet runs as root; nobody else may prepare devices or read our registration


def registration_socket_name(driver_name: str) -> str:
    return f"{driver_name}-reg.sock"


@dataclass(frozen=True)
class DraStatus:
    serving: bool  # both sockets are ours and served
    registered: bool  # the kubelet's last NotifyRegistrationStatus said registered
    registrations: int
    last_error: str  # the kubelet's refusal, or why a socket could not be served again
    recreated: int  # sockets served afresh after they disappeared


class _DirHandler(FileSystemEventHandler):
    def __init__(self, names: set[str], wake: threading.Event) -> None:
        self._names = names
        self._wake = wake

    def on_any_event(self, event: FileSystemEvent) -> None:
        paths = [event.src_path, getattr(event, "dest_path", "")]
        if any(os.path.basename(os.fsdecode(p)) in self._names for p in paths if p):
            self._wake.set()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.lstat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


class DraServer:
    def __init__(self, plugin_dir: Path, registry_dir: Path, state: NodeState, driver: Driver,
                 health: HealthSettings, driver_name: str = DRIVER, max_workers: int = 16,
                 confirm_timeout_s: float = 5.0, on_registered: Callable[[], None] | None = None) -> None:
        self.plugin_dir = plugin_dir.absolute()
        self.registry_dir = registry_dir.absolute()
        self.dra_path = self.plugin_dir / DRA_SOCKET
        self.registration_path = self.registry_dir / registration_socket_name(driver_name)
        self.state = state
        self.driver = driver
        self.health_settings = health
        self.driver_name = driver_name
        self.max_workers = max_workers
        self.confirm_timeout_s = confirm_timeout_s
        # One servicer for the life of the server: its counts survive a re-created socket.
        self.registration = RegistrationServicer(driver_name, str(self.dra_path),
                                                 on_registered=on_registered)
        self.health: HealthServicers | None = None  # those of the DRA server serving now
        self._lock = threading.Lock()  # the servers below and the counters; the audit and stop() take it
        self._dra: UnixGrpcServer | None = None
        self._dra_id: tuple[int, int] | None = None
        self._reg: UnixGrpcServer | None = None
        self._reg_id: tuple[int, int] | None = None
        self._recreated = 0
        self._serve_error = ""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._observer: Observer | None = None  # type: ignore[valid-type]

    # Lifecycle ----------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Serve the DRA socket, then the registration socket (the kubelet may connect to the endpoint as soon as
        it sees the registration), then watch both. Raises OSError or RuntimeError naming the socket that failed;
        nothing is left behind then."""
        try:
            with self._lock:
                self._serve_dra()
                self._serve_registration()
        except (OSError, RuntimeError):
            self.stop()
            raise
        observer = Observer()
        handler = _DirHandler({self.dra_path.name, self.registration_path.name}, self._wake)
        for d in {self.plugin_dir, self.registry_dir}:
            observer.schedule(handler, str(d), recursive=False)
        observer.daemon = True
        observer.start()
        self._observer = observer
        self._thread = threading.Thread(target=self._run, name="dra-sockets", daemon=True)
        self._thread.start()
        log.info("DRA driver %s serving on %s, registration on %s", self.driver_name, self.dra_path,
                 self.registration_path)

    def stop(self, grace_s: float = 0.5) -> None:
        """Stop serving and remove both sockets. Streams end at once; calls in flight get ``grace_s``."""
        self._stop.set()
        self._wake.set()
        if self._observer is not None:
            self._observer.stop()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            # The registration first: the kubelet stops using us before the endpoint goes.
            self._stop_registration(grace_s)
            self._stop_dra(grace_s)
        if self._observer is not None:
            self._observer.join(1.0)

    def status(self) -> DraStatus:
        counts = self.registration.counts()
        with self._lock:
            serving = (self._dra_id is not None and self._reg_id is not None
                       and _identity(self.dra_path) == self._dra_id
                       and _identity(self.registration_path) == self._reg_id)
            error = self._serve_error or counts.last_error
            recreated = self._recreated
        return DraStatus(serving=serving, registered=counts.registered and serving,
                         registrations=counts.registrations, last_error=error, recreated=recreated)

    @property
    def health_streams(self) -> int:
        """Open health streams (the kubelet keeps one while it watches device health), for the metrics."""
        health = self.health  # read once: the audit replaces it when it serves the socket afresh
        return health.active_streams if health is not None else 0

    # Serving ------------------------------------------------------------------------------------------------------

    def _confirm(self, what: str, path: Path) -> None:
        with grpc.insecure_channel(f"unix://{path}") as ch:
            try:
                grpc.channel_ready_future(ch).result(timeout=self.confirm_timeout_s)
            except grpc.FutureTimeoutError:
                raise RuntimeError(f"the {what} socket {path} does not answer after "
                                   f"{self.confirm_timeout_s:g}s") from None

    def _serve_dra(self) -> None:
        holder: list[HealthServicers] = []

        def add(server: grpc.Server) -> None:
            add_dra_services(server, self.driver)
            holder.append(add_health_services(server, self.state, self.health_settings))

        server = UnixGrpcServer(self.dra_path, MODE, add, self.max_workers, "dra")
        try:
            self.plugin_dir.mkdir(parents=True, exist_ok=True)
            server.start()
            self._confirm("DRA", self.dra_path)
        except (OSError, RuntimeError) as exc:
            holder[0].close()
            server.stop(0)
            raise type(exc)(f"cannot serve the DRA socket {self.dra_path}: {exc}") from exc
        self._dra, self.health, self._dra_id = server, holder[0], _identity(self.dra_path)

    def _serve_registration(self) -> None:
        server = UnixGrpcServer(self.registration_path, MODE,
                                lambda s: registration_grpc.add_RegistrationServicer_to_server(self.registration, s),
                                2, "dra-reg")
        try:
            self.registry_dir.mkdir(parents=True, exist_ok=True)
            server.start()
            self._confirm("registration", self.registration_path)
        except (OSError, RuntimeError) as exc:
            server.stop(0)
            raise type(exc)(f"cannot serve the registration socket {self.registration_path}: {exc}") from exc
        self._reg, self._reg_id = server, _identity(self.registration_path)

    def _stop_dra(self, grace_s: float) -> None:
        if self.health is not None:
            self.health.close()  # streams end now instead of holding the stop for their whole grace
        if self._dra is not None:
            self._stop_server(self._dra, self.dra_path, self._dra_id, grace_s)
        self._dra, self._dra_id, self.health = None, None, None

    def _stop_registration(self, grace_s: float) -> None:
        if self._reg is not None:
            self._stop_server(self._reg, self.registration_path, self._reg_id, grace_s)
        self._reg, self._reg_id = None, None

    @staticmethod
    def _stop_server(server: UnixGrpcServer, path: Path, ident: tuple[int, int] | None, grace_s: float) -> None:
        # Whatever is at the path now, if it is not the socket we bound (someone else's, or nothing), is left alone.
        server.stop(grace_s, remove=_identity(path) == ident)

    # The audit ----------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(AUDIT_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._audit()
            except Exception:  # one failed audit must not end the re-creation for good
                log.exception("audit of the DRA sockets failed")

    def _audit(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            errors: list[str] = []
            if self._dra is None or _identity(self.dra_path) != self._dra_id:
                self._stop_dra(0.2)
                try:
                    self._serve_dra()
                    self._recreated += 1
                    log.info("the DRA socket %s was gone; serving it afresh", self.dra_path)
                except (OSError, RuntimeError) as exc:
                    errors.append(str(exc))
            if self._reg is None or _identity(self.registration_path) != self._reg_id:
                self._stop_registration(0.2)
                self.registration.forget()
                try:
                    self._serve_registration()
                    self._recreated += 1
                    log.info("the registration socket %s was gone; serving it afresh", self.registration_path)
                except (OSError, RuntimeError) as exc:
                    errors.append(str(exc))
            error = "; ".join(errors)
            if error and error != self._serve_error:  # once per distinct failure, retried every audit
                log.warning("%s; retrying every %gs", error, AUDIT_S)
            elif not error and self._serve_error:
                log.info("DRA sockets served again")
            self._serve_error = error
