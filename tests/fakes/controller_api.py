"""An in-memory API server at the fleet controller's edge: the ``ControllerApi`` calls over Node documents, Leases,
Events and Pods, with the server's rules that the controller depends on (increasing integer resourceVersions, JSON
merge patches with the ``metadata.resourceVersion`` precondition, 404 and 409 on Leases), plus the Node and device
annotations the node agent writes (docs/annotations.md), and a fake Leadership for the reconciler alone.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from plugin.kube.errors import ApiFailure
from plugin.kube.views import NodePage
from plugin.options.selectors import Requirement, parse_selector

P = "gpu-health.io"
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z
RANK = {"Healthy": 0, "Degraded": 1, "Unknown": 2, "Unhealthy": 3}
StreamItem = dict[str, Any] | Exception | Callable[[], object]


def _matches(r: Requirement, labels: Mapping[str, str]) -> bool:
    have = labels.get(r.key)
    if r.op == "exists":
        return have is not None
    if r.op == "!":
        return have is None
    if r.op in ("=", "in"):
        return have is not None and have in r.values
    return have is None or have not in r.values  # != and notin, as Kubernetes: a missing label matches


def selector_matches(requirements: Sequence[Requirement], labels: Mapping[str, str]) -> bool:
    """The API server's side of a label selector: whether a node's labels satisfy every requirement."""
    return all(_matches(r, labels) for r in requirements)


def rfc(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null removes, anything else (lists included) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def device(index: int, state: str = "Healthy", *, action: str = "none", code: str = "", since: float | None = T0,
           parent: str = "", node: str = "n") -> tuple[str, str]:
    """One device annotation, as the node agent writes it: (key, compact JSON)."""
    doc: dict[str, Any] = {"id": f"GPU-{node}-{index}"}
    if parent:
        doc["parent"] = parent
    doc["state"] = state
    doc["action"] = action
    if since is not None:
        doc["since"] = rfc(since)
    doc["reasons"] = [{"code": code, "message": code, "action": action}] if code else []
    return f"{P}/gpu.{index}", json.dumps(doc, separators=(",", ":"))


def gpu_node(name: str, devices: Mapping[int, str] | None = None, *, gpus: int = 8, allocatable: int | None = None,
             annotated: bool = True, reboot: tuple[int, ...] = (), since: float | None = T0,
             taints: list[dict[str, Any]] | None = None, labels: dict[str, str] | None = None,
             unschedulable: bool = False, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A Node with ``gpus`` GPUs. ``devices`` gives a state per GPU index (the rest Healthy); ``reboot`` the
    indices whose action is reboot-node (and state Unhealthy unless ``devices`` says otherwise)."""
    ann: dict[str, str] = {}
    if annotated:
        states = {i: "Healthy" for i in range(gpus)}
        states.update(devices or {})
        for i in reboot:
            if i not in (devices or {}):
                states[i] = "Unhealthy"
        for i, st in states.items():
            action = "reboot-node" if i in reboot else ("reset-gpu" if st == "Unhealthy" else "none")
            code = "xid-79" if i in reboot else ("ecc-uncorrected" if st == "Unhealthy" else "")
            k, v = device(i, st, action=action, code=code, since=since, node=name)
            ann[k] = v
        worst = max(states.values(), key=lambda s: RANK[s]) if states else "Unknown"
        ann[f"{P}/schema"] = "v1"
        ann[f"{P}/state"] = worst
        ann[f"{P}/summary"] = f"{worst}: {len(states)} devices ()"
    ann.update(annotations or {})
    doc: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "uid": f"uid-{name}", "labels": dict(labels or {}), "annotations": ann},
        "spec": {},
        "status": {"capacity": {"cpu": "64", "nvidia.com/gpu": str(gpus)},
                   "allocatable": {"cpu": "63", "nvidia.com/gpu": str(gpus if allocatable is None else allocatable)},
                   "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": rfc(T0)}]},
    }
    if taints:
        doc["spec"]["taints"] = [dict(t) for t in taints]
    if unschedulable:
        doc["spec"]["unschedulable"] = True
    return doc


def plain_node(name: str) -> dict[str, Any]:
    """A Node without GPUs or our annotations: never counted, never touched."""
    return {"metadata": {"name": name, "uid": f"uid-{name}"}, "spec": {},
            "status": {"capacity": {"cpu": "8"}, "allocatable": {"cpu": "8"}}}


