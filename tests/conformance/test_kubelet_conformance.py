"""The kubelet's own device-manager code as a peer: tests/conformance/kubelet/.

For each pinned Kubernetes release the Go harness is built (cached outside the repository by
scripts/gobuild.py) and run twice: against the Python plugin on the simulated backend, and against the
kubelet's Stub as a control. Every "FAIL" line it prints fails the test.

Without a Go toolchain the tests skip, except with CI=true, where that is a failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conformance.skips import build_or_skip

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
HARNESS_DIR = HERE / "kubelet"


@dataclass(frozen=True)
class KubeletPin:
    version: str
    modfile: str
    tags: tuple[str, ...] = ()


# Newest release, and the newest minor before the devicemanager plugin package took loggers and
# contexts (contextual logging arrived in 1.35).
KUBELET_PINS = [
    KubeletPin("v1.37.2", "go.mod"),
    KubeletPin("v1.34.4", "go.k134.mod", ("kube134",)),
]

RESULT_RE = re.compile(r"^(PASS|FAIL|N/A) (\S+?)(?::| - |$)(.*)$")
SUMMARY_RE = re.compile(r"^(\d+) passed, (\d+) failed$")


def build_harness(pin: KubeletPin) -> Path:
    """Build (or reuse) the harness binary for one pinned release; pytest skip/fail semantics."""
    return build_or_skip(HARNESS_DIR, ".", "kubelet-peer", version=pin.version, modfile=pin.modfile, tags=pin.tags)


def run_harness(exe: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(exe), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)


def parse_results(stdout: str) -> tuple[dict[str, list[str]], tuple[int, int] | None]:
    """Result lines by status ("PASS", "FAIL", "N/A") and the (passed, failed) summary."""
    results: dict[str, list[str]] = {"PASS": [], "FAIL": [], "N/A": []}
    summary = None
    for line in stdout.splitlines():
        if m := RESULT_RE.match(line):
            results[m.group(1)].append(line)
        elif m := SUMMARY_RE.match(line):
            summary = (int(m.group(1)), int(m.group(2)))
    return results, summary


@pytest.mark.conformance
@pytest.mark.parametrize("target", ["plugin", "stub"])
@pytest.mark.parametrize("pin", KUBELET_PINS, ids=[p.version for p in KUBELET_PINS])
def test_kubelet_peer(pin: KubeletPin, target: str) -> None:
    exe = build_harness(pin)
    scale = os.environ.get("KUBELET_PEER_TIMEOUT_SCALE", "1")
    proc = run_harness(
        exe,
        "-targets",
        target,
        "-python",
        sys.executable,
        "-plugin-cwd",
        str(REPO),
        "-timeout-scale",
        scale,
    )
    results, summary = parse_results(proc.stdout)
    report = (
        f"kubelet peer {pin.version} against {target}:\n{proc.stdout}\n--- stderr (tail) ---\n{proc.stderr[-6000:]}"
    )
    assert summary is not None, "no summary line\n" + report
    assert summary == (len(results["PASS"]), len(results["FAIL"])), "summary does not match result lines\n" + report
    if results["FAIL"]:
        pytest.fail(
            f"{len(results['FAIL'])} kubelet-peer scenario(s) failed against {target} ({pin.version}):\n  "
            + "\n  ".join(results["FAIL"])
            + "\n\n"
            + report,
            pytrace=False,
        )
    assert proc.returncode == 0, report
    # Not vacuous: every scenario ran and passed or was explicitly not applicable.
    names = {line.split()[1].rstrip(":").split("/", 1)[1] for lines in results.values() for line in lines}
    for scenario in (
        "registration",
        "fault_recovery",
        "allocate",
        "allocate_invalid_ids",
        "preferred_allocation",
        "kubelet_restart",
        "plugin_kill",
        "plugin_restart",
        "concurrent_allocate",
        "shutdown",
        # Derived devices (kubelet/sharing.go): time-slicing replicas and a mixed-MIG node with three resources.
        "shared_registration",
        "shared_fault",
        "shared_allocate",
        "shared_preferred",
        "mig_registration",
        "mig_instance_fault",
        "mig_allocate",
        "mig_kubelet_restart",
    ):
        assert scenario in names, f"scenario {scenario} missing\n" + report
    if target == "plugin":
        assert not results["N/A"], "every scenario applies to the plugin\n" + report
