"""Every reason code end to end through NVML: the stand-in for libnvidia-ml (tests/nvml_standin), the real nvidia-ml-py,
the real NvmlBackend and the Monitor, read back from the node state.

One table row per way a code is raised: the GPU model, what the node file says, and the code, State and Action the
device must carry. A test holds the table to plugin.health.reasons.REASONS, so a new code without a row here fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from plugin.devices.memory import INFLIGHT
from plugin.devices.nvml import NvmlBackend
from plugin.dra import health as dra_health
from plugin.dra import slices as rs
from plugin.dra.health import HealthSettings, device_health
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState, Snapshot
from plugin.health.policy import xid_class
from plugin.health.reasons import REASONS, SPECS, Action, KubeletHealth, ReasonSpec, Source, State, xid_spec
from tests.fakes import nvml_standin as standin
from tests.fakes.nvml_standin import StandinNode

REPO = Path(__file__).resolve().parents[2]
TARGET = 2  # the GPU each row acts on; the seven others must stay Healthy


@dataclass(frozen=True)
class Row:
    code: str  # the worst reason the target GPU must carry
    state: State  # the target GPU's state, and that reason's severity
    action: Action  # that reason's action
    profile: str = "h100-sxm"
    signals: Mapping[str, Any] = field(default_factory=dict)  # set on the target after a first, clean poll
    nvml: Mapping[str, Any] = field(default_factory=dict)  # the target's stand-in keys, set with the signals
    at_start: Mapping[str, Any] = field(default_factory=dict)  # the target's stand-in keys before the backend starts
    xids: tuple[int, ...] = ()  # appended with the signals, delivered through wait_events
    events: int = 0  # further events the change raises, handed to the monitor
    polls: int = 1  # polls after the change
    then: tuple[Mapping[str, Any], ...] = ()  # later signal changes, one poll after each
    cfg: Mapping[str, Any] = field(default_factory=dict)  # HealthConfig fields
    drive: str = "table"  # "stall" and "crash" rows need a running monitor or a dying process: tests of their own
    name: str = ""

    @property
    def id(self) -> str:
        return self.name or self.code


ROWS: tuple[Row, ...] = (
    # XIDs, by class (health.xid): events, latched.
    Row("xid-48", State.UNHEALTHY, Action.RESET_GPU, xids=(48,), polls=0),
    Row("xid-79", State.UNHEALTHY, Action.REBOOT_NODE, xids=(79,), polls=0),
    Row("xid-64", State.UNHEALTHY, Action.CONTACT_SUPPORT, xids=(64,), polls=0),
    Row("xid-95", State.UNHEALTHY, Action.CONTACT_SUPPORT, xids=(95,), polls=0),
    Row("xid-63", State.DEGRADED, Action.RESET_GPU, xids=(63,), polls=0),
    Row("xid-999", State.DEGRADED, Action.CONTACT_SUPPORT, xids=(999,), polls=0),
    Row("xid-13-repeated", State.DEGRADED, Action.CONTACT_SUPPORT, xids=(13, 13, 13), polls=0),
    # Memory.
    Row("ecc-uncorrected", State.UNHEALTHY, Action.RESET_GPU, signals={"ecc_uncorrected_volatile": 2}),
    Row("ecc-uncorrected", State.UNHEALTHY, Action.RESET_GPU, signals={"ecc_uncorrected_volatile": 1}, polls=0,
        events=1, name="ecc-uncorrected-event"),
    Row("ecc-corrected-high", State.DEGRADED, Action.NONE, signals={"ecc_corrected_volatile": 50},
        cfg={"ecc_corrected_limit": 10}),
    # Readings are stamped with wall time milliseconds apart: any growth is a burst far above 10 a minute.
    Row("ecc-corrected-rate", State.DEGRADED, Action.NONE, signals={"ecc_corrected_volatile": 1000},
        cfg={"ecc_corrected_rate_per_min": 10.0}),
    Row("row-remap-pending", State.DEGRADED, Action.RESET_GPU, signals={"row_remap_pending": True}),
    Row("row-remap-failure", State.UNHEALTHY, Action.CONTACT_SUPPORT, signals={"row_remap_failure": True}),
    # Page retirement is pre-Ampere: a T4 has it.
    Row("retired-pages-pending", State.DEGRADED, Action.RESET_GPU, profile="t4",
        signals={"retired_pages_pending": True}),
    Row("retired-pages-limit", State.UNHEALTHY, Action.CONTACT_SUPPORT, profile="t4",
        signals={"retired_pages_count": 63}),
    # Temperature and clocks.
    Row("thermal-slowdown", State.DEGRADED, Action.NONE, signals={"temperature_c": 88}),
    Row("thermal-slowdown", State.DEGRADED, Action.NONE, signals={"clock_event_reasons": ["hw_thermal_slowdown"]},
        name="thermal-slowdown-clocks"),
    Row("temperature-shutdown", State.UNHEALTHY, Action.CONTACT_SUPPORT, signals={"temperature_c": 95}),
    Row("hw-slowdown", State.DEGRADED, Action.NONE, signals={"clock_event_reasons": ["hw_slowdown"]}),
    Row("power-brake", State.DEGRADED, Action.NONE, signals={"clock_event_reasons": ["hw_power_brake_slowdown"]}),
    # PCIe.
    Row("pcie-link-degraded", State.DEGRADED, Action.RESET_GPU, profile="l40s",
        signals={"pcie_link": {"gen": 4, "width": 8}}),
    Row("pcie-replay-rate", State.DEGRADED, Action.CONTACT_SUPPORT, signals={"pcie_replay_count": 100_000}),
    # NVLink and the fabric.
    Row("nvlink-down", State.UNHEALTHY, Action.RESET_GPU, signals={"nvlink_down": [1]}),
    Row("nvlink-down", State.UNHEALTHY, Action.RESET_GPU, profile="a100-sxm", at_start={"links_trained": 10},
        cfg={"nvlink_expected_links": {"NVIDIA A100-SXM4-80GB": 12}}, polls=0, name="nvlink-expected-links"),
    Row("nvlink-errors", State.DEGRADED, Action.CONTACT_SUPPORT, signals={"nvlink_error_count": 50}),
    Row("fabric-unhealthy", State.UNHEALTHY, Action.CONTACT_SUPPORT, profile="gb200",
        signals={"fabric_health": "unhealthy"}),
    Row("fabric-limited", State.DEGRADED, Action.CONTACT_SUPPORT, signals={"fabric_health": "limited_capacity"}),
    # The driver's recovery action (field 230), by nvml.h's number.
    Row("recovery-action-reset", State.UNHEALTHY, Action.RESET_GPU, nvml={"recovery_action_raw": 1},
        name="recovery-action-1-gpu-reset"),
    Row("recovery-action-reboot", State.UNHEALTHY, Action.REBOOT_NODE, nvml={"recovery_action_raw": 2},
        name="recovery-action-2-node-reboot"),
    Row("recovery-action-drain-p2p", State.DEGRADED, Action.DRAIN, nvml={"recovery_action_raw": 3}),
    Row("recovery-action-reset", State.UNHEALTHY, Action.RESET_GPU, nvml={"recovery_action_raw": 4},
        name="recovery-action-4-drain-and-reset"),
    Row("recovery-action-imex", State.UNHEALTHY, Action.DRAIN, nvml={"recovery_action_raw": 5}),
    Row("recovery-action-reset", State.UNHEALTHY, Action.RESET_GPU, nvml={"recovery_action_raw": 6},
        name="recovery-action-6-bus-reset"),
    Row("recovery-action-reboot", State.UNHEALTHY, Action.REBOOT_NODE, nvml={"recovery_action_raw": 7},
        name="recovery-action-7-system-reboot"),
    Row("recovery-action-unknown", State.UNKNOWN, Action.CONTACT_SUPPORT, nvml={"recovery_action_raw": 9}),
    # The GPU itself.
    Row("gpu-lost", State.UNHEALTHY, Action.REBOOT_NODE, signals={"lost": True}),
    Row("gpu-lost", State.UNHEALTHY, Action.REBOOT_NODE, nvml={"fail": {"nvmlDeviceGetTemperature": "gpu_is_lost"}},
        name="gpu-lost-answer"),
    # The event arrives though the lost GPU answers no call; no poll after it, so the event alone raises it.
    Row("gpu-unavailable", State.UNHEALTHY, Action.RESET_GPU, signals={"lost": True}, polls=0, events=1),
    Row("reset-required", State.UNHEALTHY, Action.RESET_GPU, signals={"reset_required": True}),
    Row("reset-required", State.UNHEALTHY, Action.RESET_GPU,
        nvml={"fail": {"nvmlDeviceGetRemappedRows": "reset_required"}}, name="reset-required-answer"),
    Row("nvml-error", State.UNKNOWN, Action.CONTACT_SUPPORT, signals={"nvml_error": True}, polls=3),
    Row("nvml-error", State.UNKNOWN, Action.CONTACT_SUPPORT, nvml={"fail": {"nvmlDeviceGetTemperature": "timeout"}},
        polls=2, cfg={"nvml_error_polls": 2}, name="nvml-error-one-call"),
    # Healthy <-> Degraded twice with flap_max 2: the third change trips the damping, and the clean poll after it
    # holds Degraded with the flapping reason.
    Row("flapping", State.DEGRADED, Action.CONTACT_SUPPORT, signals={"temperature_c": 88},
        then=({"temperature_c": 40}, {"temperature_c": 88}, {"temperature_c": 40}),
        cfg={"flap_max": 2, "clear_after_polls": 1}),
    Row("nvml-stalled", State.UNKNOWN, Action.CONTACT_SUPPORT, drive="stall"),
    Row("nvml-check-unavailable", State.DEGRADED, Action.CONTACT_SUPPORT, drive="crash"),
)
ROW = {r.id: r for r in ROWS}

# REASONS rows no NVML fault can raise, with why. Another provider's reasons (Source.EXTERNAL, docs/nvsentinel.md)
# bring their own codes and have no row.
EXCLUDED: dict[str, str] = {
    "recovery-check-failed": "the recovery check's verdict, not NVML's (tests/unit/test_return_to_service.py)",
    "recovery-check-pending": "the recovery check's wait, not NVML's (tests/unit/test_return_to_service.py)",
    "gpu-missing": "the node's, from the PCI bus and the expected count against NVML's list, on no GPU "
                   "(tests/unit/test_gpu_missing.py; through the stand-in: tests/unit/test_busy_unallocated.py)",
    "busy-unallocated": "NVML's processes against the pods holding the GPU: needs a holder as well "
                        "(tests/unit/test_busy_unallocated.py, through the stand-in)",
}


def health_config(row: Row) -> HealthConfig:
    return HealthConfig(**row.cfg)


def spec_of(row: Row) -> ReasonSpec:
    """The REASONS row a table row raises: an XID's by the class it is configured in, else the code's own."""
    m = re.fullmatch(r"xid-(\d+)(-repeated)?", row.code)
    if m:
        return xid_spec(int(m[1]), xid_class(int(m[1]), health_config(row)))
    return SPECS[row.code]


# Fixtures and helpers ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def lib() -> None:
    # Before any test here initialises pynvml, so its CDLL("libnvidia-ml.so.1") resolves to the stand-in.
    standin.load_in_process(standin.library_dir_or_skip())


@pytest.fixture(autouse=True)
def no_violations(lib: None) -> Iterator[None]:
    # What the real driver would turn into undefined behaviour is recorded by the stand-in: none may be left.
    standin.reset_violations()
    yield
    assert standin.violations() == []


# The product name each stand-in profile stands for: the node file's GPUs are renamed to it, since the name is the
# GPU model that per-model settings (nvlinkExpectedLinks) and the crashed-call memory are keyed by.
def states(snap: Snapshot) -> list[State]:
    return [d.state for d in snap.devices]


def assert_row(row: Row, snap: Snapshot, uuids: list[str], target: int = TARGET) -> None:
    dev = snap.get(uuids[target])
    assert dev is not None
    assert dev.reasons, f"{row.id}: no reason on the target GPU"
    worst = dev.reasons[0]
    assert (worst.code, dev.state, worst.severity, worst.action) == (row.code, row.state, row.state, row.action), \
        dev.reasons
    assert [d.state for d in snap.devices if d.id != uuids[target]] == [State.HEALTHY] * (len(uuids) - 1)


def assert_dra_scores_the_same(row: Row, snap: Snapshot, uuids: list[str], target: int = TARGET) -> None:
    """The same snapshot as DRA mode publishes it (issue 38, "the fault catalog run in DRA mode scores as in
    device-plugin mode"): the target's taint is keyed by its state and valued with the row's code; a claim that
    tolerates nothing may be allocated exactly the devices device-plugin mode calls Healthy to the kubelet; the
    health stream names the code; the seven others are untainted and Healthy."""
    settings = rs.SliceSettings(node_name="gpu-node-1")
    devices = rs.published_devices(snap.devices)
    published = {e["name"]: e for e in rs.resource_slice(devices, settings)["spec"]["devices"]}
    reports = {r.device: r for r in device_health(snap, None, HealthSettings(pool="gpu-node-1"))}
    keys = {State.UNHEALTHY: "unhealthy", State.UNKNOWN: "unknown", State.DEGRADED: "degraded"}
    stream = {State.UNHEALTHY: dra_health.UNHEALTHY, State.UNKNOWN: dra_health.UNKNOWN,
              State.DEGRADED: dra_health.HEALTHY}
    for d in devices:
        assert d.status is not None
        # What device-plugin mode tells the kubelet is what DRA lets a claim without tolerations have.
        assert rs.allocatable(d.status, settings) == (d.status.kubelet_health is KubeletHealth.HEALTHY), row.id
        taints = published[d.name].get("taints") or []
        if d.gpu.uuid != uuids[target]:
            assert taints == [] and reports[d.name].health == dra_health.HEALTHY, (row.id, d.name)
            continue
        assert [(t["key"], t["value"]) for t in taints] == [(f"gpu-health.io/{keys[row.state]}",
                                                            rs.taint_value(row.code))], (row.id, taints)
        assert reports[d.name].health == stream[row.state] and reports[d.name].message.startswith(f"{row.code}:")


# The table --------------------------------------------------------------------------------------------------------

def test_the_table_covers_every_reason_code() -> None:
    assert not any(s.source == Source.EXTERNAL for s in REASONS)  # EXCLUDED's premise
    covered = {spec_of(r) for r in ROWS}
    missing = [(s.code, s.xid_class) for s in REASONS if s not in covered and s.code not in EXCLUDED]
    assert missing == [], "reason codes with no row in this table"
    for r in ROWS:
        spec = spec_of(r)
        # The table's expectations are the documented ones (docs/reasons.md is rendered from REASONS).
        assert (r.state, r.action) == (spec.severity, spec.action), r.id


@pytest.mark.parametrize("row", [r for r in ROWS if r.drive == "table"], ids=lambda r: r.id)
def test_reason_end_to_end(tmp_path: Path, row: Row) -> None:
    node = StandinNode.of_profile(tmp_path / "node.json", row.profile)
    if row.at_start:
        node.nvml(TARGET, **row.at_start)
    with standin.use_node(node.path):
        backend = NvmlBackend()
    try:
        state = NodeState()
        monitor = Monitor(backend, state, health_config(row), 5.0, threading.Event())
        monitor.poll_once()
        if not row.at_start:
            assert states(state.snapshot()) == [State.HEALTHY] * 8  # the change, not the start, raises it
        if row.signals:
            node.set(TARGET, **row.signals)
        if row.nvml:
            node.nvml(TARGET, **row.nvml)
        if row.xids:
            sig = node.gpu(TARGET)["signals"]
            sig["xid_events"] = [*sig.get("xid_events", []), *row.xids]
            node.write()
        for _ in range(row.polls):
            monitor.poll_once()
        for step in row.then:
            node.set(TARGET, **step)
            monitor.poll_once()
        wanted = len(row.xids) + row.events
        if wanted:
            events = standin.next_events(backend, wanted)
            assert len(events) == wanted and {e.uuid for e in events} == {node.uuids[TARGET]}, events
            monitor.handle_events(events)
        assert_row(row, state.snapshot(), node.uuids)
        assert_dra_scores_the_same(row, state.snapshot(), node.uuids)
    finally:
        backend.close()


# Rows with tests of their own -------------------------------------------------------------------------------------

def test_nvml_stalled_while_a_call_hangs_and_cleared_when_it_returns(tmp_path: Path) -> None:
    row = ROW["nvml-stalled"]
    node = StandinNode.of_profile(tmp_path / "node.json", "h100-sxm")
    with standin.use_node(node.path):
        backend = NvmlBackend()
    state = NodeState()
    stop = threading.Event()
    monitor = Monitor(backend, state, HealthConfig(), 60.0, stop, event_wait_s=0.05, stall_s=0.5)
    monitor.start()  # its first poll runs here, before the hang
    try:
        assert states(state.snapshot()) == [State.HEALTHY] * 8
        node.nvml(TARGET, hang=["nvmlDeviceGetTemperature"])
        monitor.request_poll()
        snap = standin.wait_state(state, lambda s: s.get(node.uuids[TARGET]).state == State.UNKNOWN)  # type: ignore[union-attr]
        dev = snap.get(node.uuids[TARGET])
        assert dev is not None and (dev.reasons[0].code, dev.reasons[0].action) == (row.code, row.action)
        assert dev.state == row.state and "nvmlDeviceGetTemperature" in dev.reasons[0].message
        # GPUs read before the hung one are fine; the ones after it wait behind it and are not known either.
        assert states(snap)[:TARGET] == [State.HEALTHY] * TARGET
        assert states(snap)[TARGET + 1:] == [State.UNKNOWN] * (7 - TARGET)
        node.nvml(TARGET, hang=None)  # the call returns, the cycle completes
        snap = standin.wait_state(state, lambda s: states(s) == [State.HEALTHY] * 8)
        assert states(snap) == [State.HEALTHY] * 8, [d.reasons for d in snap.devices]
    finally:
        node.nvml(TARGET, hang=None)  # never leave a poller thread blocked inside the library
        stop.set()
        monitor.join(5.0)
        backend.close()


CRASHING_READ = """
import sys
from pathlib import Path

from plugin.devices.nvml import NvmlBackend

backend = NvmlBackend(state_dir=Path(sys.argv[1]))
for gpu in backend.discover().gpus:
    backend.read(gpu)
print("every GPU read")
"""


def test_nvml_check_unavailable_after_a_call_crashed_the_process(tmp_path: Path) -> None:
    row = ROW["nvml-check-unavailable"]
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    node = StandinNode.of_profile(tmp_path / "node.json", "h100-sxm")
    for i in range(8):
        node.nvml(i, crash=["nvmlDeviceGetGpuFabricInfoV"])
    env = standin.env_for_subprocess(node.path)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", CRASHING_READ, str(state_dir)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stdout, proc.stderr)
    marker = json.loads((state_dir / INFLIGHT).read_text())
    assert (marker["signal"], marker["call"], marker["driver"]) == \
        ("fabric", "nvmlDeviceGetGpuFabricInfoV", "570.124.06")

    # The next start: the crash is taken out of the node file, so a backend that still made the call would show it
    # in the call count rather than take this test process down.
    for i in range(8):
        node.nvml(i, crash=None)
    standin.reset_call_counts()
    with standin.use_node(node.path):
        backend = NvmlBackend(state_dir=state_dir)
    try:
        assert not (state_dir / INFLIGHT).exists()
        state = NodeState()
        Monitor(backend, state, HealthConfig(), 5.0, threading.Event()).poll_once()
        readings = [backend.read(g) for g in backend.discover().gpus]
        assert standin.call_count("nvmlDeviceGetGpuFabricInfoV") == 0
        assert all(r.errors == () and r.fabric_health is None and r.temperature_c == 40 for r in readings)
        assert [d["checks"]["fabric"] for d in backend.describe()] == \
            ["unavailable: crashed the process in nvmlDeviceGetGpuFabricInfoV"] * 8
        assert backend.unavailable() == {
            u: {"fabric": "unavailable: crashed the process in nvmlDeviceGetGpuFabricInfoV"} for u in node.uuids}
        snap = state.snapshot()
        for i in range(8):
            dev = snap.get(node.uuids[i])
            assert dev is not None and dev.state == row.state
            assert [(r.code, r.severity, r.action) for r in dev.reasons] == [(row.code, row.state, row.action)]
            assert "fabric" in dev.reasons[0].message and "nvmlDeviceGetGpuFabricInfoV" in dev.reasons[0].message
    finally:
        backend.close()
