"""manifests/base against a real kube-apiserver: server-side dry run, then RBAC + ValidatingAdmissionPolicy.

The plugin's service account, holding a token bound to a Pod on node A (what the kubelet projects
into the plugin's Pod), may patch annotations under `gpu-health.io/` on node A and nothing else:
not node B, not other annotations, labels, spec or status, and (with the node-condition overlay's
nodes/status grant) only the `GPUHealthy` condition. What the fleet controller owns on a Node (its record under
`controller.gpu-health.io/`, the quarantine taint, the cordon, its label) the plugin can neither add, change nor
remove, while the controller's own account, not matched by the policy, writes all of it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.conformance.apiserver.apiserver_peer import wait_until

pytestmark = [pytest.mark.conformance, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
BASE = REPO / "manifests" / "base"

NAMESPACE = "gpu-health-system"
SERVICE_ACCOUNT = "gpu-health-device-plugin"
SA_USER = f"system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}"
POLICY = "gpu-health-device-plugin-own-node-only"
NODE_A = "vap-node-a"
NODE_B = "vap-node-b"
POD_A = "gpu-health-device-plugin-vap-a"
PREFIX = "gpu-health.io/"
FOREIGN_ANNOTATION = ("example.com/owner", "ops-team")
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"

CONTENT_TYPES = {
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "json": "application/json-patch+json",
    "apply": "application/apply-patch+yaml",
}


def patch_node(apiserver, token, node, body, *, kind="merge", status=False, dry_run=False):
    path = f"/api/v1/nodes/{node}" + ("/status" if status else "")
    query = []
    if dry_run:
        query.append("dryRun=All")
    if kind == "apply":
        query += ["fieldManager=gpu-health-device-plugin", "force=true"]
    if query:
        path += "?" + "&".join(query)
    return apiserver.request("PATCH", path, body, token=token, content_type=CONTENT_TYPES[kind])


def get_node(apiserver, node):
    result = apiserver.request("GET", f"/api/v1/nodes/{node}")
    assert result.ok, result.message
    return result.body


def assert_denied(result, *fragments):
    assert result.status == 403, f"expected 403, got {result.status}: {result.message}"
    for fragment in fragments:
        assert fragment in result.message, f"{fragment!r} not in {result.message!r}"


def can_i(apiserver, token, verb, resource, subresource=""):
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": {"verb": verb, "resource": resource, "subresource": subresource}},
    }
    result = apiserver.request("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", review, token=token)
    return result.ok and result.body["status"].get("allowed", False)


@pytest.fixture(scope="module")
def deployed(apiserver):
    """Nodes A and B, manifests/base dry-run then applied, the plugin Pod on node A and its token."""
    for node in (NODE_A, NODE_B):
        apiserver.create_node(node, labels={"nvidia.com/gpu.present": "true"}, annotations=dict([FOREIGN_ANNOTATION]))

    # Server-side dry run of the whole base. A dry-run create of a namespaced object in a namespace
    # that does not exist yet fails with NotFound (the dry-run Namespace is not persisted), so the
    # Namespace is created first, on its own.
    apiserver.kubectl("apply", "-f", str(BASE / "namespace.yaml"))
    dry_run = apiserver.kubectl("apply", "--dry-run=server", "-k", str(BASE), check=False)
    leaked = apiserver.request("GET", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{SERVICE_ACCOUNT}")

    apiserver.kubectl("apply", "-k", str(BASE))
    apiserver.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": POD_A, "namespace": NAMESPACE},
            "spec": {
                "nodeName": NODE_A,
                "serviceAccountName": SERVICE_ACCOUNT,
                "containers": [{"name": "plugin", "image": "gpu-health-device-plugin:test"}],
            },
        }
    )
    token = apiserver.token_for_pod(NAMESPACE, SERVICE_ACCOUNT, POD_A)

    # RBAC and admission policies reach the authorizer and the admission plugin through informers:
    # wait until both are in force. The policy probe is a dry run, so node B is never written.
    wait_until(lambda: can_i(apiserver, token, "patch", "nodes"), "RBAC grant for the plugin")
    wait_until(
        lambda: (
            patch_node(
                apiserver, token, NODE_B, {"metadata": {"annotations": {PREFIX + "probe": "x"}}}, dry_run=True
            ).status
            == 403
        ),
        "the admission policy to be in force",
    )
    return {"dry_run": dry_run, "leaked": leaked, "token": token}


@pytest.fixture()
def token(deployed):
    return deployed["token"]


def test_versions(apiserver):
    out = json.loads(apiserver.kubectl("version", "-o", "json").stdout)
    assert out["serverVersion"]["gitVersion"] == "v1.37.2"
    assert out["clientVersion"]["gitVersion"] == "v1.37.2"
    assert apiserver.etcd_version, "etcd did not report its version"


def test_server_side_dry_run_accepts_base(deployed):
    dry_run = deployed["dry_run"]
    assert dry_run.returncode == 0, dry_run.stderr
    for kind_name in (
        "serviceaccount/gpu-health-device-plugin",
        "clusterrole.rbac.authorization.k8s.io/gpu-health-device-plugin",
        "clusterrolebinding.rbac.authorization.k8s.io/gpu-health-device-plugin",
        f"validatingadmissionpolicy.admissionregistration.k8s.io/{POLICY}",
        f"validatingadmissionpolicybinding.admissionregistration.k8s.io/{POLICY}",
    ):
        assert kind_name in dry_run.stdout and "(server dry run)" in dry_run.stdout, dry_run.stdout
    assert deployed["leaked"].status == 404, "the dry run created the ServiceAccount"


def test_policy_compares_every_node_status_field(apiserver):
    """The policy lists the status fields it freezes one by one (CEL cannot iterate an object's fields).
    A misspelt or missing field would silently compare "absent == absent", so check the list against
    the server's own NodeStatus schema: every field but `conditions` must be compared, and nothing else."""
    schema = apiserver.request("GET", "/openapi/v3/api/v1")
    assert schema.ok, schema.message
    properties = set(schema.body["components"]["schemas"]["io.k8s.api.core.v1.NodeStatus"]["properties"])
    policy_text = (BASE / "validatingadmissionpolicy.yaml").read_text()
    compared = set(re.findall(r"object\.\?status\.\?(\w+) == oldObject\.\?status\.\?\1\b", policy_text))
    assert compared == properties - {"conditions"}, (
        f"missing from the policy: {sorted(properties - {'conditions'} - compared)}; "
        f"not NodeStatus fields: {sorted(compared - properties)}"
    )


def test_pod_bound_token_carries_node_name(apiserver, token):
    user = apiserver.whoami(token)
    assert user["username"] == SA_USER
    assert user["extra"][NODE_NAME_EXTRA] == [NODE_A]


def test_own_node_prefixed_annotation_allowed_via_kubectl(apiserver, token):
    kubeconfig = apiserver.kubeconfig_for_token(token, "plugin-node-a")
    apiserver.kubectl(
        "patch",
        "node",
        NODE_A,
        "--type=merge",
        "-p",
        json.dumps({"metadata": {"annotations": {PREFIX + "gpu-0": "Healthy"}}}),
        kubeconfig=kubeconfig,
    )
    apiserver.kubectl(
        "annotate", "--overwrite", "node", NODE_A, PREFIX + "gpu-1=Unhealthy:xid-79", kubeconfig=kubeconfig
    )
    annotations = get_node(apiserver, NODE_A)["metadata"]["annotations"]
    assert annotations[PREFIX + "gpu-0"] == "Healthy"
    assert annotations[PREFIX + "gpu-1"] == "Unhealthy:xid-79"
    assert annotations[FOREIGN_ANNOTATION[0]] == FOREIGN_ANNOTATION[1]
    # ... and the plugin can read nodes.
    listed = apiserver.kubectl("get", "nodes", "-o", "name", kubeconfig=kubeconfig).stdout.split()
    assert f"node/{NODE_A}" in listed and f"node/{NODE_B}" in listed


@pytest.mark.parametrize("kind", ["merge", "strategic", "json", "apply"])
def test_own_node_prefixed_annotation_allowed_every_patch_type(apiserver, token, kind):
    key = PREFIX + f"via-{kind}"
    if kind == "json":
        body = [{"op": "add", "path": "/metadata/annotations/" + key.replace("/", "~1"), "value": "ok"}]
    elif kind == "apply":
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE_A, "annotations": {key: "ok"}}}
    else:
        body = {"metadata": {"annotations": {key: "ok"}}}
    result = patch_node(apiserver, token, NODE_A, body, kind=kind)
    assert result.ok, f"{result.status}: {result.message}"
    assert get_node(apiserver, NODE_A)["metadata"]["annotations"][key] == "ok"


