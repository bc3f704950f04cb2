"""The pod-status admission policy (manifests/base/podstatuspolicy.yaml) on a real kube-apiserver, with the plugin's
own Pod-bound token.

DRA mode's grant (components/dra/rbac.yaml) lets the plugin's account patch the status of every pod in the cluster;
the policy confines that to the plugin's own condition (`gpu-health.io/DevicesHealthy`) on the pods of its own node.
Here the grant is bound as shipped (its rules and the base ClusterRole's, bound to a service account of the plugin's
name in a namespace of this module's own) and the policy is applied as shipped. The plugin's own client call
(KubeClient.patch_pod_status_condition, with the condition body plugin/dra/podstatus.py builds) writes and rewrites
its condition on a pod of node A, leaving the kubelet's conditions and every other field as they were. A pod of
another node or of none, any other condition, any other status field, the labels, annotations and finalizers
(which the pods/status subresource does store: shown here with the admin's account), and every write without a
node association are refused with a message naming what was refused, and the stored pod stays as it was; a pod
made again under the same name is not written (409, the UID precondition).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plugin.dra.podstatus import PodConditionSettings, Verdict, Written, condition_body
from plugin.kube.client import KubeClient
from plugin.kube.errors import ApiFailure
from tests.conformance.apiserver.apiserver_peer import wait_until
from tests.conformance.apiserver.shipped_rbac import dra_grants

pytestmark = [pytest.mark.conformance, pytest.mark.slow]

MANIFESTS = Path(__file__).resolve().parents[3] / "manifests"
POLICY_FILE = MANIFESTS / "base" / "podstatuspolicy.yaml"
NAMESPACE = "pss-test"  # the plugin's own; not manifests/base's namespace, which other modules apply and check
APPS = "pss-apps"  # the pods that got GPUs: any namespace
SERVICE_ACCOUNT = "gpu-health-device-plugin"
NODE_A = "pss-node-a"
NODE_B = "pss-node-b"
PLUGIN_POD = "gpu-health-device-plugin-pss-a"
SETTINGS = PodConditionSettings()
OURS = SETTINGS.condition_type
STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
T0 = "2026-01-01T00:00:00Z"

# What a kubelet has written to a running pod's status by the time the plugin looks at it.
KUBELET_CONDITIONS = [
    {"type": t, "status": "True", "lastProbeTime": None, "lastTransitionTime": T0}
    for t in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled")
]
KUBELET_STATUS: dict[str, Any] = {
    "phase": "Running",
    "conditions": KUBELET_CONDITIONS,
    "hostIP": "192.168.0.10", "hostIPs": [{"ip": "192.168.0.10"}],
    "podIP": "10.1.0.5", "podIPs": [{"ip": "10.1.0.5"}],
    "startTime": T0,
    "containerStatuses": [{
        "name": "app", "ready": True, "started": True, "restartCount": 0, "image": "registry.example/app:1",
        "imageID": "registry.example/app@sha256:" + "0" * 64, "containerID": "containerd://" + "a" * 64,
        "state": {"running": {"startedAt": T0}}}],
}


def assert_denied(result: Any, *fragments: str) -> None:
    assert result.status == 403, f"expected 403, got {result.status}: {result.message[:300]}"
    assert "ValidatingAdmissionPolicy" in result.message, result.message  # the policy's, not RBAC's
    for fragment in fragments:
        assert fragment in result.message, f"{fragment!r} not in {result.message!r}"


def pod_path(name: str, namespace: str = APPS) -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


def our_condition(status: str = "True", reason: str = "Healthy", message: str = "gpu-0 Healthy",
                  transition: str = T0) -> dict[str, str]:
    """The condition as the plugin's writer builds it."""
    return condition_body(SETTINGS, Written(Verdict(status, reason, message), transition))


