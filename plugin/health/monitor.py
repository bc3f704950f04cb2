"""The health engine at run time: feeds backend readings and events through per-device trackers into the node state.

Two worker threads: one waits on driver events with a short timeout, one polls every ``poll_interval`` seconds (or
at once when an event or a node-file change asks for it). Both only touch trackers under one lock and publish to the
node state; neither blocks the other for longer than a verdict takes.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from plugin.devices.backend import Backend
from plugin.devices.kmsg import PciAddress, pci_address
from plugin.devices.model import EventKind, EventOrigin, Gpu, GpuEvent, Reading
from plugin.health.busy import BusyWatch
from plugin.health.config import HealthConfig
from plugin.health.node_state import DeviceStatus, NodeState, Transition
from plugin.health.policy import Disposition, condition, inventory_condition
from plugin.health.reasons import Clear, Condition, Reason, Source, State
from plugin.health.recovery import RecoveryChecker
from plugin.health.store import Persister, StateStore
from plugin.health.tracker import ClearRefused, DeviceTracker

__all__ = ["ClearRefused", "Monitor"]

log = logging.getLogger(__name__)

# Seconds apart that the same XID (one GPU, one code) from NVML and from the kernel log is taken as one event: the
# driver writes the log line and signals the event set together; the reader's clock and the record's own differ
# by a scheduling delay, never by more than this.
SAME_EVENT_WINDOW_S = 5.0


class _NodeReason:
    """One node reason's hysteresis: on after ``RAISE_AFTER_POLLS`` polls in a row show it (a GPU reset or a driver
    reload takes a GPU out of NVML for a moment), off after ``clear_after`` polls in a row without it; while on, its
    first time stays and its message follows the latest poll."""

    RAISE_AFTER_POLLS = 2

    def __init__(self, clear_after: int) -> None:
        self.clear_after = max(1, clear_after)
        self.reason: Reason | None = None
        self._seen = 0
        self._clean = 0
        self._first = 0.0

    def observe(self, c: Condition | None, now: float) -> None:
        if c is None:
            self._seen = 0
            self._clean += 1
            if self.reason is not None and self._clean >= self.clear_after:
                self.reason = None
            return
        self._clean = 0
        self._seen += 1
        if self._seen == 1 and self.reason is None:
            self._first = now
        if self.reason is not None or self._seen >= self.RAISE_AFTER_POLLS:
            first = self.reason.first_seen if self.reason is not None else self._first
            self.reason = Reason.of(c, first)


class SameEvent:
    """Pairs each event from one origin with an unpaired one of the other origin within the window; what pairs is
    not counted again. Events of one origin never pair with each other: an XID the driver reports twice is two.
    Holds only the last ``window_s`` of unpaired events per (device, kind, code)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._open: dict[tuple[str, EventKind, int, int | None], list[tuple[float, EventOrigin, int]]] = {}

    def admit(self, e: GpuEvent) -> int:
        """How many of ``e.repeats`` are new."""
        key = (e.uuid, e.kind, e.code, e.gpu_instance_id)
        entries = [x for x in self._open.get(key, ()) if abs(x[0] - e.time) <= self.window_s]
        left = e.repeats
        kept: list[tuple[float, EventOrigin, int]] = []
        for when, origin, n in entries:
            if origin != e.origin and left > 0:
                took = min(n, left)
                left -= took
                n -= took
            if n > 0:
                kept.append((when, origin, n))
        if left > 0:
            kept.append((e.time, e.origin, left))
        if kept:
            self._open[key] = kept
        else:
            self._open.pop(key, None)
        if len(self._open) > 4096:  # bounded whatever the events: the oldest keys go first
            for k in list(self._open)[:1024]:
                del self._open[k]
        return left


