"""GPUs busy with no pod (health/busy.py) on a fake clock, then end to end through the real pynvml on the NVML
stand-in (tests/nvml_standin), whose node file lists the processes; and a GPU gone from NVML while the PCI bus (a
directory of our own) still has it, through the same stand-in."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from plugin.devices.inventory import PciInventory
from plugin.devices.model import ComputeProcess, Gpu
from plugin.health.busy import CODE, BusyWatch
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.health.reasons import Action, State
from tests.fakes import nvml_standin
from tests.unit.test_gpu_missing import bus

GRACE = 300.0
T = 1_767_225_600.0
PY = ComputeProcess(4242, 2048, "python3")


class Holders:
    """Who holds each GPU, as the kubelet would say; counts the questions."""

    def __init__(self) -> None:
        self.by_uuid: dict[str, str] = {}
        self.asked = 0

    def __call__(self, gpu: Gpu) -> str:
        self.asked += 1
        return self.by_uuid.get(gpu.uuid, "")

    def of(self, uuid: str) -> Any:
        return lambda: self(Gpu(uuid, 0))


def test_processes_on_a_gpu_no_pod_holds_become_the_reason_after_the_grace() -> None:
    w, h = BusyWatch(GRACE, ["nvidia-cuda-mps-server"]), Holders()
    assert w.observe("g", (PY,), T, h.of("g")) is None
    assert w.observe("g", (PY,), T + GRACE - 1, h.of("g")) is None
    assert h.asked == 0  # nobody is asked before the grace is over
    r = w.observe("g", (PY,), T + GRACE, h.of("g"))
    assert r is not None and (r.code, r.severity, r.action) == (CODE, State.DEGRADED, Action.NONE)
    assert r.message == "1 process (python3) using 2048 MiB on a GPU no pod holds, for 5 min"
    assert h.asked == 1
    # The memory it holds grows: the same reason, message and all (no write for a steady leak).
    assert w.observe("g", (ComputeProcess(4242, 9000, "python3"),), T + GRACE + 5, h.of("g")) == r
    # Another process joins: the message follows, the first time stays.
    two = w.observe("g", (PY, ComputeProcess(77, None, "")), T + GRACE + 10, h.of("g"))
    assert two is not None and two.first_seen == r.first_seen
    assert two.message.startswith("2 processes (pid 77, python3) using 2048 MiB")
    # Gone with the processes, at once.
    assert w.observe("g", (), T + GRACE + 15, h.of("g")) is None and w.reason("g") is None


def test_a_pods_work_is_asked_about_again_only_a_grace_later_and_ignored_names_never() -> None:
    w, h = BusyWatch(GRACE, ["nvidia-cuda-mps-server"]), Holders()
    h.by_uuid["g"] = "held by pod ml/train-0"
    for k in range(0, int(3 * GRACE) + 1, 5):
        assert w.observe("g", (PY,), T + k, h.of("g")) is None
    assert h.asked == 3  # once per grace, not once per poll
    mps = (ComputeProcess(1, 64, "nvidia-cuda-mps-server"),)
    for k in range(0, int(2 * GRACE), 5):
        assert w.observe("m", mps, T + k, h.of("m")) is None
    assert h.asked == 3
    # The pod ends but its process stays: the reason comes at the next question.
    del h.by_uuid["g"]
    assert w.observe("g", (PY,), T + 4 * GRACE, h.of("g")) is not None


def test_a_kubelet_that_cannot_answer_counts_as_holding() -> None:
    w = BusyWatch(GRACE)
    for k in (0, GRACE, 2 * GRACE):
        assert w.observe("g", (PY,), T + k, lambda: "cannot tell which pods hold it: kubelet unreachable") is None


# Through the real pynvml on the stand-in ---------------------------------------------------------------------------

@pytest.fixture
def nvml(tmp_path: Path) -> Any:
    backend, node = nvml_standin.open_backend(tmp_path / "nvml")
    yield backend, node
    backend.close()


def engine(backend: Any, clock: list[float], holders: Holders, sysfs: Path | None = None) -> tuple[Monitor, NodeState]:
    state = NodeState()
    m = Monitor(backend, state, HealthConfig(clear_after_polls=1), 5.0, threading.Event(), clock=lambda: clock[0],
                busy=holders, busy_watch=BusyWatch(GRACE, ["nvidia-cuda-mps-server"]),
                inventory=PciInventory(sysfs).gpus if sysfs is not None else None)
    return m, state


def test_a_leaked_process_read_through_nvml_makes_its_gpu_degraded_and_its_pods_gpu_stays_healthy(nvml: Any) -> None:
    backend, node = nvml
    clock, holders = [T], Holders()
    m, state = engine(backend, clock, holders)
    uuids = node.uuids
    node.set(2, compute_processes=[{"pid": 4242, "used_mib": 30000, "name": "/usr/bin/python3"}])
    node.set(3, compute_processes=[{"pid": 5151, "used_mib": 1000, "name": "python3"}])
    node.set(4, compute_processes=[{"pid": 9, "used_mib": 64, "name": "nvidia-cuda-mps-server"}])
    holders.by_uuid[uuids[3]] = "held by pod ml/train-0"
    m.poll_once()
    clock[0] += GRACE
    m.poll_once()
    snap = state.snapshot()
    states = {d.id: d.state for d in snap.devices}
    assert states == {u: State.DEGRADED if i == 2 else State.HEALTHY for i, u in enumerate(uuids)}
    [r] = snap.get(uuids[2]).reasons  # type: ignore[union-attr]
    assert r.code == CODE and r.message.startswith("1 process (python3) using 30000 MiB")
    assert holders.asked == 2  # GPUs 2 and 3, once each: the MPS server is never asked about
    node.set(2, compute_processes=None)  # the process is killed
    clock[0] += 5
    m.poll_once()
    assert state.snapshot().get(uuids[2]).state == State.HEALTHY  # type: ignore[union-attr]


def test_a_gpu_the_driver_never_brought_up_is_gpu_missing(tmp_path: Path) -> None:
    """The bus has 8 GPUs; the driver (the stand-in's node file) lists 7 from the start: GPU 5 never initialised."""
    from plugin.devices.nvml import NvmlBackend

    nvml_standin.load_in_process(nvml_standin.library_dir_or_skip())
    doc = nvml_standin.builtin_node()
    del doc["gpus"][5]
    node = nvml_standin.StandinNode(tmp_path / "nvml-node.json", doc)
    with nvml_standin.use_node(node.path):
        backend = NvmlBackend()
    try:
        sysfs = tmp_path / "sys"
        bus(sysfs, 8)
        clock = [T]
        m, state = engine(backend, clock, Holders(), sysfs)
        m.poll_once()
        assert state.snapshot().node_reasons == ()  # one poll may be a reset in progress
        clock[0] += 5
        m.poll_once()
        [r] = state.snapshot().node_reasons
        assert r.code == "gpu-missing" and r.message == "1 GPU on the PCI bus not seen by NVML: 0000:68:00.0"
        assert m.gpus_missing == 1 and len(state.snapshot().devices) == 7
        assert all(d.state == State.HEALTHY for d in state.snapshot().devices)
    finally:
        backend.close()
