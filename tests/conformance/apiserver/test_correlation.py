"""Pod correlation against a real kube-apiserver: Events on the pods holding a failing GPU (visible in
``kubectl describe pod``), pod annotations, and evictions through the eviction API with PodDisruptionBudgets enforced
by the API server itself (429 while the budget forbids it).

The plugin authenticates as its service account with a token bound to a plugin Pod on the node (what the kubelet
projects), so the base's RBAC plus manifests/overlays/remediation/rbac.yaml are what allow each call. The kubelet's
PodResources API is the stand-in from tests/fakes on a real unix socket. No controller-manager runs: the test plays
the disruption controller by writing the budget's status, the way that controller would.
"""

from __future__ import annotations

import secrets
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from plugin.devices.simulated import SimulatedBackend
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.kube.client import KubeClient
from plugin.kubelet.resources import WholeGpus
from plugin.outlets.correlation import CorrelationSettings, Correlator, PodResourcesClient
from tests.conftest import NodeFile
from tests.fakes.podresources import PodResourcesServer

pytestmark = [pytest.mark.conformance, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
BASE = REPO / "manifests" / "base"
REMEDIATION_RBAC = REPO / "manifests" / "overlays" / "remediation" / "rbac.yaml"
PLUGIN_NS = "gpu-health-system"
PLUGIN_SA = "gpu-health-device-plugin"
GPU = "nvidia.com/gpu"


def pod_body(namespace: str, name: str, node: str, labels: dict[str, str] | None = None,
             service_account: str = "default") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
            "spec": {"nodeName": node, "serviceAccountName": service_account, "automountServiceAccountToken": False,
                     "containers": [{"name": "worker", "image": "registry.invalid/train:1",
                                     "resources": {"limits": {GPU: "1"}}}]}}


def ok(result: Any) -> Any:
    assert result.ok, f"HTTP {result.status}: {result.message}"
    return result.body


@dataclass
class Cluster:
    apiserver: Any
    namespace: str
    node: str
    kubeconfig: Path

    def create_pod(self, name: str, labels: dict[str, str] | None = None, running: bool = True) -> str:
        body = ok(self.apiserver.request("POST", f"/api/v1/namespaces/{self.namespace}/pods",
                                         pod_body(self.namespace, name, self.node, labels)))
        if running:
            # What the kubelet would report: a Running, Ready pod (a Pending one is evicted without asking its PDB).
            ok(self.apiserver.request(
                "PATCH", f"/api/v1/namespaces/{self.namespace}/pods/{name}/status",
                {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
                content_type="application/merge-patch+json"))
        return str(body["metadata"]["uid"])

    def pod(self, name: str) -> dict[str, Any] | None:
        r = self.apiserver.request("GET", f"/api/v1/namespaces/{self.namespace}/pods/{name}")
        if r.status == 404:
            return None
        return ok(r)  # type: ignore[no-any-return]

    def events_for(self, name: str) -> list[dict[str, Any]]:
        body = ok(self.apiserver.request(
            "GET", f"/api/v1/namespaces/{self.namespace}/events?fieldSelector=involvedObject.name%3D{name}"))
        return list(body["items"])

    def budget(self, name: str, selector: dict[str, str], allowed: int) -> None:
        path = f"/apis/policy/v1/namespaces/{self.namespace}/poddisruptionbudgets"
        if self.apiserver.request("GET", f"{path}/{name}").status == 404:
            ok(self.apiserver.request("POST", path, {
                "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                "metadata": {"name": name, "namespace": self.namespace},
                "spec": {"minAvailable": 1, "selector": {"matchLabels": selector}}}))
        generation = ok(self.apiserver.request("GET", f"{path}/{name}"))["metadata"]["generation"]
        # The disruption controller's job, done by hand: how many pods may go now.
        ok(self.apiserver.request("PATCH", f"{path}/{name}/status", {"status": {
            "observedGeneration": generation, "disruptionsAllowed": allowed, "currentHealthy": 1 + allowed,
            "desiredHealthy": 1, "expectedPods": 1 + allowed}}, content_type="application/merge-patch+json"))


@pytest.fixture(scope="module")
def cluster(apiserver: Any) -> Cluster:
    apiserver.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=correlation-test",
                      *[a for f in ("namespace.yaml", "serviceaccount.yaml", "clusterrole.yaml",
                                    "clusterrolebinding.yaml") for a in ("-f", str(BASE / f))],
                      "-f", str(REMEDIATION_RBAC))
    suffix = secrets.token_hex(3)
    node = f"corr-node-{suffix}"
    namespace = f"corr-{suffix}"
    apiserver.create_node(node)
    ok(apiserver.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                        "metadata": {"name": namespace}}))
    # No controller-manager: the default service account a pod is admitted with is created by hand.
    ok(apiserver.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts",
                         {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}))
    plugin_pod = f"gpu-health-device-plugin-{suffix}"
    ok(apiserver.request("POST", f"/api/v1/namespaces/{PLUGIN_NS}/pods",
                         pod_body(PLUGIN_NS, plugin_pod, node, service_account=PLUGIN_SA)))
    token = apiserver.token_for_pod(PLUGIN_NS, PLUGIN_SA, plugin_pod)
    return Cluster(apiserver, namespace, node, apiserver.kubeconfig_for_token(token, "plugin"))


