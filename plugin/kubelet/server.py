"""The DevicePlugin gRPC servicer: a plain synchronous class over the node state, so grpcio-testing can drive it."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator

import grpc

from api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugin.health.node_state import NodeState
from plugin.kubelet.allocation import AllocationConfig, AllocationError, check_ids, container_response
from plugin.kubelet.resources import KubeletDevice, Resource
from plugin.sockets import client_left

log = logging.getLogger(__name__)


class DevicePluginServicer(api_pb2_grpc.DevicePluginServicer):
    def __init__(self, state: NodeState, resource: Resource, alloc: AllocationConfig,
                 options: api_pb2.DevicePluginOptions) -> None:
        self.state = state
        self.resource = resource
        self.alloc = alloc
        self.options = options
        self.closed = threading.Event()
        self._streams = 0
        self._streams_lock = threading.Condition()

    @property
    def open_streams(self) -> int:
        return self._streams

    def wait_for_streams(self, count: int, timeout: float) -> bool:
        """Block until exactly ``count`` streams are open (tests and shutdown use it)."""
        with self._streams_lock:
            return self._streams_lock.wait_for(lambda: self._streams == count, timeout)

    def close(self) -> None:
        """End every open stream of this servicer (the server is being replaced or the process stops)."""
        self.closed.set()
        self.state.poke()

    def GetDevicePluginOptions(self, request: api_pb2.Empty,
                               context: grpc.ServicerContext) -> api_pb2.DevicePluginOptions:
        return self.options

    def ListAndWatch(self, request: api_pb2.Empty,
                     context: grpc.ServicerContext) -> Iterator[api_pb2.ListAndWatchResponse]:
        left = client_left(context, self.state.poke)
        with self._streams_lock:
            self._streams += 1
        try:
            last: tuple[KubeletDevice, ...] | None = None
            # From version -1, which no snapshot has: the kubelet gets the first response at once.
            for snap in self.state.follow(-1, lambda: left.is_set() or self.closed.is_set()):
                view = self.resource.devices(snap)
                if view != last:
                    last = view
                    yield self.resource.response(snap)  # the same view, from the resource's cached encoding
        finally:
            with self._streams_lock:
                self._streams -= 1
                self._streams_lock.notify_all()

    def Allocate(self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext) -> api_pb2.AllocateResponse:
        if not request.container_requests:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "container_requests is empty")
        snap = self.state.snapshot()
        resp = api_pb2.AllocateResponse()
        try:
            for i, creq in enumerate(request.container_requests):
                what = f"container_requests[{i}].devices_ids"
                self.resource.check_request(snap, creq.devices_ids, what)  # e.g. failRequestsGreaterThanOne
                statuses = check_ids(list(creq.devices_ids), lambda d: self.resource.backing(snap, d),
                                     self.alloc.allow_unhealthy, what)
                resp.container_responses.append(container_response(statuses, self.alloc, os.path.exists))
        except AllocationError as exc:
            log.warning("Allocate refused: %s", exc)
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        return resp

    def GetPreferredAllocation(self, request: api_pb2.PreferredAllocationRequest,
                               context: grpc.ServicerContext) -> api_pb2.PreferredAllocationResponse:
        snap = self.state.snapshot()
        resp = api_pb2.PreferredAllocationResponse()
        for i, creq in enumerate(request.container_requests):
            size = creq.allocation_size
            if size < 1:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"container_requests[{i}].allocation_size must be at least 1, got {size}")
            # IDs we cannot place are left out rather than failing admission: the kubelet fills any shortfall.
            available = [d for d in dict.fromkeys(creq.available_deviceIDs)
                         if self.resource.backing(snap, d) is not None]
            must = [d for d in dict.fromkeys(creq.must_include_deviceIDs)
                    if self.resource.backing(snap, d) is not None]
            if len(must) > size:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"container_requests[{i}]: {len(must)} must-include devices exceed "
                              f"allocation_size {size}")
            # The resource knows what its IDs are (whole GPUs, MIG slices, replicas) and picks accordingly.
            resp.container_responses.add(deviceIDs=self.resource.preferred(snap, available, must, size))
        return resp

    def PreStartContainer(self, request: api_pb2.PreStartContainerRequest,
                          context: grpc.ServicerContext) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()
