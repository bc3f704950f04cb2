"""The real NVML backend code against a hand-written fake of the pynvml module: every signal and every error kind."""

from __future__ import annotations

import threading

import pytest

from plugin.devices.backend import BackendError
from plugin.devices.nvml import NvmlBackend
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.health.policy import evaluate_reading
from plugin.health.reasons import State
from tests.fakes.fake_pynvml import ERROR_CODES, FakeGpu, FakeNvml, eight_gpu_node


@pytest.fixture
def nv() -> FakeNvml:
    return eight_gpu_node()


def codes_for(backend: NvmlBackend, index: int) -> set[str]:
    gpu = backend.discover().gpus[index]
    return {c.code for c in evaluate_reading(backend.read(gpu), None, HealthConfig())}


def test_discovery_reads_identity_and_topology(nv: FakeNvml) -> None:
    b = NvmlBackend(nv)
    d = b.discover()
    assert d.error is None and d.driver_version == "570.86.15"
    g = d.gpus[5]
    assert (g.uuid, g.index, g.minor, g.numa_node, g.name) == ("GPU-fake-5", 5, 5, 1, "NVIDIA H100 80GB HBM3")
    assert g.memory_mib == 80 * 1024 and g.pci_bus_id == "00000000:1D:00.0"
    assert g.nvlink_peers == (4, 6, 7)
    assert d.gpus[0].pcie_switch == d.gpus[1].pcie_switch != d.gpus[2].pcie_switch
    assert set(nv.registered) == {f"GPU-fake-{i}" for i in range(8)}
    assert all(mask & 0x8 for mask in nv.registered.values())


def test_healthy_gpu_reads_clean(nv: FakeNvml) -> None:
    b = NvmlBackend(nv)
    r = b.read(b.discover().gpus[0])
    assert r.errors == () and not r.lost
    assert (r.temperature_c, r.temperature_slowdown_c, r.temperature_shutdown_c) == (40, 87, 92)
    assert (r.pcie_gen, r.pcie_width, r.pcie_max_gen, r.pcie_max_width) == (5, 16, 5, 16)
    assert r.nvlink_down == () and r.recovery_action == "none" and r.row_remap_pending is False
    assert codes_for(b, 0) == set()


@pytest.mark.parametrize(("mutate", "code"), [
    (lambda g: g.ecc.__setitem__((1, 0), 2), "ecc-uncorrected"),
    (lambda g: setattr(g, "remap", (0, 0, 1, 0)), "row-remap-pending"),
    (lambda g: setattr(g, "remap", (0, 1, 0, 1)), "row-remap-failure"),
    (lambda g: setattr(g, "retired_pending", 1), "retired-pages-pending"),
    (lambda g: g.retired.__setitem__(1, list(range(63))), "retired-pages-limit"),
    (lambda g: setattr(g, "temperature", 88), "thermal-slowdown"),
    (lambda g: setattr(g, "temperature", 95), "temperature-shutdown"),
    (lambda g: setattr(g, "clocks", 0x40), "thermal-slowdown"),
    (lambda g: setattr(g, "clocks", 0x8), "hw-slowdown"),
    (lambda g: setattr(g, "clocks", 0x80), "power-brake"),
    (lambda g: setattr(g, "pcie", (5, 8, 5, 16)), "pcie-link-degraded"),
    (lambda g: setattr(g, "pcie", (3, 16, 5, 16)), "pcie-link-degraded"),
    (lambda g: g.nvlinks.__setitem__(1, (0, "")), "nvlink-down"),
    (lambda g: setattr(g, "recovery", 1), "recovery-action-reset"),
    (lambda g: setattr(g, "recovery", 2), "recovery-action-reboot"),
    (lambda g: setattr(g, "recovery", 3), "recovery-action-drain-p2p"),
    (lambda g: setattr(g, "recovery", 4), "recovery-action-reset"),
    (lambda g: setattr(g, "fabric", 2), "fabric-unhealthy"),
    (lambda g: setattr(g, "fabric", 3), "fabric-limited"),
])
def test_every_polled_signal(nv: FakeNvml, mutate: object, code: str) -> None:
    b = NvmlBackend(nv)
    mutate(nv.gpus[3])  # type: ignore[operator]
    assert code in codes_for(b, 3)
    assert codes_for(b, 2) == set()  # the neighbour is untouched


