"""Workload correlation: when a device turns bad, tell the pods that hold it, and optionally move them.

The kubelet does not connect a device's health with the containers using it, so a job on a failed GPU crash-loops
there. This outlet closes the gap. On a transition into one of the configured states (``--correlate-on``, Unhealthy
by default) it asks the kubelet's PodResources API which pods and containers hold the device, then for each pod:

- posts a Warning Event on the pod naming the device, its state and reason (always);
- merge-patches an annotation onto the pod listing its failing devices (``--annotate-pods``);
- asks the eviction API to evict it (``--remediate=evict``), so its controller reschedules it on a healthy GPU.
  Evictions honour PodDisruptionBudgets: the API server answers 429 when a budget forbids one; the pod is then
  retried with back-off for as long as its device stays bad, and never deleted around the budget.

It reads transitions from the node state in its own thread and never computes health. Every action happens at most
once per (pod, device, state); the kubelet path never waits on any of it. A pod to tell is kept until its Event (and
annotation) is written: when the API client cannot be built or a request fails, it is retried with jittered,
capped back-off for as long as the device stays in the state it was to be told about.
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc

from api.podresources.v1 import api_pb2 as pr_pb2
from api.podresources.v1 import api_pb2_grpc as pr_grpc
from plugin.backoff import Backoff
from plugin.health.node_state import DeviceStatus, NodeState, Snapshot, Transition
from plugin.kube.errors import ApiFailure
from plugin.kube.events import Involved, event_body
from plugin.kube.names import DEFAULT_PREFIX
from plugin.kube.protocols import Closeable, PodApi
from plugin.outlets.worker import OutletThread

log = logging.getLogger(__name__)

ANNOTATION = "failing-devices"  # under the configured prefix: gpu-health.io/failing-devices


# PodResources -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Holding:
    """One device held by one container, as the kubelet's PodResources API reports it."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_id: str  # the ID the device plugin advertised (a GPU UUID, a MIG UUID, a replica ID)


class PodResourcesError(Exception):
    pass


class PodLister(Protocol):
    def list(self) -> list[Holding]: ...
    def close(self) -> None: ...


