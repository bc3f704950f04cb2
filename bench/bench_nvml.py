#!/usr/bin/env python3
"""The NVML backend through the real nvidia-ml-py, over the NVML stand-in (tests/nvml_standin: a C libnvidia-ml.so.1
driven by a node file), on 8 GPUs of the h100-sxm and a100-sxm profiles.

    python bench/bench_nvml.py                          # everything, prints JSON
    python bench/bench_nvml.py --cycles 200 --idle-seconds 60 --settle-seconds 10 --profile-cycles 200

- poll cost: ``backend.read(gpu)`` and a whole ``Monitor.poll_once()`` of 8 GPUs, wall and CPU, median and p90, in
  process; the pre-d4a9051 backend (``git show d4a9051~1:plugin/devices/nvml.py``) read on the same node in the same
  run for the ratio;
- NVML calls per GPU per poll, by C function, from the stand-in's own counters (``ghdpStandinCallCount``), for this
  backend and the old one; the old one's stand-in violations (its fabric structure passed by value) are counted;
- RSS of the real plugin process (``--backend nvml`` on the stand-in, and ``--backend simulated``), default poll
  interval, no kubelet, ``--settle-seconds`` after its first poll; then its idle CPU over ``--idle-seconds``, and per
  thread: CPU and wake-ups (voluntary context switches) in that window;
- where the memory goes: RSS of fresh interpreters after each import step (pynvml, the backend, nvmlInit);
- where a poll's time goes: cProfile of ``--profile-cycles`` poll cycles, top functions by cumulative time.

The stand-in answers from memory, so the per-call cost here is pynvml's ctypes marshalling plus ours; on a real GPU
each call also pays the driver's ioctl.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.util
import io
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import compiled_env, cpu_seconds, free_port, machine, pct, rss_mib, thread_count  # noqa: E402
from plugin.config.options import Config  # noqa: E402
from plugin.devices.model import Gpu  # noqa: E402
from plugin.devices.nvml import NvmlBackend  # noqa: E402
from plugin.devices.simulated import builtin_node  # noqa: E402
from plugin.health.config import HealthConfig  # noqa: E402
from plugin.health.monitor import Monitor  # noqa: E402
from plugin.health.node_state import NodeState  # noqa: E402
from scripts.nvmlstandin import StandinBuildError, StandinToolchainMissing  # noqa: E402
from tests.fakes import nvml_standin as standin  # noqa: E402

PROFILES = {"h100-sxm": "NVIDIA H100 80GB HBM3", "a100-sxm": "NVIDIA A100-SXM4-80GB"}
DEFAULT_INTERVAL = float(Config.__dataclass_fields__["poll_interval"].default)  # type: ignore[arg-type]  # 5 s
OLD_REV = "d4a9051~1"  # the backend before "one field-values call per poll" and "fabric info by pointer"
RSS_TARGET_MIB = 45.0
IDLE_TARGET_PCT = 0.3


def node_doc(profile: str) -> dict[str, Any]:
    """The built-in 8-GPU node (two NVLink islands of four, the other link slots to NVSwitches), named as the
    profile's model."""
    doc = builtin_node()
    for g in doc["gpus"]:
        g["name"] = PROFILES[profile]
    return doc


def symbols() -> list[str]:
    """Every NVML function the stand-in counts: its ENTER("...") names, read from its sources."""
    names: set[str] = set()
    for src in (REPO / "tests" / "nvml_standin").glob("*.c"):
        names.update(re.findall(r'ENTER\("(\w+)"\)', src.read_text()))
    return sorted(names)


def counts() -> dict[str, int]:
    return {n: c for n in symbols() if (c := standin.call_count(n))}