@dataclass
class Rig:
    node: NodeFile
    backend: SimulatedBackend
    monitor: Monitor
    kubelet: PodResourcesServer
    correlator: Correlator

    def fault(self, index: int, **signals: Any) -> None:
        self.node.set(index, **signals)
        assert self.backend.reload()
        self.monitor.poll_once()


@pytest.fixture
def make_rig(cluster: Cluster) -> Iterator[Any]:
    made: list[Rig] = []
    tmp = tempfile.TemporaryDirectory(prefix="ghdp-")

    def make(**settings: Any) -> Rig:
        d = Path(tmp.name) / str(len(made))
        d.mkdir()
        node = NodeFile(d / "node.json")
        backend = SimulatedBackend(node.path)
        state = NodeState()
        monitor = Monitor(backend, state, HealthConfig(clear_after_polls=1), 5.0, threading.Event())
        kubelet = PodResourcesServer(d / "pr.sock")
        kubelet.start()
        opts: dict[str, Any] = {"states": frozenset({"Unhealthy"}), "resources": (WholeGpus(),),
                                "node_name": cluster.node, "evict_retry_initial_s": 0.05}
        opts.update(settings)
        corr = Correlator(state, CorrelationSettings(**opts), PodResourcesClient(d / "pr.sock"),
                          lambda: KubeClient(cluster.kubeconfig))
        monitor.poll_once()
        rig = Rig(node, backend, monitor, kubelet, corr)
        made.append(rig)
        return rig

    yield make
    for r in made:
        r.correlator.stop()
        r.kubelet.stop()
        r.backend.close()
    tmp.cleanup()


def test_event_on_each_pod_holding_the_failed_gpu_shows_in_describe(cluster: Cluster, make_rig: Any) -> None:
    rig = make_rig(annotate=True)
    uid = cluster.create_pod("train-a")
    cluster.create_pod("train-b")
    rig.kubelet.assign(cluster.namespace, "train-a", "worker", GPU, rig.node.uuids[2])
    rig.kubelet.assign(cluster.namespace, "train-b", "worker", GPU, rig.node.uuids[0])
    rig.fault(2, row_remap_failure=True)
    rig.correlator.step(0.0)
    assert rig.correlator.stats.last_error == ""
    assert rig.correlator.stats.events_posted == 1

    events = cluster.events_for("train-a")
    assert len(events) == 1
    ev = events[0]
    assert ev["involvedObject"]["uid"] == uid and ev["involvedObject"]["kind"] == "Pod"
    assert ev["type"] == "Warning" and ev["reason"] == "GPUUnhealthy"
    assert rig.node.uuids[2] in ev["message"] and "row-remap-failure" in ev["message"]
    assert ev["source"]["host"] == cluster.node
    assert cluster.events_for("train-b") == []
    # kubectl describe finds Events by the pod's UID: the reason operators look for is right there.
    described = cluster.apiserver.kubectl("describe", "pod", "train-a", "-n", cluster.namespace).stdout
    assert "GPUUnhealthy" in described and rig.node.uuids[2] in described

    pod = cluster.pod("train-a")
    assert pod is not None
    assert pod["metadata"]["annotations"]["gpu-health.io/failing-devices"] == f"{rig.node.uuids[2]}=Unhealthy"


def test_eviction_waits_for_the_disruption_budget(cluster: Cluster, make_rig: Any) -> None:
    rig = make_rig(evict=True)
    cluster.create_pod("guarded", labels={"app": "guarded"})
    cluster.create_pod("free")
    cluster.budget("guarded", {"app": "guarded"}, allowed=0)
    rig.kubelet.assign(cluster.namespace, "guarded", "worker", GPU, rig.node.uuids[5])
    rig.kubelet.assign(cluster.namespace, "free", "worker", GPU, rig.node.uuids[5])
    rig.fault(5, row_remap_failure=True)

    next_at = rig.correlator.step(100.0)
    stats = rig.correlator.stats
    # The pod without a budget is evicted at once; the guarded one is refused by the API server with 429.
    assert stats.evictions_evicted == 1 and stats.evictions_blocked == 1, stats
    free = cluster.pod("free")
    assert free is None or free["metadata"].get("deletionTimestamp")
    guarded = cluster.pod("guarded")
    assert guarded is not None and not guarded["metadata"].get("deletionTimestamp")
    assert next_at > 100.0

    # Still refused on the retry while the budget says no.
    next_at = rig.correlator.step(next_at)
    assert stats.evictions_blocked == 2 and stats.evictions_evicted == 1

    # The budget allows one disruption now (a replacement became ready elsewhere): the retry goes through.
    cluster.budget("guarded", {"app": "guarded"}, allowed=1)
    assert rig.correlator.step(next_at) == float("inf")
    assert stats.evictions_evicted == 2 and stats.evictions_failed == 0
    guarded = cluster.pod("guarded")
    assert guarded is None or guarded["metadata"].get("deletionTimestamp")
