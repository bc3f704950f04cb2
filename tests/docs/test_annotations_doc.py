"""docs/annotations.md shows what the program really writes.

The documented scenario (the built-in simulated node; at 00:01:00 GPU 2 reports 2 uncorrected ECC errors, GPU 3
XID 79 and GPU 5 runs at 90 C) is run through the real health policy and tracker, the node state, and the
outlets' own functions; every annotation value, Event message, condition message and `kubectl gpu-health` table in
the doc must be exactly what they produce.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from plugin import kubectl_plugin
from plugin.devices.model import Gpu, GpuEvent, Reading
from plugin.devices.simulated import builtin_node
from plugin.health.config import DEFAULT_KUBELET_HEALTH, HealthConfig
from plugin.health.node_state import DeviceStatus, NodeState, Snapshot
from plugin.health.tracker import DeviceTracker
from plugin.kube.names import DEFAULT_PREFIX
from plugin.outlets.condition import desired_condition
from plugin.outlets.events import event_for
from plugin.schema.annotations import desired_annotations, last_transitions

DOC = (Path(__file__).resolve().parents[2] / "docs" / "annotations.md").read_text()
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z
FAULT = T0 + 60


def _gpus() -> list[Gpu]:
    return [Gpu(uuid=g["uuid"], index=i, name=g.get("name", "NVIDIA GPU"))
            for i, g in enumerate(builtin_node()["gpus"])]


def _statuses(trackers: dict[str, DeviceTracker], gpus: list[Gpu], now: float) -> list[DeviceStatus]:
    out = []
    for g in gpus:
        state, reasons = trackers[g.uuid].update(now)
        out.append(DeviceStatus(g.uuid, g, state, reasons, trackers[g.uuid].since, DEFAULT_KUBELET_HEALTH[state]))
    return out


class Scenario:
    def __init__(self, faults: bool = True) -> None:
        self.gpus = _gpus()
        self.state = NodeState()
        cfg = HealthConfig()
        self.trackers = {g.uuid: DeviceTracker(g.uuid, cfg) for g in self.gpus}
        for t in self.trackers.values():
            t.observe_reading(Reading(time=T0, temperature_c=40, temperature_slowdown_c=87,
                                      temperature_shutdown_c=92, ecc_uncorrected_volatile=0))
        self.state.publish(_statuses(self.trackers, self.gpus, T0), T0)
        uuid = [g.uuid for g in self.gpus]
        for i, t in enumerate(self.trackers.values()):
            hot = i == 5
            ecc = 2 if i == 2 and faults else 0
            t.observe_reading(Reading(time=FAULT, temperature_c=90 if hot else 40, temperature_slowdown_c=87,
                                      temperature_shutdown_c=92, ecc_uncorrected_volatile=ecc))
        if faults:
            self.trackers[uuid[3]].observe_event(GpuEvent(uuid[3], "xid", 79, FAULT))
        self.transitions = self.state.publish(_statuses(self.trackers, self.gpus, FAULT), FAULT)

    @property
    def snapshot(self) -> Snapshot:
        return self.state.snapshot()

    def annotations(self, max_bytes: int = 65536) -> dict[str, str]:
        return desired_annotations(self.snapshot, last_transitions(self.state.history()),
                                   max_bytes=max_bytes).annotations


def _quoted(text: str) -> None:
    assert f"`{text}`" in DOC, f"docs/annotations.md does not show what the code writes:\n{text}"


def test_summary_and_device_value() -> None:
    ann = Scenario().annotations()
    _quoted(ann[f"{DEFAULT_PREFIX}/summary"])
    _quoted(ann[f"{DEFAULT_PREFIX}/devices"])
    blocks = re.findall(r"```json\n(.*?)```", DOC, re.S)
    assert len(blocks) == 1
    shown, real = json.loads(blocks[0]), json.loads(ann[f"{DEFAULT_PREFIX}/gpu.3"])
    assert shown == real and list(shown) == list(real)


def test_truncation_marker() -> None:
    s = Scenario()
    max_bytes = 1200
    marker = s.annotations(max_bytes)[f"{DEFAULT_PREFIX}/truncated"]
    dropped = int(marker.split()[0])
    template = marker.replace(f"{dropped} device", "N device", 1).replace(f"{max_bytes}-byte", "B-byte", 1)
    _quoted(template)


def test_event_message() -> None:
    s = Scenario()
    t = next(t for t in s.transitions if t.id == s.gpus[2].uuid)
    spec = event_for(t, "gpu.2")
    assert spec is not None and spec.reason == "GPUUnhealthy" and spec.type == "Warning"
    _quoted(spec.message)


def test_condition_messages() -> None:
    bad = desired_condition(Scenario().snapshot, "GPUHealthy")
    assert (bad.status, bad.reason) == ("False", "GPUUnhealthy")
    _quoted(bad.message)
    good = desired_condition(Scenario(faults=False).snapshot, "GPUHealthy")
    assert (good.status, good.reason) == ("True", "GPUsHealthy")
    _quoted(good.message)


def test_kubectl_gpu_health_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps({"kind": "List", "items": [
        {"kind": "Node", "metadata": {"name": "gpu-node-a", "annotations": Scenario().annotations()}}]}))
    assert kubectl_plugin.main(["--from-file", str(nodes), "--state", "Unhealthy,Degraded"]) == 0
    out = capsys.readouterr().out
    assert "$ kubectl gpu-health --state Unhealthy,Degraded\n" + out in DOC, out