def test_own_node_prefixed_annotation_removal_allowed(apiserver, token):
    key = PREFIX + "to-remove"
    assert patch_node(apiserver, token, NODE_A, {"metadata": {"annotations": {key: "x"}}}).ok
    result = patch_node(apiserver, token, NODE_A, {"metadata": {"annotations": {key: None}}})
    assert result.ok, result.message
    assert key not in get_node(apiserver, NODE_A)["metadata"]["annotations"]


def test_other_node_denied(apiserver, token):
    before = get_node(apiserver, NODE_B)["metadata"]
    result = patch_node(apiserver, token, NODE_B, {"metadata": {"annotations": {PREFIX + "gpu-0": "Healthy"}}})
    assert_denied(result, f"running on node {NODE_A} may not modify node {NODE_B}")
    after = get_node(apiserver, NODE_B)["metadata"]
    assert after["annotations"] == before["annotations"]
    assert after["resourceVersion"] == before["resourceVersion"]


def test_other_node_denied_via_kubectl(apiserver, token):
    kubeconfig = apiserver.kubeconfig_for_token(token, "plugin-node-a")
    proc = apiserver.kubectl("annotate", "node", NODE_B, PREFIX + "gpu-0=Healthy", kubeconfig=kubeconfig, check=False)
    assert proc.returncode != 0
    assert "Forbidden" in proc.stderr and f"may not modify node {NODE_B}" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "key",
    ["example.com/foo", "gpu-health.io.evil.com/foo", "sub.gpu-health.io/foo", "foo", "node.alpha.kubernetes.io/ttl"],
)
def test_annotation_outside_prefix_denied(apiserver, token, key):
    result = patch_node(apiserver, token, NODE_A, {"metadata": {"annotations": {key: "x", PREFIX + "ok": "y"}}})
    assert_denied(result, f"may only change annotations under {PREFIX}", key)
    assert key not in get_node(apiserver, NODE_A)["metadata"]["annotations"]


