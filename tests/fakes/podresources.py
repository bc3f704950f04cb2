"""A stand-in for the kubelet's PodResources API (``v1.PodResourcesLister``) on a real unix socket: tests say which
pods and containers hold which devices, and can make the server fail the way an unhappy kubelet does."""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path

import grpc

from api.podresources.v1 import api_pb2, api_pb2_grpc

# (namespace, pod) -> container -> resource -> device IDs
Assignments = dict[tuple[str, str], dict[str, dict[str, list[str]]]]


class PodResourcesServer(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.pods: Assignments = {}
        self.fail: grpc.StatusCode | None = None  # answer List with this error while set
        self.calls = 0
        self.called = threading.Condition()
        self._server: grpc.Server | None = None

    def assign(self, namespace: str, pod: str, container: str, resource: str, *device_ids: str) -> None:
        self.pods.setdefault((namespace, pod), {}).setdefault(container, {}).setdefault(resource, []).extend(
            device_ids)

    def _pod(self, key: tuple[str, str]) -> api_pb2.PodResources:
        p = api_pb2.PodResources(namespace=key[0], name=key[1])
        for container, by_resource in self.pods[key].items():
            c = p.containers.add(name=container)
            for resource, ids in by_resource.items():
                c.devices.add(resource_name=resource, device_ids=ids)
        return p

    def List(self, request: api_pb2.ListPodResourcesRequest,
             context: grpc.ServicerContext) -> api_pb2.ListPodResourcesResponse:
        with self.called:
            self.calls += 1
            self.called.notify_all()
        if self.fail is not None:
            context.abort(self.fail, "kubelet says no")
        return api_pb2.ListPodResourcesResponse(pod_resources=[self._pod(k) for k in sorted(self.pods)])

    def Get(self, request: api_pb2.GetPodResourcesRequest,
            context: grpc.ServicerContext) -> api_pb2.GetPodResourcesResponse:
        key = (request.pod_namespace, request.pod_name)
        if key not in self.pods:
            context.abort(grpc.StatusCode.NOT_FOUND, f"pod {key[0]}/{key[1]} not found")
        return api_pb2.GetPodResourcesResponse(pod_resources=self._pod(key))

    def GetAllocatableResources(self, request: api_pb2.AllocatableResourcesRequest,
                                context: grpc.ServicerContext) -> api_pb2.AllocatableResourcesResponse:
        return api_pb2.AllocatableResourcesResponse()

    def wait_calls(self, n: int, timeout: float = 10.0) -> bool:
        with self.called:
            return self.called.wait_for(lambda: self.calls >= n, timeout)

    def start(self) -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.socket_path}")
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait(2)
