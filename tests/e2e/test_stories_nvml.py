"""The plugin on its NVML backend on the real local cluster (docs/local-cluster.md, "The NVML backend on the
stand-in"): the DaemonSet from manifests/overlays/local-cluster-nvml runs ``--backend=nvml``, and the real
nvidia-ml-py in the image loads the project's NVML stand-in (tests/nvml_standin) from where a driver's library
would be mounted. Faults go in through the stand-in's node file and reach the kubelet and the Node as NVML reports
them: events, polled counters, the recovery-action field.

pytest takes the files in name order, so this one runs after test_stories_dra_chart.py, whose story 27 left no
plugin, no plugin namespace and no annotations; the stories here leave the cluster the same way for
test_stories_nvsentinel.py. Run alone, the conftest has deployed overlays/local-cluster: story 34 removes it first.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plugin.health.config import HealthConfig
from tests.e2e.conftest import Local, until
from tests.fakes.nvml_standin import StandinNode

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OVERLAY = "local-cluster-nvml"
PLUGIN_NS = "gpu-health-system"
DAEMONSET = "daemonset/gpu-health-device-plugin"
MODEL = "NVIDIA H100 80GB HBM3"  # the h100-sxm profile's name, which up's NVML node file gives every GPU
# Where components/local-cluster-nvml mounts the library and points LD_LIBRARY_PATH.
LIBRARY_IN_POD = "/usr/local/nvidia/lib64/libnvidia-ml.so.1"
METRICS = "http://127.0.0.1:9402/metrics"  # the plugin is on the host network (components/local-cluster-nvml)
ECC_GPU = 2  # the latched fault: an uncorrected ECC error, cleared by a GPU reset
LINK_GPU = 5  # the polled fault: a link down, which clears on its own


@pytest.fixture(scope="module")
def nvml(local: Local) -> StandinNode:
    """The NVML node file `up` wrote beside the stand-in's library, rewritten by rename as a fault injector would."""
    path = Path(local.info["nvml_node_file"])
    return StandinNode(path, json.loads(path.read_text()))


def _pod(local: Local) -> dict[str, Any]:
    [pod] = [p for p in local.plugin_pods() if not p["metadata"].get("deletionTimestamp")]
    return pod


def _log(local: Local) -> str:
    return local.logs(_pod(local)["metadata"]["name"], PLUGIN_NS)


def _exec(local: Local, *argv: str) -> str:
    return local.kubectl("exec", "-n", PLUGIN_NS, _pod(local)["metadata"]["name"], "--", *argv)


def _polls() -> int:
    """The plugin's own count of completed polls (its /metrics summary)."""
    with urllib.request.urlopen(METRICS, timeout=5) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith("gpu_health_poll_duration_seconds_count"):
            return int(float(line.split()[-1]))
    raise AssertionError("no gpu_health_poll_duration_seconds_count in the plugin's /metrics")


def _wait_polls(n: int) -> None:
    """Until the plugin has completed ``n`` more polls: counted by the plugin, so a slow machine only takes longer."""
    target = _polls() + n
    until(f"{n} more polls", lambda: _polls() >= target, timeout=30 * n)


def _reasons(annotation: dict[str, Any]) -> list[str]:
    return [r["code"] for r in annotation["reasons"]]


def _reset_gpu(local: Local, nvml: StandinNode, index: int) -> None:
    """A GPU reset as NVML shows it: the recovery-action field asks for one, then goes back to none."""
    nvml.set(index, recovery_action="gpu_reset")
    local.wait_annotation(index, lambda a: "recovery-action-reset" in _reasons(a))
    nvml.set(index, recovery_action="none")


@pytest.fixture(scope="module", autouse=True)
def _uninstalled_at_the_end(local: Local) -> Iterator[None]:
    """Whatever a story left, the module ends with no plugin, no plugin namespace and no annotations (as
    test_stories_dra_chart.py left the cluster and test_stories_nvsentinel.py expects)."""
    yield
    local.kubectl("delete", "-k", str(local.c.overlay(OVERLAY)), "--ignore-not-found", "--wait=true", timeout=300)
    until("the plugin pods gone", lambda: not local.plugin_pods(), timeout=120)
    local.c.remove_reporting()
    left = local.node_json()["metadata"].get("annotations", {})
    assert not [k for k in left if k.startswith("gpu-health.io/")], left


