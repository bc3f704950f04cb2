"""Reasons another health provider gives a GPU (``Monitor.set_external``), merged with the tracker's: the worst
state of both, published at once, inherited by the GPU's MIG devices, never latched or saved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plugin.health.reasons import Action, KubeletHealth, Reason, Source, State
from tests.unit.test_monitor import MIG, Node, gpu_doc

UUID = gpu_doc(0)["uuid"]


def external(code: str = "external-nvml-ready", severity: State = State.UNHEALTHY) -> Reason:
    return Reason(code, severity, "NVMLReady False: XidError", Source.EXTERNAL, Action.REBOOT_NODE, 1.0)


def test_an_external_reason_sets_the_state_at_once_and_its_clearing_restores_ours(tmp_path: Path) -> None:
    node = Node(tmp_path, [gpu_doc(0), gpu_doc(1)])
    node.poll()
    node.clock.now += 10
    transitions = node.monitor.set_external(UUID.upper().replace("GPU", "gpu"), [external()])  # any case
    assert [(t.id, t.to_state) for t in transitions] == [(UUID, "Unhealthy")]
    d = node.device(UUID)
    assert d.state is State.UNHEALTHY and d.kubelet_health is KubeletHealth.UNHEALTHY
    assert [r.code for r in d.reasons] == ["external-nvml-ready"] and d.since == node.clock.now
    assert node.device(gpu_doc(1)["uuid"]).state is State.HEALTHY
    version = node.state.snapshot().version
    assert node.monitor.set_external(UUID, [external()]) == []  # the same set again: nothing published
    node.poll(advance=5.0)
    assert node.state.snapshot().version == version, "an idle poll keeps the merged state as it is"
    node.clock.now += 10
    assert [t.to_state for t in node.monitor.set_external(UUID, [])] == ["Healthy"]
    assert node.device(UUID).reasons == () and node.device(UUID).since == node.clock.now


def test_the_worse_of_ours_and_theirs_wins_and_both_reasons_are_carried(tmp_path: Path) -> None:
    node = Node(tmp_path, [gpu_doc(0, temperature_c=90)])
    node.poll()
    assert node.device(UUID).state is State.DEGRADED
    node.monitor.set_external(UUID, [external(severity=State.UNKNOWN)])
    d = node.device(UUID)
    assert d.state is State.UNKNOWN
    assert [r.code for r in d.reasons] == ["external-nvml-ready", "thermal-slowdown"]


def test_mig_devices_inherit_their_gpus_external_reasons(tmp_path: Path) -> None:
    node = Node(tmp_path, [gpu_doc(0, migs=1)])
    node.poll()
    node.monitor.set_external(UUID, [external()])
    mig = node.device(MIG)
    assert mig.state is State.UNHEALTHY and [r.code for r in mig.reasons] == ["external-nvml-ready"]


def test_reasons_for_a_gpu_not_yet_seen_apply_when_it_appears(tmp_path: Path) -> None:
    node = Node(tmp_path, [gpu_doc(0)])
    node.poll()
    late = gpu_doc(1)["uuid"]
    assert node.monitor.set_external(late, [external()]) == []
    node.change([gpu_doc(0), gpu_doc(1)])
    node.poll(advance=5.0)
    assert node.device(late).state is State.UNHEALTHY


def test_external_reasons_are_not_saved_nor_latched(tmp_path: Path) -> None:
    node = Node(tmp_path, [gpu_doc(0)])
    node.poll()
    node.monitor.set_external(UUID, [external()])
    node.save()
    saved = json.loads((node.state_dir / "state.json").read_text())
    assert not any("latched" in v and v["latched"] for v in saved["devices"].values())
    node.restart()
    node.poll()
    assert node.device(UUID).state is State.HEALTHY, "the source sends them again; a restart does not keep them"


def test_a_saved_transition_this_release_cannot_read_is_skipped_not_fatal(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    # A later release may save a reason source or state this one does not know (as this release added "external"):
    # after a rollback the plugin must still start, keeping every transition it can read.
    node = Node(tmp_path, [gpu_doc(0)])
    node.poll()
    node.monitor.set_external(UUID, [external()])
    node.save()
    path = node.state_dir / "state.json"
    saved = json.loads(path.read_text())
    readable = len(saved["transitions"])
    assert readable >= 2
    saved["transitions"][-1]["reasons"][0]["source"] = "from-a-later-release"
    path.write_text(json.dumps(saved))
    node.restart()
    assert [t.seq for t in node.state.history()] == [t["seq"] for t in saved["transitions"][:-1]]
    assert any("skipped" in r.getMessage() and "from-a-later-release" in r.getMessage() for r in caplog.records)
