"""The fleet controller's overlays against a real kube-apiserver: server-side dry run, Pod admission, and its RBAC.

Both overlays (manifests/overlays/controller, controller-drain) pass `kubectl apply --dry-run=server
--validate=strict`; the Deployment's pod is admitted in the project's namespace and under Pod Security `restricted`.
Then the controller's own objects are applied for real and its service account's token is asked, through `kubectl
auth can-i` and through real (dry-run) requests, what it may do: patch Nodes, renew its own Lease, post Events; not
delete Nodes, not read Secrets, and evict pods only with the drain component.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conformance.apiserver.apiserver_peer import wait_until

pytestmark = [pytest.mark.conformance]

REPO = Path(__file__).resolve().parents[3]
MANIFESTS = REPO / "manifests"
VARIANTS = {
    "controller": MANIFESTS / "overlays" / "controller",
    "controller-drain": MANIFESTS / "overlays" / "controller-drain",
}
DRAIN_RBAC = MANIFESTS / "components" / "controller-drain" / "rbac.yaml"
NAMESPACE = "gpu-health-system"
NAME = "gpu-health-controller"
# Objects persist for the whole session: this file's own names, so no other test sees them.
NODE = "controller-manifests-node"
POD_NS = "controller-manifests-pods"
RESTRICTED_NS = "controller-manifests-restricted"


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


@pytest.fixture(scope="module")
def namespace(apiserver: Any) -> str:
    # A dry-run create in a Namespace that does not exist fails (the dry-run Namespace is not persisted).
    apiserver.kubectl("apply", "-f", str(MANIFESTS / "base" / "namespace.yaml"))
    return NAMESPACE


@pytest.fixture(scope="module")
def rendered(apiserver: Any) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for variant, path in VARIANTS.items():
        text = apiserver.kubectl("kustomize", str(path)).stdout
        out[variant] = [d for d in yaml.safe_load_all(text) if d]
    return out


def _controller_objects(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["metadata"]["name"].startswith(NAME)]


# Dry run and admission ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_passes_a_server_side_dry_run(apiserver: Any, namespace: str,
                                                   rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    result = apiserver.kubectl("apply", "--dry-run=server", "--validate=strict", "-k", str(VARIANTS[variant]),
                               "-o", "json", check=False)
    assert result.returncode == 0, f"{variant}: {result.stderr}"
    doc = json.loads(result.stdout)
    returned = {_key(o): o for o in (doc["items"] if doc.get("kind") == "List" else [doc])}
    expected = {_key(o): o for o in rendered[variant]}
    assert returned.keys() == expected.keys(), f"{variant}: the server answered for {sorted(returned)}"
    # The server kept what matters: nothing dropped as unknown, nothing rewritten.
    for kind in ("ClusterRole", "Role"):
        for key in (k for k in expected if k[0] == kind and k[1].startswith(NAME)):
            assert returned[key]["rules"] == expected[key]["rules"], key
    sent, back = expected[("Deployment", NAME)], returned[("Deployment", NAME)]
    assert back["spec"]["replicas"] == 2
    assert back["spec"]["strategy"] == sent["spec"]["strategy"]
    sent_pod, back_pod = sent["spec"]["template"]["spec"], back["spec"]["template"]["spec"]
    for field in ("securityContext", "affinity", "tolerations", "automountServiceAccountToken"):
        assert back_pod[field] == sent_pod[field], field
    for field in ("securityContext", "command", "args", "resources"):
        assert back_pod["containers"][0][field] == sent_pod["containers"][0][field], field
    # Defaulting adds the fieldRef's apiVersion; the fields read are what was sent.
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in back_pod["containers"][0]["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    assert returned[("PodDisruptionBudget", NAME)]["spec"] == expected[("PodDisruptionBudget", NAME)]["spec"]


def _pod(rendered: dict[str, list[dict[str, Any]]], namespace: str, name: str) -> dict[str, Any]:
    dep = next(o for o in rendered["controller"] if o["kind"] == "Deployment")
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": dep["spec"]["template"]["metadata"]["labels"]},
            "spec": copy.deepcopy(dep["spec"]["template"]["spec"])}


def _service_account(apiserver: Any, namespace: str) -> None:
    # Service-account admission looks the account up when a Pod is created, even in a dry run.
    apiserver.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": NAME, "namespace": namespace}})


def test_the_controllers_pod_is_admitted(apiserver: Any, namespace: str,
                                         rendered: dict[str, list[dict[str, Any]]]) -> None:
    _service_account(apiserver, NAMESPACE)
    pod = _pod(rendered, NAMESPACE, f"{NAME}-admission")
    result = apiserver.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods?dryRun=All&fieldValidation=Strict", pod)
    assert result.ok, f"{result.status} {result.message}"
    admitted = result.body["spec"]
    assert "priorityClassName" not in admitted
    # The projected token is mounted: every action of the controller is an API call.
    mounts = {m["mountPath"] for m in admitted["containers"][0]["volumeMounts"]}
    assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts
    # Admission adds only the not-ready/unreachable tolerations, never one for the quarantine taint.
    keys = {t.get("key") for t in admitted["tolerations"]}
    assert keys == {"CriticalAddonsOnly", "node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}


def test_the_controllers_pod_meets_pod_security_restricted(apiserver: Any, namespace: str,
                                                           rendered: dict[str, list[dict[str, Any]]]) -> None:
    # Stricter than the DaemonSet, which needs `privileged` for its host paths: the controller passes `restricted`.
    labels = {"pod-security.kubernetes.io/enforce": "restricted"}
    apiserver.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": RESTRICTED_NS, "labels": labels}})
    _service_account(apiserver, RESTRICTED_NS)
    path = f"/api/v1/namespaces/{RESTRICTED_NS}/pods?dryRun=All&fieldValidation=Strict"
    pod = _pod(rendered, RESTRICTED_NS, f"{NAME}-restricted")
    result = apiserver.request("POST", path, pod)
    assert result.ok, f"{result.status} {result.message}"
    # Guards the check: `restricted` is enforced here, so the same pod with one hardening setting gone is refused.
    del pod["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"]
    refused = apiserver.request("POST", path, pod)
    assert refused.status == 403, f"{refused.status} {refused.message}"
    assert "allowPrivilegeEscalation" in refused.message


# RBAC, asked with the controller's own token --------------------------------------------------------------------

class Identity:
    """The controller's service-account token, asked through `kubectl auth can-i` and through raw requests."""

    def __init__(self, apiserver: Any, token: str) -> None:
        self.apiserver = apiserver
        self.token = token
        self.kubeconfig = apiserver.kubeconfig_for_token(token, NAME)

    def can_i(self, verb: str, resource: str, *extra: str) -> bool:
        proc = self.apiserver.kubectl("auth", "can-i", verb, resource, *extra, kubeconfig=self.kubeconfig,
                                      check=False)
        answer: str = proc.stdout.strip()
        assert answer in ("yes", "no"), f"kubectl auth can-i {verb} {resource} {extra}: {proc.stdout}{proc.stderr}"
        assert (proc.returncode == 0) is (answer == "yes")
        return answer == "yes"

    def request(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        return self.apiserver.request(method, path, body, token=self.token, **kwargs)


@pytest.fixture(scope="module")
def controller(apiserver: Any, namespace: str, rendered: dict[str, list[dict[str, Any]]]) -> Identity:
    """The controller's ServiceAccount, roles and bindings applied for real, and a token for the account."""
    objs = [o for o in _controller_objects(rendered["controller"])
            if o["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")]
    assert len(objs) == 5
    apiserver.apply(objs)
    if apiserver.request("GET", f"/api/v1/nodes/{NODE}").status == 404:
        apiserver.create_node(NODE, labels={"nvidia.com/gpu.present": "true"})
    me = Identity(apiserver, apiserver.token_for_service_account(NAMESPACE, NAME))
    wait_until(lambda: me.can_i("update", f"leases.coordination.k8s.io/{NAME}", "-n", NAMESPACE)
               and me.can_i("patch", "nodes"), "the controller's RBAC to be in force")
    return me


def test_it_may_watch_and_patch_nodes_but_not_delete_or_replace_them(controller: Identity) -> None:
    for verb in ("get", "list", "watch", "patch"):
        assert controller.can_i(verb, "nodes"), verb
    for verb in ("create", "update", "delete", "deletecollection"):
        assert not controller.can_i(verb, "nodes"), verb
    assert not controller.can_i("patch", "nodes", "--subresource=status")
    assert controller.request("DELETE", f"/api/v1/nodes/{NODE}").status == 403


def test_a_quarantine_patch_is_allowed_through_rbac_and_admission(controller: Identity) -> None:
    # The plugin's admission policy confines the plugin's account to annotations on its own Node; the controller's
    # account must be untouched by it: taint, cordon, label and annotations, on any Node (a dry run: nothing stays).
    taints = [{"key": "gpu-health.io/quarantine", "value": "reboot-required", "effect": "NoSchedule"}]
    patch = {"metadata": {"labels": {"gpu-health.io/quarantined": "true"},
                          "annotations": {"controller.gpu-health.io/quarantined-by": NAME}},
             "spec": {"unschedulable": True, "taints": taints}}
    result = controller.request("PATCH", f"/api/v1/nodes/{NODE}?dryRun=All", patch,
                                content_type="application/merge-patch+json")
    assert result.ok, f"{result.status} {result.message}"
    assert result.body["spec"]["taints"] == taints
    assert result.body["spec"]["unschedulable"] is True


def test_it_may_renew_only_its_own_lease(controller: Identity) -> None:
    lease = f"leases.coordination.k8s.io/{NAME}"
    for verb in ("get", "update"):
        assert controller.can_i(verb, lease, "-n", NAMESPACE), verb
    assert controller.can_i("create", "leases.coordination.k8s.io", "-n", NAMESPACE)
    # Names restrict everything but create; another Lease, or the same name elsewhere, is out of reach.
    other = "leases.coordination.k8s.io/kube-scheduler"
    for verb in ("get", "update", "patch", "delete"):
        assert not controller.can_i(verb, other, "-n", NAMESPACE), verb
    for verb in ("patch", "delete", "list", "watch"):
        assert not controller.can_i(verb, lease, "-n", NAMESPACE), verb
    for verb in ("get", "create", "update"):
        assert not controller.can_i(verb, lease, "-n", "kube-system"), verb
    # A real (dry-run) create of its Lease goes through.
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": NAME, "namespace": NAMESPACE},
            "spec": {"holderIdentity": "test", "leaseDurationSeconds": 15}}
    created = controller.request("POST", f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases?dryRun=All",
                                 body)
    assert created.status == 201, f"{created.status} {created.message}"