def test_idle_gpu_at_lower_pcie_gen_is_fine(nv: FakeNvml) -> None:
    b = NvmlBackend(nv)
    nv.gpus[1].pcie = (1, 16, 5, 16)
    nv.gpus[1].clocks = 0x1  # GpuIdle
    assert codes_for(b, 1) == set()


def test_pcie_replay_and_nvlink_counters_are_read(nv: FakeNvml) -> None:
    b = NvmlBackend(nv)
    nv.gpus[0].replay = 7
    nv.gpus[0].nvlink_errors = {(0, 0): 2, (1, 1): 3, (2, 2): 5}
    r = b.read(b.discover().gpus[0])
    assert r.pcie_replay_count == 7 and r.nvlink_error_count == 5 and r.nvlink_crc_count == 5


def test_old_binding_without_clock_event_reasons_falls_back(nv: FakeNvml) -> None:
    b = NvmlBackend(nv)
    nv.fail[("nvmlDeviceGetCurrentClocksEventReasons", None)] = "function_not_found"
    nv.gpus[0].clocks = 0x80
    assert "power-brake" in codes_for(b, 0)


def test_not_supported_means_no_signal_not_a_fault(nv: FakeNvml) -> None:
    b = NvmlBackend(nv)
    nv.fail[("nvmlDeviceGetRemappedRows", None)] = "not_supported"
    nv.fail[("nvmlDeviceGetFieldValues", None)] = "function_not_found"
    r = b.read(b.discover().gpus[0])
    assert r.errors == () and r.row_remap_pending is None and r.recovery_action is None


def test_lost_gpu_and_reset_required(nv: FakeNvml) -> None:
    b = NvmlBackend(nv)
    nv.fail[("nvmlDeviceGetTemperature", "GPU-fake-2")] = "gpu_is_lost"
    nv.fail[("nvmlDeviceGetRemappedRows", "GPU-fake-3")] = "reset_required"
    assert b.read(b.discover().gpus[2]).lost
    assert codes_for(b, 2) == {"gpu-lost"}
    assert "reset-required" in codes_for(b, 3)
    assert codes_for(b, 4) == set()


# Every device call the backend makes x every error kind: no exception, only that GPU affected.
POLL_CALLS = ["nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetRetiredPagesPendingStatus",
              "nvmlDeviceGetRetiredPages", "nvmlDeviceGetTemperature", "nvmlDeviceGetCurrentClocksEventReasons",
              "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth",
              "nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetFieldValues", "nvmlDeviceGetGpuFabricInfoV"]


@pytest.mark.parametrize("error", sorted(ERROR_CODES))
@pytest.mark.parametrize("call", POLL_CALLS)
def test_fault_matrix_poll(nv: FakeNvml, call: str, error: str) -> None:
    nv.gpus[6].fabric = 1
    b = NvmlBackend(nv)
    nv.fail[(call, "GPU-fake-6")] = error
    state = NodeState()
    monitor = Monitor(b, state, HealthConfig(nvml_error_polls=2), 5.0, threading.Event())
    for _ in range(3):
        monitor.poll_once()
    snap = state.snapshot()
    others = [d.state for d in snap.devices if d.id != "GPU-fake-6"]
    assert others == [State.HEALTHY] * 7
    expected = {"not_supported": State.HEALTHY, "function_not_found": State.HEALTHY,
                "gpu_is_lost": State.UNHEALTHY, "reset_required": State.UNHEALTHY,
                "unknown": State.UNKNOWN, "uninitialized": State.UNKNOWN}[error]
    got = snap.get("GPU-fake-6")
    assert got is not None and got.state == expected, got.reasons


