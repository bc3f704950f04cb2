"""Return to service on the real local cluster (issue 34): a GPU comes back after the action its fault asked for, and
nothing the project does keeps a fixed node out.

- 40: XID 79 (`reboot-node`), the fleet controller quarantines the node `reboot-required`, the node reboots
  (`scripts/local-cluster reboot`: the kubelet, containerd and the plugin restarted, a new boot id): the GPU is
  Healthy again, allocatable back to 8, and the controller releases the node after its hold.
- 41: a quarantined node's plugin DaemonSet rolled to a new revision: the new pod runs there (the DaemonSet tolerates
  the controller's taint), and once the GPU recovers the node is released.
- 42: `gpu-health-plugin clear` through `kubectl exec` in the plugin's pod: refused while the GPU is still lost,
  accepted once it reads clean, with the operator's note in an Event on the Node.
- 43: story 40 in DRA mode: the device's taint leaves the ResourceSlice after the reboot and a claim for it is served
  again.

The plugin reads the cluster's own boot id file (overlays/local-cluster-reboot and local-cluster-dra-reboot), which
the reboot changes; the state dir survives it, as /var/lib/gpu-health-device-plugin does on a real node.

Runs after test_stories_nvsentinel.py on the same cluster (pytest takes the files in name order), which left no
plugin installed, and leaves none (and no controller, no ResourceSlice) for test_stories_safety.py. Each story says
what it needs; run alone, the fixture's plugin is replaced by the first story's.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.e2e.conftest import DRA_DRIVER, NS, Local, until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PLUGIN_NS = "gpu-health-system"
DS = "gpu-health-device-plugin"
OVERLAY = "local-cluster-reboot"
DRA_OVERLAY = "local-cluster-dra-reboot"
CONTROLLER_OVERLAY = "local-cluster-controller"  # its recovery hold is 5 s
TAINT = "gpu-health.io/quarantine"
OURS = "controller.gpu-health.io/quarantined-by"
# The controller's count of the node's quarantines (--repeat-limit, 5 in 7 days): stories 40 and 41 quarantine the
# one node twice, on top of the other files' stories.
HISTORY = "controller.gpu-health.io/quarantine-history"
DRIVER = DRA_DRIVER
# One GPU per story, so none nears the flap damper (more than 4 state changes in 10 minutes hold a GPU in its worst
# state) whatever order a re-run takes them in.
REBOOTED, ROLLED, CLEARED, DRA_REBOOTED = 3, 5, 2, 6


def _until(what: str, check: Callable[[], Any], timeout: float = 90) -> Any:
    return until(what, check, timeout)


def _now() -> datetime:
    # Event times are whole seconds: a second back, so an Event of this very second counts as after.
    return datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1)


def _node_events(local: Local, reason: str | None, since: datetime) -> list[dict[str, Any]]:
    """The Node's Events (namespace default, where the kubelet's, the plugin's and the controller's go) last seen at
    or after ``since``."""
    out = []
    for e in local.events("default", "Node", local.node):
        stamp = e.get("lastTimestamp") or e.get("eventTime") or e["metadata"]["creationTimestamp"]
        when = datetime.fromisoformat(stamp.replace("Z", "+00:00")).replace(microsecond=0)
        if when >= since and (reason is None or e["reason"] == reason):
            out.append(e)
    return out


def _quarantine(local: Local) -> list[tuple[str, str]]:
    return [(t.get("value", ""), t["effect"]) for t in local.node_json()["spec"].get("taints") or []
            if t["key"] == TAINT]


def _ours(local: Local) -> bool:
    return bool(local.node_json()["metadata"].get("annotations", {}).get(OURS) == "gpu-health-controller")


def _live_pods(local: Local) -> list[dict[str, Any]]:
    return [p for p in local.plugin_pods() if not p["metadata"].get("deletionTimestamp")]


def _plugin_pod(local: Local) -> dict[str, Any]:
    [pod] = _live_pods(local)
    return pod


def _clean_node(local: Local) -> None:
    """No fault in the node file and no latched state: earlier stories latched faults in the shared state dir."""
    for g in local.node_file.doc["gpus"]:
        g["signals"] = {}
    local.node_file.write()
    (local.c.layout.work / "plugin-state" / "state.json").unlink(missing_ok=True)


def _fresh_plugin(local: Local, overlay: str) -> None:
    """The plugin from ``overlay`` on a clean node: whatever plugin runs (the fixture's, an earlier story's) goes
    first, so no old process writes its state over the cleaned state dir."""
    local.kubectl("delete", "-n", PLUGIN_NS, "daemonset", DS, "--ignore-not-found", "--cascade=foreground",
                  "--wait=true", timeout=200)
    _until("the old plugin pod gone", lambda: not local.plugin_pods(), timeout=120)
    _clean_node(local)
    local.kubectl("apply", "-k", str(local.c.overlay(overlay)), timeout=120)
    local.kubectl("-n", PLUGIN_NS, "rollout", "status", f"daemonset/{DS}", "--timeout=180s", timeout=200)


def _deploy_controller(local: Local) -> None:
    local.kubectl("apply", "-k", str(local.c.overlay(CONTROLLER_OVERLAY)))
    local.kubectl("-n", PLUGIN_NS, "rollout", "status", "deployment/gpu-health-controller", "--timeout=180s",
                  timeout=200)


def _forget_quarantines(local: Local) -> None:
    """Take the controller's count of this node's quarantines off, as an operator's release does: a re-run of these
    stories, or one more story quarantining the node, must not make it a repeat offender that no recovery releases."""
    local.kubectl("annotate", "node", local.node, f"{HISTORY}-")


def _wait_released(local: Local, since: datetime, timeout: float = 120) -> None:
    """The controller's release: its taint and record gone, and a GPUNodeReleased Event since ``since``."""
    _until("the controller's release", lambda: not _quarantine(local) and not _ours(local), timeout)
    _until("a GPUNodeReleased Event", lambda: _node_events(local, "GPUNodeReleased", since), 30)