class FakeControllerApi:
    """Safe to call from several threads at once (the controller's quarantine writers share one server): the state
    and the bookkeeping change under one lock; the hooks (``leading``, ``on_call``, ``before_patch``) run outside
    it, so that they may call back in or block."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rv = 100
        self.nodes: dict[str, dict[str, Any]] = {}
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.pods: dict[str, list[dict[str, Any]]] = {}
        self.calls: list[str] = []  # "verb target", every request in order
        self.evictions: list[tuple[float, str]] = []  # (clock, namespace/name) of each eviction accepted
        self.refuse_evictions: dict[str, int] = {}  # pod name -> how many more times a PDB says 429
        self.failures: dict[str, list[ApiFailure]] = {}  # call name -> failures to raise, first first
        self.down = False  # every call fails as when the API server cannot be reached
        self.before_patch: Callable[[str], None] | None = None  # runs before a Node patch is applied (a racer)
        # Whether the replica making the requests leads, asked at each write (a Node patch, an eviction, an Event):
        # a write made while it says no is recorded in unled_writes. on_call runs after each request is recorded
        # (what happens on the server, or to the Lease, while that request is in flight).
        self.leading: Callable[[], bool] | None = None
        self.unled_writes: list[str] = []
        self.on_call: Callable[[str], None] | None = None
        # Node name -> the failure every patch of that Node gets (a webhook that always says no, a 503 that lasts)
        self.refuse_patches: dict[str, ApiFailure] = {}
        self.clock: Callable[[], float] = lambda: 0.0
        # The watcher's side: the watch streams to hand out, one per watch call. An item is an event, a failure
        # to raise there, or a callable: something that happens on the server (or to the clock) at that point.
        self.streams: list[list[StreamItem]] = []
        self.watch_calls: list[tuple[str, str, int]] = []
        self.list_calls: list[str] = []
        self.list_page_size = 0
        self.filter_lists = False  # True: a LIST returns only the Nodes its label selector matches, as the server does
        self.idle = threading.Event()  # set when a watch found no scripted stream left and waits for close()
        self._closed = threading.Event()
        # Node patches under way (past their bookkeeping, not yet answered), and the most there ever were at once.
        # ``hold_patches``, while clear, keeps each patch waiting there: the writes a controller has in flight.
        self.hold_patches = threading.Event()
        self.hold_patches.set()
        self.patches_in_flight = 0
        self.most_patches_in_flight = 0
        self._patching = threading.Condition(self._lock)

    # Helpers for tests -------------------------------------------------------------------------------------------

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def add_node(self, doc: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            d = copy.deepcopy(doc)
            d["metadata"]["resourceVersion"] = self._next_rv()
            self.nodes[d["metadata"]["name"]] = d
            return copy.deepcopy(d)

    def node(self, name: str) -> dict[str, Any]:
        """The Node as a watch event or a GET would carry it now."""
        with self._lock:
            return copy.deepcopy(self.nodes[name])

    def edit(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """Someone else's write (the node agent, the kubelet, an operator): no precondition, a new version."""
        with self._lock:
            doc = merge_patch(self.nodes[name], dict(patch))
            doc["metadata"]["resourceVersion"] = self._next_rv()
            self.nodes[name] = doc
            return copy.deepcopy(doc)

    def heartbeat(self, name: str, t: float) -> dict[str, Any]:
        """What the kubelet changes every few seconds: a condition's heartbeat time (and so the version)."""
        with self._lock:
            doc = self.nodes[name]
            doc["status"]["conditions"] = [{"type": "Ready", "status": "True", "lastHeartbeatTime": rfc(t)}]
            doc["metadata"]["resourceVersion"] = self._next_rv()
            return copy.deepcopy(doc)

    def writes(self) -> list[str]:
        """Every request that changes something other than an Event."""
        return [c for c in self.calls if c.split()[0] in ("patch", "create", "update", "evict")
                and not c.startswith("create event")]

    def fail(self, call: str, status: int | None, message: str = "injected", times: int = 1,
             retry_after: float | None = None) -> None:
        """The next ``times`` requests of ``call`` (e.g. "patch node", "update lease", "evict pod", or one target's:
        "patch node n3") fail."""
        with self._lock:
            self.failures.setdefault(call, []).extend(ApiFailure(status, message, retry_after) for _ in range(times))

    def wait_patches_in_flight(self, n: int, timeout: float = 10.0) -> bool:
        """Wait until ``n`` Node patches are under way at once (see ``hold_patches``)."""
        with self._patching:
            return self._patching.wait_for(lambda: self.patches_in_flight >= n, timeout)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every Node as it is now, read at one instant."""
        with self._lock:
            return copy.deepcopy(self.nodes)

    def _enter(self, call: str, detail: str) -> None:
        unled = call in ("patch node", "evict pod", "create event") and self.leading is not None and not self.leading()
        with self._lock:
            self.calls.append(f"{call} {detail}")
            if unled:
                self.unled_writes.append(f"{call} {detail}")
        if self.on_call is not None:
            self.on_call(f"{call} {detail}")
        if self.down:
            raise ApiFailure(None, "ConnectionRefusedError: [Errno 111] Connection refused")
        with self._lock:
            for key in (f"{call} {detail}", call):
                queued = self.failures.get(key)
                if queued:
                    raise queued.pop(0)

    # Nodes -------------------------------------------------------------------------------------------------------

    def list_nodes(self, selector: str) -> tuple[list[dict[str, Any]], str]:
        self._enter("list nodes", "")
        self.list_calls.append(selector)
        wanted = parse_selector(selector) if self.filter_lists else ()
        with self._lock:
            return [copy.deepcopy(n) for n in self.nodes.values()
                    if selector_matches(wanted, n["metadata"].get("labels") or {})], str(self.rv)

    def list_node_pages(self, selector: str) -> Iterator[NodePage]:
        """The controller's LIST: pages of ``list_page_size`` Nodes (all in one when 0) from one snapshot, each
        request a "list nodes" call (so ``fail("list nodes", ...)`` can fail any page)."""
        self._enter("list nodes", "")
        self.list_calls.append(selector)
        wanted = parse_selector(selector) if self.filter_lists else ()
        with self._lock:
            snapshot = [copy.deepcopy(n) for n in self.nodes.values()
                        if selector_matches(wanted, n["metadata"].get("labels") or {})]
            rv = str(self.rv)
        size = self.list_page_size or max(1, len(snapshot))
        for start in range(0, max(1, len(snapshot)), size):
            if start:
                self._enter("list nodes", str(start))
            yield NodePage(snapshot[start:start + size], rv)

    def watch_nodes(self, selector: str, resource_version: str, timeout_s: int) -> Iterator[dict[str, Any]]:
        self._enter("watch nodes", resource_version)
        self.watch_calls.append((selector, resource_version, timeout_s))
        stream = self.streams.pop(0) if self.streams else None
        return self._stream(stream)

    def _stream(self, stream: list[StreamItem] | None) -> Iterator[dict[str, Any]]:
        if stream is None:
            self.idle.set()
            self._closed.wait(30.0)
            raise ApiFailure(None, "watch stream broke: closed")
        for item in stream:
            if isinstance(item, Exception):
                raise item
            if callable(item):
                item()
                continue
            yield copy.deepcopy(item)

    def get_node_doc(self, name: str) -> dict[str, Any]:
        self._enter("get node", name)
        with self._lock:
            if name not in self.nodes:
                raise ApiFailure(404, f'nodes "{name}" not found')
            return copy.deepcopy(self.nodes[name])

    def patch_node(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        self._enter("patch node", name)  # arrived (and recorded, led or not) before it waits
        with self._patching:
            self.patches_in_flight += 1
            self.most_patches_in_flight = max(self.most_patches_in_flight, self.patches_in_flight)
            self._patching.notify_all()
        try:
            self.hold_patches.wait()
            return self._patch_node(name, patch)
        finally:
            with self._patching:
                self.patches_in_flight -= 1

    def _patch_node(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        refused = self.refuse_patches.get(name)
        if refused is not None:
            raise refused
        with self._lock:
            racer, self.before_patch = self.before_patch, None
        if racer is not None:
            racer(name)
        with self._lock:
            if name not in self.nodes:
                raise ApiFailure(404, f'nodes "{name}" not found')
            current = self.nodes[name]
            want = (patch.get("metadata") or {}).get("resourceVersion")
            if want is not None and want != current["metadata"]["resourceVersion"]:
                raise ApiFailure(409, "Operation cannot be fulfilled on nodes: the object has been modified; "
                                      "please apply your changes to the latest version and try again")
            doc = merge_patch(current, dict(patch))
            doc["metadata"]["resourceVersion"] = self._next_rv()
            self.nodes[name] = doc
            return copy.deepcopy(doc)

    # Leases ------------------------------------------------------------------------------------------------------

    def get_lease(self, namespace: str, name: str) -> dict[str, Any]:
        self._enter("get lease", name)
        with self._lock:
            lease = self.leases.get((namespace, name))
            if lease is None:
                raise ApiFailure(404, f'leases.coordination.k8s.io "{name}" not found')
            return copy.deepcopy(lease)

    def create_lease(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        name = str(body["metadata"]["name"])
        self._enter("create lease", name)
        with self._lock:
            if (namespace, name) in self.leases:
                raise ApiFailure(409, f'leases.coordination.k8s.io "{name}" already exists')
            doc = copy.deepcopy(dict(body))
            doc["metadata"]["resourceVersion"] = self._next_rv()
            self.leases[(namespace, name)] = doc
            return copy.deepcopy(doc)

    def update_lease(self, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self._enter("update lease", name)
        with self._lock:
            current = self.leases.get((namespace, name))
            if current is None:
                raise ApiFailure(404, f'leases.coordination.k8s.io "{name}" not found')
            if (body.get("metadata") or {}).get("resourceVersion") != current["metadata"]["resourceVersion"]:
                raise ApiFailure(409, "Operation cannot be fulfilled on leases.coordination.k8s.io: the object "
                                      "has been modified")
            doc = copy.deepcopy(dict(body))
            doc["metadata"]["resourceVersion"] = self._next_rv()
            self.leases[(namespace, name)] = doc
            return copy.deepcopy(doc)

    def annotate_lease(self, namespace: str, name: str, key: str, value: str) -> None:
        """``kubectl annotate lease ... --overwrite``: a write of someone else's, so the version moves."""
        with self._lock:
            lease = self.leases[(namespace, name)]
            lease["metadata"].setdefault("annotations", {})[key] = value
            lease["metadata"]["resourceVersion"] = self._next_rv()

    # Events, pods, evictions -------------------------------------------------------------------------------------

    def create_event(self, namespace: str, body: Mapping[str, Any]) -> str:
        self._enter("create event", str(body.get("reason")))
        with self._lock:
            self.events.append({**copy.deepcopy(dict(body)), "namespace": namespace})
            return f"event-{len(self.events)}"

    def list_pods_on(self, node: str) -> list[dict[str, Any]]:
        self._enter("list pods", node)
        with self._lock:
            return copy.deepcopy(self.pods.get(node, []))

    def evict_pod(self, namespace: str, name: str, uid: str) -> None:
        self._enter("evict pod", f"{namespace}/{name}")
        with self._lock:
            if self.refuse_evictions.get(name, 0) > 0:
                self.refuse_evictions[name] -= 1
                raise ApiFailure(429, "Cannot evict pod as it would violate the pod's disruption budget.")
            for node, pods in self.pods.items():
                for p in pods:
                    meta = p["metadata"]
                    if meta["namespace"] == namespace and meta["name"] == name:
                        if uid and meta.get("uid") != uid:
                            raise ApiFailure(409, "Precondition failed: UID in precondition does not match")
                        self.pods[node] = [q for q in pods if q is not p]
                        self.evictions.append((self.clock(), f"{namespace}/{name}"))
                        return
            raise ApiFailure(404, f'pods "{name}" not found')

    def close(self) -> None:
        self._closed.set()