@pytest.mark.parametrize("value", [None, "someone-else"], ids=["remove", "change"])
def test_foreign_annotation_change_denied(apiserver, token, value):
    key = FOREIGN_ANNOTATION[0]
    result = patch_node(apiserver, token, NODE_A, {"metadata": {"annotations": {key: value}}})
    assert_denied(result, key)
    assert get_node(apiserver, NODE_A)["metadata"]["annotations"][key] == FOREIGN_ANNOTATION[1]


@pytest.mark.parametrize(
    "labels",
    [{"gpu-health.io/healthy": "true"}, {"nvidia.com/gpu.present": "false"}, {"nvidia.com/gpu.present": None}],
    ids=["add", "change", "remove"],
)
def test_label_change_denied(apiserver, token, labels):
    before = get_node(apiserver, NODE_A)["metadata"]["labels"]
    result = patch_node(apiserver, token, NODE_A, {"metadata": {"labels": labels}})
    assert_denied(result, "may not change a Node's labels")
    assert get_node(apiserver, NODE_A)["metadata"]["labels"] == before


@pytest.mark.parametrize(
    "spec",
    [
        {"unschedulable": True},
        {"taints": [{"key": "gpu-health.io/unhealthy", "value": "true", "effect": "NoSchedule"}]},
    ],
    ids=["cordon", "taint"],
)
def test_spec_change_denied(apiserver, token, spec):
    before = get_node(apiserver, NODE_A)["spec"]
    result = patch_node(apiserver, token, NODE_A, {"spec": spec})
    assert_denied(result, "may not change a Node's spec")
    assert get_node(apiserver, NODE_A)["spec"] == before


