"""scripts/local-cluster's refusals and the configuration it writes: what keeps it off a real node's paths.
The cluster itself runs in tests/e2e."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from scripts.localcluster import cli
from scripts.localcluster import cluster as lc


@pytest.mark.parametrize("command", ["up", "down"])
def test_refuses_without_root_in_one_line(command: str, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setattr(lc.os, "geteuid", lambda: 1000)
    real = lc.Cluster
    monkeypatch.setattr(lc, "Cluster", lambda: real(lc.Layout(tmp_path / "work")))
    assert cli.main([command]) == 1
    err = capsys.readouterr().err
    assert err == "local-cluster: must run as root (the kubelet, containerd and runc need it)\n"
    assert not (tmp_path / "work").exists()  # refused before anything was made


def test_status_without_a_cluster_says_so(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    real = lc.Cluster
    monkeypatch.setattr(lc, "Cluster", lambda: real(lc.Layout(tmp_path / "none")))
    assert cli.main(["status"]) == 1
    assert capsys.readouterr().err == "local-cluster: no cluster is up\n"


def test_a_missing_kernel_or_host_feature_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(lc.os, "geteuid", lambda: 0)
    layout = lc.Layout(tmp_path)
    monkeypatch.setattr(lc, "cni_bin_dir", lambda: None)
    with pytest.raises(lc.ClusterError, match=r"no CNI plugins .* containernetworking-plugins"):
        lc.check_host(layout)
    monkeypatch.setattr(lc, "cni_bin_dir", lambda: tmp_path)
    monkeypatch.setattr(lc, "cgroup_version", lambda: 1)
    monkeypatch.setattr(lc, "V1_CONTROLLERS", ("cpu", "no-such-controller"))
    with pytest.raises(lc.ClusterError, match="cgroup v1 hierarchies missing: no-such-controller"):
        lc.check_host(layout)


def _paths(value: object) -> list[str]:
    if isinstance(value, dict):
        return [p for v in value.values() for p in _paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in _paths(v)]
    return [value] if isinstance(value, str) and value.startswith("/") else []


def test_containerd_keeps_every_path_in_the_work_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cni = tmp_path / "cni-bin"
    monkeypatch.setattr(lc, "cni_bin_dir", lambda: cni)
    layout = lc.Layout(tmp_path / "work")
    conf = tomllib.loads(lc.write_containerd_config(layout, "localhost/pause:3.10").read_text())
    outside = [p for p in _paths(conf) if not p.startswith(str(layout.work)) and p != str(cni)]
    assert outside == []
    runtime = conf["plugins"]["io.containerd.cri.v1.runtime"]
    # This machine refuses a lower oom_score_adj; pod network namespaces stay out of /var/run/netns.
    assert runtime["restrict_oom_score_adj"] is True and runtime["netns_mounts_under_state_dir"] is True
    assert runtime["containerd"]["runtimes"]["runc"]["options"]["Root"].startswith(str(layout.work))
    # DRA mode's CDI specs come from the cluster's own dir, which exists before containerd scans it.
    assert runtime["cdi_spec_dirs"] == [str(layout.cdi_dir)] and layout.cdi_dir.is_dir()
    assert conf["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"] == "localhost/pause:3.10"
    # Plugins that would install into /opt or listen in /var/run are off.
    assert {"io.containerd.internal.v1.opt", "io.containerd.nri.v1.nri"} <= set(conf["disabled_plugins"])


def test_pods_reach_only_the_bridge(tmp_path: Path) -> None:
    layout = lc.Layout(tmp_path)
    conf = json.loads((lc.write_cni_config(layout) / "10-gpu-health-local.conflist").read_text())
    bridge = conf["plugins"][0]
    assert bridge["bridge"] == lc.BRIDGE and bridge["isGateway"] is False and bridge["ipMasq"] is False
    assert bridge["ipam"]["ranges"][0][0]["subnet"] == str(lc.SUBNET)
    assert bridge["ipam"]["dataDir"].startswith(str(tmp_path))


def test_kubelet_config_for_this_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = lc.Layout(tmp_path)
    monkeypatch.setattr(lc, "cgroup_version", lambda: 1)
    cfg = json.loads(lc.write_kubelet_config(layout).read_text())
    assert cfg["failCgroupV1"] is False and cfg["cgroupRoot"] == lc.CGROUP_ROOT
    assert cfg["featureGates"] == {"ResourceHealthStatus": True}
    assert cfg["resolvConf"] == "" and cfg["address"] == lc.NODE_IP
    assert cfg["authentication"]["anonymous"]["enabled"] is False
    assert cfg["podLogsDir"].startswith(str(tmp_path))
    monkeypatch.setattr(lc, "cgroup_version", lambda: 2)
    assert "failCgroupV1" not in json.loads(lc.write_kubelet_config(layout).read_text())


def test_up_puts_the_nvml_standin_where_a_driver_would_and_its_node_file_beside_it(tmp_path: Path) -> None:
    """What `up` writes for overlays/local-cluster-nvml, run here with the real stand-in: the copied library, loaded
    from its place in the work dir by the real pynvml in a child process, answers from the node file for the same 8
    GPUs as the simulated node."""
    import subprocess
    import sys

    from plugin.devices.simulated import builtin_node, parse_node
    from scripts.nvmlstandin import LIBRARY
    from tests.fakes import nvml_standin

    layout = lc.Layout(tmp_path / "work")
    lc.make_nvml_files(layout, nvml_standin.library_dir_or_skip())
    lib = layout.nvml_lib_dir / LIBRARY
    # A copy (a link into the build cache would lead nowhere inside the pod), under the work dir down removes.
    assert lib.is_file() and not lib.is_symlink() and lib.stat().st_mode & 0o111
    assert layout.nvml_node_file.parent == layout.nvml_node_dir
    assert layout.nvml_lib_dir.is_relative_to(layout.work) and layout.nvml_node_dir.is_relative_to(layout.work)
    doc = json.loads(layout.nvml_node_file.read_text())
    assert doc["nvml"] == {"profile": "h100-sxm"}
    assert [g["uuid"] for g in doc["gpus"]] == [g["uuid"] for g in builtin_node()["gpus"]]
    parse_node(doc)  # the simulated backend accepts it too: one format
    env = nvml_standin.env_for_subprocess(layout.nvml_node_file, layout.nvml_lib_dir)
    r = subprocess.run([sys.executable, "-m", "plugin", "inspect", "-o", "json"], env=env, capture_output=True,
                       text=True, timeout=60, cwd=lc.REPO)
    assert r.returncode == 0 and "VIOLATION" not in r.stderr, r.stderr
    gpus = json.loads(r.stdout)["gpus"]
    assert [(g["uuid"], g["name"]) for g in gpus] == [(g["uuid"], "NVIDIA H100 80GB HBM3") for g in doc["gpus"]]
    # The up JSON names both.
    info = lc.Cluster(layout)._info_from({"plugin": {"ref": "p"}, "workload": {"ref": "w"}})
    assert (info["nvml_lib_dir"], info["nvml_node_file"]) == (str(layout.nvml_lib_dir), str(layout.nvml_node_file))