DISCOVERY_CALLS = ["nvmlDeviceGetName", "nvmlDeviceGetMinorNumber", "nvmlDeviceGetPciInfo_v3",
                   "nvmlDeviceGetNumaNodeId", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetTemperatureThreshold",
                   "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetMigMode",
                   "nvmlDeviceGetNvLinkRemotePciInfo", "nvmlDeviceGetTopologyCommonAncestor",
                   "nvmlDeviceGetUUID", "nvmlDeviceRegisterEvents", "nvmlDeviceGetSupportedEventTypes"]


@pytest.mark.parametrize("error", sorted(ERROR_CODES))
@pytest.mark.parametrize("call", DISCOVERY_CALLS)
def test_fault_matrix_discovery(nv: FakeNvml, call: str, error: str) -> None:
    nv.fail[(call, "GPU-fake-1")] = error
    b = NvmlBackend(nv)
    uuids = [g.uuid for g in b.discover().gpus]
    assert call in nv.calls, f"{call} never called: the fault was never injected"
    if call == "nvmlDeviceGetUUID":
        assert "GPU-fake-1" not in uuids and len(uuids) == 7  # a GPU we cannot name is not advertised
    else:
        assert len(uuids) == 8


def test_init_failure_is_a_clear_backend_error() -> None:
    with pytest.raises(BackendError, match=r"libnvidia-ml\.so not found"):
        NvmlBackend(FakeNvml([], init_error="library_not_found"))


def test_enumeration_failure_is_reported_not_raised(nv: FakeNvml) -> None:
    nv.fail[("nvmlDeviceGetCount", None)] = "unknown"
    d = NvmlBackend(nv).discover()
    assert d.gpus == () and d.error is not None and "enumeration" in d.error


def test_events_xid_dbe_unavailable_recovery_and_timeout(nv: FakeNvml) -> None:
    b = NvmlBackend(nv)
    assert b.wait_events(0.01) == ()
    nv.inject_event(2, 0x8, 79)
    nv.inject_event(3, 0x2, 0)
    nv.inject_event(4, 0x4000, 0)
    nv.inject_event(5, 0x8000, 1)
    got = [b.wait_events(1.0)[0] for _ in range(4)]
    assert [(e.uuid, e.kind, e.code) for e in got] == [
        ("GPU-fake-2", "xid", 79), ("GPU-fake-3", "ecc-dbe", 0), ("GPU-fake-4", "gpu-unavailable", 0),
        ("GPU-fake-5", "recovery-action", 1)]
    assert got[0].gpu_instance_id is None


def test_event_wait_errors_do_not_raise(nv: FakeNvml) -> None:
    b = NvmlBackend(nv)
    nv.fail[("nvmlEventSetWait_v2", None)] = "unknown"
    assert b.wait_events(0.01) == ()


def test_mig_discovery_and_instance_scoped_event() -> None:
    nv = FakeNvml([FakeGpu("GPU-a", "00000000:18:00.0", mig=[{"uuid": "MIG-a0", "gi": 1, "profile": "3g.40gb"},
                                                             {"uuid": "MIG-a1", "gi": 2, "profile": "3g.40gb"}]),
                   FakeGpu("GPU-b", "00000000:19:00.0", minor=1)])
    b = NvmlBackend(nv)
    migs = b.discover().gpus[0].mig_devices
    assert [(m.uuid, m.gpu_instance_id, m.profile) for m in migs] == [("MIG-a0", 1, "3g.40gb"),
                                                                      ("MIG-a1", 2, "3g.40gb")]
    state = NodeState()
    monitor = Monitor(b, state, HealthConfig(), 5.0, threading.Event())
    monitor.poll_once()
    nv.inject_event(0, 0x8, 94, gi=2)  # a contained memory error inside GPU instance 2
    monitor.handle_events(list(b.wait_events(1.0)))
    snap = state.snapshot()
    assert {d.id: d.state for d in snap.devices} == {
        "GPU-a": State.HEALTHY, "MIG-a0": State.HEALTHY, "MIG-a1": State.DEGRADED, "GPU-b": State.HEALTHY}
    nv.inject_event(0, 0x8, 79)  # whole-GPU fatal: every slice follows its parent
    monitor.handle_events(list(b.wait_events(1.0)))
    snap = state.snapshot()
    assert [snap.get(i).state for i in ("GPU-a", "MIG-a0", "MIG-a1")] == [State.UNHEALTHY] * 3  # type: ignore[union-attr]


