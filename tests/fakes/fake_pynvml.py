"""A hand-written stand-in for the ``pynvml`` module: the subset of functions the NVML backend calls, over a table of
per-GPU values, with a switch to make any call fail with any NVML error code. It sits at the edge: the real backend
code runs unchanged against it."""

from __future__ import annotations

import ctypes
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_UNKNOWN = 999
NVML_NVLINK_MAX_LINKS = 4
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230

ERROR_CODES = {
    "uninitialized": NVML_ERROR_UNINITIALIZED,
    "not_supported": NVML_ERROR_NOT_SUPPORTED,
    "function_not_found": NVML_ERROR_FUNCTION_NOT_FOUND,
    "gpu_is_lost": NVML_ERROR_GPU_IS_LOST,
    "reset_required": NVML_ERROR_RESET_REQUIRED,
    "unknown": NVML_ERROR_UNKNOWN,
}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {v: k for k, v in ERROR_CODES.items()}.get(self.value, f"NVML error {self.value}")


@dataclass
class FakeGpu:
    uuid: str
    bus_id: str
    name: str = "NVIDIA H100 80GB HBM3"
    minor: int = 0
    numa: int = 0
    memory: int = 80 * 1024**3
    ecc: dict[tuple[int, int], int] = field(default_factory=lambda: {(1, 0): 0, (0, 0): 0, (1, 1): 0, (0, 1): 0})
    remap: tuple[int, int, int, int] = (0, 0, 0, 0)
    retired_pending: int = 0
    retired: dict[int, list[int]] = field(default_factory=lambda: {0: [], 1: []})
    temperature: int = 40
    thresholds: dict[int, int] = field(default_factory=lambda: {0: 92, 1: 87})
    clocks: int = 0
    pcie: tuple[int, int, int, int] = (5, 16, 5, 16)  # cur gen, cur width, max gen, max width
    replay: int = 0
    nvlinks: dict[int, tuple[int, str]] = field(default_factory=dict)  # link -> (state, remote bus id)
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)
    recovery: int = 0
    fabric: int | None = None
    mig: list[dict[str, Any]] = field(default_factory=list)


class FakeFieldValue:
    def __init__(self, ret: int, value: int) -> None:
        self.nvmlReturn = ret
        self.value = SimpleNamespace(uiVal=value)


class FakeFabricInfo(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("state", ctypes.c_uint), ("healthSummary", ctypes.c_uint8)]


