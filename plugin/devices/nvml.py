"""The NVML backend: the only module that imports ``pynvml``.

Every call on a device goes through ``_call``, which sorts NVML's answers into four kinds: a value, "this GPU has
no such signal" (NotSupported, FunctionNotFound, a binding without the function), "the GPU is lost / needs a
reset", and a generic error that is recorded against that device alone. Nothing here raises out of ``read``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from plugin.devices.backend import BackendError
from plugin.devices.model import Discovery, EventKind, Gpu, GpuEvent, MigDevice, Reading

log = logging.getLogger(__name__)

# NVML return codes (nvml.h); compared by value so a hand-written fake module needs only NVMLError.value.
ERR_NOT_SUPPORTED = 3
ERR_NOT_FOUND = 6
ERR_TIMEOUT = 10
ERR_LIBRARY_NOT_FOUND = 12
ERR_FUNCTION_NOT_FOUND = 13
ERR_GPU_IS_LOST = 15
ERR_RESET_REQUIRED = 16
NOT_A_SIGNAL = {ERR_NOT_SUPPORTED, ERR_FUNCTION_NOT_FOUND, ERR_NOT_FOUND}

EV_XID = 0x8
EV_DBE = 0x2
EV_GPU_UNAVAILABLE = 0x4000
EV_RECOVERY_ACTION = 0x8000
WHOLE_GPU = 0xFFFFFFFF

CLOCK_BITS = {0x8: "hw_slowdown", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
              0x80: "hw_power_brake_slowdown"}
CLOCK_IDLE = 0x1
RECOVERY = {0: "none", 1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p", 4: "drain_and_reset"}
FABRIC = {1: "healthy", 2: "unhealthy", 3: "limited_capacity"}
FI_RECOVERY_ACTION = 230
TOPOLOGY_MULTIPLE = 20  # common ancestor at or below a PCIe switch (possibly several)


class _Unsupported(Exception):
    pass


class _Lost(Exception):
    pass


class _ResetRequired(Exception):
    pass


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class NvmlBackend:
    name = "nvml"

    def __init__(self, nvml: ModuleType | Any | None = None, max_links: int | None = None) -> None:
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
        self._handles: dict[str, Any] = {}
        self._links: dict[str, tuple[int, ...]] = {}
        self._static: dict[str, dict[str, int | None]] = {}
        self._mig_by_gi: dict[tuple[str, int], str] = {}
        # Guards the error counter: the poll thread and the event thread both fail calls, and metrics reads it.
        self._errors_lock = threading.Lock()
        self._call_errors = 0
        # Guards the event set's life: close() may come while the event thread sits in nvmlEventSetWait on it,
        # and freeing a set under a waiter is a use-after-free in the driver library. Whoever is last out frees.
        self._event_lock = threading.Lock()
        self._event_set: Any = None
        self._waiting = False
        self._closed = False
        self._released = False
        self._discovery = self._discover()
        self._setup_events()

    # Call discipline ------------------------------------------------------------------------------------------

    def _call(self, fn_name: str, *args: Any) -> Any:
        fn = getattr(self.nv, fn_name, None)
        if fn is None:
            raise _Unsupported(fn_name)
        try:
            return fn(*args)
        except self.nv.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in NOT_A_SIGNAL:
                raise _Unsupported(fn_name) from exc
            if code == ERR_GPU_IS_LOST:
                raise _Lost(fn_name) from exc
            if code == ERR_RESET_REQUIRED:
                raise _ResetRequired(fn_name) from exc
            with self._errors_lock:
                self._call_errors += 1
            raise

    @property
    def call_errors(self) -> int:
        """NVML calls that failed with a generic error (NotSupported, lost and reset-required excluded)."""
        with self._errors_lock:
            return self._call_errors

    def _opt(self, fn_name: str, *args: Any) -> Any:
        """A value, or None where the signal does not exist; other errors propagate."""
        try:
            return self._call(fn_name, *args)
        except _Unsupported:
            return None

    # Discovery ------------------------------------------------------------------------------------------------

    def _discover(self) -> Discovery:
        try:
            count = self._call("nvmlDeviceGetCount")
            driver = _text(self._opt("nvmlSystemGetDriverVersion") or "")
        except (self.nv.NVMLError, _Lost, _ResetRequired) as exc:
            return Discovery(error=f"device enumeration failed: {exc}")
        found: list[tuple[Gpu, Any, str]] = []
        for index in range(count):
            try:
                h = self._call("nvmlDeviceGetHandleByIndex", index)
                uuid = _text(self._call("nvmlDeviceGetUUID", h))
            except (self.nv.NVMLError, _Lost, _ResetRequired, _Unsupported) as exc:
                # A GPU we cannot even name cannot be advertised; the others still can.
                log.error("GPU index %d cannot be read at discovery (%s); not advertised", index, exc)
                continue
            gpu, bus = self._describe(index, h, uuid)
            found.append((gpu, h, bus))
        by_bus = {bus.lower(): g.index for g, _, bus in found if bus}
        switches = self._switch_groups([(g, h) for g, h, _ in found])
        gpus = []
        for g, h, _ in found:
            peers = self._nvlink_peers(g.uuid, h, by_bus, g.index)
            gpus.append(Gpu(uuid=g.uuid, index=g.index, name=g.name, minor=g.minor, numa_node=g.numa_node,
                            memory_mib=g.memory_mib, pci_bus_id=g.pci_bus_id, nvlink_peers=peers,
                            pcie_switch=switches.get(g.uuid), mig_devices=g.mig_devices))
            self._handles[g.uuid] = h
        return Discovery(gpus=tuple(gpus), driver_version=driver)

    def _describe(self, index: int, h: Any, uuid: str) -> tuple[Gpu, str]:
        def safe(fn: str, *args: Any) -> Any:
            try:
                return self._opt(fn, *args)
            except (self.nv.NVMLError, _Lost, _ResetRequired):
                return None

        name = _text(safe("nvmlDeviceGetName", h) or "NVIDIA GPU")
        minor = safe("nvmlDeviceGetMinorNumber", h)
        pci = safe("nvmlDeviceGetPciInfo_v3", h) or safe("nvmlDeviceGetPciInfo", h)
        bus = _text(getattr(pci, "busId", "") or "") if pci is not None else ""
        numa = safe("nvmlDeviceGetNumaNodeId", h)
        if numa is not None and (numa < 0 or numa >= 0xFFFF):
            numa = None
        mem = safe("nvmlDeviceGetMemoryInfo", h)
        memory_mib = int(getattr(mem, "total", 0) // (1024 * 1024)) if mem is not None else 0
        self._static[uuid] = {
            "slowdown": safe("nvmlDeviceGetTemperatureThreshold", h, 1),
            "shutdown": safe("nvmlDeviceGetTemperatureThreshold", h, 0),
            "max_gen": safe("nvmlDeviceGetMaxPcieLinkGeneration", h),
            "max_width": safe("nvmlDeviceGetMaxPcieLinkWidth", h),
        }
        migs = self._migs(uuid, h)
        return Gpu(uuid=uuid, index=index, name=name, minor=minor, numa_node=numa, memory_mib=memory_mib,
                   pci_bus_id=bus, mig_devices=migs), bus

    def _migs(self, uuid: str, h: Any) -> tuple[MigDevice, ...]:
        try:
            mode = self._opt("nvmlDeviceGetMigMode", h)
            if not mode or mode[0] != 1:
                return ()
            count = self._call("nvmlDeviceGetMaxMigDeviceCount", h)
        except (self.nv.NVMLError, _Lost, _ResetRequired, _Unsupported):
            return ()
        out = []
        for i in range(count):
            try:
                mh = self._call("nvmlDeviceGetMigDeviceHandleByIndex", h, i)
            except _Unsupported:  # NOT_FOUND: an empty slot
                continue
            except (self.nv.NVMLError, _Lost, _ResetRequired):
                continue
            try:
                muuid = _text(self._call("nvmlDeviceGetUUID", mh))
                gi = int(self._call("nvmlDeviceGetGpuInstanceId", mh))
                ci = int(self._opt("nvmlDeviceGetComputeInstanceId", mh) or 0)
                mname = _text(self._opt("nvmlDeviceGetName", mh) or "")
                mem = self._opt("nvmlDeviceGetMemoryInfo", mh)
            except (self.nv.NVMLError, _Lost, _ResetRequired, _Unsupported) as exc:
                log.error("MIG device %d of %s unreadable: %s", i, uuid, exc)
                continue
            profile = mname.split("MIG ", 1)[1].strip() if "MIG " in mname else f"gi{gi}"
            self._mig_by_gi[(uuid, gi)] = muuid
            out.append(MigDevice(uuid=muuid, parent_uuid=uuid, gpu_instance_id=gi, compute_instance_id=ci,
                                 profile=profile,
                                 memory_mib=int(getattr(mem, "total", 0) // (1024 * 1024)) if mem else 0))
        return tuple(out)

    def _nvlink_peers(self, uuid: str, h: Any, by_bus: dict[str, int], own: int) -> tuple[int, ...]:
        peers: set[int] = set()
        links: list[int] = []
        for link in range(self.max_links):
            try:
                if self._call("nvmlDeviceGetNvLinkState", h, link) != 1:
                    links.append(link)  # present but down: still polled, so the fault shows
                    continue
            except (_Unsupported, self.nv.NVMLError, _Lost, _ResetRequired):
                continue  # no such link on this GPU
            links.append(link)
            try:
                remote = self._call("nvmlDeviceGetNvLinkRemotePciInfo", h, link)
            except (_Unsupported, self.nv.NVMLError, _Lost, _ResetRequired):
                continue
            peer = by_bus.get(_text(getattr(remote, "busId", "")).lower())
            if peer is not None and peer != own:
                peers.add(peer)
        self._links[uuid] = tuple(links)
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
                try:
                    level = self._call("nvmlDeviceGetTopologyCommonAncestor", ha, hb)
                except (_Unsupported, self.nv.NVMLError, _Lost, _ResetRequired):
                    continue
                if int(level) <= TOPOLOGY_MULTIPLE:
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
        values: dict[str, Any] = {}
        errors: list[tuple[str, str]] = []
        static = self._static.get(gpu.uuid, {})
        values["temperature_slowdown_c"] = static.get("slowdown")
        values["temperature_shutdown_c"] = static.get("shutdown")
        values["pcie_max_gen"] = static.get("max_gen")
        values["pcie_max_width"] = static.get("max_width")
        reset_required = False
        for signal, fn in self._readers(gpu.uuid, h):
            try:
                values.update(fn())
            except _Unsupported:
                continue
            except _Lost:
                return Reading(time=now, lost=True)
            except _ResetRequired:
                reset_required = True
            except self.nv.NVMLError as exc:
                errors.append((signal, str(exc)))
            except Exception as exc:  # a binding quirk must cost one signal, not the poll
                errors.append((signal, f"{type(exc).__name__}: {exc}"))
        return Reading(time=now, reset_required=reset_required, errors=tuple(errors), **values)

    def _readers(self, uuid: str, h: Any) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
        nv = self.nv
        return [
            ("ecc", lambda: {
                "ecc_uncorrected_volatile": self._opt("nvmlDeviceGetTotalEccErrors", h, 1, 0),
                "ecc_corrected_volatile": self._opt("nvmlDeviceGetTotalEccErrors", h, 0, 0),
                "ecc_uncorrected_aggregate": self._opt("nvmlDeviceGetTotalEccErrors", h, 1, 1),
                "ecc_corrected_aggregate": self._opt("nvmlDeviceGetTotalEccErrors", h, 0, 1),
            }),
            ("row_remap", lambda: self._remap(h)),
            ("retired_pages", lambda: self._retired(h)),
            ("temperature", lambda: {"temperature_c": self._call("nvmlDeviceGetTemperature", h, 0)}),
            ("clocks", lambda: self._clocks(h)),
            ("pcie", lambda: {
                "pcie_gen": self._opt("nvmlDeviceGetCurrPcieLinkGeneration", h),
                "pcie_width": self._opt("nvmlDeviceGetCurrPcieLinkWidth", h),
                "pcie_replay_count": self._opt("nvmlDeviceGetPcieReplayCounter", h),
            }),
            ("nvlink", lambda: self._nvlink(uuid, h)),
            ("recovery_action", lambda: self._recovery(h)),
            ("fabric", lambda: self._fabric(h)),
        ] if nv is not None else []

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
        except _Unsupported:
            bits = self._call("nvmlDeviceGetCurrentClocksThrottleReasons", h)
        bits = int(bits)
        return {"clock_event_reasons": frozenset(n for b, n in CLOCK_BITS.items() if bits & b),
                "gpu_idle": bool(bits & CLOCK_IDLE)}

    def _nvlink(self, uuid: str, h: Any) -> dict[str, Any]:
        links = self._links.get(uuid, ())
        if not links:
            return {}
        down = []
        errors = 0
        crc = 0
        for link in links:
            if self._call("nvmlDeviceGetNvLinkState", h, link) != 1:
                down.append(link)
                continue
            for counter in (0, 1):  # DL_REPLAY, DL_RECOVERY
                errors += int(self._opt("nvmlDeviceGetNvLinkErrorCounter", h, link, counter) or 0)
            for counter in (2, 3):  # DL_CRC_FLIT, DL_CRC_DATA
                crc += int(self._opt("nvmlDeviceGetNvLinkErrorCounter", h, link, counter) or 0)
        return {"nvlink_down": tuple(down), "nvlink_error_count": errors, "nvlink_crc_count": crc}

    def _recovery(self, h: Any) -> dict[str, Any]:
        field = int(getattr(self.nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", FI_RECOVERY_ACTION))
        values = self._call("nvmlDeviceGetFieldValues", h, [field])
        v = values[0]
        if int(getattr(v, "nvmlReturn", 0)) != 0:
            return {}  # the field exists from driver R570: older drivers answer per field, not per call
        raw = getattr(v, "value", None)
        action = int(getattr(raw, "uiVal", raw) or 0) if raw is not None else 0
        return {"recovery_action": RECOVERY.get(action, "none")}

    def _fabric(self, h: Any) -> dict[str, Any]:
        ctor = getattr(self.nv, "c_nvmlGpuFabricInfo_v3_t", None)
        if ctor is None:
            return {}
        info = ctor()
        self._call("nvmlDeviceGetGpuFabricInfoV", h, info)
        summary = FABRIC.get(int(getattr(info, "healthSummary", 0)))
        return {"fabric_health": summary} if summary else {}

    # Events ---------------------------------------------------------------------------------------------------

    def _setup_events(self) -> None:
        try:
            self._event_set = self._call("nvmlEventSetCreate")
        except (_Unsupported, self.nv.NVMLError, _Lost, _ResetRequired) as exc:
            log.error("NVML events unavailable (%s): relying on polling alone", exc)
            return
        wanted = EV_XID | EV_DBE | EV_GPU_UNAVAILABLE | EV_RECOVERY_ACTION
        for uuid, h in self._handles.items():
            try:
                supported = int(self._opt("nvmlDeviceGetSupportedEventTypes", h) or (EV_XID | EV_DBE))
                mask = supported & wanted
                if mask:
                    self._call("nvmlDeviceRegisterEvents", h, mask, self._event_set)
            except (_Unsupported, self.nv.NVMLError, _Lost, _ResetRequired) as exc:
                log.error("cannot register NVML events for %s: %s (polling still covers it)", uuid, exc)

    def wait_events(self, timeout_s: float) -> Sequence[GpuEvent]:
        with self._event_lock:
            event_set = None if self._closed else self._event_set
            self._waiting = event_set is not None
        if event_set is None:
            time.sleep(timeout_s)
            return ()
        try:
            data = self._call("nvmlEventSetWait_v2", event_set, int(timeout_s * 1000))
        except (_Unsupported, _Lost, _ResetRequired):
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
        uuid = self._uuid_of(data.device)
        if uuid is None:
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

    def _uuid_of(self, handle: Any) -> str | None:
        for uuid, h in self._handles.items():
            if h == handle or getattr(h, "value", object()) == getattr(handle, "value", None):
                return uuid
        try:
            return _text(self._call("nvmlDeviceGetUUID", handle))
        except (_Unsupported, self.nv.NVMLError, _Lost, _ResetRequired):
            return None

    def watch(self, on_change: Callable[[], None]) -> None:
        pass  # NVML has no change notification beyond events; the poller covers the rest

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
        except (_Unsupported, self.nv.NVMLError, _Lost, _ResetRequired):
            pass
        try:
            self._call("nvmlShutdown")
        except (_Unsupported, self.nv.NVMLError, _Lost, _ResetRequired):
            pass
