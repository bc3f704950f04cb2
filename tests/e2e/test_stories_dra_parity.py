"""Issue 38, DRA mode at parity (docs/dra.md), on the real local cluster: a pod that asks `nvidia.com/gpu: 2` with no
claim served by our driver through the DeviceClass's extendedResourceName (KEP-5004), MIG instances published as
devices of the slice with their parent's faults reaching a pod's status, and one GPU shared by two claims
(consumable capacity, KEP-5075) whose fault reaches both pods.

pytest takes the files in name order: this one runs after test_stories_dra_chart.py, whose story 27 left no plugin,
no plugin namespace and no annotations, and leaves the cluster the same way (and the node file without MIG layout or
signals) for test_stories_migrate.py. Run alone, the conftest has deployed overlays/local-cluster: story 53 replaces it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import NS, RES, Local, until
from tests.e2e.test_stories_dra import DRIVER, PLUGIN_NS, _clear_signals, _delete

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OVERLAY = "local-cluster-dra"
CONFIGMAP = "gpu-health-device-plugin-config"
MIG_1G = 6  # seven 1g.10gb instances
MIG_3G = 7  # two 3g.40gb instances
SHARED = 5  # two claims at once
WHOLE = [0, 1, 2, 3, 4, 5]  # the GPUs the slice still publishes whole
CDI_PREFIX = f"{DRIVER}/gpu="


def _migs(index: int) -> list[dict[str, Any]]:
    if index == MIG_1G:
        return [{"uuid": f"MIG-{index}1000000-0000-4000-8000-00000000000{gi - 7}", "gpu_instance_id": gi,
                 "compute_instance_id": 0, "profile": "1g.10gb", "memory_mib": 9856} for gi in range(7, 14)]
    return [{"uuid": f"MIG-{index}3000000-0000-4000-8000-00000000000{gi}", "gpu_instance_id": gi,
             "compute_instance_id": 0, "profile": "3g.40gb", "memory_mib": 40192} for gi in (1, 2)]


def mig_name(parent: int, gi: int) -> str:
    return f"gpu-{parent}-mig-{gi}-0"


def _devices(local: Local) -> dict[str, dict[str, Any]]:
    s = local.resource_slice()
    return {d["name"]: d for d in (s or {}).get("spec", {}).get("devices", [])}


def _attr(device: dict[str, Any], name: str) -> Any:
    value = device["attributes"][f"{DRIVER}/{name}"]
    return next(iter(value.values()))


def _health(local: Local, pod: str) -> dict[str, tuple[str, str]]:
    """Device name -> (health, message) from the pod's allocatedResourcesStatus: the kubelet names a DRA device by
    its first CDI ID, ours ``gpu.gpu-health.io/gpu=<claim uid>-<device name>`` (a UID has 36 characters)."""
    out: dict[str, tuple[str, str]] = {}
    for cs in local.get("pod", pod, NS)["status"].get("containerStatuses", []):
        for res in cs.get("allocatedResourcesStatus") or []:
            for r in res.get("resources") or []:
                rid = str(r["resourceID"])
                if rid.startswith(CDI_PREFIX):
                    out[rid[len(CDI_PREFIX) + 37:]] = (r.get("health", ""), r.get("message", ""))
    return out


def _condition(local: Local, pod: str) -> dict[str, Any]:
    """The pod's gpu-health.io/DevicesHealthy condition ({} while it has none): what a pod served with no claim
    shows of its devices' health, the kubelet showing nothing there."""
    conds = local.get("pod", pod, NS)["status"].get("conditions") or []
    return next((c for c in conds if c["type"] == "gpu-health.io/DevicesHealthy"), {})


def _claim(name: str, cls: str, selector: str | None = None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": cls, "allocationMode": "ExactCount", "count": 1}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name, "namespace": NS},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}


def _claim_pod(local: Local, name: str, claim: str) -> dict[str, Any]:
    pod = local.gpu_pod(name, 1)
    container = pod["spec"]["containers"][0]
    container["resources"] = {"claims": [{"name": "gpu"}]}
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    return pod


def _results(local: Local, claim: str) -> list[dict[str, Any]]:
    c = local.get("resourceclaim", claim, NS)
    return [r for r in c["status"]["allocation"]["devices"]["results"] if r["driver"] == DRIVER]


def _configure(local: Local) -> None:
    """The node's MIG layout in the node file, and the plugin's config with the mixed strategy and GPU 5 shared by
    two claims; then the DaemonSet restarted to read it (the config is read at start)."""
    for g in local.node_file.doc["gpus"]:
        if g["index"] in (MIG_1G, MIG_3G):
            g["mig_devices"] = _migs(g["index"])
    local.node_file.write()
    cm = local.get("configmap", CONFIGMAP, PLUGIN_NS)
    doc = yaml.safe_load(cm["data"]["config.yaml"])
    doc.setdefault("plugin", {})["migStrategy"] = "mixed"
    doc["sharing"] = {"timeSlicing": {"resources": [{"name": RES, "replicas": 2, "devices": [SHARED]}]}}
    cm["data"]["config.yaml"] = yaml.safe_dump(doc)
    local.kubectl("apply", "-f", "-", stdin=json.dumps(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CONFIGMAP, "namespace": PLUGIN_NS},
         "data": cm["data"]}))
    local.kubectl("-n", PLUGIN_NS, "rollout", "restart", "daemonset/gpu-health-device-plugin")
    local.kubectl("-n", PLUGIN_NS, "rollout", "status", "daemonset/gpu-health-device-plugin", "--timeout=180s",
                  timeout=200)