def test_token_without_pod_binding_denied(apiserver, deployed):
    unbound = apiserver.token_for_service_account(NAMESPACE, SERVICE_ACCOUNT)
    assert NODE_NAME_EXTRA not in (apiserver.whoami(unbound).get("extra") or {})
    result = patch_node(apiserver, unbound, NODE_A, {"metadata": {"annotations": {PREFIX + "gpu-0": "x"}}})
    assert_denied(result, "no node association")


def test_rbac_denies_everything_else(apiserver, token):
    assert_denied(apiserver.request("DELETE", f"/api/v1/nodes/{NODE_A}", token=token), "cannot delete")
    assert_denied(
        apiserver.request("PUT", f"/api/v1/nodes/{NODE_A}", get_node(apiserver, NODE_A), token=token), "cannot update"
    )
    new_node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "vap-node-new"}}
    assert_denied(apiserver.request("POST", "/api/v1/nodes", new_node, token=token), "cannot create")
    # nodes/status is only granted by the node-condition overlay.
    condition = {"status": {"conditions": [{"type": "GPUHealthy", "status": "True"}]}}
    assert_denied(patch_node(apiserver, token, NODE_A, condition, kind="strategic", status=True), "cannot patch")
    assert_denied(apiserver.request("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets", token=token), "cannot list")
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": "gpu-health-", "namespace": "default"},
        "involvedObject": {"kind": "Node", "name": NODE_A, "apiVersion": "v1"},
        "reason": "GPUUnhealthy",
        "message": "test",
        "type": "Warning",
        "source": {"component": "test"},
    }
    created = apiserver.request("POST", "/api/v1/namespaces/default/events", event, token=token)
    assert created.ok, created.message


def test_policy_leaves_other_users_alone(apiserver, deployed):
    """The policy only binds the plugin's service account: the admin can still relabel node B."""
    result = apiserver.request(
        "PATCH",
        f"/api/v1/nodes/{NODE_B}",
        {"metadata": {"labels": {"admin-touched": "yes"}}},
        content_type=CONTENT_TYPES["merge"],
    )
    assert result.ok, result.message


@pytest.fixture(scope="module")
def status_grant(apiserver, deployed):
    """What the node-condition overlay adds: nodes/status patch for the plugin's service account."""
    apiserver.apply(
        [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": "vap-test-node-status"},
                "rules": [{"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]}],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": "vap-test-node-status"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "vap-test-node-status",
                },
                "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}],
            },
        ]
    )
    token = deployed["token"]
    wait_until(lambda: can_i(apiserver, token, "patch", "nodes", "status"), "the nodes/status grant")
    return token


def gpu_condition(status="True"):
    return {
        "type": "GPUHealthy",
        "status": status,
        "reason": "AllGPUsHealthy" if status == "True" else "XID",
        "message": "8/8 GPUs healthy",
        "lastHeartbeatTime": "2026-01-01T00:00:00Z",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }


def test_status_gpuhealthy_condition_allowed(apiserver, status_grant):
    for status in ("True", "False"):
        result = patch_node(
            apiserver,
            status_grant,
            NODE_A,
            {"status": {"conditions": [gpu_condition(status)]}},
            kind="strategic",
            status=True,
        )
        assert result.ok, result.message
        conditions = {c["type"]: c for c in get_node(apiserver, NODE_A)["status"]["conditions"]}
        assert conditions["GPUHealthy"]["status"] == status
        assert conditions["Ready"]["status"] == "True"


