"""What the NVML backend keeps in the state dir across restarts (plugin/devices/memory.py): links seen active, and
the call a dead process was in."""

from __future__ import annotations

import json
from pathlib import Path

from plugin.devices.memory import FILE, INFLIGHT, NvmlMemory


def test_links_seen_active_survive_a_restart_and_are_written_only_when_they_grow(tmp_path: Path) -> None:
    m = NvmlMemory(tmp_path)
    m.saw_active("GPU-a", [0, 1, 2])
    written = (tmp_path / FILE).stat().st_mtime_ns
    m.saw_active("GPU-a", [1, 2])  # nothing new: an idle poll writes nothing
    assert (tmp_path / FILE).stat().st_mtime_ns == written
    m.saw_active("GPU-a", [3])
    assert NvmlMemory(tmp_path).links_seen("GPU-a") == frozenset({0, 1, 2, 3})
    assert NvmlMemory(tmp_path).links_seen("GPU-b") == frozenset()


def test_a_marker_left_by_a_dead_process_names_the_call_to_skip_on_that_model_and_driver(tmp_path: Path) -> None:
    m = NvmlMemory(tmp_path)
    # The process dies inside the call: the context never exits, so the marker stays.
    ctx = m.inflight("fabric", "NVIDIA GB200", "570.124.06", "nvmlDeviceGetGpuFabricInfoV")
    ctx.__enter__()
    assert json.loads((tmp_path / INFLIGHT).read_text())["call"] == "nvmlDeviceGetGpuFabricInfoV"
    again = NvmlMemory(tmp_path)
    assert not (tmp_path / INFLIGHT).exists()
    crashed = again.crashed("fabric", "NVIDIA GB200", "570.124.06")
    assert crashed is not None and crashed["call"] == "nvmlDeviceGetGpuFabricInfoV"
    assert again.crashed("fabric", "NVIDIA GB200", "575.51.03") is None  # a new driver tries it again
    assert again.crashed("fabric", "NVIDIA H100 80GB HBM3", "570.124.06") is None
    assert NvmlMemory(tmp_path).crashed("fabric", "NVIDIA GB200", "570.124.06") == crashed  # kept


def test_a_call_that_returns_leaves_no_marker(tmp_path: Path) -> None:
    m = NvmlMemory(tmp_path)
    with m.inflight("ecc", "NVIDIA L40S", "570.124.06", "nvmlDeviceGetTotalEccErrors"):
        assert (tmp_path / INFLIGHT).exists()
    assert not (tmp_path / INFLIGHT).exists()
    assert NvmlMemory(tmp_path).crashed_calls() == []


def test_read_only_learns_but_never_writes_nor_takes_the_running_plugins_marker(tmp_path: Path) -> None:
    NvmlMemory(tmp_path).saw_active("GPU-a", [5])
    (tmp_path / INFLIGHT).write_text(json.dumps({"signal": "ecc", "model": "m", "driver": "d", "call": "c"}))
    ro = NvmlMemory(tmp_path, read_only=True)
    assert ro.links_seen("GPU-a") == frozenset({5})
    ro.saw_active("GPU-a", [6])
    with ro.inflight("pcie", "m", "d", "nvmlDeviceGetCurrPcieLinkWidth"):
        pass
    assert (tmp_path / INFLIGHT).exists() and ro.crashed_calls() == []
    assert NvmlMemory(tmp_path, read_only=True).links_seen("GPU-a") == frozenset({5})


def test_an_unreadable_file_costs_the_memory_never_the_start(tmp_path: Path) -> None:
    (tmp_path / FILE).write_text("{not json")
    m = NvmlMemory(tmp_path)
    assert m.links_seen("GPU-a") == frozenset() and m.crashed_calls() == []
    (tmp_path / FILE).write_text(json.dumps({"links_seen_active": [1, 2], "crashed_calls": {}}))
    assert NvmlMemory(tmp_path).links_seen("GPU-a") == frozenset()
    m.saw_active("GPU-a", [1])  # rewritten whole and readable again
    assert NvmlMemory(tmp_path).links_seen("GPU-a") == frozenset({1})
