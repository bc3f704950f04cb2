"""A stand-in for NVSentinel's device API server (``nvidia.device.v1alpha1.GpuService``) on a real unix socket:
GPUs in memory, a resource version that grows on every change, ABORTED for a status write naming a stale one,
NOT_FOUND for an unknown name, a watch that sends an ADDED event per existing GPU first, and a restart on the same
path that forgets everything (as theirs, which keeps no state on disk, does). Tests act as another provider through
a real gRPC client (``client()``)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf import empty_pb2

from api.nvsentinel.deviceapi.v1alpha1 import gpu_pb2, gpu_pb2_grpc


class FakeDeviceApi(gpu_pb2_grpc.GpuServiceServicer):
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.gpus: dict[str, gpu_pb2.Gpu] = {}
        self.calls: list[tuple[str, str]] = []  # (method, GPU name) of every call answered
        self.unimplemented: set[str] = set()  # methods answered UNIMPLEMENTED, as a server of another version would
        self.after_get: Callable[[str], None] | None = None  # runs after a GetGpu is answered (once, then cleared)
        self.changed = threading.Condition()
        self._rv = 0
        self._watchers: list[queue.Queue[gpu_pb2.WatchGpusResponse | None]] = []
        self._server: grpc.Server | None = None

    # Lifecycle ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        gpu_pb2_grpc.add_GpuServiceServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        self._server.add_insecure_port(f"unix:{self.socket_path}")
        self._server.start()

    def stop(self) -> None:
        with self.changed:
            for w in self._watchers:
                w.put(None)
            self._watchers.clear()
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None

    def restart(self) -> None:
        """Stop, forget every GPU, and serve again on the same path."""
        self.stop()
        with self.changed:
            self.gpus.clear()
        self.start()

    def client(self) -> gpu_pb2_grpc.GpuServiceStub:
        return gpu_pb2_grpc.GpuServiceStub(grpc.insecure_channel(f"unix:{self.socket_path}"))  # type: ignore[no-untyped-call]

    # Test helpers ---------------------------------------------------------------------------------------------

    def writes(self, method: str = "UpdateGpuStatus") -> int:
        with self.changed:
            return sum(1 for m, _ in self.calls if m == method)

    def wait(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        with self.changed:
            return self.changed.wait_for(predicate, timeout)

    def put_raw(self, gpu: gpu_pb2.Gpu) -> None:
        """Store and announce a GPU as a broken peer might, past the checks CreateGpu makes."""
        with self.changed:
            self._bump(gpu)
            self.gpus[gpu.metadata.name] = gpu
            self._emit("ADDED", gpu)

    def condition(self, name: str, ctype: str) -> gpu_pb2.Condition | None:
        with self.changed:
            gpu = self.gpus.get(name)
            return next((c for c in gpu.status.conditions if c.type == ctype), None) if gpu else None

    # The service ----------------------------------------------------------------------------------------------

    def _answer(self, method: str, name: str, context: grpc.ServicerContext) -> None:
        if method in self.unimplemented:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, f"unknown method {method}")
        with self.changed:
            self.calls.append((method, name))
            self.changed.notify_all()

    def _emit(self, kind: str, gpu: gpu_pb2.Gpu) -> None:
        for w in self._watchers:
            w.put(gpu_pb2.WatchGpusResponse(type=kind, object=gpu))
        self.changed.notify_all()

    def _bump(self, gpu: gpu_pb2.Gpu) -> None:
        self._rv += 1
        gpu.resource_version = self._rv
        gpu.metadata.resource_version = str(self._rv)

    def GetGpu(self, request: gpu_pb2.GetGpuRequest, context: grpc.ServicerContext) -> gpu_pb2.GetGpuResponse:
        self._answer("GetGpu", request.name, context)
        with self.changed:
            gpu = self.gpus.get(request.name)
            if gpu is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"gpu {request.name} not found")
            resp = gpu_pb2.GetGpuResponse(gpu=gpu)
        hook, self.after_get = self.after_get, None
        if hook is not None:
            hook(request.name)
        return resp

    def ListGpus(self, request: gpu_pb2.ListGpusRequest, context: grpc.ServicerContext) -> gpu_pb2.ListGpusResponse:
        self._answer("ListGpus", "", context)
        with self.changed:
            return gpu_pb2.ListGpusResponse(gpu_list=gpu_pb2.GpuList(
                metadata=gpu_pb2.ListMeta(resource_version=str(self._rv)), items=list(self.gpus.values())))

    def WatchGpus(self, request: gpu_pb2.WatchGpusRequest,
                  context: grpc.ServicerContext) -> Iterator[gpu_pb2.WatchGpusResponse]:
        self._answer("WatchGpus", "", context)
        q: queue.Queue[gpu_pb2.WatchGpusResponse | None] = queue.Queue()
        with self.changed:
            for gpu in self.gpus.values():
                q.put(gpu_pb2.WatchGpusResponse(type="ADDED", object=gpu))
            self._watchers.append(q)
        try:
            while context.is_active():
                try:
                    event = q.get(timeout=0.1)
                except queue.Empty:
                    continue
                if event is None:
                    return
                yield event
        finally:
            with self.changed:
                if q in self._watchers:
                    self._watchers.remove(q)

    def CreateGpu(self, request: gpu_pb2.CreateGpuRequest,
                  context: grpc.ServicerContext) -> gpu_pb2.CreateGpuResponse:
        name = request.gpu.metadata.name
        self._answer("CreateGpu", name, context)
        if not name or not request.gpu.spec.uuid:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "metadata.name and spec.uuid are required")
        with self.changed:
            if name in self.gpus:
                return gpu_pb2.CreateGpuResponse(gpu=self.gpus[name], created=False)
            gpu = gpu_pb2.Gpu()
            gpu.CopyFrom(request.gpu)
            self._bump(gpu)
            self.gpus[name] = gpu
            self._emit("ADDED", gpu)
            return gpu_pb2.CreateGpuResponse(gpu=gpu, created=True)

    def UpdateGpu(self, request: gpu_pb2.UpdateGpuRequest,
                  context: grpc.ServicerContext) -> gpu_pb2.UpdateGpuResponse:
        self._answer("UpdateGpu", request.gpu.metadata.name, context)
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not used by the plugin")
        raise AssertionError  # abort raises

    def UpdateGpuStatus(self, request: gpu_pb2.UpdateGpuStatusRequest,
                        context: grpc.ServicerContext) -> gpu_pb2.UpdateGpuStatusResponse:
        self._answer("UpdateGpuStatus", request.name, context)
        with self.changed:
            gpu = self.gpus.get(request.name)
            if gpu is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"gpu {request.name} not found")
            if request.resource_version and request.resource_version != gpu.resource_version:
                context.abort(grpc.StatusCode.ABORTED, f"resource version {request.resource_version} is stale "
                                                       f"(now {gpu.resource_version})")
            gpu.status.CopyFrom(request.status)
            self._bump(gpu)
            self._emit("MODIFIED", gpu)
            return gpu_pb2.UpdateGpuStatusResponse(gpu=gpu)

    def DeleteGpu(self, request: gpu_pb2.DeleteGpuRequest, context: grpc.ServicerContext) -> empty_pb2.Empty:
        self._answer("DeleteGpu", request.name, context)
        with self.changed:
            gpu = self.gpus.pop(request.name, None)
            if gpu is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"gpu {request.name} not found")
            self._emit("DELETED", gpu)
        return empty_pb2.Empty()
