"""The node-local health stream (gpuhealth.v1alpha1.DeviceHealth) on its own unix socket."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import grpc

from api.gpuhealth.v1alpha1 import health_pb2, health_pb2_grpc
from plugin.health.node_state import DeviceStatus, NodeState, Snapshot, Transition
from plugin.health.reasons import Reason
from plugin.sockets import UnixGrpcServer, client_left

log = logging.getLogger(__name__)


def reason_pb(r: Reason) -> health_pb2.Reason:
    return health_pb2.Reason(code=r.code, message=r.message, source=r.source, action=r.action,
                             first_seen=r.first_seen, severity=r.severity.value)


def status_pb(d: DeviceStatus) -> health_pb2.DeviceStatus:
    return health_pb2.DeviceStatus(id=d.id, state=d.state.value, reasons=[reason_pb(r) for r in d.reasons],
                                   since=d.since, kubelet_health=d.kubelet_health, index=d.gpu.index,
                                   name=d.mig.profile if d.mig else d.gpu.name)


def snapshot_pb(snap: Snapshot, outlet_errors: Mapping[str, str] | None = None) -> health_pb2.ListResponse:
    return health_pb2.ListResponse(devices=[status_pb(d) for d in snap.devices], seq=snap.seq,
                                   outlet_errors=dict(outlet_errors or {}))


def transition_pb(t: Transition) -> health_pb2.Transition:
    return health_pb2.Transition(seq=t.seq, id=t.id, from_state=t.from_state, to_state=t.to_state,
                                 reasons=[reason_pb(r) for r in t.reasons], time=t.time)


class HealthServicer(health_pb2_grpc.DeviceHealthServicer):
    def __init__(self, state: NodeState, outlet_errors: Callable[[], Mapping[str, str]] = dict) -> None:
        self.state = state
        self.closed = threading.Event()
        # Failing outlets (e.g. the API-server writer) by name, shown in List and Watch snapshots; read at each one.
        self.outlet_errors = outlet_errors

    def close(self) -> None:
        self.closed.set()
        self.state.poke()

    def List(self, request: health_pb2.ListRequest, context: grpc.ServicerContext) -> health_pb2.ListResponse:
        return snapshot_pb(self.state.snapshot(), self.outlet_errors())

    def Watch(self, request: health_pb2.WatchRequest,
              context: grpc.ServicerContext) -> Iterator[health_pb2.WatchEvent]:
        left = client_left(context, self.state.poke)
        start = self.state.snapshot()
        seq = request.since_seq
        missed = self.state.transitions_since(seq) if seq > 0 else None
        if missed is None:
            # A fresh client, or one whose resume point fell out of the bounded history: start from a snapshot.
            yield health_pb2.WatchEvent(snapshot=snapshot_pb(start, self.outlet_errors()), resync=seq > 0)
            seq = start.seq
        else:
            for t in missed:
                yield health_pb2.WatchEvent(transition=transition_pb(t))
                seq = t.seq
        for snap in self.state.follow(start.version, lambda: left.is_set() or self.closed.is_set()):
            news = self.state.transitions_since(seq)
            if news is None:  # this client fell behind the history: hand it a fresh snapshot
                yield health_pb2.WatchEvent(snapshot=snapshot_pb(snap, self.outlet_errors()), resync=True)
                seq = snap.seq
                continue
            for t in news:
                yield health_pb2.WatchEvent(transition=transition_pb(t))
                seq = t.seq


class HealthServer:
    def __init__(self, socket_path: Path, state: NodeState, max_workers: int = 16,
                 outlet_errors: Callable[[], Mapping[str, str]] = dict) -> None:
        self.path = socket_path
        self.servicer = HealthServicer(state, outlet_errors)
        # 0660: for the node's admins group, not the world; born so at its final path, umask untouched (bind_unix).
        self._grpc = UnixGrpcServer(socket_path, 0o660,
                                    lambda s: health_pb2_grpc.add_DeviceHealthServicer_to_server(self.servicer, s),
                                    max_workers, "health")

    def start(self) -> None:
        """Raises OSError or RuntimeError (bind), like UnixGrpcServer.start."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._grpc.start()
        log.info("health API serving on %s", self.path)

    def stop(self, grace_s: float = 0.5) -> None:
        self.servicer.close()
        self._grpc.stop(grace_s)
