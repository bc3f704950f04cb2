"""The NVML backend through the real nvidia-ml-py over the C stand-in for libnvidia-ml (tests/nvml_standin): discovery,
every polled signal, every answer of every call, events and the event set's life.

The hand-written fake of pynvml (tests/fakes/fake_pynvml.py) is left only where a C library loaded in this process
cannot stand in: a driver without a function (FUNCTION_NOT_FOUND), and nvmlInit with no library to load at all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from plugin.devices.backend import BackendError
from plugin.devices.model import EventKind, Gpu, GpuEvent
from plugin.devices.nvml import NvmlBackend
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.health.policy import evaluate_reading
from plugin.health.reasons import State
from tests.fakes import nvml_standin as standin
from tests.fakes.fake_pynvml import FakeNvml, eight_gpu_node
from tests.fakes.nvml_standin import StandinNode

XID, DBE, UNAVAILABLE, RECOVERY = 0x8, 0x2, 0x4000, 0x8000
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(scope="module")
def lib() -> None:
    # Loaded before any test here initialises pynvml, so pynvml's CDLL("libnvidia-ml.so.1") resolves to it.
    standin.load_in_process(standin.library_dir_or_skip())


def _standin_loaded() -> bool:
    try:
        standin.violation_count()
    except RuntimeError:
        return False
    return True


@pytest.fixture(autouse=True)
def no_violations() -> Iterator[None]:
    # Misuse the real driver would turn into undefined behaviour (a struct by value, a freed set, a foreign handle)
    # is recorded by the stand-in, not crashed on: every test must leave none, the backend's close included.
    if _standin_loaded():
        standin.reset_violations()
    yield
    if _standin_loaded():
        assert standin.violations() == []


@pytest.fixture
def node(lib: None, tmp_path: Path) -> StandinNode:
    return StandinNode(tmp_path / "node.json")


@contextmanager
def running(node: StandinNode, **kwargs: Any) -> Iterator[NvmlBackend]:
    """The real backend (real pynvml) initialised on ``node``'s file, closed at the end whatever happens."""
    with standin.use_node(node.path):
        b = NvmlBackend(**kwargs)
    try:
        yield b
    finally:
        b.close()


def codes_for(b: NvmlBackend, index: int, cfg: HealthConfig | None = None) -> set[str]:
    gpu = b.discover().gpus[index]
    return {c.code for c in evaluate_reading(b.read(gpu), None, cfg or HealthConfig())}