@pytest.fixture(scope="module", autouse=True)
def _node_as_it_was(local: Local) -> Iterator[None]:
    yield
    for g in local.node_file.doc["gpus"]:
        g.pop("mig_devices", None)
    _clear_signals(local)


def test_53_a_pod_asking_nvidia_com_gpu_with_no_claim_runs_on_the_dra_node(local: Local) -> None:
    local.kubectl("delete", "-n", NS, "pods", "--all", "--grace-period=1", "--wait=true", timeout=120)
    local.kubectl("delete", "-k", str(local.c.overlay("local-cluster")), "--ignore-not-found", "--wait=true",
                  timeout=180)
    _clear_signals(local)
    (local.c.layout.work / "plugin-state" / "state.json").unlink(missing_ok=True)
    local.kubectl("apply", "-k", str(local.c.overlay(OVERLAY)), timeout=120)
    _configure(local)
    devices = until("the slice with MIG instances and the shared GPU",
                    lambda: (d := _devices(local)) and mig_name(MIG_1G, 13) in d and
                    d.get(f"gpu-{SHARED}", {}).get("allowMultipleAllocations") and d, 90)
    cls = local.get("deviceclass", DRIVER)
    assert cls["spec"]["extendedResourceName"] == RES
    # The node advertises no nvidia.com/gpu of a device plugin: the scheduler serves the request through DRA.
    assert int(local.node_json()["status"].get("allocatable", {}).get(RES, "0")) == 0
    # The very pod spec the device-plugin stories run (Local.gpu_pod): limits nvidia.com/gpu: 2, no claim.
    local.apply(local.gpu_pod("plain-two", 2))
    uuids = local.visible_devices("plain-two")
    pod = local.get("pod", "plain-two", NS)
    ext = pod["status"]["extendedResourceClaimStatus"]
    assert [m["resourceName"] for m in ext["requestMappings"]] == [RES]
    results = _results(local, ext["resourceClaimName"])
    names = sorted(r["device"] for r in results)
    assert len(names) == 2 and all(_attr(devices[n], "type") == "gpu" for n in names), names
    assert sorted(uuids) == sorted(_attr(devices[n], "uuid") for n in names)
    log = local.logs("plain-two")
    assert "nvidiactl" in log and all(f"nvidia{_attr(devices[n], 'index')}" in log for n in names), log
    # The claim the scheduler made is prepared by our driver: its CDI spec is on the node.
    uid = local.get("resourceclaim", ext["resourceClaimName"], NS)["metadata"]["uid"]
    assert (local.c.layout.cdi_dir / f"{DRIVER}-{uid}.json").exists()
    # The kubelet shows no device health for a container that names no claim; our condition does.
    assert not _health(local, "plain-two")
    ok = until("the pod's DevicesHealthy condition", lambda: _condition(local, "plain-two"), 60)
    assert (ok["status"], ok["reason"]) == ("True", "Healthy") and all(n in ok["message"] for n in names), ok
    # Its GPUs' health reaches the scheduler (a fault taints the device, and no new pod gets it) and the pod.
    bad = int(_attr(devices[names[0]], "index"))
    local.signals(bad, xid_events=[48])
    taint = until("the taint on the pod's faulted GPU",
                  lambda: (_devices(local)[names[0]].get("taints") or [None])[0], 60)
    assert taint["key"] == "gpu-health.io/unhealthy" and taint["value"] == "xid-48", taint
    cond = until("the condition False", lambda: (c := _condition(local, "plain-two")).get("status") == "False" and c,
                 60)
    assert cond["reason"] == "Unhealthy" and cond["message"].startswith(f"{names[0]} Unhealthy: xid-48"), cond
    assert cond["lastTransitionTime"] >= ok["lastTransitionTime"]
    local.reset_gpu(bad)
    until("the taint gone after the reset", lambda: not _devices(local)[names[0]].get("taints"), 60)
    until("the condition True again", lambda: _condition(local, "plain-two").get("status") == "True", 60)
    _delete(local, "pod/plain-two")


