"""The NVML stand-in (tests/nvml_standin) through the real nvidia-ml-py: what each profile answers, faults, live
rewrites, events, hangs, crashes, and the misuse it must catch (tests/fakes/nvml_standin.py drives it)."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import nvml_standin as standin
from tests.fakes.nvml_standin import StandinNode

pynvml = pytest.importorskip("pynvml")

H100_BUS = "00000000:18:00.0"


class _FabricInfoV3(ctypes.Structure):
    """nvml.h's nvmlGpuFabricInfo_v3_t, for bindings before 13.580 (12.560, the oldest the project declares, has only
    the v2 struct); pynvml's own class, where it exists, is what the tests use."""

    _fields_ = [("version", ctypes.c_uint), ("clusterUuid", ctypes.c_uint8 * 16), ("status", ctypes.c_int),
                ("cliqueId", ctypes.c_uint32), ("state", ctypes.c_uint8), ("healthMask", ctypes.c_uint32),
                ("healthSummary", ctypes.c_uint8)]

    def __init__(self) -> None:
        super().__init__(version=0x3000028)  # nvmlGpuFabricInfo_v3, as pynvml's constructor sets it


def fabric_info_v3() -> Any:
    return getattr(pynvml, "c_nvmlGpuFabricInfo_v3_t", _FabricInfoV3)()


@pytest.fixture(scope="module", autouse=True)
def loaded() -> None:
    standin.load_in_process(standin.library_dir_or_skip())


@pytest.fixture
def node(tmp_path: Path) -> StandinNode:
    return StandinNode(tmp_path / "node.json")


@pytest.fixture
def nv(node: StandinNode) -> Iterator[Any]:
    standin.reset_violations()
    with standin.initialised(node.path) as mod:
        yield mod
    assert standin.violations() == [], "a test that expects violations must reset them"


def code(fn: Any, *args: Any) -> int:
    """The NVML return code of a pynvml call: 0 on success."""
    try:
        fn(*args)
    except pynvml.NVMLError as exc:
        return int(exc.value)
    return 0