def _exec_plugin(local: Local, *args: str) -> subprocess.CompletedProcess[str]:
    """``gpu-health-plugin ARGS`` in the plugin's pod, as an operator runs it: kubectl exec."""
    return subprocess.run(["kubectl", "exec", "-n", PLUGIN_NS, _plugin_pod(local)["metadata"]["name"], "--",
                           "gpu-health-plugin", *args], capture_output=True, text=True, env=local.env, timeout=60)


def _said(p: subprocess.CompletedProcess[str]) -> list[str]:
    """What the command printed, without the line kubectl adds for a non-zero exit."""
    return [line for line in (p.stdout + p.stderr).strip().splitlines()
            if line.strip() and not line.startswith("command terminated with exit code")]


def _codes(a: dict[str, Any]) -> list[str]:
    return [r["code"] for r in a["reasons"]]


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    status: dict[str, Any] = pod["status"]["containerStatuses"][0]
    return status


# 40: a reboot clears a reboot-node fault --------------------------------------------------------------------------

def test_40_a_reboot_brings_an_xid_79_gpu_back_and_the_controller_releases_the_node(local: Local) -> None:
    _fresh_plugin(local, OVERLAY)
    local.wait_gpus(8)
    _forget_quarantines(local)
    _deploy_controller(local)
    since = _now()
    gpu = REBOOTED
    local.signals(gpu, xid_events=[79])
    local.wait_gpus(7)
    a = local.wait_annotation(gpu, lambda a: "xid-79" in _codes(a))
    assert (a["state"], a["action"]) == ("Unhealthy", "reboot-node"), a
    _until("the reboot-required quarantine", lambda: _quarantine(local) == [("reboot-required", "NoSchedule")])
    assert _ours(local)

    before = _plugin_pod(local)
    kubelet, containerd = (local.c.layout.run / f"{n}.pid" for n in ("kubelet", "containerd"))
    pids = (kubelet.read_text(), containerd.read_text())
    started = time.monotonic()
    rebooted = local.reboot()
    print(f"reboot: {rebooted}")
    assert rebooted["boot_id"] != rebooted["previous_boot_id"]
    assert kubelet.read_text() != pids[0] and containerd.read_text() != pids[1], pids
    # The reboot took the XID list out of the node file, as a fresh driver has none to report.
    assert "xid_events" not in local.node_file.doc["gpus"][gpu]["signals"]

    # The kubelet starts the same pod's container again (a new container, not a new pod), and it reads the new boot.
    def restarted() -> dict[str, Any] | None:
        pods = _live_pods(local)
        if len(pods) != 1 or "containerStatuses" not in pods[0]["status"]:
            return None
        c = _container(pods[0])
        return pods[0] if c.get("ready") and c.get("containerID") != _container(before)["containerID"] else None

    after = _until("the plugin's container started again and ready", restarted, timeout=180)
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    seen = subprocess.run(["kubectl", "exec", "-n", PLUGIN_NS, after["metadata"]["name"], "--", "cat",
                           str(local.c.layout.boot_id_file)], capture_output=True, text=True, env=local.env, timeout=60)
    assert seen.stdout.strip() == rebooted["boot_id"], seen.stderr

    # The latch was recorded under the old boot id and the GPU reads clean: cleared, saying why.
    local.wait_gpus(8, timeout=180)
    a = local.wait_annotation(gpu, lambda a: a["state"] == "Healthy")
    assert not a["reasons"], a
    back = time.monotonic() - started
    events = _until("an Event saying the node rebooted", lambda: [
        e for e in _node_events(local, None, since) if "node rebooted" in e.get("message", "")], 60)
    assert any("xid-79" in e["message"] for e in events), [e["message"] for e in events]
    _wait_released(local, since)
    print(f"reboot to allocatable 8: {back:.1f} s; to release: {time.monotonic() - started:.1f} s")


