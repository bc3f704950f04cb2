"""NVSentinel's node-local device API at run time (docs/nvsentinel.md, "The device API"): the provider publishes our
health as one condition on each physical GPU, the consumer turns other providers' conditions into reasons for our
engine. The mapping both ways is pure (``gpuconditions``); this module is the gRPC, the threads and the retries.

Neither side ever blocks the health engine: the provider runs on an outlet thread woken by the node state, the
consumer on a thread of its own that only calls the engine's ``set_external``. Every call has a deadline; every
failure backs off with jitter and is logged once per streak.
"""

from __future__ import annotations

import logging
import os
import random
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from api.nvsentinel.deviceapi.v1alpha1 import gpu_pb2, gpu_pb2_grpc
from plugin.backoff import Backoff
from plugin.health.node_state import NodeState
from plugin.health.reasons import Reason, worst_first
from plugin.kube.protocols import Closeable
from plugin.nvsentinel.gpuconditions import (
    REJECT_KINDS,
    GpuCondition,
    Rejected,
    Verdict,
    differs,
    external_reasons,
    merged_status,
    physical,
    verdict,
)
from plugin.outlets.worker import OutletThread

log = logging.getLogger(__name__)

DEFAULT_SOCKET = Path("/var/run/device-api/device.sock")
WATCH_METHOD = "/nvidia.device.v1alpha1.GpuService/WatchGpus"
OPERATIONS = ("create", "update-status")
RESULTS = ("ok", "exists", "conflict", "not-found", "unimplemented", "error")
ROLES = ("provider", "consumer")


@dataclass(frozen=True)
class DeviceApiSettings:
    socket: Path
    label: str  # how the user named the socket option (--device-api-socket, its env variable or file key)
    provide: bool
    consume: bool
    call_timeout_s: float = 5.0
    resync_s: float = 30.0  # how often the provider re-reads its GPUs (reads only; it writes when one differs)
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    max_conflicts: int = 5  # ABORTED answers in a row for one GPU before it waits for the next round


class ExternalReasonSink(Protocol):
    """What the consumer needs of the health engine (the Monitor satisfies it; app.py wires it)."""

    def set_external(self, uuid: str, reasons: Sequence[Reason]) -> object: ...


class DeviceApiStats:
    """Counters for /metrics, shared by the provider and the consumer; read at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writes = {(op, result): 0 for op in OPERATIONS for result in RESULTS}
        self._connected = {role: False for role in ROLES}
        self._rejected = {kind: 0 for kind in REJECT_KINDS}
        self.external_reasons = 0

    def wrote(self, operation: str, result: str) -> None:
        with self._lock:
            self._writes[(operation, result)] = self._writes.get((operation, result), 0) + 1

    def rejected(self, kind: str) -> None:
        with self._lock:
            self._rejected[kind] = self._rejected.get(kind, 0) + 1

    def set_connected(self, role: str, up: bool) -> None:
        self._connected[role] = up

    def writes(self) -> Mapping[tuple[str, str], int]:
        with self._lock:
            return dict(self._writes)

    def connected(self) -> Mapping[str, bool]:
        return dict(self._connected)

    def rejections(self) -> Mapping[str, int]:
        with self._lock:
            return dict(self._rejected)


class OurActions:
    """The recommended action our provider last wrote on each of its GPU objects, for the consumer. The field is
    one per GPU and any provider may write it: an action equal to the one we wrote says nothing about another
    provider's finding, and taking it as theirs would hand our own action back to us as external evidence."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, str] = {}

    def wrote(self, name: str, action: str) -> None:
        with self._lock:
            self._by_name[name] = action

    def ours(self, name: str) -> str:
        """Our last action on object ``name``, "" when we wrote none."""
        with self._lock:
            return self._by_name.get(name, "")


