"""The cluster reporter against a real kube-apiserver, with the plugin's own service-account token.

The access control of manifests/base is in force (its ValidatingAdmissionPolicy as is, its ClusterRole's rules
bound to a service account of the same name in a namespace of this module's own, so the API server shared by the
session keeps manifests/base's own namespace untouched for test_apiserver_peer.py); the token is bound to a Pod on
node A as the kubelet would project it, and the real reporter (and its real client) writes through it: merge
patches that pass the policy, stale-key removal, a concurrent edit answered with 409, RBAC and policy denials
shown in the status, Events, the node condition with the overlay's nodes/status grant, and kubectl /
kubectl gpu-health reading it all.
Time is driven by hand (``tick``), the API calls are real.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from plugin.kube.client import KubeClient
from plugin.outlets.reporter import KubeReporter, ReporterSettings
from tests.conformance.apiserver.apiserver_peer import wait_until
from tests.conftest import FakeClock
from tests.fakes.node_devices import Node

pytestmark = [pytest.mark.conformance, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
BASE = REPO / "manifests" / "base"
NAMESPACE = "ann-test"  # not manifests/base's namespace: test_apiserver_peer.py checks a dry run there
SERVICE_ACCOUNT = "gpu-health-device-plugin"
NODE_A = "ann-node-a"
NODE_B = "ann-node-b"
POD_A = "gpu-health-device-plugin-ann-a"
P = "gpu-health.io"
FOREIGN = {"example.com/owner": "ops-team"}
T0 = 1_767_225_600.0


def can_i(apiserver: Any, token: str, verb: str, resource: str, subresource: str = "") -> bool:
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
              "spec": {"resourceAttributes": {"verb": verb, "resource": resource, "subresource": subresource}}}
    result = apiserver.request("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", review, token=token)
    return bool(result.ok and result.body["status"].get("allowed", False))


def node(apiserver: Any, name: str) -> dict[str, Any]:
    result = apiserver.request("GET", f"/api/v1/nodes/{name}")
    assert result.ok, result.message
    return dict(result.body)


def annotations(apiserver: Any, name: str) -> dict[str, str]:
    return dict(node(apiserver, name)["metadata"].get("annotations") or {})


@pytest.fixture(scope="module")
def plugin_kubeconfig(apiserver: Any) -> Path:
    """Nodes A and B, manifests/base applied, the plugin's Pod on node A, and a kubeconfig with its token."""
    for name in (NODE_A, NODE_B):
        apiserver.create_node(name, annotations={**FOREIGN, f"{P}/gpu.9": '{"state":"Unhealthy"}',
                                                 f"{P}/note": "kept: not a key of ours"})
    rules = yaml.safe_load((BASE / "clusterrole.yaml").read_text())["rules"]
    apiserver.apply([
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": SERVICE_ACCOUNT, "namespace": NAMESPACE}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "ann-test-plugin"},
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "ann-test-plugin"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "ann-test-plugin"},
         "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}]},
    ])
    # The admission policy exactly as shipped (it matches the service-account name in any namespace).
    apiserver.kubectl("apply", "-f", str(BASE / "validatingadmissionpolicy.yaml"),
                      "-f", str(BASE / "validatingadmissionpolicybinding.yaml"))
    apiserver.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD_A, "namespace": NAMESPACE},
                     "spec": {"nodeName": NODE_A, "serviceAccountName": SERVICE_ACCOUNT,
                              "containers": [{"name": "plugin", "image": "gpu-health-device-plugin:test"}]}})
    token = apiserver.token_for_pod(NAMESPACE, SERVICE_ACCOUNT, POD_A)
    wait_until(lambda: can_i(apiserver, token, "patch", "nodes"), "RBAC grant for the plugin")
    probe = {"metadata": {"annotations": {f"{P}/probe": "x"}}}
    wait_until(lambda: apiserver.request("PATCH", f"/api/v1/nodes/{NODE_B}?dryRun=All", probe, token=token,
                                         content_type="application/merge-patch+json").status == 403,
               "the admission policy to be in force")
    return Path(apiserver.kubeconfig_for_token(token, "plugin-ann-a"))


