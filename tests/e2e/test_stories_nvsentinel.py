"""NVSentinel on the real local cluster (issue 26, docs/nvsentinel.md): the plugin deployed with both NVSentinel
components (manifests/overlays/local-cluster-nvsentinel) while NVSentinel's stand-in (the conformance peer of
tests/conformance/nvsentinel, docs/conformance.md) serves its platform connector and its device API on the node,
where NVSentinel's own pods would.

Runs after test_stories_dra_chart.py (story 27 left no plugin installed) and leaves the cluster as it found it: the
safety stories after it deploy the plugin themselves.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conformance.nvsentinel.peer import DeviceApiClient, Event, NvsentinelPeer, build_peer
from tests.e2e.conftest import Local, until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OVERLAY = "local-cluster-nvsentinel"
PLUGIN_NS = "gpu-health-system"
FAULTY = 3  # the GPU the fault story uses
OTHERS = 5  # the GPU another provider finds failing


@pytest.fixture(scope="module")
def peer(local: Local) -> Iterator[NvsentinelPeer]:
    """NVSentinel's stand-in on the node, its sockets in the directory the overlay mounts into the plugin's pod."""
    root = local.c.layout.work / "nvsentinel"
    root.mkdir(exist_ok=True)
    p = NvsentinelPeer(build_peer(), root).start()
    yield p
    p.stop()
    shutil.rmtree(root, ignore_errors=True)


def _about(uuid: str, healthy: bool) -> Callable[[Event], bool]:
    return lambda e: e["isHealthy"] is healthy and any(
        x["entityType"] == "GPU_UUID" and x["entityValue"] == uuid for x in e["entitiesImpacted"])


def _our_condition(client: DeviceApiClient, uuid: str) -> Any:
    return next((c for c in client.get(uuid.lower()).status.conditions if c.type == "gpu-health.io/GPUHealthy"), None)


def test_28_a_fault_on_the_node_reaches_nvsentinel_as_the_table_says_and_its_recovery_closes_it(
        local: Local, peer: NvsentinelPeer) -> None:
    # A clean node: earlier stories latched faults in the state dir this deployment shares.
    for g in local.node_file.doc["gpus"]:
        g["signals"] = {}
    local.node_file.write()
    (local.c.layout.work / "plugin-state" / "state.json").unlink(missing_ok=True)
    local.kubectl("apply", "-k", str(local.c.overlay(OVERLAY)), timeout=120)
    local.kubectl("-n", PLUGIN_NS, "rollout", "status", "daemonset/gpu-health-device-plugin", "--timeout=180s",
                  timeout=200)
    local.wait_gpus(8)
    uuids = local.node_file.uuids
    # The provider registered every GPU under its lowercased UUID; a healthy node sent NVSentinel nothing.
    with DeviceApiClient(peer.device_socket) as client:
        until("every GPU in the device API", lambda: {g.metadata.name for g in client.list()} == {
            u.lower() for u in uuids})
        until("our condition on every GPU", lambda: all(
            (c := _our_condition(client, u)) is not None and c.status == "True" for u in uuids))
    assert peer.events() == []
    # XID 79 on one GPU: the event docs/nvsentinel.md's table gives xid-79.
    uuid = uuids[FAULTY]
    local.signals(FAULTY, xid_events=[79])
    [event] = peer.wait_events(_about(uuid, healthy=False), timeout=60)
    assert (event["agent"], event["componentClass"], event["checkName"]) == (
        "gpu-health-device-plugin", "GPU", "GpuHealthXid")
    assert (event["isFatal"], event["errorCode"], event["recommendedAction"]) == (True, ["79"], "RESTART_BM")
    assert event["nodeName"] == local.node and event["processingStrategy"] == "EXECUTE_REMEDIATION"
    entities = [(x["entityType"], x["entityValue"]) for x in event["entitiesImpacted"]]
    assert entities[0] == ("GPU", str(FAULTY)) and entities[-1] == ("GPU_UUID", uuid)
    assert event["metadata"] == {"state": "Unhealthy", "codes": "xid-79", "action": "reboot-node"}
    # The same fault everywhere else the plugin reports it, and in the device API.
    local.wait_gpus(7)
    assert local.wait_annotation(FAULTY, lambda a: a["state"] == "Unhealthy")["reasons"][0]["code"] == "xid-79"
    with DeviceApiClient(peer.device_socket) as client:
        ours = until("our condition False on the faulty GPU", lambda: (c := _our_condition(client, uuid)) is not None
                     and c.status == "False" and c)
        assert ours.reason == "Xid79" and client.get(uuid.lower()).status.recommended_action == "reboot-node"
    # The GPU is fixed and the operator clears it (XID 79 asks for a reboot; a reset is not one): the XID check
    # closes with the same check name and entities.
    seen = len(peer.events())
    local.clear_gpu(FAULTY, "xid-79", "GPU reseated (story 28)")
    local.wait_gpus(8)
    closed = peer.wait_events(lambda e: _about(uuid, healthy=True)(e) and e["checkName"] == "GpuHealthXid",
                              timeout=60, after=seen)[0]
    assert closed["entitiesImpacted"] == event["entitiesImpacted"] and closed["isFatal"] is False
    # Nothing about the other GPUs was ever sent.
    assert all(_about(uuid, True)(e) or _about(uuid, False)(e) for e in peer.events())


def test_29_another_monitors_finding_reaches_the_kubelet_and_the_node_through_us_then_uninstall(
        local: Local, peer: NvsentinelPeer) -> None:
    uuid = local.node_file.uuids[OTHERS]
    sent = len(peer.events())
    with DeviceApiClient(peer.device_socket) as other:
        # As NVSentinel's NVML provider marks a GPU after a critical XID: a condition of its own, False.
        other.set_condition(uuid.lower(), "NVMLReady", "False", reason="XidError",
                            message="Critical XID error 48 detected")
        local.wait_gpus(7)
        ann = local.wait_annotation(OTHERS, lambda a: a["state"] == "Unhealthy")
        assert ann["reasons"][0]["code"] == "external-nvml-ready"
        assert "Critical XID error 48" in ann["reasons"][0]["message"]
        # Our own condition says so too, next to theirs, which we kept.
        until("our condition False beside theirs", lambda: (c := _our_condition(other, uuid)) is not None
              and c.status == "False" and c.reason == "ExternalNvmlReady")
        assert {c.type for c in other.get(uuid.lower()).status.conditions} == {"gpu-health.io/GPUHealthy",
                                                                                "NVMLReady"}
        other.set_condition(uuid.lower(), "NVMLReady", "True", reason="Initialized", message="GPU usable again")
        local.wait_gpus(8)
        local.wait_annotation(OTHERS, lambda a: a["state"] == "Healthy")
    # A finding that came from NVSentinel's side is never sent back to it.
    assert not [e for e in peer.events()[sent:] if _about(uuid, False)(e)]
    local.kubectl("delete", "-k", str(local.c.overlay(OVERLAY)), "--wait=true", timeout=200)
    assert local.plugin_pods() == []