class PodResourcesClient:
    """The kubelet's ``v1.PodResourcesLister`` over its unix socket. The channel is opened on first use and
    reused; gRPC reconnects by itself after a kubelet restart."""

    def __init__(self, socket_path: Path, timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._stub: pr_grpc.PodResourcesListerStub | None = None

    def list(self) -> list[Holding]:
        if self._stub is None:
            if not self.socket_path.exists():
                raise PodResourcesError(f"{self.socket_path} does not exist (is the PodResources API enabled and "
                                        "the kubelet's pod-resources directory mounted?)")
            self._channel = grpc.insecure_channel(f"unix://{self.socket_path}")
            self._stub = pr_grpc.PodResourcesListerStub(self._channel)
        try:
            resp = self._stub.List(pr_pb2.ListPodResourcesRequest(), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise PodResourcesError(f"List on {self.socket_path}: {exc.code().name}: {exc.details()}") from None
        return holdings(resp)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None


def holdings(resp: pr_pb2.ListPodResourcesResponse) -> list[Holding]:
    out: list[Holding] = []
    for pod in resp.pod_resources:
        for c in pod.containers:
            for d in c.devices:
                out.extend(Holding(pod.namespace, pod.name, c.name, d.resource_name, i) for i in d.device_ids)
    return out


# The outlet -------------------------------------------------------------------------------------------------------

class Resource(Protocol):
    """What correlation needs of a resource the plugin serves (the kubelet side's resources are these)."""

    @property
    def name(self) -> str: ...

    def backing(self, snap: Snapshot, device_id: str) -> DeviceStatus | None:
        """The node-state device behind one advertised ID; None when unknown."""
        ...


@dataclass(frozen=True)
class CorrelationSettings:
    states: frozenset[str]
    resources: tuple[Resource, ...]
    node_name: str = ""
    annotate: bool = False
    evict: bool = False
    annotation_prefix: str = DEFAULT_PREFIX
    evict_retry_initial_s: float = 5.0
    evict_retry_max_s: float = 300.0
    lookup_retry_initial_s: float = 1.0
    lookup_retry_max_s: float = 60.0
    act_retry_initial_s: float = 1.0
    act_retry_max_s: float = 60.0
    max_pending_pods: int = 4096  # pods waiting for a retry; beyond it the oldest is dropped (and logged)


@dataclass
class CorrelationStats:
    """Counters for metrics; plain ints written by the outlet's thread only."""

    lookups: int = 0
    lookup_failures: int = 0
    events_posted: int = 0
    event_failures: int = 0
    annotations: int = 0
    annotation_failures: int = 0
    evictions_evicted: int = 0
    evictions_blocked: int = 0  # 429: a PodDisruptionBudget does not allow it now
    evictions_failed: int = 0
    last_error: str = ""


@dataclass
class Affected:
    """One pod on failing devices, with what we know about each device."""

    namespace: str
    pod: str
    containers: dict[str, list[str]] = field(default_factory=dict)  # device id -> containers
    transitions: dict[str, Transition] = field(default_factory=dict)  # device id -> the transition


@dataclass
class _PodWork:
    """What is still owed to one pod: an Event for the devices not yet told, the annotation, the eviction."""

    pod: Affected
    backoff: Backoff
    uid: str | None = None  # None: not looked up yet
    annotate: bool = False
    evict: bool = False
    next_at: float = 0.0


@dataclass
class _Eviction:
    namespace: str
    pod: str
    uid: str
    devices: tuple[str, ...]
    backoff: Backoff
    next_at: float = 0.0


class Correlator(OutletThread):
    def __init__(self, state: NodeState, settings: CorrelationSettings, lister: PodLister,
                 api_factory: Callable[[], PodApi], clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, rng: random.Random | None = None) -> None:
        super().__init__(state, clock, version=-1, thread_name="correlation", label="pod correlation", log=log)
        self.settings = settings
        self.lister = lister
        self._api_factory = api_factory
        self._api: PodApi | None = None
        self._wall = wall
        self.stats = CorrelationStats()
        self._seq = state.snapshot().seq
        self._pending: dict[str, Transition] = {}  # device id -> transition not yet matched to pods
        # Lookups and evictions retry without jitter: the kubelet's socket and a PodDisruptionBudget's refusal are
        # this node's own, not a fleet's coming back at once.
        self._lookup = Backoff(settings.lookup_retry_initial_s, settings.lookup_retry_max_s, jitter=False)
        self._lookup_at = 0.0
        self._done: OrderedDict[tuple[str, str, str, str], None] = OrderedDict()  # (ns, pod, device, state)
        self._evictions: dict[tuple[str, str], _Eviction] = {}
        self._work: OrderedDict[tuple[str, str], _PodWork] = OrderedDict()  # (ns, pod) -> what it is still owed
        self._rng = rng or random.Random()
        self._logged: set[str] = set()

    def _clients(self) -> Iterable[Closeable | None]:
        return (self.lister, self._api)

    # One step ---------------------------------------------------------------------------------------------------

    def step(self, now: float) -> float:
        """Take new transitions, act on what is due; return when to be called again (sooner on a change)."""
        snap = self.state.snapshot()
        if snap.version != self._version:
            self._version = snap.version
            self._take(snap)
        self._drop_recovered(snap)
        if self._pending and now >= self._lookup_at:
            self._correlate(snap, now)
        self._retry_work(snap, now)
        self._retry_evictions(snap, now)
        deadlines = [float("inf")]
        if self._pending:
            deadlines.append(self._lookup_at)
        deadlines += [w.next_at for w in self._work.values()]
        deadlines += [e.next_at for e in self._evictions.values()]
        return min(deadlines)

    def _take(self, snap: Snapshot) -> None:
        news = self.state.transitions_since(self._seq)
        if news is None:
            # Fell behind the bounded history: act on the devices that are bad now rather than guess what we missed.
            log.warning("pod correlation fell behind the transition history; re-checking every failing device")
            news = [Transition(snap.seq, d.id, "", d.state.value, d.reasons, d.since) for d in snap.devices]
        self._seq = snap.seq
        for t in news:
            if t.from_state == t.to_state:
                continue  # a clearance that kept the state: the pods were told when the device entered it
            if t.to_state in self.settings.states:
                self._pending[t.id] = t
            else:
                self._pending.pop(t.id, None)
                # Recovered (or gone): a later failure of this device is news again for the pods on it.
                for key in [k for k in self._done if k[2] == t.id]:
                    del self._done[key]

    def _drop_recovered(self, snap: Snapshot) -> None:
        for dev in [d for d in self._pending if not self._still_bad(snap, d)]:
            del self._pending[dev]

    def _still_bad(self, snap: Snapshot, device_id: str) -> bool:
        d = snap.get(device_id)
        return d is not None and d.state.value in self.settings.states

    def _correlate(self, snap: Snapshot, now: float) -> None:
        self.stats.lookups += 1
        try:
            held = self.lister.list()
        except PodResourcesError as exc:
            self.stats.lookup_failures += 1
            delay = self._lookup.next_delay()
            self._lookup_at = now + delay
            self.stats.last_error = f"PodResources: {exc}"
            # Loud once per outage, then quiet: the back-off already paces the retries.
            (log.warning if self._lookup.failures == 1 else log.debug)(
                "pod correlation: cannot ask the kubelet which pods hold %s: %s; retrying in %.0fs",
                ", ".join(sorted(self._pending)), exc, delay)
            return
        self._lookup.reset()
        pending, self._pending = self._pending, {}
        for pod in match(held, pending, snap, self.settings.resources):
            self._act(pod, now)

    def _api_client(self) -> PodApi:
        if self._api is None:
            self._api = self._api_factory()
        return self._api

    def _act(self, pod: Affected, now: float) -> None:
        """Queue what ``pod`` is owed for these transitions (merged with anything still owed) and try it now."""
        key = (pod.namespace, pod.pod)
        work = self._work.get(key)
        if work is None:
            work = _PodWork(Affected(pod.namespace, pod.pod),
                            Backoff(self.settings.act_retry_initial_s, self.settings.act_retry_max_s, rng=self._rng))
            self._work[key] = work
            while len(self._work) > self.settings.max_pending_pods:
                (ns, name), _ = self._work.popitem(last=False)
                log.warning("pod correlation: over %d pods waiting for the API server; dropped %s/%s",
                            self.settings.max_pending_pods, ns, name)
        work.pod.transitions.update(pod.transitions)
        for d, containers in pod.containers.items():
            work.pod.containers[d] = containers
        work.annotate = work.annotate or self.settings.annotate
        work.evict = work.evict or self.settings.evict
        work.next_at = now
        self._retry_work(self.state.snapshot(), now)

    def _retry_work(self, snap: Snapshot, now: float) -> None:
        for key, work in list(self._work.items()):
            if work.next_at > now:
                continue
            if self._do(work, snap, now):
                del self._work[key]
            else:
                work.next_at = now + work.backoff.next_delay()

    def _applies(self, snap: Snapshot, device_id: str, state: str) -> bool:
        """A device is still worth telling about while it is in the state the pod was to be told about (a move to
        another bad state is a new transition, told on its own)."""
        d = snap.get(device_id)
        return d is not None and d.state.value == state

    def _do(self, work: _PodWork, snap: Snapshot, now: float) -> bool:
        """One attempt at what ``work`` owes; True when nothing is left (done, or no longer applies)."""
        pod = work.pod
        for d in [d for d, t in pod.transitions.items() if not self._applies(snap, d, t.to_state)]:
            del pod.transitions[d]
            pod.containers.pop(d, None)
        if not pod.transitions:
            return True  # recovered, or moved on to a state told by its own transition
        new = [d for d, t in pod.transitions.items()
               if (pod.namespace, pod.pod, d, t.to_state) not in self._done]
        if not new and not work.annotate and not work.evict:
            return True
        try:
            api = self._api_client()
        except ApiFailure as f:
            self.stats.event_failures += 1
            self._note_error(f"no Kubernetes client for pod correlation: {f}; retrying")
            return False
        if work.uid is None:
            try:
                work.uid = api.get_pod(pod.namespace, pod.pod).uid
            except ApiFailure as f:
                if f.status == 404:
                    return True  # gone already: nothing to tell, nothing to move
                # Without get (RBAC) the Event still goes out, only without the pod's UID.
                work.uid = ""
                self._note_error(f"cannot read pod {pod.namespace}/{pod.pod} ({f}); posting its Event without a UID")
        done = True
        if new:
            try:
                api.create_event(pod.namespace, self._event_body(pod, new, work.uid or ""))
            except ApiFailure as f:
                self.stats.event_failures += 1
                self._note_error(f"posting an Event on pod {pod.namespace}/{pod.pod}: {f}; retrying")
                done = False
            else:
                for d in new:
                    self._remember((pod.namespace, pod.pod, d, pod.transitions[d].to_state))
                self.stats.events_posted += 1
                log.warning("pod %s/%s holds failing device(s) %s: Event posted", pod.namespace, pod.pod,
                            ", ".join(new))
        if work.annotate:
            key = f"{self.settings.annotation_prefix}/{ANNOTATION}"
            value = ",".join(f"{d}={pod.transitions[d].to_state}" for d in sorted(pod.transitions))
            try:
                api.patch_pod_annotations(pod.namespace, pod.pod, {key: value})
            except ApiFailure as f:
                self.stats.annotation_failures += 1
                self._note_error(f"annotating pod {pod.namespace}/{pod.pod}: {f}; retrying")
                done = False
            else:
                self.stats.annotations += 1
                work.annotate = False
        if work.evict:
            work.evict = False  # evictions keep their own retry (PodDisruptionBudgets answer 429 for a while)
            if (pod.namespace, pod.pod) not in self._evictions:
                backoff = Backoff(self.settings.evict_retry_initial_s, self.settings.evict_retry_max_s, jitter=False)
                self._evictions[(pod.namespace, pod.pod)] = _Eviction(pod.namespace, pod.pod, work.uid or "",
                                                                      tuple(sorted(pod.transitions)), backoff,
                                                                      next_at=now)
                self._retry_evictions(snap, now)
        if done:
            work.backoff.reset()
        return done

    def _retry_evictions(self, snap: Snapshot, now: float) -> None:
        for key, ev in list(self._evictions.items()):
            if ev.next_at > now:
                continue
            if not any(self._still_bad(snap, d) for d in ev.devices):
                log.info("pod %s/%s: its devices recovered; eviction no longer needed", ev.namespace, ev.pod)
                del self._evictions[key]
                continue
            try:
                self._api_client().evict_pod(ev.namespace, ev.pod, ev.uid)
            except ApiFailure as f:
                if f.status == 404 or f.status == 409:
                    # Gone, or replaced by a new pod of the same name (the UID precondition failed): done.
                    del self._evictions[key]
                    continue
                delay = ev.backoff.next_delay(f.retry_after)
                ev.next_at = now + delay
                if f.status == 429:
                    self.stats.evictions_blocked += 1
                    log.warning("eviction of pod %s/%s refused (%s); retrying in %.0fs while its device stays bad",
                                ev.namespace, ev.pod, f.message, delay)
                else:
                    self.stats.evictions_failed += 1
                    self._note_error(f"evicting pod {ev.namespace}/{ev.pod}: {f}; retrying in {delay:.0f}s")
                continue
            self.stats.evictions_evicted += 1
            log.warning("evicted pod %s/%s from failing device(s) %s", ev.namespace, ev.pod, ", ".join(ev.devices))
            del self._evictions[key]

    def _remember(self, key: tuple[str, str, str, str]) -> None:
        self._done[key] = None
        while len(self._done) > 4096:
            self._done.popitem(last=False)

    def _note_error(self, message: str) -> None:
        self.stats.last_error = message
        log.warning("pod correlation: %s", message)

    def _event_body(self, pod: Affected, devices: Sequence[str], uid: str) -> dict[str, Any]:
        worst = pod.transitions[devices[0]]
        parts = []
        for d in devices:
            t = pod.transitions[d]
            containers = ", ".join(sorted(set(pod.containers.get(d, []))))
            part = f"device {d} (container {containers}) is {t.to_state}"
            if t.reasons:
                r = t.reasons[0]
                part += f": {r.code}: {r.message} (action: {r.action})"
            parts.append(part)
        now = self._wall()
        # A pod name may take all 253 characters an object name has; the generated Event name must fit them too.
        return event_body(Involved("Pod", pod.pod, pod.namespace, uid), pod.namespace,
                          reason=f"GPU{worst.to_state}", type_="Warning", message="; ".join(parts), count=1,
                          first=now, last=now, host=self.settings.node_name, stem=pod.pod[:200])


def match(held: Iterable[Holding], bad: Mapping[str, Transition], snap: Snapshot,
          resources: Sequence[Resource]) -> list[Affected]:
    """Pods holding any of the ``bad`` devices. An advertised ID is mapped back to the node-state device behind it
    (a replica to its GPU, a MIG device to itself); a GPU-level transition also covers the devices derived from it."""
    ours = {r.name: r for r in resources}
    pods: dict[tuple[str, str], Affected] = {}
    for h in held:
        resource = ours.get(h.resource)
        if resource is None:
            continue  # another plugin's device
        backing = resource.backing(snap, h.device_id)
        candidates = [backing.id, backing.parent_id] if backing is not None else [h.device_id]
        hit = next((c for c in candidates if c in bad), None)
        if hit is None:
            continue
        pod = pods.setdefault((h.namespace, h.pod), Affected(h.namespace, h.pod))
        pod.containers.setdefault(hit, []).append(h.container)
        pod.transitions[hit] = bad[hit]
    return sorted(pods.values(), key=lambda p: (p.namespace, p.pod))
