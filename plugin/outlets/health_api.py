"""The node-local health stream (gpuhealth.v1alpha1.DeviceHealth) on its own unix socket, and the operator's Clear.

Whoever can reach the socket can clear a fault: it is node-local, mode 0660 in the state dir, so that means root on
the node, the node's admins group, or anyone allowed to ``kubectl exec`` into the plugin's pod.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Protocol

import grpc

from api.gpuhealth.v1alpha1 import health_pb2, health_pb2_grpc
from plugin.health.node_state import DeviceStatus, NodeState, Snapshot, Transition
from plugin.health.reasons import Reason
from plugin.health.tracker import ClearRefused
from plugin.sockets import UnixGrpcServer, client_left

log = logging.getLogger(__name__)


def reason_pb(r: Reason) -> health_pb2.Reason:
    return health_pb2.Reason(code=r.code, message=r.message, source=r.source, action=r.action,
                             first_seen=r.first_seen, severity=r.severity.value)


def status_pb(d: DeviceStatus) -> health_pb2.DeviceStatus:
    c = d.cleared
    return health_pb2.DeviceStatus(id=d.id, state=d.state.value, reasons=[reason_pb(r) for r in d.reasons],
                                   since=d.since, kubelet_health=d.kubelet_health, index=d.gpu.index,
                                   name=d.mig.profile if d.mig else d.gpu.name,
                                   cleared=c.text if c is not None else "", cleared_at=c.time if c is not None else 0.0)


class Registration(Protocol):
    """The kubelet registration record as the health API shows it: the supervisor's, or DRA mode's."""

    @property
    def registered(self) -> bool: ...

    @property
    def registrations(self) -> int: ...

    @property
    def last_registered_at(self) -> float: ...

    @property
    def last_error(self) -> str: ...


def kubelet_pb(mode: str, rec: Registration) -> health_pb2.KubeletRegistration:
    return health_pb2.KubeletRegistration(mode=mode, registered=rec.registered, registrations=rec.registrations,
                                          last_registered_at=rec.last_registered_at, last_error=rec.last_error)


def snapshot_pb(snap: Snapshot, outlet_errors: Mapping[str, str] | None = None,
                kubelet: health_pb2.KubeletRegistration | None = None) -> health_pb2.ListResponse:
    return health_pb2.ListResponse(devices=[status_pb(d) for d in snap.devices], seq=snap.seq,
                                   outlet_errors=dict(outlet_errors or {}), kubelet=kubelet)


def transition_pb(t: Transition) -> health_pb2.Transition:
    return health_pb2.Transition(seq=t.seq, id=t.id, from_state=t.from_state, to_state=t.to_state,
                                 reasons=[reason_pb(r) for r in t.reasons], time=t.time, note=t.note)


NOTE_MAX = 256  # characters of an operator's note: one line in the history, an Event and the stream
_CODE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
CODE_MAX = 63


class Clearer(Protocol):
    """What the Clear RPC needs of the monitor (plugin/health/monitor.py), wired in app.py."""

    def clear(self, device_id: str | None, code: str | None, note: str,
              now: float | None = None) -> list[tuple[str, str]]: ...


class BadClear(ValueError):
    """A Clear request wrong as written or naming what the node does not have; ``code`` is the gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_note(note: str) -> str:
    """The note as kept, or BadClear saying what is wrong with it: required, one printable line, bounded. The CLI
    checks ``--note`` with it before it dials, the server again for any other client."""
    text = note.strip()
    if not text:
        raise BadClear(grpc.StatusCode.INVALID_ARGUMENT, "required: say why the fault is cleared (what was "
                                                         "fixed, a ticket)")
    if len(text) > NOTE_MAX:
        raise BadClear(grpc.StatusCode.INVALID_ARGUMENT,
                       f"at most {NOTE_MAX} characters, got {len(text)}")
    if not text.isprintable():
        raise BadClear(grpc.StatusCode.INVALID_ARGUMENT,
                       f"one line of printable characters, got {text[:40]!r}")
    return text


def check_code(code: str) -> str:
    """A reason code as written (xid-79), or BadClear: whether the device has it is the monitor's to say."""
    if len(code) > CODE_MAX or not _CODE.match(code):
        raise BadClear(grpc.StatusCode.INVALID_ARGUMENT,
                       f"expected a reason code such as xid-79 (lower-case, hyphenated), got {code[:80]!r}")
    return code