class Pods:
    """Pods of APPS, made and read as the admin; the status the kubelet would have written put on them."""

    def __init__(self, apiserver: Any) -> None:
        self.apiserver = apiserver

    def get(self, name: str) -> dict[str, Any] | None:
        r = self.apiserver.request("GET", pod_path(name))
        if r.status == 404:
            return None
        assert r.ok, r.message
        return dict(r.body)

    def delete(self, name: str) -> None:
        # No kubelet confirms a graceful delete here: gone at once, or it would linger with a deletionTimestamp.
        r = self.apiserver.request("DELETE", pod_path(name) + "?gracePeriodSeconds=0")
        assert r.ok or r.status == 404, r.message
        wait_until(lambda: self.get(name) is None, f"pod {name} to be gone")

    def running(self, name: str, node: str | None) -> dict[str, Any]:
        """A fresh pod ``name`` bound to ``node`` (None: not scheduled yet) with a running pod's status."""
        if self.get(name) is not None:
            self.delete(name)
        spec: dict[str, Any] = {"containers": [{"name": "app", "image": "registry.example/app:1"}],
                                "automountServiceAccountToken": False}
        if node is not None:
            spec["nodeName"] = node
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": APPS, "labels": {"app": "trainer"},
                             "annotations": {"example.com/owner": "team-a"}},
                "spec": spec}
        r = self.apiserver.request("POST", f"/api/v1/namespaces/{APPS}/pods", body)
        assert r.ok, r.message
        status = KUBELET_STATUS if node is not None else {
            "phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                                "lastProbeTime": None, "lastTransitionTime": T0}]}
        r = self.apiserver.request("PATCH", pod_path(name) + "/status", {"status": status}, content_type=MERGE)
        assert r.ok, r.message
        return dict(r.body)


def deploy(apiserver: Any) -> dict[str, Any]:
    """Nodes A and B, the DRA grant and the policy as shipped, the plugin's Pod on node A and its token."""
    for name in (NODE_A, NODE_B):
        apiserver.create_node(name)
    objs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": APPS}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": SERVICE_ACCOUNT, "namespace": NAMESPACE}},
        # No controller-manager makes it here; the ServiceAccount admission plugin wants it for the workloads.
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": APPS}},
    ]
    objs += dra_grants("pss-test", SERVICE_ACCOUNT, NAMESPACE)
    apiserver.apply(objs)
    # The policy exactly as shipped (it matches the service-account name in any namespace).
    apiserver.kubectl("apply", "-f", str(POLICY_FILE))
    apiserver.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": PLUGIN_POD, "namespace": NAMESPACE},
                     "spec": {"nodeName": NODE_A, "serviceAccountName": SERVICE_ACCOUNT,
                              "containers": [{"name": "plugin", "image": "gpu-health-device-plugin:test"}]}})
    token = str(apiserver.token_for_pod(NAMESPACE, SERVICE_ACCOUNT, PLUGIN_POD))
    pods = Pods(apiserver)

    # The plugin's account may patch every pod's status as far as RBAC goes: what stops it below is the policy
    # alone. A dry run: the probe pod on node B is never written.
    pods.running("pss-probe-b", NODE_B)
    probe = {"metadata": {}, "status": {"conditions": [our_condition()]}}

    def policy_in_force() -> bool:
        r = apiserver.request("PATCH", pod_path("pss-probe-b") + "/status?dryRun=All", probe, token=token,
                              content_type=STRATEGIC)
        return r.status == 403 and "ValidatingAdmissionPolicy" in r.message

    wait_until(policy_in_force, "the RBAC grant and the admission policy to be in force")
    return {"token": token, "pods": pods,
            "kubeconfig": apiserver.kubeconfig_for_token(token, "plugin-pss-a")}


@pytest.fixture(scope="module")
def deployed(apiserver: Any) -> dict[str, Any]:
    return deploy(apiserver)


@pytest.fixture()
def token(deployed: dict[str, Any]) -> str:
    return str(deployed["token"])


@pytest.fixture()
def pods(deployed: dict[str, Any]) -> Pods:
    p: Pods = deployed["pods"]
    return p


