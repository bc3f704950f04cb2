"""The health engine over a real simulated backend, a fake clock and a real state dir: ``since``, restarts and
rate holds as a device's published status shows them. No threads are started; each poll is called directly."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from plugin.devices.simulated import SimulatedBackend
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import DeviceStatus, NodeState
from plugin.health.reasons import State
from plugin.health.store import StateStore

MIG = "MIG-5a1e0000-0001-4000-8000-000000000001"


class Clock:
    def __init__(self, now: float = 1_767_225_600.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def gpu_doc(i: int, migs: int = 0, **signals: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "uuid": f"GPU-5a1e0000-0000-4000-8000-{i:012d}", "index": i, "numa_node": 0,
        "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559, "nvlink_peers": [], "pcie_switch": None,
        "signals": dict(signals),
    }
    if migs:
        doc["mig_devices"] = [{"uuid": MIG, "gpu_instance_id": 1, "profile": "1g.10gb"}]
    return doc


class Node:
    """A node file, the backend over it, and a monitor with a state dir: ``restart()`` is a plugin restart."""

    def __init__(self, tmp: Path, gpus: list[dict[str, Any]], cfg: HealthConfig | None = None) -> None:
        self.file = tmp / "node.json"
        self.state_dir = tmp / "state"
        self.clock = Clock()
        self.cfg = cfg or HealthConfig()
        self.write(gpus)
        self.restart()

    def write(self, gpus: list[dict[str, Any]]) -> None:
        self.file.write_text(json.dumps({"gpus": gpus}))

    def restart(self) -> None:
        self.backend = SimulatedBackend(self.file, clock=self.clock)
        self.state = NodeState()
        self.monitor = Monitor(self.backend, self.state, self.cfg, 5.0, threading.Event(),
                               StateStore(self.state_dir), clock=self.clock)

    def change(self, gpus: list[dict[str, Any]]) -> None:
        """Rewrite the file and apply it the way the watcher does, then deliver any new events."""
        self.write(gpus)
        assert self.backend.reload()
        events = self.backend.wait_events(0)
        if events:
            self.monitor.handle_events(events)

    def poll(self, advance: float = 0.0) -> None:
        self.clock.now += advance
        self.monitor.poll_once()

    def save(self) -> None:
        assert self.monitor.persister is not None
        self.monitor.persister.flush()

    def device(self, device_id: str) -> DeviceStatus:
        d = self.state.snapshot().get(device_id)
        assert d is not None, f"{device_id} not published"
        return d


def test_since_of_an_unchanged_device_stays_put_and_idle_polls_publish_nothing(tmp_path: Path) -> None:
    node = Node(tmp_path, [gpu_doc(0), gpu_doc(1)])
    node.poll()
    first = node.clock.now
    version = node.state.snapshot().version
    for _ in range(20):
        node.poll(advance=5.0)
    assert [d.since for d in node.state.snapshot().devices] == [first, first]
    # Nothing a reader can see changed, so the snapshot was never replaced: outlets and streams stay asleep.
    assert node.state.snapshot().version == version


def test_since_moves_only_when_the_state_changes(tmp_path: Path) -> None:
    uuid = gpu_doc(0)["uuid"]
    node = Node(tmp_path, [gpu_doc(0)])
    node.poll()
    node.change([gpu_doc(0, temperature_c=90)])
    node.poll(advance=5.0)
    hot_at = node.clock.now
    assert node.device(uuid).state is State.DEGRADED and node.device(uuid).since == hot_at
    node.change([gpu_doc(0, temperature_c=91)])  # a new message, the same state
    node.poll(advance=5.0)
    assert node.device(uuid).since == hot_at


def test_since_is_kept_across_a_plugin_restart(tmp_path: Path) -> None:
    node = Node(tmp_path, [gpu_doc(0)])
    node.poll()
    first = node.clock.now
    node.save()
    node.clock.now += 3600
    node.restart()
    node.poll()
    assert node.device(gpu_doc(0)["uuid"]).since == first


def test_a_latched_xid_on_a_mig_device_survives_two_restarts(tmp_path: Path) -> None:
    node = Node(tmp_path, [gpu_doc(0, migs=1)])
    node.poll()
    node.change([gpu_doc(0, migs=1, mig_events=[{"gpu_instance_id": 1, "xid": 48}])])
    assert node.device(MIG).state is State.UNHEALTHY
    latched_at = node.device(MIG).since
    node.save()
    for _ in range(2):  # the second restart checks that the first one's state write kept the MIG entry
        node.clock.now += 60
        node.restart()
        node.poll()
        mig = node.device(MIG)
        assert mig.state is State.UNHEALTHY and [r.code for r in mig.reasons] == ["xid-48"]
        assert mig.since == latched_at
        assert node.device(gpu_doc(0)["uuid"]).state is State.HEALTHY  # the parent is not charged
        node.save()


def test_saved_latches_of_a_device_missing_at_the_first_poll_are_kept(tmp_path: Path) -> None:
    late = gpu_doc(1)["uuid"]
    node = Node(tmp_path, [gpu_doc(0), gpu_doc(1)])
    node.poll()
    node.change([gpu_doc(0), gpu_doc(1, xid_events=[79])])
    assert node.device(late).state is State.UNHEALTHY
    node.save()
    node.write([gpu_doc(0)])  # GPU 1 has not come up yet when the plugin restarts
    node.restart()
    node.poll(advance=10)
    node.save()  # this write must not drop GPU 1's entry
    node.write([gpu_doc(0), gpu_doc(1, xid_events=[79])])
    node.restart()
    node.poll(advance=10)
    assert node.device(late).state is State.UNHEALTHY
    assert [r.code for r in node.device(late).reasons] == ["xid-79"]


@pytest.mark.parametrize(("xid", "after"), [(48, State.HEALTHY), (64, State.UNHEALTHY), (79, State.UNHEALTHY)])
def test_a_device_that_leaves_nvml_and_returns_was_reset_only_reset_latches_clear(tmp_path: Path, xid: int,
                                                                                    after: State) -> None:
    # Leaving NVML and coming back while the plugin runs is what a GPU reset or driver reload looks like: the latches
    # a reset mends (xid-48) clear, those it does not (xid-64: support; xid-79: a reboot) stay.
    uuid = gpu_doc(1)["uuid"]
    node = Node(tmp_path, [gpu_doc(0), gpu_doc(1)])
    node.poll()
    node.change([gpu_doc(0), gpu_doc(1, xid_events=[xid])])
    assert node.device(uuid).state is State.UNHEALTHY
    node.change([gpu_doc(0)])
    node.poll(advance=5)
    assert node.state.snapshot().get(uuid) is None
    node.save()
    node.change([gpu_doc(0), gpu_doc(1)])
    node.poll(advance=5)
    assert node.device(uuid).state is after
    if after is State.HEALTHY:
        last = node.state.history()[-1]
        assert last.id == uuid and "left NVML and came back" in last.note and f"xid-{xid}" in last.note


def test_a_pcie_replay_storm_holds_for_the_rate_window_then_clears(tmp_path: Path) -> None:
    uuid = gpu_doc(0)["uuid"]
    node = Node(tmp_path, [gpu_doc(0)], HealthConfig(rate_hold_s=600.0))
    node.poll()
    node.change([gpu_doc(0, pcie_replay_count=10_000)])
    node.poll(advance=0.5)
    assert [r.code for r in node.device(uuid).reasons] == ["pcie-replay-rate"]
    stopped_at = node.clock.now
    for _ in range(10):  # the counter stopped growing: each poll is clean
        node.poll(advance=0.5)
    assert node.device(uuid).state is State.DEGRADED
    node.clock.now = stopped_at + 599
    node.poll()
    assert node.device(uuid).state is State.DEGRADED
    node.clock.now = stopped_at + 601
    node.poll()
    assert node.device(uuid).state is State.HEALTHY


def test_a_held_rate_condition_survives_a_restart(tmp_path: Path) -> None:
    uuid = gpu_doc(0)["uuid"]
    node = Node(tmp_path, [gpu_doc(0)], HealthConfig(rate_hold_s=600.0))
    node.poll()
    node.change([gpu_doc(0, nvlink_error_count=5)])
    node.poll(advance=1)
    assert [r.code for r in node.device(uuid).reasons] == ["nvlink-errors"]
    node.save()
    node.restart()
    node.poll(advance=60)
    assert [r.code for r in node.device(uuid).reasons] == ["nvlink-errors"]
    node.poll(advance=600)
    assert node.device(uuid).state is State.HEALTHY


def test_a_corrected_ecc_burst_is_flagged_and_held_when_a_rate_is_configured(tmp_path: Path) -> None:
    uuid = gpu_doc(0)["uuid"]
    node = Node(tmp_path, [gpu_doc(0)], HealthConfig(ecc_corrected_rate_per_min=100.0, rate_hold_s=300.0))
    node.poll()
    node.change([gpu_doc(0, ecc_corrected_volatile=50)])
    node.poll(advance=6)  # 500/min
    assert [r.code for r in node.device(uuid).reasons] == ["ecc-corrected-rate"]
    for _ in range(5):
        node.poll(advance=6)
    assert node.device(uuid).state is State.DEGRADED
    node.poll(advance=300)
    assert node.device(uuid).state is State.HEALTHY
