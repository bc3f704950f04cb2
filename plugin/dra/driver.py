"""The kubelet-facing half of DRA mode: NodePrepareResources and NodeUnprepareResources for this node's devices
(whole GPUs, and MIG instances under ``--mig-strategy mixed``).

Prepare turns a claim the scheduler allocated into what the runtime needs: a CDI spec naming the devices' nodes
(an instance's are its parent GPU's) and UUIDs, and the CDI ids in the answer. It reads the allocation from the
ResourceClaim on the API server (the kubelet sends only the claim's identity), checks each device against the node
state, and records the result in a checkpoint before it answers, so a repeated prepare (a kubelet restart) and an
unprepare after a plugin restart answer from what was prepared. Unprepare undoes both; a claim it does not know is
already unprepared. A claim stays prepared as it was when its device goes (a MIG instance destroyed, a GPU gone)
until the kubelet unprepares it: the pod may still run, and only the checkpoint knows what to remove.

Failures of one claim are that claim's error in the answer, never the call's: the kubelet retries each claim on
its own. Only a request that is malformed as a whole (an empty UID, a UID that is not a UUID) fails the call, with
INVALID_ARGUMENT, and a checkpoint that cannot be read fails every call with UNAVAILABLE until it can: answering
without knowing what was prepared could prepare a GPU twice or forget one, and saving would overwrite the file.
Every claim's answer is counted for the metrics under a closed set of results (``Result``), never its message.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from api.dra.v1 import api_pb2 as v1_pb2
from api.dra.v1 import api_pb2_grpc as v1_grpc
from api.dra.v1beta1 import api_pb2 as v1beta1_pb2
from api.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from plugin.dra import cdi
from plugin.dra.checkpoint import Checkpoint, CheckpointError, CheckpointUnreadable, PreparedClaim, PreparedDevice
from plugin.dra.podstatus import extended_resource_pod
from plugin.dra.slices import DRIVER, PublishedDevice, SliceSettings, allocatable, device_plan, published_devices
from plugin.health.node_state import DeviceStatus, NodeState
from plugin.kube.errors import ApiFailure
from plugin.kube.protocols import ClaimApi

log = logging.getLogger(__name__)


def _registration_name(pb: ModuleType) -> str:
    # The kubelet's plugin registration lists a DRA service as "<version>.DRAPlugin" (the last two parts of the
    # gRPC service name), not by its full name; taken from the descriptors so the two cannot drift apart.
    full: str = pb.DESCRIPTOR.services_by_name["DRAPlugin"].full_name
    return ".".join(full.split(".")[-2:])


GRPC_SERVICE_NAMES: tuple[str, ...] = tuple(pb.DESCRIPTOR.services_by_name["DRAPlugin"].full_name
                                            for pb in (v1_pb2, v1beta1_pb2))
SERVICE_NAMES: tuple[str, ...] = (_registration_name(v1_pb2), _registration_name(v1beta1_pb2))


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    uid: str
    name: str


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class RequestError(ValueError):
    """The request as a whole is malformed; the message names the field."""


class Unavailable(Exception):
    """The call cannot be answered now (the checkpoint cannot be read); the kubelet retries it."""


class Result(StrEnum):
    """What one claim's prepare or unprepare came to, as the metrics count it: a closed set, one member per kind of
    error the driver answers a claim with (docs/observability.md lists them), never the message itself."""

    OK = "ok"
    CLAIM_NOT_FOUND = "claim-not-found"  # no such claim (404), or one of that name with another UID
    API_ERROR = "api-error"  # any other failure reading the ResourceClaim
    NOT_ALLOCATED = "not-allocated"  # no allocation yet, or an allocation result without a device or request name
    NOT_OURS = "not-ours"  # no device of this driver's pool allocated, or a device name the node does not publish
    NOT_ALLOCATABLE = "not-allocatable"  # the device is not allocatable now (its health, the claim's tolerations)
    CDI_ERROR = "cdi-error"  # the CDI spec could not be written or removed
    CHECKPOINT_ERROR = "checkpoint-error"  # the checkpoint could not be written
    # The call was refused whole, so every claim in it is counted under these: INVALID_ARGUMENT, and UNAVAILABLE
    # while the checkpoint cannot be read.
    INVALID_REQUEST = "invalid-request"
    UNAVAILABLE = "unavailable"


PREPARE = "prepare"
UNPREPARE = "unprepare"
# The results each operation can have: all of them are exported from the start, at 0 until they happen.
RESULTS: dict[str, tuple[Result, ...]] = {
    PREPARE: tuple(Result),
    UNPREPARE: (Result.OK, Result.CDI_ERROR, Result.CHECKPOINT_ERROR, Result.INVALID_REQUEST, Result.UNAVAILABLE),
}


class ResultCounts:
    """Claims by (operation, result). Its own lock, not the driver's: a scrape must never wait for a prepare that
    is reading the API server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {(op, r.value): 0 for op, results in RESULTS.items() for r in results}

    def add(self, operation: str, result: Result, n: int = 1) -> None:
        key = (operation, result.value)
        if key not in self._counts:
            raise ValueError(f"{operation} has no result {result.value!r}")  # a new error path left out of RESULTS
        with self._lock:
            self._counts[key] += n

    def counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)


