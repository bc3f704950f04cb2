#!/usr/bin/env python3
"""A fleet of simulated GPU Nodes on a real kube-apiserver, for the fleet controller's benchmarks (issue 15).

The API server and etcd are the conformance peer's (tests/conformance/apiserver); the Nodes are plain objects that
look like GPU nodes running our plugin (GPU labels, ``nvidia.com/gpu: 8``, the plugin's annotations, schema v1,
rendered by the plugin's own code). With ``realistic=True`` they also carry what a real GPU node's object carries and
a controller has to read past: 50 container images with digests, the kubelet's five conditions with their messages,
feature-discovery labels, addresses and node info, and managedFields of two managers (created as the kubelet, the
annotations then written as the plugin): about 17 KB each as the server serves them. kwok (``sigs.k8s.io/kwok``,
built from its Go module in bench/go/kwok) keeps their heartbeats like kubelets: each node's Lease in
``kube-node-lease`` renewed every 10 s (leaseDuration 40 s, the kubelet's), and its status written every 5 minutes,
each node at its own phase (the kubelet's nodeStatusReportFrequency). Every client gets its own service account, so
the audit log tells one client's requests from another's.

    with Fleet(5000, Path(tempfile.mkdtemp())) as fleet:
        kubeconfig = fleet.kubeconfig_for("controller")         # its own user in the audit log
        since = time.time()
        sent = fleet.set_device_state("gpu-node-00042", 3, "Unhealthy", "reboot-node", "xid-79")  # monotonic
        fleet.request_counts(since=since, by="user")            # requests per user (or user agent) since then

Run alone, it starts a fleet, prints the phase timings and the CPU of etcd, kube-apiserver and kwok while
idle, and stops:

    python bench/_fleet.py --nodes 5000 --idle 60
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import random
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._common import cpu_seconds, machine, rss_mib  # noqa: E402
from plugin.devices.model import Gpu  # noqa: E402
from plugin.health.node_state import DeviceStatus, Snapshot, Transition  # noqa: E402
from plugin.health.reasons import Action, KubeletHealth, Reason, Source, State  # noqa: E402
from plugin.kube.events import rfc3339  # noqa: E402
from plugin.kube.names import COMPONENT, DEFAULT_PREFIX  # noqa: E402
from plugin.schema.annotations import desired_annotations, merge_patch  # noqa: E402
from scripts import gobuild  # noqa: E402
from tests.conformance.apiserver import _binaries  # noqa: E402
from tests.conformance.apiserver.apiserver_peer import ApiServerPeer  # noqa: E402

KWOK_VERSION = "v0.8.0"
KWOK_MODULE = REPO / "bench" / "go" / "kwok"
KWOK_PACKAGE = "sigs.k8s.io/kwok/cmd/kwok"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"

NAMESPACE = "fleet-bench"  # where the service accounts of the fleet's clients live
KWOK_ACCOUNT = "kwok"
NODE_LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40  # the kubelet's default; kwok renews at a quarter of it, as the kubelet does
# Node status: the kubelet reports it every 5 minutes when nothing changed (nodeStatusReportFrequency), each node at
# its own phase. Each Node is created with a Ready heartbeat a random part of the period ago, and kwok's heartbeat
# stage fires one period after the last heartbeat, so the fleet writes statuses evenly from the start.
STATUS_PERIOD_S = 300
GPUS_PER_NODE = 8
CREATE_WORKERS = 16
BASE_TIME = 1_767_225_600.0  # 2026-01-01T00:00:00Z: the devices' `since` when the fleet is created

NODE_LABELS = {
    "kubernetes.io/os": "linux",
    "kubernetes.io/arch": "amd64",
    "node.kubernetes.io/instance-type": "p5.48xlarge",
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.count": str(GPUS_PER_NODE),
    "nvidia.com/gpu.memory": "81559",
    "nvidia.com/gpu.family": "hopper",
    "nvidia.com/cuda.driver.major": "580",
    "nvidia.com/mig.capable": "true",
    "type": "kwok",
}


def build_kwok() -> Path:
    """The kwok controller binary, built once per version and source state (scripts/gobuild.py's cache)."""
    return gobuild.build(KWOK_MODULE, KWOK_PACKAGE, "kwok", {"CGO_ENABLED": "0"}, version=KWOK_VERSION,
                         ldflags="-s -w")


@dataclass(frozen=True)
class AuditedRequest:
    """One API request as the audit log saw it (counted once, even for a watch that logs two stages)."""

    time: float  # wall clock, when the server received it
    user: str
    user_agent: str
    verb: str
    resource: str
    subresource: str
    namespace: str
    name: str
    code: int | None
    completed: float = 0.0  # wall clock, when the server had answered it (the audit entry's stage time)


@dataclass
class _Device:
    state: State = State.HEALTHY
    reasons: tuple[Reason, ...] = ()
    since: float = BASE_TIME
    last: Transition | None = None


@dataclass
class Fleet:
    """``n_nodes`` GPU Nodes named ``<node_prefix><index, 5 digits>`` on a fresh kube-apiserver; see the module
    docstring. Use as a context manager (or call :meth:`start` and :meth:`stop`)."""

    n_nodes: int
    workdir: Path
    kwok: bool = True  # False: Node objects only, no heartbeats
    # The kubelet's 40 s (renewed every 10 s): 500 Lease writes/s at 5,000 nodes, most of an idle fleet's CPU. A
    # larger value lightens the load on a small machine; nothing that watches Nodes sees a difference.
    lease_duration_s: int = LEASE_DURATION_S
    status_period_s: int = STATUS_PERIOD_S
    seed: int = 1
    node_prefix: str = "gpu-node-"
    prefix: str = DEFAULT_PREFIX
    extra_apiserver_args: Sequence[str] = ()
    extra_etcd_args: Sequence[str] = ()
    realistic: bool = False  # True: Node objects the size of real GPU nodes' (see the module docstring)
    verbose: bool = True
    timings: dict[str, float] = field(default_factory=dict)
    peer: ApiServerPeer | None = None
    _kwok_proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _devices: dict[str, list[_Device]] = field(default_factory=dict, repr=False)
    _local: threading.local = field(default_factory=threading.local, repr=False)
    _model_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _audit_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _audit_offset: int = 0
    _audit_seen: set[str] = field(default_factory=set, repr=False)
    _audit: list[AuditedRequest] = field(default_factory=list, repr=False)
    _seq: int = 0

    # Lifecycle ------------------------------------------------------------------------------------------------

    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        t = time.monotonic()
        binaries = _binaries.build_all()
        kwok_bin = build_kwok() if self.kwok else None
        self._phase("binaries (built or from the cache)", t)

        t = time.monotonic()
        policy = self.workdir / "audit-policy.json"
        policy.write_text(json.dumps(_audit_policy(f"system:serviceaccount:{NAMESPACE}:{KWOK_ACCOUNT}")))
        peer_dir = self.workdir / "apiserver"
        shutil.rmtree(peer_dir, ignore_errors=True)  # an earlier run's etcd data would bring its nodes back
        self.peer = ApiServerPeer.start(
            binaries, workdir=peer_dir,
            extra_apiserver_args=[
                # Later flags win: ours replaces the peer's audit policy (node writes only) with one that logs
                # every request but kwok's heartbeats, so any client's requests can be counted.
                f"--audit-policy-file={policy}",
                "--max-requests-inflight=800",
                "--max-mutating-requests-inflight=400",
                *self.extra_apiserver_args,
            ],
            extra_etcd_args=self.extra_etcd_args)
        self._phase("etcd + kube-apiserver ready", t)

        t = time.monotonic()
        self._ensure("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        self._ensure("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                            "metadata": {"name": NODE_LEASE_NAMESPACE}})
        kwok_kubeconfig = self.kubeconfig_for(KWOK_ACCOUNT) if self.kwok else None
        self._phase("namespaces and accounts", t)

        t = time.monotonic()
        names = [f"{self.node_prefix}{i:05d}" for i in range(self.n_nodes)]
        with ThreadPoolExecutor(CREATE_WORKERS) as pool:
            for _ in pool.map(self._create_node, names):
                pass
        self._phase(f"{self.n_nodes} Nodes created ({CREATE_WORKERS} in parallel)", t, rate=self.n_nodes)

        if kwok_bin is not None and kwok_kubeconfig is not None:
            t = time.monotonic()
            self._start_kwok(kwok_bin, kwok_kubeconfig)
            self.wait_for_leases(self.n_nodes)
            self._phase(f"kwok started, {self.n_nodes} node Leases held", t)

    def stop(self) -> None:
        proc, self._kwok_proc = self._kwok_proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        if self.peer is not None:
            self.peer.stop()
            self.peer = None

    # What callers use -----------------------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (system:masters)."""
        return self._peer().kubeconfig

    @property
    def node_names(self) -> list[str]:
        return list(self._devices)

    def kubeconfig_for(self, name: str, cluster_role: str = "cluster-admin") -> Path:
        """A kubeconfig for service account ``fleet-bench/<name>`` (created, bound to ``cluster_role``), so the
        audit log names this client ``system:serviceaccount:fleet-bench:<name>`` (:meth:`user_of`)."""
        peer = self._peer()
        self._ensure(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts",
                     {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}})
        self._ensure("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": f"{NAMESPACE}-{name}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}],
        })
        token = peer.token_for_service_account(NAMESPACE, name, expiration_seconds=7 * 86400)
        return peer.kubeconfig_for_token(token, name)

    @staticmethod
    def user_of(name: str) -> str:
        return f"system:serviceaccount:{NAMESPACE}:{name}"

    def set_device_state(self, node: str, index: int, state: str, action: str = "none", code: str = "",
                         message: str = "") -> float:
        """Change device ``index`` of ``node`` the way the plugin would: one JSON merge patch of the node's
        annotations with that device's entry, ``state`` and ``summary`` (the keys that changed), rendered by the
        plugin's own functions. A non-Healthy state needs a reason ``code``; Healthy clears the reasons.
        Returns ``time.monotonic()`` just before the request was sent."""
        patch = self.change_device(node, index, state, action, code, message)
        sent = time.monotonic()
        self._call("PATCH", f"/api/v1/nodes/{node}", {"metadata": {"annotations": patch}},
                   "application/merge-patch+json")
        return sent

    def report_status(self, node: str) -> None:
        """What a kubelet's periodic status report does to a Node (nodeStatusReportFrequency, 5 minutes): every
        condition's heartbeat time moved, nothing else; one strategic merge patch of ``nodes/status``, which every
        watcher of Nodes receives as the whole Node modified."""
        now = datetime.now().astimezone().isoformat(timespec="seconds")
        conditions = [{"type": t, "lastHeartbeatTime": now}
                      for t in ("MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable", "Ready")]
        self._call("PATCH", f"/api/v1/nodes/{node}/status", {"status": {"conditions": conditions}},
                   "application/strategic-merge-patch+json", manager="kubelet")

    def change_device(self, node: str, index: int, state: str, action: str = "none", code: str = "",
                      message: str = "") -> dict[str, Any]:
        """:meth:`set_device_state` in the fleet's model only (no request): returns the merge patch of the node's
        annotations it would send."""
        st = State(state)
        devices = self._devices[node]
        if not 0 <= index < len(devices):
            raise ValueError(f"{node} has devices 0..{len(devices) - 1}, not {index}")
        if st is not State.HEALTHY and not code:
            raise ValueError(f"a {st.value} device needs a reason code")
        now = float(int(time.time()))
        reasons = () if st is State.HEALTHY else (
            Reason(code, st, message or f"{code} (fleet benchmark)", Source.POLL, Action(action), now),)
        with self._model_lock:
            before = self._annotations(node)
            dev = devices[index]
            if st is not dev.state:
                self._seq += 1
                dev.last = Transition(self._seq, _device_id(node, index), dev.state.value, st.value, reasons, now)
                dev.since = now
            dev.state, dev.reasons = st, reasons
            return merge_patch(before, self._annotations(node), self.prefix)

    def node_object(self, name: str) -> dict[str, Any]:
        """Node ``name`` as the fleet writes it, its plugin annotations in place (the fields the API server adds,
        uid, resourceVersion and managedFields, aside). Needs no API server: in-process benchmarks build the same
        Nodes as the fleet. Its device model is kept until :meth:`forget_node`."""
        if name not in self._devices:
            self._devices[name] = [_Device() for _ in range(GPUS_PER_NODE)]
        body, plugin = self._bodies(name)
        if plugin is not None:
            body["metadata"]["annotations"].update(plugin)
        return body

    def forget_node(self, name: str) -> None:
        self._devices.pop(name, None)

    def set_device_states(self, changes: Sequence[tuple[str, int, str, str, str]],
                          workers: int = CREATE_WORKERS) -> list[float]:
        """Many :meth:`set_device_state` calls at once, ``workers`` in parallel (a correlated failure across the
        fleet): each change is ``(node, index, state, action, code)``. Returns each one's send time, in order."""
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(lambda c: self.set_device_state(*c), changes))

    def get_node(self, node: str) -> dict[str, Any]:
        return self._call("GET", f"/api/v1/nodes/{node}")

    def list_nodes(self, query: str = "") -> dict[str, Any]:
        """GET /api/v1/nodes with ``query`` (e.g. ``fieldSelector=metadata.name%3Dgpu-node-00001``); the list's
        ``metadata.resourceVersion`` is where a watch of what happens next starts."""
        return self._call("GET", f"/api/v1/nodes{'?' + query if query else ''}")

    def requests(self, since: float | None = None, until: float | None = None,
                 start: int = 0) -> list[AuditedRequest]:
        """Every request the audit log holds (all but kwok's), oldest first; ``since``/``until`` are wall-clock
        seconds (``time.time()``) and bound the time the server received it; ``start``, a :meth:`audit_mark`, skips
        what the log held then (a poll in a loop then costs what was written since, not the whole log)."""
        self._read_audit()
        return [r for r in self._audit[start:]
                if (since is None or r.time >= since) and (until is None or r.time < until)]

    def audit_mark(self) -> int:
        """Where the audit log ends now, for :meth:`requests`' ``start``: entries are kept in the order the server
        completed them, so a request received after this call is never before the mark."""
        self._read_audit()
        return len(self._audit)

    def request_counts(self, since: float | None = None, until: float | None = None,
                       by: str = "user") -> Counter[str]:
        """Requests per ``user`` (a client of :meth:`kubeconfig_for` is ``user_of(name)``), ``user_agent``,
        ``verb`` or ``resource`` in [since, until) (wall clock)."""
        if by not in ("user", "user_agent", "verb", "resource"):
            raise ValueError(f"by: one of user, user_agent, verb, resource, not {by!r}")
        return Counter(str(getattr(r, by)) for r in self.requests(since, until))

    def pids(self) -> dict[str, int]:
        """Process ids of etcd, kube-apiserver and (when running) kwok."""
        peer = self._peer()
        out = {str(getattr(p, "name", "?")): p.pid for p in peer._procs}  # the peer keeps them, named
        if self._kwok_proc is not None:
            out["kwok"] = self._kwok_proc.pid
        return out

    def measure_idle(self, seconds: float) -> dict[str, dict[str, float]]:
        """CPU (cores) and RSS of each of the fleet's processes over ``seconds`` of whatever runs now."""
        pids = self.pids()
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        load_before = os.getloadavg()[0]
        time.sleep(seconds)
        out = {name: {"cpu_cores": round((cpu_seconds(pid) - before[name]) / seconds, 3),
                      "rss_mib": round(rss_mib(pid), 1)} for name, pid in pids.items()}
        out["machine"] = {"loadavg_1m_before": round(load_before, 2), "loadavg_1m_after": os.getloadavg()[0]}
        return out

    def wait_for_leases(self, count: int, timeout: float = 600.0) -> None:
        """Until ``count`` node Leases exist (kwok creates one per node it manages)."""
        deadline = time.monotonic() + timeout
        while True:
            held = self.lease_count()
            if held >= count:
                return
            if self._kwok_proc is not None and self._kwok_proc.poll() is not None:
                raise RuntimeError(f"kwok exited with code {self._kwok_proc.returncode}; log: "
                                   f"{self.workdir / 'kwok.log'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{held} of {count} node Leases after {timeout:.0f}s")
            time.sleep(1.0)

    def lease_count(self) -> int:
        # resourceVersion=0: served from the watch cache, without a read from etcd.
        doc = self._call("GET", f"/apis/coordination.k8s.io/v1/namespaces/{NODE_LEASE_NAMESPACE}/leases"
                                "?resourceVersion=0")
        return len(doc.get("items") or [])

    # Internals ------------------------------------------------------------------------------------------------

    def _peer(self) -> ApiServerPeer:
        if self.peer is None:
            raise RuntimeError("the fleet is not started")
        return self.peer

    def _phase(self, what: str, started: float, rate: int = 0) -> None:
        elapsed = time.monotonic() - started
        self.timings[what] = round(elapsed, 2)
        if self.verbose:
            extra = f" ({rate / elapsed:.0f}/s)" if rate and elapsed > 0 else ""
            print(f"fleet: {what}: {elapsed:.1f}s{extra}", file=sys.stderr, flush=True)

    def _annotations(self, node: str) -> dict[str, str]:
        devs = self._devices[node]
        statuses = tuple(
            DeviceStatus(_device_id(node, i), Gpu(_device_id(node, i), i, "NVIDIA H100 80GB HBM3"), d.state,
                         d.reasons, d.since,
                         KubeletHealth.HEALTHY if d.state is State.HEALTHY else KubeletHealth.UNHEALTHY)
            for i, d in enumerate(devs))
        snapshot = Snapshot(1, self._seq, statuses, None, {s.id: s for s in statuses})
        last = {_device_id(node, i): d.last for i, d in enumerate(devs) if d.last is not None}
        return desired_annotations(snapshot, last, self.prefix).annotations

    def _node_body(self, name: str, heartbeat_ago_s: float) -> dict[str, Any]:
        now = rfc3339(time.time())
        heartbeat = rfc3339(time.time() - heartbeat_ago_s)
        resources = {"cpu": "192", "memory": "2063731Mi", "pods": "110", "ephemeral-storage": "7154497Mi",
                     "nvidia.com/gpu": str(GPUS_PER_NODE)}
        return {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {"kubernetes.io/hostname": name, **NODE_LABELS},
                "annotations": {KWOK_ANNOTATION: "fake", **self._annotations(name)},
            },
            "status": {
                "capacity": resources, "allocatable": resources, "phase": "Running",
                "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux", "kubeletVersion": "v1.37.2",
                             "containerRuntimeVersion": "containerd://2.1.4", "kernelVersion": "6.8.0",
                             "osImage": "Ubuntu 24.04 LTS", "bootID": "", "machineID": "", "systemUUID": "",
                             "kubeProxyVersion": ""},
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                "message": "kubelet is posting ready status", "lastHeartbeatTime": heartbeat,
                                "lastTransitionTime": now}],
            },
        }

    def _bodies(self, name: str) -> tuple[dict[str, Any], dict[str, str] | None]:
        """The Node's body, and for a realistic one the plugin's annotations apart (written by another manager)."""
        rng = random.Random(f"{self.seed}/{name}")
        phase = rng.uniform(0, self.status_period_s)
        if not self.realistic:
            return self._node_body(name, phase), None
        body = realistic_node(name, self._node_body(name, phase), rng)
        return body, body["metadata"].pop("plugin-annotations")

    def _create_node(self, name: str) -> None:
        self._devices[name] = [_Device() for _ in range(GPUS_PER_NODE)]
        body, annotations = self._bodies(name)
        if annotations is None:
            self._ensure("/api/v1/nodes", body)
            return
        # Two writers, as on a real node: the kubelet registers the Node, the plugin then annotates it; each
        # becomes an entry of managedFields.
        self._ensure("/api/v1/nodes", body, manager="kubelet")
        self._call("PATCH", f"/api/v1/nodes/{name}", {"metadata": {"annotations": annotations}},
                   "application/merge-patch+json")

    def _ensure(self, collection: str, body: Mapping[str, Any], manager: str = COMPONENT) -> None:
        try:
            self._call("POST", collection, body, manager=manager)
        except _HttpError as exc:
            if exc.status != 409:
                raise

    def _call(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
              manager: str = COMPONENT) -> dict[str, Any]:
        """One request as admin on this thread's kept-alive connection. Every request the fleet makes may be sent
        twice (a create answers 409 then, which :meth:`_ensure` accepts), so one whose kept-alive connection the
        server had closed while idle is sent again on a fresh one."""
        peer = self._peer()
        headers = {"Authorization": f"Bearer {peer.admin_token}", "Accept": "application/json",
                   "User-Agent": COMPONENT}
        payload = None
        if body is not None:
            payload = json.dumps(body, separators=(",", ":")).encode()
            headers["Content-Type"] = content_type
        url = path if method == "GET" else f"{path}{'&' if '?' in path else '?'}fieldManager={manager}"
        for attempt in (1, 2):
            conn: http.client.HTTPSConnection | None = getattr(self._local, "conn", None)
            reused = conn is not None
            if conn is None:
                host, port = peer.url.removeprefix("https://").rsplit(":", 1)
                tls = ssl.create_default_context(cafile=str(peer.ca_file))
                conn = http.client.HTTPSConnection(host, int(port), context=tls, timeout=60)
                self._local.conn = conn
            try:
                conn.request(method, url, body=payload, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (OSError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if not reused or attempt == 2:
                    raise
        if not 200 <= resp.status < 300:
            raise _HttpError(resp.status, f"{method} {path}: HTTP {resp.status} {data[:300]!r}")
        doc = json.loads(data) if data else {}
        return doc if isinstance(doc, dict) else {}

    def _start_kwok(self, binary: Path, kubeconfig: Path) -> None:
        config = self.workdir / "kwok.yaml"
        # JSON documents are YAML documents: one KwokConfiguration and the two node Stages.
        docs = _kwok_config(self.lease_duration_s, self.status_period_s)
        config.write_text("\n---\n".join(json.dumps(doc) for doc in docs) + "\n")
        argv = [str(binary), f"--config={config}", f"--kubeconfig={kubeconfig}",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                f"--node-lease-duration-seconds={self.lease_duration_s}",
                f"--server-address=127.0.0.1:{_free_port()}", "--node-ip=10.0.0.1"]
        with open(self.workdir / "kwok.log", "wb") as log:
            self._kwok_proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               start_new_session=True)

    def _read_audit(self) -> None:
        path = self._peer().workdir / "audit.log"
        with self._audit_lock:
            try:
                with open(path, "rb") as f:
                    f.seek(self._audit_offset)
                    chunk = f.read()
            except FileNotFoundError:
                return
            end = chunk.rfind(b"\n") + 1  # a line being written now waits for the next read
            self._audit_offset += end
            for line in chunk[:end].splitlines():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                audit_id = e.get("auditID", "")
                if audit_id in self._audit_seen:
                    continue
                self._audit_seen.add(audit_id)
                ref = e.get("objectRef") or {}
                self._audit.append(AuditedRequest(
                    time=_parse_time(e.get("requestReceivedTimestamp", "")),
                    user=(e.get("user") or {}).get("username", ""), user_agent=e.get("userAgent", ""),
                    verb=e.get("verb", ""), resource=ref.get("resource", e.get("requestURI", "")),
                    subresource=ref.get("subresource", ""), namespace=ref.get("namespace", ""),
                    name=ref.get("name", ""), code=(e.get("responseStatus") or {}).get("code"),
                    completed=_parse_time(e.get("stageTimestamp", ""))))


# What a GPU node's object carries besides what the controller reads. Image names are made up but shaped like a
# GPU node's: CUDA, framework and inference images, each known by a digest and one or two tags, as the kubelet lists
# them (at most 50, its nodeStatusMaxImages).
_IMAGE_REPOS = tuple(f"registry.example.com/{path}" for path in (
    "nvidia/pytorch", "nvidia/tritonserver", "nvidia/cuda", "nvidia/nemo", "nvidia/k8s-device-plugin",
    "nvidia/gpu-operator", "nvidia/dcgm-exporter", "ml-platform/training-runtime", "ml-platform/inference",
    "infra/node-problem-detector", "kubernetes/kube-proxy", "kubernetes/pause", "calico/node", "calico/cni",
    "prometheus/node-exporter"))
_FEATURE_LABELS = {
    "feature.node.kubernetes.io/cpu-cpuid.AVX512F": "true", "feature.node.kubernetes.io/cpu-cpuid.AVX512BW": "true",
    "feature.node.kubernetes.io/cpu-cpuid.AMXTILE": "true",
    "feature.node.kubernetes.io/cpu-hardware_multithreading": "true",
    "feature.node.kubernetes.io/cpu-model.vendor_id": "Intel",
    "feature.node.kubernetes.io/kernel-version.major": "6", "feature.node.kubernetes.io/kernel-version.minor": "8",
    "feature.node.kubernetes.io/pci-10de.present": "true",
    "feature.node.kubernetes.io/pci-15b3.present": "true", "feature.node.kubernetes.io/rdma.available": "true",
    "feature.node.kubernetes.io/system-os_release.ID": "ubuntu",
    "feature.node.kubernetes.io/system-os_release.VERSION_ID": "24.04",
    "nvidia.com/cuda.runtime.major": "12", "nvidia.com/cuda.runtime.minor": "9", "nvidia.com/gpu.compute.major": "9",
    "nvidia.com/gpu.compute.minor": "0", "nvidia.com/gpu.deploy.device-plugin": "true",
    "nvidia.com/gpu.deploy.dcgm-exporter": "true", "nvidia.com/gpu.machine": "p5.48xlarge",
    "nvidia.com/gpu.replicas": "1", "nvidia.com/mig.strategy": "single", "nvidia.com/gfd.timestamp": "1767225600",
    "topology.kubernetes.io/region": "us-east-2", "beta.kubernetes.io/arch": "amd64", "beta.kubernetes.io/os": "linux",
    "beta.kubernetes.io/instance-type": "p5.48xlarge", "node.kubernetes.io/lifecycle": "normal",
}
_CONDITION_MESSAGES = (
    ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
    ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
    ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
    ("NetworkUnavailable", "False", "CalicoIsUp", "Calico is running on this node"),
)


def realistic_node(name: str, bare: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """``bare`` (a :meth:`Fleet._node_body`) grown to a real GPU node's object; its plugin annotations moved to
    ``metadata["plugin-annotations"]`` for the caller to write as the plugin."""
    doc = json.loads(json.dumps(bare))
    meta, status = doc["metadata"], doc["status"]
    index = int(name.rsplit("-", 1)[-1]) if name.rsplit("-", 1)[-1].isdigit() else 0
    ip = f"10.{index // 65536 % 256}.{index // 256 % 256}.{index % 256}"
    meta["labels"].update(_FEATURE_LABELS)
    meta["labels"]["topology.kubernetes.io/zone"] = f"us-east-2{'abc'[index % 3]}"
    meta["labels"]["nvidia.com/gpu-driver-upgrade-state"] = "upgrade-done"
    plugin = {k: v for k, v in meta["annotations"].items() if k != KWOK_ANNOTATION}
    meta["annotations"] = {
        KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0",
        "volumes.kubernetes.io/controller-managed-attach-detach": "true",
        "csi.volume.kubernetes.io/nodeid": json.dumps({"ebs.csi.aws.com": f"i-{rng.getrandbits(64):016x}",
                                                       "efs.csi.aws.com": f"i-{rng.getrandbits(64):016x}"}),
        "nfd.node.kubernetes.io/feature-labels": ",".join(sorted(k.split("/", 1)[1] for k in _FEATURE_LABELS
                                                                 if k.startswith("feature."))),
    }
    meta["plugin-annotations"] = plugin
    doc["spec"] = {"podCIDR": f"100.64.{index % 256}.0/24", "podCIDRs": [f"100.64.{index % 256}.0/24"],
                   "providerID": f"aws:///us-east-2a/i-{rng.getrandbits(64):016x}"}
    ready = status["conditions"][0]
    status["conditions"] = [{"type": t, "status": st, "reason": reason, "message": message,
                             "lastHeartbeatTime": ready["lastHeartbeatTime"],
                             "lastTransitionTime": ready["lastTransitionTime"]}
                            for t, st, reason, message in _CONDITION_MESSAGES] + [ready]
    status["addresses"] = [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name},
                           {"type": "InternalDNS", "address": f"ip-{ip.replace('.', '-')}.us-east-2.compute.internal"}]
    status["daemonEndpoints"] = {"kubeletEndpoint": {"Port": 10250}}
    status["nodeInfo"].update({"bootID": str(uuid_of(rng)), "machineID": f"{rng.getrandbits(128):032x}",
                               "systemUUID": str(uuid_of(rng)), "kernelVersion": "6.8.0-1021-aws",
                               "osImage": "Ubuntu 24.04.2 LTS"})
    images = []
    for i in range(50):
        repo = _IMAGE_REPOS[i % len(_IMAGE_REPOS)]
        names = [f"{repo}@sha256:{rng.getrandbits(256):064x}", f"{repo}:{24 + i // 15}.{i % 12:02d}-py3"]
        if i % 3 == 0:
            names.append(f"{repo}:v{i // 3}.{i % 7}.{i % 5}")
        images.append({"names": names, "sizeBytes": rng.randrange(20_000_000, 22_000_000_000)})
    status["images"] = images
    return doc


def uuid_of(rng: random.Random) -> str:
    h = f"{rng.getrandbits(128):032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class _HttpError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _device_id(node: str, index: int) -> str:
    """A UUID-shaped id, the same for a node and index in every run."""
    digest = hashlib.sha256(node.encode()).hexdigest()[:12]
    return f"GPU-{index:08x}-0000-4000-8000-{digest}"


def _parse_time(text: str) -> float:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _audit_policy(quiet_user: str) -> dict[str, Any]:
    return {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
            "rules": [{"level": "None", "users": [quiet_user]}, {"level": "Metadata"}]}


_CONDITIONS_TEMPLATE = """{{ $now := Now }}
{{ $lastTransitionTime := or .metadata.creationTimestamp $now }}
conditions:
{{ range NodeConditions }}
- lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $lastTransitionTime | Quote }}
  message: {{ .message | Quote }}
  reason: {{ .reason | Quote }}
  status: {{ .status | Quote }}
  type: {{ .type | Quote }}
{{ end }}
"""


def _kwok_config(lease_duration_s: int, status_period_s: int) -> Iterator[dict[str, Any]]:
    yield {"apiVersion": "config.kwok.x-k8s.io/v1alpha1", "kind": "KwokConfiguration",
           # A configuration given is not defaulted, so kwok's defaults are spelled out, but for the lease workers:
           # 5,000 renewals per 10 s leave 8 ms each to kwok's 4.
           "options": {"nodeLeaseDurationSeconds": lease_duration_s, "nodeLeaseParallelism": 16,
                       "nodePlayStageParallelism": 4, "podPlayStageParallelism": 4,
                       "podsOnNodeSyncParallelism": 1}}
    # kwok's own node-initialize (for a node created not Ready) and heartbeat-with-lease stages, reduced to the
    # conditions, with the kubelet's status period and phases instead of kwok's random 10 to 20 minutes.
    yield {"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage", "metadata": {"name": "node-initialize"},
           "spec": {"resourceRef": {"apiGroup": "v1", "kind": "Node"},
                    "selector": {"matchExpressions": [
                        {"key": '.status.conditions.[] | select( .type == "Ready" ) | .status',
                         "operator": "NotIn", "values": ["True"]}]},
                    "next": {"statusTemplate": _CONDITIONS_TEMPLATE + "phase: Running\n"}}}
    yield {"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage", "metadata": {"name": "node-heartbeat-with-lease"},
           "spec": {"resourceRef": {"apiGroup": "v1", "kind": "Node"},
                    "selector": {"matchExpressions": [
                        {"key": ".status.phase", "operator": "In", "values": ["Running"]},
                        {"key": '.status.conditions.[] | select( .type == "Ready" ) | .status',
                         "operator": "In", "values": ["True"]}]},
                    "delay": {"durationMilliseconds": status_period_s * 1000,
                              "durationFrom": {"jq": {"expression": (
                                  '.status.conditions.[] | select( .type == "Ready" ) | .lastHeartbeatTime'
                                  f" | fromdateiso8601 + {status_period_s} | todateiso8601")}}},
                    "next": {"statusTemplate": _CONDITIONS_TEMPLATE}}}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--idle", type=float, default=60.0, help="seconds of idle CPU measurement")
    ap.add_argument("--status-period", type=int, default=STATUS_PERIOD_S,
                    help="seconds between two status writes of a node (the kubelet's report frequency is 300)")
    ap.add_argument("--lease-duration", type=int, default=LEASE_DURATION_S,
                    help="node Lease duration in seconds (renewed at a quarter of it; the kubelet's is 40)")
    ap.add_argument("--workdir", type=Path, help="where the fleet keeps its files (default: a new temporary dir)")
    args = ap.parse_args(argv)
    if args.nodes < 1:
        ap.error("--nodes: must be at least 1")
    if args.lease_duration < 4:
        ap.error("--lease-duration: must be at least 4 (seconds)")
    if args.status_period < 1:
        ap.error("--status-period: must be at least 1 (second)")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-health-fleet-"))
    with Fleet(args.nodes, workdir, lease_duration_s=args.lease_duration,
               status_period_s=args.status_period) as fleet:
        since = time.time()
        idle = fleet.measure_idle(args.idle)
        counts = fleet.request_counts(since=since)
        print(json.dumps({"machine": machine(), "nodes": args.nodes, "timings_s": fleet.timings,
                          "idle": idle, "audited_requests_idle_by_user": dict(counts)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
