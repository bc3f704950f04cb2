"""GPUs missing from NVML: the PCI bus as sysfs lists it (a directory of our own), the expected count, the node
reason ``gpu-missing`` with its hysteresis, and what the annotations, the condition and the fleet controller's
decoder make of it. The monitor runs over the real simulated backend, polled by hand."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from plugin.devices.inventory import PciInventory
from plugin.devices.simulated import SimulatedBackend
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.health.policy import inventory_condition
from plugin.health.reasons import Action, State
from plugin.outlets.condition import desired_condition
from plugin.schema.annotations import decode, desired_annotations, merge_patch

P = "gpu-health.io"


def function(root: Path, name: str, vendor: int, cls: int) -> None:
    d = root / "bus" / "pci" / "devices" / name
    d.mkdir(parents=True)
    (d / "vendor").write_text(f"0x{vendor:04x}\n")
    (d / "class").write_text(f"0x{cls:06x}\n")


def bus(root: Path, gpus: int, extra: tuple[str, ...] = ()) -> None:
    """A server's PCI bus: a host bridge, a NIC, an NVSwitch and each GPU with its audio function."""
    function(root, "0000:00:00.0", 0x8086, 0x060000)
    function(root, "0000:05:00.0", 0x15B3, 0x020000)
    function(root, "0000:c6:00.0", 0x10DE, 0x068000)  # NVSwitch: a bridge, no GPU
    for i in range(gpus):
        function(root, f"0000:{0x18 + 0x10 * i:02x}:00.0", 0x10DE, 0x030200)
        function(root, f"0000:{0x18 + 0x10 * i:02x}:00.1", 0x10DE, 0x040300)  # its HDMI audio
    for name in extra:
        function(root, name, 0x10DE, 0x030000)


def test_the_inventory_lists_nvidia_display_controllers_only(tmp_path: Path) -> None:
    bus(tmp_path, 2, extra=("0001:3b:00.0",))
    inv = PciInventory(tmp_path)
    assert inv.gpus() == ((0, 0x18, 0), (0, 0x28, 0), (1, 0x3B, 0))
    # A GPU that leaves the bus (its function removed) leaves the list at the next look.
    for f in (tmp_path / "bus" / "pci" / "devices" / "0000:28:00.0").iterdir():
        f.unlink()
    (tmp_path / "bus" / "pci" / "devices" / "0000:28:00.0").rmdir()
    assert inv.gpus() == ((0, 0x18, 0), (1, 0x3B, 0))


def test_a_gpu_bound_to_another_driver_is_not_nvmls_to_list(tmp_path: Path) -> None:
    bus(tmp_path, 3)
    devices = tmp_path / "bus" / "pci" / "devices"
    drivers = tmp_path / "bus" / "pci" / "drivers"
    for d in ("nvidia", "vfio-pci"):
        (drivers / d).mkdir(parents=True)
    (devices / "0000:18:00.0" / "driver").symlink_to(drivers / "nvidia")
    (devices / "0000:28:00.0" / "driver").symlink_to(drivers / "vfio-pci")  # passed through to a VM
    # 0000:38:00.0 is bound to nothing: the driver's probe failed, so it is the one NVML should have had.
    assert PciInventory(tmp_path).gpus() == ((0, 0x18, 0), (0, 0x38, 0))


def test_an_unreadable_bus_is_unknown_said_once_not_empty(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "plugin.devices.inventory")
    inv = PciInventory(tmp_path / "no-sysfs")
    assert inv.gpus() is None and inv.gpus() is None
    assert len(caplog.records) == 1 and "cannot list" in caplog.records[0].getMessage()