def test_34_the_plugin_on_nvml_loads_the_standin_where_the_driver_would_be_and_advertises_8_gpus(
        local: Local, nvml: StandinNode) -> None:
    if local.kubectl("get", "-n", PLUGIN_NS, DAEMONSET, "--ignore-not-found", "-o", "name").strip():
        # Run alone, the conftest's plugin (simulated backend) is installed: it goes first, so the state dir below
        # is cleared with nothing writing it, and the 8 GPUs seen next are the new plugin's.
        local.kubectl("delete", "-n", PLUGIN_NS, DAEMONSET, "--wait=true", timeout=120)
        until("the simulated plugin's pods gone", lambda: not local.plugin_pods(), timeout=120)
        local.wait_gpus(0)
    # A clean node: earlier stories latched faults for these UUIDs in the state dir every overlay shares.
    for g in nvml.doc["gpus"]:
        g["signals"] = {}
    nvml.write()
    (local.c.layout.work / "plugin-state" / "state.json").unlink(missing_ok=True)

    local.kubectl("apply", "-k", str(local.c.overlay(OVERLAY)), timeout=120)
    rollout = local.kubectl("-n", PLUGIN_NS, "rollout", "status", DAEMONSET, "--timeout=180s", check=False,
                            timeout=200)
    if "successfully rolled out" not in rollout:
        # A plugin that cannot load NVML exits (failOnInitError) and crash-loops: its last words say why.
        pods = local.kubectl("get", "pods", "-n", PLUGIN_NS, "-o", "wide", check=False)
        logs = local.kubectl("logs", "-n", PLUGIN_NS, "-l", "app.kubernetes.io/name=gpu-health-device-plugin",
                             "--tail=40", "--previous", check=False)
        pytest.fail(f"the nvml plugin did not roll out: {rollout}\n{pods}\n{logs}")
    local.wait_gpus(8)
    local.wait_gpus(8, "capacity")
    pod = _pod(local)
    args = pod["spec"]["containers"][0]["args"]
    assert "--backend=nvml" in args and not [a for a in args if a.startswith("--simulated-node")], args
    # pynvml's dlopen found the library where the overlay mounted it, as it would a driver's.
    maps = _exec(local, "cat", "/proc/1/maps")
    assert {line.split()[-1] for line in maps.splitlines() if "libnvidia-ml" in line} == {LIBRARY_IN_POD}, maps
    # After its first poll the plugin logs what NVML reported for each GPU (plugin/app.py): the stand-in's 8 H100s.
    log = until("the plugin's line per GPU", lambda: (text := _log(local)).count(f": {MODEL} (") == 8 and text)
    for g in nvml.doc["gpus"]:
        assert f"GPU {g['index']} {g['uuid']}: {MODEL} (" in log, log
    assert "registered nvidia.com/gpu with the kubelet" in log
    assert "Traceback" not in log, log
    # The stand-in prints "nvml-standin: VIOLATION: ..." where a real driver would have undefined behaviour.
    assert "VIOLATION" not in log, log
    for i in range(8):
        local.wait_annotation(i, lambda a: a["state"] == "Healthy")


def test_35_an_uncorrected_ecc_error_is_latched_until_the_gpu_is_reset(local: Local, nvml: StandinNode) -> None:
    # A growing volatile count: NVML raises a double-bit ECC event and the poll reads the count.
    nvml.set(ECC_GPU, ecc_uncorrected_volatile=2)
    local.wait_gpus(7)
    a = local.wait_annotation(ECC_GPU, lambda a: a["state"] == "Unhealthy")
    assert _reasons(a) == ["ecc-uncorrected"] and a["action"] == "reset-gpu", a
    # The count read back as 0: the polled reason clears after clear_after_polls clean polls, but the event's stays
    # latched until the GPU is seen reset (docs/health.md), so the GPU stays out. Counted in the plugin's own polls:
    # there is no change to wait for.
    nvml.set(ECC_GPU, ecc_uncorrected_volatile=0)
    _wait_polls(HealthConfig().clear_after_polls + 1)
    after = local.annotation(ECC_GPU)
    assert after is not None and after["state"] == "Unhealthy" and _reasons(after) == ["ecc-uncorrected"], after
    assert local.gpus() == 7
    # The reset clears the latch: all 8 back.
    _reset_gpu(local, nvml, ECC_GPU)
    local.wait_gpus(8)
    a = local.wait_annotation(ECC_GPU, lambda a: a["state"] == "Healthy")
    assert a["reasons"] == [] and a["from"] == "Unhealthy", a
    assert "VIOLATION" not in _log(local)


def test_36_a_link_down_takes_the_gpu_out_and_clears_on_its_own(local: Local, nvml: StandinNode) -> None:
    # Link 0 of an NVLink the plugin has seen up goes down: a polled reason, no event, no latch.
    nvml.set(LINK_GPU, nvlink_down=[0])
    local.wait_gpus(7)
    a = local.wait_annotation(LINK_GPU, lambda a: a["state"] == "Unhealthy")
    assert _reasons(a) == ["nvlink-down"] and "link 0" in a["reasons"][0]["message"], a
    # The link back up: after clear_after_polls clean polls the GPU is Healthy again, with nothing reset.
    nvml.set(LINK_GPU, nvlink_down=None)
    local.wait_gpus(8)
    a = local.wait_annotation(LINK_GPU, lambda a: a["state"] == "Healthy")
    assert a["reasons"] == [] and a["from"] == "Unhealthy", a


def test_37_inspect_in_the_plugins_pod_shows_the_8_gpus_nvml_reports_with_their_checks_on(
        local: Local, nvml: StandinNode) -> None:
    # `kubectl exec` inherits the container's environment: LD_LIBRARY_PATH and the stand-in's node file.
    out = _exec(local, "gpu-health-plugin", "inspect")
    gpus: list[tuple[str, dict[str, str]]] = []
    for line in out.splitlines():
        if line.startswith("GPU "):
            gpus.append((line, {}))
        elif line.startswith("  ") and not line.startswith("  NVLink ") and gpus:
            signal, how = line.split(None, 1)
            gpus[-1][1][signal] = how
    assert [h.split()[2] for h, _ in gpus] == nvml.uuids, out
    for header, checks in gpus:
        assert f"  {MODEL}  (Hopper, driver " in header, header
        # What the h100-sxm profile has: NVLink (to peers, then NVSwitches), fabric info and row remapping.
        assert (checks["nvlink"], checks["fabric"], checks["row_remap"]) == ("on", "on", "on"), (header, checks)
        assert not [s for s, how in checks.items() if not how.startswith(("on", "off: "))], (header, checks)
    assert out.count("NVLink 18 active of 18 slots") == 8, out