def handle(i: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(i)


# Profiles ---------------------------------------------------------------------------------------------------------

PROFILES = {
    # profile: (name, arch, link slots, nvswitch links active, fabric, remap, retired pages, pcie max gen)
    "a100-sxm": ("NVIDIA A100-SXM4-80GB", 7, 12, True, False, True, False, 4),
    "h100-sxm": ("NVIDIA H100 80GB HBM3", 9, 18, True, True, True, False, 5),
    "h100-pcie": ("NVIDIA H100 PCIe", 9, 18, False, False, True, False, 5),
    "l40s": ("NVIDIA L40S", 8, 0, False, False, True, False, 4),
    "t4": ("Tesla T4", 6, 0, False, False, False, True, 3),
    "gb200": ("NVIDIA GB200", 10, 18, True, True, True, False, 5),
}


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_profile_answers(tmp_path: Path, profile: str) -> None:
    name, arch, slots, switched, fabric, remap, retired, gen = PROFILES[profile]
    doc = {"gpus": [{"uuid": "GPU-a", "index": 0, "numa_node": 0, "name": name, "memory_mib": 1000,
                     "nvlink_peers": [], "pcie_switch": None, "signals": {}}]}
    node = StandinNode(tmp_path / "node.json", doc, profile=profile)
    with standin.initialised(node.path):
        h = handle(0)
        assert pynvml.nvmlDeviceGetName(h) == name
        assert pynvml.nvmlDeviceGetArchitecture(h) == arch
        assert pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h) == gen
        assert pynvml.nvmlDeviceGetMaxPcieLinkWidth(h) == 16
        if slots == 0:
            assert code(pynvml.nvmlDeviceGetNvLinkState, h, 0) == pynvml.NVML_ERROR_NOT_SUPPORTED
        else:
            states = [pynvml.nvmlDeviceGetNvLinkState(h, k) for k in range(slots)]
            assert states == [1 if switched else 0] * slots
            assert code(pynvml.nvmlDeviceGetNvLinkState, h, slots) == pynvml.NVML_ERROR_INVALID_ARGUMENT
        info = fabric_info_v3()
        if fabric:
            pynvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
            assert (info.state, info.status, info.healthSummary) == (3, 0, 1)
        else:
            assert code(pynvml.nvmlDeviceGetGpuFabricInfoV, h, ctypes.byref(info)) == pynvml.NVML_ERROR_NOT_SUPPORTED
        if remap:
            assert pynvml.nvmlDeviceGetRemappedRows(h) == (0, 0, 0, 0)
        else:
            assert code(pynvml.nvmlDeviceGetRemappedRows, h) == pynvml.NVML_ERROR_NOT_SUPPORTED
        if retired:
            assert pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h) == 0
            assert pynvml.nvmlDeviceGetRetiredPages(h, 1) == []
        else:
            assert code(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, h) == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_identity_and_topology(nv: Any, node: StandinNode) -> None:
    assert nv.nvmlDeviceGetCount() == 8
    assert nv.nvmlSystemGetDriverVersion() == "570.124.06"
    assert nv.nvmlSystemGetCudaDriverVersion() == 12080
    h0, h1, h2, h4 = handle(0), handle(1), handle(2), handle(4)
    assert nv.nvmlDeviceGetUUID(h0) == node.uuids[0]
    assert nv.nvmlDeviceGetPciInfo_v3(h0).busId == H100_BUS
    assert nv.nvmlDeviceGetMinorNumber(h1) == 1
    assert nv.nvmlDeviceGetIndex(h2) == 2
    assert nv.nvmlDeviceGetNumaNodeId(h4) == 1
    assert nv.nvmlDeviceGetMemoryInfo(h0).total == 81559 * 1024 * 1024
    assert nv.nvmlDeviceGetMemoryInfo(h0, version=nv.nvmlMemory_v2).total == 81559 * 1024 * 1024
    assert ctypes.addressof(nv.nvmlDeviceGetHandleByUUID(node.uuids[1]).contents) == ctypes.addressof(h1.contents)
    assert code(nv.nvmlDeviceGetHandleByUUID, "GPU-nope") == nv.NVML_ERROR_NOT_FOUND
    assert code(nv.nvmlDeviceGetHandleByIndex, 8) == nv.NVML_ERROR_INVALID_ARGUMENT
    levels = [nv.nvmlDeviceGetTopologyCommonAncestor(h0, h) for h in (h0, h1, h2, h4)]
    assert levels == [0, 20, 40, 50]
    assert nv.nvmlDeviceGetTemperatureThreshold(h0, 1) == 87
    assert nv.nvmlDeviceGetTemperatureThreshold(h0, 0) == 92
    assert nv.nvmlDeviceGetComputeRunningProcesses(h0) == []
    assert nv.nvmlDeviceGetMigMode(h0) == [0, 0]
    assert nv.nvmlDeviceGetSupportedEventTypes(h0) == 0xC00B


def test_nvlink_model(nv: Any, node: StandinNode) -> None:
    # GPU 0 of the built-in node: links 0..2 to GPUs 1, 2, 3; links 3..17 to NVSwitches; nothing past 18.
    h0 = handle(0)
    assert [nv.nvmlDeviceGetNvLinkRemotePciInfo(h0, k).busId for k in range(3)] == \
        [nv.nvmlDeviceGetPciInfo(handle(i)).busId for i in (1, 2, 3)]
    gpu_buses = {nv.nvmlDeviceGetPciInfo(handle(i)).busId for i in range(8)}
    assert nv.nvmlDeviceGetNvLinkRemotePciInfo(h0, 3).busId not in gpu_buses
    assert code(nv.nvmlDeviceGetNvLinkState, h0, 18) == nv.NVML_ERROR_INVALID_ARGUMENT
    assert code(nv.nvmlDeviceGetNvLinkState, h0, 36) == nv.NVML_ERROR_INVALID_ARGUMENT
    node.set(0, nvlink_down=[1], nvlink_error_count=7)
    node.nvml(0, links_trained=10, past_links="disabled", nvlink_crc=3)
    assert [nv.nvmlDeviceGetNvLinkState(h0, k) for k in range(12)] == [1, 0] + [1] * 8 + [0, 0]
    assert nv.nvmlDeviceGetNvLinkState(h0, 20) == 0  # what NVIDIA's own mock answers past the last link
    assert code(nv.nvmlDeviceGetNvLinkState, h0, 36) == nv.NVML_ERROR_INVALID_ARGUMENT
    assert nv.nvmlDeviceGetNvLinkErrorCounter(h0, 0, 0) == 7
    assert nv.nvmlDeviceGetNvLinkErrorCounter(h0, 0, 2) == 3
    assert nv.nvmlDeviceGetNvLinkErrorCounter(h0, 4, 0) == 0
    node.remove_gpu(3)  # GPU 0's link 2 loses its far end
    assert nv.nvmlDeviceGetCount() == 7
    assert nv.nvmlDeviceGetNvLinkState(h0, 2) == 0