# 41: the plugin rolled on a quarantined node ----------------------------------------------------------------------

def test_41_a_plugin_rolled_on_a_quarantined_node_runs_there_and_the_node_is_released(local: Local) -> None:
    # Story 40's plugin and controller, on a node it left whole.
    local.wait_gpus(8)
    gpu = ROLLED
    local.signals(gpu, nvlink_down=[0])  # a polled fault: it goes when the link comes back
    local.wait_gpus(7)
    local.wait_annotation(gpu, lambda a: a["state"] == "Unhealthy" and "nvlink-down" in _codes(a))
    _until("the quarantine", lambda: _quarantine(local) and _ours(local))
    since = _now()  # after story 40's release, whose Event must not count as this one's
    old = _plugin_pod(local)

    # A new revision of the DaemonSet, as any upgrade makes: the old pod goes, and the new one must come back on
    # the node the controller has tainted, or the node's GPUs and annotations are gone for as long as it lasts.
    local.kubectl("-n", PLUGIN_NS, "rollout", "restart", f"daemonset/{DS}")
    revision = local.get("daemonset", DS, PLUGIN_NS)["spec"]["template"]["metadata"]["annotations"][
        "kubectl.kubernetes.io/restartedAt"]

    def new_pod_ready() -> dict[str, Any] | None:
        for p in _live_pods(local):
            if p["metadata"].get("annotations", {}).get("kubectl.kubernetes.io/restartedAt") == revision and \
                    p["status"].get("containerStatuses") and _container(p).get("ready"):
                return p
        return None

    try:
        new = _until("the new revision's plugin pod running on the quarantined node", new_pod_ready, timeout=180)
    except AssertionError:
        ds = local.get("daemonset", DS, PLUGIN_NS)["status"]
        pods = [(p["metadata"]["name"], p["status"].get("phase")) for p in local.plugin_pods()]
        raise AssertionError(f"no plugin pod of the new revision runs on the quarantined node (taints "
                             f"{_quarantine(local)}; DaemonSet status {ds}; pods {pods}): the DaemonSet must "
                             f"tolerate {TAINT}") from None
    assert new["metadata"]["uid"] != old["metadata"]["uid"] and new["spec"]["nodeName"] == local.node
    # It took the state over: the GPU is still out, the node still quarantined.
    assert local.gpus() == 7 and _quarantine(local) and _ours(local)
    assert "nvlink-down" in _codes(local.annotation(gpu) or {"reasons": []})

    # The link comes back: the new plugin reports the GPU Healthy and the controller releases the node.
    local.signals(gpu, nvlink_down=None)
    local.wait_gpus(8)
    local.wait_annotation(gpu, lambda a: a["state"] == "Healthy")
    _wait_released(local, since)
    local.kubectl("delete", "-k", str(local.c.overlay(CONTROLLER_OVERLAY)), "--wait=true", timeout=200)
    _forget_quarantines(local)


# 42: the operator's clear ------------------------------------------------------------------------------------------

