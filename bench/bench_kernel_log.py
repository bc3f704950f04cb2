#!/usr/bin/env python3
"""The kernel log as a source (docs/kernel-log.md): how fast records are read, and what an idle kernel log costs.

    python bench/bench_kernel_log.py                 # prints JSON
    python bench/bench_kernel_log.py --lines 500000 --idle-seconds 30

- throughput: the real reader over a file in the kmsg format, handing every batch to the real health engine on 8
  simulated GPUs, until the last record is handed on; lines per second, median of --repeats runs, for a flood of
  one XID (every line a driver line, folded) and for ordinary kernel lines (none a driver line); and the same flood
  through the relay process and its FIFO;
- memory: the process's RSS before and after the flood runs;
- idle: the reader thread's wake-ups (context switches) and CPU per second over --idle-seconds, on this machine's
  /dev/kmsg when it can be read (the relay process on it too), else on a FIFO with its writer open and silent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import machine, rss_mib  # noqa: E402
from plugin.devices.kernellog import KernelLog  # noqa: E402
from plugin.devices.model import GpuEvent  # noqa: E402
from plugin.devices.simulated import SimulatedBackend, builtin_node  # noqa: E402
from plugin.health.config import HealthConfig  # noqa: E402
from plugin.health.monitor import Monitor  # noqa: E402
from plugin.health.node_state import NodeState  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def engine(tmp: Path) -> Monitor:
    node = tmp / "node.json"
    node.write_text(json.dumps(builtin_node()))
    m = Monitor(SimulatedBackend(node), NodeState(), HealthConfig(), 5.0, threading.Event())
    m.poll_once()
    return m


def write_log(path: Path, lines: int, flood: bool) -> None:
    # GPU 0 of the built-in node sits at 0000:18:00.
    text = ("NVRM: Xid (PCI:0000:18:00): 95, pid=4242, name=train, Uncontained: FBHUB. RST: No, D-RST: No"
            if flood else "systemd[1]: Started session-42.scope - Session 42 of User root.")
    with path.open("w") as f:
        f.writelines(f"3,{s},{1_000_000 + s},-;{text}\n" for s in range(lines))


def read_all(tmp: Path, source: Path, lines: int, via_relay: bool = False) -> float:
    """Seconds from the reader's start to its last record handed on."""
    m = engine(tmp)
    state = tmp / f"state-{time.monotonic_ns()}"
    state.mkdir()
    path, relay = source, None
    if via_relay:
        path = tmp / f"fifo-{time.monotonic_ns()}"
        relay = subprocess.Popen([sys.executable, "-m", "plugin", "kernel-log-relay", "--from", str(source),
                                  "--to", str(path)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not path.exists():
            time.sleep(0.01)

    def deliver(events: list[GpuEvent]) -> None:
        m.handle_events(events)

    k = KernelLog(path, state, "bench", m.gpu_for_pci, deliver, retry_s=0.01)
    t0 = time.perf_counter()
    k.start()
    assert k.wait_read(lines - 1, timeout=600), "the reader did not reach the last record"
    took = time.perf_counter() - t0
    k.close()
    if relay is not None:
        relay.terminate()
        relay.wait(10)
    return took


def thread_counters(tid: int) -> tuple[int, float]:
    """A thread's context switches (voluntary + not) and its CPU seconds."""
    status = Path(f"/proc/self/task/{tid}/status").read_text()
    switches = sum(int(line.split()[1]) for line in status.splitlines()
                   if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return switches, (int(fields[11]) + int(fields[12])) / TICKS


def process_counters(pid: int) -> tuple[int, float]:
    switches, cpu = 0, 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        switches += sum(int(line.split()[1]) for line in status.splitlines()
                        if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        cpu += (int(fields[11]) + int(fields[12])) / TICKS
    return switches, cpu


def kmsg_readable() -> bool:
    try:
        os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK))
        return True
    except OSError:
        return False


def idle(tmp: Path, seconds: float) -> dict[str, Any]:
    m = engine(tmp)
    state = tmp / "idle-state"
    state.mkdir()
    out: dict[str, Any] = {}
    relay = None
    writer = None
    if kmsg_readable():
        out["source"] = "/dev/kmsg (this machine's)"
        path = tmp / "idle-fifo"
        relay = subprocess.Popen([sys.executable, "-m", "plugin", "kernel-log-relay", "--to", str(path)], cwd=REPO,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not path.exists():
            time.sleep(0.01)
    else:
        out["source"] = "a FIFO, its writer open and silent (/dev/kmsg cannot be read here)"
        path = tmp / "idle-fifo"
        os.mkfifo(path)
    k = KernelLog(path, state, "bench", m.gpu_for_pci, lambda events: m.handle_events(events))
    k.start()
    if relay is None:
        writer = os.open(path, os.O_WRONLY)
    # Caught up: the backlog (the ring) read, then a moment for the last batch.
    k.wait(lambda r: r.stats.readable, 10)
    time.sleep(2.0)
    assert k._thread is not None and k._thread.native_id is not None
    tid = k._thread.native_id
    records0 = k.stats.records
    s0, c0 = thread_counters(tid)
    r0 = process_counters(relay.pid) if relay is not None else (0, 0.0)
    time.sleep(seconds)
    s1, c1 = thread_counters(tid)
    r1 = process_counters(relay.pid) if relay is not None else (0, 0.0)
    out.update({
        "seconds": seconds,
        "records_logged_meanwhile": k.stats.records - records0,
        "reader_wakeups_per_s": round((s1 - s0) / seconds, 3),
        "reader_cpu_percent": round(100 * (c1 - c0) / seconds, 3),
    })
    if relay is not None:
        out["relay_wakeups_per_s"] = round((r1[0] - r0[0]) / seconds, 3)
        out["relay_cpu_percent"] = round(100 * (r1[1] - r0[1]) / seconds, 3)
        relay.terminate()
        relay.wait(10)
    k.close()
    if writer is not None:
        os.close(writer)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=500_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--idle-seconds", type=float, default=30.0)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        flood, ordinary = tmp / "flood.log", tmp / "ordinary.log"
        write_log(flood, a.lines, flood=True)
        write_log(ordinary, a.lines, flood=False)
        rss0 = rss_mib()
        runs = {name: [a.lines / read_all(tmp, src, a.lines, relay) for _ in range(a.repeats)]
                for name, src, relay in (("flood of one XID", flood, False), ("ordinary lines", ordinary, False),
                                         ("flood of one XID, through the relay", flood, True))}
        rss1 = rss_mib()
        result = {
            "machine": machine(),
            "command": " ".join(["python", "bench/bench_kernel_log.py", *sys.argv[1:]]),
            "lines": a.lines,
            "lines_per_s_median": {k: round(statistics.median(v)) for k, v in runs.items()},
            "rss_mib_before_after": [round(rss0, 1), round(rss1, 1)],
            "idle": idle(tmp, a.idle_seconds),
        }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