class _ClaimError(Exception):
    def __init__(self, result: Result, message: str) -> None:
        super().__init__(message)
        self.result = result


def check_request(claims: Sequence[ClaimRef]) -> None:
    seen: dict[str, int] = {}
    for i, c in enumerate(claims):
        for field in ("uid", "name", "namespace"):
            if not getattr(c, field):
                raise RequestError(f"claims[{i}].{field} is empty")
        if not cdi.is_claim_uid(c.uid):
            # The UID names the CDI spec file and the checkpoint entry: nothing else may get that far.
            raise RequestError(f"claims[{i}].uid {c.uid!r} of ResourceClaim {c.namespace}/{c.name} is not a UUID")
        if c.uid in seen:
            # The answer is a map by UID: a second entry would silently overwrite the first.
            raise RequestError(f"claims[{i}].uid {c.uid!r} repeats claims[{seen[c.uid]}].uid")
        seen[c.uid] = i


def _why(status: DeviceStatus) -> str:
    top = status.reasons
    return top[0].code if top else status.state.value


def _not_allocatable(status: DeviceStatus, settings: SliceSettings) -> str:
    plan = device_plan(status, settings)
    if plan.taint is None:
        return "it is left out of the ResourceSlice (the cluster drops device taints)"
    t = plan.taint
    value = f"={t['value']}" if "value" in t else ""
    return f"the claim does not tolerate its taint {t['key']}{value}:{t['effect']}"


