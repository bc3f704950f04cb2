"""The local cluster's overlays (manifests/overlays/local-cluster*): valid, accepted by the plugin, and pointing
the DaemonSet at the paths scripts/local-cluster makes. They run for real in tests/e2e."""

from __future__ import annotations

import copy
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

OVERLAYS = ("local-cluster", "local-cluster-remediation", "local-cluster-nvsentinel", "local-cluster-nvml",
            "local-cluster-reboot")
# Where components/local-cluster-nvml mounts the NVML stand-in's directory: CUDA images' and GKE's place for the
# driver's libraries.
NVML_LIB_IN_POD = "/usr/local/nvidia/lib64"


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
    if overlay == "local-cluster-nvml":
        assert cfg.backend == "nvml" and cfg.simulated_node is None
    else:
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
    assert host.get("node", str(layout.node_dir)) == str(layout.node_dir) and host["devroot"] == str(layout.dev_root)
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


def test_the_nvml_overlay_mounts_the_standin_where_a_driver_library_would_be_and_its_node_dir(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    from tests.fakes.nvml_standin import ENV_NODE

    layout = lc.Layout()
    ds = find(rendered["local-cluster-nvml"], "DaemonSet", NAME)
    c = container(ds)
    host = {v["name"]: v["hostPath"] for v in ds["spec"]["template"]["spec"]["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    # The library: the host directory `up` copies it into, read only, where LD_LIBRARY_PATH makes pynvml's
    # dlopen("libnvidia-ml.so.1") look.
    assert host["nvml-lib"] == {"path": str(layout.nvml_lib_dir), "type": "Directory"}
    assert mounts["nvml-lib"] == {"name": "nvml-lib", "mountPath": NVML_LIB_IN_POD, "readOnly": True}
    assert env["LD_LIBRARY_PATH"] == NVML_LIB_IN_POD
    # The node file's directory, at the host's path, so the stand-in sees a fault injector's rename in it.
    assert host["nvml-node"] == {"path": str(layout.nvml_node_dir), "type": "Directory"}
    assert mounts["nvml-node"] == {"name": "nvml-node", "mountPath": str(layout.nvml_node_dir), "readOnly": True}
    assert env[ENV_NODE] == str(layout.nvml_node_file) and layout.nvml_node_file.parent == layout.nvml_node_dir
    # No simulated node anywhere, and no NVIDIA runtime (the mounts do its part).
    assert "node" not in host and "runtimeClassName" not in ds["spec"]["template"]["spec"]


def test_the_nvml_overlay_differs_from_the_simulated_one_only_in_the_backend_and_its_files(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    """components/local-cluster-nvml repeats components/local-cluster but for the backend: held to that here, so a
    change to one that the other lacks fails."""
    sim = {(o["kind"], o["metadata"]["name"]): o for o in rendered["local-cluster"]}
    nvml = {(o["kind"], o["metadata"]["name"]): o for o in rendered["local-cluster-nvml"]}
    assert set(sim) == set(nvml)
    assert [k for k in sim if sim[k] != nvml[k]] == [("DaemonSet", NAME)]

    def without(ds: dict[str, Any], args: set[str], names: set[str]) -> dict[str, Any]:
        ds = copy.deepcopy(ds)
        spec = ds["spec"]["template"]["spec"]
        c = spec["containers"][0]
        c["args"] = [a for a in c["args"] if a.split("=", 1)[0] not in args]
        c["env"] = [e for e in c["env"] if e["name"] not in names]
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] not in names]
        spec["volumes"] = [v for v in spec["volumes"] if v["name"] not in names]
        return ds

    assert without(sim[("DaemonSet", NAME)], {"--backend", "--simulated-node"}, {"node"}) == without(
        nvml[("DaemonSet", NAME)], {"--backend"}, {"nvml-lib", "nvml-node", "LD_LIBRARY_PATH",
                                                   "GHDP_NVML_STANDIN_NODE"})


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