def test_42_clear_through_kubectl_exec_is_refused_while_the_gpu_is_lost_and_accepted_once_it_reads_clean(
        local: Local) -> None:
    # Story 41's plugin, on a whole node; no controller.
    local.wait_gpus(8)
    gpu = CLEARED
    since = _now()
    # XID 79 and the GPU off the bus, as XID 79 reports it.
    local.signals(gpu, xid_events=[79])
    local.wait_annotation(gpu, lambda a: "xid-79" in _codes(a))
    local.signals(gpu, lost=True)
    local.wait_annotation(gpu, lambda a: "gpu-lost" in _codes(a))
    local.wait_gpus(7)

    note = "e2e: reseated the GPU, it reads clean"
    refused = _exec_plugin(local, "clear", str(gpu), "--reason", "xid-79", "--note", note)
    said = _said(refused)
    assert refused.returncode != 0, said
    assert len(said) == 1 and "lost" in said[0].lower() and "Traceback" not in said[0], said
    a = local.annotation(gpu)
    assert a is not None and a["state"] == "Unhealthy" and {"xid-79", "gpu-lost"} <= set(_codes(a)), a

    # The GPU answers again: the polled gpu-lost goes, the XID 79 latch (reboot-node: a reset does not clear it)
    # stays until a reboot, or until the operator clears it.
    local.signals(gpu, lost=None)
    a = local.wait_annotation(gpu, lambda a: "gpu-lost" not in _codes(a))
    assert (a["state"], _codes(a)) == ("Unhealthy", ["xid-79"]), a
    assert local.gpus() == 7

    accepted = _exec_plugin(local, "clear", str(gpu), "--reason", "xid-79", "--note", note)
    assert accepted.returncode == 0, _said(accepted)
    local.wait_gpus(8)
    a = local.wait_annotation(gpu, lambda a: a["state"] == "Healthy")
    assert not a["reasons"], a
    events = _until("an Event on the Node with the operator's note", lambda: [
        e for e in _node_events(local, None, since) if note in e.get("message", "")], 60)
    assert any("xid-79" in e["message"] for e in events), [e["message"] for e in events]


# 43: the reboot in DRA mode ---------------------------------------------------------------------------------------

def _device_taints(local: Local, index: int) -> list[dict[str, Any]] | None:
    """The taints of device gpu-<index> in the node's slice; None while there is no slice (a starting kubelet
    deletes it, the plugin puts it back)."""
    s = local.resource_slice()
    if s is None:
        return None
    d = next((d for d in s["spec"].get("devices", []) if d["name"] == f"gpu-{index}"), None)
    return None if d is None else list(d.get("taints") or [])


def _claim_and_pod(local: Local, name: str, index: int) -> list[dict[str, Any]]:
    """A claim for exactly GPU ``index`` and a pod that uses it and prints its devices."""
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name, "namespace": NS},
             "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                 "deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": 1,
                 "selectors": [{"cel": {"expression": f'device.attributes["{DRIVER}"].index == {index}'}}]}}]}}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
           "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                    "resourceClaims": [{"name": "gpus", "resourceClaimName": name}],
                    "containers": [{"name": "work", "image": local.info["workload_image"], "imagePullPolicy": "Never",
                                    "command": ["sh", "-c", "echo NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES; "
                                                "sleep 100000"], "resources": {"claims": [{"name": "gpus"}]}}]}}
    return [claim, pod]


def _delete(local: Local, *objs: str) -> None:
    for o in objs:
        local.kubectl("delete", "-n", NS, o, "--grace-period=1", "--ignore-not-found", "--wait=true", timeout=120)


def test_43_in_dra_mode_a_reboot_untaints_the_device_and_a_claim_is_served_again(local: Local) -> None:
    _fresh_plugin(local, DRA_OVERLAY)
    gpu = DRA_REBOOTED
    _until("the node's ResourceSlice, untainted", lambda: _device_taints(local, gpu) == [], timeout=120)
    local.signals(gpu, xid_events=[79])
    taints = _until("the device's taint", lambda: _device_taints(local, gpu), timeout=60)
    assert [(t["key"], t["value"], t["effect"]) for t in taints] == [("gpu-health.io/unhealthy", "xid-79",
                                                                       "NoSchedule")], taints
    # A claim for exactly that device is not served while it is out.
    local.apply(*_claim_and_pod(local, "back", gpu))
    local.unschedulable("back")
    assert "allocation" not in local.get("resourceclaim", "back", NS).get("status", {})

    started = time.monotonic()
    rebooted = local.reboot()
    print(f"reboot: {rebooted}")
    # The starting kubelet deletes the node's slices; the plugin, started again, publishes its slice with the
    # latch cleared (another boot, the GPU reads clean).
    _until("the device untainted after the reboot", lambda: _device_taints(local, gpu) == [], timeout=180)
    untainted = time.monotonic() - started
    uuids = local.visible_devices("back")
    assert [local.index_of(u) for u in uuids] == [gpu], uuids
    print(f"DRA reboot to the device untainted: {untainted:.1f} s; to the claim served: "
          f"{time.monotonic() - started:.1f} s")
    _delete(local, "pod/back", "resourceclaim/back")
    # Leave no plugin and no slice (test_stories_safety.py deploys its own): the kubelet wipes a driver's slices
    # 30 s after its last plugin went (docs/dra.md, "Uninstall").
    local.kubectl("delete", "-k", str(local.c.overlay(DRA_OVERLAY)), "--wait=true", timeout=200)
    _until("the kubelet to wipe the ResourceSlice", lambda: local.resource_slice() is None, timeout=120)