def _get(obj: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


class Driver:
    """``slice_settings`` gives the settings the ResourceSlice is written with now (the writer turns taints off
    when it finds the cluster drops them): Prepare judges each device by the same ``allocatable`` rule the slice is
    built from, so what the scheduler may allocate is what the driver prepares. ``allow_unhealthy`` prepares
    whatever the scheduler hands over, allocatable now or not."""

    def __init__(self, state: NodeState, claims: ClaimApi, node_name: str, cdi_dir: Path, checkpoint_dir: Path,
                 dev_dir: str, allow_unhealthy: bool = False, driver_name: str = DRIVER,
                 exists: Callable[[str], bool] = os.path.exists,
                 slice_settings: Callable[[], SliceSettings] | None = None,
                 claims_changed: Callable[[], None] = lambda: None) -> None:
        self._state = state
        # Called (under the lock, so it must not block) once the prepared claims changed: the pod-condition writer
        # looks at them again.
        self._claims_changed = claims_changed
        self._api = claims
        self.node_name = node_name
        fixed = SliceSettings(node_name=node_name, driver=driver_name)
        self._slice_settings: Callable[[], SliceSettings] = slice_settings or (lambda: fixed)
        self.pool = self._slice_settings().pool_name  # the ResourceSlice outlet's pool: one per node, named after it
        self.cdi_dir = cdi_dir
        self.dev_dir = dev_dir
        self.allow_unhealthy = allow_unhealthy
        self.driver_name = driver_name
        self._exists = exists
        self._checkpoint = Checkpoint(checkpoint_dir)
        # The kubelet may send batches in parallel; one lock keeps the checkpoint and the spec files in step.
        # The API read happens under it too: prepares are rare and short, and two of the same claim must not race.
        self._lock = threading.Lock()
        self._prepared: dict[str, PreparedClaim] = {}
        self._loaded = False
        self._results = ResultCounts()
        # A newer version (CheckpointTooNew) refuses the start from here; a read error waits for the calls.
        try:
            self._prepared = self._checkpoint.load()
            self._loaded = True
        except CheckpointUnreadable as exc:
            log.error("%s; NodePrepareResources and NodeUnprepareResources answer UNAVAILABLE until it can be read "
                      "(the file is kept)", exc)

    def prepared(self) -> dict[str, PreparedClaim]:
        with self._lock:
            return dict(self._prepared)

    # What the metrics read (plugin/outlets/metrics/sources.py: ClaimCounters) ---------------------------------------

    @property
    def prepared_claims(self) -> int:
        # Without the lock, which a prepare holds while it reads the API server: the dict is only ever replaced or
        # given one key under it, and its length is read in one step.
        return len(self._prepared)

    def result_counts(self) -> dict[tuple[str, str], int]:
        """Claims by (operation, result) since the start, every possible pair included."""
        return self._results.counts()

    def _whole(self, operation: str, claims: Sequence[ClaimRef], step: Callable[[], None]) -> None:
        """Run ``step`` (the request's check, or the checkpoint's read under the lock), counting every claim of a
        call it refuses whole."""
        try:
            step()
        except RequestError:
            self._results.add(operation, Result.INVALID_REQUEST, len(claims))
            raise
        except Unavailable:
            self._results.add(operation, Result.UNAVAILABLE, len(claims))
            raise

    def _load(self) -> None:
        """Read the checkpoint unless done; Unavailable while it cannot be. Called under the lock."""
        if self._loaded:
            return
        try:
            self._prepared = self._checkpoint.load()
        except CheckpointError as exc:  # a newer version appearing under a running plugin waits the same way
            raise Unavailable(str(exc)) from None
        self._loaded = True
        self._claims_changed()
        log.info("DRA checkpoint %s read: %d prepared claims", self._checkpoint.path, len(self._prepared))

    # Prepare ------------------------------------------------------------------------------------------------------

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """Results by claim UID. Raises ``RequestError`` for a malformed request and ``Unavailable`` while the
        checkpoint cannot be read."""
        self._whole(PREPARE, claims, lambda: check_request(claims))  # before the lock: a bad call waits for nothing
        out: dict[str, PrepareResult] = {}
        with self._lock:
            self._whole(PREPARE, claims, self._load)
            for c in claims:
                try:
                    out[c.uid] = PrepareResult(devices=self._prepare_one(c))
                    result = Result.OK
                except _ClaimError as exc:
                    log.warning("prepare of ResourceClaim %s/%s (%s) failed: %s", c.namespace, c.name, c.uid, exc)
                    out[c.uid] = PrepareResult(error=str(exc))
                    result = exc.result
                self._results.add(PREPARE, result)
        return out

    def _prepare_one(self, c: ClaimRef) -> tuple[PreparedDevice, ...]:
        done = self._prepared.get(c.uid)
        if done is not None:
            if not cdi.spec_exists(self.cdi_dir, c.uid, self.driver_name):
                self._write_spec(c.uid, done.devices)
            return done.devices
        claim = self._fetch(c)
        devices = self._allocated(c, claim)
        self._write_spec(c.uid, devices)
        record = PreparedClaim(uid=c.uid, namespace=c.namespace, name=c.name, devices=devices,
                               pod=extended_resource_pod(claim))
        try:
            self._checkpoint.save({**self._prepared, c.uid: record})
        except OSError as exc:
            # Without the record an unprepare after a restart still removes the spec (it goes by UID), but a
            # spec no answer named is garbage: take it back.
            self._remove_spec(c.uid)
            raise _ClaimError(Result.CHECKPOINT_ERROR,
                              f"cannot write the checkpoint {self._checkpoint.path}: {exc}") from None
        self._prepared[c.uid] = record
        self._claims_changed()
        log.info("prepared ResourceClaim %s/%s (%s): %s", c.namespace, c.name, c.uid,
                 ", ".join(f"{d.device} ({d.uuid})" for d in devices))
        return devices

    def _fetch(self, c: ClaimRef) -> dict[str, Any]:
        try:
            claim = self._api.get_resource_claim(c.namespace, c.name)
        except ApiFailure as exc:
            result = Result.CLAIM_NOT_FOUND if exc.status == 404 else Result.API_ERROR
            raise _ClaimError(result, f"cannot read ResourceClaim {c.namespace}/{c.name}: {exc}") from None
        got = _get(claim, "metadata.uid")
        if got != c.uid:
            raise _ClaimError(Result.CLAIM_NOT_FOUND,
                              f"ResourceClaim {c.namespace}/{c.name} has uid {got!r}, not {c.uid!r}: the claim "
                              f"the kubelet asks for is gone (deleted and created again?)")
        return claim

    def _allocated(self, c: ClaimRef, claim: dict[str, Any]) -> tuple[PreparedDevice, ...]:
        what = f"ResourceClaim {c.namespace}/{c.name}"
        if not isinstance(_get(claim, "status.allocation"), dict):
            raise _ClaimError(Result.NOT_ALLOCATED, f"{what} is not allocated")
        results = _get(claim, "status.allocation.devices.results")
        if not isinstance(results, list):
            results = []
        # One device may serve several requests of the claim; it is still one GPU, named once, in first-seen order
        # (once per share of it the claim holds, where the device is shared: the kubelet keys each by its shareID).
        requests: dict[tuple[str, str], list[str]] = {}
        # The tolerations each request had when the scheduler allocated the device (the allocation keeps a copy).
        tolerations: dict[str, list[list[dict[str, Any]]]] = {}
        for i, r in enumerate(results):
            if not isinstance(r, dict) or r.get("driver") != self.driver_name or r.get("pool") != self.pool:
                continue
            device, request, share = r.get("device"), r.get("request"), r.get("shareID") or ""
            if not isinstance(device, str) or not device or not isinstance(request, str):
                raise _ClaimError(Result.NOT_ALLOCATED,
                                  f"{what}: status.allocation.devices.results[{i}] has no device or request name")
            if not isinstance(share, str):
                raise _ClaimError(Result.NOT_ALLOCATED,
                                  f"{what}: status.allocation.devices.results[{i}].shareID is not a string")
            names = requests.setdefault((device, share), [])
            if request not in names:
                names.append(request)
            tolerated = r.get("tolerations")
            tolerations.setdefault(device, []).append(
                [t for t in tolerated if isinstance(t, dict)] if isinstance(tolerated, list) else [])
        if not requests:
            raise _ClaimError(Result.NOT_OURS,
                              f"{what} has no device of driver {self.driver_name} in pool {self.pool} allocated")
        settings = self._slice_settings()
        by_name = self._devices_by_name(settings)
        out: list[PreparedDevice] = []
        for (device, share), names in requests.items():
            found = by_name.get(device)
            if found is None:
                # Also a MIG instance destroyed since the scheduler allocated it: nothing left to hand over.
                raise _ClaimError(Result.NOT_OURS,
                                  f"{what}: device {device!r} is not a GPU or MIG instance of node {self.node_name}")
            status = found.status
            # Every request holding the device must be one the scheduler could give it to now.
            if status is not None and not self.allow_unhealthy and \
                    not all(allocatable(status, settings, t) for t in tolerations[device]):
                raise _ClaimError(Result.NOT_ALLOCATABLE,
                                  f"{what}: device {device!r} ({found.uuid}) is {status.state.value} "
                                  f"({_why(status)}); {_not_allocatable(status, settings)}; refusing to prepare it")
            out.append(PreparedDevice(request_names=tuple(names), pool=self.pool, device=device, uuid=found.uuid,
                                      minor=found.gpu.dev_minor,
                                      cdi_ids=(cdi.cdi_id(c.uid, device, self.driver_name),),
                                      parent_uuid=found.gpu.uuid if found.is_mig else "", share_id=share))
        return tuple(out)

    def _devices_by_name(self, settings: SliceSettings) -> dict[str, PublishedDevice]:
        # The devices exactly as the ResourceSlice writer publishes them, under the same MIG strategy.
        return {d.name: d for d in published_devices(self._state.snapshot().devices, settings.mig_strategy)}

    def _write_spec(self, uid: str, devices: Sequence[PreparedDevice]) -> None:
        # Two shares of one device in one claim are one device to the container: the first of each name.
        first: dict[str, PreparedDevice] = {}
        for d in devices:
            first.setdefault(d.device, d)
        gpus = [cdi.CdiGpu(device=d.device, uuid=d.uuid, minor=d.minor) for d in first.values()]
        spec = cdi.build_spec(uid, gpus, self.dev_dir, self._exists, self.driver_name)
        try:
            cdi.write_spec(self.cdi_dir, uid, spec, self.driver_name)
        except OSError as exc:
            raise _ClaimError(Result.CDI_ERROR, f"cannot write the CDI spec to {self.cdi_dir}: {exc}") from None

    def _remove_spec(self, uid: str) -> None:
        try:
            cdi.remove_spec(self.cdi_dir, uid, self.driver_name)
        except OSError as exc:
            log.error("cannot remove the CDI spec of claim %s from %s: %s", uid, self.cdi_dir, exc)

    # Unprepare ----------------------------------------------------------------------------------------------------

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """The error of each claim by UID, empty on success. Raises ``RequestError`` for a malformed request and
        ``Unavailable`` while the checkpoint cannot be read."""
        self._whole(UNPREPARE, claims, lambda: check_request(claims))  # before the lock: a bad call waits for nothing
        out: dict[str, str] = {}
        with self._lock:
            self._whole(UNPREPARE, claims, self._load)
            for c in claims:
                try:
                    self._unprepare_one(c)
                    out[c.uid], result = "", Result.OK
                except _ClaimError as exc:
                    out[c.uid], result = str(exc), exc.result
                self._results.add(UNPREPARE, result)
        return out

    def _unprepare_one(self, c: ClaimRef) -> None:
        # The spec goes by UID whether or not the checkpoint knows the claim: a crash between writing the spec
        # and the checkpoint leaves exactly that case.
        try:
            cdi.remove_spec(self.cdi_dir, c.uid, self.driver_name)
        except OSError as exc:
            raise _ClaimError(Result.CDI_ERROR, f"cannot remove the CDI spec of ResourceClaim "
                                                f"{c.namespace}/{c.name}: {exc}") from None
        if c.uid not in self._prepared:
            return
        rest = {uid: p for uid, p in self._prepared.items() if uid != c.uid}
        try:
            self._checkpoint.save(rest)
        except OSError as exc:
            raise _ClaimError(Result.CHECKPOINT_ERROR,
                              f"cannot write the checkpoint {self._checkpoint.path}: {exc}") from None
        self._prepared = rest
        self._claims_changed()
        log.info("unprepared ResourceClaim %s/%s (%s)", c.namespace, c.name, c.uid)


# gRPC ---------------------------------------------------------------------------------------------------------------

def _refs(claims: Any) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]


