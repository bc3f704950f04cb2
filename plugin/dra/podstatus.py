"""Device health in the status of a pod that asked for ``nvidia.com/gpu`` with no claim (DRA mode, KEP-5004).

For such a pod the scheduler makes a ResourceClaim of its own (owned by the pod, annotated
``resource.kubernetes.io/extended-resource-claim: "true"``), and the kubelet prepares it through our driver like any
other. But the 1.37 kubelet fills ``allocatedResourcesStatus`` only for the claims a container names in
``resources.claims``, and this pod's containers name none, so its status says nothing about its GPUs. This writer
gives each such pod one condition, ``<prefix>/DevicesHealthy`` (``gpu-health.io/DevicesHealthy`` by default):

- ``status``: "True" while every device of the claim may be used (Healthy, or Degraded where ``health.kubeletHealth``
  maps Degraded to Healthy, as the DRA health stream says it); "False" once one may not (Unhealthy, Degraded mapped
  to Unhealthy); "Unknown" where none is False but one is Unknown or gone from the node;
- ``reason``: the worst state of its devices (Healthy, Degraded, Unknown, Unhealthy); ``message``: each device that
  is not Healthy with its worst reason, or the devices when all are;
- ``lastTransitionTime``: when ``status`` last changed.

The writes are strategic-merge PATCHes of ``pods/<name>/status`` touching this one condition (merge key: type), with
the pod's UID as a precondition, so a pod of the same name made again is never written. The kubelet keeps
conditions it does not own when it writes the pod's status, as it does for readiness gates.

Only on change: what was last written to each pod is kept, in memory and in a small file in the state dir, so a
restarted plugin neither rewrites every pod nor moves a ``lastTransitionTime``; an unchanged node sends nothing. A
burst coalesces (``debounce_s``), a token bucket (one round per ``min_interval_s``) bounds the rounds, failures back
off. A pod that is gone (404), or was made again under its name (the API server refuses the changed UID: 422 on
1.37, 409 where a precondition check answers first), is left alone until its claim is unprepared.

Time is passed in (``tick(now)``), so tests drive it on a virtual clock.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from plugin.atomicfile import write_atomic
from plugin.backoff import Backoff
from plugin.dra.checkpoint import PodRef, PreparedClaim
from plugin.dra.health import shorten
from plugin.dra.slices import check_mig_strategy, published_devices
from plugin.health.node_state import DeviceStatus, NodeState, Snapshot
from plugin.health.reasons import State
from plugin.kube.errors import ApiFailure
from plugin.kube.events import rfc3339
from plugin.kube.protocols import PodStatusApi
from plugin.kube.ratelimit import WriteScheduler
from plugin.kube.writer import PacedWriter, WriterStatus
from plugin.outlets.worker import OutletThread
from plugin.validation import FieldError

log = logging.getLogger(__name__)

LABEL = "pod conditions"
EXTENDED_RESOURCE_CLAIM = "resource.kubernetes.io/extended-resource-claim"
CONDITION = "DevicesHealthy"  # under the taint prefix
MESSAGE_MAX = 1024
# Answers that concern one pod, not the server: gone (404), or made again under its name, whose new UID the server
# refuses to take from our patch (422 "metadata.uid: field is immutable" on 1.37; 409 where a precondition answers).
SKIP_STATUSES = frozenset({404, 409, 422})
DEGRADED_AS = ("Healthy", "Unhealthy")
STATE_FILE = "dra-pod-conditions.json"
STATE_VERSION = 1

# A condition's status by the worst state of the claim's devices; Degraded as health.kubeletHealth says.
_STATUS = {State.HEALTHY: "True", State.UNKNOWN: "Unknown", State.UNHEALTHY: "False"}


def extended_resource_pod(claim: Mapping[str, Any]) -> PodRef | None:
    """The pod a claim was made for when the scheduler made it for the pod's extended resources; None for any
    other claim (the kubelet shows those claims' device health itself)."""
    meta = claim.get("metadata")
    if not isinstance(meta, dict):
        return None
    annotations = meta.get("annotations")
    if not isinstance(annotations, dict) or annotations.get(EXTENDED_RESOURCE_CLAIM) != "true":
        return None
    namespace = meta.get("namespace")
    owners = meta.get("ownerReferences")
    if not isinstance(namespace, str) or not isinstance(owners, list):
        return None
    for o in owners:
        if isinstance(o, dict) and o.get("kind") == "Pod" and o.get("apiVersion") == "v1" and o.get("controller") \
                and isinstance(o.get("name"), str) and isinstance(o.get("uid"), str) and o["name"] and o["uid"]:
            return PodRef(namespace, o["name"], o["uid"])
    return None


@dataclass(frozen=True, kw_only=True)
class PodConditionSettings:
    """Invalid values raise ``FieldError`` naming the field."""

    taint_prefix: str = "gpu-health.io"
    degraded_as: str = "Healthy"  # health.kubeletHealth's Degraded: what the DRA health stream says
    mig_strategy: str = "none"  # the slice's: a claim's devices are named as the slice names them

    def __post_init__(self) -> None:
        check_mig_strategy(self.mig_strategy)
        if self.degraded_as not in DEGRADED_AS:
            raise FieldError("degraded_as", f"expected one of {', '.join(DEGRADED_AS)}, got {self.degraded_as!r}")

    @property
    def condition_type(self) -> str:
        return f"{self.taint_prefix}/{CONDITION}"


@dataclass(frozen=True)
class Verdict:
    """What a pod's condition says, but its transition time."""

    status: str
    reason: str
    message: str


def _counted_state(d: DeviceStatus | None, settings: PodConditionSettings) -> State:
    if d is None:
        return State.UNKNOWN  # gone from the node, or no verdict yet
    if d.state is State.DEGRADED and settings.degraded_as == "Unhealthy":
        return State.UNHEALTHY
    return d.state


def verdict(devices: Iterable[tuple[str, DeviceStatus | None]], settings: PodConditionSettings) -> Verdict:
    """The condition for a claim's devices, each by its slice name with its status (None: not on the node now)."""
    worst = State.HEALTHY
    status_of = State.HEALTHY
    names: list[str] = []
    notes: list[str] = []
    for name, d in devices:
        names.append(name)
        state = d.state if d is not None else State.UNKNOWN
        worst = max(worst, state, key=lambda s: s.rank)
        status_of = max(status_of, _counted_state(d, settings), key=lambda s: s.rank)
        if d is None:
            notes.append(f"{name} Unknown: not on the node now")
        elif d.state is not State.HEALTHY:
            top = d.reasons
            why = f": {top[0].code}: {top[0].message}" if top else ""
            notes.append(f"{name} {d.state.value}{why}")
    message = f"{', '.join(names)} Healthy" if not notes else "; ".join(notes)
    status = _STATUS.get(status_of, "True")  # Degraded counted as usable: True
    return Verdict(status, worst.value, shorten(message, MESSAGE_MAX))


def desired_verdicts(claims: Iterable[PreparedClaim], snapshot: Snapshot,
                     settings: PodConditionSettings) -> dict[PodRef, Verdict]:
    """The condition each pod of a prepared extended-resource claim should show now."""
    by_name = {d.name: d.status for d in published_devices(snapshot.devices, settings.mig_strategy)}
    out: dict[PodRef, Verdict] = {}
    for c in claims:
        if c.pod is None:
            continue
        seen: dict[str, DeviceStatus | None] = {}
        for d in c.devices:
            seen.setdefault(d.device, by_name.get(d.device))  # a shared device is one device to the pod
        out[c.pod] = verdict(seen.items(), settings)
    return out


@dataclass(frozen=True)
class Written:
    """A pod's condition as this writer last wrote it."""

    verdict: Verdict
    transition: str  # lastTransitionTime, RFC 3339


def condition_body(settings: PodConditionSettings, w: Written) -> dict[str, str]:
    return {"type": settings.condition_type, "status": w.verdict.status, "reason": w.verdict.reason,
            "message": w.verdict.message, "lastTransitionTime": w.transition}


class WrittenStore:
    """What was written to each pod, across restarts: one small JSON file, written whole. A file that cannot be
    read or understood counts as empty (each pod is then written once more), said once."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / STATE_FILE

    def load(self) -> dict[PodRef, Written]:
        try:
            doc = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("%s: cannot read %s (%s): each pod's condition is written once more", LABEL, self.path, exc)
            return {}
        try:
            if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
                raise ValueError(f"version {doc.get('version') if isinstance(doc, dict) else None!r}")
            out: dict[PodRef, Written] = {}
            for uid, e in (doc.get("pods") or {}).items():
                v = Verdict(str(e["status"]), str(e["reason"]), str(e["message"]))
                out[PodRef(str(e["namespace"]), str(e["name"]), str(uid))] = Written(v, str(e["transition"]))
            return out
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("%s: %s is not one this plugin reads (%s): each pod's condition is written once more",
                        LABEL, self.path, exc)
            return {}

    def save(self, written: Mapping[PodRef, Written]) -> None:
        doc = {"version": STATE_VERSION, "pods": {
            p.uid: {"namespace": p.namespace, "name": p.name, "status": w.verdict.status, "reason": w.verdict.reason,
                    "message": w.verdict.message, "transition": w.transition}
            for p, w in sorted(written.items(), key=lambda kv: kv[0].uid)}}
        write_atomic(self.path, json.dumps(doc, separators=(",", ":")).encode())


@dataclass(frozen=True, kw_only=True)
class PodConditionStatus(WriterStatus):
    """For metrics. ``writes`` are pod status patches that succeeded; ``pods`` the pods the writer looks after."""

    pods: int = 0
    skipped: int = 0  # pods left alone: gone (404) or made again under their name (422, 409)
    failure_kinds: ClassVar[tuple[str, ...]] = ("client", "write", "state-file")


class PodConditionWriter(PacedWriter[PodConditionStatus, PodStatusApi], OutletThread):
    RECOVERED = "API server answering again"

    def __init__(self, state: NodeState, settings: PodConditionSettings,
                 claims: Callable[[], Mapping[str, PreparedClaim]], client_factory: Callable[[], PodStatusApi],
                 state_dir: Path, debounce_s: float = 1.0, min_interval_s: float = 10.0,
                 backoff_max_s: float = 300.0, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, *, backoff_initial_s: float = 1.0,
                 rng: random.Random | None = None) -> None:
        OutletThread.__init__(self, state, clock, version=0, thread_name="pod-conditions", label=LABEL, log=log)
        self.settings = settings
        self._claims_of = claims
        self._backoff = Backoff(backoff_initial_s, backoff_max_s, rng=rng or random.Random())
        PacedWriter.__init__(self, PodConditionStatus(),
                             WriteScheduler(debounce_s, min_interval_s, self._backoff, clock()), client_factory,
                             wall, label=LABEL, log=log)
        self._store = WrittenStore(state_dir)
        self._written = self._store.load()
        self._claims: list[PreparedClaim] = []
        self._desired: dict[PodRef, Verdict] = {}
        self._skip: set[PodRef] = set()
        self._claims_dirty = threading.Event()
        self._claims_dirty.set()
        self._save_failed_logged = False

    def claims_changed(self) -> None:
        """The driver prepared or unprepared a claim (from any thread, without blocking)."""
        self._claims_dirty.set()
        self.state.poke()

    def _woken(self) -> bool:
        return self._claims_dirty.is_set()

    def pending(self) -> dict[PodRef, Verdict]:
        """The pods whose condition differs from what was last written to them."""
        return {p: v for p, v in self._desired.items() if p not in self._skip and self._differs(p, v)}

    def _differs(self, pod: PodRef, v: Verdict) -> bool:
        w = self._written.get(pod)
        return w is None or w.verdict != v

    def tick(self, now: float) -> float:
        if self._claims_dirty.is_set():
            self._claims_dirty.clear()
            self._claims = list(self._claims_of().values())
            self._version = -1  # recompute below
        snap = self.state.snapshot()
        if snap.version == 0:
            return math.inf  # no verdict yet: a condition now would say Unknown for every device
        if snap.version != self._version:
            self._version = snap.version
            self._desired = desired_verdicts(self._claims, snap, self.settings)
            self._forget_gone()
        pending = self.pending()
        self._update(pods=len(self._desired))
        if not pending:
            self._sched.settled()
            return math.inf
        self._sched.changed(now)
        retry_at = self._connect(now)
        if retry_at is not None:
            return retry_at
        if self._sched.try_start(now):
            self._write(now, pending)
        return self._sched.due_at(now)

    def _forget_gone(self) -> None:
        # A pod whose claim is unprepared is gone or going: what was written to it is no longer ours to keep.
        gone = [p for p in self._written if p not in self._desired]
        self._skip &= set(self._desired)
        if gone:
            for p in gone:
                del self._written[p]
            self._save()

    def _write(self, now: float, pending: Mapping[PodRef, Verdict]) -> None:
        assert self._api is not None
        writes = 0
        try:
            for pod, v in sorted(pending.items(), key=lambda kv: (kv[0].namespace, kv[0].name)):
                before = self._written.get(pod)
                transition = before.transition if before is not None and before.verdict.status == v.status \
                    else rfc3339(self._wall())
                w = Written(v, transition)
                try:
                    self._api.patch_pod_status_condition(pod.namespace, pod.name, pod.uid,
                                                         condition_body(self.settings, w))
                except ApiFailure as f:
                    if f.status not in SKIP_STATUSES:
                        raise
                    # Gone, or another pod of that name: nothing to tell; its claim is unprepared soon. A refusal of
                    # this one pod must not hold back the others, nor be asked again and again.
                    self._skip.add(pod)
                    self._update(skipped=self.status().skipped + 1)
                    log.info("%s: pod %s/%s (%s) left alone: %s", LABEL, pod.namespace, pod.name, pod.uid, f)
                    continue
                writes += 1
                self._written[pod] = w
                if before is None or before.verdict.status != v.status:
                    log.info("%s: pod %s/%s %s=%s (%s: %s)", LABEL, pod.namespace, pod.name,
                             self.settings.condition_type, v.status, v.reason, v.message)
        except ApiFailure as f:
            self._failed("writing a pod's status", f, self._sched.failed(now, f.retry_after), "write")
            return
        finally:
            if writes:
                self._update(writes=self.status().writes + writes)
                self._save()
        self._sched.succeeded()
        self._recovered()

    def _save(self) -> None:
        try:
            self._store.save(self._written)
        except OSError as exc:
            # Only a restart pays for it: each pod's condition is written once more then.
            s = self.status()
            self._update(failures_by_kind={**s.failures_by_kind,
                                           "state-file": s.failures_by_kind.get("state-file", 0) + 1})
            if not self._save_failed_logged:
                log.warning("%s: cannot write %s (%s); a restart writes each pod's condition once more", LABEL,
                            self._store.path, exc)
                self._save_failed_logged = True