def test_54_mig_instances_are_devices_and_a_fault_on_their_gpu_reaches_the_pods_status(local: Local) -> None:
    devices = _devices(local)
    names = sorted(devices)
    assert [n for n in names if n.startswith("gpu-") and "-mig-" not in n] == [f"gpu-{i}" for i in WHOLE]
    instances = [mig_name(MIG_1G, gi) for gi in range(7, 14)] + [mig_name(MIG_3G, gi) for gi in (1, 2)]
    assert sorted(instances) == sorted(n for n in names if "-mig-" in n)
    one = devices[mig_name(MIG_1G, 9)]
    parent = next(g for g in local.node_file.doc["gpus"] if g["index"] == MIG_1G)
    assert _attr(one, "type") == "mig" and _attr(one, "profile") == "1g.10gb"
    assert _attr(one, "parentUUID") == parent["uuid"] and _attr(one, "index") == MIG_1G
    assert _attr(one, "uuid") == _migs(MIG_1G)[2]["uuid"]
    assert one["capacity"][f"{DRIVER}/memory"]["value"] == "9856Mi"
    # A claim for one 1g.10gb instance (the profile's DeviceClass), and a pod that asks the profile's resource
    # as the mixed strategy names it, with no claim.
    local.apply(_claim("one-mig", "mig.gpu-health.io", f'device.attributes["{DRIVER}"].profile == "1g.10gb"'),
                _claim_pod(local, "mig-claim", "one-mig"))
    [seen] = local.visible_devices("mig-claim")
    [r] = _results(local, "one-mig")
    assert r["device"].startswith(f"gpu-{MIG_1G}-mig-") and seen == _attr(devices[r["device"]], "uuid")
    pod = local.gpu_pod("mig-plain", 1)
    pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/mig-3g.40gb": "1"}}
    local.apply(pod)
    [seen3] = local.visible_devices("mig-plain")
    assert seen3 in {m["uuid"] for m in _migs(MIG_3G)}
    # A MIG instance served with no claim: its health in the pod's condition, as a whole GPU's.
    cond = until("mig-plain's DevicesHealthy condition", lambda: _condition(local, "mig-plain"), 60)
    assert cond["status"] == "True" and cond["message"].startswith(f"gpu-{MIG_3G}-mig-"), cond
    until("the instance Healthy in the pod's status",
          lambda: _health(local, "mig-claim").get(r["device"], ("", ""))[0] == "Healthy", 90)
    # A fault on the parent GPU: every instance tainted, and the pod's status names the reason.
    local.signals(MIG_1G, xid_events=[48])
    until("every 1g.10gb instance tainted",
          lambda: all((_devices(local)[mig_name(MIG_1G, gi)].get("taints") or [{}])[0].get("value") == "xid-48"
                      for gi in range(7, 14)), 60)
    _, message = until("Unhealthy in the pod's status",
                            lambda: (h := _health(local, "mig-claim").get(r["device"])) and h[0] == "Unhealthy" and h,
                            90)
    assert message.startswith("xid-48"), message
    assert not (_devices(local)[mig_name(MIG_3G, 1)].get("taints")), "another GPU's instance was tainted"
    local.reset_gpu(MIG_1G)
    until("the instance Healthy again", lambda: _health(local, "mig-claim").get(r["device"], ("",))[0] == "Healthy",
          90)
    _delete(local, "pod/mig-claim", "pod/mig-plain", "resourceclaim/one-mig")


def test_55_two_claims_share_one_gpu_and_its_fault_reaches_both_pods(local: Local) -> None:
    select = f'device.attributes["{DRIVER}"].index == {SHARED}'
    for n in ("share-a", "share-b", "share-c"):
        local.apply(_claim(n, DRIVER, select))
    local.apply(_claim_pod(local, "share-a", "share-a"), _claim_pod(local, "share-b", "share-b"))
    uuid = next(g["uuid"] for g in local.node_file.doc["gpus"] if g["index"] == SHARED)
    assert local.visible_devices("share-a") == [uuid] and local.visible_devices("share-b") == [uuid]
    a, b = _results(local, "share-a"), _results(local, "share-b")
    assert [x["device"] for x in a + b] == [f"gpu-{SHARED}"] * 2
    assert a[0]["shareID"] != b[0]["shareID"]
    # The GPU takes two claims: a third stays unallocated and its pod unschedulable.
    local.apply(_claim_pod(local, "share-c", "share-c"))
    local.unschedulable("share-c")
    local.signals(SHARED, xid_events=[48])
    for pod in ("share-a", "share-b"):
        h = until(f"Unhealthy in {pod}'s status",
                  lambda p=pod: (x := _health(local, p).get(f"gpu-{SHARED}")) and x[0] == "Unhealthy" and x, 90)
        assert h[1].startswith("xid-48"), h
    local.reset_gpu(SHARED)
    _delete(local, "pod/share-a", "pod/share-b", "pod/share-c",
            "resourceclaim/share-a", "resourceclaim/share-b", "resourceclaim/share-c")
    # Leave no plugin and no plugin namespace, as story 27 left the cluster.
    local.kubectl("delete", "-k", str(local.c.overlay(OVERLAY)), "--ignore-not-found", "--wait=true", timeout=180)
    until("the node's slice gone once the driver left", lambda: local.resource_slice() is None, 120)
    assert not list(local.c.layout.cdi_dir.glob(f"{DRIVER}-*.json"))
    local.c.remove_reporting()  # the annotations an uninstall leaves (docs/deploy.md), as story 27 removes them