class FakeLeadership:
    """The reconciler's view of the elector: whether it leads, and the Lease's annotations."""

    def __init__(self, leader: bool = True, annotations: dict[str, str] | None = None) -> None:
        self.leader = leader
        self.lease_annotations = dict(annotations or {})
        self.set_calls: list[tuple[str, str]] = []

    def is_leader(self) -> bool:
        return self.leader

    def annotations(self) -> dict[str, str]:
        return dict(self.lease_annotations)

    def seen_annotations(self) -> dict[str, str]:
        return dict(self.lease_annotations)

    def set_annotation(self, key: str, value: str) -> None:
        self.set_calls.append((key, value))
        self.lease_annotations[key] = value


def controller_sample(rec: Any, family: str, **labels: str) -> float:
    """One sample of the controller's metrics for a reconciler alone (no watcher, an elector that leads), as a
    scrape would read it."""
    from plugin.controller.metrics import ControllerCollector

    class Watcher:
        failures = lists = events = 0

    class Elector:
        failures = 0

        def is_leader(self) -> bool:
            return True

    for f in ControllerCollector(rec, Watcher(), Elector()).collect():  # type: ignore[arg-type]
        if f.name == family:
            return float(next(s.value for s in f.samples if s.labels == labels))
    raise AssertionError(f"no {family}")
