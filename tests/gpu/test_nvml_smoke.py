"""Smoke test on a real NVIDIA GPU: the NVML backend discovers every GPU, reads every signal without raising, the
policy classifies the readings, the event wait returns, and a GPU with no fault reads Healthy. The run is a child
process (tests/gpu/smoke.py), apart from any NVML stand-in this pytest process loaded. Prints what it saw (record
it in docs/gpu-smoke.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]


def test_real_gpu_discovery_readings_and_events() -> None:
    run = subprocess.run([sys.executable, "-m", "tests.gpu.smoke"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    print(run.stdout)
    assert run.returncode == 0, run.stderr