def check_clear(snap: Snapshot, device: str, all_devices: bool, reason: str) -> None:
    """Raise BadClear for a request that cannot be meant: neither or both of device and all, a reason that is not
    a reason code, a device this node does not have (by device id, GPU UUID or GPU index)."""
    if all_devices == bool(device):
        both = ", not both" if device else ""
        raise BadClear(grpc.StatusCode.INVALID_ARGUMENT,
                       f"name one device (a GPU UUID, a MIG device UUID or an index) or all{both}")
    if reason:
        try:
            check_code(reason)
        except BadClear as exc:
            raise BadClear(exc.code, f"reason: {exc}") from None
    if device and not any(_names(d, device) for d in snap.devices):
        raise BadClear(grpc.StatusCode.NOT_FOUND, f"device {device[:80]!r}: no such device on this node "
                                                  f"(a GPU UUID, a MIG device UUID or an index: see `status`)")


def _names(d: DeviceStatus, device: str) -> bool:
    return device in (d.id, d.gpu.uuid) or (device.isdigit() and int(device) == d.gpu.index)


class HealthServicer(health_pb2_grpc.DeviceHealthServicer):
    def __init__(self, state: NodeState, outlet_errors: Callable[[], Mapping[str, str]] = dict,
                 clearer: Clearer | None = None,
                 registration: tuple[str, Callable[[], Registration]] | None = None) -> None:
        self.state = state
        # The monitor, which owns the latches; None where nothing may be cleared (a servicer over a bare state).
        self.clearer = clearer
        self.closed = threading.Event()
        # Failing outlets (e.g. the API-server writer) by name, shown in List and Watch snapshots; read at each one.
        self.outlet_errors = outlet_errors
        # The mode and the kubelet registration record, read at each snapshot; None over a bare state (no kubelet
        # side), which leaves the field unset as an older plugin does.
        self.registration = registration

    def _snapshot(self, snap: Snapshot) -> health_pb2.ListResponse:
        reg = self.registration
        return snapshot_pb(snap, self.outlet_errors(), kubelet_pb(reg[0], reg[1]()) if reg is not None else None)

    def close(self) -> None:
        self.closed.set()
        self.state.poke()

    def List(self, request: health_pb2.ListRequest, context: grpc.ServicerContext) -> health_pb2.ListResponse:
        return self._snapshot(self.state.snapshot())

    def Watch(self, request: health_pb2.WatchRequest,
              context: grpc.ServicerContext) -> Iterator[health_pb2.WatchEvent]:
        left = client_left(context, self.state.poke)
        start = self.state.snapshot()
        seq = request.since_seq
        missed = self.state.transitions_since(seq) if seq > 0 else None
        if missed is None:
            # A fresh client, or one whose resume point fell out of the bounded history: start from a snapshot.
            yield health_pb2.WatchEvent(snapshot=self._snapshot(start), resync=seq > 0)
            seq = start.seq
        else:
            for t in missed:
                yield health_pb2.WatchEvent(transition=transition_pb(t))
                seq = t.seq
        for snap in self.state.follow(start.version, lambda: left.is_set() or self.closed.is_set()):
            news = self.state.transitions_since(seq)
            if news is None:  # this client fell behind the history: hand it a fresh snapshot
                yield health_pb2.WatchEvent(snapshot=self._snapshot(snap), resync=True)
                seq = snap.seq
                continue
            for t in news:
                yield health_pb2.WatchEvent(transition=transition_pb(t))
                seq = t.seq

    def Clear(self, request: health_pb2.ClearRequest,
              context: grpc.ServicerContext) -> health_pb2.ClearResponse:
        if self.clearer is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server has no monitor to clear faults with")
        try:
            try:
                note = check_note(request.note)
            except BadClear as exc:
                raise BadClear(exc.code, f"note: {exc}") from None
            check_clear(self.state.snapshot(), request.device, request.all, request.reason)
            cleared = self.clearer.clear(request.device or None, request.reason or None, note)
        except BadClear as exc:
            context.abort(exc.code, str(exc))
        except ClearRefused as exc:
            # The monitor's one line: the condition is still present, or the reason is not there for the operator
            # to clear (not on the device, or one only its cause takes off). Nothing was changed.
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return health_pb2.ClearResponse(cleared=[health_pb2.Cleared(id=d, code=c) for d, c in cleared])


class HealthServer:
    def __init__(self, socket_path: Path, state: NodeState, max_workers: int = 16,
                 outlet_errors: Callable[[], Mapping[str, str]] = dict, clearer: Clearer | None = None,
                 registration: tuple[str, Callable[[], Registration]] | None = None) -> None:
        self.path = socket_path
        self.servicer = HealthServicer(state, outlet_errors, clearer, registration)
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
