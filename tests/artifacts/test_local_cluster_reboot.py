"""scripts/local-cluster reboot's pieces that need no cluster: what a reboot takes out of a node file and what it
keeps, the boot id file, the refusal without a cluster, and the overlays that point the plugin at the cluster's boot
id. The reboot itself runs in tests/e2e/test_stories_return.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plugin.devices.simulated import KNOWN_SIGNALS, builtin_node, load_node_file, write_node_file
from scripts.localcluster import cli
from scripts.localcluster import cluster as lc
from tests.artifacts.test_manifests import MANIFESTS, NAME, _plugin_config, container, find, kubectl, render

__all__ = ["kubectl"]  # the fixture, shared with test_manifests

# Each reboot overlay and the overlay it adds the boot id to.
REBOOT_OVERLAYS = {"local-cluster-reboot": "local-cluster", "local-cluster-dra-reboot": "local-cluster-dra"}


def test_every_signal_a_reboot_clears_is_one_the_node_file_knows() -> None:
    # A signal renamed in the simulated format, and left here, would silently survive every reboot.
    assert set(lc.REBOOT_CLEARS) <= KNOWN_SIGNALS, set(lc.REBOOT_CLEARS) - KNOWN_SIGNALS


def test_a_reboot_clears_the_drivers_state_and_keeps_what_the_gpu_keeps(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    doc = builtin_node()
    doc["gpus"][3]["signals"] = {"xid_events": [79], "lost": True, "recovery_action": "node_reboot",
                                 "ecc_uncorrected_volatile": 2, "row_remap_pending": True}
    doc["gpus"][5]["signals"] = {"row_remap_failure": True, "retired_pages_count": 70, "temperature_c": 90,
                                 "nvlink_down": [0]}
    write_node_file(path, doc)
    cleared = lc.clear_volatile_signals(path)
    assert cleared == [f"gpu.3.{k}" for k in ("xid_events", "lost", "recovery_action", "ecc_uncorrected_volatile",
                                              "row_remap_pending")]
    after = json.loads(path.read_text())
    assert after["gpus"][3]["signals"] == {}
    assert after["gpus"][5]["signals"] == doc["gpus"][5]["signals"]
    load_node_file(path)  # still a file the plugin accepts
    # Nothing left to clear: the file is not rewritten (a plugin watching it sees no change).
    before = path.stat().st_mtime_ns
    assert lc.clear_volatile_signals(path) == []
    assert path.stat().st_mtime_ns == before


def test_each_boot_has_its_own_id(tmp_path: Path) -> None:
    layout = lc.Layout(tmp_path / "work")
    first = lc.write_boot_id(layout)
    assert lc.read_boot_id(layout) == first and layout.boot_id_file.parent == layout.boot_dir
    second = lc.write_boot_id(layout)
    assert second != first and lc.read_boot_id(layout) == second
    assert [p.name for p in layout.boot_dir.iterdir()] == ["boot_id"]  # replaced by rename, nothing left over


def test_reboot_without_a_cluster_says_so(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    real = lc.Cluster
    monkeypatch.setattr(lc, "Cluster", lambda: real(lc.Layout(tmp_path / "none")))
    assert cli.main(["reboot"]) == 1
    assert capsys.readouterr().err == "local-cluster: no cluster is up: `scripts/local-cluster up` first\n"


@pytest.mark.parametrize("overlay", sorted(REBOOT_OVERLAYS))
def test_the_reboot_overlays_read_the_clusters_boot_id_and_change_nothing_else(overlay: str, kubectl: Path,
                                                                               tmp_path: Path) -> None:
    layout = lc.Layout()
    objs = render(kubectl, MANIFESTS / "overlays" / overlay)
    cfg, mounts = _plugin_config(objs, tmp_path)
    assert cfg.boot_id_file == layout.boot_id_file and str(layout.boot_dir) in mounts
    ds = find(objs, "DaemonSet", NAME)
    host = {v["name"]: v["hostPath"] for v in ds["spec"]["template"]["spec"]["volumes"] if "hostPath" in v}
    # The directory, at the host's path, read only: `reboot` replaces the file by rename.
    assert host["boot"] == {"path": str(layout.boot_dir), "type": "Directory"}
    assert {"name": "boot", "mountPath": str(layout.boot_dir), "readOnly": True} in container(ds)["volumeMounts"]
    # Everything else is the overlay it is built on.
    base = {(o["kind"], o["metadata"]["name"]): o for o in render(kubectl, MANIFESTS / "overlays" /
                                                                   REBOOT_OVERLAYS[overlay])}
    ours = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    assert set(base) == set(ours) and [k for k in base if base[k] != ours[k]] == [("DaemonSet", NAME)]
    spec = ds["spec"]["template"]["spec"]
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "boot"]
    c = container(ds)
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "boot"]
    c["env"] = [e for e in c["env"] if e["name"] != "GPU_HEALTH_BOOT_ID_FILE"]
    assert ds == base[("DaemonSet", NAME)]
