"""The NVML backend: the only module that imports ``pynvml``.

Every call on a device goes through ``_call``, which sorts NVML's answers (docs/nvml-calls.md holds the table, and a
test holds the table to ``ANSWERS`` here):

- a value;
- *absent*: this GPU, driver or binding has no such signal (NOT_SUPPORTED, FUNCTION_NOT_FOUND, NOT_FOUND,
  ARGUMENT_VERSION_MISMATCH, NO_PERMISSION, and INVALID_ARGUMENT where it marks a link slot past the GPU's links).
  Absent is never a fault: the check is off for that GPU and ``inspect`` says why;
- the GPU is lost (GPU_IS_LOST) or needs a reset (RESET_REQUIRED);
- a generic error (TIMEOUT, UNKNOWN, anything else), recorded against that device and signal alone.

Nothing here raises out of ``read``. pynvml's wrappers pass their arguments to the C library as they are given, so
anything nvml.h takes by pointer is handed over with ``byref`` here; handles are opaque ``POINTER`` objects that
compare by address, never with ``==``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from plugin.devices.backend import BackendError
from plugin.devices.memory import NvmlMemory
from plugin.devices.model import ComputeProcess, Discovery, EventKind, Gpu, GpuEvent, MigDevice, Reading

log = logging.getLogger(__name__)

# NVML return codes (nvml.h); compared by value so a hand-written fake module needs only NVMLError.value.
SUCCESS = 0
ERR_UNINITIALIZED = 1
ERR_INVALID_ARGUMENT = 2
ERR_NOT_SUPPORTED = 3
ERR_NO_PERMISSION = 4
ERR_NOT_FOUND = 6
ERR_TIMEOUT = 10
ERR_LIBRARY_NOT_FOUND = 12
ERR_FUNCTION_NOT_FOUND = 13
ERR_GPU_IS_LOST = 15
ERR_RESET_REQUIRED = 16
ERR_ARGUMENT_VERSION_MISMATCH = 25
ERR_UNKNOWN = 999

# What each answer means for health; docs/nvml-calls.md states the same, and tests/unit/test_nvml_calls_doc.py
# holds the two together.
ANSWERS: dict[int, tuple[str, str]] = {
    SUCCESS: ("value", "the reading"),
    ERR_NOT_SUPPORTED: ("absent", "this GPU has no such signal: the check is off, the GPU's state is unchanged"),
    ERR_FUNCTION_NOT_FOUND: ("absent", "the driver or binding is older than the call: the check is off"),
    ERR_NOT_FOUND: ("absent", "no such object (an empty MIG slot): skipped"),
    ERR_ARGUMENT_VERSION_MISMATCH: ("absent", "the driver does not know this structure version: the check is off"),
    ERR_NO_PERMISSION: ("absent", "the plugin may not read it (container privileges): the check is off, "
                                  "and inspect says so"),
    ERR_INVALID_ARGUMENT: ("absent/error", "a link slot past the GPU's links: absent; anywhere else an error"),
    ERR_GPU_IS_LOST: ("lost", "gpu-lost, Unhealthy"),
    ERR_RESET_REQUIRED: ("reset", "reset-required, Unhealthy"),
    ERR_TIMEOUT: ("error", "an error against that signal; nvml-error (Unknown) after nvmlErrorPolls polls"),
    ERR_UNKNOWN: ("error", "an error against that signal; nvml-error (Unknown) after nvmlErrorPolls polls"),
}
ABSENT = {code for code, (kind, _) in ANSWERS.items() if kind == "absent"}

EV_SBE = 0x1
EV_DBE = 0x2
EV_XID = 0x8
EV_GPU_UNAVAILABLE = 0x4000
EV_RECOVERY_ACTION = 0x8000
WANTED_EVENTS = EV_XID | EV_DBE | EV_GPU_UNAVAILABLE | EV_RECOVERY_ACTION
WHOLE_GPU = 0xFFFFFFFF

CLOCK_BITS = {0x8: "hw_slowdown", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
              0x80: "hw_power_brake_slowdown"}
CLOCK_IDLE = 0x1
# nvml.h's nvmlGpuRecoveryAction_t; a value past these reads as "unknown", never as "none".
RECOVERY = {0: "none", 1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p", 4: "drain_and_reset",
            5: "recover_imex_domain", 6: "bus_reset", 7: "system_reboot"}
FABRIC = {1: "healthy", 2: "unhealthy", 3: "limited_capacity"}
FABRIC_STATE = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
FABRIC_INFO_V3 = 0x3000028  # nvmlGpuFabricInfo_v3: sizeof(nvmlGpuFabricInfo_v3_t) | 3 << 24
ARCH = {2: "Kepler", 3: "Maxwell", 4: "Pascal", 5: "Volta", 6: "Turing", 7: "Ampere", 8: "Ada", 9: "Hopper",
        10: "Blackwell", 13: "Rubin"}

# Field ids (nvml.h): one nvmlDeviceGetFieldValues call per GPU per poll reads what used to take a state call and four
# counter calls per link.
FI_NVLINK_CRC_FLIT_TOTAL = 38
FI_NVLINK_CRC_DATA_TOTAL = 45
FI_NVLINK_REPLAY_TOTAL = 52
FI_NVLINK_RECOVERY_TOTAL = 59
FI_NVLINK_LINK_COUNT = 91
FI_NVLINK_GET_STATE = 165
FI_RECOVERY_ACTION = 230
TOPOLOGY_MULTIPLE = 20  # common ancestor at or below a PCIe switch (possibly several)

# nvml.h's nvmlValueType_t -> the member of nvmlValue_t that holds it.
VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

SIGNALS = ("ecc", "row_remap", "retired_pages", "temperature", "clocks", "pcie", "fields", "fabric")


class _FabricInfoV3(ctypes.Structure):
    """nvml.h's nvmlGpuFabricInfo_v3_t, for bindings older than 13.580 that lack it (12.560 has only v2)."""

    _fields_ = [("version", ctypes.c_uint), ("clusterUuid", ctypes.c_uint8 * 16), ("status", ctypes.c_int),
                ("cliqueId", ctypes.c_uint32), ("state", ctypes.c_uint8), ("healthMask", ctypes.c_uint32),
                ("healthSummary", ctypes.c_uint8)]