@pytest.fixture()
def plugin(deployed: dict[str, Any]) -> Iterator[KubeClient]:
    """The plugin's own client, through its token."""
    client = KubeClient(deployed["kubeconfig"])
    yield client
    client.close()


def conditions(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod["status"].get("conditions") or [])


def ours(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in conditions(pod) if c["type"] == OURS]


def others(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in conditions(pod) if c["type"] != OURS]


def as_stored(condition: dict[str, str]) -> dict[str, Any]:
    """A condition as the server gives it back (a pod condition always carries lastProbeTime, null here)."""
    return {"lastProbeTime": None, **condition}


def without_ours(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod with our condition and what every write moves (resourceVersion, managedFields) taken out."""
    p = copy.deepcopy(pod)
    for k in ("resourceVersion", "managedFields"):
        p["metadata"].pop(k, None)
    p["status"]["conditions"] = [c for c in conditions(p) if c["type"] != OURS]
    return p


def patch_status(apiserver: Any, name: str, body: dict[str, Any], token: str,
                 content_type: str = STRATEGIC) -> Any:
    return apiserver.request("PATCH", pod_path(name) + "/status", body, token=token, content_type=content_type)


# The policy as the server sees it ----------------------------------------------------------------------------

def test_the_policy_compares_every_pod_status_field(apiserver: Any) -> None:
    """CEL cannot iterate an object's fields, so the policy lists the status fields it freezes one by one, each
    named in its refusal. A misspelt or missing one would compare "absent == absent" and let a change through:
    the list must be the server's own PodStatus fields but `conditions` (judged by type), nothing more or less."""
    schema = apiserver.request("GET", "/openapi/v3/api/v1")
    assert schema.ok, schema.message
    properties = set(schema.body["components"]["schemas"]["io.k8s.api.core.v1.PodStatus"]["properties"])
    text = POLICY_FILE.read_text()
    compared = set(re.findall(r"object\.\?status\.\?(\w+)\s*==\s*oldObject\.\?status\.\?\1\s*\?\s*\[\]\s*:"
                              r"\s*\['\1'\]", text))
    assert compared == properties - {"conditions"}, (
        f"missing from the policy: {sorted(properties - {'conditions'} - compared)}; "
        f"not PodStatus fields: {sorted(compared - properties)}")


# What the plugin does is let through --------------------------------------------------------------------------

def test_the_plugin_writes_and_rewrites_its_condition_on_a_pod_of_its_node(pods: Pods, plugin: KubeClient) -> None:
    before = pods.running("pss-a-written", NODE_A)
    uid = before["metadata"]["uid"]
    plugin.patch_pod_status_condition(APPS, "pss-a-written", uid, our_condition())
    stored = pods.get("pss-a-written")
    assert stored is not None
    # Ours is there once; the kubelet's conditions stay as they were, in their order, and nothing else moved (the
    # merge puts a new condition first; where does not matter to anyone who reads conditions by type).
    assert ours(stored) == [as_stored(our_condition())]
    assert others(stored) == KUBELET_CONDITIONS
    assert without_ours(stored) == without_ours(before)

    # The verdict changes: status, reason, message and transition time, in place.
    worse = our_condition("False", "Unhealthy", "gpu-0 Unhealthy: xid-79: fell off the bus", "2026-01-01T00:10:00Z")
    plugin.patch_pod_status_condition(APPS, "pss-a-written", uid, worse)
    stored = pods.get("pss-a-written")
    assert stored is not None
    assert ours(stored) == [as_stored(worse)]
    assert others(stored) == KUBELET_CONDITIONS
    assert without_ours(stored) == without_ours(before)


def test_other_accounts_are_not_judged(apiserver: Any, pods: Pods) -> None:
    # The admin (and so the kubelet, the scheduler, the disruption controller) writes any condition as before.
    before = pods.running("pss-a-admin", NODE_A)
    ready = [{**c, "status": "False"} if c["type"] == "Ready" else c for c in KUBELET_CONDITIONS]
    r = patch_status(apiserver, "pss-a-admin", {"status": {"conditions": [*ready, our_condition()]}}, "admin",
                     MERGE)
    assert r.ok, r.message
    stored = pods.get("pss-a-admin")
    assert stored is not None and conditions(stored) == [*ready, as_stored(our_condition())]
    assert stored["metadata"]["uid"] == before["metadata"]["uid"]


# What it must not do is refused --------------------------------------------------------------------------------

def test_a_pod_of_another_node_is_refused(apiserver: Any, token: str, pods: Pods, plugin: KubeClient) -> None:
    before = pods.running("pss-b-pod", NODE_B)
    with pytest.raises(ApiFailure) as exc:
        plugin.patch_pod_status_condition(APPS, "pss-b-pod", before["metadata"]["uid"], our_condition())
    assert exc.value.status == 403
    assert_denied(patch_status(apiserver, "pss-b-pod", {"status": {"conditions": [our_condition()]}}, token),
                  f"running on node {NODE_A} may not write the status of pod {APPS}/pss-b-pod of node {NODE_B}")
    assert pods.get("pss-b-pod") == before


def test_a_pod_of_no_node_is_refused(apiserver: Any, token: str, pods: Pods) -> None:
    before = pods.running("pss-unbound-pod", None)
    assert_denied(patch_status(apiserver, "pss-unbound-pod", {"status": {"conditions": [our_condition()]}}, token),
                  f"running on node {NODE_A} may not write the status of pod {APPS}/pss-unbound-pod of no node")
    assert pods.get("pss-unbound-pod") == before


def _ready(status: str) -> dict[str, Any]:
    return {"type": "Ready", "status": status, "reason": "Forged", "lastTransitionTime": "2026-01-01T00:05:00Z"}


# Each refused change: (patch type, body, what the refusal names).
REFUSED: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "another-condition": (STRATEGIC, {"status": {"conditions": [_ready("False")]}},
                          (f"may only change the pod condition {OURS}; it changed: Ready",)),
    "another-condition-with-ours": (STRATEGIC, {"status": {"conditions": [our_condition(), _ready("False")]}},
                                    (f"may only change the pod condition {OURS}; it changed: Ready",)),
    "another-condition-removed": (STRATEGIC, {"status": {"conditions": [{"type": "Ready", "$patch": "delete"}]}},
                                  ("it changed: Ready",)),
    "a-new-condition": (STRATEGIC, {"status": {"conditions": [
        {"type": "example.com/Healthy", "status": "True", "lastTransitionTime": T0}]}},
                        ("it changed: example.com/Healthy",)),
    "pod-ip": (MERGE, {"status": {"podIP": "10.9.9.9", "podIPs": [{"ip": "10.9.9.9"}]}},
               (f"may only change the pod condition {OURS} in a pod status, not status.podIP, status.podIPs",)),
    "phase": (MERGE, {"status": {"phase": "Failed"}}, ("not status.phase",)),
    "container-statuses": (MERGE, {"status": {"containerStatuses": [
        {**KUBELET_STATUS["containerStatuses"][0], "ready": False, "restartCount": 7}]}},
                           ("not status.containerStatuses",)),
    "message-and-reason": (MERGE, {"status": {"message": "forged", "reason": "Evicted"}},
                           ("not status.message, status.reason",)),
    "label": (MERGE, {"metadata": {"labels": {"app": "other"}}},
              ("may not change a pod's metadata.labels through its status",)),
    "annotation": (MERGE, {"metadata": {"annotations": {"example.com/owner": None, "example.com/x": "y"}}},
                   ("may not change a pod's metadata.annotations through its status",)),
    "finalizer": (MERGE, {"metadata": {"finalizers": ["example.com/hold"]}},
                  ("may not change a pod's metadata.finalizers through its status",)),
    "label-with-ours": (STRATEGIC, {"metadata": {"labels": {"example.com/gpu": "bad"}},
                                    "status": {"conditions": [our_condition()]}},
                        ("metadata.labels",)),
}


