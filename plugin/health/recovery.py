"""The recovery check: an operator's command run on a GPU before a latched or held fault clears (``--recovery-check``,
docs/recovery-check.md).

A reboot, a reset or a hold time says the cause of a fault is probably gone; a diagnostic says the GPU works. When a
check is configured the monitor asks for one (``request``) instead of clearing, and clears only on a pass. The checker
runs one check at a time per node (a diagnostic loads the GPU, the PCIe fabric and the host engine; two at once would
slow each other and could fail each other), never on a GPU a pod holds, and each within its timeout. The command is
split like a shell would split it but never run through one: ``{index}``, ``{uuid}`` and ``{pci}`` are substituted in
each argument after the split, so a value can never become shell syntax or a second argument.

What a check leaves behind is killed with it: the command runs in a session of its own, and when it exits, times out
or is stopped, its whole process group is killed, so a background helper of one check never overlaps the next.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shlex
import signal
import string
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from plugin.devices.model import Gpu

log = logging.getLogger(__name__)

PLACEHOLDERS = ("index", "uuid", "pci")
DETAIL_CHARS = 400  # the end of the output that goes into the reason's message (one line)
_CSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")  # a terminal control sequence (colours, cursor moves)
OUTPUT_BYTES = 16384  # the end of the output kept for the log; a chatty or runaway command never grows memory


@dataclass(frozen=True)
class CheckResult:
    device_id: str  # GPU UUID
    passed: bool
    detail: str  # one line for the reason message: "exit 3: <last output, bounded>", "timed out after 300 s"


class RecoveryChecker(Protocol):
    def request(self, gpu: Gpu) -> None:
        """Ask for a check of ``gpu``; idempotent. It runs later, one at a time per node, never on a busy GPU."""
        ...

    def cancel(self, uuid: str) -> None:
        """The fault came back or was cleared otherwise: drop a queued check (a running one is killed, unreported)."""
        ...

    def results(self) -> list[CheckResult]:
        """The checks finished since the last call, drained."""
        ...

    def waiting(self, uuid: str) -> str:
        """"" when no check of that GPU is queued or running, else why it has not finished: "queued", "running",
        "held by pod ns/name"."""
        ...


# The command template ------------------------------------------------------------------------------------------

def validate_template(template: str) -> str | None:
    """Why ``template`` cannot be a recovery check command (one line), or None when it can."""
    try:
        argv = shlex.split(template)
    except ValueError as exc:  # "No closing quotation", "No escaped character"
        return f"cannot split the command like a shell would: {str(exc).lower()}"
    if not argv:
        return "expected a command, got an empty one"
    known = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
    for arg in argv:
        try:
            parts = list(string.Formatter().parse(arg))
        except ValueError:  # "Single '}' encountered in format string", "expected '}' before end of string"
            return f"unbalanced brace in {arg!r} (placeholders are {known}; {{{{ and }}}} are literal braces)"
        for _, name, spec, conversion in parts:
            if name is None:
                continue
            field = "{" + name + "}"
            where = f" in {arg!r}" if arg != field else ""
            if name not in PLACEHOLDERS:
                return f"unknown placeholder {field}{where} (known: {known}; {{{{ and }}}} are literal braces)"
            if spec or conversion:
                return f"placeholder {{{name}}}{where} takes no conversion or format"
    return None


def command_for(template: str, gpu: Gpu) -> list[str]:
    """The argv of a check of ``gpu``: the template split, then each argument's placeholders substituted."""
    values = {"index": str(gpu.index), "uuid": gpu.uuid, "pci": gpu.pci_bus_id}
    return [arg.format_map(values) for arg in shlex.split(template)]