class _Absent(Exception):
    def __init__(self, fn: str, why: str) -> None:
        super().__init__(f"{fn}: {why}")
        self.why = why


class _Lost(Exception):
    pass


class _ResetRequired(Exception):
    pass


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def handle_key(handle: Any) -> int | None:
    """An NVML handle's identity: the address it points at. Two ``POINTER`` objects to one device are unequal under
    ``==`` and have no ``.value``; a fake binding's plain ints are their own key."""
    if isinstance(handle, int):
        return handle
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


def field_int(v: Any) -> int:
    """The integer in a ``c_nvmlFieldValue_t`` by its ``valueType``."""
    raw = getattr(v, "value", None)
    if raw is None:
        return 0
    member = VALUE_MEMBER.get(int(getattr(v, "valueType", 1)), "uiVal")
    return int(getattr(raw, member, getattr(raw, "uiVal", 0)) or 0)


def _why(code: int | None) -> str:
    return {ERR_NOT_SUPPORTED: "not supported by this GPU", ERR_FUNCTION_NOT_FOUND: "not in this driver or binding",
            ERR_NOT_FOUND: "not found", ERR_ARGUMENT_VERSION_MISMATCH: "structure version unknown to this driver",
            ERR_NO_PERMISSION: "no permission", ERR_INVALID_ARGUMENT: "no such link"}.get(
                code or 0, f"NVML error {code}")