@pytest.mark.parametrize("change", REFUSED, ids=list(REFUSED))
def test_anything_but_its_condition_is_refused_on_a_pod_of_its_own_node(apiserver: Any, token: str, pods: Pods,
                                                                        change: str) -> None:
    content_type, body, says = REFUSED[change]
    name = f"pss-a-{change}"
    before = pods.running(name, NODE_A)
    # Valid as such: the admin's dry run of the same request passes, so what refuses the plugin is the policy.
    admin = apiserver.request("PATCH", pod_path(name) + "/status?dryRun=All", body, content_type=content_type)
    assert admin.ok, admin.message
    assert_denied(patch_status(apiserver, name, body, token, content_type), *says)
    assert pods.get(name) == before


def test_metadata_through_the_status_subresource_is_stored_for_the_admin(apiserver: Any, pods: Pods) -> None:
    # Why the policy judges labels, annotations and finalizers at all: this server keeps them when they come
    # through pods/status (only the spec, ownerReferences and deletionTimestamp are reset to the stored ones).
    pods.running("pss-a-metadata", NODE_A)
    body = {"metadata": {"labels": {"app": "other"}, "annotations": {"example.com/x": "y"},
                         "finalizers": ["example.com/hold"]}, "spec": {"activeDeadlineSeconds": 5}}
    r = patch_status(apiserver, "pss-a-metadata", body, "admin", MERGE)
    assert r.ok, r.message
    stored = pods.get("pss-a-metadata")
    assert stored is not None
    assert stored["metadata"]["labels"] == {"app": "other"}
    assert stored["metadata"]["annotations"]["example.com/x"] == "y"
    assert stored["metadata"]["finalizers"] == ["example.com/hold"]
    assert "activeDeadlineSeconds" not in stored["spec"]  # the spec: ignored on this subresource
    r = apiserver.request("PATCH", pod_path("pss-a-metadata"), {"metadata": {"finalizers": None}}, content_type=MERGE)
    assert r.ok, r.message