def test_field_values(nv: Any, node: StandinNode) -> None:
    node.set(0, recovery_action="drain_and_reset", nvlink_error_count=5, nvlink_down=[0])
    values = nv.nvmlDeviceGetFieldValues(handle(0), [230, (165, 0), (165, 1), (165, 40), 91, 52, 38, 59, 999])
    assert [v.nvmlReturn for v in values] == [0, 0, 0, nv.NVML_ERROR_INVALID_ARGUMENT, 0, 0, 0, 0,
                                              nv.NVML_ERROR_NOT_SUPPORTED]
    assert values[0].value.uiVal == 4
    assert (values[1].value.uiVal, values[2].value.uiVal) == (0, 1)
    assert values[4].value.uiVal == 18
    assert (values[5].value.ullVal, values[6].value.ullVal, values[7].value.ullVal) == (5, 0, 0)
    assert values[0].timestamp > 0
    node.nvml(0, recovery_action_raw=7)
    assert nv.nvmlDeviceGetFieldValues(handle(0), [230])[0].value.uiVal == 7


def test_recovery_field_needs_r570(tmp_path: Path) -> None:
    node = StandinNode(tmp_path / "node.json", driver_version="550.90.07")
    with standin.initialised(node.path) as nv:
        assert nv.nvmlDeviceGetFieldValues(handle(0), [230])[0].nvmlReturn == nv.NVML_ERROR_NOT_SUPPORTED
        assert nv.nvmlDeviceGetSupportedEventTypes(handle(0)) == 0xB
        assert code(nv.nvmlDeviceRegisterEvents, handle(0), 0x4000, nv.nvmlEventSetCreate()) == \
            nv.NVML_ERROR_NOT_SUPPORTED


def test_signals(nv: Any, node: StandinNode) -> None:
    h = handle(1)
    node.set(1, ecc_uncorrected_volatile=2, ecc_corrected_volatile=9, row_remap_pending=True, temperature_c=91,
             clock_event_reasons=["hw_slowdown", "hw_power_brake_slowdown"], pcie_link={"gen": 3, "width": 8},
             pcie_replay_count=12, fabric_health="limited_capacity")
    assert [nv.nvmlDeviceGetTotalEccErrors(h, t, c) for t in (1, 0) for c in (0, 1)] == [2, 2, 9, 9]
    assert nv.nvmlDeviceGetEccMode(h) == [1, 1]
    assert nv.nvmlDeviceGetRemappedRows(h)[2:] == (1, 0)
    assert nv.nvmlDeviceGetTemperature(h, 0) == 91
    assert nv.nvmlDeviceGetCurrentClocksEventReasons(h) == 0x88
    assert nv.nvmlDeviceGetCurrentClocksThrottleReasons(h) == 0x88
    assert (nv.nvmlDeviceGetCurrPcieLinkGeneration(h), nv.nvmlDeviceGetCurrPcieLinkWidth(h)) == (3, 8)
    assert nv.nvmlDeviceGetPcieReplayCounter(h) == 12
    info = fabric_info_v3()
    nv.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
    assert info.healthSummary == 3
    node.set(1, clock_event_reasons=None)
    assert nv.nvmlDeviceGetCurrentClocksEventReasons(h) == 0x1  # GpuIdle
    node.nvml(1, ecc=False)
    assert code(nv.nvmlDeviceGetTotalEccErrors, h, 1, 0) == nv.NVML_ERROR_NOT_SUPPORTED
    assert nv.nvmlDeviceGetEccMode(h) == [0, 0]
    for signal_name, expected in (("lost", 15), ("reset_required", 16), ("nvml_error", 999)):
        node.set(1, **{signal_name: True})
        assert code(nv.nvmlDeviceGetTemperature, h, 0) == expected
        assert code(nv.nvmlDeviceGetUUID, h) == expected
        node.set(1, **{signal_name: None})
    assert nv.nvmlDeviceGetTemperature(h, 0) == 91
    assert nv.nvmlDeviceGetTemperature(handle(0), 0) == 40