class _Failure(Exception):
    """A call that failed; ``message`` is the one line to log, ``kind`` says which streak it belongs to."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class _Streak:
    """Failures in a row: the back-off (with jitter), and whether a failure is worth a log line (the first of a
    streak, or one of another kind)."""

    def __init__(self, settings: DeviceApiSettings, rng: random.Random | None) -> None:
        self._backoff = Backoff(settings.backoff_initial_s, settings.backoff_max_s, jitter=True, rng=rng)
        self._kind = ""

    def failed(self, f: _Failure) -> tuple[float, bool]:
        delay = self._backoff.next_delay()
        worth = self._backoff.failures == 1 or f.kind != self._kind
        self._kind = f.kind
        return delay, worth

    def succeeded(self) -> int:
        self._kind = ""
        return self._backoff.reset()


class _Link:
    """One channel to the device API, built when first needed and dropped after a lost connection, so the next
    attempt dials afresh (a restarted server is found at once, not after gRPC's own reconnect back-off)."""

    def __init__(self, settings: DeviceApiSettings) -> None:
        self._settings = settings
        self._channel: grpc.Channel | None = None

    def channel(self) -> grpc.Channel:
        path = self._settings.socket
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise _Failure("absent", f"{self._settings.label}: no device API socket at {path} yet") from None
        except OSError as exc:
            raise _Failure("stat", f"{self._settings.label}: {path}: {exc.strerror}") from None
        if not stat.S_ISSOCK(mode):
            raise _Failure("not-a-socket", f"{self._settings.label}: {path} exists but is not a socket; "
                                           "expected the device API server's unix socket")
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"unix:{path}")
        return self._channel

    def stub(self) -> gpu_pb2_grpc.GpuServiceStub:
        return gpu_pb2_grpc.GpuServiceStub(self.channel())

    def drop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def close(self) -> None:
        self.drop()


def _failure(exc: grpc.RpcError, method: str, settings: DeviceApiSettings) -> _Failure:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    if code is grpc.StatusCode.UNIMPLEMENTED:
        return _Failure("unimplemented", f"{settings.label}: the device API at {settings.socket} does not implement "
                                         f"{method}: a server of another version?")
    name = code.name if code is not None else "error"
    detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    return _Failure(name.lower(), f"device API {method} failed: {name}: {detail}")


def _result(f: _Failure) -> str:
    """A failed write's result label: a server of another version apart from every other error."""
    return "unimplemented" if f.kind == "unimplemented" else "error"


def _code(exc: grpc.RpcError) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.Call) else None


def conditions_of(gpu: gpu_pb2.Gpu) -> tuple[GpuCondition, ...]:
    return tuple(GpuCondition(c.type, c.status, c.reason, c.message,
                              c.last_transition_time.ToNanoseconds() / 1e9 if c.HasField("last_transition_time")
                              else 0.0)
                 for c in gpu.status.conditions)


def _to_proto(c: GpuCondition) -> gpu_pb2.Condition:
    out = gpu_pb2.Condition(type=c.type, status=c.status, reason=c.reason, message=c.message)
    if c.last_transition:
        out.last_transition_time.FromNanoseconds(int(c.last_transition * 1e9))
    return out


# Provider --------------------------------------------------------------------------------------------------------

