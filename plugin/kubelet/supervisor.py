"""The one owner of sockets and registration: serve, confirm, Register; re-serve and re-register when the kubelet
restarts (its socket is created again) or our socket disappears; clean up on stop. Device state is untouched."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugin.health.state import NodeState
from plugin.kubelet.allocation import AllocationConfig
from plugin.kubelet.resources import Resource
from plugin.kubelet.server import DevicePluginServicer

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"


def plugin_options() -> api_pb2.DevicePluginOptions:
    # Built once: Register sends it and GetDevicePluginOptions returns the same object.
    return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


class PluginServer:
    """One gRPC server for one resource on a socket whose name is unique to this instance."""

    def __init__(self, plugin_dir: Path, resource: Resource, servicer: DevicePluginServicer,
                 max_workers: int = 64) -> None:
        short = resource.name.split("/")[-1].replace(".", "-")
        self.endpoint = f"gpu-health-{short}-{secrets.token_hex(4)}.sock"
        self.path = plugin_dir / self.endpoint
        self.resource = resource
        self.servicer = servicer
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                              thread_name_prefix=f"dp-{short}"))
        api_pb2_grpc.add_DevicePluginServicer_to_server(servicer, self._server)

    def start(self, confirm_timeout_s: float = 5.0) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others can connect
        try:
            self._server.add_insecure_port(f"unix://{self.path}")
            self._server.start()
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        with grpc.insecure_channel(f"unix://{self.path}") as ch:
            api_pb2_grpc.DevicePluginStub(ch).GetDevicePluginOptions(api_pb2.Empty(), timeout=confirm_timeout_s)

    def stop(self, grace_s: float = 0.5) -> None:
        self.servicer.close()
        self._server.stop(grace_s).wait(grace_s + 1.0)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def register(kubelet_socket: Path, server: PluginServer, options: api_pb2.DevicePluginOptions,
             timeout_s: float = 15.0) -> None:
    """Call the kubelet's Register. Raises grpc.RpcError or OSError with the kubelet's reason."""
    if not kubelet_socket.exists():
        raise FileNotFoundError(f"{kubelet_socket} does not exist (is the kubelet running?)")
    with grpc.insecure_channel(f"unix://{kubelet_socket}") as ch:
        api_pb2_grpc.RegistrationStub(ch).Register(
            api_pb2.RegisterRequest(version=API_VERSION, endpoint=server.endpoint,
                                    resource_name=server.resource.name, options=options),
            timeout=timeout_s)


@dataclass
class RegistrationRecord:
    registered: bool = False
    registrations: int = 0
    failures: int = 0
    last_registered_at: float = 0.0
    last_error: str = ""


class _DirHandler(FileSystemEventHandler):
    def __init__(self, supervisor: Supervisor) -> None:
        self._sup = supervisor

    def on_any_event(self, event: FileSystemEvent) -> None:
        name = os.path.basename(str(event.src_path))
        if event.event_type == "created" and name == KUBELET_SOCKET:
            self._sup.kubelet_socket_created()
        elif event.event_type == "deleted" and name in self._sup.current_endpoints():
            self._sup.request_restart(f"our socket {name} was deleted")


class Supervisor:
    def __init__(self, plugin_dir: Path, resources: list[Resource], state: NodeState, alloc: AllocationConfig,
                 stop: threading.Event, backoff_initial_s: float = 0.1, backoff_max_s: float = 5.0) -> None:
        self.plugin_dir = plugin_dir
        self.resources = resources
        self.state = state
        self.alloc = alloc
        self.stop = stop
        self.options = plugin_options()
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.servers: list[PluginServer] = []
        self.record = RegistrationRecord()
        self._wake = threading.Event()
        self._restart_reason: str | None = "start"
        self._lock = threading.Lock()
        self._observer: Observer | None = None  # type: ignore[valid-type]
        self._thread: threading.Thread | None = None
        self.registered_event = threading.Event()  # set after every successful round of registration
        self._registered_with: tuple[int, int] | None = None
        # Endpoints registered in the current round. With several resources, a retry after one failed must not
        # register the others again: the kubelet would see a second plugin on the same socket.
        self._round_done: set[str] = set()

    def current_endpoints(self) -> set[str]:
        with self._lock:
            return {s.endpoint for s in self.servers}

    def _kubelet_identity(self) -> tuple[int, int] | None:
        try:
            st = (self.plugin_dir / KUBELET_SOCKET).stat()
        except OSError:
            return None
        return st.st_ino, st.st_ctime_ns

    def kubelet_socket_created(self) -> None:
        # Our socket's deletion (the kubelet wipes the dir first) may already have made us register with this very
        # kubelet; registering again would open the old-stream race the kubelet had before 1.37.
        ident = self._kubelet_identity()
        if ident is not None and self.record.registered and ident == self._registered_with:
            log.info("kubelet.sock created, but already registered with that kubelet")
            return
        self.request_restart("kubelet.sock created (kubelet restarted)")

    def request_restart(self, reason: str) -> None:
        with self._lock:
            if self._restart_reason is None:
                self._restart_reason = reason
        self._wake.set()

    def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        observer = Observer()
        observer.schedule(_DirHandler(self), str(self.plugin_dir), recursive=False)
        observer.daemon = True
        observer.start()
        self._observer = observer
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        backoff = self.backoff_initial_s
        while not self.stop.is_set():
            with self._lock:
                reason, self._restart_reason = self._restart_reason, None
            if reason is not None:
                log.info("(re)starting device plugin servers: %s", reason)
                self.record.registered = False
                self.registered_event.clear()
                self._round_done = set()
                self._replace_servers()
                backoff = self.backoff_initial_s
            if not self.record.registered and self.servers:
                if self._register_all():
                    backoff = self.backoff_initial_s
                else:
                    self._wake.wait(backoff)
                    self._wake.clear()
                    backoff = min(backoff * 2, self.backoff_max_s)
                    continue
            self._wake.wait(1.0)
            self._wake.clear()

    def _replace_servers(self) -> None:
        with self._lock:
            old, self.servers = self.servers, []
        for s in old:
            s.stop(grace_s=0.2)
        fresh = []
        for resource in self.resources:
            servicer = DevicePluginServicer(self.state, resource, self.alloc, self.options)
            server = PluginServer(self.plugin_dir, resource, servicer)
            try:
                server.start()
            except (grpc.RpcError, OSError, RuntimeError) as exc:
                log.error("cannot serve %s on %s: %s", resource.name, server.path, exc)
                server.stop(0)
                self.request_restart(f"serving {resource.name} failed")
                continue
            log.info("serving %s on %s", resource.name, server.path)
            fresh.append(server)
        with self._lock:
            self.servers = fresh

    def _register_all(self) -> bool:
        kubelet_socket = self.plugin_dir / KUBELET_SOCKET
        ident = self._kubelet_identity()
        for server in list(self.servers):
            if server.endpoint in self._round_done:
                continue
            try:
                register(kubelet_socket, server, self.options)
            except (grpc.RpcError, OSError) as exc:
                why = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                self.record.failures += 1
                if why != self.record.last_error:
                    log.warning("registration of %s failed, retrying with backoff: %s", server.resource.name, why)
                self.record.last_error = str(why)
                return False
            self._round_done.add(server.endpoint)
            log.info("registered %s with the kubelet (endpoint %s)", server.resource.name, server.endpoint)
        self._registered_with = ident
        self.record.registered = True
        self.record.registrations += 1
        self.record.last_registered_at = time.time()
        self.record.last_error = ""
        self.registered_event.set()
        return True

    def shutdown(self, timeout_s: float = 3.0) -> None:
        self.stop.set()
        self._wake.set()
        if self._observer is not None:
            self._observer.stop()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            servers, self.servers = self.servers, []
        for s in servers:
            s.stop(grace_s=0.2)
        if self._observer is not None:
            self._observer.join(1.0)