def test_retired_pages_on_t4(tmp_path: Path) -> None:
    node = StandinNode(tmp_path / "node.json", profile="t4")
    node.set(0, retired_pages_count=3, retired_pages_pending=True)
    with standin.initialised(node.path) as nv:
        h = handle(0)
        assert nv.nvmlDeviceGetRetiredPagesPendingStatus(h) == 1
        assert len(nv.nvmlDeviceGetRetiredPages(h, 1)) == 3
        assert nv.nvmlDeviceGetRetiredPages(h, 0) == []
        count = ctypes.c_uint(0)
        assert nv.nvmlLib.nvmlDeviceGetRetiredPages(h, 1, ctypes.byref(count), None) == 7  # INSUFFICIENT_SIZE
        assert count.value == 3


def test_forced_failures(nv: Any, node: StandinNode) -> None:
    node.nvml(2, fail={"nvmlDeviceGetTemperature": "unknown", "nvmlDeviceGetMemoryInfo": "timeout",
                       "nvmlDeviceGetPciInfo": "argument_version_mismatch"})
    h = handle(2)
    assert code(nv.nvmlDeviceGetTemperature, h, 0) == nv.NVML_ERROR_UNKNOWN
    assert code(nv.nvmlDeviceGetMemoryInfo, h, nv.nvmlMemory_v2) == nv.NVML_ERROR_TIMEOUT  # any version suffix
    assert code(nv.nvmlDeviceGetPciInfo_v3, h) == nv.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    assert nv.nvmlDeviceGetTemperature(handle(1), 0) == 40
    node.nvml(None, fail={"nvmlDeviceGetCount": "no_permission"})
    assert code(nv.nvmlDeviceGetCount) == nv.NVML_ERROR_NO_PERMISSION


def test_live_rewrite_and_malformed_rewrite(nv: Any, node: StandinNode, capfd: pytest.CaptureFixture[str]) -> None:
    h = handle(0)
    for temp in (41, 42, 43):  # same size, back to back: stat alone could miss these
        node.set(0, temperature_c=temp)
        assert nv.nvmlDeviceGetTemperature(h, 0) == temp
    node.path.write_text('{"gpus": [')
    assert nv.nvmlDeviceGetTemperature(h, 0) == 43
    assert nv.nvmlDeviceGetTemperature(h, 0) == 43
    err = capfd.readouterr().err
    assert err.count("keeping the last good state") == 1 and "line 1, column 11" in err
    node.set(0, temperature_c=50)
    assert nv.nvmlDeviceGetTemperature(h, 0) == 50


def test_gpus_added_and_removed(nv: Any, node: StandinNode) -> None:
    h7 = handle(7)
    gone = node.remove_gpu(7)
    assert nv.nvmlDeviceGetCount() == 7
    assert code(nv.nvmlDeviceGetUUID, h7) == nv.NVML_ERROR_GPU_IS_LOST
    node.doc["gpus"].append(gone)
    node.write()
    assert nv.nvmlDeviceGetCount() == 8
    assert ctypes.addressof(handle(7).contents) == ctypes.addressof(h7.contents)  # same struct, keyed by UUID
    assert nv.nvmlDeviceGetUUID(h7) == gone["uuid"]