def test_the_spec_through_the_status_subresource_is_ignored(apiserver: Any, token: str, pods: Pods) -> None:
    # The server puts the stored spec back before the policy sees the pod: nothing changes, nothing is refused.
    before = pods.running("pss-a-spec", NODE_A)
    r = patch_status(apiserver, "pss-a-spec", {"spec": {"activeDeadlineSeconds": 5}}, token, MERGE)
    assert r.ok, r.message
    assert pods.get("pss-a-spec") == before


def test_a_pod_made_again_under_the_name_is_not_written(pods: Pods, plugin: KubeClient) -> None:
    old = pods.running("pss-a-again", NODE_A)
    new = pods.running("pss-a-again", NODE_A)  # deleted and made again: another UID
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    with pytest.raises(ApiFailure) as exc:
        plugin.patch_pod_status_condition(APPS, "pss-a-again", old["metadata"]["uid"], our_condition())
    # A PATCH carries no storage precondition: the UID in it reaches validation, and v1.37.2 answers 422
    # (metadata.uid: field is immutable), not the 409 a PUT's or a DELETE's UID precondition gets. Either way
    # nothing is written, and neither is the policy's doing (its refusals are 403).
    assert exc.value.status in (409, 422), exc.value
    if exc.value.status == 422:
        assert "metadata.uid" in exc.value.message and "immutable" in exc.value.message, exc.value
    assert pods.get("pss-a-again") == new


def test_a_token_without_node_association_is_refused(apiserver: Any, pods: Pods) -> None:
    unbound = apiserver.token_for_service_account(NAMESPACE, SERVICE_ACCOUNT)
    assert "authentication.kubernetes.io/node-name" not in (apiserver.whoami(unbound).get("extra") or {})
    before = pods.running("pss-a-unbound-token", NODE_A)
    body = {"metadata": {"uid": before["metadata"]["uid"]}, "status": {"conditions": [our_condition()]}}
    assert_denied(patch_status(apiserver, "pss-a-unbound-token", body, unbound), "no node association")
    assert pods.get("pss-a-unbound-token") == before