class Monitor:
    def __init__(self, backend: Backend, state: NodeState, cfg: HealthConfig, poll_interval_s: float,
                 stop: threading.Event, store: StateStore | None = None,
                 clock: Callable[[], float] = time.time, event_wait_s: float = 0.25,
                 stall_s: float | None = None, boot_id: str = "",
                 recovery: RecoveryChecker | None = None,
                 inventory: Callable[[], Sequence[PciAddress] | None] | None = None,
                 expected_gpus: int | None = None,
                 busy: Callable[[Gpu], str] | None = None, busy_watch: BusyWatch | None = None) -> None:
        self.backend = backend
        # GPUs busy with no pod: who holds a GPU ("" for nobody; the recovery check asks the same) and the watch
        # that asks it only once a GPU has had processes for the grace period (health/busy.py). None: off.
        self.busy = busy
        self.busy_watch = busy_watch if busy is not None else None
        # What says a GPU is missing from NVML: the NVIDIA GPUs on the PCI bus (None: not looked at) and how many
        # GPUs the node should have (--expected-gpus, or its nvidia.com/gpu.count label: set_expected_gpus).
        self.inventory = inventory
        self.expected_gpus = expected_gpus
        self._missing = _NodeReason(cfg.clear_after_polls)
        self._logged_missing: dict[PciAddress, str] = {}  # GPUs the kernel log named that NVML does not list
        self.gpus_missing = 0  # for /metrics: GPUs the last poll found missing (0 when none, or not looked at)
        # The node's boot: latches carry it, and one from another boot that a reboot mends clears at a clean read.
        self.boot_id = boot_id
        self.recovery = recovery
        # GPUs that left NVML while this process ran: coming back is a reset (a driver reload, a GPU reset).
        self._gone: set[str] = set()
        self.state = state
        self.cfg = cfg
        self.poll_interval_s = poll_interval_s
        self.stop = stop
        self.clock = clock
        self.event_wait_s = event_wait_s
        self._lock = threading.Lock()
        self._trackers: dict[str, DeviceTracker] = {}
        self._mig_trackers: dict[str, DeviceTracker] = {}
        self._gpus: dict[str, Gpu] = {}
        self._saved: dict[str, Any] = {}
        # Reasons another health provider gives a GPU (set_external), by lowercased UUID, and when each GPU's set
        # last changed. Not tracked, latched or saved: their source holds them and sends them again on reconnect.
        self._external: dict[str, tuple[Reason, ...]] = {}
        self._external_at: dict[str, float] = {}
        # The same driver event read from NVML's event set and from the kernel log counts once.
        self._same = SameEvent(SAME_EVENT_WINDOW_S)
        self._poll_now = threading.Event()
        self._threads: list[threading.Thread] = []
        # A read that does not return (a hung driver call) holds the poller: after ``stall_s`` the GPUs it keeps
        # from being read turn Unknown, so the kubelet stops believing them fine. None: no stall watch.
        self.stall_s = stall_s
        self._cycle_lock = threading.Condition()
        self._cycle_started: float | None = None  # monotonic start of the poll cycle in progress
        self._read_this_cycle: set[str] = set()
        self._reading: str | None = None  # the GPU whose read is in progress
        self._stalled: dict[str, Reason] = {}
        self._unavailable: dict[str, Reason] = {}  # checks the backend skips since they crashed the library
        self.store = store
        self.persister: Persister | None = None
        # Liveness: when each loop last went round; probes compare these with the clock.
        self.last_poll_at = 0.0
        self.last_event_loop_at = 0.0
        self.poll_durations: list[float] = []
        self.events_seen = 0
        # Cumulative counters for the metrics outlet (read at scrape time, never reset): poll cycles and their
        # total seconds, and XID events by (device, XID).
        self.polls = 0
        self.poll_seconds = 0.0
        self.xids_seen: dict[tuple[str, int], int] = {}
        if store is not None:
            saved = store.load()
            self._saved = dict(saved.get("devices", {}))
            state.restore_history(_readable_transitions(saved.get("transitions", [])))
            self.persister = Persister(store, self._collect, stop)

    # Lifecycle ------------------------------------------------------------------------------------------------

    def start(self, persist: bool = True) -> None:
        """Discover and poll once synchronously, so the first snapshot anyone sees is already true. Without
        ``persist`` (a successor waiting for the state dir) the state file is read but not written until
        ``start_persisting``."""
        self.poll_once()
        self.backend.watch(self.request_poll)
        if persist:
            self.start_persisting()
        loops: list[tuple[Callable[[], None], str]] = [(self._event_loop, "nvml-events"), (self._poll_loop, "poller")]
        if self.stall_s is not None:
            loops.append((self._stall_watch, "stall-watch"))
        for target, name in loops:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def start_persisting(self) -> None:
        """Write the state file from now on, starting with the whole current state."""
        if self.persister is not None and not self.persister.started:
            self.persister.start()
            self.persister.mark_dirty()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        # The backend's watcher feeds this monitor: it ends first, before the threads it wakes and before the final
        # write, whose files may sit where it watches (a watchdog observer stopped with an event in flight logs it).
        self.backend.unwatch()
        self._poll_now.set()  # the poller may be mid-interval; wake it to see the stop event
        with self._cycle_lock:
            self._cycle_lock.notify_all()
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        # A successor that never took the state dir over leaves the file to its owner.
        if self.persister is not None and self.persister.started:
            self.persister.join(max(0.0, deadline - time.monotonic()))
            try:
                self.persister.flush()
            except OSError as exc:
                log.error("final state write failed: %s", exc)

    def request_poll(self) -> None:
        self._poll_now.set()

    def set_external(self, uuid: str, reasons: Sequence[Reason]) -> list[Transition]:
        """Replace the reasons another provider gives GPU ``uuid`` (any case; its MIG devices inherit them) and
        publish at once. The GPU's state is the worst of ours and theirs. A GPU not (yet) discovered keeps them
        until it is."""
        key = uuid.lower()
        new = tuple(reasons)
        with self._lock:
            if self._external.get(key, ()) == new:
                return []
            if new:
                self._external[key] = new
            else:
                self._external.pop(key, None)
            self._external_at[key] = self.clock()
            transitions = self._publish_locked(self.clock())
        if transitions and self.persister is not None:
            self.persister.mark_dirty()  # the history in the state file
        return transitions

    # Loops ----------------------------------------------------------------------------------------------------

    def _poll_loop(self) -> None:
        next_at = time.monotonic() + self.poll_interval_s
        while not self.stop.is_set():
            self._poll_now.wait(timeout=max(0.0, next_at - time.monotonic()))
            if self.stop.is_set():
                return
            self._poll_now.clear()
            try:
                self.poll_once()
            except Exception:  # a bug in one cycle must not end health monitoring
                log.exception("poll cycle failed")
            next_at = time.monotonic() + self.poll_interval_s

    def _event_loop(self) -> None:
        while not self.stop.is_set():
            self.last_event_loop_at = self.clock()
            try:
                events = self.backend.wait_events(self.event_wait_s)
            except Exception as exc:  # the backend promises not to raise; be sure anyway
                log.error("event wait failed: %s", exc)
                self.stop.wait(1.0)
                continue
            if events:
                self.handle_events(events)

    # Work -----------------------------------------------------------------------------------------------------

    def gpu_for_pci(self, pci: PciAddress) -> str | None:
        """The UUID of the GPU NVML sees at a PCI address (how the kernel log names a GPU), if any."""
        for gpu in list(self._gpus.values()):  # a copy in one step: the poll thread owns the dict
            if pci_address(gpu.pci_bus_id) == pci:
                return gpu.uuid
        return None

    def handle_events(self, events: Sequence[GpuEvent]) -> list[Transition]:
        poll = False
        with self._lock:
            for e in events:
                repeats = self._same.admit(e)
                if repeats == 0:
                    continue  # the other source already brought this one
                if repeats != e.repeats:
                    e = replace(e, repeats=repeats)
                self.events_seen += repeats
                if e.kind == EventKind.XID:
                    key = (e.uuid, e.code)
                    self.xids_seen[key] = self.xids_seen.get(key, 0) + repeats
                if e.gpu_instance_id is not None:
                    tracker = self._mig_tracker_for(e.uuid, e.gpu_instance_id)
                else:
                    tracker = self._trackers.get(e.uuid)
                if tracker is None:
                    log.warning("event %s %s for unknown device %s ignored", e.kind, e.code, e.uuid)
                    continue
                if e.repeats > 1:
                    log.info("device %s: %s %s (%s, %d times)", e.uuid, e.kind, e.code, e.origin, e.repeats)
                else:
                    log.info("device %s: %s %s (%s)", e.uuid, e.kind, e.code, e.origin)
                if tracker.observe_event(e) == Disposition.POLL:
                    poll = True
            transitions = self._publish_locked(self.clock())
        if poll:
            self.request_poll()
        if self.persister is not None:
            self.persister.mark_dirty()
        return transitions

    def _stall_watch(self) -> None:
        """Sleeps while no cycle runs; wakes when one has run ``stall_s``, and then once a second while it hangs."""
        assert self.stall_s is not None
        while not self.stop.is_set():
            with self._cycle_lock:
                started = self._cycle_started
                if started is None:
                    self._cycle_lock.wait()
                    continue
                remaining = started + self.stall_s - time.monotonic()
                if remaining > 0:
                    self._cycle_lock.wait(remaining)
                    continue
                blocked = self._reading
                # list() copies the keys in one step under the GIL: the poll thread owns _gpus, but it is stuck.
                pending = [u for u in list(self._gpus) if u not in self._read_this_cycle]
                age = time.monotonic() - started
            self._mark_stalled(blocked, pending, age)
            self.stop.wait(1.0)

    def _mark_stalled(self, blocked: str | None, pending: list[str], age: float) -> None:
        what = getattr(self.backend, "current_call", None)
        call = f" in {what}" if isinstance(what, str) and what else ""
        with self._lock:
            changed = False
            for uuid in pending:
                if uuid in self._stalled:
                    continue
                if uuid == blocked:
                    msg = f"an NVML read of this GPU{call} has not returned for {age:.0f} s"
                else:
                    msg = f"not read for {age:.0f} s: the poller waits on a hung NVML call (GPU {blocked}{call})"
                self._stalled[uuid] = Reason.of(condition("nvml-stalled", msg, Source.POLL), self.clock())
                log.error("device %s: %s", uuid, msg)
                changed = True
            if changed:
                self._publish_locked(self.clock())

    def _skipped_checks(self) -> dict[str, Reason]:
        """One reason per GPU whose checks the backend skips because they crashed the library before."""
        unavailable = getattr(self.backend, "unavailable", None)
        if not callable(unavailable):
            return {}
        out: dict[str, Reason] = {}
        for uuid, checks in unavailable().items():
            previous = self._unavailable.get(uuid)
            msg = "not watched: " + "; ".join(f"{c} ({why.removeprefix('unavailable: ')})"
                                              for c, why in sorted(checks.items()))
            if previous is not None and previous.message == msg:
                out[uuid] = previous  # keep first_seen
            else:
                out[uuid] = Reason.of(condition("nvml-check-unavailable", msg, Source.POLL), self.clock())
        return out

    def _begin_read(self, uuid: str) -> None:
        with self._cycle_lock:
            self._reading = uuid

    def poll_once(self) -> list[Transition]:
        started = time.perf_counter()
        with self._cycle_lock:
            self._cycle_started = time.monotonic()
            self._read_this_cycle = set()
            self._cycle_lock.notify_all()
        try:
            discovery = self.backend.discover()
            readings: list[tuple[Gpu, Reading]] = []
            for g in discovery.gpus:
                self._begin_read(g.uuid)
                readings.append((g, self.backend.read(g)))
                with self._cycle_lock:
                    self._read_this_cycle.add(g.uuid)
        finally:
            with self._cycle_lock:
                self._cycle_started = None
                self._reading = None
        skipped = self._skipped_checks()
        self._watch_busy(readings)  # before the lock: it may ask the kubelet, which can take a moment
        with self._lock:
            self._unavailable = skipped
            for g, _ in readings:
                if self._stalled.pop(g.uuid, None) is not None:
                    log.info("device %s: its NVML read returned again", g.uuid)
            current = {g.uuid for g in discovery.gpus}
            dirty = False
            for uuid in list(self._trackers):
                if uuid not in current:
                    log.warning("device %s disappeared", uuid)
                    if self.recovery is not None:
                        self.recovery.cancel(uuid)
                    self._shelve(self._trackers.pop(uuid))
                    if self.busy_watch is not None:
                        self.busy_watch.forget(uuid)
                    self._gone.add(uuid)
                    self._gpus.pop(uuid, None)
                    dirty = True
            self._take_check_results()
            for gpu, reading in readings:
                tracker = self._trackers.get(gpu.uuid)
                back = False
                if tracker is None:
                    self._note_replacement(gpu)
                    tracker = self._new_tracker(gpu.uuid)
                    back = gpu.uuid in self._gone
                    self._gone.discard(gpu.uuid)
                    dirty = True
                self._gpus[gpu.uuid] = gpu
                dirty = self._sync_mig_trackers(gpu) or dirty
                applied = list(tracker.observe_reading(reading))
                if back:
                    why = "GPU reset: it left NVML and came back (a reset or driver reload)"
                    tracker.clear_by(Clear.RESET, why, reading.time)
                    applied.append((Clear.RESET, why))
                for kind, why in applied:
                    log.info("device %s: %s", gpu.uuid, why)
                    dirty = True
                    if kind != Clear.RESET:
                        continue
                    for t in self._mig_trackers.values():
                        if t.device_id.startswith(gpu.uuid + "/"):
                            t.clear_by(kind, why, reading.time)
                for t in self._mig_trackers.values():
                    # A MIG device's own latches from before a reboot are judged on its GPU's read, like the GPU's.
                    if t.device_id.startswith(gpu.uuid + "/") and t.judge_reboot(reading):
                        dirty = True
                if self.recovery is not None:
                    if tracker.awaiting_check:
                        self.recovery.request(gpu)
                    else:
                        # No longer waiting (the operator cleared it, or it failed again): a queued or running
                        # check must not start under a workload scheduled since.
                        self.recovery.cancel(gpu.uuid)
            now = self.clock()
            if discovery.error is None:  # a failed discovery says nothing of which GPUs NVML has
                self._check_inventory(discovery.gpus, now)
            transitions = self._publish_locked(now, discovery.error)
        self.last_poll_at = now
        elapsed = time.perf_counter() - started
        self.poll_durations.append(elapsed)
        self.polls += 1
        self.poll_seconds += elapsed
        if len(self.poll_durations) > 1000:
            del self.poll_durations[:500]
        if self.persister is not None and (dirty or transitions):
            self.persister.mark_dirty()
        return transitions

    def _sync_mig_trackers(self, gpu: Gpu) -> bool:
        """Give every advertised MIG device its saved tracker back, and shelve those of instances that are gone.

        MIG trackers are otherwise born on events only, so a latch saved for one would never be loaded again, and
        the next state write would drop it."""
        changed = False
        advertised = {f"{gpu.uuid}/{m.uuid}" for m in gpu.mig_devices}
        for key in advertised:
            if key not in self._mig_trackers and key in self._saved:
                self._new_tracker(key)
                changed = True
        for key in [k for k in self._mig_trackers if k.startswith(gpu.uuid + "/") and k not in advertised]:
            log.warning("MIG device %s disappeared", key)
            self._shelve(self._mig_trackers.pop(key))
            changed = True
        return changed

    def _shelve(self, tracker: DeviceTracker) -> None:
        # A device that is gone keeps what it had latched: if it comes back (after a rescan, a MIG re-layout or a
        # plugin restart) it has not been seen reset, so the fault still holds.
        for key in [m for m in self._mig_trackers if m.startswith(tracker.device_id + "/")]:
            self._shelve(self._mig_trackers.pop(key))
        saved = tracker.to_dict()
        if _worth_keeping(saved):
            self._saved[tracker.device_id] = saved

    def _take_check_results(self) -> None:
        if self.recovery is None:
            return
        for result in self.recovery.results():
            tracker = self._trackers.get(result.device_id)
            if tracker is None or not tracker.awaiting_check:
                continue  # the GPU went, or the operator cleared it meanwhile
            log.log(logging.INFO if result.passed else logging.ERROR, "device %s: recovery check %s: %s",
                    result.device_id, "passed" if result.passed else "failed", result.detail)
            tracker.check_result(result.passed, result.detail, self.clock())

    def _note_replacement(self, gpu: Gpu) -> None:
        """A new UUID at a PCI address another GPU had: it starts clean (its own tracker), and the old UUID's
        saved record stays in the state file, readable, under its own UUID."""
        if not gpu.pci_bus_id:
            return
        for uuid, saved in self._saved.items():
            if uuid != gpu.uuid and "/" not in uuid and saved.get("pci") == gpu.pci_bus_id \
                    and uuid not in self._trackers:
                log.warning("device %s at PCI %s replaces %s: it starts clean; the old GPU's record stays in the "
                            "state file", gpu.uuid, gpu.pci_bus_id, uuid)
                saved["replaced_by"] = gpu.uuid

    def clear(self, device_id: str | None, code: str | None, note: str, now: float | None = None) \
            -> list[tuple[str, str]]:
        """The operator's clear: ``device_id`` a GPU or MIG device UUID or a GPU index (None: every device);
        ``code`` one reason (None: all that may be cleared). Refused with ClearRefused, changing nothing, while a
        condition is still present. Published at once; the transition's note names the operator's note."""
        when = self.clock() if now is None else now
        with self._lock:
            targets = self._clear_targets(device_id)
            codes = frozenset({code}) if code else None
            if device_id is not None or code is not None:
                # Judge every target before touching any, so a refusal changes nothing.
                for t in targets:
                    self._refuse_foreign(t, code)
            done: list[tuple[str, str]] = []
            refusals: list[str] = []
            for t in targets:
                try:
                    for c in t.operator_clear(codes, note, when):
                        done.append((t.device_id.rsplit("/", 1)[-1], c))
                except ClearRefused as exc:
                    if device_id is not None:
                        raise
                    refusals.append(str(exc))
            if not done:
                raise ClearRefused(refusals[0] if len(refusals) == 1 else
                                   "nothing to clear on any device" + (f" ({'; '.join(refusals)})" if refusals else ""))
            if self.recovery is not None:
                for t in targets:
                    if "/" not in t.device_id and not t.awaiting_check:
                        self.recovery.cancel(t.device_id)  # at once, not at the next poll
            self._publish_locked(when)
        if self.persister is not None:
            self.persister.mark_dirty()
        for dev, c in done:
            log.warning("device %s: %s cleared by the operator: %s", dev, c, note)
        return done

    def _clear_targets(self, device_id: str | None) -> list[DeviceTracker]:
        if device_id is None:
            return [*self._trackers.values(), *self._mig_trackers.values()]
        if device_id in self._trackers:
            return [self._trackers[device_id]]
        for key, t in self._mig_trackers.items():
            if key.rsplit("/", 1)[-1] == device_id:
                return [t]
        if device_id.isdigit():
            for uuid, gpu in self._gpus.items():
                if gpu.index == int(device_id) and uuid in self._trackers:
                    return [self._trackers[uuid]]
        for gpu in self._gpus.values():
            for mig in gpu.mig_devices:
                if mig.uuid == device_id:
                    # A MIG device with no reasons of its own has no tracker: what it shows is its GPU's.
                    raise ClearRefused(f"{device_id}: its reasons are its GPU's ({gpu.uuid}): clear that GPU")
        raise ClearRefused(f"no device {device_id!r} on this node (a GPU UUID, a MIG device UUID or a GPU index)")

    def _refuse_foreign(self, tracker: DeviceTracker, code: str | None) -> None:
        """Reasons the tracker does not hold are not the operator's to clear here: the monitor's own and another
        provider's clear when their cause does."""
        uuid = tracker.device_id.split("/", 1)[0]
        if code is None:
            return
        if code == "nvml-stalled" and uuid in self._stalled:
            raise ClearRefused(f"{uuid}: nvml-stalled is still present: it clears when the hung NVML call returns")
        if code == "nvml-check-unavailable" and uuid in self._unavailable:
            raise ClearRefused(f"{uuid}: nvml-check-unavailable clears with another driver version "
                               "(`gpu-health-plugin inspect` names the call)")
        if any(r.code == code for r in self._external.get(uuid.lower(), ())):
            raise ClearRefused(f"{uuid}: {code} is another health provider's: it clears when that provider says so")

    def _new_tracker(self, device_id: str) -> DeviceTracker:
        # Only whole GPUs wait for a recovery check: the check runs on a GPU, and a MIG device shows its GPU's wait.
        tracker = DeviceTracker(device_id, self.cfg, boot_id=self.boot_id,
                                gated=self.recovery is not None and "/" not in device_id)
        saved = self._saved.pop(device_id, None)
        if saved:
            tracker.load(saved)
            log.info("device %s: restored %s with %d latched reasons from the state dir",
                     device_id, tracker.state.value, len(saved.get("latched", [])))
        if "/" in device_id:
            self._mig_trackers[device_id] = tracker
        else:
            self._trackers[device_id] = tracker
        return tracker

    def _mig_tracker_for(self, uuid: str, gi: int) -> DeviceTracker | None:
        gpu = self._gpus.get(uuid)
        if gpu is None:
            return None
        for mig in gpu.mig_devices:
            if mig.gpu_instance_id == gi:
                key = f"{uuid}/{mig.uuid}"
                return self._mig_trackers.get(key) or self._new_tracker(key)
        return self._trackers.get(uuid)  # an instance we do not advertise: charge the whole GPU

    def _watch_busy(self, readings: Sequence[tuple[Gpu, Reading]]) -> None:
        watch, busy = self.busy_watch, self.busy
        if watch is None or busy is None:
            return
        now = self.clock()
        for gpu, reading in readings:
            if reading.lost:
                continue  # a lost GPU lists nothing: its streak stands until it answers again
            before = watch.reason(gpu.uuid)
            after = watch.observe(gpu.uuid, reading.compute_processes, now, functools.partial(busy, gpu))
            if after is not None and (before is None or before.message != after.message):
                log.warning("device %s: %s: %s", gpu.uuid, after.code, after.message)
            elif after is None and before is not None:
                log.info("device %s: %s cleared", gpu.uuid, before.code)

    def set_expected_gpus(self, n: int | None) -> None:
        """How many GPUs the node should have, from the node's label when no --expected-gpus was given; judged at the
        next poll."""
        if n != self.expected_gpus:
            log.info("expecting %s GPUs on this node", n if n is not None else "no particular number of")
            self.expected_gpus = n
            self.request_poll()

    def note_unknown_gpu(self, pci: PciAddress, what: str) -> None:
        """The kernel log names a GPU at ``pci`` that NVML does not list (a line the driver wrote about it: an
        RmInitAdapter failure, an XID): evidence of a GPU missing from NVML, as the PCI bus would be. Kept in
        memory until NVML lists a GPU there; judged at the next poll."""
        if pci not in self._logged_missing:
            self._logged_missing[pci] = what
            self.request_poll()

    def _check_inventory(self, gpus: Sequence[Gpu], now: float) -> None:
        in_nvml = [a for g in gpus if (a := pci_address(g.pci_bus_id)) is not None]
        for a in in_nvml:
            self._logged_missing.pop(a, None)  # NVML lists a GPU there (now): the log's word is old news
        if self.inventory is None and self.expected_gpus is None and not self._logged_missing \
                and self._missing.reason is None:
            return  # nothing to look at, and nothing raised that a clean look would have to take off
        on_bus = self.inventory() if self.inventory is not None else None
        logged = dict(self._logged_missing)
        c = inventory_condition(on_bus, in_nvml, len(gpus), self.expected_gpus, self.cfg, logged)
        before = self._missing.reason
        self._missing.observe(c, now)
        self.gpus_missing = max(len((set(on_bus or ()) | set(logged)) - set(in_nvml)),
                                (self.expected_gpus or 0) - len(gpus), 0) if c is not None else 0
        after = self._missing.reason
        if after is not None and (before is None or before.message != after.message):
            log.warning("node: %s: %s", after.code, after.message)
        elif after is None and before is not None:
            log.info("node: %s cleared: every GPU is there again", before.code)

    def _publish_locked(self, now: float, error: str | None = None) -> list[Transition]:
        statuses: list[DeviceStatus] = []
        mapping = self.cfg.kubelet_health
        for uuid, tracker in sorted(self._trackers.items(), key=lambda kv: self._gpus[kv[0]].index):
            gpu = self._gpus[uuid]
            state, reasons = tracker.update(now)
            since = tracker.since
            external = self._external.get(uuid.lower(), ())
            # The monitor's own findings (a hung read, checks the backend skips) ride along like another provider's.
            busy = self.busy_watch.reason(uuid) if self.busy_watch is not None else None
            found = tuple(r for r in (self._stalled.get(uuid), self._unavailable.get(uuid), busy) if r is not None)
            if found:
                external = (*found, *external)
                since = max(since, *(r.first_seen for r in found))
            if external:
                state = State.worst(state, *(r.severity for r in external))
                reasons = reasons + external
            if uuid.lower() in self._external_at:
                # The state may have moved with the other provider's reasons: the node state keeps the older
                # ``since`` while the state holds, so the later of the two moments is right either way.
                since = max(since, self._external_at[uuid.lower()])
            if self.recovery is not None and tracker.awaiting_check:
                reasons = self._with_waiting(uuid, reasons)
            statuses.append(DeviceStatus(uuid, gpu, state, reasons, since, mapping[state], cleared=tracker.cleared))
            for mig in gpu.mig_devices:
                own = self._mig_trackers.get(f"{uuid}/{mig.uuid}")
                m_state, m_reasons, m_since, m_cleared = state, reasons, since, tracker.cleared
                if own is not None:
                    o_state, o_reasons = own.update(now)
                    m_state = State.worst(state, o_state)
                    m_reasons = o_reasons + reasons
                    m_since = max(m_since, own.since)
                    if own.cleared is not None and (m_cleared is None or own.cleared.time > m_cleared.time):
                        m_cleared = own.cleared
                statuses.append(DeviceStatus(mig.uuid, gpu, m_state, m_reasons, m_since, mapping[m_state], mig,
                                             m_cleared))
        node = (self._missing.reason,) if self._missing.reason is not None else ()
        transitions = self.state.publish(statuses, now, error, node)
        for t in transitions:
            log.info("transition #%d %s: %s -> %s %s", t.seq, t.id, t.from_state, t.to_state,
                     ",".join(r.code for r in t.reasons) or "-")
        return transitions

    def _with_waiting(self, uuid: str, reasons: tuple[Reason, ...]) -> tuple[Reason, ...]:
        """The pending reason says why its check has not run yet (a pod holds the GPU, another check runs)."""
        assert self.recovery is not None
        why = self.recovery.waiting(uuid)
        if not why:
            return reasons
        return tuple(replace(r, message=f"{r.message} ({why})") if r.code == "recovery-check-pending" else r
                     for r in reasons)

    def _collect(self) -> dict[str, Any]:
        with self._lock:
            # Saved entries of devices not (yet) seen since the restart are written back unchanged: losing them
            # would silently heal a GPU that merely came up late.
            devices = {k: v for k, v in self._saved.items() if _worth_keeping(v)}
            devices.update({k: t.to_dict() for k, t in {**self._trackers, **self._mig_trackers}.items()})
            for uuid, gpu in self._gpus.items():
                if uuid in devices and gpu.pci_bus_id:
                    devices[uuid]["pci"] = gpu.pci_bus_id  # to tell a replaced GPU from a new one later
        return {"devices": devices, "transitions": [t.to_dict() for t in self.state.history()[-256:]]}


def _readable_transitions(saved: list[Any]) -> list[Transition]:
    """The saved transitions this release can read. One written by a later release (a reason source or state added
    since) is skipped with a line, not raised: after a rollback the plugin must start, and the history is a record
    for resuming watchers, not state a verdict depends on."""
    out: list[Transition] = []
    for entry in saved:
        try:
            out.append(Transition.from_dict(entry))
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("saved transition %s skipped: this release cannot read it (%s)",
                        entry.get("seq", "?") if isinstance(entry, dict) else "?", exc)
    return out


def _worth_keeping(saved: dict[str, Any]) -> bool:
    """Whether a device's saved entry holds anything a poll could not re-derive."""
    return bool(saved.get("latched") or saved.get("rate_held") or saved.get("app_xids")
                or saved.get("backoff_until") or saved.get("awaiting"))