def test_mig(tmp_path: Path) -> None:
    node = StandinNode(tmp_path / "node.json")
    node.gpu(0)["mig_devices"] = [
        {"uuid": "MIG-a", "gpu_instance_id": 7, "compute_instance_id": 0, "profile": "1g.10gb", "memory_mib": 9856},
        {"uuid": "MIG-b", "gpu_instance_id": 2, "profile": "3g.40gb"}]
    node.write()
    with standin.initialised(node.path) as nv:
        h = handle(0)
        assert nv.nvmlDeviceGetMigMode(h) == [1, 1]
        assert nv.nvmlDeviceGetMaxMigDeviceCount(h) == 7
        m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
        assert nv.nvmlDeviceGetUUID(m) == "MIG-a"
        assert nv.nvmlDeviceGetName(m) == "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
        assert (nv.nvmlDeviceGetGpuInstanceId(m), nv.nvmlDeviceGetComputeInstanceId(m)) == (7, 0)
        assert nv.nvmlDeviceGetMemoryInfo(m).total == 9856 * 1024 * 1024
        assert nv.nvmlDeviceIsMigDeviceHandle(m).value == 1
        parent = nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)
        assert ctypes.addressof(parent.contents) == ctypes.addressof(h.contents)
        assert code(nv.nvmlDeviceGetMigDeviceHandleByIndex, h, 2) == nv.NVML_ERROR_NOT_FOUND
        assert code(nv.nvmlDeviceGetGpuInstanceId, h) == nv.NVML_ERROR_INVALID_ARGUMENT
        assert code(nv.nvmlDeviceRegisterEvents, m, 0x8, nv.nvmlEventSetCreate()) == nv.NVML_ERROR_NOT_SUPPORTED
        es = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(h, 0x8, es)
        node.set(0, mig_events=[{"gpu_instance_id": 7, "xid": 79}])
        ev = nv.nvmlEventSetWait_v2(es, 1000)
        assert (ev.eventData, ev.gpuInstanceId, ev.computeInstanceId) == (79, 7, 0)
        nv.nvmlEventSetFree(es)


# Events -----------------------------------------------------------------------------------------------------------

def test_events(nv: Any, node: StandinNode) -> None:
    node.set(1, xid_events=[13])  # present before registration: history
    es = nv.nvmlEventSetCreate()
    other = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(handle(1), 0x8 | 0x2 | 0x8000, es)
    nv.nvmlDeviceRegisterEvents(handle(1), 0x2, other)
    assert code(nv.nvmlEventSetWait_v2, es, 20) == nv.NVML_ERROR_TIMEOUT
    node.set(1, xid_events=[13, 79, 48])
    got = [nv.nvmlEventSetWait_v2(es, 1000) for _ in range(2)]
    assert [(e.eventType, e.eventData, e.gpuInstanceId) for e in got] == [(8, 79, 0xFFFFFFFF), (8, 48, 0xFFFFFFFF)]
    assert ctypes.addressof(got[0].device.contents) == ctypes.addressof(handle(1).contents)
    node.set(1, ecc_uncorrected_volatile=1, recovery_action="gpu_reset", lost=True)  # lost: 0x4000 not registered
    got = [nv.nvmlEventSetWait_v2(es, 1000) for _ in range(2)]
    assert sorted((e.eventType, e.eventData) for e in got) == [(0x2, 0), (0x8000, 1)]
    assert code(nv.nvmlEventSetWait_v2, es, 0) == nv.NVML_ERROR_TIMEOUT
    assert nv.nvmlEventSetWait_v2(other, 0).eventType == 0x2  # each set its own queue
    assert code(nv.nvmlDeviceRegisterEvents, handle(0), 0x10, es) == nv.NVML_ERROR_NOT_SUPPORTED
    nv.nvmlEventSetFree(other)
    nv.nvmlEventSetFree(es)


def test_event_wait_wakes_on_rewrite(nv: Any, node: StandinNode) -> None:
    es = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(handle(3), 0x8, es)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(nv.nvmlEventSetWait_v2(es, 30_000)))
    waiter.start()
    # The waiter holds no lock while blocked: other calls go on meanwhile.
    assert nv.nvmlDeviceGetTemperature(handle(3), 0) == 40
    node.set(3, xid_events=[94])
    waiter.join(10)
    assert not waiter.is_alive()
    assert got[0].eventData == 94
    nv.nvmlEventSetFree(es)


# Hangs and crashes ------------------------------------------------------------------------------------------------