@pytest.mark.parametrize(
    "status_patch,fragment",
    [
        ({"conditions": [{"type": "Ready", "status": "False", "reason": "GPUBroken"}]}, "Ready"),
        ({"conditions": [{"type": "MemoryPressure", "status": "True"}]}, "MemoryPressure"),
        ({"capacity": {"nvidia.com/gpu": "7"}}, "status other than the GPUHealthy condition"),
        ({"allocatable": {"nvidia.com/gpu": "0"}}, "status other than the GPUHealthy condition"),
    ],
    ids=["ready", "new-condition", "capacity", "allocatable"],
)
def test_status_other_fields_denied(apiserver, status_grant, status_patch, fragment):
    before = get_node(apiserver, NODE_A)["status"]
    result = patch_node(apiserver, status_grant, NODE_A, {"status": status_patch}, kind="strategic", status=True)
    assert_denied(result, fragment)
    assert get_node(apiserver, NODE_A)["status"] == before


def test_status_other_node_denied(apiserver, status_grant):
    result = patch_node(
        apiserver, status_grant, NODE_B, {"status": {"conditions": [gpu_condition()]}}, kind="strategic", status=True
    )
    assert_denied(result, f"may not modify node {NODE_B}")


def test_status_subresource_cannot_smuggle_metadata(apiserver, status_grant):
    result = patch_node(
        apiserver, status_grant, NODE_A, {"metadata": {"labels": {"smuggled": "yes"}}}, kind="merge", status=True
    )
    assert_denied(result, "labels")


# What the fleet controller owns on a Node is out of the plugin's reach ---------------------------------------------
# The controller keeps its record under its own prefix, `controller.gpu-health.io/` (quarantined-by, quarantine-owns,
# ...), and acts on it: a node agent that could write it could have the controller uncordon a node an operator
# cordoned. The policy admits only annotations under `gpu-health.io/`, so the plugin's own token can write its state
# and is refused on the controller's record, on the quarantine taint, the cordon and labels.

CONTROLLER_PREFIX = "controller.gpu-health.io/"
CONTROLLER_RECORD = {CONTROLLER_PREFIX + "quarantined-by": "gpu-health-controller",
                     CONTROLLER_PREFIX + "quarantine-owns": "taint"}
QUARANTINE_TAINT = {"key": PREFIX + "quarantine", "value": "xid-79", "effect": "NoSchedule"}


def admin_patch(apiserver, node, body):
    result = apiserver.request("PATCH", f"/api/v1/nodes/{node}", body, content_type=CONTENT_TYPES["merge"])
    assert result.ok, result.message
    return result.body


def test_own_state_annotation_allowed(apiserver, token):
    key = PREFIX + "state"
    for value in ("Unhealthy", "Healthy", None):
        result = patch_node(apiserver, token, NODE_A, {"metadata": {"annotations": {key: value}}})
        assert result.ok, f"{value}: {result.status} {result.message}"
        assert get_node(apiserver, NODE_A)["metadata"].get("annotations", {}).get(key) == value


@pytest.mark.parametrize("key", sorted(CONTROLLER_RECORD))
@pytest.mark.parametrize("change", ["add", "modify", "remove"])
def test_controller_record_refused(apiserver, token, key, change):
    # The operator's (or the controller's) value, where there is one to modify or remove.
    admin_patch(apiserver, NODE_A, {"metadata": {"annotations": {key: None if change == "add" else "taint"}}})
    before = get_node(apiserver, NODE_A)["metadata"]
    forged = {"add": CONTROLLER_RECORD[key], "modify": "taint,cordon", "remove": None}[change]
    # Beside a key the plugin may write, so it is the controller's key alone that is refused.
    body = {"metadata": {"annotations": {key: forged, PREFIX + "state": "Healthy"}}}
    assert_denied(patch_node(apiserver, token, NODE_A, body), f"may only change annotations under {PREFIX}", key)
    after = get_node(apiserver, NODE_A)["metadata"]
    assert after["annotations"] == before["annotations"]
    assert after["resourceVersion"] == before["resourceVersion"]
    admin_patch(apiserver, NODE_A, {"metadata": {"annotations": {key: None}}})