class DeviceApiProvider(OutletThread):
    """Keeps one condition of ours (``gpuconditions.CONDITION_TYPE``) on every physical GPU of the node, written only
    when what it says changes. Each write is read-modify-write: the status is replaced whole, so every other
    provider's condition must go back as the server holds it, at the version we read."""

    def __init__(self, state: NodeState, settings: DeviceApiSettings, stats: DeviceApiStats, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 rng: random.Random | None = None, ours: OurActions | None = None) -> None:
        super().__init__(state, clock, version=-1, thread_name="device-api-provider", label="device API provider",
                         log=log)
        self.settings = settings
        self.stats = stats
        self.ours = ours or OurActions()
        self._wall = wall
        self._link = _Link(settings)
        self._streak = _Streak(settings, rng)
        self._retry_at = 0.0
        self._resync_at = 0.0
        self._created: set[str] = set()  # GPU names known to exist on this server
        self._written: dict[str, Verdict] = {}  # what the server holds of ours, as far as we know
        self._our_action: dict[str, str] = {}  # the recommended action we last wrote, per GPU

    def _clients(self) -> Iterable[Closeable | None]:
        return (self._link,)

    def step(self, now: float) -> float:
        if now < self._retry_at:
            return self._retry_at
        snap = self.state.snapshot()
        self._version = snap.version
        wanted = physical((d.parent_id, d.state, d.reasons) for d in snap.devices)
        resync = now >= self._resync_at
        try:
            stub = self._link.stub()
            for uuid, (state, reasons) in wanted.items():
                name = uuid.lower()
                v = verdict(state, reasons)
                if resync or self._written.get(name) != v:
                    self._publish(stub, name, uuid, v)
        except _Failure as f:
            self.stats.set_connected("provider", False)
            if f.kind not in ("not-a-socket", "absent", "unimplemented"):
                self._link.drop()
            # Whatever the server holds now is unknown: the next round re-reads every GPU.
            self._created.clear()
            self._written.clear()
            delay, worth = self._streak.failed(f)
            if worth:
                log.warning("%s; retrying in %.2gs", f.message, delay)
            self._retry_at = now + delay
            return self._retry_at
        self.stats.set_connected("provider", True)
        if n := self._streak.succeeded():
            log.info("device API provider: writing again after %d failed attempts", n)
        if resync:
            self._resync_at = now + self.settings.resync_s
        return self._resync_at

    def _call(self, method: str, fn: Callable[..., Any], request: Any) -> Any:
        try:
            return fn(request, timeout=self.settings.call_timeout_s)
        except grpc.RpcError as exc:
            if _code(exc) in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED):
                raise
            raise _failure(exc, method, self.settings) from None

    def _create(self, stub: gpu_pb2_grpc.GpuServiceStub, name: str, uuid: str) -> None:
        gpu = gpu_pb2.Gpu(metadata=gpu_pb2.ObjectMeta(name=name), spec=gpu_pb2.GpuSpec(uuid=uuid))
        try:
            resp = self._call("CreateGpu", stub.CreateGpu, gpu_pb2.CreateGpuRequest(gpu=gpu))
        except _Failure as f:
            self.stats.wrote("create", _result(f))
            raise
        self.stats.wrote("create", "ok" if resp.created else "exists")
        self._created.add(name)

    def _publish(self, stub: gpu_pb2_grpc.GpuServiceStub, name: str, uuid: str, v: Verdict) -> None:
        for _ in range(self.settings.max_conflicts):
            if name not in self._created:
                self._create(stub, name, uuid)
            try:
                gpu = self._call("GetGpu", stub.GetGpu, gpu_pb2.GetGpuRequest(name=name)).gpu
            except grpc.RpcError:  # NOT_FOUND: the server restarted empty, or someone deleted it
                self._created.discard(name)
                continue
            existing, action = conditions_of(gpu), gpu.status.recommended_action
            last = self._our_action.get(name)
            if not differs(existing, action, v, last if last is not None else action):
                self._written[name] = v
                return
            conditions, new_action = merged_status(existing, action, v, self._wall(), last)
            request = gpu_pb2.UpdateGpuStatusRequest(
                name=name, resource_version=gpu.resource_version,
                status=gpu_pb2.GpuStatus(conditions=[_to_proto(c) for c in conditions],
                                         recommended_action=new_action))
            # Told before the write: the consumer may read its watch event before this call returns.
            self.ours.wrote(name, v.action if new_action == v.action else "")
            try:
                self._call("UpdateGpuStatus", stub.UpdateGpuStatus, request)
            except grpc.RpcError as exc:
                if _code(exc) is grpc.StatusCode.ABORTED:
                    self.stats.wrote("update-status", "conflict")  # another provider wrote between: read again
                else:
                    self.stats.wrote("update-status", "not-found")
                    self._created.discard(name)
                continue
            except _Failure as f:
                self.stats.wrote("update-status", _result(f))
                raise
            self.stats.wrote("update-status", "ok")
            self._written[name] = v
            self._our_action[name] = v.action if new_action == v.action else ""
            return
        raise _Failure("conflict", f"device API: GPU {name} changed under {self.settings.max_conflicts} writes in a "
                                   "row; trying again later")


# Consumer --------------------------------------------------------------------------------------------------------