class Reporter:
    def __init__(self, kubeconfig: Path, node_name: str, **settings: Any) -> None:
        self.clock = FakeClock(1000.0)
        self.state = NodeState()
        self.node = Node(self.state, n=8)
        self.rep = KubeReporter(self.state, ReporterSettings(node_name=node_name, **settings),
                                lambda: KubeClient(kubeconfig), clock=self.clock,
                                wall=lambda: T0 + self.clock.now, rng=random.Random(5))

    def at(self, t: float) -> None:
        for _ in range(1000):
            deadline = self.rep.tick(self.clock.now)
            if self.clock.now >= t:
                return
            self.clock.now = min(max(deadline, self.clock.now), t)
        raise AssertionError("reporter did not settle")

    def set(self, index: int, state: State, *codes: str) -> None:
        self.node.set(index, state, *codes, now=T0 + self.clock.now)


def test_reporter_reconciles_node_through_the_admission_policy(apiserver: Any, plugin_kubeconfig: Path) -> None:
    r = Reporter(plugin_kubeconfig, NODE_A)
    r.node.publish(T0)
    r.set(3, State.UNHEALTHY, "xid-79")
    r.at(1002.0)
    got = annotations(apiserver, NODE_A)
    status = r.rep.status()
    assert status.ok and status.writes == 1, status
    assert f"{P}/gpu.9" not in got  # a stale key of ours, removed
    assert got[f"{P}/note"] == "kept: not a key of ours" and got["example.com/owner"] == "ops-team"
    assert json.loads(got[f"{P}/gpu.3"])["state"] == "Unhealthy"
    assert got[f"{P}/state"] == "Unhealthy" and got[f"{P}/schema"] == "v1"

    # Steady: nothing more is written, even across a resync.
    rv = node(apiserver, NODE_A)["metadata"]["resourceVersion"]
    r.at(1700.0)
    assert node(apiserver, NODE_A)["metadata"]["resourceVersion"] == rv and r.rep.status().writes == 1

    # A device disappears: its key goes.
    r.node.remove(7, now=T0 + r.clock.now)
    r.at(1720.0)
    assert f"{P}/gpu.7" not in annotations(apiserver, NODE_A)


def test_concurrent_edit_is_a_409_and_the_retry_wins(apiserver: Any, plugin_kubeconfig: Path) -> None:
    r = Reporter(plugin_kubeconfig, NODE_A)
    r.node.publish(T0)
    r.at(1002.0)
    # Someone else edits the node after our read: our next patch carries a stale resourceVersion.
    result = apiserver.request("PATCH", f"/api/v1/nodes/{NODE_A}",
                               {"metadata": {"annotations": {"example.com/owner": "other-team",
                                                             f"{P}/gpu.1": "hand edit"}}},
                               content_type="application/merge-patch+json")
    assert result.ok, result.message
    r.set(5, State.DEGRADED, "thermal-slowdown")
    r.at(1020.0)
    got = annotations(apiserver, NODE_A)
    assert r.rep.status().conflicts == 1 and r.rep.status().ok
    assert got["example.com/owner"] == "other-team"
    assert json.loads(got[f"{P}/gpu.5"])["state"] == "Degraded"
    assert json.loads(got[f"{P}/gpu.1"])["state"] == "Healthy"  # repaired from the fresh read


def test_policy_and_rbac_denials_show_in_the_status(apiserver: Any, plugin_kubeconfig: Path) -> None:
    before = annotations(apiserver, NODE_B)
    r = Reporter(plugin_kubeconfig, NODE_B, events=False)  # node A's token, node B's name
    r.node.publish(T0)
    r.at(1005.0)
    s = r.rep.status()
    assert not s.ok and s.writes == 0 and s.failures >= 1
    assert "HTTP 403" in (s.last_error or "") and f"may not modify node {NODE_B}" in (s.last_error or "")
    assert annotations(apiserver, NODE_B) == before

    # A token without the grant cannot even read the node.
    apiserver.kubectl("create", "serviceaccount", "ann-nobody", "-n", NAMESPACE, check=False)
    token = apiserver.token_for_service_account(NAMESPACE, "ann-nobody")
    other = Reporter(Path(apiserver.kubeconfig_for_token(token, "ann-nobody")), NODE_A)
    other.node.publish(T0)
    other.at(1000.0)
    err = other.rep.status().last_error or ""
    assert "HTTP 403" in err and 'cannot get resource "nodes"' in err, err


