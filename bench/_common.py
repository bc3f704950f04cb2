"""Small helpers shared by the benchmark scripts: percentiles, process stats, the machine line."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path


def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile (nearest rank) of values; 0 for none."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(p / 100 * len(s) + 0.5) - 1))
    return s[k]


def summary_ms(values_s: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 3) if ms else 0.0,
            "p99_ms": round(pct(ms, 99), 3), "max_ms": round(max(ms), 3) if ms else 0.0}


def rss_mib(pid: int | None = None) -> float:
    status = Path(f"/proc/{pid or 'self'}/status").read_text()
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def thread_count(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def machine() -> str:
    return f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, {platform.system()}"


def compiled_env(repo: Path) -> dict[str, str]:
    """The environment for a plugin process whose memory is measured: its own modules byte-compiled first, as they
    are in the image (pip compiles a wheel's modules at install; the installed libraries already have theirs).
    Without this, a machine that sets PYTHONDONTWRITEBYTECODE (this one does) compiles every module of ours at every
    start, and the compiler's garbage shows up as about 1 MiB of RSS that no DaemonSet pays. The bytecode lands in
    the usual, git-ignored __pycache__ directories."""
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-m", "compileall", "-q", "plugin", "api"], cwd=repo, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def simulated_plugin(repo: Path, metrics: bool = True) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """The real plugin process on a simulated 8-GPU node, registered with a kubelet stand-in, its modules
    byte-compiled as in the image: (process, metrics port). Stopped, and its files removed, on the way out."""
    import sys
    import tempfile

    from plugin.devtools.standin import KubeletStandin
    from tests.conftest import NodeFile

    with tempfile.TemporaryDirectory(prefix="ghdp-bench-") as tmp:
        root = Path(tmp)
        (root / "dev").mkdir()
        NodeFile(root / "node.json")
        kubelet = KubeletStandin(root / "dp")
        kubelet.start()
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "plugin", "run", "--backend", "simulated", "--simulated-node",
             str(root / "node.json"), "--device-plugin-dir", str(root / "dp"), "--state-dir", str(root / "state"),
             "--dev-root", str(root), "--log-level", "warning", "--correlate-on", "none",
             "--metrics-address", f"127.0.0.1:{port}" if metrics else "off"],
            cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=compiled_env(repo))
        try:
            assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8), 30), "plugin did not register"
            yield proc, port
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
            kubelet.stop()


def proc_status(pid: int) -> dict[str, int]:
    """A process's resident and peak memory (kB) and thread count, from /proc/<pid>/status."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "Threads"):
            out[key] = int(rest.split()[0])
    return out