class NvmlBackend:
    name = "nvml"

    def __init__(self, nvml: ModuleType | Any | None = None, max_links: int | None = None,
                 state_dir: Path | None = None, read_only: bool = False) -> None:
        if nvml is None:
            try:
                import pynvml as nvml_mod
            except ImportError as exc:  # the package itself is missing
                raise BackendError(f"pynvml (nvidia-ml-py) is not installed: {exc}") from exc
            nvml = nvml_mod
        self.nv = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            hint = " (libnvidia-ml.so not found: is the NVIDIA driver installed and mounted?)" \
                if code == ERR_LIBRARY_NOT_FOUND else ""
            raise BackendError(f"nvmlInit failed: {exc}{hint}") from exc
        except OSError as exc:
            raise BackendError(f"nvmlInit failed: {exc}") from exc
        self.max_links = max_links if max_links is not None else int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
        self.memory = NvmlMemory(state_dir, read_only=read_only)
        self.driver = ""
        # The call a read is in, for the monitor's message when one hangs (a plain attribute: one writer).
        self.current_call: str | None = None
        self._handles: dict[str, Any] = {}
        self._uuid_by_key: dict[int, str] = {}
        self._links: dict[str, tuple[int, ...]] = {}  # every link slot that answers, active or not
        self._links_by_field: dict[str, bool] = {}
        self._static: dict[str, dict[str, Any]] = {}
        self._mig_by_gi: dict[tuple[str, int], str] = {}
        # Per GPU and signal: "on", or why it is off. Written by the poll thread, read by inspect and metrics.
        self._checks: dict[str, dict[str, str]] = {}
        self._proven: set[tuple[str, str]] = set()  # (signal, model) that returned once in this process
        # Guards the error counter: the poll thread and the event thread both fail calls, and metrics reads it.
        self._errors_lock = threading.Lock()
        self._call_errors = 0
        # Guards the event set's life: close() may come while the event thread sits in nvmlEventSetWait on it,
        # and freeing a set under a waiter is a use-after-free in the driver library. Whoever is last out frees.
        self._event_lock = threading.Lock()
        self._event_set: Any = None
        self._event_masks: dict[str, int] = {}
        self._waiting = False
        self._closed = False
        self._released = False
        self._discovery = self._discover()
        self._setup_events()

    # Call discipline ------------------------------------------------------------------------------------------

    def _call(self, fn_name: str, *args: Any, past_end: bool = False, normal: frozenset[int] = frozenset()) -> Any:
        """One NVML call. ``past_end``: INVALID_ARGUMENT means "no such link", not a mistake of ours; ``normal``:
        codes that are an ordinary answer of this call (raised, never counted as errors)."""
        fn = getattr(self.nv, fn_name, None)
        if fn is None:
            raise _Absent(fn_name, _why(ERR_FUNCTION_NOT_FOUND))
        try:
            return fn(*args)
        except self.nv.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in ABSENT or (past_end and code == ERR_INVALID_ARGUMENT):
                raise _Absent(fn_name, _why(code)) from exc
            if code == ERR_GPU_IS_LOST:
                raise _Lost(fn_name) from exc
            if code == ERR_RESET_REQUIRED:
                raise _ResetRequired(fn_name) from exc
            if code in normal:
                raise
            with self._errors_lock:
                self._call_errors += 1
            raise

    @property
    def call_errors(self) -> int:
        """NVML calls that failed with a generic error (absent signals, lost and reset-required excluded)."""
        with self._errors_lock:
            return self._call_errors

    def _opt(self, fn_name: str, *args: Any) -> Any:
        """A value, or None where the signal does not exist; other errors propagate."""
        try:
            return self._call(fn_name, *args)
        except _Absent:
            return None

    def _safe(self, fn_name: str, *args: Any) -> Any:
        """A value, or None for any failure: for facts that only describe a GPU."""
        try:
            return self._call(fn_name, *args)
        except (self.nv.NVMLError, _Absent, _Lost, _ResetRequired):
            return None

    @contextmanager
    def _guard(self, signal: str, model: str, call: str) -> Iterator[None]:
        """The first call of a signal on a GPU model in this process runs under a marker in the state dir, so a
        crash inside the library is known at the next start (NvmlMemory)."""
        key = (signal, model)
        if key in self._proven:
            yield
            return
        with self.memory.inflight(signal, model, self.driver, call):
            yield
        self._proven.add(key)

    def _skipped(self, signal: str, model: str) -> dict[str, Any] | None:
        return self.memory.crashed(signal, model, self.driver)

    # Discovery ------------------------------------------------------------------------------------------------

    def _discover(self) -> Discovery:
        try:
            count = self._call("nvmlDeviceGetCount")
            self.driver = _text(self._opt("nvmlSystemGetDriverVersion") or "")
        except (self.nv.NVMLError, _Lost, _ResetRequired, _Absent) as exc:
            return Discovery(error=f"device enumeration failed: {exc}")
        found: list[tuple[Gpu, Any, str]] = []
        for index in range(count):
            try:
                h = self._call("nvmlDeviceGetHandleByIndex", index)
                uuid = _text(self._call("nvmlDeviceGetUUID", h))
            except (self.nv.NVMLError, _Lost, _ResetRequired, _Absent) as exc:
                # A GPU we cannot even name cannot be advertised; the others still can.
                log.error("GPU index %d cannot be read at discovery (%s); not advertised", index, exc)
                continue
            gpu, bus = self._describe(index, h, uuid)
            found.append((gpu, h, bus))
            key = handle_key(h)
            if key is not None:
                self._uuid_by_key[key] = uuid
        by_bus = {bus.lower(): g.index for g, _, bus in found if bus}
        switches = self._switch_groups([(g, h) for g, h, _ in found])
        gpus = []
        for g, h, _ in found:
            peers = self._nvlink_peers(g, h, by_bus)
            gpus.append(Gpu(uuid=g.uuid, index=g.index, name=g.name, minor=g.minor, numa_node=g.numa_node,
                            memory_mib=g.memory_mib, pci_bus_id=g.pci_bus_id, nvlink_peers=peers,
                            pcie_switch=switches.get(g.uuid), mig_devices=g.mig_devices))
            self._handles[g.uuid] = h
        return Discovery(gpus=tuple(gpus), driver_version=self.driver)

    def _describe(self, index: int, h: Any, uuid: str) -> tuple[Gpu, str]:
        name = _text(self._safe("nvmlDeviceGetName", h) or "NVIDIA GPU")
        minor = self._safe("nvmlDeviceGetMinorNumber", h)
        pci = self._safe("nvmlDeviceGetPciInfo_v3", h) or self._safe("nvmlDeviceGetPciInfo", h)
        bus = _text(getattr(pci, "busId", "") or "") if pci is not None else ""
        numa = self._safe("nvmlDeviceGetNumaNodeId", h)
        if numa is not None and (numa < 0 or numa >= 0xFFFF):
            numa = None
        mem = self._safe("nvmlDeviceGetMemoryInfo", h)
        memory_mib = int(getattr(mem, "total", 0) // (1024 * 1024)) if mem is not None else 0
        ecc = self._safe("nvmlDeviceGetEccMode", h)
        arch = self._safe("nvmlDeviceGetArchitecture", h)
        self._static[uuid] = {
            "name": name,
            "architecture": ARCH.get(int(arch), f"unknown ({arch})") if arch is not None else "unknown",
            "ecc_mode": None if ecc is None else bool(ecc[0]),
            "slowdown": self._safe("nvmlDeviceGetTemperatureThreshold", h, 1),
            "shutdown": self._safe("nvmlDeviceGetTemperatureThreshold", h, 0),
            "max_gen": self._safe("nvmlDeviceGetMaxPcieLinkGeneration", h),
            "max_width": self._safe("nvmlDeviceGetMaxPcieLinkWidth", h),
        }
        self._checks[uuid] = {}
        migs = self._migs(uuid, h)
        return Gpu(uuid=uuid, index=index, name=name, minor=minor, numa_node=numa, memory_mib=memory_mib,
                   pci_bus_id=bus, mig_devices=migs), bus

    def _migs(self, uuid: str, h: Any) -> tuple[MigDevice, ...]:
        try:
            mode = self._opt("nvmlDeviceGetMigMode", h)
            self._static[uuid]["mig_mode"] = None if not mode else bool(mode[0] == 1)
            if not mode or mode[0] != 1:
                return ()
            count = self._call("nvmlDeviceGetMaxMigDeviceCount", h)
        except (self.nv.NVMLError, _Lost, _ResetRequired, _Absent):
            return ()
        out = []
        for i in range(count):
            try:
                mh = self._call("nvmlDeviceGetMigDeviceHandleByIndex", h, i)
            except (self.nv.NVMLError, _Lost, _ResetRequired, _Absent):  # NOT_FOUND: an empty slot
                continue
            try:
                muuid = _text(self._call("nvmlDeviceGetUUID", mh))
                gi = int(self._call("nvmlDeviceGetGpuInstanceId", mh))
                ci = int(self._opt("nvmlDeviceGetComputeInstanceId", mh) or 0)
                mname = _text(self._opt("nvmlDeviceGetName", mh) or "")
                mem = self._opt("nvmlDeviceGetMemoryInfo", mh)
            except (self.nv.NVMLError, _Lost, _ResetRequired, _Absent) as exc:
                log.error("MIG device %d of %s unreadable: %s", i, uuid, exc)
                continue
            profile = mname.split("MIG ", 1)[1].strip() if "MIG " in mname else f"gi{gi}"
            self._mig_by_gi[(uuid, gi)] = muuid
            out.append(MigDevice(uuid=muuid, parent_uuid=uuid, gpu_instance_id=gi, compute_instance_id=ci,
                                 profile=profile,
                                 memory_mib=int(getattr(mem, "total", 0) // (1024 * 1024)) if mem else 0))
        return tuple(out)

    def _link_count(self, h: Any) -> int:
        """How many link slots to probe: the GPU's own count where the driver gives it, else the binding's max."""
        try:
            values = self._call("nvmlDeviceGetFieldValues", h, [FI_NVLINK_LINK_COUNT])
        except (self.nv.NVMLError, _Absent, _Lost, _ResetRequired):
            return self.max_links
        v = values[0]
        if int(getattr(v, "nvmlReturn", ERR_NOT_SUPPORTED)) != SUCCESS:
            return self.max_links
        return min(field_int(v), self.max_links)

    def _nvlink_peers(self, g: Gpu, h: Any, by_bus: dict[str, int]) -> tuple[int, ...]:
        """Probe the link slots: active ones are remembered (a later down is a fault), inactive ones are topology
        until seen active; a slot past the GPU's links ends the probe."""
        uuid = g.uuid
        checks = self._checks[uuid]
        crashed = self._skipped("nvlink", g.name)
        if crashed is not None:
            checks["nvlink"] = f"unavailable: crashed the process in {crashed.get('call') or 'an NVML call'}"
            self._links[uuid] = ()
            return ()
        peers: set[int] = set()
        slots: list[int] = []
        active: list[int] = []
        with self._guard("nvlink", g.name, "nvmlDeviceGetNvLinkState"):
            for link in range(self._link_count(h)):
                try:
                    state = self._call("nvmlDeviceGetNvLinkState", h, link, past_end=True)
                except _Absent as exc:
                    if link == 0:
                        checks["nvlink"] = f"off: NVLink {exc.why}"
                    break
                except (self.nv.NVMLError, _Lost, _ResetRequired) as exc:
                    log.error("GPU %s NVLink %d unreadable at discovery: %s", uuid, link, exc)
                    slots.append(link)  # it answers the poll or counts as an error there
                    continue
                slots.append(link)
                if state != 1:
                    continue
                active.append(link)
                remote = self._safe("nvmlDeviceGetNvLinkRemotePciInfo", h, link)
                peer = by_bus.get(_text(getattr(remote, "busId", "")).lower()) if remote is not None else None
                if peer is not None and peer != g.index:
                    peers.add(peer)
        self.memory.saw_active(uuid, active)
        self._links[uuid] = tuple(slots)
        self._static[uuid]["links_active"] = len(active)
        self._static[uuid]["link_slots"] = len(slots)
        if slots and not active and not self.memory.links_seen(uuid):
            checks["nvlink"] = f"off: no active link among {len(slots)} slots (no NVLink bridge or switch)"
        elif slots:
            checks["nvlink"] = "on"
        return tuple(sorted(peers))

    def _switch_groups(self, gpus: list[tuple[Gpu, Any]]) -> dict[str, str]:
        parent = {g.uuid: g.uuid for g, _ in gpus}

        def find(x: str) -> str:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for i, (ga, ha) in enumerate(gpus):
            for gb, hb in gpus[i + 1:]:
                level = self._safe("nvmlDeviceGetTopologyCommonAncestor", ha, hb)
                if level is not None and int(level) <= TOPOLOGY_MULTIPLE:
                    parent[find(ga.uuid)] = find(gb.uuid)
        groups: dict[str, str] = {}
        out: dict[str, str] = {}
        for g, _ in gpus:
            root = find(g.uuid)
            members = [x for x in parent if find(x) == root]
            if len(members) > 1:
                out[g.uuid] = groups.setdefault(root, f"sw{len(groups)}")
        return out

    def discover(self) -> Discovery:
        return self._discovery

    # Polling --------------------------------------------------------------------------------------------------

    def read(self, gpu: Gpu) -> Reading:
        now = time.time()
        h = self._handles.get(gpu.uuid)
        if h is None:
            return Reading(time=now, lost=True)
        static = self._static.get(gpu.uuid, {})
        values: dict[str, Any] = {
            "model": gpu.name,
            "temperature_slowdown_c": static.get("slowdown"),
            "temperature_shutdown_c": static.get("shutdown"),
            "pcie_max_gen": static.get("max_gen"),
            "pcie_max_width": static.get("max_width"),
        }
        errors: list[tuple[str, str]] = []
        checks = self._checks.setdefault(gpu.uuid, {})
        reset_required = False
        for signal, call, fn in self._readers(gpu.uuid, h):
            if checks.get(signal, "").startswith(("off", "unavailable")):
                continue  # settled for this process: the GPU lacks it, or it crashed the library before
            crashed = None if (signal, gpu.name) in self._proven else self._skipped(signal, gpu.name)
            if crashed is not None:
                checks[signal] = f"unavailable: crashed the process in {crashed.get('call') or call}"
                continue
            self.current_call = call
            try:
                with self._guard(signal, gpu.name, call):
                    got = fn()
                values.update(got)
                if signal not in checks or checks[signal].startswith("error"):
                    checks[signal] = "on"
            except _Absent as exc:
                # Said once per GPU at start, in the what-is-watched lines (app) and by inspect.
                checks[signal] = f"off: {exc}"
            except _Lost:
                self.current_call = None
                return Reading(time=now, lost=True)
            except _ResetRequired:
                reset_required = True
            except self.nv.NVMLError as exc:
                errors.append((signal, str(exc)))
                checks[signal] = f"error: {exc}"
            except Exception as exc:  # a binding quirk must cost one signal, not the poll
                errors.append((signal, f"{type(exc).__name__}: {exc}"))
                checks[signal] = f"error: {type(exc).__name__}: {exc}"
        self.current_call = None
        return Reading(time=now, reset_required=reset_required, errors=tuple(errors), **values)

    def _readers(self, uuid: str, h: Any) -> list[tuple[str, str, Callable[[], dict[str, Any]]]]:
        return [
            ("ecc", "nvmlDeviceGetTotalEccErrors", lambda: self._ecc(uuid, h)),
            ("row_remap", "nvmlDeviceGetRemappedRows", lambda: self._remap(h)),
            ("retired_pages", "nvmlDeviceGetRetiredPages", lambda: self._retired(h)),
            ("temperature", "nvmlDeviceGetTemperature",
             lambda: {"temperature_c": self._call("nvmlDeviceGetTemperature", h, 0)}),
            ("clocks", "nvmlDeviceGetCurrentClocksEventReasons", lambda: self._clocks(h)),
            ("pcie", "nvmlDeviceGetCurrPcieLinkGeneration", lambda: {
                "pcie_gen": self._opt("nvmlDeviceGetCurrPcieLinkGeneration", h),
                "pcie_width": self._opt("nvmlDeviceGetCurrPcieLinkWidth", h),
                "pcie_replay_count": self._opt("nvmlDeviceGetPcieReplayCounter", h),
            }),
            ("fields", "nvmlDeviceGetFieldValues", lambda: self._fields(uuid, h)),
            ("fabric", "nvmlDeviceGetGpuFabricInfoV", lambda: self._fabric(uuid, h)),
            ("processes", "nvmlDeviceGetComputeRunningProcesses", lambda: self._processes(uuid, h)),
        ]

    def _processes(self, uuid: str, h: Any) -> dict[str, Any]:
        """The processes computing on the GPU, each named where NVML can; a GPU in MIG mode lists them per MIG
        device, which this check does not read."""
        if self._static.get(uuid, {}).get("mig_mode"):
            raise _Absent("nvmlDeviceGetComputeRunningProcesses", "the GPU is in MIG mode")
        out = []
        for p in self._call("nvmlDeviceGetComputeRunningProcesses", h) or ():
            pid = int(getattr(p, "pid", 0) or 0)
            if pid <= 0:
                continue
            used = getattr(p, "usedGpuMemory", None)
            name = self._safe("nvmlSystemGetProcessName", pid)
            if isinstance(name, bytes):
                name = name.decode("utf-8", "replace")
            out.append(ComputeProcess(pid, int(used) // (1 << 20) if isinstance(used, int) else None,
                                      str(name or "").rsplit("/", 1)[-1]))
        return {"compute_processes": tuple(out)}

    def _ecc(self, uuid: str, h: Any) -> dict[str, Any]:
        if self._static.get(uuid, {}).get("ecc_mode") is False:
            raise _Absent("nvmlDeviceGetEccMode", "ECC is disabled on this GPU")
        values = {
            "ecc_uncorrected_volatile": self._opt("nvmlDeviceGetTotalEccErrors", h, 1, 0),
            "ecc_corrected_volatile": self._opt("nvmlDeviceGetTotalEccErrors", h, 0, 0),
            "ecc_uncorrected_aggregate": self._opt("nvmlDeviceGetTotalEccErrors", h, 1, 1),
            "ecc_corrected_aggregate": self._opt("nvmlDeviceGetTotalEccErrors", h, 0, 1),
        }
        if all(v is None for v in values.values()):
            raise _Absent("nvmlDeviceGetTotalEccErrors", _why(ERR_NOT_SUPPORTED))
        return values

    def _remap(self, h: Any) -> dict[str, Any]:
        _corr, _unc, pending, failure = self._call("nvmlDeviceGetRemappedRows", h)
        return {"row_remap_pending": bool(pending), "row_remap_failure": bool(failure)}

    def _retired(self, h: Any) -> dict[str, Any]:
        pending = self._call("nvmlDeviceGetRetiredPagesPendingStatus", h)
        count = 0
        for cause in (0, 1):
            pages = self._opt("nvmlDeviceGetRetiredPages", h, cause)
            count += len(pages or ())
        return {"retired_pages_pending": bool(pending), "retired_pages_count": count}

    def _clocks(self, h: Any) -> dict[str, Any]:
        try:
            bits = self._call("nvmlDeviceGetCurrentClocksEventReasons", h)
        except _Absent:
            bits = self._call("nvmlDeviceGetCurrentClocksThrottleReasons", h)
        bits = int(bits)
        return {"clock_event_reasons": frozenset(n for b, n in CLOCK_BITS.items() if bits & b),
                "gpu_idle": bool(bits & CLOCK_IDLE)}

    def _fields(self, uuid: str, h: Any) -> dict[str, Any]:
        """The recovery action, the NVLink error totals and every link's state in one call."""
        links = self._links.get(uuid, ())
        by_field = self._links_by_field.get(uuid, True)
        ids: list[Any] = [FI_RECOVERY_ACTION]
        if links:
            ids += [FI_NVLINK_REPLAY_TOTAL, FI_NVLINK_RECOVERY_TOTAL, FI_NVLINK_CRC_FLIT_TOTAL,
                    FI_NVLINK_CRC_DATA_TOTAL]
            if by_field:
                ids += [(FI_NVLINK_GET_STATE, link) for link in links]
        try:
            values = self._call("nvmlDeviceGetFieldValues", h, ids)
        except _Absent:
            if not links:
                raise
            values = []  # a driver without field values: per-link state calls below, no recovery action
        got: dict[int, int] = {}
        states: dict[int, int] = {}
        for requested, v in zip(ids, values, strict=False):
            if int(getattr(v, "nvmlReturn", SUCCESS)) != SUCCESS:
                continue  # per field: this driver or GPU lacks it
            if isinstance(requested, tuple):
                states[requested[1]] = field_int(v)
            else:
                got[requested] = field_int(v)
        out: dict[str, Any] = {}
        if FI_RECOVERY_ACTION in got:  # from driver R570; older drivers answer per field
            out["recovery_action"] = RECOVERY.get(got[FI_RECOVERY_ACTION], "unknown")
            out["recovery_action_code"] = got[FI_RECOVERY_ACTION]
        if not links:
            return out
        if FI_NVLINK_REPLAY_TOTAL in got or FI_NVLINK_RECOVERY_TOTAL in got:
            out["nvlink_error_count"] = got.get(FI_NVLINK_REPLAY_TOTAL, 0) + got.get(FI_NVLINK_RECOVERY_TOTAL, 0)
        if FI_NVLINK_CRC_FLIT_TOTAL in got or FI_NVLINK_CRC_DATA_TOTAL in got:
            out["nvlink_crc_count"] = got.get(FI_NVLINK_CRC_FLIT_TOTAL, 0) + got.get(FI_NVLINK_CRC_DATA_TOTAL, 0)
        if by_field and len(states) < len(links):
            # A driver without the link-state field: per-link calls from now on.
            self._links_by_field[uuid] = False
        for link in links:
            if link not in states:
                try:
                    states[link] = int(self._call("nvmlDeviceGetNvLinkState", h, link, past_end=True))
                except _Absent:
                    continue
        active = [link for link, s in states.items() if s == 1]
        seen = self.memory.links_seen(uuid)
        if set(active) - seen:
            self.memory.saw_active(uuid, active)  # a link that trained after start: its later loss is a fault
            seen = seen | set(active)
        out["nvlink_down"] = tuple(sorted(link for link, s in states.items() if s != 1 and link in seen))
        out["nvlink_active_count"] = len(active)
        return out

    def _fabric(self, uuid: str, h: Any) -> dict[str, Any]:
        ctor = getattr(self.nv, "c_nvmlGpuFabricInfo_v3_t", None) or _FabricInfoV3
        info = ctor()
        if not getattr(info, "version", 0):
            info.version = FABRIC_INFO_V3  # pynvml's own class sets it; ours must too
        # nvml.h: nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t, nvmlGpuFabricInfoV_t *). The wrapper passes
        # its argument through untouched, so the pointer is ours to make.
        self._call("nvmlDeviceGetGpuFabricInfoV", h, ctypes.byref(info))
        self._static.setdefault(uuid, {})["fabric_state"] = FABRIC_STATE.get(int(getattr(info, "state", 0)),
                                                                             "unknown")
        summary = FABRIC.get(int(getattr(info, "healthSummary", 0)))
        return {"fabric_health": summary} if summary else {}

    # What is watched --------------------------------------------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        """Per GPU: what NVML reported and which checks are on, off or unavailable, and why (``inspect``)."""
        out = []
        for gpu in self._discovery.gpus:
            static = self._static.get(gpu.uuid, {})
            checks = dict(self._checks.get(gpu.uuid, {}))
            out.append({
                "index": gpu.index, "uuid": gpu.uuid, "name": gpu.name,
                "architecture": static.get("architecture", "unknown"), "driver": self.driver,
                "links_active": static.get("links_active", 0), "link_slots": static.get("link_slots", 0),
                "links_seen_active": sorted(self.memory.links_seen(gpu.uuid)),
                "ecc_mode": static.get("ecc_mode"), "mig_mode": static.get("mig_mode"),
                "fabric_state": static.get("fabric_state"),
                "events": self._event_masks.get(gpu.uuid, 0),
                "checks": {s: checks.get(s, "not read yet") for s in (*SIGNALS, "nvlink", "events")},
            })
        return out

    def unavailable(self) -> dict[str, dict[str, str]]:
        """Checks that crashed the library before and are skipped, per GPU: for status, reasons and metrics."""
        out: dict[str, dict[str, str]] = {}
        for uuid, checks in self._checks.items():
            bad = {s: why for s, why in checks.items() if why.startswith("unavailable")}
            if bad:
                out[uuid] = bad
        return out

    # Events ---------------------------------------------------------------------------------------------------

    def _setup_events(self) -> None:
        try:
            self._event_set = self._call("nvmlEventSetCreate")
        except (_Absent, self.nv.NVMLError, _Lost, _ResetRequired) as exc:
            log.error("NVML events unavailable (%s): relying on polling alone", exc)
            for uuid in self._handles:
                self._checks.setdefault(uuid, {})["events"] = f"off: {exc}"
            return
        for uuid, h in self._handles.items():
            model = str(self._static.get(uuid, {}).get("name", ""))
            checks = self._checks.setdefault(uuid, {})
            crashed = self._skipped("events", model)
            if crashed is not None:
                checks["events"] = f"unavailable: crashed the process in {crashed.get('call') or 'an NVML call'}"
                continue
            try:
                with self._guard("events", model, "nvmlDeviceRegisterEvents"):
                    supported = self._opt("nvmlDeviceGetSupportedEventTypes", h)
                    mask = (int(supported) if supported is not None else EV_XID | EV_DBE) & WANTED_EVENTS
                    if mask:
                        self._call("nvmlDeviceRegisterEvents", h, mask, self._event_set)
                        self._event_masks[uuid] = mask
                checks["events"] = f"on (0x{mask:x})" if mask else "off: no event type this plugin uses"
            except (_Absent, self.nv.NVMLError, _Lost, _ResetRequired) as exc:
                checks["events"] = f"off: {exc}"
                log.error("cannot register NVML events for %s: %s (polling still covers it)", uuid, exc)

    def wait_events(self, timeout_s: float) -> Sequence[GpuEvent]:
        with self._event_lock:
            event_set = None if self._closed else self._event_set
            self._waiting = event_set is not None
        if event_set is None:
            time.sleep(timeout_s)
            return ()
        try:
            # TIMEOUT is how a wait with no event ends, four times a second on an idle node: not an error.
            data = self._call("nvmlEventSetWait_v2", event_set, int(timeout_s * 1000), normal=frozenset({ERR_TIMEOUT}))
        except (_Absent, _Lost, _ResetRequired):
            return ()
        except self.nv.NVMLError as exc:
            if getattr(exc, "value", None) != ERR_TIMEOUT:
                log.warning("NVML event wait failed: %s", exc)
                time.sleep(min(timeout_s, 0.5))
            return ()
        finally:
            with self._event_lock:
                self._waiting = False
                closed_meanwhile = self._closed
            if closed_meanwhile:
                self._release()  # close() left the set to us: it was in use
        now = time.time()
        key = handle_key(data.device)
        uuid = self._uuid_by_key.get(key) if key is not None else None
        if uuid is None:
            # Never ask the GPU that raised the event who it is: a lost GPU cannot answer.
            log.warning("NVML event type 0x%x data %s for a device not registered here: ignored",
                        int(data.eventType), int(data.eventData))
            return ()
        etype = int(data.eventType)
        gi = int(getattr(data, "gpuInstanceId", WHOLE_GPU))
        ci = int(getattr(data, "computeInstanceId", WHOLE_GPU))
        scope = None if gi == WHOLE_GPU else gi
        cscope = None if ci == WHOLE_GPU else ci
        if etype & EV_XID:
            return (GpuEvent(uuid, EventKind.XID, int(data.eventData), now, scope, cscope),)
        if etype & EV_DBE:
            return (GpuEvent(uuid, EventKind.ECC_DBE, 0, now, scope, cscope),)
        if etype & EV_GPU_UNAVAILABLE:
            return (GpuEvent(uuid, EventKind.GPU_UNAVAILABLE, 0, now),)
        if etype & EV_RECOVERY_ACTION:
            return (GpuEvent(uuid, EventKind.RECOVERY_ACTION, int(data.eventData), now),)
        return ()

    def watch(self, on_change: Callable[[], None]) -> None:
        pass  # NVML has no change notification beyond events; the poller covers the rest

    def unwatch(self) -> None:
        pass

    def close(self) -> None:
        """Free the event set and shut NVML down; never under a wait in progress. If the event thread is waiting
        now, it does both when its wait returns (within the wait's timeout), so close() itself never blocks on the
        driver. A wait that never returns (a hung driver) leaks the set until the process exits, which is safe."""
        with self._event_lock:
            self._closed = True
            in_use = self._waiting
        if in_use:
            log.debug("NVML event set in use by a wait: the event thread frees it when the wait returns")
            return
        self._release()

    def _release(self) -> None:
        with self._event_lock:
            if self._released:
                return
            self._released = True
            event_set, self._event_set = self._event_set, None
        try:
            if event_set is not None:
                self._call("nvmlEventSetFree", event_set)
        except (_Absent, self.nv.NVMLError, _Lost, _ResetRequired):
            pass
        try:
            self._call("nvmlShutdown")
        except (_Absent, self.nv.NVMLError, _Lost, _ResetRequired):
            pass
