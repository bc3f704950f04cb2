"""The DRA health stream (DRAResourceHealth v1 and v1alpha1): the node state as the kubelet reads device health.

The kubelet stamps every device of a report with the time it received it and reads a device as Unknown once no
report named it within the device's timeout. So every message is a full report of every device: one at once, one
after each change of the node state, and one every ``heartbeat_s`` while nothing changes. The mapping from a
snapshot to a report is the pure function ``device_health``; the servicers only pace it.

The devices are the slice's (``slices.published_devices``, under the same MIG strategy): whole GPUs, and MIG
instances under ``mixed``, each with its own state, an instance's carrying its parent's faults. A device that is
gone from the node (an instance destroyed) is no longer reported, so the kubelet shows it Unknown after its
timeout while a claim still holds it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import grpc

from api.drahealth.v1 import api_pb2 as v1_pb2
from api.drahealth.v1 import api_pb2_grpc as v1_grpc
from api.drahealth.v1alpha1 import api_pb2 as v1alpha1_pb2
from api.drahealth.v1alpha1 import api_pb2_grpc as v1alpha1_grpc
from plugin.dra.slices import DRIVER, check_mig_strategy, published_devices
from plugin.health.node_state import NodeState, Snapshot
from plugin.health.reasons import State
from plugin.sockets import client_left
from plugin.validation import FieldError

log = logging.getLogger(__name__)

# The kubelet keeps up to 1024 characters of a message; pod status is read by people, so ours stays short.
MESSAGE_MAX = 256

HEALTHY = "HEALTHY"
UNHEALTHY = "UNHEALTHY"
UNKNOWN = "UNKNOWN"

DEGRADED_AS = ("Healthy", "Unhealthy")

# The names the kubelet matches in the registration's supported versions, newest first (it takes the first it
# knows). Taken from the descriptors so that what we announce is what we serve.
HEALTH_SERVICE_NAMES: tuple[str, ...] = tuple(pb.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name
                                              for pb in (v1_pb2, v1alpha1_pb2))


@dataclass(frozen=True, kw_only=True)
class HealthSettings:
    """How device health is told to the kubelet. Invalid values raise ``FieldError`` naming the field."""

    pool: str  # the ResourceSlice's pool: the node name
    driver: str = DRIVER
    # A Degraded device still works: by default the kubelet hears Healthy (with the reason as the message).
    degraded_as: str = "Healthy"
    timeout_s: int = 60  # health_check_timeout_seconds in every report
    heartbeat_s: float = 20.0  # a full report at least this often; at most a third of timeout_s
    mig_strategy: str = "none"  # the slice's (SliceSettings.mig_strategy): the devices reported are the slice's

    def __post_init__(self) -> None:
        check_mig_strategy(self.mig_strategy)
        if not self.pool:
            raise FieldError("pool", "expected the pool name (the node name), got an empty string")
        if self.degraded_as not in DEGRADED_AS:
            raise FieldError("degraded_as", f"expected one of {', '.join(DEGRADED_AS)}, got {self.degraded_as!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int) or self.timeout_s < 1:
            raise FieldError("timeout_s", f"expected a whole number of seconds of at least 1, got {self.timeout_s!r}")
        if not 0 < self.heartbeat_s <= self.timeout_s / 3:
            # Two reports may be lost or late before the kubelet reads the device as Unknown.
            raise FieldError("heartbeat_s", f"expected more than 0 and at most a third of timeout_s "
                                            f"({self.timeout_s / 3:g}), got {self.heartbeat_s!r}")


class DeviceReport(NamedTuple):
    pool: str
    device: str
    health: str  # HEALTHY, UNHEALTHY or UNKNOWN: the name of the HealthStatus value
    message: str


def shorten(message: str, limit: int = MESSAGE_MAX) -> str:
    """``message`` on one line, cut to ``limit`` characters (the last three an ellipsis when cut)."""
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit - 3] + "..."


def device_health(snapshot: Snapshot, names: Mapping[str, str] | None,
                  settings: HealthSettings) -> list[DeviceReport]:
    """One report line per device the slice publishes for ``snapshot``, in the slice's order.

    ``names`` maps a device's UUID (a GPU's, or a MIG instance's) to its name in the ResourceSlice; None: the names
    ``published_devices`` gives, as the slice writer does. A device without a name there is left out (it is not in
    the slice either).
    """
    out: list[DeviceReport] = []
    for device in published_devices(snapshot.devices, settings.mig_strategy):
        d = device.status
        name = device.name if names is None else names.get(device.uuid)
        if name is None or d is None:
            continue
        top = d.reasons
        reason = shorten(f"{top[0].code}: {top[0].message}") if top else ""
        if d.state is State.HEALTHY:
            health, message = HEALTHY, ""
        elif d.state is State.DEGRADED:
            health = HEALTHY if settings.degraded_as == "Healthy" else UNHEALTHY
            message = reason or d.state.value
        elif d.state is State.UNHEALTHY:
            health, message = UNHEALTHY, reason or d.state.value
        else:
            health, message = UNKNOWN, reason or d.state.value
        out.append(DeviceReport(settings.pool, name, health, message))
    return out


def _response(pb: ModuleType, reports: list[DeviceReport], settings: HealthSettings, now: float) -> Any:
    stamp = int(now)
    return pb.NodeWatchResourcesResponse(devices=[
        pb.DeviceHealth(device=pb.DeviceIdentifier(pool_name=r.pool, device_name=r.device),
                        health=pb.HealthStatus.Value(r.health), last_updated_time=stamp,
                        health_check_timeout_seconds=settings.timeout_s, message=r.message)
        for r in reports])


class _Streams:
    """What both versions share: the pacing of one stream, the close of all, and counters."""

    def __init__(self, state: NodeState, settings: HealthSettings) -> None:
        self.state = state
        self.settings = settings
        self.closed = threading.Event()
        self._lock = threading.Lock()
        self.active = 0
        self.reports = 0  # messages sent, all streams together

    def watch(self, pb: ModuleType, context: grpc.ServicerContext) -> Iterator[Any]:
        left = client_left(context, self.state.poke)

        def done() -> bool:
            return left.is_set() or self.closed.is_set() or self.state.closed

        with self._lock:
            self.active += 1
        try:
            snap = self.state.snapshot()
            while not done():
                yield self._report(pb, snap)
                # Waits for a new version, the heartbeat, or the end: never wakes for nothing to send, as a
                # poke for another stream is re-judged inside wait_for_change and does not return.
                snap = self.state.wait_for_change(snap.version, self.settings.heartbeat_s, abort=done)
        finally:
            with self._lock:
                self.active -= 1

    def _report(self, pb: ModuleType, snap: Snapshot) -> Any:
        with self._lock:
            self.reports += 1
        return _response(pb, device_health(snap, None, self.settings), self.settings, time.time())


class HealthV1Servicer(v1_grpc.DRAResourceHealthServicer):
    def __init__(self, streams: _Streams) -> None:
        self._streams = streams

    def NodeWatchResources(self, request: v1_pb2.NodeWatchResourcesRequest,
                           context: grpc.ServicerContext) -> Iterator[v1_pb2.NodeWatchResourcesResponse]:
        yield from self._streams.watch(v1_pb2, context)


class HealthV1alpha1Servicer(v1alpha1_grpc.DRAResourceHealthServicer):
    def __init__(self, streams: _Streams) -> None:
        self._streams = streams

    def NodeWatchResources(self, request: v1alpha1_pb2.NodeWatchResourcesRequest,
                           context: grpc.ServicerContext) -> Iterator[v1alpha1_pb2.NodeWatchResourcesResponse]:
        yield from self._streams.watch(v1alpha1_pb2, context)


class HealthServicers:
    """Both versions on one server; ``close`` ends every stream so the server can stop without waiting."""

    def __init__(self, state: NodeState, settings: HealthSettings) -> None:
        self._streams = _Streams(state, settings)
        self.v1 = HealthV1Servicer(self._streams)
        self.v1alpha1 = HealthV1alpha1Servicer(self._streams)

    @property
    def active_streams(self) -> int:
        return self._streams.active

    @property
    def reports_sent(self) -> int:
        return self._streams.reports

    def close(self) -> None:
        self._streams.closed.set()
        self._streams.state.poke()


def add_health_services(server: grpc.Server, state: NodeState, settings: HealthSettings) -> HealthServicers:
    servicers = HealthServicers(state, settings)
    v1_grpc.add_DRAResourceHealthServicer_to_server(servicers.v1, server)
    v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(servicers.v1alpha1, server)
    return servicers