def _prepare(driver: Driver, pb: ModuleType, request: Any, context: grpc.ServicerContext) -> Any:
    try:
        results = driver.prepare(_refs(request.claims))
    except RequestError as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise  # abort raises; this keeps the type checker and a fake context honest
    except Unavailable as exc:
        context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        raise
    resp = pb.NodePrepareResourcesResponse()
    for uid, r in results.items():
        entry = resp.claims[uid]
        entry.error = r.error
        for d in r.devices:
            dev = entry.devices.add(request_names=list(d.request_names), pool_name=d.pool, device_name=d.device,
                                    cdi_device_ids=list(d.cdi_ids))
            if d.share_id and "share_id" in dev.DESCRIPTOR.fields_by_name:  # v1beta1 has no shares
                dev.share_id = d.share_id
    return resp


def _unprepare(driver: Driver, pb: ModuleType, request: Any, context: grpc.ServicerContext) -> Any:
    try:
        results = driver.unprepare(_refs(request.claims))
    except RequestError as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise
    except Unavailable as exc:
        context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        raise
    resp = pb.NodeUnprepareResourcesResponse()
    for uid, error in results.items():
        resp.claims[uid].error = error
    return resp


class DraPluginV1Servicer(v1_grpc.DRAPluginServicer):
    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    def NodePrepareResources(self, request: v1_pb2.NodePrepareResourcesRequest,
                             context: grpc.ServicerContext) -> v1_pb2.NodePrepareResourcesResponse:
        resp: v1_pb2.NodePrepareResourcesResponse = _prepare(self._driver, v1_pb2, request, context)
        return resp

    def NodeUnprepareResources(self, request: v1_pb2.NodeUnprepareResourcesRequest,
                               context: grpc.ServicerContext) -> v1_pb2.NodeUnprepareResourcesResponse:
        resp: v1_pb2.NodeUnprepareResourcesResponse = _unprepare(self._driver, v1_pb2, request, context)
        return resp