def old_backend_module() -> ModuleType:
    """plugin/devices/nvml.py as it was before d4a9051, as its own module (it imports only model and backend, whose
    older names the current ones still carry)."""
    src = subprocess.run(["git", "show", f"{OLD_REV}:plugin/devices/nvml.py"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    path = Path(tempfile.mkdtemp(prefix="ghdp-oldnvml-")) / "old_nvml.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_nvml", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dist(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {"p50_ms": round(statistics.median(ms), 4), "p90_ms": round(pct(ms, 90), 4), "n": len(ms)}


def time_reads(read: Callable[[Gpu], Any], gpus: tuple[Gpu, ...], cycles: int) -> dict[str, Any]:
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(cycles):
        for g in gpus:
            c0, t0 = time.process_time(), time.perf_counter()
            read(g)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    # process_time ticks coarsely on some kernels; the mean over many reads is the honest CPU figure.
    return {"wall": dist(wall), "cpu_mean_ms": round(1000 * sum(cpu) / len(cpu), 4)}


def calls_per_gpu_poll(read: Callable[[Gpu], Any], gpus: tuple[Gpu, ...], polls: int) -> dict[str, float]:
    standin.reset_call_counts()
    for _ in range(polls):
        for g in gpus:
            read(g)
    per = {n: c / (polls * len(gpus)) for n, c in counts().items()}
    return {n: round(v, 2) for n, v in sorted(per.items(), key=lambda kv: -kv[1])}


@contextlib.contextmanager
def nvml_node(profile: str) -> Iterator[tuple[Path, standin.StandinNode]]:
    with tempfile.TemporaryDirectory(prefix="ghdp-bench-nvml-") as tmp:
        root = Path(tmp)
        node = standin.StandinNode(root / "node.json", node_doc(profile), profile=profile)
        with standin.use_node(node.path):
            yield root, node


def bench_in_process(profile: str, cycles: int, call_polls: int, profile_cycles: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    standin.reset_violations()
    with nvml_node(profile) as (root, _node):
        backend = NvmlBackend(state_dir=root / "state")
        try:
            gpus = backend.discover().gpus
            monitor = Monitor(backend, NodeState(), HealthConfig(), DEFAULT_INTERVAL, threading.Event())
            for _ in range(20):  # warm-up: checks settle (on / off), links seen, first-call guards passed
                monitor.poll_once()
            out["read"] = time_reads(backend.read, gpus, cycles)
            polls: list[float] = []
            cpu: list[float] = []
            for _ in range(cycles):
                c0, t0 = time.process_time(), time.perf_counter()
                monitor.poll_once()
                polls.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            out["poll_once_8_gpus"] = {"wall": dist(polls), "cpu_mean_ms": round(1000 * sum(cpu) / len(cpu), 4),
                                       "wall_per_gpu_p50_ms": round(1000 * statistics.median(polls) / len(gpus), 4)}
            out["calls_per_gpu_per_poll"] = calls_per_gpu_poll(backend.read, gpus, call_polls)
            # The monitor adds nothing of its own to NVML: a poll_once's calls are its reads'.
            standin.reset_call_counts()
            for _ in range(call_polls):
                monitor.poll_once()
            out["calls_per_poll_once_equal_reads"] = (
                round(sum(counts().values()) / (call_polls * len(gpus)), 2)
                == round(sum(out["calls_per_gpu_per_poll"].values()), 2))
            out["checks"] = backend.describe()[0]["checks"]
            out["cprofile_top"] = cprofile(monitor.poll_once, profile_cycles)
        finally:
            backend.close()
    out["violations"] = standin.violation_count()

    old = old_backend_module()
    standin.reset_violations()
    with nvml_node(profile), c_stderr_to_devnull():
        ob = old.NvmlBackend()
        try:
            ogpus = ob.discover().gpus
            for _ in range(20):
                for g in ogpus:
                    ob.read(g)
            out["old_read"] = time_reads(ob.read, ogpus, cycles)
            out["old_calls_per_gpu_per_poll"] = calls_per_gpu_poll(ob.read, ogpus, call_polls)
            sample = ob.read(ogpus[0])
            out["old_reading_errors"] = [list(e) for e in sample.errors]
            out["old_nvlink_down_gpu0"] = list(sample.nvlink_down or ())
        finally:
            ob.close()
    # The old defect: the fabric structure passed by value, one violation per GPU per poll (a real driver writes
    # through whatever the register held).
    out["old_violations"] = standin.violation_count()
    out["old_violation_kinds"] = sorted({re.sub(r"0x[0-9a-f]+", "0x...", v) for v in standin.violations()})
    standin.reset_violations()
    new_total = sum(out["calls_per_gpu_per_poll"].values())
    old_total = sum(out["old_calls_per_gpu_per_poll"].values())
    out["calls_total_per_gpu_per_poll"] = {"new": round(new_total, 2), "old": round(old_total, 2),
                                           "old_over_new": round(old_total / new_total, 2)}
    out["read_p50_old_over_new"] = round(out["old_read"]["wall"]["p50_ms"] / out["read"]["wall"]["p50_ms"], 2)
    return out


@contextlib.contextmanager
def c_stderr_to_devnull() -> Iterator[None]:
    """The stand-in prints every violation on fd 2; the old backend makes one per GPU per poll, counted instead."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def cprofile(fn: Callable[[], Any], cycles: int, top: int = 15) -> list[str]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(cycles):
        fn()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("cumulative")
    stats.print_stats(top)
    lines = [ln.rstrip() for ln in buf.getvalue().splitlines()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    return [f"{cycles} poll cycles of 8 GPUs; cumulative seconds include cProfile's own overhead"] + \
        [ln for ln in lines[start:] if ln.strip()]


# The process -------------------------------------------------------------------------------------------------------

def polls_done(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("gpu_health_poll_duration_seconds_count"):
            return int(float(line.split()[-1]))
    return 0


def threads(pid: int) -> dict[int, tuple[str, float, int]]:
    """tid -> (comm, CPU seconds, voluntary + involuntary context switches: each one a wake-up or a preemption)."""
    ticks = float(os.sysconf("SC_CLK_TCK"))
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            status = (task / "status").read_text()
            comm = (task / "comm").read_text().strip()
        except OSError:
            continue  # the thread ended meanwhile
        fields = stat.rsplit(")", 1)[1].split()
        # voluntary_ctxt_switches (the thread slept and was woken) + nonvoluntary_ctxt_switches (preempted)
        switches = sum(int(ln.split()[1]) for ln in status.splitlines() if "ctxt_switches:" in ln)
        out[int(task.name)] = (comm, (int(fields[11]) + int(fields[12])) / ticks, switches)
    return out


# --name-threads: a sitecustomize that gives every Python thread its name in /proc/PID/task/TID/comm (Python 3.11
# leaves them all "python"), so the wake-ups can be told apart. It loads ctypes into the process, so it is a
# diagnosis run's option, never on for the RSS figure.
NAME_THREADS = """import ctypes, threading
_libc = ctypes.CDLL(None)
_inner = threading.Thread._bootstrap_inner
def _named(self):
    _libc.prctl(15, self.name[:15].encode(), 0, 0, 0)  # PR_SET_NAME
    _inner(self)
threading.Thread._bootstrap_inner = _named
"""


def bench_process(backend: str, settle_s: float, idle_s: float, name_threads: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ghdp-bench-nvml-proc-") as tmp:
        root = Path(tmp)
        env = compiled_env(REPO)
        if name_threads:
            (root / "site").mkdir()
            (root / "site" / "sitecustomize.py").write_text(NAME_THREADS)
            env["PYTHONPATH"] = ":".join(p for p in (str(root / "site"), env.get("PYTHONPATH", "")) if p)
        args = [sys.executable, "-m", "plugin", "run", "--backend", backend, "--device-plugin-dir",
                str(root / "dp"), "--state-dir", str(root / "state"), "--log-level", "warning"]
        if backend == "nvml":
            node = standin.StandinNode(root / "node.json", node_doc("h100-sxm"), profile="h100-sxm")
            env = standin.env_for_subprocess(node.path, base=env)
        # The default serves metrics on 0.0.0.0:9402; a free loopback port keeps it on without clashing with
        # whatever else runs on this shared machine, and it tells when the first poll has run.
        port = free_port()
        args += ["--metrics-address", f"127.0.0.1:{port}"]
        log = root / "plugin.log"
        with open(log, "wb") as logf:
            proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT)
        try:
            t0 = time.monotonic()
            while polls_done(port) < 1:
                if proc.poll() is not None or time.monotonic() - t0 > 60:
                    raise RuntimeError(f"the {backend} plugin never polled: {log.read_text()[-2000:]}")
                time.sleep(0.05)  # the plugin has no event to await from outside; its metrics are read
            start_s = time.monotonic() - t0
            time.sleep(settle_s)  # the measurement's own delay: "RSS N seconds after the first poll"
            rss = rss_mib(proc.pid)
            th0, c0, w0 = threads(proc.pid), cpu_seconds(proc.pid), time.monotonic()
            time.sleep(idle_s)  # the idle window itself
            th1, c1, w1 = threads(proc.pid), cpu_seconds(proc.pid), time.monotonic()
            rss_end = rss_mib(proc.pid)
            n_threads = thread_count(proc.pid)
        finally:
            proc.terminate()
            proc.wait(10)
        text = log.read_text(errors="replace")
    window = w1 - w0
    per_thread: list[dict[str, Any]] = []
    for tid, (comm, cpu1, sw1) in th1.items():
        _, cpu0, sw0 = th0.get(tid, (comm, 0.0, 0))
        per_thread.append({"tid": tid, "comm": comm, "cpu_ms": round(1000 * (cpu1 - cpu0), 1),
                           "wakeups_per_s": round((sw1 - sw0) / window, 2)})
    per_thread.sort(key=lambda t: (-t["wakeups_per_s"], -t["cpu_ms"]))
    return {"backend": backend, "first_poll_after_s": round(start_s, 2), "rss_mib": round(rss, 1),
            "rss_end_mib": round(rss_end, 1), "rss_target_mib": RSS_TARGET_MIB, "idle_seconds": round(window, 1),
            "idle_cpu_percent_of_core": round(100 * (c1 - c0) / window, 3), "idle_target_percent": IDLE_TARGET_PCT,
            "threads": n_threads, "busy_threads": [t for t in per_thread if t["wakeups_per_s"] or t["cpu_ms"]],
            "violations_logged": text.count("VIOLATION"), "tracebacks_logged": text.count("Traceback")}


# Where the memory goes ------------------------------------------------------------------------------------------

STEPS = {
    "interpreter": "",
    "import pynvml": "import pynvml",
    "+ nvmlInit on the stand-in": "import pynvml; pynvml.nvmlInit()",
    "import plugin.devices.nvml": "import plugin.devices.nvml",
    "+ NvmlBackend (8 GPUs discovered, events registered)":
        "import plugin.devices.nvml as m; m.NvmlBackend()",
    "import plugin.devices.simulated": "import plugin.devices.simulated",
}


def attribution(env: dict[str, str]) -> dict[str, float]:
    """RSS of a fresh interpreter after each step (median of 3), MiB."""
    out = {}
    for label, code in STEPS.items():
        script = f"{code}\nimport pathlib\nprint([l for l in pathlib.Path('/proc/self/status').read_text()" \
                 ".splitlines() if l.startswith('VmRSS')][0].split()[1])"
        vals = []
        for _ in range(3):
            r = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                               check=True)
            vals.append(int(r.stdout.split()[-1]) / 1024)
        out[label] = round(statistics.median(vals), 2)
    return out


def import_times(env: dict[str, str], top: int = 12) -> list[str]:
    """``python -X importtime`` of the plugin's nvml start-up imports: the slowest modules, cumulative us."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import plugin.app, plugin.devices.nvml"],
                       cwd=REPO, env=env, capture_output=True, text=True, check=True)
    rows = []
    for ln in r.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", ln)
        if m:
            rows.append((int(m.group(2)), m.group(4)))
    rows.sort(reverse=True)
    return [f"{us / 1000:8.1f} ms  {name}" for us, name in rows[:top]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=200, help="poll cycles timed in process, per profile")
    ap.add_argument("--call-polls", type=int, default=20, help="poll cycles whose NVML calls are counted")
    ap.add_argument("--profile-cycles", type=int, default=200, help="poll cycles under cProfile")
    ap.add_argument("--settle-seconds", type=float, default=10.0, help="after the first poll, before RSS is read")
    ap.add_argument("--idle-seconds", type=float, default=60.0, help="the idle CPU window of the plugin process")
    ap.add_argument("--skip-process", action="store_true", help="in-process parts only")
    ap.add_argument("--skip-in-process", action="store_true", help="the plugin processes only")
    ap.add_argument("--name-threads", action="store_true",
                    help="name the processes' Python threads (diagnosis: which thread wakes; RSS then is not the "
                         "plugin's alone)")
    args = ap.parse_args()
    out: dict[str, Any] = {"machine": machine(), "command": "python bench/bench_nvml.py " + " ".join(sys.argv[1:]),
                           "default_poll_interval_s": DEFAULT_INTERVAL}
    try:
        lib_dir = standin.library_dir()
    except (StandinToolchainMissing, StandinBuildError) as exc:
        print(f"bench_nvml: the NVML stand-in cannot be built: {exc}", file=sys.stderr)
        return 1
    standin.load_in_process(lib_dir)
    import pynvml

    out["nvidia_ml_py"] = getattr(pynvml, "__version__", None) or _dist_version("nvidia-ml-py")
    out["stand_in"] = str(lib_dir)
    for profile in PROFILES if not args.skip_in_process else ():
        out[profile] = bench_in_process(profile, args.cycles, args.call_polls, args.profile_cycles)
    if not args.skip_process:
        env = compiled_env(REPO)
        with tempfile.TemporaryDirectory(prefix="ghdp-bench-nvml-attr-") as tmp:
            node = standin.StandinNode(Path(tmp) / "node.json", node_doc("h100-sxm"), profile="h100-sxm")
            attr_env = standin.env_for_subprocess(node.path, base=env)
            out["rss_by_step_mib"] = attribution(attr_env)
            out["slowest_imports"] = import_times(attr_env)
        # Both processes idle at once: each one's CPU is its own (/proc), and the window is paid once.
        results: dict[str, dict[str, Any]] = {}

        def one(backend: str) -> None:
            results[backend] = bench_process(backend, args.settle_seconds, args.idle_seconds, args.name_threads)

        workers = [threading.Thread(target=one, args=(b,)) for b in ("nvml", "simulated")]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        out["process"] = results
        nv, sim = results["nvml"], results["simulated"]
        out["process_summary"] = {
            "rss_nvml_mib": nv["rss_mib"], "rss_simulated_mib": sim["rss_mib"],
            "rss_nvml_minus_simulated_mib": round(nv["rss_mib"] - sim["rss_mib"], 1),
            "rss_target_met": nv["rss_mib"] <= RSS_TARGET_MIB,
            "idle_nvml_pct": nv["idle_cpu_percent_of_core"], "idle_simulated_pct": sim["idle_cpu_percent_of_core"],
            "idle_target_met": nv["idle_cpu_percent_of_core"] <= IDLE_TARGET_PCT,
        }
    print(json.dumps(out, indent=2))
    return 0


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
