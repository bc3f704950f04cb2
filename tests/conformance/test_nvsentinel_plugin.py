"""The real plugin process against the NVSentinel stand-in: health events into the platform connector, GPUs and
conditions through the device API, as provider and as consumer. Black box: the CLI, a simulated node file, the peer's
records; the plugin's own code and counters are never looked at.

Asserted here as docs/nvsentinel.md states it: the GPU named as NVSentinel's own GPU monitor names it (index, PCI
address, GPU_UUID), isHealthy/isFatal, errorCode, recommendedAction, processingStrategy, agent, componentClass, the
same checkName and entities clearing what they raised; a device-API GPU per GPU named by its lowercased UUID, our one
condition type, and another provider's failing condition (NVSentinel's providers say False for a GPU they find unfit)
as an external-<type> reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.nvsentinel.peer import DeviceApiClient, Event, NvsentinelPeer, poll
from tests.conftest import NodeFile

pytestmark = pytest.mark.conformance

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.1
IDLE_POLLS = 20
AGENT = "gpu-health-device-plugin"


class Plugin:
    """`gpu-health-plugin run` as a process on a simulated node, wired to the peer."""

    def __init__(self, root: Path, peer: NvsentinelPeer, *extra: str) -> None:
        self.root = root
        self.node = NodeFile(root / "node.json")
        (root / "dev").mkdir(exist_ok=True)
        for name in [f"nvidia{i}" for i in range(8)] + ["nvidiactl", "nvidia-uvm"]:
            (root / "dev" / name).touch()
        self.args = [
            sys.executable, "-m", "plugin", "run", "--backend", "simulated", "--simulated-node", str(self.node.path),
            "--device-plugin-dir", str(root / "dp"), "--state-dir", str(root / "state"), "--dev-root", str(root),
            "--metrics-address", "off", "--poll-interval", str(POLL_S), "--correlate-on", "none",
            "--nvsentinel-socket", str(peer.connector_socket), "--device-api-socket", str(peer.device_socket),
            "--device-api-provide", "--device-api-consume", *extra]
        self.proc = subprocess.Popen(self.args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def uuid(self, index: int) -> str:
        return str(self.node.uuids[index])

    def status(self) -> dict[str, dict[str, Any]]:
        """`gpu-health-plugin status -o json`, by device id."""
        proc = subprocess.run([sys.executable, "-m", "plugin", "status", "--state-dir", str(self.root / "state"),
                               "-o", "json"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return {d["id"]: d for d in json.loads(proc.stdout)["devices"]}

    def codes(self, index: int) -> list[str]:
        try:
            device = self.status().get(self.uuid(index))
        except AssertionError:
            return []  # not serving yet
        return [r["code"] for r in device["reasons"]] if device else []

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out


@pytest.fixture
def peer(nvsentinel_peer: NvsentinelPeer) -> NvsentinelPeer:
    return nvsentinel_peer


@pytest.fixture
def start_plugin(peer: NvsentinelPeer, short_socket_dir: Path) -> Iterator[Callable[..., Plugin]]:
    started: list[Plugin] = []

    def start(*extra: str) -> Plugin:
        started.append(Plugin(short_socket_dir, peer, *extra))
        return started[-1]

    yield start
    for plugin in started:
        plugin.stop()


def about(uuid: str) -> Callable[[Event], bool]:
    """Events naming this GPU by UUID, as NVSentinel's GPU reset and drain look it up."""
    return lambda e: any(x["entityValue"] == uuid and x["entityType"] == "GPU_UUID" for x in e["entitiesImpacted"])


def unhealthy(uuid: str) -> Callable[[Event], bool]:
    return lambda e: about(uuid)(e) and not e["isHealthy"]