class DraPluginV1beta1Servicer(v1beta1_grpc.DRAPluginServicer):
    """The same driver for kubelets that speak only v1beta1 (the messages have the same fields)."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    def NodePrepareResources(self, request: v1beta1_pb2.NodePrepareResourcesRequest,
                             context: grpc.ServicerContext) -> v1beta1_pb2.NodePrepareResourcesResponse:
        resp: v1beta1_pb2.NodePrepareResourcesResponse = _prepare(self._driver, v1beta1_pb2, request, context)
        return resp

    def NodeUnprepareResources(self, request: v1beta1_pb2.NodeUnprepareResourcesRequest,
                               context: grpc.ServicerContext) -> v1beta1_pb2.NodeUnprepareResourcesResponse:
        resp: v1beta1_pb2.NodeUnprepareResourcesResponse = _unprepare(self._driver, v1beta1_pb2, request, context)
        return resp


def add_dra_services(server: grpc.Server, driver: Driver) -> None:
    """Serve both versions; the kubelet picks the newest that the registration lists (``SERVICE_NAMES``)."""
    v1_grpc.add_DRAPluginServicer_to_server(DraPluginV1Servicer(driver), server)
    v1beta1_grpc.add_DRAPluginServicer_to_server(DraPluginV1beta1Servicer(driver), server)
