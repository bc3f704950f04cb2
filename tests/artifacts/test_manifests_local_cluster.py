"""The local cluster's overlays (manifests/overlays/local-cluster*): valid, accepted by the plugin, and pointing
the DaemonSet at the paths scripts/local-cluster makes. They run for real in tests/e2e."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from scripts.localcluster import cluster as lc
from tests.artifacts.test_manifests import (
    KUBE_VERSIONS,
    MANIFESTS,
    NAME,
    _plugin_config,
    container,
    find,
    kubectl,
    render,
)

__all__ = ["kubectl"]  # the fixture, shared with test_manifests

OVERLAYS = ("local-cluster", "local-cluster-remediation", "local-cluster-nvsentinel")


@pytest.fixture(scope="module")
def rendered(kubectl: Path) -> dict[str, list[dict[str, Any]]]:
    return {o: render(kubectl, MANIFESTS / "overlays" / o) for o in OVERLAYS}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_valid_and_accepted_by_the_plugin(rendered: dict[str, list[dict[str, Any]]], overlay: str,
                                          tmp_path: Path) -> None:
    for obj in rendered[overlay]:
        kubernetes_validate.validate(obj, KUBE_VERSIONS[-1], strict=True)
    cfg, mounts = _plugin_config(rendered[overlay], tmp_path)
    layout = lc.Layout()
    assert cfg.backend == "simulated"
    assert cfg.simulated_node == layout.node_file and str(layout.node_dir) in mounts
    assert cfg.dev_root == layout.dev_root and str(layout.dev_root) in mounts
    assert cfg.node_condition is True
    assert (cfg.remediate == "evict") is (overlay == "local-cluster-remediation")
    ds = find(rendered[overlay], "DaemonSet", NAME)
    spec = ds["spec"]["template"]["spec"]
    assert "runtimeClassName" not in spec and spec["hostNetwork"] is True
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert host["pod-resources"] == str(layout.kubelet_root / "pod-resources")
    assert host["device-plugins"] == str(lc.DEVICE_PLUGIN_DIR)
    assert host["node"] == str(layout.node_dir) and host["devroot"] == str(layout.dev_root)
    if overlay == "local-cluster-nvsentinel":
        # NVSentinel's stand-in serves both sockets from one directory of the cluster's (tests/e2e).
        assert host["nvsentinel"] == host["device-api"] == str(layout.work / "nvsentinel")
        assert (cfg.nvsentinel_socket, cfg.device_api_socket) == (Path("/var/run/nvsentinel/nvsentinel.sock"),
                                                                  Path("/var/run/device-api/device.sock"))
        assert cfg.device_api_provide and cfg.device_api_consume
    else:
        assert cfg.nvsentinel_socket is None and cfg.device_api_socket is None
    env = {e["name"]: e.get("value") for e in container(ds)["env"]}
    assert (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]) == ("127.0.0.1", str(lc.API_PORT))
    assert container(ds)["image"] == "localhost/gpu-health-device-plugin:0.1.0"
    # On the host's network a declared port is a host port, which would keep a surge rollout's second pod off the
    # node: none is declared, and the probes name the plugin's port by number.
    assert "ports" not in container(ds)
    assert [container(ds)[p]["httpGet"]["port"] for p in ("livenessProbe", "readinessProbe")] == [9402, 9402]


def test_the_base_is_what_users_apply(rendered: dict[str, list[dict[str, Any]]], kubectl: Path) -> None:
    # Only the DaemonSet differs from the base (+ node condition); every other object is the same.
    users = {(o["kind"], o["metadata"]["name"]): o for o in render(kubectl, MANIFESTS / "overlays" / "node-condition")}
    ours = {(o["kind"], o["metadata"]["name"]): o for o in rendered["local-cluster"]}
    assert set(users) == set(ours)
    assert [k for k in users if users[k] != ours[k]] == [("DaemonSet", NAME)]


def test_the_local_controller_overlay_adds_only_the_controller_and_points_it_at_the_cluster(
        kubectl: Path, tmp_path: Path) -> None:
    from plugin.controller.config import load

    objs = render(kubectl, MANIFESTS / "overlays" / "local-cluster-controller")
    for obj in objs:
        kubernetes_validate.validate(obj, KUBE_VERSIONS[-1], strict=True)
    # Applied next to a plugin overlay, it must change none of the plugin's objects.
    assert not {(o["kind"], o["metadata"]["name"]) for o in objs} & {
        (o["kind"], o["metadata"]["name"]) for o in render(kubectl, MANIFESTS / "overlays" / "local-cluster")}
    deploy = find(objs, "Deployment", "gpu-health-controller")
    spec = deploy["spec"]["template"]["spec"]
    assert deploy["spec"]["replicas"] == 1 and spec["hostNetwork"] is True
    assert {"key": "gpu-health.io/quarantine", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    c = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]) == ("127.0.0.1", str(lc.API_PORT))
    assert c["image"] == "localhost/gpu-health-device-plugin:0.1.0"
    config = tmp_path / "config.yaml"
    config.write_text(find(objs, "ConfigMap", "gpu-health-controller-config")["data"]["config.yaml"])
    cfg = load([a.replace("/etc/gpu-health-controller/config.yaml", str(config)) for a in c["args"]],
               environ={"POD_NAME": "x"})
    assert cfg.recovery_hold_s == 5.0
