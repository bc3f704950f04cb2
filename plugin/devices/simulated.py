"""The simulated backend: a JSON node description on disk stands in for NVML.

The file is watched; every rewrite (in place or by atomic rename) is applied at once. A malformed file is reported
with the field and GPU at fault and the last good description stays in force. ``docs/simulated-node.md`` is the
format's reference.

NVLink: link ``k`` of a GPU is the one to the ``k``-th GPU in its ``nvlink_peers``. A peer that is not in the file
(a GPU removed, as when it falls off the bus) leaves that link without a far end, so the reading shows it down,
as NVML shows the links of a GPU whose peer is gone; the file stays valid.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from plugin.devices.model import (
    CLOCK_EVENT_REASONS,
    FABRIC_HEALTH,
    RECOVERY_ACTIONS,
    ComputeProcess,
    Discovery,
    EventKind,
    Gpu,
    GpuEvent,
    MigDevice,
    Reading,
)

log = logging.getLogger(__name__)

DEFAULT_SLOWDOWN_C = 87
DEFAULT_SHUTDOWN_C = 92
DEFAULT_PCIE_MAX_GEN = 5
DEFAULT_PCIE_MAX_WIDTH = 16

_INT_SIGNALS = ("ecc_uncorrected_volatile", "ecc_corrected_volatile", "pcie_replay_count", "temperature_c",
                "retired_pages_count", "nvlink_error_count")
_BOOL_SIGNALS = ("row_remap_pending", "row_remap_failure", "retired_pages_pending", "lost", "nvml_error",
                 "reset_required")
KNOWN_SIGNALS = frozenset(
    _INT_SIGNALS + _BOOL_SIGNALS
    + ("xid_events", "clock_event_reasons", "pcie_link", "nvlink_down", "recovery_action", "fabric_health",
       "mig_events", "compute_processes")
)


class NodeFileError(ValueError):
    """The node file is malformed; the message names the field (and the GPU) at fault."""


@dataclass(frozen=True)
class SimGpu:
    gpu: Gpu  # nvlink_peers: the peers present in the file only
    signals: dict[str, Any]
    slowdown_c: int
    shutdown_c: int
    pcie_max_gen: int
    pcie_max_width: int
    missing_peers: tuple[tuple[int, int], ...] = ()  # (link, peer index) for each peer not in the file


def builtin_node() -> dict[str, Any]:
    """An 8-GPU H100-like node: 2 NUMA nodes, two NVLink islands of 4, one PCIe switch per pair."""
    gpus = []
    for i in range(8):
        island = range(0, 4) if i < 4 else range(4, 8)
        gpus.append({
            "uuid": f"GPU-5a1e0000-0000-4000-8000-{i:012d}",
            "index": i,
            "numa_node": 0 if i < 4 else 1,
            "name": "NVIDIA H100 80GB HBM3",
            "memory_mib": 81559,
            "pci_bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0",
            "nvlink_peers": [p for p in island if p != i],
            "pcie_switch": f"sw{i // 2}",
            "signals": {},
        })
    return {"gpus": gpus}


def write_node_file(path: Path, doc: dict[str, Any] | None = None) -> None:
    """Write a node description (the built-in node by default) as a file this backend accepts. Atomic, so a plugin
    already watching ``path`` never reads half a file."""
    doc = builtin_node() if doc is None else doc
    parse_node(doc)  # never write what load_node_file would refuse
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _field(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _int(value: Any, where: str, name: str, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise NodeFileError(f"{_field(where, name)}: expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise NodeFileError(f"{_field(where, name)}: must be >= {minimum}, got {value}")
    return value


def _bool(value: Any, where: str, name: str) -> bool:
    if not isinstance(value, bool):
        raise NodeFileError(f"{_field(where, name)}: expected true or false, got {value!r}")
    return value


def _validate_signals(signals: Any, where: str) -> dict[str, Any]:
    if not isinstance(signals, dict):
        raise NodeFileError(f"{where}: expected an object of signals, got {type(signals).__name__}")
    for key, value in signals.items():
        name = f"signals.{key}"
        if key not in KNOWN_SIGNALS:
            raise NodeFileError(f"{where}.{name}: unknown signal (known: {', '.join(sorted(KNOWN_SIGNALS))})")
        if key in _INT_SIGNALS:
            _int(value, where, name)
        elif key in _BOOL_SIGNALS:
            _bool(value, where, name)
        elif key in ("xid_events", "nvlink_down"):
            if not isinstance(value, list):
                raise NodeFileError(f"{where}.{name}: expected a list of integers, got {value!r}")
            for v in value:
                _int(v, where, name)
        elif key == "mig_events":
            if not isinstance(value, list):
                raise NodeFileError(f"{where}.{name}: expected a list of {{gpu_instance_id, xid}} objects")
            for v in value:
                if not isinstance(v, dict) or set(v) != {"gpu_instance_id", "xid"}:
                    raise NodeFileError(f"{where}.{name}: each entry needs exactly gpu_instance_id and xid")
                _int(v["gpu_instance_id"], where, name)
                _int(v["xid"], where, name)
        elif key == "compute_processes":
            if not isinstance(value, list):
                raise NodeFileError(f"{where}.{name}: expected a list of {{pid, used_mib, name}} objects")
            for v in value:
                if not isinstance(v, dict) or "pid" not in v or set(v) - {"pid", "used_mib", "name"}:
                    raise NodeFileError(f"{where}.{name}: each entry needs pid, and may have used_mib and name")
                _int(v["pid"], where, f"{name}.pid", minimum=1)
                if "used_mib" in v:
                    _int(v["used_mib"], where, f"{name}.used_mib")
                if not isinstance(v.get("name", ""), str):
                    raise NodeFileError(f"{where}.{name}.name: expected a string")
        elif key == "clock_event_reasons":
            if not isinstance(value, list) or any(v not in CLOCK_EVENT_REASONS for v in value):
                raise NodeFileError(f"{where}.{name}: expected a list of {', '.join(CLOCK_EVENT_REASONS)}")
        elif key == "pcie_link":
            if not isinstance(value, dict) or set(value) - {"gen", "width"}:
                raise NodeFileError(f"{where}.{name}: expected {{\"gen\": int, \"width\": int}}")
            for k in ("gen", "width"):
                if k in value:
                    _int(value[k], where, f"{name}.{k}", minimum=1)
        elif key == "recovery_action" and value not in RECOVERY_ACTIONS:
            raise NodeFileError(f"{where}.{name}: expected one of {', '.join(RECOVERY_ACTIONS)}, got {value!r}")
        elif key == "fabric_health" and value not in FABRIC_HEALTH:
            raise NodeFileError(f"{where}.{name}: expected one of {', '.join(FABRIC_HEALTH)}, got {value!r}")
    return dict(signals)


def parse_node(doc: Any) -> list[SimGpu]:
    """Validate a node description; raise NodeFileError naming the first bad field."""
    if not isinstance(doc, dict):
        raise NodeFileError("top level: expected an object with a 'gpus' list")
    gpus = doc.get("gpus")
    if not isinstance(gpus, list):
        raise NodeFileError("gpus: expected a list")
    out: list[SimGpu] = []
    seen_uuid: set[str] = set()
    seen_index: set[int] = set()
    for pos, entry in enumerate(gpus):
        where = f"gpus[{pos}]"
        if not isinstance(entry, dict):
            raise NodeFileError(f"{where}: expected an object")
        uuid = entry.get("uuid")
        if isinstance(uuid, str) and uuid:
            where = f"gpus[{pos}] ({uuid})"
        for required in ("uuid", "index", "numa_node", "name", "memory_mib", "nvlink_peers", "pcie_switch",
                         "signals"):
            if required not in entry:
                raise NodeFileError(f"{where}.{required}: missing")
        if not isinstance(uuid, str) or not uuid or len(uuid) > 63 or any(c in uuid for c in " ,/"):
            raise NodeFileError(f"{where}.uuid: expected a non-empty id of at most 63 characters without "
                                f"spaces, commas or slashes, got {uuid!r}")
        if uuid in seen_uuid:
            raise NodeFileError(f"{where}.uuid: duplicate {uuid!r}")
        seen_uuid.add(uuid)
        index = _int(entry["index"], where, "index")
        if index in seen_index:
            raise NodeFileError(f"{where}.index: duplicate {index}")
        seen_index.add(index)
        numa = entry["numa_node"]
        if numa is not None:
            numa = _int(numa, where, "numa_node")
        name = entry["name"]
        if not isinstance(name, str):
            raise NodeFileError(f"{where}.name: expected a string, got {name!r}")
        memory = _int(entry["memory_mib"], where, "memory_mib")
        peers = entry["nvlink_peers"]
        if not isinstance(peers, list):
            raise NodeFileError(f"{where}.nvlink_peers: expected a list of GPU indices")
        for p in peers:
            _int(p, where, "nvlink_peers")
        switch = entry["pcie_switch"]
        if switch is not None and not isinstance(switch, str):
            raise NodeFileError(f"{where}.pcie_switch: expected a string or null, got {switch!r}")
        signals = _validate_signals(entry["signals"], where)
        migs = _parse_migs(entry.get("mig_devices", []), where, uuid)
        out.append(SimGpu(
            gpu=Gpu(uuid=uuid, index=index, name=name, minor=entry.get("minor", index), numa_node=numa,
                    memory_mib=memory, pci_bus_id=str(entry.get("pci_bus_id", "")),
                    nvlink_peers=tuple(peers), pcie_switch=switch, mig_devices=migs),
            signals=signals,
            slowdown_c=_int(entry.get("temperature_slowdown_c", DEFAULT_SLOWDOWN_C), where,
                            "temperature_slowdown_c"),
            shutdown_c=_int(entry.get("temperature_shutdown_c", DEFAULT_SHUTDOWN_C), where,
                            "temperature_shutdown_c"),
            pcie_max_gen=_int(entry.get("pcie_max_gen", DEFAULT_PCIE_MAX_GEN), where, "pcie_max_gen", 1),
            pcie_max_width=_int(entry.get("pcie_max_width", DEFAULT_PCIE_MAX_WIDTH), where, "pcie_max_width", 1),
        ))
    indices = {s.gpu.index for s in out}
    checked = []
    for s in out:
        if s.gpu.index in s.gpu.nvlink_peers:
            raise NodeFileError(f"gpus ({s.gpu.uuid}).nvlink_peers: {s.gpu.index} is this GPU's own index")
        missing = tuple((link, p) for link, p in enumerate(s.gpu.nvlink_peers) if p not in indices)
        if missing:
            present = tuple(p for p in s.gpu.nvlink_peers if p in indices)
            s = replace(s, gpu=replace(s.gpu, nvlink_peers=present), missing_peers=missing)
        checked.append(s)
    return checked


def _parse_migs(value: Any, where: str, parent: str) -> tuple[MigDevice, ...]:
    if not isinstance(value, list):
        raise NodeFileError(f"{where}.mig_devices: expected a list")
    migs = []
    for i, m in enumerate(value):
        w = f"{where}.mig_devices[{i}]"
        if not isinstance(m, dict):
            raise NodeFileError(f"{w}: expected an object")
        for required in ("uuid", "gpu_instance_id", "profile"):
            if required not in m:
                raise NodeFileError(f"{w}.{required}: missing")
        if not isinstance(m["uuid"], str) or not m["uuid"] or len(m["uuid"]) > 63:
            raise NodeFileError(f"{w}.uuid: expected a non-empty id of at most 63 characters")
        if not isinstance(m["profile"], str) or not m["profile"]:
            raise NodeFileError(f"{w}.profile: expected a profile name such as '1g.10gb'")
        migs.append(MigDevice(uuid=m["uuid"], parent_uuid=parent,
                              gpu_instance_id=_int(m["gpu_instance_id"], w, "gpu_instance_id"),
                              compute_instance_id=_int(m.get("compute_instance_id", 0), w, "compute_instance_id"),
                              profile=m["profile"], memory_mib=_int(m.get("memory_mib", 0), w, "memory_mib")))
    return tuple(migs)


def load_node_file(path: Path) -> list[SimGpu]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise NodeFileError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NodeFileError(f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
    return parse_node(doc)


class _FileHandler(FileSystemEventHandler):
    def __init__(self, target: Path, on_event: Callable[[], None]) -> None:
        self._target = str(target)
        self._on_event = on_event

    def on_any_event(self, event: FileSystemEvent) -> None:
        paths = {str(event.src_path), str(getattr(event, "dest_path", "") or "")}
        if self._target in paths and event.event_type in ("created", "modified", "moved", "closed"):
            self._on_event()


class SimulatedBackend:
    """Backend over a node file (or the built-in node). Thread-safe: the watcher thread swaps in new state."""

    name = "simulated"

    def __init__(self, node_file: Path | None = None, clock: Callable[[], float] = time.time) -> None:
        self._path = node_file.resolve() if node_file else None
        self._clock = clock
        self._lock = threading.Lock()
        self._events: queue.SimpleQueue[GpuEvent] = queue.SimpleQueue()
        self._xid_seen: dict[str, int] = {}
        self._mig_seen: dict[str, int] = {}
        self._observer: Any = None
        self._listeners: list[Callable[[], None]] = []
        self._missing_links: set[tuple[str, int, int]] = set()  # (uuid, link, peer) already logged
        self.last_error: str | None = None
        self._gpus: dict[str, SimGpu] = {}
        if self._path is None:
            self._apply(parse_node(builtin_node()))
        else:
            self._apply(load_node_file(self._path))  # a bad file at start is fatal: nothing good to keep

    def _apply(self, gpus: list[SimGpu]) -> None:
        now = self._clock()
        missing = {(s.gpu.uuid, link, peer) for s in gpus for link, peer in s.missing_peers}
        # Once per link going missing, not per reload or poll: a file rewritten ten times is still one fault.
        for uuid, link, peer in sorted(missing - self._missing_links):
            log.warning("simulated node: GPU %s NVLink %d goes to GPU index %d, which is not in the node file; "
                        "the link reads as down", uuid, link, peer)
        self._missing_links = missing
        with self._lock:
            self._gpus = {s.gpu.uuid: s for s in gpus}
            for s in gpus:
                self._queue_new_events(s, now)
            for gone in set(self._xid_seen) - set(self._gpus):
                del self._xid_seen[gone]
                self._mig_seen.pop(gone, None)

    def _queue_new_events(self, s: SimGpu, now: float) -> None:
        uuid = s.gpu.uuid
        xids = s.signals.get("xid_events", [])
        seen = self._xid_seen.get(uuid)
        # A GPU seen for the first time brings its history, not new events: replaying it would re-fire old faults
        # on every plugin start.
        if seen is not None and len(xids) > seen:
            for xid in xids[seen:]:
                self._events.put(GpuEvent(uuid=uuid, kind=EventKind.XID, code=int(xid), time=now))
        self._xid_seen[uuid] = len(xids)
        migs = s.signals.get("mig_events", [])
        seen_mig = self._mig_seen.get(uuid)
        if seen_mig is not None and len(migs) > seen_mig:
            for m in migs[seen_mig:]:
                self._events.put(GpuEvent(uuid=uuid, kind=EventKind.XID, code=int(m["xid"]), time=now,
                                          gpu_instance_id=int(m["gpu_instance_id"])))
        self._mig_seen[uuid] = len(migs)

    def reload(self) -> bool:
        """Re-read the node file; keep the last good state on error. True when the file was applied."""
        if self._path is None:
            return False
        try:
            gpus = load_node_file(self._path)
        except NodeFileError as exc:
            if str(exc) != self.last_error:
                log.error("simulated node file rejected, keeping the last good state: %s", exc)
            self.last_error = str(exc)
            return False
        self.last_error = None
        self._apply(gpus)
        return True

    def _file_changed(self) -> None:
        if self.reload():
            for listener in list(self._listeners):
                listener()

    # Backend protocol -------------------------------------------------------------------------------------------

    def discover(self) -> Discovery:
        with self._lock:
            gpus = tuple(sorted((s.gpu for s in self._gpus.values()), key=lambda g: g.index))
        return Discovery(gpus=gpus, driver_version="simulated")

    def read(self, gpu: Gpu) -> Reading:
        now = self._clock()
        with self._lock:
            s = self._gpus.get(gpu.uuid)
        if s is None:
            return Reading(time=now, lost=True)
        sig = s.signals
        if sig.get("lost"):
            return Reading(time=now, lost=True)
        if sig.get("nvml_error"):
            return Reading(time=now, errors=(("all", "simulated NVML error (NVML_ERROR_UNKNOWN)"),))
        link = sig.get("pcie_link", {})
        reasons = sig.get("clock_event_reasons")
        down = tuple(sorted(set(sig.get("nvlink_down", ())) | {k for k, _ in s.missing_peers}))
        links = len(s.gpu.nvlink_peers) + len(s.missing_peers)
        return Reading(
            time=now,
            model=s.gpu.name,
            ecc_uncorrected_volatile=sig.get("ecc_uncorrected_volatile", 0),
            ecc_corrected_volatile=sig.get("ecc_corrected_volatile", 0),
            row_remap_pending=sig.get("row_remap_pending", False),
            row_remap_failure=sig.get("row_remap_failure", False),
            retired_pages_pending=sig.get("retired_pages_pending", False),
            retired_pages_count=sig.get("retired_pages_count", 0),
            temperature_c=sig.get("temperature_c", 40),
            temperature_slowdown_c=s.slowdown_c,
            temperature_shutdown_c=s.shutdown_c,
            clock_event_reasons=frozenset(reasons or ()),
            pcie_gen=link.get("gen", s.pcie_max_gen),
            pcie_width=link.get("width", s.pcie_max_width),
            pcie_max_gen=s.pcie_max_gen,
            pcie_max_width=s.pcie_max_width,
            pcie_replay_count=sig.get("pcie_replay_count", 0),
            nvlink_down=down,
            nvlink_active_count=links - len([k for k in down if k < links]),
            nvlink_error_count=sig.get("nvlink_error_count", 0),
            recovery_action=sig.get("recovery_action", "none"),
            fabric_health=sig.get("fabric_health"),
            reset_required=sig.get("reset_required", False),
            compute_processes=tuple(ComputeProcess(p["pid"], p.get("used_mib"), p.get("name", ""))
                                    for p in sig.get("compute_processes", ())),
        )

    def wait_events(self, timeout_s: float) -> Sequence[GpuEvent]:
        try:
            first = self._events.get(timeout=timeout_s)
        except queue.Empty:
            return ()
        out = [first]
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def watch(self, on_change: Callable[[], None]) -> None:
        self._listeners.append(on_change)
        if self._path is None or self._observer is not None:
            return
        observer = Observer()
        observer.schedule(_FileHandler(self._path, self._file_changed), str(self._path.parent), recursive=False)
        observer.daemon = True
        observer.start()
        self._observer = observer

    def unwatch(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=2)
            self._observer = None

    def close(self) -> None:
        self.unwatch()
