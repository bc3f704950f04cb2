#!/usr/bin/env python3
"""Allocate latency through the kubelet's own device-plugin client: our Python plugin and the
kubelet's Go Stub (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1), same client,
same process run.

Builds (or reuses from ~/.cache/gpu-health-device-plugin/) the Go harness in
tests/conformance/kubelet/ and runs its bench mode, which prints JSON; this script prints that JSON
and, with --table, a short summary.

    python bench/bench_kubelet_peer.py                      # kubelet v1.37.2, 2000 calls, 1/16/64 callers
    python bench/bench_kubelet_peer.py --calls 5000 --concurrency 1,8 --table
    python bench/bench_kubelet_peer.py --kubelet v1.34.4 --out results.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts import gobuild  # noqa: E402

CONFORMANCE = REPO / "tests" / "conformance"

# Kept in step with KUBELET_PINS in tests/conformance/test_kubelet_conformance.py.
PINS = {
    "v1.37.2": ("go.mod", ()),
    "v1.34.4": ("go.k134.mod", ("kube134",)),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kubelet", default="v1.37.2", choices=sorted(PINS), help="pinned kubelet release")
    ap.add_argument("--calls", type=int, default=2000, help="Allocate calls per concurrency level")
    ap.add_argument("--warmup", type=int, default=200, help="warm-up calls per target")
    ap.add_argument("--concurrency", default="1,16,64", help="concurrent callers, comma-separated")
    ap.add_argument("--targets", default="plugin,stub", help="plugin, stub or both")
    ap.add_argument("--plugin-log-level", default="info", help="the plugin's --log-level during the run")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs the plugin")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--table", action="store_true", help="print a summary table to stderr")
    args = ap.parse_args()

    modfile, tags = PINS[args.kubelet]
    print(f"building or reusing kubelet-peer {args.kubelet} ...", file=sys.stderr, flush=True)
    try:
        exe = gobuild.build(
            CONFORMANCE / "kubelet", ".", "kubelet-peer", version=args.kubelet, modfile=modfile, tags=tags
        )
    except (gobuild.GoToolchainMissing, gobuild.GoBuildError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    cmd = [
        str(exe),
        "-mode",
        "bench",
        "-targets",
        args.targets,
        "-calls",
        str(args.calls),
        "-warmup",
        str(args.warmup),
        "-concurrency",
        args.concurrency,
        "-python",
        args.python,
        "-plugin-cwd",
        str(REPO),
        "-plugin-log-level",
        args.plugin_log_level,
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.stderr:
        sys.stderr.write(proc.stderr[-4000:])
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        print(f"error: harness printed no JSON (exit {proc.returncode}):\n{proc.stdout[-4000:]}", file=sys.stderr)
        return 1
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.table:
        print(
            f"\n{report['kubelet']}, {report['cpus']} CPUs, {report['calls_per_level']} calls per level",
            file=sys.stderr,
        )
        print(f"{'target':8} {'callers':>7} {'p50 us':>9} {'p99 us':>9} {'calls/s':>9} {'errors':>6}", file=sys.stderr)
        for t in report["targets"]:
            if t.get("error"):
                print(f"{t['target']:8} error: {t['error'].splitlines()[0]}", file=sys.stderr)
            for r in t.get("results") or []:
                print(
                    f"{t['target']:8} {r['concurrency']:>7} {r['p50_us']:>9.0f} {r['p99_us']:>9.0f} "
                    f"{r['calls_per_s']:>9.0f} {r['errors']:>6}",
                    file=sys.stderr,
                )
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