def one_line(output: bytes, limit: int = DETAIL_CHARS) -> str:
    """The end of a command's output as one line of at most ``limit`` characters: every run of whitespace (line
    breaks included) one space, other control characters (a terminal's colours) dropped, the start cut off when it is
    too long (the verdict of a diagnostic is at its end)."""
    text = re.sub(r"\s+", " ", _CSI.sub("", output.decode("utf-8", "replace")))
    text = "".join(c for c in text if c.isprintable()).strip()
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


# The checker -----------------------------------------------------------------------------------------------------

class _Tail:
    """The last ``limit`` bytes of a stream, filled by one reader thread and read once it is done."""

    def __init__(self, limit: int = OUTPUT_BYTES) -> None:
        self.limit = limit
        self.data = bytearray()
        self.cut = False
        self.done = threading.Event()

    def read_from(self, pipe: IO[bytes]) -> None:
        try:
            while chunk := os.read(pipe.fileno(), 65536):
                self.data += chunk
                if len(self.data) > self.limit:
                    del self.data[:len(self.data) - self.limit]
                    self.cut = True
        except OSError:
            pass
        finally:
            pipe.close()
            self.done.set()


@dataclass
class _Running:
    gpu: Gpu
    started: float
    proc: subprocess.Popen[bytes] | None = None  # None until it has started
    exited: bool = False
    cancelled: bool = False

    def kill(self, sig: signal.Signals) -> None:
        """Signal the check's whole process group. Only while its leader is unreaped: until then its ID cannot
        name another process group, so the signal reaches only what this check started."""
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class CommandRecoveryChecker:
    """Runs ``template`` (``validate_template`` has passed it) for each requested GPU, one at a time, in a worker
    thread started on the first request.

    ``busy(gpu)`` says why the GPU may not be checked now ("held by pod ns/name"; "" when it may): a queued check of a
    busy GPU stays queued and is tried again on the next new request or after ``retry_s``. ``wake`` is called when a
    result is ready. Setting ``stop`` kills a running check (no result: the device stays as it is) and ends the
    worker. ``lock_file``, when given, is held (flock) while a check runs, so two plugin instances on one node (a
    handover) still run one check at a time."""

    def __init__(self, template: str, timeout_s: float, busy: Callable[[Gpu], str], wake: Callable[[], None],
                 stop: threading.Event, *, retry_s: float = 10.0, kill_grace_s: float = 5.0,
                 lock_file: Path | None = None) -> None:
        error = validate_template(template)
        if error is not None:
            raise ValueError(error)
        self.template = template
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.kill_grace_s = kill_grace_s
        self.lock_file = lock_file
        self._busy = busy
        self._wake = wake
        self._stop = stop
        self._cond = threading.Condition()
        self._queue: dict[str, Gpu] = {}  # uuid -> GPU, in request order
        self._why: dict[str, str] = {}  # uuid -> why its queued check has not run (the last busy answer)
        self._results: list[CheckResult] = []
        self._running: _Running | None = None
        self._kicked = False  # a new request or a cancel came while the worker was asking who is busy
        self._worker: threading.Thread | None = None
        self._lock_fd: int | None = None
        # Counters for whoever wants them (metrics, tests): written by the worker only.
        self.runs = 0
        self.failures = 0

    # RecoveryChecker ----------------------------------------------------------------------------------------------

    def request(self, gpu: Gpu) -> None:
        with self._cond:
            if self._stop.is_set():
                return
            run = self._running
            # A running check, or a finished one not yet drained, answers this request already.
            if (run is not None and run.gpu.uuid == gpu.uuid and not run.cancelled) \
                    or any(r.device_id == gpu.uuid for r in self._results):
                return
            new = gpu.uuid not in self._queue
            self._queue[gpu.uuid] = gpu  # the newest discovery of the GPU (its index or PCI address may change)
            if not new:
                return  # asked again each poll: the worker's own retry paces the look at who holds it
            log.info("recovery check of GPU %d %s queued", gpu.index, gpu.uuid)
            self._kicked = True
            self._cond.notify_all()
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="recovery-check", daemon=True)
                self._worker.start()
                threading.Thread(target=self._watch_stop, name="recovery-check-stop", daemon=True).start()

    def cancel(self, uuid: str) -> None:
        """Cheap for a GPU the checker does not know: the monitor may call it for every GPU that is not waiting."""
        with self._cond:
            self._why.pop(uuid, None)
            self._results = [r for r in self._results if r.device_id != uuid]
            changed = False
            if self._queue.pop(uuid, None) is not None:
                log.info("recovery check of %s dropped before it ran", uuid)
                changed = True
            run = self._running
            if run is not None and run.gpu.uuid == uuid and not run.cancelled:
                run.cancelled = True
                log.info("recovery check of GPU %d %s cancelled while running: killing it", run.gpu.index, uuid)
                run.kill(signal.SIGKILL)
                changed = True
            if changed:
                self._kicked = True
                self._cond.notify_all()

    def results(self) -> list[CheckResult]:
        with self._cond:
            out, self._results = self._results, []
            return out

    def waiting(self, uuid: str) -> str:
        with self._cond:
            run = self._running
            if run is not None and run.gpu.uuid == uuid and not run.cancelled:
                return "running"
            if uuid in self._queue:
                return self._why.get(uuid) or "queued"
            return ""

    # Lifecycle ----------------------------------------------------------------------------------------------------

    def join(self, timeout: float) -> None:
        """Wait for the worker to end once ``stop`` is set (a running check is killed by then)."""
        if self._worker is not None:
            self._worker.join(timeout)

    def _watch_stop(self) -> None:
        # The worker waits on its condition, which an Event cannot notify: this thread turns the stop into a notify
        # and kills the running check, so nothing waits on a timer to notice.
        self._stop.wait()
        with self._cond:
            if self._running is not None:
                self._running.kill(signal.SIGKILL)
            self._cond.notify_all()

    # The worker ---------------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while not self._stop.is_set():
            run = self._next()
            if run is None:
                continue
            try:
                result = self._check(run)
            except Exception as exc:  # never lose the worker: the device would wait for a check forever
                log.exception("recovery check of GPU %d %s could not be run", run.gpu.index, run.gpu.uuid)
                result = CheckResult(run.gpu.uuid, False, f"the check could not be run: {exc}")
            finally:
                self._unlock()
            with self._cond:
                self._running = None
                # Cancelled, or stopped: no verdict on the GPU, which stays as it is until it is asked again.
                if result is None or run.cancelled or self._stop.is_set():
                    continue
                self._results.append(result)
            self.runs += 1
            self.failures += not result.passed
            self._wake()

    def _next(self) -> _Running | None:
        """The first queued GPU that may be checked now, taken off the queue and marked running; None to look again
        (after a stop, a new request, a cancel, or ``retry_s`` with every queued GPU busy)."""
        with self._cond:
            while not self._queue and not self._stop.is_set():
                self._cond.wait()
            self._kicked = False
            queued = list(self._queue.values())
        for gpu in queued:
            if self._stop.is_set():
                return None
            why = self._why_not(gpu)  # outside the lock: it may ask the kubelet
            with self._cond:
                if self._queue.get(gpu.uuid) is not gpu:
                    continue  # cancelled or re-requested meanwhile
                if why:
                    if self._why.get(gpu.uuid) != why:
                        log.info("recovery check of GPU %d %s waits: %s", gpu.index, gpu.uuid, why)
                    self._why[gpu.uuid] = why
                    continue
                if not self._lock():
                    self._why[gpu.uuid] = "another gpu-health-plugin on this node is running a recovery check"
                    break
                del self._queue[gpu.uuid]
                self._why.pop(gpu.uuid, None)
                self._running = _Running(gpu, time.monotonic())
                return self._running
        with self._cond:
            if not self._kicked and self._queue and not self._stop.is_set():
                self._cond.wait(self.retry_s)
        return None

    def _why_not(self, gpu: Gpu) -> str:
        try:
            return self._busy(gpu)
        except Exception as exc:  # a predicate that cannot answer must not let a check run under a workload
            return f"cannot tell whether a workload holds it: {exc}"

    def _lock(self) -> bool:
        if self.lock_file is None:
            return True
        try:
            fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            log.warning("recovery check lock %s: %s; running without it", self.lock_file, exc.strerror or exc)
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def _check(self, run: _Running) -> CheckResult | None:
        """Run one check to its end; None when it was cancelled or stopped (no verdict on the GPU)."""
        gpu = run.gpu
        argv = command_for(self.template, gpu)
        label = f"GPU {gpu.index} {gpu.uuid}"
        try:
            # A session of its own: the timeout and the stop kill the process group, helpers included.
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            # A check that cannot start is a failed check, said in the reason; the operator fixes the command.
            detail = f"cannot run {argv[0]}: {exc.strerror or exc}"
            log.warning("recovery check of %s failed: %s", label, detail)
            return CheckResult(gpu.uuid, False, detail)
        log.info("recovery check of %s started: %s", label, shlex.join(argv))
        tail = _Tail()
        assert proc.stdout is not None
        threading.Thread(target=tail.read_from, args=(proc.stdout,), name="recovery-check-output",
                         daemon=True).start()
        threading.Thread(target=self._reap, args=(run, proc.pid), name="recovery-check-reaper",
                         daemon=True).start()
        deadline = run.started + self.timeout_s
        timed_out = False
        with self._cond:
            run.proc = proc
            while not run.exited and not run.cancelled and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                self._cond.wait(left)
            if timed_out:
                # TERM first: a diagnostic may have state of its own to put back (the host engine's test plan).
                run.kill(signal.SIGTERM)
                grace = time.monotonic() + self.kill_grace_s
                while not run.exited and (left := grace - time.monotonic()) > 0:
                    self._cond.wait(left)
            # Whatever is left of the group goes now, before the leader is reaped: a helper of this check never
            # outlives it, and never overlaps the next one.
            run.kill(signal.SIGKILL)
            grace = time.monotonic() + self.kill_grace_s
            while not run.exited and (left := grace - time.monotonic()) > 0:
                self._cond.wait(left)
            # Reaped under the lock that every kill takes, so no kill can name the leader's ID once it is free. A
            # leader that SIGKILL does not end (stuck in the driver) is left to its reaper thread; the check ends.
            code = proc.wait() if run.exited else None
        # With the group gone the pipe's last writer is too; a helper that left the session keeps it open, and is
        # not waited for.
        tail.done.wait(1.0)
        output = bytes(tail.data)
        if run.cancelled or self._stop.is_set():
            log.info("recovery check of %s stopped before it finished", label)
            return None
        took = time.monotonic() - run.started
        if timed_out or code is None:  # no exit code only after a timeout: it was killed, and stuck
            detail = f"timed out after {self.timeout_s:g} s"
        elif code == 0:
            detail = f"exit 0 in {took:.0f} s"
        elif code < 0:
            detail = f"killed by {_signal_name(-code)}"
        else:
            detail = f"exit {code}"
        passed = code == 0 and not timed_out
        (log.info if passed else log.warning)(
            "recovery check of %s %s (%s after %.1f s); its output%s:\n%s", label,
            "passed" if passed else "failed", detail, took,
            f" (the last {OUTPUT_BYTES} bytes)" if tail.cut else "",
            output.decode("utf-8", "replace").rstrip() or "(none)")
        if not passed:
            line = one_line(output)
            detail += f": {line}" if line else " (no output)"
        return CheckResult(gpu.uuid, passed, detail)

    def _reap(self, run: _Running, pid: int) -> None:
        """Wait for the check's leader to exit without reaping it (the worker kills its group first), then wake the
        worker."""
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass
        with self._cond:
            run.exited = True
            self._cond.notify_all()


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"
