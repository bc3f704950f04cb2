"""Memory and CPU of one plugin process as the DaemonSet runs it, to size the container's requests and limit.

Starts the kubelet stand-in in this process and `python -m plugin run` (simulated backend, the built-in 8-GPU node
written to a node file, default poll interval unless --poll-interval) as a child with the DaemonSet's defaults. Once
the plugin has registered it samples the child's RSS, then rewrites the node file with a fault on one GPU and clears
it again (--faults times), then idles for --idle seconds. Repeated --runs times; prints per-run numbers and the
median over runs. The manifests' memory request follows the steady RSS and the limit leaves headroom over the peak
(VmHWM); see docs/deploy.md and docs/benchmarks.md.

    python bench/bench_deploy_rss.py [--runs 3] [--faults 8] [--idle 20] [--reporter] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import compiled_env, proc_status  # noqa: E402
from plugin.devices.simulated import builtin_node  # noqa: E402
from plugin.devtools.standin import KubeletStandin  # noqa: E402


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _write_node(path: Path, doc: dict[str, object]) -> None:
    # Atomic rename, as an operator's tooling (or the demo) would rewrite it.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def one_run(faults: int, idle_s: float, poll_interval: str | None, reporter: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="gh-rss-") as tmp_s:
        tmp = Path(tmp_s)
        plugin_dir, state_dir, node_file = tmp / "plugins", tmp / "state", tmp / "node.json"
        node = builtin_node()
        _write_node(node_file, node)
        kubelet = KubeletStandin(plugin_dir)
        kubelet.start()
        args = [sys.executable, "-m", "plugin", "run", "--backend", "simulated", "--simulated-node", str(node_file),
                "--device-plugin-dir", str(plugin_dir), "--state-dir", str(state_dir), "--log-format", "json"]
        if poll_interval:
            args += ["--poll-interval", poll_interval]
        if reporter:
            # Cluster reporting on, as in the DaemonSet, against an API server that refuses connections: the
            # client library and the reporter thread are loaded and retry with back-off.
            kubeconfig = tmp / "kubeconfig"
            kubeconfig.write_text(json.dumps({
                "apiVersion": "v1", "kind": "Config", "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9"}}],
                "users": [{"name": "u", "user": {"token": "x"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
            args += ["--node-name", "bench-node", "--kubeconfig", str(kubeconfig)]
        t0 = time.monotonic()
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, env=compiled_env(REPO))
        try:
            if not kubelet.wait_for(lambda: kubelet.capacity()[1] == 8, timeout=60):
                raise RuntimeError("plugin did not register 8 healthy GPUs within 60 s")
            registered_s = time.monotonic() - t0
            at_registration = proc_status(proc.pid)
            gpus = node["gpus"]
            assert isinstance(gpus, list)
            for i in range(faults):
                gpus[i % len(gpus)]["signals"] = {"nvlink_down": [0]}
                _write_node(node_file, node)
                if not kubelet.wait_for(lambda: kubelet.capacity()[1] == len(gpus) - 1, timeout=30):
                    raise RuntimeError(f"fault {i}: allocatable is {kubelet.capacity()}, want {len(gpus) - 1}")
                gpus[i % len(gpus)]["signals"] = {}
                _write_node(node_file, node)
                if not kubelet.wait_for(lambda: kubelet.capacity()[1] == len(gpus), timeout=30):
                    raise RuntimeError(f"recovery {i}: allocatable is {kubelet.capacity()}, want {len(gpus)}")
            after_faults = proc_status(proc.pid)
            cpu0, w0 = _cpu_s(proc.pid), time.monotonic()
            time.sleep(idle_s)  # idle: nothing to await, the point is to let time pass
            idle_cpu_pct = 100 * (_cpu_s(proc.pid) - cpu0) / (time.monotonic() - w0)
            end = proc_status(proc.pid)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
            kubelet.stop()
    return {"registered_s": round(registered_s, 3),
            "rss_registered_mib": round(at_registration["VmRSS"] / 1024, 1),
            "rss_after_faults_mib": round(after_faults["VmRSS"] / 1024, 1),
            "rss_end_mib": round(end["VmRSS"] / 1024, 1),
            "peak_hwm_mib": round(end["VmHWM"] / 1024, 1),
            "threads": end["Threads"],
            "idle_cpu_pct_of_core": round(idle_cpu_pct, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--faults", type=int, default=8,
                    help="fault + recovery cycles per run, one GPU after the other (more than 2 per GPU within "
                         "10 minutes trips flap damping, which keeps the GPU Unhealthy on purpose)")
    ap.add_argument("--idle", type=float, default=20.0, help="seconds of idle after the faults")
    ap.add_argument("--poll-interval", default="0.2",
                    help="plugin poll interval for the fault phase (a fault clears after 3 clean polls); "
                         "'' for the plugin's default")
    ap.add_argument("--reporter", action="store_true",
                    help="turn cluster reporting on (node name + a kubeconfig whose API server is unreachable)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    runs = [one_run(a.faults, a.idle, a.poll_interval or None, a.reporter) for _ in range(a.runs)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    if a.json:
        print(json.dumps({"machine": f"{os.cpu_count()} cores, Python {platform.python_version()}", "runs": runs,
                          "median": med}, indent=2))
        return 0
    print(f"machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}")
    cols = list(runs[0])
    print("run  " + "  ".join(cols))
    for i, r in enumerate(runs, 1):
        print(f"{i:<4} " + "  ".join(f"{r[c]!s:>{len(c)}}" for c in cols))
    print("med  " + "  ".join(f"{med[c]!s:>{len(c)}}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
