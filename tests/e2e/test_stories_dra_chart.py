"""The Helm chart in DRA mode on the real local cluster (issue 26, docs/deploy.md "DRA mode with Helm"): `helm
install` with `mode: dra` publishes the node's ResourceSlice, a ResourceClaim of the chart's DeviceClass runs a pod
with GPUs prepared by the plugin, and `helm uninstall` leaves nothing of the release.

Runs after test_stories_dra.py on the same cluster (pytest takes the files in name order), whose story 25 left no
plugin installed and no namespace; the stories here leave the cluster the same way for test_stories_safety.py.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import REPO, Local, until
from tests.e2e.test_stories_dra import (
    DRIVER,
    PLUGIN_NS,
    _clear_signals,
    _delete,
    _plugin_log,
    _pod_health,
    run_two_of_one_island,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHART = str(REPO / "charts" / "gpu-health-device-plugin")
RELEASE = "gpu-health-device-plugin"
# The local cluster's values, then DRA mode's on top: overlays/local-cluster-dra as Helm values
# (tests/artifacts/test_chart.py compares the two renderings object by object).
HELM_VALUES = ["-f", str(REPO / "scripts" / "localcluster" / "helm-values.yaml"),
               "-f", str(REPO / "scripts" / "localcluster" / "helm-values-dra.yaml")]
# Every cluster-scoped object the release makes in DRA mode.
CLUSTER_OBJECTS = (("deviceclass", DRIVER), ("clusterrole", RELEASE), ("clusterrolebinding", RELEASE),
                   ("clusterrole", f"{RELEASE}-dra"), ("clusterrolebinding", f"{RELEASE}-dra"),
                   ("validatingadmissionpolicy", f"{RELEASE}-own-node-only"),
                   ("validatingadmissionpolicybinding", f"{RELEASE}-own-node-only"),
                   ("validatingadmissionpolicy", f"{RELEASE}-own-node-slices"),
                   ("validatingadmissionpolicybinding", f"{RELEASE}-own-node-slices"),
                   ("validatingadmissionpolicy", f"{RELEASE}-own-node-pod-status"),
                   ("validatingadmissionpolicybinding", f"{RELEASE}-own-node-pod-status"))


def _releases(local: Local) -> list[dict[str, object]]:
    releases: list[dict[str, object]] = json.loads(local.helm("list", "-n", PLUGIN_NS, "-o", "json").stdout)
    return releases


def _cluster_objects(local: Local) -> list[tuple[str, str]]:
    return [(kind, name) for kind, name in CLUSTER_OBJECTS
            if local.kubectl("get", kind, name, "--ignore-not-found", "-o", "name").strip()]


def test_26_helm_install_in_dra_mode_publishes_the_slice_and_a_claim_of_its_device_class_runs(local: Local) -> None:
    # A clean node, as story 20 starts: no latched fault in the state dir both modes share.
    _clear_signals(local)
    (local.c.layout.work / "plugin-state" / "state.json").unlink(missing_ok=True)
    # docs/deploy.md: the namespace first, from the base, for its Pod Security label.
    local.kubectl("apply", "-f", str(REPO / "manifests" / "base" / "namespace.yaml"))
    out = local.helm("install", RELEASE, CHART, "-n", PLUGIN_NS, *HELM_VALUES, "--wait", "--timeout=3m",
                     timeout=240).stdout
    # The notes point at the slices, not at allocatable nvidia.com/gpu.
    assert "kubectl get resourceslices --field-selector spec.driver=gpu.gpu-health.io" in out, out
    assert "DeviceClass gpu.gpu-health.io" in out, out
    [release] = _releases(local)
    assert release["status"] == "deployed", release
    assert _cluster_objects(local) == list(CLUSTER_OBJECTS)
    dc = local.get("deviceclass", DRIVER)
    assert dc["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    local.kubectl("-n", PLUGIN_NS, "rollout", "status", "daemonset/gpu-health-device-plugin", "--timeout=180s",
                  timeout=200)
    [pod] = local.plugin_pods()
    assert "--mode=dra" in pod["spec"]["containers"][0]["args"]
    assert all(c["ready"] for c in pod["status"]["containerStatuses"])
    s = until("the node's ResourceSlice", local.resource_slice, timeout=120)
    assert sorted(d["name"] for d in s["spec"]["devices"]) == [f"gpu-{i}" for i in range(8)]
    assert not any(d.get("taints") for d in s["spec"]["devices"])
    assert "registered with the kubelet" in _plugin_log(local)
    # One mode per node: the GPUs are DRA devices, not the extended resource.
    assert local.gpus() == 0
    # Two GPUs of one NVLink island through the chart's DeviceClass, prepared by the plugin.
    uid = run_two_of_one_island(local, "chart-two")
    health = until("the devices' health in pod status", lambda: len(_pod_health(local, "chart-two")) == 2
                   and _pod_health(local, "chart-two"))
    assert all(h == ("Healthy", "") for h in health.values()), health
    _delete(local, "pod/chart-two", "resourceclaim/chart-two")
    until("the claim's CDI spec removed", lambda: not (local.c.layout.cdi_dir / f"{DRIVER}-{uid}.json").exists())


def test_27_helm_uninstall_in_dra_mode_leaves_nothing_of_the_release(local: Local) -> None:
    local.helm("uninstall", RELEASE, "-n", PLUGIN_NS, "--wait", "--timeout=3m", timeout=240)
    assert _releases(local) == []
    assert _cluster_objects(local) == []
    assert local.kubectl("get", "daemonsets,configmaps,serviceaccounts", "-n", PLUGIN_NS, "-o", "name",
                         "-l", "app.kubernetes.io/managed-by=Helm") == ""
    until("the plugin pods gone", lambda: not local.plugin_pods(), timeout=120)
    # The kubelet deletes a driver's ResourceSlices 30 s after its last plugin went (docs/dra.md, "Restarts and
    # uninstall"): nothing is left for the scheduler to hand out.
    until("the kubelet to wipe the ResourceSlice", lambda: local.resource_slice() is None, timeout=120)
    assert not list(local.c.layout.cdi_dir.glob(f"{DRIVER}-*.json"))
    # Left on the Node, as docs/deploy.md says of every uninstall: the annotations the plugin wrote (it cannot tell
    # an uninstall from a restart); no node condition, which local-cluster-dra's values turn off. The documented
    # clean-up removes them.
    meta = local.node_json()
    assert [k for k in meta["metadata"].get("annotations", {}) if k.startswith("gpu-health.io/gpu.")]
    assert not [c for c in meta["status"]["conditions"] if c["type"] == "GPUHealthy"]
    local.c.remove_reporting()
    meta = local.node_json()
    assert not [k for k in meta["metadata"].get("annotations", {}) if k.startswith("gpu-health.io/")]
    # The namespace is not the release's (docs/deploy.md); removed, the cluster is as story 25 left it.
    local.kubectl("delete", "namespace", PLUGIN_NS, "--wait=true", timeout=200)
