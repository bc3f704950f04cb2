"""A kubelet stand-in: the Registration server and the plugin client, behaving as the kubelet's device manager does
where the plugin can tell (validation, dial-back before Register returns, full-snapshot ListAndWatch, all devices
unhealthy when a stream ends, sockets wiped on restart). Used by the demo and by integration tests; the Go
conformance suite checks the same behaviour against the kubelet's own code."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugin.validation import is_extended_resource_name

log = logging.getLogger(__name__)


@dataclass
class PluginView:
    resource: str
    endpoint: str
    options: api_pb2.DevicePluginOptions
    channel: grpc.Channel
    stub: api_pb2_grpc.DevicePluginStub
    devices: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # id -> (health, numa)
    connected: bool = True
    updates: int = 0
    stream: object | None = None


class KubeletStandin(api_pb2_grpc.RegistrationServicer):
    """``rename=False`` (the default) binds ``kubelet.sock`` in place, as the kubelet does (``net.Listen`` on the final
    path): the plugin sees it created, possibly a moment before it answers. ``rename=True`` binds under a temporary
    name and renames it into place, so tests can cover a socket that appears by rename."""

    def __init__(self, plugin_dir: Path, dial_timeout_s: float = 10.0, rename: bool = False) -> None:
        self.plugin_dir = plugin_dir
        self.dial_timeout_s = dial_timeout_s
        self.rename = rename
        # Called at the start of every Register, before any check: lets a test hold a registration in flight.
        self.register_gate: Callable[[api_pb2.RegisterRequest], None] | None = None
        self.plugins: dict[str, PluginView] = {}
        self.registrations: list[tuple[float, str, str]] = []  # (time, resource, endpoint)
        self.rejections: list[str] = []
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self.on_update: Callable[[], None] | None = None

    @property
    def socket(self) -> Path:
        return self.plugin_dir / "kubelet.sock"

    # Lifecycle ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kubelet"))
        api_pb2_grpc.add_RegistrationServicer_to_server(self, server)
        if self.rename:
            tmp = self.plugin_dir / ".kubelet.sock.tmp"
            tmp.unlink(missing_ok=True)
            server.add_insecure_port(f"unix://{tmp}")
            server.start()
            tmp.rename(self.socket)
        else:
            self.socket.unlink(missing_ok=True)
            server.add_insecure_port(f"unix://{self.socket}")
            server.start()
        self._server = server

    def stop(self) -> None:
        """The kubelet goes away: its server stops and every plugin stream ends."""
        if self._server is not None:
            self._server.stop(0).wait(2)
            self._server = None
        with self._cond:
            views = list(self.plugins.values())
        for v in views:
            v.channel.close()
        self.socket.unlink(missing_ok=True)

    def restart(self) -> None:
        """What a restarting kubelet does: stop, delete every unix socket in the plugin dir, serve again."""
        self.stop()
        for p in self.plugin_dir.iterdir():
            if p.is_socket():
                p.unlink(missing_ok=True)
        self.start()

    # Registration ---------------------------------------------------------------------------------------------

    def Register(self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext) -> api_pb2.Empty:
        def reject(msg: str) -> api_pb2.Empty:
            with self._cond:
                self.rejections.append(msg)
                self._cond.notify_all()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg)
            return api_pb2.Empty()

        if self.register_gate is not None:
            self.register_gate(request)
        received = time.monotonic()
        if request.version != "v1beta1":
            return reject(f"unsupported device plugin API version {request.version!r}")
        name = request.resource_name
        if not is_extended_resource_name(name):
            return reject(f"invalid extended resource name {name!r}")
        if not request.endpoint or "/" in request.endpoint:
            return reject(f"endpoint must be a bare file name in the plugin dir, got {request.endpoint!r}")
        path = self.plugin_dir / request.endpoint
        channel = grpc.insecure_channel(f"unix://{path}")
        stub = api_pb2_grpc.DevicePluginStub(channel)
        try:
            grpc.channel_ready_future(channel).result(timeout=self.dial_timeout_s)
            options = stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=self.dial_timeout_s)
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            channel.close()
            msg = f"cannot dial plugin {request.endpoint}: {exc}"
            with self._cond:
                self.rejections.append(msg)
                self._cond.notify_all()
            context.abort(grpc.StatusCode.UNAVAILABLE, msg)
        view = PluginView(name, request.endpoint, options, channel, stub)
        with self._cond:
            old = self.plugins.get(name)
            self.plugins[name] = view
            self.registrations.append((received, name, request.endpoint))
            self._cond.notify_all()
        if old is not None:
            old.channel.close()  # the newer registration replaces the older client
        threading.Thread(target=self._watch, args=(view,), name=f"law-{name}", daemon=True).start()
        return api_pb2.Empty()

    def _watch(self, view: PluginView) -> None:
        try:
            stream = view.stub.ListAndWatch(api_pb2.Empty())
            view.stream = stream
            for resp in stream:
                with self._cond:
                    view.devices = {d.ID: (d.health, tuple(n.ID for n in d.topology.nodes)) for d in resp.devices}
                    view.updates += 1
                    self._cond.notify_all()
                if self.on_update:
                    self.on_update()
        except grpc.RpcError:
            pass
        finally:
            with self._cond:
                view.connected = False
                # The kubelet marks every device of the resource unhealthy when the stream ends.
                view.devices = {k: ("Unhealthy", numa) for k, (_, numa) in view.devices.items()}
                self._cond.notify_all()
            if self.on_update:
                self.on_update()

    # Queries --------------------------------------------------------------------------------------------------

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def view(self, resource: str = "nvidia.com/gpu") -> PluginView | None:
        with self._cond:
            return self.plugins.get(resource)

    def capacity(self, resource: str = "nvidia.com/gpu") -> tuple[int, int]:
        """(capacity, allocatable) as the kubelet would write them to the node."""
        with self._cond:
            v = self.plugins.get(resource)
            if v is None:
                return 0, 0
            return len(v.devices), sum(1 for h, _ in v.devices.values() if h == "Healthy")

    def health(self, device_id: str, resource: str = "nvidia.com/gpu") -> str | None:
        with self._cond:
            v = self.plugins.get(resource)
            return v.devices.get(device_id, (None, ()))[0] if v else None

    def allocate(self, ids: list[str], resource: str = "nvidia.com/gpu") -> api_pb2.AllocateResponse:
        v = self.view(resource)
        if v is None:
            raise RuntimeError(f"no plugin registered for {resource}")
        req = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)])
        return v.stub.Allocate(req, timeout=10)

    def preferred(self, available: list[str], must: list[str], size: int,
                  resource: str = "nvidia.com/gpu") -> list[str]:
        v = self.view(resource)
        if v is None:
            raise RuntimeError(f"no plugin registered for {resource}")
        req = api_pb2.PreferredAllocationRequest(container_requests=[
            api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=available,
                                                        must_include_deviceIDs=must, allocation_size=size)])
        return list(v.stub.GetPreferredAllocation(req, timeout=10).container_responses[0].deviceIDs)
