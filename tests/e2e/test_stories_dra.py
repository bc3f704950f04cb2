"""DRA driver mode on the real local cluster (issue 17, docs/dra.md): the plugin redeployed with ``--mode dra``
(manifests/overlays/local-cluster-dra), ResourceClaims allocated by the real scheduler from our ResourceSlice,
prepared by the real kubelet through our DRA service, and the devices' health streamed into pod status.

Runs after test_stories.py on the same cluster (pytest takes the files in name order): story 13 left no plugin
installed. The stories here run in order too, each from what the one before left.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

from tests.e2e.conftest import DRA_DRIVER, NS, Local, until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DRIVER = DRA_DRIVER
OVERLAY = "local-cluster-dra"
PLUGIN_NS = "gpu-health-system"
ISLANDS = ({0, 1, 2, 3}, {4, 5, 6, 7})
CDI_PREFIX = f"{DRIVER}/gpu="
# GPUs the stories moved between states: the latency bench faults others, so no GPU nears the flap damper
# (more than 4 state changes in 10 minutes hold a GPU in its worst state).
USED: set[int] = set()


def _device(local: Local, index: int) -> dict[str, Any]:
    s = local.resource_slice()
    assert s is not None, "no ResourceSlice"
    return next(d for d in s["spec"].get("devices", []) if d["name"] == f"gpu-{index}")


def _until(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    return until(what, check, timeout)


def _taint(local: Local, index: int) -> dict[str, Any] | None:
    taints = _device(local, index).get("taints") or []
    return taints[0] if taints else None


def _claim(name: str, count: int, selector: str | None = None, same_island: bool = False) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": count}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    spec: dict[str, Any] = {"devices": {"requests": [{"name": "gpus", "exactly": exactly}]}}
    if same_island:
        spec["devices"]["constraints"] = [{"requests": ["gpus"], "matchAttribute": f"{DRIVER}/nvlinkIsland"}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}


def _by_index(index: int) -> str:
    return f'device.attributes["{DRIVER}"].index == {index}'


def _pod(local: Local, name: str, claim: str) -> dict[str, Any]:
    command = "echo NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES; ls /dev | grep nvidia; sleep 100000"
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                 "resourceClaims": [{"name": "gpus", "resourceClaimName": claim}],
                 "containers": [{"name": "work", "image": local.info["workload_image"], "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", command], "resources": {"claims": [{"name": "gpus"}]}}]},
    }


def _allocated(local: Local, claim: str) -> list[int]:
    c = local.get("resourceclaim", claim, NS)
    results = c["status"]["allocation"]["devices"]["results"]
    return sorted(int(r["device"].split("-")[1]) for r in results if r["driver"] == DRIVER)


def _pod_health(local: Local, pod: str) -> dict[int, tuple[str, str]]:
    """GPU index -> (health, message) from the pod's allocatedResourcesStatus: the kubelet names a DRA device by
    its first CDI ID, ours ``gpu.gpu-health.io/gpu=<claim uid>-gpu-<index>``."""
    out: dict[int, tuple[str, str]] = {}
    for cs in local.get("pod", pod, NS)["status"].get("containerStatuses", []):
        for res in cs.get("allocatedResourcesStatus") or []:
            for r in res.get("resources") or []:
                rid = str(r["resourceID"])
                if rid.startswith(CDI_PREFIX) and "-gpu-" in rid:
                    out[int(rid.rsplit("-gpu-", 1)[1])] = (r.get("health", ""), r.get("message", ""))
    return out


def _plugin_log(local: Local) -> str:
    [pod] = [p for p in local.plugin_pods() if not p["metadata"].get("deletionTimestamp")]
    return local.logs(pod["metadata"]["name"], PLUGIN_NS)


def _registrations(local: Local) -> int:
    """Registrations the plugin logged; -1 while its log cannot be read (kubectl reads it through the kubelet,
    which a kubelet restart takes away for a moment)."""
    try:
        return _plugin_log(local).count("registered with the kubelet")
    except AssertionError:
        return -1


def _clear_signals(local: Local) -> None:
    for g in local.node_file.doc["gpus"]:
        g["signals"] = {}
    local.node_file.write()


def _delete(local: Local, *objs: str) -> None:
    for o in objs:
        local.kubectl("delete", "-n", NS, o, "--grace-period=1", "--ignore-not-found", "--wait=true", timeout=120)


def run_two_of_one_island(local: Local, name: str) -> str:
    """A claim (and pod) ``name`` for two GPUs of one NVLink island, running with their device nodes; its UID."""
    local.apply(_claim(name, 2, same_island=True), _pod(local, name, name))
    uuids = local.visible_devices(name)
    indices = {local.index_of(u) for u in uuids}
    assert len(uuids) == 2 and any(indices <= i for i in ISLANDS), uuids
    assert sorted(indices) == _allocated(local, name)
    log = local.logs(name)
    assert "nvidiactl" in log and all(f"nvidia{i}" in log for i in indices), log
    # The claim's CDI spec is on the node, where containerd read it.
    uid: str = local.get("resourceclaim", name, NS)["metadata"]["uid"]
    assert (local.c.layout.cdi_dir / f"{DRIVER}-{uid}.json").exists()
    return uid


def test_20_dra_mode_publishes_a_slice_and_two_gpus_of_one_island_run(local: Local) -> None:
    # A clean node: what the device-plugin stories latched stays in their state dir, which DRA mode shares.
    _clear_signals(local)
    (local.c.layout.work / "plugin-state" / "state.json").unlink(missing_ok=True)
    local.kubectl("apply", "-k", str(local.c.overlay(OVERLAY)), timeout=120)
    local.kubectl("-n", PLUGIN_NS, "rollout", "status", "daemonset/gpu-health-device-plugin", "--timeout=180s",
                  timeout=200)
    s = _until("the node's ResourceSlice", local.resource_slice)
    devices = {d["name"]: d for d in s["spec"]["devices"]}
    assert sorted(devices) == [f"gpu-{i}" for i in range(8)]
    attrs = devices["gpu-5"]["attributes"]
    assert attrs[f"{DRIVER}/uuid"]["string"] == local.node_file.uuids[5]
    assert attrs[f"{DRIVER}/nvlinkIsland"] == devices["gpu-4"]["attributes"][f"{DRIVER}/nvlinkIsland"]
    assert f"{DRIVER}/memory" in devices["gpu-0"]["capacity"]
    assert not any(d.get("taints") for d in devices.values())
    # The kubelet registered the driver: its readiness is our /readyz.
    [pod] = local.plugin_pods()
    assert all(c["ready"] for c in pod["status"]["containerStatuses"])
    assert "registered with the kubelet" in _plugin_log(local)
    # Story 1 of the issue: two GPUs of one NVLink island.
    run_two_of_one_island(local, "two")
    assert all(h == ("Healthy", "") for h in _pod_health(local, "two").values()) and len(_pod_health(local, "two"))


def test_21_a_fault_taints_the_device_and_reaches_pod_status(local: Local) -> None:
    held = _allocated(local, "two")
    bad = held[0]
    USED.add(bad)
    local.signals(bad, xid_events=[48])  # fatal, and a reset mends it (story 23)
    taint = _until("the NoSchedule taint", lambda: _taint(local, bad))
    assert taint["key"] == "gpu-health.io/unhealthy" and taint["effect"] == "NoSchedule", taint
    assert taint["value"] == "xid-48"
    health = _until("Unhealthy in pod status", lambda: _pod_health(local, "two").get(bad, ("", ""))[0] == "Unhealthy"
                    and _pod_health(local, "two"))
    assert "xid-48" in health[bad][1], health
    assert health[held[1]][0] == "Healthy"
    assert _taint(local, held[1]) is None
    # The pod goes; its claim is unprepared (the CDI spec removed) and deleted.
    uid = local.get("resourceclaim", "two", NS)["metadata"]["uid"]
    _delete(local, "pod/two", "resourceclaim/two")
    _until("the claim's CDI spec removed", lambda: not (local.c.layout.cdi_dir / f"{DRIVER}-{uid}.json").exists())
    # A new claim for exactly the tainted device is not given it.
    local.apply(_claim("want-bad", 1, _by_index(bad)), _pod(local, "want-bad", "want-bad"))
    message = local.unschedulable("want-bad")
    assert "cannot allocate all claims" in message or "resourceclaim" in message.lower(), message
    assert "allocation" not in local.get("resourceclaim", "want-bad", NS).get("status", {})


def test_22_a_degraded_device_is_tainted_for_information_and_still_allocatable(local: Local) -> None:
    hot = next(i for i in range(7, -1, -1) if i not in USED)
    USED.add(hot)
    local.signals(hot, temperature_c=90)
    taint = _until("the Degraded taint", lambda: _taint(local, hot))
    assert taint["key"] == "gpu-health.io/degraded" and taint["effect"] == "None", taint
    assert taint["value"] == "thermal-slowdown"
    local.apply(_claim("hot", 1, _by_index(hot)), _pod(local, "hot", "hot"))
    assert [local.index_of(u) for u in local.visible_devices("hot")] == [hot]
    health = _until("the reason in pod status", lambda: _pod_health(local, "hot").get(hot, ("", ""))[1]
                    and _pod_health(local, "hot"))
    assert health[hot][0] == "Healthy" and "thermal-slowdown" in health[hot][1], health
    local.signals(hot, temperature_c=None)
    _until("the Degraded taint removed", lambda: _taint(local, hot) is None)
    _until("no message once healthy", lambda: _pod_health(local, "hot").get(hot) == ("Healthy", ""))
    _delete(local, "pod/hot", "resourceclaim/hot")


def test_22b_the_docs_claim_tolerating_unknown_is_allocated_and_prepared_an_unknown_device(local: Local) -> None:
    """Issue 24 item 10: the toleration docs/dra.md shows, taken from the page, gets a claim an Unknown device
    (kept from every other claim), the kubelet prepares it, and the pod runs with Unknown in its status."""
    from tests.unit.test_dra_allocatable import documented_tolerations

    dark = next(i for i in range(7, -1, -1) if i not in USED and _taint(local, i) is None)
    USED.add(dark)
    local.signals(dark, nvml_error=True)
    taint = _until("the Unknown taint", lambda: _taint(local, dark), timeout=120)
    assert taint["key"] == "gpu-health.io/unknown" and taint["effect"] == "NoSchedule", taint
    local.apply(_claim("want-dark", 1, _by_index(dark)), _pod(local, "want-dark", "want-dark"))
    local.unschedulable("want-dark")
    claim = _claim("dark", 1, _by_index(dark))
    claim["spec"]["devices"]["requests"][0]["exactly"]["tolerations"] = documented_tolerations()
    local.apply(claim, _pod(local, "dark", "dark"))
    assert [local.index_of(u) for u in local.visible_devices("dark")] == [dark]
    [result] = local.get("resourceclaim", "dark", NS)["status"]["allocation"]["devices"]["results"]
    assert [t["key"] for t in result.get("tolerations", [])] == ["gpu-health.io/unknown"], result
    health = _until("Unknown in pod status", lambda: _pod_health(local, "dark").get(dark, ("", ""))[0] == "Unknown"
                    and _pod_health(local, "dark"))
    assert "nvml-error" in health[dark][1], health
    local.signals(dark, nvml_error=None)
    _until("the Unknown taint removed", lambda: _taint(local, dark) is None, timeout=120)
    _delete(local, "pod/dark", "resourceclaim/dark")
    local.wait("pod/want-dark", "condition=Ready", 120, NS)  # recovered and free: the other claim gets it now
    _delete(local, "pod/want-dark", "resourceclaim/want-dark")


def test_23_recovery_plugin_restart_and_kubelet_restart(local: Local) -> None:
    bad = next(i for i in range(8) if _taint(local, i) is not None)
    local.reset_gpu(bad)
    _until("the taint removed on recovery", lambda: _taint(local, bad) is None)
    # The pending claim now gets the device and its pod runs.
    local.wait("pod/want-bad", "condition=Ready", 120, NS)
    assert _allocated(local, "want-bad") == [bad]
    # A plugin restart: the prepared claim survives it, and the unprepare after it works.
    [old] = local.plugin_pods()
    local.kubectl("delete", "pod", "-n", PLUGIN_NS, old["metadata"]["name"], "--wait=true", timeout=120)
    local.kubectl("-n", PLUGIN_NS, "rollout", "status", "daemonset/gpu-health-device-plugin", "--timeout=180s",
                  timeout=200)
    _until("the new plugin registered", lambda: "registered with the kubelet" in _plugin_log(local))
    assert local.get("pod", "want-bad", NS)["status"]["phase"] == "Running"
    uid = local.get("resourceclaim", "want-bad", NS)["metadata"]["uid"]
    _delete(local, "pod/want-bad", "resourceclaim/want-bad")
    assert not (local.c.layout.cdi_dir / f"{DRIVER}-{uid}.json").exists()
    # A kubelet restart: the kubelet finds our registration socket again and a new claim is prepared.
    before = _registrations(local)
    local.restart_kubelet()
    _until("a second registration", lambda: _registrations(local) > before, timeout=120)
    # A starting kubelet deletes the node's ResourceSlices; the plugin, registered again, puts its slice back.
    _until("the slice back after the kubelet restart", lambda: local.resource_slice() is not None, timeout=60)
    local.apply(_claim("after", 1), _pod(local, "after", "after"))
    assert len(local.visible_devices("after")) == 1
    _delete(local, "pod/after", "resourceclaim/after")


def test_24_latency_bench_fault_to_taint_and_to_pod_status(local: Local) -> None:
    """Issue 17's latency proof: bench/bench_dra_latency.py on this cluster (numbers in docs/benchmarks.md). The
    bench prints the medians and maxima; here only that every sample arrived."""
    from bench import bench_dra_latency

    gpus = [i for i in range(8) if i not in USED][:4]
    result = bench_dra_latency.run_faults(local.c, local.info, len(gpus), NS, gpus)
    print(json.dumps({k: v for k, v in result.items() if k != "per_fault_s"}))
    assert result["faults"] == len(gpus) == 4, result
    assert result["fault_to_taint"]["n"] == result["fault_to_pod_status_message"]["n"] == 4


def test_25_an_idle_node_writes_no_slice_then_uninstall_wipes_it(local: Local) -> None:
    # Nothing changes on the node for 30 s (the health stream's heartbeats included): the slice is not written.
    before = local.resource_slice()
    assert before is not None
    watch = subprocess.Popen(["kubectl", "get", "resourceslices", "--watch", "--output-watch-events", "-o", "json",
                              f"--field-selector=spec.nodeName={local.node},spec.driver={DRIVER}"],
                             stdout=subprocess.PIPE, text=True, env=local.env)
    try:
        out, _ = watch.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        watch.terminate()
        out, _ = watch.communicate(timeout=10)
    events, rest, decoder = [], out.strip(), json.JSONDecoder()
    while rest:
        doc, end = decoder.raw_decode(rest)
        events.append((doc["type"], doc["object"]["metadata"]["resourceVersion"]))
        rest = rest[end:].strip()
    assert events == [("ADDED", before["metadata"]["resourceVersion"])], events
    local.kubectl("delete", "-k", str(local.c.overlay(OVERLAY)), "--wait=true", timeout=200)
    # The kubelet deletes a driver's ResourceSlices 30 s after its last plugin went (docs/dra.md, "Uninstall"), so
    # nothing is left for the scheduler to hand out on a node with no driver.
    _until("the kubelet to wipe the ResourceSlice", lambda: local.resource_slice() is None, timeout=120)
    assert not list(local.c.layout.cdi_dir.glob(f"{DRIVER}-*.json"))