def registered(peer: NvsentinelPeer, plugin: Plugin, timeout: float = 60.0) -> None:
    """Every GPU of the node created in the device API, named by its lowercased UUID."""
    expected = {u.lower() for u in plugin.node.uuids}

    def done() -> bool:
        if plugin.proc.poll() is not None:
            raise AssertionError(f"the plugin exited with {plugin.proc.returncode}: {plugin.stop()}")
        return expected <= {w["name"] for w in peer.device_writes() if w["operation"] == "create"}

    poll(done, timeout, "every GPU created in the device API")


def append_xid(plugin: Plugin, index: int, xid: int) -> None:
    sig = plugin.node.doc["gpus"][index]["signals"]
    plugin.node.set(index, xid_events=[*sig.get("xid_events", []), xid])


def test_xid79_reaches_the_platform_connector_as_a_fatal_restart_bm_event(peer: NvsentinelPeer,
                                                                          start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin()
    registered(peer, plugin)
    append_xid(plugin, 0, 79)
    [event, *_] = peer.wait_events(unhealthy(plugin.uuid(0)))
    assert event["isFatal"] is True and event["isHealthy"] is False
    assert any("79" in code for code in event["errorCode"]), event["errorCode"]
    assert event["recommendedAction"] == "RESTART_BM"
    assert (event["agent"], event["componentClass"]) == (AGENT, "GPU")
    entities = [(x["entityType"], x["entityValue"]) for x in event["entitiesImpacted"]]
    assert entities[0] == ("GPU", "0") and entities[-1] == ("GPU_UUID", plugin.uuid(0))
    assert [t for t, _ in entities] in (["GPU", "GPU_UUID"], ["GPU", "PCI", "GPU_UUID"])
    assert event["nodeName"] and event["checkName"]
    assert event["processingStrategy"] == "EXECUTE_REMEDIATION"
    assert event["rawProcessingStrategy"] in ("UNSPECIFIED", "EXECUTE_REMEDIATION")
    others = {plugin.uuid(i) for i in range(1, 8)}
    assert not [e for e in peer.events() if not e["isHealthy"] and
                any(x["entityValue"] in others for x in e["entitiesImpacted"])]


def test_a_cleared_polled_fault_sends_a_healthy_event_for_the_same_check(peer: NvsentinelPeer,
                                                                         start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin()
    registered(peer, plugin)
    plugin.node.set(2, row_remap_pending=True)
    [raised, *_] = peer.wait_events(unhealthy(plugin.uuid(2)))
    assert raised["isFatal"] is False  # Degraded: reported, not fatal
    seen = len(peer.events())
    plugin.node.set(2, row_remap_pending=None)
    [cleared, *_] = peer.wait_events(lambda e: about(plugin.uuid(2))(e) and e["isHealthy"], after=seen)
    assert cleared["checkName"] == raised["checkName"]
    assert cleared["entitiesImpacted"] == raised["entitiesImpacted"]
    assert cleared["isFatal"] is False and cleared["agent"] == AGENT


def test_store_only_marks_every_event_store_only(peer: NvsentinelPeer,
                                                 start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin("--nvsentinel-store-only")
    registered(peer, plugin)
    append_xid(plugin, 0, 79)
    peer.wait_events(unhealthy(plugin.uuid(0)))
    assert {(e["processingStrategy"], e["rawProcessingStrategy"]) for e in peer.events()} == {
        ("STORE_ONLY", "STORE_ONLY")}


def test_a_restarted_nvsentinel_hears_the_current_faults_again(peer: NvsentinelPeer,
                                                              start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin()
    registered(peer, plugin)
    append_xid(plugin, 0, 79)
    [first, *_] = peer.wait_events(unhealthy(plugin.uuid(0)))
    peer.restart()  # its device API comes back empty, as NVSentinel's does
    seen_events, seen_writes = len(peer.events()), len(peer.device_writes())
    [again, *_] = peer.wait_events(unhealthy(plugin.uuid(0)), after=seen_events)
    assert (again["checkName"], again["isFatal"], again["errorCode"]) == (
        first["checkName"], first["isFatal"], first["errorCode"])
    poll(lambda: {u.lower() for u in plugin.node.uuids} <= {
        w["name"] for w in peer.device_writes()[seen_writes:] if w["operation"] == "create"}, 60,
        "the GPUs registered again after the device API restarted")
    with DeviceApiClient(peer.device_socket) as client:
        poll(lambda: any("79" in c.reason + c.message for c in client.get(plugin.uuid(0).lower()).status.conditions),
             30, "our condition on GPU 0 written again")


def test_an_idle_node_sends_nothing_and_writes_nothing(peer: NvsentinelPeer,
                                                       start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin()
    registered(peer, plugin)

    def counts() -> tuple[int, int]:
        return len(peer.events()), len(peer.device_writes())

    # Start-up may publish once per GPU; wait until two reads a few polls apart agree.
    previous: list[tuple[int, int]] = [(-1, -1)]

    def settled() -> bool:
        now, before = counts(), previous[0]
        previous[0] = now
        return now == before

    poll(settled, 30, "start-up writes to end", interval=5 * POLL_S)
    baseline = counts()
    # The point is the absence of writes, so the time has to pass: IDLE_POLLS poll intervals, nothing to await.
    time.sleep(IDLE_POLLS * POLL_S)
    assert counts() == baseline
    assert plugin.proc.poll() is None


def test_every_gpu_is_in_the_device_api_and_a_fault_writes_our_condition(peer: NvsentinelPeer,
                                                                        start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin()
    registered(peer, plugin)
    with DeviceApiClient(peer.device_socket) as client:
        gpus = {g.metadata.name: g for g in client.list()}
        assert set(gpus) == {u.lower() for u in plugin.node.uuids}
        assert all(g.spec.uuid == plugin.uuid(i) for i, g in
                   enumerate(gpus[u.lower()] for u in plugin.node.uuids))
        append_xid(plugin, 0, 79)
        name = plugin.uuid(0).lower()
        poll(lambda: any("79" in c.reason + c.message for c in client.get(name).status.conditions), 30,
             "our condition on GPU 0")
        [ours] = client.get(name).status.conditions
        assert (ours.type, ours.status, ours.reason) == ("gpu-health.io/GPUHealthy", "False", "Xid79")
        assert client.get(name).status.recommended_action == "reboot-node"
        assert not any("79" in c.reason + c.message for c in client.get(plugin.uuid(1).lower()).status.conditions)
    assert not [c for c in plugin.codes(0) if c.startswith("external-")]  # our own condition read back is not news


def test_another_providers_failing_condition_is_a_reason_until_cleared(peer: NvsentinelPeer,
                                                                       start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin()
    registered(peer, plugin)
    name = plugin.uuid(1).lower()
    with DeviceApiClient(peer.device_socket) as other:
        # As NVSentinel's NVML provider marks a GPU after a critical XID: its own condition type, False.
        other.set_condition(name, "NVMLReady", "False", reason="XidError", message="Critical XID error 48 detected")
        codes = poll(lambda: [c for c in plugin.codes(1) if c.startswith("external-")], 30,
                     "an external- reason on GPU 1")
        assert codes == ["external-nvml-ready"]
        assert plugin.status()[plugin.uuid(1)]["state"] == "Unhealthy"
        assert not [c for c in plugin.codes(0) if c.startswith("external-")]
        other.set_condition(name, "NVMLReady", "True", reason="Initialized", message="fine again")
        poll(lambda: not [c for c in plugin.codes(1) if c.startswith("external-")], 30,
             "the external- reason on GPU 1 gone once its provider says True")
        append_xid(plugin, 0, 79)  # our own condition, written and read back, is never external
        poll(lambda: any("79" in c.reason + c.message for c in other.get(plugin.uuid(0).lower()).status.conditions),
             30, "our condition on GPU 0")
        assert not [c for c in plugin.codes(0) if c.startswith("external-")]