def test_it_may_post_events_and_nothing_else(controller: Identity) -> None:
    for ns in ("default", NAMESPACE):
        assert controller.can_i("create", "events", "-n", ns), ns
        assert controller.can_i("patch", "events", "-n", ns), ns
        assert not controller.can_i("delete", "events", "-n", ns), ns
    for resource in ("secrets", "configmaps"):
        for verb in ("get", "list"):
            assert not controller.can_i(verb, resource, "-n", NAMESPACE), (verb, resource)
    assert not controller.can_i("create", "serviceaccounts", "--subresource=token", "-n", NAMESPACE)
    assert not controller.can_i("list", "secrets", "--all-namespaces")
    assert controller.request("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets").status == 403
    assert not controller.can_i("create", "deployments.apps", "-n", NAMESPACE)
    assert not controller.can_i("escalate", "clusterroles.rbac.authorization.k8s.io")


def _eviction(controller: Identity, pod: str) -> Any:
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": POD_NS},
            "deleteOptions": {"dryRun": ["All"]}}
    return controller.request("POST", f"/api/v1/namespaces/{POD_NS}/pods/{pod}/eviction", body)


@pytest.fixture(scope="module")
def workload_pod(apiserver: Any) -> str:
    """A pod to evict (never scheduled: no scheduler runs here; the eviction is a dry run)."""
    apiserver.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": POD_NS}})
    apiserver.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default",
                                                                               "namespace": POD_NS}})
    name = "workload"
    if apiserver.request("GET", f"/api/v1/namespaces/{POD_NS}/pods/{name}").status == 404:
        apiserver.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": POD_NS},
                         "spec": {"automountServiceAccountToken": False,
                                  "containers": [{"name": "app", "image": "registry.invalid/app:1"}]}})
    return name