def test_events_on_the_node_are_aggregated(apiserver: Any, plugin_kubeconfig: Path) -> None:
    r = Reporter(plugin_kubeconfig, NODE_A)
    r.node.publish(T0)
    r.at(1002.0)
    for k in range(3):
        r.set(2, State.UNHEALTHY, "ecc-uncorrected")
        r.at(1003.0 + k * 2)
        r.set(2, State.HEALTHY)
        r.at(1004.0 + k * 2)
    r.at(1100.0)
    assert r.rep.status().event_failures == 0, r.rep.status().last_error
    out = apiserver.kubectl("get", "events", "-n", "default", "-o", "json",
                            "--field-selector", f"involvedObject.name={NODE_A},reason=GPUUnhealthy").stdout
    events = json.loads(out)["items"]
    assert len(events) == 1 and events[0]["count"] == 3 and events[0]["type"] == "Warning"
    assert events[0]["involvedObject"]["uid"] == node(apiserver, NODE_A)["metadata"]["uid"]
    assert "gpu.2" in events[0]["message"] and "ecc-uncorrected" in events[0]["message"]
    described = apiserver.kubectl("describe", "node", NODE_A).stdout
    assert "GPUUnhealthy" in described and "GPURecovered" in described


def test_node_condition_with_the_status_grant(apiserver: Any, plugin_kubeconfig: Path) -> None:
    apiserver.apply([
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "ann-test-node-status"},
         "rules": [{"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "ann-test-node-status"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "ann-test-node-status"},
         "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}]},
    ])
    token_config = plugin_kubeconfig
    token = json.loads(token_config.read_text())["users"][0]["user"]["token"]
    wait_until(lambda: can_i(apiserver, token, "patch", "nodes", "status"), "the nodes/status grant")
    r = Reporter(token_config, NODE_A, condition=True, events=False)
    r.node.publish(T0)
    r.set(4, State.UNHEALTHY, "xid-79")
    r.at(1002.0)
    assert r.rep.status().ok, r.rep.status().last_error
    conditions = {c["type"]: c for c in node(apiserver, NODE_A)["status"]["conditions"]}
    assert conditions["GPUHealthy"]["status"] == "False" and conditions["GPUHealthy"]["reason"] == "GPUUnhealthy"
    assert "gpu.4" in conditions["GPUHealthy"]["message"] and conditions["Ready"]["status"] == "True"
    r.set(4, State.HEALTHY)
    r.at(1020.0)
    conditions = {c["type"]: c for c in node(apiserver, NODE_A)["status"]["conditions"]}
    assert conditions["GPUHealthy"]["status"] == "True"


def test_kubectl_and_kubectl_gpu_health_read_the_annotations(apiserver: Any, plugin_kubeconfig: Path,
                                                             tmp_path: Path) -> None:
    r = Reporter(plugin_kubeconfig, NODE_A)
    r.node.publish(T0)
    r.set(6, State.UNHEALTHY, "xid-79")
    r.set(1, State.DEGRADED, "thermal-slowdown")
    r.at(1002.0)
    # The README's recipes.
    columns = apiserver.kubectl("get", "node", NODE_A, "-o",
                                r"custom-columns=NODE:.metadata.name,GPU:.metadata.annotations.gpu-health\.io/state,"
                                r"SUMMARY:.metadata.annotations.gpu-health\.io/summary").stdout
    assert columns.splitlines()[1].split()[:3] == [NODE_A, "Unhealthy", "Unhealthy:"]
    value = apiserver.kubectl("get", "node", NODE_A, "-o",
                              r"jsonpath={.metadata.annotations.gpu-health\.io/gpu\.6}").stdout
    assert json.loads(value)["reasons"][0]["code"] == "xid-79"

    # kubectl finds the plugin on PATH, as an operator's kubectl would.
    venv_bin = Path(sys.executable).parent
    plugin_exe = shutil.which("kubectl-gpu_health", path=str(venv_bin))
    assert plugin_exe, f"kubectl-gpu_health is not installed next to {sys.executable} (pip install -e .)"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").symlink_to(apiserver.kubectl_path)
    (bin_dir / "kubectl-gpu_health").symlink_to(plugin_exe)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "KUBECONFIG": str(apiserver.kubeconfig),
           "KUBECACHEDIR": str(tmp_path / "cache")}
    proc = subprocess.run([str(bin_dir / "kubectl"), "gpu-health", "--node", NODE_A, "--state", "Unhealthy,Degraded"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [ln.split() for ln in proc.stdout.splitlines()[1:]]
    assert [(row[0], row[1], row[3]) for row in rows] == [(NODE_A, "gpu.1", "Degraded"), (NODE_A, "gpu.6", "Unhealthy")]
    proc = subprocess.run([str(bin_dir / "kubectl"), "gpu-health", "-o", "json"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert {d["device"] for d in doc["devices"] if d["node"] == NODE_A} >= {f"gpu.{i}" for i in range(7)}