class _RateLimitedLog:
    """One line per kind of malformed input per interval, saying how many were left unsaid in between."""

    def __init__(self, clock: Callable[[], float], interval_s: float = 60.0) -> None:
        self._clock = clock
        self._interval = interval_s
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def __call__(self, kind: str, message: str) -> None:
        now = self._clock()
        if kind in self._last and now - self._last[kind] < self._interval:
            self._quiet[kind] = self._quiet.get(kind, 0) + 1
            return
        quiet = self._quiet.pop(kind, 0)
        self._last[kind] = now
        log.warning("device API: skipped a malformed condition (%s): %s%s", kind, message,
                    f" ({quiet} more of this kind since the last line)" if quiet else "")


def _lenient(data: bytes) -> gpu_pb2.WatchGpusResponse | None:
    """A watch event, or None for one that does not parse (a string field that is not UTF-8, a broken peer): that
    event is skipped, the stream goes on."""
    try:
        return gpu_pb2.WatchGpusResponse.FromString(data)
    except DecodeError:
        return None


class DeviceApiConsumer:
    """Watches every GPU on the device API and hands the engine, per GPU of ours, the reasons other providers'
    conditions amount to (``gpuconditions.external_reasons``)."""

    def __init__(self, sink: ExternalReasonSink, settings: DeviceApiSettings, stats: DeviceApiStats, *,
                 wall: Callable[[], float] = time.time, rng: random.Random | None = None,
                 ours: OurActions | None = None) -> None:
        self._sink = sink
        self._ours = ours or OurActions()
        self.settings = settings
        self.stats = stats
        self._wall = wall
        self._link = _Link(settings)
        self._streak = _Streak(settings, rng)
        self._say = _RateLimitedLog(time.monotonic)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._call: Any = None
        # Keyed by object, merged per GPU: two objects may name one UUID (another server's naming beside ours), and
        # the event of one must not erase what the other says.
        self._objects: dict[str, tuple[str, tuple[Reason, ...]]] = {}  # object name -> (lowercased UUID, reasons)
        self._held: dict[str, tuple[Reason, ...]] = {}  # lowercased UUID -> the reasons the engine holds from us

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="device-api-consumer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout)
        self._link.close()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._session()
                failure = _Failure("ended", "device API watch ended")
            except _Failure as f:
                failure = f
            except Exception:  # a bug here must not end the consumer for the life of the process
                log.exception("device API consumer: unexpected error")
                failure = _Failure("bug", "device API consumer: unexpected error")
            self.stats.set_connected("consumer", False)
            if self._stopping.is_set():
                return
            if failure.kind not in ("not-a-socket", "absent", "unimplemented"):
                self._link.drop()
            # The reasons held stay until the re-list: a lost stream (the server restarting, a socket hiccup) says
            # nothing about the GPUs, and dropping them would make a GPU another provider found failing look healthy
            # to the kubelet for as long as the device API is away, and flap with every reconnect.
            delay, worth = self._streak.failed(failure)
            if worth:
                log.warning("%s; watching again in %.2gs", failure.message, delay)
            self._stopping.wait(delay)

    def _session(self) -> None:
        channel = self._link.channel()
        stub = gpu_pb2_grpc.GpuServiceStub(channel)
        try:
            listing = stub.ListGpus(gpu_pb2.ListGpusRequest(), timeout=self.settings.call_timeout_s)
        except grpc.RpcError as exc:
            raise _failure(exc, "ListGpus", self.settings) from None
        # The re-list replaces everything held: a GPU missing from it is gone, with the reasons it gave.
        self._replace(listing.gpu_list.items)
        watch = channel.unary_stream(WATCH_METHOD, request_serializer=gpu_pb2.WatchGpusRequest.SerializeToString,
                                     response_deserializer=_lenient)
        call: Any = watch(gpu_pb2.WatchGpusRequest())
        self._call = call
        if self._stopping.is_set():
            call.cancel()
            return
        self.stats.set_connected("consumer", True)
        if n := self._streak.succeeded():
            log.info("device API consumer: watching again after %d failed attempts", n)
        try:
            for event in _events(call):
                if event is None:
                    self._reject(Rejected("undecodable", "a watch event that does not parse (a string not UTF-8?)"))
                    continue
                self._on_event(event)
        except grpc.RpcError as exc:
            if self._stopping.is_set() or _code(exc) is grpc.StatusCode.CANCELLED:
                return
            raise _failure(exc, "WatchGpus", self.settings) from None
        finally:
            self._call = None

    def _on_event(self, event: gpu_pb2.WatchGpusResponse) -> None:
        gpu = event.object
        if event.type in ("ADDED", "MODIFIED"):
            self._take(gpu)
        elif event.type == "DELETED":
            uuid, _ = self._objects.pop(gpu.metadata.name, (gpu.spec.uuid.lower(), ()))
            self._merge(uuid)
        elif event.type == "ERROR":
            raise _Failure("watch-error", f"device API watch reported an error: {gpu.metadata.name or '-'}")

    def _replace(self, gpus: Iterable[gpu_pb2.Gpu]) -> None:
        before = {u for u, _ in self._objects.values()} | set(self._held)
        self._objects = {}
        for g in gpus:
            self._take(g, merge=False)
        for uuid in sorted(before | {u for u, _ in self._objects.values()}):
            self._merge(uuid)

    def _take(self, gpu: gpu_pb2.Gpu, merge: bool = True) -> None:
        name = gpu.metadata.name
        if not gpu.spec.uuid:
            self._reject(Rejected("no-uuid", f"GPU {name or '-'} has no spec.uuid"))
            return
        uuid = gpu.spec.uuid.lower()
        held = self._held.get(uuid, ())
        action = gpu.status.recommended_action
        if action and action == self._ours.ours(name):
            action = ""  # ours: no other provider named an action (contact-support, as docs/nvsentinel.md says)
        reasons, rejected = external_reasons(name, conditions_of(gpu), action,
                                             {r.code: r.first_seen for r in held}, self._wall())
        for r in rejected:
            self._reject(r)
        moved, _ = self._objects.get(name, (uuid, ()))
        self._objects[name] = (uuid, reasons)
        if merge:
            if moved != uuid:
                self._merge(moved)  # the object now names another GPU: the one it named loses what it said
            self._merge(uuid)

    def _merge(self, uuid: str) -> None:
        """What every object naming ``uuid`` says, one reason per code (the worst kept), to the engine."""
        by_code: dict[str, Reason] = {}
        for u, reasons in self._objects.values():
            if u == uuid:
                for r in reasons:
                    kept = by_code.get(r.code)
                    by_code[r.code] = r if kept is None else worst_first((kept, r))[0]
        self._set(uuid, worst_first(tuple(by_code.values())))

    def _set(self, uuid: str, reasons: tuple[Reason, ...]) -> None:
        if not uuid or self._held.get(uuid, ()) == reasons:
            return
        if reasons:
            self._held[uuid] = reasons
        else:
            self._held.pop(uuid, None)
        self.stats.external_reasons = sum(len(rs) for rs in self._held.values())
        self._sink.set_external(uuid, reasons)

    def _reject(self, r: Rejected) -> None:
        self.stats.rejected(r.kind)
        self._say(r.kind, r.detail)


def _events(call: Any) -> Iterator[gpu_pb2.WatchGpusResponse | None]:
    yield from call


class DeviceApi:
    """Both roles as the config asks, sharing one set of counters: the provider starts with cluster reporting (only
    the instance that owns the node writes), the consumer with the engine (a successor serving the kubelet next to
    its predecessor must see the same reasons)."""

    def __init__(self, state: NodeState, sink: ExternalReasonSink, settings: DeviceApiSettings) -> None:
        self.stats = DeviceApiStats()
        ours = OurActions()
        self.provider = DeviceApiProvider(state, settings, self.stats, ours=ours) if settings.provide else None
        self.consumer = DeviceApiConsumer(sink, settings, self.stats, ours=ours) if settings.consume else None

    def start_consumer(self) -> None:
        if self.consumer is not None:
            self.consumer.start()

    def start_provider(self) -> None:
        if self.provider is not None:
            self.provider.start()

    def stop(self, timeout: float = 1.0) -> None:
        if self.provider is not None:
            self.provider.stop(timeout)
        if self.consumer is not None:
            self.consumer.stop(timeout)