@pytest.fixture
def drain_rbac(apiserver: Any, controller: Identity) -> Iterator[None]:
    """components/controller-drain's grants applied for real, and removed again after the test."""
    apiserver.kubectl("apply", "-f", str(DRAIN_RBAC))
    wait_until(lambda: controller.can_i("create", "pods", "--subresource=eviction", "-n", POD_NS),
               "the drain grant to be in force")
    try:
        yield
    finally:
        apiserver.kubectl("delete", "-f", str(DRAIN_RBAC))
        wait_until(lambda: not controller.can_i("create", "pods", "--subresource=eviction", "-n", POD_NS),
                   "the drain grant to be gone")


def test_without_the_drain_component_it_cannot_evict(controller: Identity, workload_pod: str) -> None:
    assert not controller.can_i("create", "pods", "--subresource=eviction", "-n", POD_NS)
    for verb in ("get", "list", "delete"):
        assert not controller.can_i(verb, "pods", "-n", POD_NS), verb
    refused = _eviction(controller, workload_pod)
    assert refused.status == 403, f"{refused.status} {refused.message}"


def test_the_drain_component_grants_evictions_and_pod_reads_only(controller: Identity, workload_pod: str,
                                                                 drain_rbac: None) -> None:
    assert controller.can_i("create", "pods", "--subresource=eviction", "-n", POD_NS)
    assert controller.can_i("list", "pods", "--all-namespaces")
    assert controller.can_i("get", "pods", "-n", POD_NS)
    # Evictions only, so PodDisruptionBudgets hold: never a delete, nor a patch or exec.
    for verb in ("delete", "patch", "update", "watch"):
        assert not controller.can_i(verb, "pods", "-n", POD_NS), verb
    assert not controller.can_i("create", "pods", "--subresource=exec", "-n", POD_NS)
    evicted = _eviction(controller, workload_pod)
    assert evicted.status == 201, f"{evicted.status} {evicted.message}"