def test_event_through_monitor_reaches_node_state(nv: FakeNvml) -> None:
    b = NvmlBackend(nv)
    state = NodeState()
    stop = threading.Event()
    monitor = Monitor(b, state, HealthConfig(), 60.0, stop, event_wait_s=0.05)
    monitor.start()
    try:
        v = state.snapshot().version
        nv.inject_event(1, 0x8, 48)
        snap = state.wait_for_change(v, 5.0)
        d = snap.get("GPU-fake-1")
        assert d is not None and d.state == State.UNHEALTHY and d.reasons[0].code == "xid-48"
        assert d.kubelet_health == "Unhealthy"
    finally:
        stop.set()
        monitor.join(2.0)
        b.close()
    assert "nvmlEventSetFree" in nv.calls and "nvmlShutdown" in nv.calls


def test_close_during_an_event_wait_frees_the_set_only_after_the_wait_returns(nv: FakeNvml) -> None:
    # The shutdown order the app uses when the event thread is slow to stop: close() while a wait is in flight.
    b = NvmlBackend(nv)
    nv.hold_waits = threading.Event()
    waiter = threading.Thread(target=b.wait_events, args=(0.25,), daemon=True)
    waiter.start()
    assert nv.wait_entered.wait(10.0)
    b.close()
    assert nv.misuse == [] and "nvmlEventSetFree" not in nv.calls and "nvmlShutdown" not in nv.calls
    nv.hold_waits.set()  # the wait returns (times out) ...
    waiter.join(10.0)
    assert not waiter.is_alive()
    # ... and the set is freed then, once, and NVML shut down after it.
    assert nv.misuse == []
    calls = list(nv.calls)
    assert calls.count("nvmlEventSetFree") == 1 and calls.count("nvmlShutdown") == 1
    assert calls.index("nvmlEventSetFree") < calls.index("nvmlShutdown")
    # A wait after close never touches the freed set.
    assert b.wait_events(0.0) == () and nv.misuse == []


def test_close_with_no_wait_in_flight_frees_at_once_and_only_once(nv: FakeNvml) -> None:
    b = NvmlBackend(nv)
    assert b.wait_events(0.01) == ()
    b.close()
    b.close()
    calls = list(nv.calls)
    assert calls.count("nvmlEventSetFree") == 1 and calls.count("nvmlShutdown") == 1 and nv.misuse == []


def test_call_errors_from_concurrent_threads_are_all_counted(nv: FakeNvml) -> None:
    # The poll thread and the event thread both fail calls while metrics reads the counter. (Under CPython's GIL
    # an unlocked ``+=`` rarely loses an update; a free-threaded build would lose many.)
    b = NvmlBackend(nv)
    nv.fail[("nvmlDeviceGetTemperature", None)] = "unknown"
    gpu = b.discover().gpus[0]
    per_thread, threads = 300, 4
    start = threading.Barrier(threads)

    def hammer() -> None:
        start.wait()
        for _ in range(per_thread):
            b.read(gpu)

    workers = [threading.Thread(target=hammer) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30.0)
    assert b.call_errors == per_thread * threads
    b.close()
