"""A stand-in for NVSentinel's platform connector: the real gRPC service on a unix socket, recording every batch of
health events it accepts. It can refuse the next calls with a status code, be stopped and started again on the same
path (a new socket file, as a restarted connector makes), or serve no service at all (a peer of another version)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf import empty_pb2

from api.nvsentinel.platformconnector import health_event_pb2, health_event_pb2_grpc


class FakePlatformConnector(health_event_pb2_grpc.PlatformConnectorServicer):
    def __init__(self, path: Path, serve_method: bool = True) -> None:
        self.path = path
        self.serve_method = serve_method
        self.batches: list[health_event_pb2.HealthEvents] = []
        self.calls = 0  # every call that reached us, refused ones included
        self._fail: list[grpc.StatusCode] = []
        # GPU UUIDs whose events this connector refuses (INVALID_ARGUMENT), the whole batch with them, as a
        # connector that cannot take one event of a batch answers.
        self.refuse_gpus: set[str] = set()
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None

    def HealthEventOccurredV1(self, request: health_event_pb2.HealthEvents,
                              context: grpc.ServicerContext) -> empty_pb2.Empty:
        with self._cond:
            self.calls += 1
            code = self._fail.pop(0) if self._fail else None
            if code is None and any(x.entityValue in self.refuse_gpus for e in request.events
                                    for x in e.entitiesImpacted if x.entityType == "GPU_UUID"):
                code = grpc.StatusCode.INVALID_ARGUMENT
            if code is None:
                self.batches.append(request)
            self._cond.notify_all()
        if code is not None:
            context.abort(code, "refused by the test")
        return empty_pb2.Empty()

    def fail_next(self, n: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        with self._cond:
            self._fail = [code] * n

    @property
    def events(self) -> list[health_event_pb2.HealthEvent]:
        with self._cond:
            return [e for b in self.batches for e in b.events]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def start(self) -> FakePlatformConnector:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        if self.serve_method:
            health_event_pb2_grpc.add_PlatformConnectorServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.path}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait(2.0)
            self._server = None
        self.path.unlink(missing_ok=True)

    def restart(self) -> None:
        """Stop and serve again on the same path: a new socket file (a new inode), and nothing of ours kept."""
        self.stop()
        with self._cond:
            self.batches.clear()
        self.start()
