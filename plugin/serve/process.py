"""The process's own series, under the names every Prometheus client library exports them by: memory, CPU time,
start time and file descriptors read from /proc at each scrape (``process_*``), and the Python build
(``python_info``). Names, help texts, types and labels are prometheus_client's, so dashboards written for any Python
exporter read these unchanged."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from plugin.serve.exposition import CounterFamily, Family, GaugeFamily


def _sysconf(name: str, default: int) -> int:
    try:
        return os.sysconf(name)
    except (ValueError, OSError):
        return default


class ProcessCollector:
    """/proc/self/stat (memory, CPU, start time), /proc/self/limits and /proc/self/fd. Where /proc cannot be read
    (not Linux) it exports nothing; a file that cannot be read at one scrape drops only its own series."""

    def __init__(self, proc: str = "/proc") -> None:
        self._proc = proc
        self._ticks = float(_sysconf("SC_CLK_TCK", 100))
        self._pagesize = _sysconf("SC_PAGE_SIZE", 4096)
        self._btime = 0.0
        try:
            self._btime = self._boot_time()
        except OSError:
            pass

    def _boot_time(self) -> float:
        with open(os.path.join(self._proc, "stat"), "rb") as stat:
            for line in stat:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
        return 0.0

    def collect(self) -> Iterable[Family]:
        if not self._btime:
            return []
        me = os.path.join(self._proc, "self")
        out: list[Family] = []
        try:
            with open(os.path.join(me, "stat"), "rb") as f:
                # The command name in parentheses may hold spaces (or parentheses): count fields after the last ")".
                parts = f.read().split(b")")[-1].split()
            out.append(GaugeFamily("process_virtual_memory_bytes", "Virtual memory size in bytes.",
                                   value=float(parts[20])))
            out.append(GaugeFamily("process_resident_memory_bytes", "Resident memory size in bytes.",
                                   value=float(parts[21]) * self._pagesize))
            out.append(GaugeFamily("process_start_time_seconds",
                                   "Start time of the process since unix epoch in seconds.",
                                   value=float(parts[19]) / self._ticks + self._btime))
            out.append(CounterFamily("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                                     value=float(parts[11]) / self._ticks + float(parts[12]) / self._ticks))
        except OSError:
            pass
        try:
            max_fds: float | None = None
            with open(os.path.join(me, "limits"), "rb") as limits:
                for line in limits:
                    if line.startswith(b"Max open file"):
                        max_fds = float(line.split()[3])
                        break
            open_fds = len(os.listdir(os.path.join(me, "fd")))
            out.append(GaugeFamily("process_open_fds", "Number of open file descriptors.", value=open_fds))
            if max_fds is not None:
                out.append(GaugeFamily("process_max_fds", "Maximum number of open file descriptors.", value=max_fds))
        except OSError:
            pass
        return out


def python_info() -> dict[str, str]:
    """What ``platform`` says about this interpreter, without importing it: on CPython the version is the first
    word of ``sys.version``, with a patch level of 0 where it has only two parts."""
    version = sys.version.split()[0] if sys.version else ""
    parts = version.split(".")
    if len(parts) == 2:
        parts.append("0")
        version = ".".join(parts)
    major, minor, patchlevel = [*parts, "", "", ""][:3]
    impl = {"cpython": "CPython", "pypy": "PyPy"}.get(sys.implementation.name, sys.implementation.name)
    return {"version": version, "implementation": impl, "major": major, "minor": minor, "patchlevel": patchlevel}


class PlatformCollector:
    """``python_info``: one constant series whose labels name the interpreter."""

    def __init__(self) -> None:
        info = python_info()
        fam = GaugeFamily("python_info", "Python platform information", labels=list(info))
        fam.add_metric(list(info.values()), 1)
        self._families = [fam]

    def collect(self) -> Iterable[Family]:
        return self._families
