"""Every object of manifests/base and of each overlay, applied with --dry-run=server to a real kube-apiserver.

A server-side dry run goes through the API server's decoding (strict field validation: an unknown or duplicated
field is an error), defaulting, validation and admission, and persists nothing. The pod the DaemonSet would create
is dry-run too, as a Pod bound to a node: that is where Pod Security admission (the Namespace's level must allow
hostPath volumes), the priority class and the runtime class are checked.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = [pytest.mark.conformance]

REPO = Path(__file__).resolve().parents[3]
MANIFESTS = REPO / "manifests"
VARIANTS = {
    "base": MANIFESTS / "base",
    "annotations-off": MANIFESTS / "overlays" / "annotations-off",
    "node-condition": MANIFESTS / "overlays" / "node-condition",
    "cdi": MANIFESTS / "overlays" / "cdi",
    "remediation": MANIFESTS / "overlays" / "remediation",
    "surge-upgrade": MANIFESTS / "overlays" / "surge-upgrade",
    # DRA mode (docs/dra.md): its DeviceClass and grants on the server's resource.k8s.io/v1.
    "dra": MANIFESTS / "overlays" / "dra",
}
NAMESPACE = "gpu-health-system"
NAME = "gpu-health-device-plugin"


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


@pytest.fixture(scope="module")
def namespace(apiserver) -> str:
    # A dry-run create of a namespaced object in a Namespace that does not exist fails with NotFound (the
    # dry-run Namespace is not persisted), so the Namespace is created for real first, as docs/deploy.md says.
    apiserver.kubectl("apply", "-f", str(MANIFESTS / "base" / "namespace.yaml"))
    # Service-account admission looks the account up when a Pod is created, even in a dry run.
    apiserver.kubectl("apply", "-f", str(MANIFESTS / "base" / "serviceaccount.yaml"))
    # The GPU Operator (or the operator by hand) creates the runtime class the DaemonSet names.
    apiserver.apply({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"},
                     "handler": "nvidia"})
    return NAMESPACE


@pytest.fixture(scope="module")
def rendered(apiserver) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for variant, path in VARIANTS.items():
        text = apiserver.kubectl("kustomize", str(path)).stdout
        out[variant] = [d for d in yaml.safe_load_all(text) if d]
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_passes_a_server_side_dry_run(apiserver, namespace, rendered, variant: str) -> None:
    result = apiserver.kubectl("apply", "--dry-run=server", "--validate=strict", "-k", str(VARIANTS[variant]),
                               "-o", "json", check=False)
    assert result.returncode == 0, f"{variant}: {result.stderr}"
    doc = json.loads(result.stdout)
    returned = {_key(o): o for o in (doc["items"] if doc.get("kind") == "List" else [doc])}
    expected = {_key(o): o for o in rendered[variant]}
    assert returned.keys() == expected.keys(), f"{variant}: the server answered for {sorted(returned)}"
    # The server kept what matters (nothing dropped as unknown, nothing rewritten).
    ds_sent, ds_back = expected[("DaemonSet", NAME)], returned[("DaemonSet", NAME)]
    sent_pod, back_pod = ds_sent["spec"]["template"]["spec"], ds_back["spec"]["template"]["spec"]
    assert back_pod["containers"][0]["securityContext"] == sent_pod["containers"][0]["securityContext"]
    assert back_pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert back_pod["containers"][0]["args"] == sent_pod["containers"][0]["args"]
    assert back_pod.get("automountServiceAccountToken") == sent_pod.get("automountServiceAccountToken")
    assert ds_back["spec"]["updateStrategy"] == ds_sent["spec"]["updateStrategy"]
    if ("ClusterRole", NAME) in expected:
        assert returned[("ClusterRole", NAME)]["rules"] == expected[("ClusterRole", NAME)]["rules"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_daemonsets_pod_is_admitted_on_a_gpu_node(apiserver, namespace, rendered, variant: str) -> None:
    ds = next(o for o in rendered[variant] if o["kind"] == "DaemonSet")
    node = f"manifests-gpu-node-{variant}"
    if apiserver.request("GET", f"/api/v1/nodes/{node}").status == 404:
        apiserver.create_node(node, labels={"nvidia.com/gpu.present": "true"})
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": f"{NAME}-{variant}", "namespace": NAMESPACE,
                        "labels": ds["spec"]["template"]["metadata"]["labels"]},
           "spec": copy.deepcopy(ds["spec"]["template"]["spec"])}
    pod["spec"]["nodeName"] = node
    result = apiserver.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods?dryRun=All&fieldValidation=Strict",
                               pod)
    assert result.ok, f"{variant}: {result.status} {result.message}"
    admitted = result.body["spec"]
    # Priority admission resolved the class; a system-node-critical pod outranks every workload.
    assert admitted["priorityClassName"] == "system-node-critical"
    assert admitted["priority"] == 2000001000
    assert admitted["runtimeClassName"] == "nvidia"
    # Without a token there is no API access at all (annotations-off); otherwise the projected token is mounted.
    mounts = {m["mountPath"] for m in admitted["containers"][0]["volumeMounts"]}
    token_path = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert (token_path in mounts) is (variant != "annotations-off")


def test_pod_security_would_refuse_the_pod_in_a_baseline_namespace(apiserver, namespace, rendered) -> None:
    # Guards the test above: Pod Security admission is active on this server, and the hostPath volumes are why
    # the Namespace is labelled privileged.
    ns = "manifests-baseline-check"
    apiserver.apply({"apiVersion": "v1", "kind": "Namespace",
                     "metadata": {"name": ns, "labels": {"pod-security.kubernetes.io/enforce": "baseline"}}})
    # No controller-manager runs here to create the Namespace's default service account.
    apiserver.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": ns}})
    ds = next(o for o in rendered["base"] if o["kind"] == "DaemonSet")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "baseline-check", "namespace": ns},
           "spec": copy.deepcopy(ds["spec"]["template"]["spec"])}
    pod["spec"]["serviceAccountName"] = "default"
    pod["spec"]["automountServiceAccountToken"] = False
    result = apiserver.request("POST", f"/api/v1/namespaces/{ns}/pods?dryRun=All", pod)
    assert result.status == 403, f"{result.status} {result.message}"
    assert "hostPath" in result.message


# docs/deploy.md's uninstall commands, run as written (limited to this test's node by a label selector) -----------

def _snippet(marker: str) -> str:
    doc = (REPO / "docs" / "deploy.md").read_text()
    start = doc.index(f"<!-- {marker} -->")
    body = doc[start:].split("```sh\n", 1)[1].split("```", 1)[0]
    return body.strip()


def _run_snippet(apiserver, script: str, selector: str) -> None:
    # The shared server holds other tests' nodes: narrow "every node" to ours, and change nothing else.
    assert script.count("kubectl get nodes") == 1, script
    script = script.replace("kubectl get nodes", f"kubectl get nodes -l {selector}")
    env = dict(os.environ, KUBECONFIG=str(apiserver.kubeconfig),
               PATH=f"{Path(apiserver.kubectl_path).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(["bash", "-eo", "pipefail", "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"{script}\n{proc.stdout}\n{proc.stderr}"


def test_uninstall_commands_remove_our_annotations_and_condition(apiserver) -> None:
    if shutil.which("jq") is None:
        pytest.skip("jq is not installed (docs/deploy.md's annotation one-liner uses it)")
    label = "gpu-health-uninstall-test"
    nodes = ["manifests-uninstall-a", "manifests-uninstall-b"]
    ours = {"gpu-health.io/summary": "{}", "gpu-health.io/gpu-0": "{\"state\":\"Unhealthy\"}",
            "gpu-health.io/schema": "v1"}
    foreign = {"example.com/owner": "ops", "gpu-health.io.evil.com/x": "keep", "sub.gpu-health.io/y": "keep"}
    for n in nodes:
        apiserver.create_node(n, labels={label: "true"}, annotations={**ours, **foreign})
        status = {"status": {"conditions": [
            {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ready"},
            {"type": "GPUHealthy", "status": "False", "reason": "DeviceUnhealthy", "message": "GPU-1: xid-79"}]}}
        result = apiserver.request("PATCH", f"/api/v1/nodes/{n}/status", status,
                                   content_type="application/merge-patch+json")
        assert result.ok, result.message

    _run_snippet(apiserver, _snippet("uninstall-annotations"), f"{label}=true")
    _run_snippet(apiserver, _snippet("uninstall-condition"), f"{label}=true")

    for n in nodes:
        node = apiserver.request("GET", f"/api/v1/nodes/{n}").body
        annotations = node["metadata"].get("annotations", {})
        assert not [k for k in annotations if k.startswith("gpu-health.io/")], annotations
        assert {k: annotations.get(k) for k in foreign} == foreign
        assert [c["type"] for c in node["status"]["conditions"]] == ["Ready"]


# The Helm chart's rendering (charts/gpu-health-device-plugin), everything on that needs no CRD ----------------------

CHART_ALL_ON = ("controller.enabled=true,controller.drain=true,remediation.enabled=true,nodeCondition.enabled=true,"
                "cdi.enabled=true,updateStrategy.rollingUpdate.maxSurge=10%,updateStrategy.rollingUpdate.maxUnavailable=0")


def test_the_charts_objects_pass_a_server_side_dry_run(apiserver, namespace) -> None:
    from scripts import helm as helm_build
    from tests.conformance.skips import build_or_skip

    helm = build_or_skip(helm_build.MODULE, helm_build.PACKAGE, "helm", helm_build.ENV,
                         version=helm_build.HELM_VERSION, ldflags=helm_build.LDFLAGS)
    text = subprocess.run([str(helm), "template", NAME, str(REPO / "charts" / NAME), "-n", NAMESPACE,
                           "--set", CHART_ALL_ON], capture_output=True, text=True, check=True, timeout=120).stdout
    sent = [d for d in yaml.safe_load_all(text) if d]
    result = apiserver.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", "-o", "json",
                               input=text, check=False)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    returned = {_key(o): o for o in (doc["items"] if doc.get("kind") == "List" else [doc])}
    assert returned.keys() == {_key(o) for o in sent}
    assert {("DaemonSet", NAME), ("Deployment", "gpu-health-controller"),
            ("ClusterRole", f"{NAME}-remediation"), ("ClusterRole", "gpu-health-controller-drain")} <= returned.keys()
    ds = returned[("DaemonSet", NAME)]
    assert "--handover=true" in ds["spec"]["template"]["spec"]["containers"][0]["args"]
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": "10%", "maxUnavailable": 0}