@pytest.mark.parametrize("on_bus, in_nvml, count, expected, want", [
    ([(0, 0x18, 0), (0, 0x28, 0)], [(0, 0x18, 0), (0, 0x28, 0)], 2, None, None),
    ([(0, 0x18, 0), (0, 0x28, 0)], [(0, 0x18, 0)], 1, None,
     "1 GPU on the PCI bus not seen by NVML: 0000:28:00.0"),
    (None, [(0, 0x18, 0)], 1, 2, "NVML sees 1 of the 2 GPUs expected"),
    (None, [(0, 0x18, 0)], 1, 1, None),
    ([(0, 0x18, 0), (0, 0x28, 0), (0, 0x38, 0)], [(0, 0x18, 0)], 1, 4,
     "2 GPUs on the PCI bus not seen by NVML: 0000:28:00.0, 0000:38:00.0; NVML sees 1 of the 4 GPUs expected"),
    # More than expected is no fault of ours to report, and nothing known of the bus is not an empty bus.
    (None, [(0, 0x18, 0), (0, 0x28, 0)], 2, 1, None),
])
def test_the_condition_names_what_is_missing(on_bus: Any, in_nvml: Any, count: int, expected: int | None,
                                             want: str | None) -> None:
    c = inventory_condition(on_bus, in_nvml, count, expected, HealthConfig())
    assert (c.message if c else None) == want
    if c is not None:
        assert (c.code, c.severity, c.action) == ("gpu-missing", State.UNHEALTHY, Action.REBOOT_NODE)


class Node:
    def __init__(self, tmp: Path, gpus_in_nvml: int = 2, on_bus: int = 2, expected: int | None = None) -> None:
        self.tmp = tmp
        self.file = tmp / "node.json"
        self.write(gpus_in_nvml)
        self.sysfs = tmp / "sys"
        bus(self.sysfs, on_bus)
        self.now = 1_767_225_600.0
        self.state = NodeState()
        self.monitor = Monitor(SimulatedBackend(self.file, clock=lambda: self.now), self.state,
                               HealthConfig(clear_after_polls=3), 5.0, threading.Event(), clock=lambda: self.now,
                               inventory=PciInventory(self.sysfs).gpus, expected_gpus=expected)

    def write(self, n: int) -> None:
        self.file.write_text(json.dumps({"gpus": [
            {"uuid": f"GPU-5a1e0000-0000-4000-8000-{i:012d}", "index": i, "numa_node": 0, "name": "NVIDIA H100",
             "memory_mib": 81559, "nvlink_peers": [], "pcie_switch": None,
             "pci_bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0", "signals": {}} for i in range(n)]}))

    def poll(self) -> None:
        self.now += 5
        self.monitor.backend.reload()  # type: ignore[attr-defined]
        self.monitor.poll_once()

    def codes(self) -> list[str]:
        return [r.code for r in self.state.snapshot().node_reasons]


def test_a_gpu_on_the_bus_but_not_in_nvml_is_the_nodes_reason_after_two_polls(tmp_path: Path) -> None:
    n = Node(tmp_path, gpus_in_nvml=1, on_bus=2)
    n.poll()
    assert n.codes() == [] and n.monitor.gpus_missing == 1  # one poll may be a reset in progress
    first = n.now
    n.poll()
    snap = n.state.snapshot()
    [r] = snap.node_reasons
    assert r.code == "gpu-missing" and r.first_seen == first
    assert r.message == "1 GPU on the PCI bus not seen by NVML: 0000:28:00.0"
    assert [d.state for d in snap.devices] == [State.HEALTHY]  # the GPU that is there is fine
    # Unchanged node: no new snapshot, so no outlet has anything to write.
    version = snap.version
    for _ in range(5):
        n.poll()
    assert n.state.snapshot().version == version
    # The GPU comes back (a reboot brought it up): cleared after clearAfterPolls polls with every GPU there.
    n.write(2)
    n.poll()
    n.poll()
    assert n.codes() == ["gpu-missing"]
    n.poll()
    assert n.codes() == [] and n.monitor.gpus_missing == 0


def test_the_gpus_missing_gauge_scrapes_the_number_missing_and_zero_once_they_are_back(tmp_path: Path) -> None:
    """``gpu_health_gpus_missing`` through the registry /metrics serves: the GPUs the last poll found missing."""
    from plugin.outlets.metrics import Sources, build_registry
    from tests.unit.test_metrics import scrape, value

    n = Node(tmp_path, gpus_in_nvml=1, on_bus=3)
    registry = build_registry(Sources(n.state, n.monitor), process=False)

    def gauge() -> float | None:
        return value(scrape(registry), "gpu_health_gpus_missing")

    assert gauge() == 0  # not looked yet
    n.poll()
    n.poll()
    assert n.codes() == ["gpu-missing"] and gauge() == 2
    n.write(2)  # one of the two comes up
    n.poll()
    assert n.state.snapshot().node_reasons[0].message == "1 GPU on the PCI bus not seen by NVML: 0000:38:00.0"
    assert gauge() == 1
    n.write(3)  # and the other: nothing is missing from the first poll that sees them all, the reason clears later
    n.poll()
    assert n.codes() == ["gpu-missing"] and gauge() == 0
    n.poll()
    n.poll()
    assert n.codes() == [] and gauge() == 0
    # Fewer than the node's expected count, with no bus to read: the shortfall is the number missing.
    n.monitor.inventory = None
    n.monitor.set_expected_gpus(5)
    n.poll()
    assert gauge() == 2
    n.monitor.set_expected_gpus(3)
    n.poll()
    assert gauge() == 0