def eventually(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """For a state nothing signals (a thread inside a C call): re-check until true or the deadline."""
    pause = threading.Event()
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        pause.wait(0.005)
    return True


def calls_of(base: str) -> int:
    """Calls of an NVML function under any of its versioned symbols (pynvml picks the suffix)."""
    return sum(standin.call_count(name) for name in (base, f"{base}_v2", f"{base}_v3"))


# Discovery --------------------------------------------------------------------------------------------------------

def test_discovery_reads_identity_and_topology(node: StandinNode) -> None:
    with running(node) as b:
        d = b.discover()
        described = b.describe()
    assert d.error is None and d.driver_version == "570.124.06"
    g = d.gpus[5]
    assert (g.uuid, g.index, g.minor, g.numa_node, g.name) == (node.uuids[5], 5, 5, 1, H100)
    assert g.memory_mib == 81559 and g.pci_bus_id == "00000000:68:00.0"
    assert [x.nvlink_peers for x in d.gpus] == [(1, 2, 3), (0, 2, 3), (0, 1, 3), (0, 1, 2),
                                                (5, 6, 7), (4, 6, 7), (4, 5, 7), (4, 5, 6)]
    sw = [x.pcie_switch for x in d.gpus]
    assert None not in sw and sw[0] == sw[1] and sw[2] == sw[3] and sw[4] == sw[5] and sw[6] == sw[7]
    assert len({sw[0], sw[2], sw[4], sw[6]}) == 4
    # All four kinds registered on every GPU of an R570 driver: XID, double-bit ECC, GPU unavailable, recovery.
    assert [x["events"] for x in described] == [XID | DBE | UNAVAILABLE | RECOVERY] * 8
    assert (described[0]["architecture"], described[0]["links_active"], described[0]["link_slots"]) == \
        ("Hopper", 18, 18)


def test_healthy_node_reads_clean(node: StandinNode) -> None:
    with running(node) as b:
        readings = [b.read(g) for g in b.discover().gpus]
        codes = [codes_for(b, i) for i in range(8)]
        errors = b.call_errors
    assert codes == [set()] * 8
    r = readings[0]
    assert all(x.errors == () and not x.lost and not x.reset_required for x in readings)
    assert (r.temperature_c, r.temperature_slowdown_c, r.temperature_shutdown_c) == (40, 87, 92)
    assert (r.pcie_gen, r.pcie_width, r.pcie_max_gen, r.pcie_max_width) == (5, 16, 5, 16)
    assert (r.nvlink_down, r.nvlink_active_count, r.recovery_action, r.fabric_health) == ((), 18, "none", "healthy")
    assert (r.row_remap_pending, r.ecc_uncorrected_volatile, r.retired_pages_count) == (False, 0, None)
    assert errors == 0


def test_an_empty_event_wait_is_not_an_error(node: StandinNode) -> None:
    # docs/nvml-calls.md: TIMEOUT from nvmlEventSetWait_v2 is the normal end of a wait with no event, not an error;
    # the event thread waits four times a second, so counting these would grow gpu_health_nvml_call_errors forever.
    with running(node) as b:
        assert b.wait_events(0.01) == ()
        assert b.call_errors == 0


# Every polled signal: (profile, signals, stand-in keys) set on GPU 3 after start -> the codes it reads as.
POLLED = [
    pytest.param("h100-sxm", {"ecc_uncorrected_volatile": 2}, {}, {"ecc-uncorrected"}, id="ecc-uncorrected"),
    pytest.param("h100-sxm", {"row_remap_pending": True}, {}, {"row-remap-pending"}, id="row-remap-pending"),
    pytest.param("h100-sxm", {"row_remap_failure": True}, {}, {"row-remap-failure"}, id="row-remap-failure"),
    # Page retirement is pre-Ampere: a T4 has it, an H100 answers NOT_SUPPORTED.
    pytest.param("t4", {"retired_pages_pending": True}, {}, {"retired-pages-pending"}, id="retired-pages-pending"),
    pytest.param("t4", {"retired_pages_count": 63}, {}, {"retired-pages-limit"}, id="retired-pages-limit"),
    pytest.param("h100-sxm", {"temperature_c": 88}, {}, {"thermal-slowdown"}, id="temperature-slowdown"),
    pytest.param("h100-sxm", {"temperature_c": 95}, {}, {"temperature-shutdown"}, id="temperature-shutdown"),
    pytest.param("h100-sxm", {"clock_event_reasons": ["hw_thermal_slowdown"]}, {}, {"thermal-slowdown"},
                 id="clock-hw-thermal"),
    pytest.param("h100-sxm", {"clock_event_reasons": ["sw_thermal_slowdown"]}, {}, {"thermal-slowdown"},
                 id="clock-sw-thermal"),
    pytest.param("h100-sxm", {"clock_event_reasons": ["hw_slowdown"]}, {}, {"hw-slowdown"}, id="hw-slowdown"),
    pytest.param("h100-sxm", {"clock_event_reasons": ["hw_power_brake_slowdown"]}, {}, {"power-brake"},
                 id="power-brake"),
    pytest.param("h100-sxm", {"pcie_link": {"gen": 5, "width": 8}}, {}, {"pcie-link-degraded"}, id="pcie-width"),
    # A lower generation counts only on a busy GPU; the stand-in reports GpuIdle unless another reason is set.
    pytest.param("h100-sxm", {"pcie_link": {"gen": 3, "width": 16}, "clock_event_reasons": ["hw_slowdown"]}, {},
                 {"pcie-link-degraded", "hw-slowdown"}, id="pcie-gen-busy"),
    pytest.param("h100-sxm", {"nvlink_down": [1]}, {}, {"nvlink-down"}, id="nvlink-down"),
    pytest.param("a100-sxm", {"nvlink_down": [0, 11]}, {}, {"nvlink-down"}, id="nvlink-down-a100"),
    pytest.param("h100-sxm", {}, {"recovery_action_raw": 1}, {"recovery-action-reset"}, id="recovery-1-gpu-reset"),
    pytest.param("h100-sxm", {}, {"recovery_action_raw": 2}, {"recovery-action-reboot"}, id="recovery-2-node-reboot"),
    pytest.param("h100-sxm", {}, {"recovery_action_raw": 3}, {"recovery-action-drain-p2p"}, id="recovery-3-drain-p2p"),
    pytest.param("h100-sxm", {}, {"recovery_action_raw": 4}, {"recovery-action-reset"},
                 id="recovery-4-drain-and-reset"),
    pytest.param("h100-sxm", {}, {"recovery_action_raw": 5}, {"recovery-action-imex"}, id="recovery-5-imex"),
    pytest.param("h100-sxm", {}, {"recovery_action_raw": 6}, {"recovery-action-reset"}, id="recovery-6-bus-reset"),
    pytest.param("h100-sxm", {}, {"recovery_action_raw": 7}, {"recovery-action-reboot"},
                 id="recovery-7-system-reboot"),
    pytest.param("h100-sxm", {}, {"recovery_action_raw": 9}, {"recovery-action-unknown"}, id="recovery-9-unknown"),
    pytest.param("h100-sxm", {"fabric_health": "unhealthy"}, {}, {"fabric-unhealthy"}, id="fabric-unhealthy"),
    pytest.param("h100-sxm", {"fabric_health": "limited_capacity"}, {}, {"fabric-limited"}, id="fabric-limited"),
    pytest.param("gb200", {"fabric_health": "unhealthy"}, {}, {"fabric-unhealthy"}, id="gb200-fabric-unhealthy"),
    pytest.param("gb200", {"fabric_health": "limited_capacity"}, {}, {"fabric-limited"}, id="gb200-fabric-limited"),
    pytest.param("h100-sxm", {"lost": True}, {}, {"gpu-lost"}, id="lost"),
    pytest.param("h100-sxm", {"reset_required": True}, {}, {"reset-required"}, id="reset-required"),
]


@pytest.mark.parametrize(("profile", "signals", "keys", "expected"), POLLED)
def test_every_polled_signal(tmp_path: Path, lib: None, profile: str, signals: dict[str, Any],
                             keys: dict[str, Any], expected: set[str]) -> None:
    node = StandinNode(tmp_path / "node.json", profile=profile)
    with running(node) as b:
        assert codes_for(b, 3) == set()
        node.set(3, **signals)
        node.nvml(3, **keys)
        assert codes_for(b, 3) == expected
        assert codes_for(b, 2) == set()  # the neighbour is untouched
        assert b.call_errors == 0


def test_idle_gpu_at_lower_pcie_gen_is_fine(node: StandinNode) -> None:
    with running(node) as b:
        node.set(1, pcie_link={"gen": 1, "width": 16})  # no clock reason set: the stand-in reports GpuIdle
        assert b.read(b.discover().gpus[1]).gpu_idle
        assert codes_for(b, 1) == set()
        assert codes_for(b, 1, HealthConfig(check_pcie_gen_when_idle=True)) == {"pcie-link-degraded"}


def test_a_link_that_trains_after_start_is_watched_from_then_on(tmp_path: Path, lib: None) -> None:
    node = StandinNode(tmp_path / "node.json", profile="a100-sxm")
    node.nvml(3, links_trained=10)
    with running(node) as b:
        assert b.read(b.discover().gpus[3]).nvlink_down == ()  # slots 10 and 11 never up: topology, not a fault
        node.nvml(3, links_trained=12)
        assert b.read(b.discover().gpus[3]).nvlink_active_count == 12
        node.set(3, nvlink_down=[11])
        assert b.read(b.discover().gpus[3]).nvlink_down == (11,)
        assert codes_for(b, 3) == {"nvlink-down"}


def test_links_seen_active_are_remembered_across_restarts(tmp_path: Path, lib: None) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    node = StandinNode(tmp_path / "node.json")
    with running(node, state_dir=state_dir) as b:
        assert b.read(b.discover().gpus[3]).nvlink_active_count == 18
    node.nvml(3, links_trained=16)  # two links failed while the plugin was down: they never come up at its start
    with running(node, state_dir=state_dir) as b:
        assert b.read(b.discover().gpus[3]).nvlink_down == (16, 17)
        assert codes_for(b, 3) == {"nvlink-down"}
    with running(node) as b:  # no state dir: nothing remembered, the two slots read as topology
        assert codes_for(b, 3) == set()


def test_a_removed_gpu_reads_lost_and_its_peers_links_down(node: StandinNode) -> None:
    with running(node) as b:
        gpus = b.discover().gpus
        node.remove_gpu(3)
        assert b.read(gpus[3]).lost
        # GPU 3 was each of GPUs 0-2's third peer (link 2); GPUs 4-7 are not linked to it.
        assert [b.read(g).nvlink_down for g in gpus[:3]] == [(2,)] * 3
        assert [codes_for(b, i) for i in (4, 5, 6, 7)] == [set()] * 4
        assert b.call_errors == 0


def test_pcie_replay_and_nvlink_counters_are_read(node: StandinNode) -> None:
    with running(node) as b:
        node.set(0, pcie_replay_count=7, nvlink_error_count=5)
        node.nvml(0, nvlink_crc=3)
        r = b.read(b.discover().gpus[0])
    assert (r.pcie_replay_count, r.nvlink_error_count, r.nvlink_crc_count) == (7, 5, 3)


# What each GPU model lacks: (profile, checks off) -- absent signals, never faults.
PROFILE_CHECKS = [
    ("h100-sxm", {"retired_pages"}),
    ("gb200", {"retired_pages"}),
    ("a100-sxm", {"retired_pages", "fabric"}),
    ("h100-pcie", {"retired_pages", "fabric", "nvlink"}),  # link slots, but no bridge: none ever trains
    ("l40s", {"retired_pages", "fabric", "nvlink"}),
    ("t4", {"row_remap", "fabric", "nvlink"}),
]


@pytest.mark.parametrize(("profile", "off"), PROFILE_CHECKS)
def test_a_signal_the_gpu_lacks_is_off_not_a_fault(tmp_path: Path, lib: None, profile: str, off: set[str]) -> None:
    node = StandinNode(tmp_path / "node.json", profile=profile)
    with running(node) as b:
        readings = [b.read(g) for g in b.discover().gpus]
        checks = b.describe()[0]["checks"]
        assert b.call_errors == 0
    assert all(r.errors == () for r in readings)
    assert {s for s, why in checks.items() if why.startswith("off")} == off, checks
    assert {s for s, why in checks.items() if why.startswith("on")} == set(checks) - off, checks


def test_ecc_disabled_turns_the_ecc_check_off(node: StandinNode) -> None:
    # ECC disabled at start: the check is off and stays so (no false ecc-uncorrected from a driver's stale count).
    node.nvml(2, ecc=False)
    node.set(2, ecc_uncorrected_volatile=4)
    with running(node) as b:
        assert b.read(b.discover().gpus[2]).ecc_uncorrected_volatile is None
        assert b.describe()[2]["checks"]["ecc"].startswith("off")
        assert codes_for(b, 2) == set()


# The fault matrix ---------------------------------------------------------------------------------------------------

# Every device call the backend makes each poll x every answer (docs/nvml-calls.md "Answers").
POLL_CALLS = {
    # call: the check it belongs to
    "nvmlDeviceGetTotalEccErrors": "ecc",
    "nvmlDeviceGetRemappedRows": "row_remap",
    "nvmlDeviceGetRetiredPagesPendingStatus": "retired_pages",
    "nvmlDeviceGetRetiredPages": "retired_pages",
    "nvmlDeviceGetTemperature": "temperature",
    "nvmlDeviceGetCurrentClocksEventReasons": "clocks",
    "nvmlDeviceGetCurrPcieLinkGeneration": "pcie",
    "nvmlDeviceGetCurrPcieLinkWidth": "pcie",
    "nvmlDeviceGetPcieReplayCounter": "pcie",
    "nvmlDeviceGetFieldValues": "fields",
    "nvmlDeviceGetGpuFabricInfoV": "fabric",
}
# Where an absent answer turns the whole check off; elsewhere there is a fallback or the value is optional.
OFF_WHEN_ABSENT = {"nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows",
                   "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetTemperature", "nvmlDeviceGetGpuFabricInfoV"}
# answer: (kind, GPU 6's state after three polls with nvmlErrorPolls 2, its reason codes)
ANSWERS = {
    "not_supported": ("absent", State.HEALTHY, set()),
    "argument_version_mismatch": ("absent", State.HEALTHY, set()),
    "no_permission": ("absent", State.HEALTHY, set()),
    "invalid_argument": ("error", State.UNKNOWN, {"nvml-error"}),  # not a link slot: an error
    "gpu_is_lost": ("lost", State.UNHEALTHY, {"gpu-lost"}),
    "reset_required": ("reset", State.UNHEALTHY, {"reset-required"}),
    "timeout": ("error", State.UNKNOWN, {"nvml-error"}),
    "unknown": ("error", State.UNKNOWN, {"nvml-error"}),
    "uninitialized": ("error", State.UNKNOWN, {"nvml-error"}),
}


@pytest.mark.parametrize("answer", sorted(ANSWERS))
@pytest.mark.parametrize("call", sorted(POLL_CALLS))
def test_fault_matrix_poll(node: StandinNode, call: str, answer: str) -> None:
    if "RetiredPages" in call:
        node.gpu(6)["profile"] = "t4"  # a GPU that has page retirement, so the call is really made
        node.write()
    with running(node) as b:
        node.nvml(6, fail={call: answer})
        standin.reset_call_counts()
        state = NodeState()
        monitor = Monitor(b, state, HealthConfig(nvml_error_polls=2), 5.0, threading.Event())
        for _ in range(3):
            monitor.poll_once()
        assert calls_of(call) > 0, f"{call} never called: the fault was never injected"
        check = b.describe()[6]["checks"][POLL_CALLS[call]]
        errors = b.call_errors
    kind, expected, codes = ANSWERS[answer]
    snap = state.snapshot()
    assert [d.state for d in snap.devices if d.id != node.uuids[6]] == [State.HEALTHY] * 7
    got = snap.get(node.uuids[6])
    assert got is not None
    assert (got.state, {r.code for r in got.reasons}) == (expected, codes), got.reasons
    if kind == "absent" and call in OFF_WHEN_ABSENT:
        assert check.startswith("off: "), check
    if kind == "error":
        assert check.startswith("error: ") and errors == 3, (check, errors)
    else:
        assert errors == 0  # absent, lost and reset-required are answers, not failed calls


# Discovery calls failing on GPU 1 at start: the GPU is still advertised (bar one it cannot name), without the fact.
DISCOVERY_CALLS: dict[str, Callable[[NvmlBackend, Gpu, dict[str, Any], bool], bool]] = {
    "nvmlDeviceGetName": lambda b, g, d, absent: g.name == "NVIDIA GPU",
    "nvmlDeviceGetMinorNumber": lambda b, g, d, absent: g.minor is None,
    "nvmlDeviceGetPciInfo": lambda b, g, d, absent: g.pci_bus_id == "",  # _v3 and the fallback alike
    "nvmlDeviceGetNumaNodeId": lambda b, g, d, absent: g.numa_node is None,
    "nvmlDeviceGetMemoryInfo": lambda b, g, d, absent: g.memory_mib == 0,
    "nvmlDeviceGetArchitecture": lambda b, g, d, absent: d["architecture"] == "unknown",
    # Unknown ECC mode: assumed on, so the ECC check still runs.
    "nvmlDeviceGetEccMode": lambda b, g, d, absent: d["ecc_mode"] is None and b.read(g).ecc_uncorrected_volatile == 0,
    "nvmlDeviceGetTemperatureThreshold": lambda b, g, d, absent: b.read(g).temperature_slowdown_c is None,
    "nvmlDeviceGetMaxPcieLinkGeneration": lambda b, g, d, absent: b.read(g).pcie_max_gen is None,
    "nvmlDeviceGetMaxPcieLinkWidth": lambda b, g, d, absent: b.read(g).pcie_max_width is None,
    "nvmlDeviceGetMigMode": lambda b, g, d, absent: d["mig_mode"] is None,
    "nvmlDeviceGetNvLinkState": lambda b, g, d, absent: g.nvlink_peers == (),
    "nvmlDeviceGetNvLinkRemotePciInfo": lambda b, g, d, absent: g.nvlink_peers == () and d["links_active"] == 18,
    "nvmlDeviceGetTopologyCommonAncestor": lambda b, g, d, absent: g.pcie_switch is None,
    "nvmlDeviceRegisterEvents": lambda b, g, d, absent: d["events"] == 0,
    # Without the supported types, XID and double-bit ECC are assumed; a failed call registers nothing.
    "nvmlDeviceGetSupportedEventTypes": lambda b, g, d, absent: d["events"] == (XID | DBE if absent else 0),
}


@pytest.mark.parametrize("answer", sorted(ANSWERS))
@pytest.mark.parametrize("call", sorted([*DISCOVERY_CALLS, "nvmlDeviceGetUUID"]))
def test_fault_matrix_discovery(node: StandinNode, call: str, answer: str) -> None:
    node.nvml(1, fail={call: answer})
    standin.reset_call_counts()
    with running(node) as b:
        assert calls_of(call) > 0, f"{call} never called: the fault was never injected"
        gpus = b.discover().gpus
        uuids = [g.uuid for g in gpus]
        if call == "nvmlDeviceGetUUID":
            assert uuids == [u for u in node.uuids if u != node.uuids[1]]  # a GPU we cannot name is not advertised
            return
        assert uuids == node.uuids
        desc = b.describe()[1]
        assert DISCOVERY_CALLS[call](b, gpus[1], desc, ANSWERS[answer][0] == "absent"), (gpus[1], desc)
        # GPU 1's neighbours keep their facts; only a GPU 1 without a bus id cannot be matched as their peer.
        assert gpus[2].nvlink_peers == ((0, 3) if call == "nvmlDeviceGetPciInfo" else (0, 1, 3))
        assert b.describe()[2]["events"] == XID | DBE | UNAVAILABLE | RECOVERY


def test_enumeration_failure_is_reported_not_raised(node: StandinNode) -> None:
    node.nvml(None, fail={"nvmlDeviceGetCount": "unknown"})
    with running(node) as b:
        d = b.discover()
    assert d.gpus == () and d.error is not None and "enumeration" in d.error


def test_init_failure_is_a_backend_error(lib: None, tmp_path: Path) -> None:
    # No node file: the stand-in answers nvmlInit as a node without a loaded driver does.
    with standin.use_node(tmp_path / "missing.json"), pytest.raises(BackendError, match="nvmlInit failed") as err:
        NvmlBackend()
    assert "libnvidia-ml.so not found" not in str(err.value)


def test_binding_without_fabric_info_v3_uses_the_projects_layout(node: StandinNode,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A binding older than 13.580 lacks c_nvmlGpuFabricInfo_v3_t: the backend's own copy of nvml.h's layout goes to
    # the real C ABI, where a wrong size or offset reads the wrong health summary (or trips the stand-in's checks).
    import pynvml

    monkeypatch.delattr(pynvml, "c_nvmlGpuFabricInfo_v3_t", raising=False)  # 12.560 never had it
    with running(node) as b:
        node.set(1, fabric_health="limited_capacity")
        assert b.read(b.discover().gpus[1]).fabric_health == "limited_capacity"
        assert b.read(b.discover().gpus[0]).fabric_health == "healthy"
        assert b.describe()[1]["fabric_state"] == "completed"


def test_binding_without_clock_event_reasons_uses_throttle_reasons(node: StandinNode,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A binding that predates the renamed call has only nvmlDeviceGetCurrentClocksThrottleReasons.
    import pynvml

    monkeypatch.delattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons")
    with running(node) as b:
        node.set(0, clock_event_reasons=["hw_power_brake_slowdown"])
        assert codes_for(b, 0) == {"power-brake"}
        assert b.call_errors == 0


# MIG --------------------------------------------------------------------------------------------------------------

def test_mig_discovery_and_instance_scoped_event(node: StandinNode) -> None:
    node.gpu(0)["mig_devices"] = [
        {"uuid": "MIG-a0", "gpu_instance_id": 1, "profile": "3g.40gb", "memory_mib": 40192},
        {"uuid": "MIG-a1", "gpu_instance_id": 2, "compute_instance_id": 0, "profile": "3g.40gb"}]
    node.write()
    with running(node) as b:
        migs = b.discover().gpus[0].mig_devices
        assert [(m.uuid, m.parent_uuid, m.gpu_instance_id, m.profile, m.memory_mib) for m in migs] == [
            ("MIG-a0", node.uuids[0], 1, "3g.40gb", 40192), ("MIG-a1", node.uuids[0], 2, "3g.40gb", 0)]
        assert b.discover().gpus[1].mig_devices == ()
        state = NodeState()
        monitor = Monitor(b, state, HealthConfig(), 5.0, threading.Event())
        monitor.poll_once()
        node.set(0, mig_events=[{"gpu_instance_id": 2, "xid": 94}])  # a contained memory error inside instance 2
        events = standin.next_events(b, 1)
        assert [(e.uuid, e.code, e.gpu_instance_id, e.compute_instance_id) for e in events] == [
            (node.uuids[0], 94, 2, 0)]
        monitor.handle_events(events)
        snap = state.snapshot()
        assert {d.id: d.state for d in snap.devices if d.gpu.index in (0, 1)} == {
            node.uuids[0]: State.HEALTHY, "MIG-a0": State.HEALTHY, "MIG-a1": State.DEGRADED,
            node.uuids[1]: State.HEALTHY}
        node.append_xid(0, 79)  # whole-GPU fatal: every slice follows its parent
        monitor.handle_events(standin.next_events(b, 1))
        snap = state.snapshot()
        assert [snap.get(i).state for i in (node.uuids[0], "MIG-a0", "MIG-a1")] == [State.UNHEALTHY] * 3  # type: ignore[union-attr]


# Events -----------------------------------------------------------------------------------------------------------

def test_events_xid_dbe_unavailable_recovery(node: StandinNode) -> None:
    node.set(1, xid_events=[13])  # in the file before start: history, never delivered
    with running(node) as b:
        assert b.wait_events(0.01) == ()
        node.append_xid(2, 79)
        node.set(3, ecc_uncorrected_volatile=1)
        node.set(4, lost=True)
        node.nvml(5, recovery_action_raw=1)
        got = standin.next_events(b, 4)
        # The unavailable event names GPU 4 though GPU 4 answers nothing now: matched by its handle's address.
        assert b.read(b.discover().gpus[4]).lost
    assert [(e.uuid, e.kind, e.code, e.gpu_instance_id) for e in got] == [
        (node.uuids[2], EventKind.XID, 79, None), (node.uuids[3], EventKind.ECC_DBE, 0, None),
        (node.uuids[4], EventKind.GPU_UNAVAILABLE, 0, None), (node.uuids[5], EventKind.RECOVERY_ACTION, 1, None)]


@pytest.mark.parametrize(("driver", "mask"), [("570.124.06", XID | DBE | UNAVAILABLE | RECOVERY),
                                              ("550.54.15", XID | DBE)])
def test_registered_event_mask_and_each_kind_delivered(tmp_path: Path, lib: None, driver: str, mask: int) -> None:
    # R570 added GPU-unavailable and recovery-action events; an older driver supports XID and double-bit ECC only,
    # and registering a kind it lacks would fail the whole registration.
    node = StandinNode(tmp_path / "node.json", driver_version=driver)
    with running(node) as b:
        assert [d["events"] for d in b.describe()] == [mask] * 8
        node.append_xid(1, 48)
        node.set(2, ecc_uncorrected_volatile=1)
        node.set(3, lost=True)
        node.nvml(4, recovery_action_raw=2)
        expected = [(node.uuids[1], EventKind.XID, 48), (node.uuids[2], EventKind.ECC_DBE, 0)]
        if mask & UNAVAILABLE:
            expected += [(node.uuids[3], EventKind.GPU_UNAVAILABLE, 0), (node.uuids[4], EventKind.RECOVERY_ACTION, 2)]
        got = standin.next_events(b, len(expected))
        assert [(e.uuid, e.kind, e.code) for e in got] == expected
        assert b.wait_events(0.1) == ()  # nothing further queued


def test_event_wait_errors_do_not_raise(node: StandinNode) -> None:
    with running(node) as b:
        node.nvml(None, fail={"nvmlEventSetWait": "unknown"})
        assert b.wait_events(0.01) == ()
        assert b.call_errors == 1


def test_event_through_monitor_reaches_node_state(node: StandinNode) -> None:
    standin.reset_call_counts()
    with standin.use_node(node.path):
        b = NvmlBackend()
    state = NodeState()
    stop = threading.Event()
    monitor = Monitor(b, state, HealthConfig(), 60.0, stop, event_wait_s=0.05)
    monitor.start()
    try:
        v = state.snapshot().version
        node.append_xid(1, 48)
        snap = state.wait_for_change(v, 10.0)
        d = snap.get(node.uuids[1])
        assert d is not None and d.state == State.UNHEALTHY and d.reasons[0].code == "xid-48"
        assert d.kubelet_health == "Unhealthy"
    finally:
        stop.set()
        monitor.join(5.0)
        b.close()
    assert standin.call_count("nvmlEventSetFree") == 1 and standin.call_count("nvmlShutdown") == 1


def test_close_during_an_event_wait_frees_the_set_only_after_the_wait_returns(node: StandinNode) -> None:
    # The shutdown order the app uses when the event thread is slow to stop: close() while a wait is in flight.
    # Freeing the set under the waiter, or shutting NVML down first, is a violation the stand-in records.
    with standin.use_node(node.path):
        b = NvmlBackend()
    standin.reset_call_counts()
    got: list[tuple[GpuEvent, ...]] = []
    waiter = threading.Thread(target=lambda: got.append(tuple(b.wait_events(30.0))), daemon=True)
    waiter.start()
    try:
        assert eventually(lambda: standin.call_count("nvmlEventSetWait_v2") == 1)
        b.close()
        assert (standin.call_count("nvmlEventSetFree"), standin.call_count("nvmlShutdown")) == (0, 0)
        node.append_xid(0, 48)  # the wait returns with it ...
        waiter.join(10.0)
        assert not waiter.is_alive()
    finally:
        if waiter.is_alive():
            node.append_xid(0, 48)
            waiter.join(10.0)
    # ... and the set is freed then, once, before NVML is shut down (the reverse order is a recorded violation).
    assert (standin.call_count("nvmlEventSetFree"), standin.call_count("nvmlShutdown")) == (1, 1)
    assert [(e.uuid, e.code) for e in got[0]] == [(node.uuids[0], 48)]
    assert b.wait_events(0.0) == ()  # a wait after close never touches the freed set
    b.close()
    assert (standin.call_count("nvmlEventSetFree"), standin.call_count("nvmlShutdown")) == (1, 1)


def test_close_with_no_wait_in_flight_frees_at_once_and_only_once(node: StandinNode) -> None:
    with standin.use_node(node.path):
        b = NvmlBackend()
    standin.reset_call_counts()
    assert b.wait_events(0.01) == ()
    b.close()
    b.close()
    assert (standin.call_count("nvmlEventSetFree"), standin.call_count("nvmlShutdown")) == (1, 1)


def test_call_errors_from_concurrent_threads_are_all_counted(node: StandinNode) -> None:
    # The poll thread and the event thread both fail calls while metrics reads the counter.
    node.nvml(None, fail={"nvmlDeviceGetTemperature": "unknown"})
    per_thread, threads = 150, 4
    with running(node) as b:
        gpu = b.discover().gpus[0]
        start = threading.Barrier(threads)

        def hammer() -> None:
            start.wait()
            for _ in range(per_thread):
                b.read(gpu)

        workers = [threading.Thread(target=hammer) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60.0)
        assert b.call_errors == per_thread * threads


# Left on the hand-written fake --------------------------------------------------------------------------------------

@pytest.fixture
def nv() -> FakeNvml:
    return eight_gpu_node()


def fake_codes(backend: NvmlBackend, index: int) -> set[str]:
    gpu = backend.discover().gpus[index]
    return {c.code for c in evaluate_reading(backend.read(gpu), None, HealthConfig())}


def test_driver_without_clock_event_reasons_falls_back(nv: FakeNvml) -> None:
    # Fake: FUNCTION_NOT_FOUND is a driver library without the symbol; the stand-in exports every function it has.
    b = NvmlBackend(nv)
    nv.fail[("nvmlDeviceGetCurrentClocksEventReasons", None)] = "function_not_found"
    nv.gpus[0].clocks = 0x80
    assert "power-brake" in fake_codes(b, 0)


def test_driver_without_field_values_has_no_recovery_action(nv: FakeNvml) -> None:
    # Fake: FUNCTION_NOT_FOUND (a driver library without nvmlDeviceGetFieldValues) cannot come from the stand-in.
    b = NvmlBackend(nv)
    nv.fail[("nvmlDeviceGetFieldValues", None)] = "function_not_found"
    r = b.read(b.discover().gpus[0])
    assert r.errors == () and r.recovery_action is None and r.nvlink_down == ()


FAKE_POLL_CALLS = ["nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows",
                   "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetRetiredPages", "nvmlDeviceGetTemperature",
                   "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrPcieLinkGeneration",
                   "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetFieldValues",
                   "nvmlDeviceGetGpuFabricInfoV"]


@pytest.mark.parametrize("call", FAKE_POLL_CALLS)
def test_function_not_found_at_poll_is_absent(nv: FakeNvml, call: str) -> None:
    # Fake: FUNCTION_NOT_FOUND needs a driver library without the symbol, which the stand-in never is.
    nv.gpus[6].fabric = 1
    b = NvmlBackend(nv)
    nv.fail[(call, "GPU-fake-6")] = "function_not_found"
    state = NodeState()
    monitor = Monitor(b, state, HealthConfig(nvml_error_polls=2), 5.0, threading.Event())
    for _ in range(3):
        monitor.poll_once()
    assert [d.state for d in state.snapshot().devices] == [State.HEALTHY] * 8
    assert b.call_errors == 0


FAKE_DISCOVERY_CALLS = ["nvmlDeviceGetName", "nvmlDeviceGetMinorNumber", "nvmlDeviceGetPciInfo_v3",
                        "nvmlDeviceGetNumaNodeId", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetTemperatureThreshold",
                        "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetMigMode",
                        "nvmlDeviceGetNvLinkRemotePciInfo", "nvmlDeviceGetTopologyCommonAncestor",
                        "nvmlDeviceGetUUID", "nvmlDeviceRegisterEvents", "nvmlDeviceGetSupportedEventTypes"]


@pytest.mark.parametrize("call", FAKE_DISCOVERY_CALLS)
def test_function_not_found_at_discovery(nv: FakeNvml, call: str) -> None:
    # Fake: FUNCTION_NOT_FOUND needs a driver library without the symbol, which the stand-in never is.
    nv.fail[(call, "GPU-fake-1")] = "function_not_found"
    b = NvmlBackend(nv)
    uuids = [g.uuid for g in b.discover().gpus]
    assert call in nv.calls, f"{call} never called: the fault was never injected"
    if call == "nvmlDeviceGetUUID":
        assert "GPU-fake-1" not in uuids and len(uuids) == 7
    else:
        assert len(uuids) == 8


def test_init_failure_without_the_library_is_a_clear_backend_error() -> None:
    # Fake: LIBRARY_NOT_FOUND is pynvml failing to load libnvidia-ml at all; here the stand-in is already loaded.
    with pytest.raises(BackendError, match=r"libnvidia-ml\.so not found"):
        NvmlBackend(FakeNvml([], init_error="library_not_found"))
