"""The kernel log as a second source of driver events (``--kernel-log``, normally ``/dev/kmsg``).

NVML's event set only reports what happens while the process listens: an XID logged during a rolling upgrade, or in
the seconds after boot before the plugin was up, is lost to it. The kernel keeps every record of the boot in its
ring, numbered, so this reader reads the ring from its start and keeps a cursor (the boot id and the last sequence
number handed on) in the state dir: after a restart the records of the same boot after the cursor are read once;
after a reboot the new boot's whole ring is. A ring that wrapped past the cursor (or lost the boot's first records
before we ever read it) is said once per gap, and reading goes on.

Records are folded per batch (one GPU, one kind, one code: one event with a count), so a flood of one XID is a few
events, not hundreds of thousands, and memory stays bounded by the distinct faults. The driver's lines name a GPU by
PCI address; ``resolve`` maps it to the GPU NVML sees there. A line for an address no GPU has (a GPU that never
initialised, an NVSwitch's SXid) is counted and logged once per address, never an error.

Idle costs nothing: ``/dev/kmsg`` and a FIFO are waited on with ``poll`` and no timeout (a wake-up pipe ends the
wait at shutdown). A regular file, which only tests use, is re-read every ``file_poll_s`` once at its end.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import select
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from plugin.atomicfile import write_atomic
from plugin.devices.kmsg import KINDS, DriverLine, LineKind, PciAddress, Record, driver_line, parse_record, pci_text
from plugin.devices.model import EventKind, EventOrigin, GpuEvent

log = logging.getLogger(__name__)

CURSOR_FILE = "kernel-log.json"
MAX_BATCH = 20_000  # records folded into one hand-over at most, so a flood's cursor moves on as it is read
READ_SIZE = 1 << 16  # larger than any record (the kernel refuses a read shorter than the record)
LOST_LOG_EVERY_S = 60.0  # a ring that keeps wrapping under a flood is counted each time, logged this often


def _uptime() -> float:
    # The kernel's record timestamps count from boot on the monotonic clock (suspend excluded).
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# A flood is the same few messages over and over: each distinct one is matched once.
_driver_line = functools.lru_cache(maxsize=4096)(driver_line)


@dataclass
class KernelLogStats:
    """Counters for /metrics; every label from a closed set, each present from the start."""

    readable: bool = False
    records: int = 0  # every record read (after the cursor)
    driver_lines: dict[str, int] = field(default_factory=lambda: {k.value: 0 for k in KINDS})
    unmatched: dict[str, int] = field(default_factory=lambda: {k.value: 0 for k in KINDS})
    malformed: int = 0
    lost: int = 0  # gaps: records the ring no longer held when we came to read them


class KernelLog:
    def __init__(self, path: Path, state_dir: Path | None, boot_id: str,
                 resolve: Callable[[PciAddress], str | None],
                 deliver: Callable[[Sequence[GpuEvent]], object],
                 clock: Callable[[], float] = time.time, uptime: Callable[[], float] = _uptime,
                 retry_s: float = 30.0, file_poll_s: float = 1.0,
                 unknown_gpu: Callable[[PciAddress, str], None] | None = None) -> None:
        # Told of a GPU's line (not an NVSwitch's) at an address where NVML has no GPU: the monitor's gpu-missing.
        self._unknown_gpu = unknown_gpu
        self.path = path
        self.boot_id = boot_id
        self._resolve = resolve
        self._deliver = deliver
        self._clock = clock
        self._uptime = uptime
        self._retry_s = retry_s
        self._file_poll_s = file_poll_s
        self._cursor_path = state_dir / CURSOR_FILE if state_dir is not None else None
        self.stats = KernelLogStats()
        self.last_seq: int | None = self._load_cursor()
        self._saved_seq = self.last_seq
        self.done_seq = self.last_seq  # the last record whose events were handed on (last_seq runs ahead in a batch)
        self._said: set[tuple[str, PciAddress, int]] = set()  # unmatched lines logged once each
        self._resolved: dict[PciAddress, str | None] = {}
        self._lost_logged_at = -LOST_LOG_EVERY_S
        self._unreadable_said = False
        self._stopping = threading.Event()
        # Notified after each batch and each open or failed open: how a caller awaits the reader (tests, benches).
        self._progress = threading.Condition()
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None

    # Lifecycle ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kernel-log", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        self._stopping.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        try:  # a reader waiting in a FIFO's open for a writer: be that writer for a moment
            os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        except OSError:
            pass  # no FIFO, or nobody waiting on it
        if self._thread is not None:
            self._thread.join(timeout)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def wait(self, until: Callable[[KernelLog], bool], timeout: float) -> bool:
        """Block until ``until(self)`` holds after a batch or an open (or at once); False at the timeout."""
        with self._progress:
            return self._progress.wait_for(lambda: until(self), timeout)

    def wait_read(self, seq: int, timeout: float = 10.0) -> bool:
        """Block until the record numbered ``seq`` (or a later one) has been handed on."""
        return self.wait(lambda k: k.done_seq is not None and k.done_seq >= seq, timeout)

    def _progressed(self) -> None:
        with self._progress:
            self._progress.notify_all()

    # The cursor -----------------------------------------------------------------------------------------------

    def _load_cursor(self) -> int | None:
        if self._cursor_path is None:
            return None
        try:
            doc = json.loads(self._cursor_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("kernel log cursor %s unreadable (%s): reading this boot's records from the start",
                        self._cursor_path, exc)
            return None
        if not isinstance(doc, dict) or doc.get("boot_id") != self.boot_id or not isinstance(doc.get("seq"), int):
            return None  # another boot (or none recorded): its whole ring is new
        return int(doc["seq"])

    def _save_cursor(self) -> None:
        if self._cursor_path is None or self.last_seq == self._saved_seq:
            return
        try:
            write_atomic(self._cursor_path, json.dumps({"boot_id": self.boot_id, "seq": self.last_seq}).encode())
            self._saved_seq = self.last_seq
        except OSError as exc:
            log.error("kernel log cursor %s not written: %s", self._cursor_path, exc)

    # Reading --------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                fd = self._open()
            except OSError as exc:
                self.stats.readable = False
                if not self._unreadable_said:
                    log.error("kernel log %s cannot be read (%s): driver events come from NVML alone; trying again "
                              "every %gs", self.path, exc.strerror or exc, self._retry_s)
                    self._unreadable_said = True
                self._progressed()
                self._sleep(self._retry_s)
                continue
            self.stats.readable = True
            self._progressed()
            if self._unreadable_said:
                log.info("kernel log %s: reading", self.path)
                self._unreadable_said = False
            try:
                self._follow(fd)
            except OSError as exc:
                self.stats.readable = False
                log.error("kernel log %s: read failed (%s); opening it again in %gs", self.path, exc, self._retry_s)
                self._unreadable_said = True
                self._sleep(self._retry_s)
            except Exception:  # a bug here must not end the reader (or anything else)
                log.exception("kernel log %s: reader failed; opening it again in %gs", self.path, self._retry_s)
                self._sleep(self._retry_s)
            finally:
                os.close(fd)

    def _open(self) -> int:
        """A FIFO is opened blocking, which waits for a writer (the relay): opened non-blocking with none, every
        read would be an end of file at once, and the reader would spin. Then it is read non-blocking like the
        rest. ``close`` wakes a wait here by opening the FIFO for writing itself."""
        try:
            fifo = stat.S_ISFIFO(os.stat(self.path).st_mode)
        except OSError:
            fifo = False
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | (0 if fifo else os.O_NONBLOCK))
        if fifo:
            os.set_blocking(fd, False)
        return fd

    def _sleep(self, seconds: float) -> None:
        select.select([self._wake_r], [], [], seconds)

    def _follow(self, fd: int) -> None:
        mode = os.fstat(fd).st_mode
        per_read = stat.S_ISCHR(mode)  # /dev/kmsg: one record per read
        regular = stat.S_ISREG(mode)
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI)
        poller.register(self._wake_r, select.POLLIN)
        partial = b""
        while not self._stopping.is_set():
            lines: list[bytes] = []
            at_end = False
            eof = False
            while len(lines) < MAX_BATCH:
                try:
                    data = os.read(fd, READ_SIZE)
                except BlockingIOError:
                    at_end = True
                    break
                except OSError as exc:
                    if exc.errno == errno.EPIPE:
                        continue  # records overwritten under us: the sequence gap says so at the next record
                    if exc.errno == errno.EINTR:
                        continue
                    raise
                if not data:
                    at_end = eof = True
                    break
                if per_read:
                    lines.append(data.split(b"\n", 1)[0])
                    continue
                chunk = partial + data
                *whole, partial = chunk.split(b"\n")
                lines.extend(whole)
            self._take(lines)
            if eof and not regular:
                if partial.strip():
                    self.stats.malformed += 1  # a writer left a record half-written
                return  # the FIFO's writer left: open it again for the next one
            if not at_end:
                continue
            if regular:
                self._sleep(self._file_poll_s)
            else:
                poller.poll()

    def _take(self, lines: list[bytes]) -> None:
        if not lines:
            return
        now = self._clock()
        boot_wall = now - self._uptime()
        folded: dict[tuple[str, EventKind, int], list[float | int]] = {}
        self._resolved = {}  # per batch: the GPU set may change between batches
        for line in lines:
            if not line or line[:1] == b" ":
                continue  # a continuation line: the record's dictionary
            rec = parse_record(line)
            if rec is None:
                self.stats.malformed += 1
                continue
            if self.last_seq is not None and rec.seq <= self.last_seq:
                continue  # handed on before (this boot, before a restart, or before a FIFO's writer came back)
            self._gap(rec)
            self.last_seq = rec.seq
            self.stats.records += 1
            d = _driver_line(rec.message)
            if d is not None:
                self._driver(d, rec, min(now, boot_wall + rec.time_us / 1e6), folded)
        if folded:
            events = [GpuEvent(uuid, kind, code, float(first), origin=EventOrigin.KERNEL_LOG, repeats=int(n))
                      for (uuid, kind, code), (first, n) in folded.items()]
            events.sort(key=lambda e: e.time)
            self._deliver(events)
        self._save_cursor()
        self.done_seq = self.last_seq
        self._progressed()

    def _gap(self, rec: Record) -> None:
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if rec.seq <= expected:
            return
        self.stats.lost += 1
        now = time.monotonic()
        if now - self._lost_logged_at < LOST_LOG_EVERY_S:
            return
        self._lost_logged_at = now
        if self.last_seq is None:
            log.warning("kernel log %s: records 0-%d of this boot are gone from the ring; driver events among "
                        "them may have been missed", self.path, rec.seq - 1)
        else:
            log.warning("kernel log %s: records %d-%d were overwritten before they were read; driver events among "
                        "them may have been missed", self.path, expected, rec.seq - 1)

    def _driver(self, d: DriverLine, rec: Record, when: float,
                folded: dict[tuple[str, EventKind, int], list[float | int]]) -> None:
        self.stats.driver_lines[d.kind.value] += 1
        uuid = None
        if d.kind != LineKind.SXID:
            if d.pci not in self._resolved:
                self._resolved[d.pci] = self._resolve(d.pci)
            uuid = self._resolved[d.pci]
        if uuid is None:
            self.stats.unmatched[d.kind.value] += 1
            key = (d.kind.value, d.pci, d.code)
            if key not in self._said and len(self._said) < 1024:
                self._said.add(key)
                log.warning("kernel log: %s at PCI %s, which no GPU NVML sees has (record %d): %s", d.kind.value,
                            pci_text(d.pci), rec.seq, rec.message[:200])
            if d.kind != LineKind.SXID and self._unknown_gpu is not None:
                self._unknown_gpu(d.pci, d.kind.value)
            return
        if d.kind == LineKind.XID:
            kind, code = EventKind.XID, d.code
        elif d.kind == LineKind.FELL_OFF_BUS:
            kind, code = EventKind.XID, 79  # what XID 79 means; the same reason and remedy
        else:
            kind, code = EventKind.GPU_UNAVAILABLE, 0  # the driver failed to initialise a GPU NVML still lists
        slot = folded.get((uuid, kind, code))
        if slot is None:
            folded[(uuid, kind, code)] = [when, 1]
        else:
            slot[1] += 1