def test_fewer_gpus_than_expected_is_the_nodes_reason_with_no_bus_to_read(tmp_path: Path) -> None:
    n = Node(tmp_path, gpus_in_nvml=2, on_bus=2, expected=8)
    n.monitor.inventory = None
    n.poll()
    n.poll()
    assert n.codes() == ["gpu-missing"]
    assert n.state.snapshot().node_reasons[0].message == "NVML sees 2 of the 8 GPUs expected"
    n.monitor.set_expected_gpus(2)
    for _ in range(3):
        n.poll()
    assert n.codes() == []


def test_a_node_with_every_gpu_there_publishes_nothing_new(tmp_path: Path) -> None:
    n = Node(tmp_path, gpus_in_nvml=2, on_bus=2, expected=2)
    n.poll()
    version = n.state.snapshot().version
    for _ in range(10):
        n.poll()
    assert n.state.snapshot().version == version and n.codes() == []


def test_the_annotations_condition_and_decoder_carry_the_nodes_reason(tmp_path: Path) -> None:
    n = Node(tmp_path, gpus_in_nvml=1, on_bus=2)
    n.poll()
    n.poll()
    snap = n.state.snapshot()
    ann = desired_annotations(snap, {}).annotations
    assert ann[f"{P}/state"] == "Unhealthy"
    assert ann[f"{P}/summary"] == "Unhealthy: 1 device (1 Healthy); node gpu-missing (reboot-node)"
    node = json.loads(ann[f"{P}/node"])
    assert node == {"reasons": [{"code": "gpu-missing", "severity": "Unhealthy", "action": "reboot-node",
                                 "message": "1 GPU on the PCI bus not seen by NVML: 0000:28:00.0",
                                 "since": "2026-01-01T00:00:05Z"}]}  # the first poll that saw it
    decoded = decode(ann)
    assert decoded.node_codes == ("gpu-missing",) and decoded.state == "Unhealthy"
    assert [e.key for e in decoded.devices] == ["gpu.0"]  # the node key is no device
    cond = desired_condition(snap, "GPUHealthy")
    assert (cond.status, cond.reason) == ("False", "GPUUnhealthy")
    assert cond.message.startswith("gpu-missing: 1 GPU on the PCI bus not seen by NVML: 0000:28:00.0")
    assert desired_condition(snap, "AcceleratedHardwareReady", "eks").reason == "NvidiaDeviceCountMismatch"
    # Back: the key goes (a null in the merge patch), the state is Healthy again.
    n.write(2)
    for _ in range(3):
        n.poll()
    after = desired_annotations(n.state.snapshot(), {}).annotations
    patch = merge_patch(ann, after, P)
    assert patch[f"{P}/node"] is None and after[f"{P}/state"] == "Healthy"
    assert desired_condition(n.state.snapshot(), "GPUHealthy").status == "True"


def test_a_gpu_the_kernel_log_named_is_missing_until_nvml_lists_one_there(tmp_path: Path) -> None:
    n = Node(tmp_path, gpus_in_nvml=1, on_bus=1)
    n.monitor.inventory = None  # the bus cannot be read here: the log's word is all there is
    n.monitor.note_unknown_gpu((0, 0x28, 0), "init-failed")
    n.poll()
    n.poll()
    assert [r.message for r in n.state.snapshot().node_reasons] == [
        "the kernel log names 0000:28:00.0 (init-failed), which NVML does not list"]
    n.write(2)  # a driver reload brought it up: NVML lists a GPU at that address
    for _ in range(3):
        n.poll()
    assert n.codes() == [] and n.monitor.gpus_missing == 0