class FakeNvml:
    """Use as the ``nvml`` argument of NvmlBackend. ``fail[(function, uuid or None)] = error name``."""

    NVMLError = NVMLError
    NVML_NVLINK_MAX_LINKS = NVML_NVLINK_MAX_LINKS
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = NVML_FI_DEV_GET_GPU_RECOVERY_ACTION

    def __init__(self, gpus: list[FakeGpu], topology: dict[tuple[int, int], int] | None = None,
                 init_error: str | None = None) -> None:
        self.gpus = gpus
        self.topology = topology or {}
        self.init_error = init_error
        self.fail: dict[tuple[str, str | None], str] = {}
        self.calls: deque[str] = deque(maxlen=1000)  # recent calls only: benchmarks make millions
        self.events: queue.SimpleQueue[SimpleNamespace] = queue.SimpleQueue()
        self.registered: dict[str, int] = {}
        self.c_nvmlGpuFabricInfo_v3_t = FakeFabricInfo
        # Event-set lifetime, checked the way the driver library would crash on it: freeing a set while a thread
        # waits on it, waiting on a freed set, freeing twice, or shutting NVML down under a waiter.
        self.misuse: list[str] = []
        self.freed: set[str] = set()
        self.waits_in_flight = 0
        self.wait_entered = threading.Event()  # set when a wait begins
        self.hold_waits: threading.Event | None = None  # when given, a wait blocks until it is set, then times out
        self._life = threading.Lock()

    # Plumbing -------------------------------------------------------------------------------------------------

    def _check(self, fn: str, handle: Any = None) -> FakeGpu | None:
        self.calls.append(fn)
        gpu = self._gpu(handle) if handle is not None else None
        for key in ((fn, gpu.uuid if gpu else None), (fn, None)):
            if key in self.fail:
                raise NVMLError(ERROR_CODES[self.fail[key]])
        return gpu

    def _gpu(self, handle: Any) -> FakeGpu:
        if isinstance(handle, tuple):  # a MIG handle: (parent index, slot)
            return self.gpus[handle[0]]
        return self.gpus[handle]

    def inject_event(self, index: int, event_type: int, data: int, gi: int = 0xFFFFFFFF) -> None:
        self.events.put(SimpleNamespace(device=index, eventType=event_type, eventData=data, gpuInstanceId=gi,
                                        computeInstanceId=0xFFFFFFFF))

    # The functions the backend calls ----------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error:
            raise NVMLError(ERROR_CODES.get(self.init_error, NVML_ERROR_LIBRARY_NOT_FOUND))

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")
        with self._life:
            if self.waits_in_flight:
                self.misuse.append("nvmlShutdown while an event wait is in progress")

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return "570.86.15"

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        self._check("nvmlDeviceGetHandleByIndex")
        return i

    def nvmlDeviceGetUUID(self, h: Any) -> str:
        g = self._check("nvmlDeviceGetUUID", h)
        assert g is not None
        if isinstance(h, tuple):
            return str(g.mig[h[1]]["uuid"])
        return g.uuid

    def nvmlDeviceGetName(self, h: Any) -> bytes:
        g = self._check("nvmlDeviceGetName", h)
        assert g is not None
        if isinstance(h, tuple):
            return f"{g.name} MIG {g.mig[h[1]]['profile']}".encode()
        return g.name.encode()  # old bindings return bytes; the backend accepts both

    def nvmlDeviceGetMinorNumber(self, h: Any) -> int:
        g = self._check("nvmlDeviceGetMinorNumber", h)
        assert g is not None
        return g.minor

    def nvmlDeviceGetPciInfo_v3(self, h: Any) -> Any:
        g = self._check("nvmlDeviceGetPciInfo_v3", h)
        assert g is not None
        return SimpleNamespace(busId=g.bus_id)

    def nvmlDeviceGetNumaNodeId(self, h: Any) -> int:
        g = self._check("nvmlDeviceGetNumaNodeId", h)
        assert g is not None
        return g.numa

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        g = self._check("nvmlDeviceGetMemoryInfo", h)
        assert g is not None
        return SimpleNamespace(total=g.memory)

    def nvmlDeviceGetTemperatureThreshold(self, h: Any, kind: int) -> int:
        g = self._check("nvmlDeviceGetTemperatureThreshold", h)
        assert g is not None
        return g.thresholds[kind]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: Any) -> int:
        g = self._check("nvmlDeviceGetMaxPcieLinkGeneration", h)
        assert g is not None
        return g.pcie[2]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: Any) -> int:
        g = self._check("nvmlDeviceGetMaxPcieLinkWidth", h)
        assert g is not None
        return g.pcie[3]

    def nvmlDeviceGetMigMode(self, h: Any) -> tuple[int, int]:
        g = self._check("nvmlDeviceGetMigMode", h)
        assert g is not None
        return (1, 1) if g.mig else (0, 0)

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Any) -> int:
        self._check("nvmlDeviceGetMaxMigDeviceCount", h)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Any, i: int) -> tuple[int, int]:
        g = self._check("nvmlDeviceGetMigDeviceHandleByIndex", h)
        assert g is not None
        if i >= len(g.mig):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return (h, i)

    def nvmlDeviceGetGpuInstanceId(self, h: Any) -> int:
        g = self._check("nvmlDeviceGetGpuInstanceId", h)
        assert g is not None
        return int(g.mig[h[1]]["gi"])

    def nvmlDeviceGetComputeInstanceId(self, h: Any) -> int:
        self._check("nvmlDeviceGetComputeInstanceId", h)
        return 0

    def nvmlDeviceGetNvLinkState(self, h: Any, link: int) -> int:
        g = self._check("nvmlDeviceGetNvLinkState", h)
        assert g is not None
        if link not in g.nvlinks:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return g.nvlinks[link][0]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: Any, link: int) -> Any:
        g = self._check("nvmlDeviceGetNvLinkRemotePciInfo", h)
        assert g is not None
        return SimpleNamespace(busId=g.nvlinks[link][1])

    def nvmlDeviceGetNvLinkErrorCounter(self, h: Any, link: int, counter: int) -> int:
        g = self._check("nvmlDeviceGetNvLinkErrorCounter", h)
        assert g is not None
        return g.nvlink_errors.get((link, counter), 0)

    def nvmlDeviceGetTopologyCommonAncestor(self, a: Any, b: Any) -> int:
        self._check("nvmlDeviceGetTopologyCommonAncestor", a)
        return self.topology.get((min(a, b), max(a, b)), 50)

    def nvmlDeviceGetTotalEccErrors(self, h: Any, etype: int, counter: int) -> int:
        g = self._check("nvmlDeviceGetTotalEccErrors", h)
        assert g is not None
        return g.ecc[(etype, counter)]

    def nvmlDeviceGetRemappedRows(self, h: Any) -> tuple[int, int, int, int]:
        g = self._check("nvmlDeviceGetRemappedRows", h)
        assert g is not None
        return g.remap

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: Any) -> int:
        g = self._check("nvmlDeviceGetRetiredPagesPendingStatus", h)
        assert g is not None
        return g.retired_pending

    def nvmlDeviceGetRetiredPages(self, h: Any, cause: int) -> list[int]:
        g = self._check("nvmlDeviceGetRetiredPages", h)
        assert g is not None
        return g.retired[cause]

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        g = self._check("nvmlDeviceGetTemperature", h)
        assert g is not None
        return g.temperature

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int:
        g = self._check("nvmlDeviceGetCurrentClocksEventReasons", h)
        assert g is not None
        return g.clocks

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: Any) -> int:
        g = self._check("nvmlDeviceGetCurrentClocksThrottleReasons", h)
        assert g is not None
        return g.clocks

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: Any) -> int:
        g = self._check("nvmlDeviceGetCurrPcieLinkGeneration", h)
        assert g is not None
        return g.pcie[0]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: Any) -> int:
        g = self._check("nvmlDeviceGetCurrPcieLinkWidth", h)
        assert g is not None
        return g.pcie[1]

    def nvmlDeviceGetPcieReplayCounter(self, h: Any) -> int:
        g = self._check("nvmlDeviceGetPcieReplayCounter", h)
        assert g is not None
        return g.replay

    def nvmlDeviceGetFieldValues(self, h: Any, fields: list[Any]) -> list[FakeFieldValue]:
        """The fields the backend asks for, each answered on its own as NVML does; any other: NOT_SUPPORTED."""
        g = self._check("nvmlDeviceGetFieldValues", h)
        assert g is not None
        out = []
        for f in fields:
            fid, scope = f if isinstance(f, tuple) else (f, 0)
            if fid == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
                out.append(FakeFieldValue(0, g.recovery))
            elif fid == 165:  # NVLink state of link ``scope``
                link = g.nvlinks.get(scope)
                out.append(FakeFieldValue(0, link[0]) if link else FakeFieldValue(NVML_ERROR_NOT_SUPPORTED, 0))
            elif fid in (52, 59, 38, 45):  # replay, recovery, CRC flit, CRC data totals
                counter = {52: 0, 59: 1, 38: 2, 45: 3}[fid]
                out.append(FakeFieldValue(0, sum(v for (_, c), v in g.nvlink_errors.items() if c == counter)))
            else:
                out.append(FakeFieldValue(NVML_ERROR_NOT_SUPPORTED, 0))
        return out

    def nvmlDeviceGetGpuFabricInfoV(self, h: Any, ref: Any) -> int:
        g = self._check("nvmlDeviceGetGpuFabricInfoV", h)
        assert g is not None
        info = ref._obj  # nvml.h takes a pointer: the backend must pass byref(info)
        if g.fabric is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        info.healthSummary = g.fabric
        return 0

    def nvmlEventSetCreate(self) -> str:
        self._check("nvmlEventSetCreate")
        return "event-set"

    def nvmlDeviceGetSupportedEventTypes(self, h: Any) -> int:
        self._check("nvmlDeviceGetSupportedEventTypes", h)
        return 0x8 | 0x2 | 0x1 | 0x4000 | 0x8000

    def nvmlDeviceRegisterEvents(self, h: Any, mask: int, event_set: str) -> None:
        g = self._check("nvmlDeviceRegisterEvents", h)
        assert g is not None
        self.registered[g.uuid] = mask

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        self._check("nvmlEventSetWait_v2")
        with self._life:
            if event_set in self.freed:
                self.misuse.append("nvmlEventSetWait_v2 on a freed event set")
            self.waits_in_flight += 1
        self.wait_entered.set()
        try:
            if self.hold_waits is not None:
                self.hold_waits.wait()
                raise NVMLError(NVML_ERROR_TIMEOUT)
            return self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError(NVML_ERROR_TIMEOUT) from None
        finally:
            with self._life:
                self.waits_in_flight -= 1

    def nvmlEventSetFree(self, event_set: str) -> None:
        self._check("nvmlEventSetFree")
        with self._life:
            if self.waits_in_flight:
                self.misuse.append("nvmlEventSetFree while a wait on it is in progress")
            if event_set in self.freed:
                self.misuse.append("nvmlEventSetFree of a freed event set")
            self.freed.add(event_set)


def eight_gpu_node() -> FakeNvml:
    """Two NVLink islands of four, one PCIe switch per pair, NUMA 0 and 1."""
    gpus = []
    for i in range(8):
        island = range(0, 4) if i < 4 else range(4, 8)
        peers = [p for p in island if p != i]
        gpus.append(FakeGpu(uuid=f"GPU-fake-{i}", bus_id=f"00000000:{0x18 + i:02X}:00.0", minor=i,
                            numa=0 if i < 4 else 1,
                            nvlinks={n: (1, f"00000000:{0x18 + p:02X}:00.0") for n, p in enumerate(peers)}))
    topology = {(a, a + 1): 10 for a in range(0, 8, 2)}  # a shared PCIe switch per pair
    return FakeNvml(gpus, topology)
