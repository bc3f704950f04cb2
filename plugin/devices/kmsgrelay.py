"""``gpu-health-plugin kernel-log-relay``: copies the kernel log to a FIFO, so that only this process needs what
opening ``/dev/kmsg`` takes in a container (the device cgroup lets no unprivileged container open it) while the
plugin itself stays unprivileged and reads the FIFO (``--kernel-log`` on the FIFO's path).

Each time a reader opens the FIFO, the relay opens the kernel log afresh, which starts it at the oldest record in
the ring, and copies every record as it comes. The reader's cursor (``kernellog.py``) skips what it has already
read; the sequence numbers travel untouched, so a gap in them still means records were lost. When the reader goes
(a plugin restart), the relay waits for the next one. Nothing is parsed here: the relay only moves bytes.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import stat
import threading
from pathlib import Path

log = logging.getLogger(__name__)

READ_SIZE = 1 << 16


class Relay:
    def __init__(self, source: Path, fifo: Path, stop: threading.Event | None = None) -> None:
        self.source = source
        self.fifo = fifo
        self.stop = stop or threading.Event()
        self.sessions = 0  # readers served, for tests and the log
        self._wake_r, self._wake_w = os.pipe()

    def prepare(self) -> None:
        """Make the FIFO (0600: only root, the plugin, reads it) unless it is one already; raises what goes wrong."""
        try:
            mode = self.fifo.lstat().st_mode
        except FileNotFoundError:
            os.mkfifo(self.fifo, 0o600)
            return
        if not stat.S_ISFIFO(mode):
            raise OSError(errno.EEXIST, f"{self.fifo} exists and is not a FIFO")

    def wake(self) -> None:
        self.stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def run(self) -> None:
        """Serve readers until ``stop``. Opening the source is retried, never fatal: the plugin's own metric says
        whether the kernel log is being read."""
        said = False
        while not self.stop.is_set():
            out = self._open_reader_side()
            if out is None:
                return
            try:
                src = os.open(self.source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                os.close(out)
                if not said:
                    log.error("kernel-log-relay: cannot read %s (%s); trying again every 30s", self.source,
                              exc.strerror or exc)
                    said = True
                if self._wait([], 30.0):
                    return
                continue
            said = False
            self.sessions += 1
            try:
                self._copy(src, out)
            finally:
                os.close(src)
                os.close(out)

    def _open_reader_side(self) -> int | None:
        """Open the FIFO for writing once a reader has it open (O_NONBLOCK answers ENXIO until then)."""
        while not self.stop.is_set():
            try:
                fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
                # No reader: a FIFO gives no event for one arriving, so look again shortly (the plugin is
                # normally there; this only runs while it restarts).
                if self._wait([], 0.5):
                    return None
                continue
            os.set_blocking(fd, True)  # a full FIFO holds the relay back rather than dropping records
            return fd
        return None

    def _wait(self, fds: list[int], timeout: float | None) -> bool:
        """Wait for ``fds`` or the timeout; True when woken to stop."""
        ready, _, _ = select.select([self._wake_r, *fds], [], [], timeout)
        return self._wake_r in ready or self.stop.is_set()

    def _copy(self, src: int, out: int) -> None:
        per_read = stat.S_ISCHR(os.fstat(src).st_mode)
        poller = select.poll()
        if per_read:
            poller.register(src, select.POLLIN | select.POLLPRI)
        poller.register(out, 0)  # POLLERR, always reported: the reader closed the FIFO
        poller.register(self._wake_r, select.POLLIN)
        while not self.stop.is_set():
            try:
                data = os.read(src, READ_SIZE)
            except BlockingIOError:
                data = None
            except OSError as exc:
                if exc.errno in (errno.EPIPE, errno.EINTR):
                    continue  # records overwritten before we read them: the reader sees the gap in the numbers
                raise
            if data:
                if per_read and not data.endswith(b"\n"):
                    data += b"\n"
                try:
                    while data:
                        data = data[os.write(out, data):]
                except BrokenPipeError:
                    return  # the reader went: wait for the next one
                continue
            # Nothing to read: wait for a record (/dev/kmsg: no timeout, so an idle log costs nothing; a regular
            # file, which only tests use, is looked at again each second), the reader leaving, or the stop.
            for fd, ev in poller.poll(None if per_read else 1000):
                if fd == self._wake_r or (fd == out and ev & (select.POLLERR | select.POLLHUP)):
                    return