def test_hang_until_rewritten(nv: Any, node: StandinNode) -> None:
    node.nvml(0, hang=["nvmlDeviceGetTemperature"])
    h = handle(0)
    got: list[int] = []
    caller = threading.Thread(target=lambda: got.append(nv.nvmlDeviceGetTemperature(h, 0)))
    caller.start()
    caller.join(0.3)
    assert caller.is_alive(), "the call should hang while the node file names it"
    assert nv.nvmlDeviceGetTemperature(handle(1), 0) == 40  # other GPUs answer meanwhile
    node.nvml(0, hang=None)
    caller.join(10)
    assert not caller.is_alive()
    assert got == [40]


def test_crash_in_subprocess(node: StandinNode) -> None:
    node.nvml(0, crash=["nvmlDeviceGetTemperature"])
    script = "import pynvml as n; n.nvmlInit(); n.nvmlDeviceGetTemperature(n.nvmlDeviceGetHandleByIndex(0), 0)"
    proc = subprocess.run([sys.executable, "-c", script], env=standin.env_for_subprocess(node.path),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGSEGV, proc.stderr


def test_subprocess_sees_the_standin(node: StandinNode) -> None:
    script = "import pynvml as n; n.nvmlInit(); print(n.nvmlDeviceGetCount(), n.nvmlSystemGetDriverVersion())"
    proc = subprocess.run([sys.executable, "-c", script], env=standin.env_for_subprocess(node.path),
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["8", "570.124.06"], proc.stderr


# Misuse -----------------------------------------------------------------------------------------------------------

def test_fabric_struct_by_value_is_a_violation(nv: Any) -> None:
    h = handle(0)
    result = code(nv.nvmlDeviceGetGpuFabricInfoV, h, fabric_info_v3())  # the backend's bug
    assert result != 0
    found = standin.violations()
    assert len(found) == 1 and "nvmlDeviceGetGpuFabricInfoV" in found[0]
    standin.reset_violations()
    info = fabric_info_v3()
    nv.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
    assert info.healthSummary == 1


def test_wrong_struct_version(nv: Any) -> None:
    assert code(nv.nvmlDeviceGetMemoryInfo, handle(0), 0x1000028) == nv.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    info = fabric_info_v3()
    info.version = 0x4000030
    assert code(nv.nvmlDeviceGetGpuFabricInfoV, handle(0), ctypes.byref(info)) == \
        nv.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    found = standin.violations()
    assert len(found) == 2
    assert "nvmlDeviceGetMemoryInfo_v2: memory: version 0x1000028" in found[0]
    standin.reset_violations()


def test_a_missing_argument_is_a_violation(nv: Any) -> None:
    """A wrapper that drops an argument moves the next one into its slot: the output pointer lands where nvml.h wants
    an enum, and the real library would read or write through whatever the missing register held."""
    lib = standin._library()
    h = handle(0)
    count, temp = ctypes.c_ulonglong(), ctypes.c_uint()
    # Whichever check meets it first (the leftover register as the output pointer, or the pointer as the enum), the
    # call is refused and recorded, never served.
    calls = [("nvmlDeviceGetTotalEccErrors", (h, 1, ctypes.byref(count)), ("counterType", "eccCounts")),
             ("nvmlDeviceGetNvLinkErrorCounter", (h, 0, ctypes.byref(count)), ("counter", "counterValue")),
             ("nvmlDeviceGetTemperature", (h, ctypes.byref(temp)), ("sensorType", "temp"))]
    for name, args, slots in calls:
        standin.reset_violations()
        result = getattr(lib, name)(*args)
        found = standin.violations()
        standin.reset_violations()
        assert result == pynvml.NVML_ERROR_INVALID_ARGUMENT, name
        assert len(found) == 1 and found[0].startswith(tuple(f"{name}: {slot}: " for slot in slots)), found


def test_foreign_handle_and_bad_pointer(nv: Any) -> None:
    fake = ctypes.c_int(0)
    bogus = ctypes.cast(ctypes.pointer(fake), nv.c_nvmlDevice_t)
    assert code(nv.nvmlDeviceGetTemperature, bogus, 0) == nv.NVML_ERROR_INVALID_ARGUMENT
    assert nv.nvmlLib.nvmlDeviceGetCount_v2(ctypes.c_void_p(0x10)) == nv.NVML_ERROR_INVALID_ARGUMENT
    assert nv.nvmlLib.nvmlDeviceGetCount_v2(None) == nv.NVML_ERROR_INVALID_ARGUMENT
    freed = nv.nvmlEventSetCreate()
    nv.nvmlEventSetFree(freed)
    assert code(nv.nvmlEventSetWait_v2, freed, 0) == nv.NVML_ERROR_INVALID_ARGUMENT
    found = standin.violations()
    assert len(found) == 4
    assert "nvmlDeviceGetTemperature: device" in found[0]
    assert "nvmlDeviceGetCount_v2: deviceCount: 0x10 is not valid memory" in found[1]
    assert "nvmlDeviceGetCount_v2: deviceCount: NULL" in found[2]
    assert "nvmlEventSetWait_v2: set" in found[3] and "freed" in found[3]
    standin.reset_violations()


def test_uninitialized_and_refcount(node: StandinNode) -> None:
    with standin.use_node(node.path):
        pynvml.nvmlInit()
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        assert pynvml.nvmlDeviceGetCount() == 8  # one init still holds
        pynvml.nvmlShutdown()
    assert code(pynvml.nvmlDeviceGetCount) == pynvml.NVML_ERROR_UNINITIALIZED
    assert code(pynvml.nvmlShutdown) == pynvml.NVML_ERROR_UNINITIALIZED


def test_init_fails_without_a_good_file(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"gpus": [{"uuid": "GPU-a", "index": "zero"}]}')
    with standin.use_node(bad):
        assert code(pynvml.nvmlInit) == pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert "gpus[0] (GPU-a).index: expected an integer" in capfd.readouterr().err
    bad.write_text("{nope")
    with standin.use_node(bad):
        assert code(pynvml.nvmlInit) == pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert "line 1, column 2" in capfd.readouterr().err
    with standin.use_node(tmp_path / "missing.json"):
        assert code(pynvml.nvmlInit) == pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    with standin.use_node(""):
        assert code(pynvml.nvmlInit) == pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert standin.ENV_NODE in capfd.readouterr().err


def test_call_counts(nv: Any) -> None:
    standin.reset_call_counts()
    for i in range(3):
        nv.nvmlDeviceGetTemperature(handle(i), 0)
    assert standin.call_count("nvmlDeviceGetTemperature") == 3
    assert standin.call_count("nvmlDeviceGetHandleByIndex_v2") == 3
    assert standin.call_count("nvmlNoSuchFunction") == 0


def test_backend_discovers_the_standin_node(node: StandinNode) -> None:
    from plugin.devices.nvml import NvmlBackend

    with standin.use_node(node.path):
        backend = NvmlBackend()
        try:
            gpus = backend.discover().gpus
        finally:
            backend.close()
    assert [g.uuid for g in gpus] == node.uuids
    assert gpus[0].nvlink_peers == (1, 2, 3)
    assert gpus[0].pcie_switch == gpus[1].pcie_switch != gpus[2].pcie_switch
    assert gpus[5].numa_node == 1
    standin.reset_violations()


def test_compute_processes_come_as_the_driver_gives_them(nv: Any, node: StandinNode) -> None:
    """pynvml asks with no room first (INSUFFICIENT_SIZE and the count), then with room; a name is asked per PID."""
    node.set(3, compute_processes=[{"pid": 4242, "used_mib": 2048, "name": "/opt/conda/bin/python3"}, {"pid": 77}])
    node.nvml(None)  # rewrite: the stand-in reads the node file at the next call
    h3 = handle(3)
    procs = nv.nvmlDeviceGetComputeRunningProcesses(h3)
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(4242, 2048 << 20), (77, None)]
    assert nv.nvmlDeviceGetComputeRunningProcesses(handle(2)) == []
    name = nv.nvmlSystemGetProcessName(4242)
    assert (name.decode() if isinstance(name, bytes) else name) == "/opt/conda/bin/python3"
    assert code(nv.nvmlSystemGetProcessName, 77) == nv.NVML_ERROR_NOT_FOUND  # no name given
    assert code(nv.nvmlSystemGetProcessName, 999) == nv.NVML_ERROR_NOT_FOUND