@pytest.fixture()
def quarantined_by_hand(apiserver):
    """Node A cordoned and tainted as a quarantine (by the admin: an operator or the controller); restored after."""
    admin_patch(apiserver, NODE_A, {"spec": {"unschedulable": True, "taints": [QUARANTINE_TAINT]}})
    yield get_node(apiserver, NODE_A)["spec"]
    admin_patch(apiserver, NODE_A, {"spec": {"unschedulable": None, "taints": None}})


@pytest.mark.parametrize(
    "spec",
    [{"unschedulable": None}, {"unschedulable": False}, {"taints": None}, {"taints": []},
     {"taints": [{**QUARANTINE_TAINT, "value": "released"}]}],
    ids=["uncordon-remove", "uncordon-false", "untaint-remove", "untaint-empty", "taint-change"],
)
def test_quarantine_taint_and_cordon_cannot_be_undone(apiserver, token, quarantined_by_hand, spec):
    result = patch_node(apiserver, token, NODE_A, {"spec": spec})
    assert_denied(result, "may not change a Node's spec")
    assert get_node(apiserver, NODE_A)["spec"] == quarantined_by_hand


def test_quarantine_taint_cannot_be_added(apiserver, token):
    before = get_node(apiserver, NODE_A)["spec"]
    result = patch_node(apiserver, token, NODE_A, {"spec": {"taints": [QUARANTINE_TAINT]}})
    assert_denied(result, "may not change a Node's spec")
    assert get_node(apiserver, NODE_A)["spec"] == before


@pytest.mark.parametrize("change", ["add", "remove"])
def test_quarantine_label_refused(apiserver, token, change):
    label = PREFIX + "quarantined"
    admin_patch(apiserver, NODE_A, {"metadata": {"labels": {label: None if change == "add" else "true"}}})
    before = get_node(apiserver, NODE_A)["metadata"]["labels"]
    result = patch_node(apiserver, token, NODE_A,
                        {"metadata": {"labels": {label: "true" if change == "add" else None}}})
    assert_denied(result, "may not change a Node's labels")
    assert get_node(apiserver, NODE_A)["metadata"]["labels"] == before
    admin_patch(apiserver, NODE_A, {"metadata": {"labels": {label: None}}})


@pytest.fixture(scope="module")
def controller_token(apiserver, deployed):
    """The controller's grant (components/controller/clusterrole.yaml) bound to an account of its name: the
    plugin's policy, in force (the `deployed` fixture), must not match it."""
    ns, name, role = "vap-controller", "gpu-health-controller", "vap-test-controller"
    rules = yaml.safe_load((REPO / "manifests" / "components" / "controller" / "clusterrole.yaml").read_text())["rules"]
    apiserver.apply([
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": role},
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": role},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]},
    ])
    token = apiserver.token_for_service_account(ns, name)
    wait_until(lambda: can_i(apiserver, token, "patch", "nodes"), "the controller's RBAC grant")
    return token


@pytest.mark.parametrize("node", [NODE_A, NODE_B])
def test_the_controller_writes_its_record_taint_cordon_and_label(apiserver, controller_token, node):
    patch = {"metadata": {"labels": {PREFIX + "quarantined": "true"}, "annotations": CONTROLLER_RECORD},
             "spec": {"unschedulable": True, "taints": [QUARANTINE_TAINT]}}
    result = patch_node(apiserver, controller_token, node, patch, dry_run=True)
    assert result.ok, f"{result.status} {result.message}"
    assert result.body["metadata"]["annotations"].items() >= CONTROLLER_RECORD.items()
    assert result.body["spec"]["taints"] == [QUARANTINE_TAINT]
    assert result.body["spec"]["unschedulable"] is True
