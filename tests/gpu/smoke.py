"""The real-GPU smoke run, as its own process (``python -m tests.gpu.smoke``): the pytest process may hold the NVML
stand-in (tests/nvml_standin) under the soname ``libnvidia-ml.so.1``, and one process can map only one library of
that name. Prints a JSON report of what it saw; exits non-zero on the first check that fails."""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import asdict
from typing import Any

from plugin.devices.nvml import NvmlBackend
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.health.policy import evaluate_reading


def main() -> int:
    backend = NvmlBackend()
    try:
        d = backend.discover()
        assert d.error is None and d.gpus, d.error
        report: dict[str, Any] = {"driver": d.driver_version, "gpus": []}
        for gpu in d.gpus:
            assert gpu.uuid.startswith(("GPU-", "MIG-")) and len(gpu.uuid) <= 63
            reading = backend.read(gpu)
            assert not reading.lost
            conditions = evaluate_reading(reading, None, HealthConfig())
            r = asdict(reading)
            r["clock_event_reasons"] = sorted(r["clock_event_reasons"] or [])
            report["gpus"].append({"gpu": {**asdict(gpu), "mig_devices": len(gpu.mig_devices)}, "reading": r,
                                   "conditions": [c.code for c in conditions]})
        assert backend.wait_events(1.0) is not None
        state = NodeState()
        monitor = Monitor(backend, state, HealthConfig(), 5.0, threading.Event())
        monitor.poll_once()
        report["states"] = {s.id: s.state.value for s in state.snapshot().devices}
        report["poll_ms"] = round(monitor.poll_durations[-1] * 1000, 3)
        report["nvml_call_errors"] = backend.call_errors
        # What is watched and why not, per GPU: the first thing to compare with the stand-in's profiles.
        report["inspect"] = backend.describe()
        print(json.dumps(report, indent=1, default=str))
        # A healthy machine's GPUs read Healthy: an absent feature must never read as a fault.
        unhealthy = {k: v for k, v in report["states"].items() if v != "Healthy"}
        if unhealthy:
            print(f"not Healthy: {unhealthy}", file=sys.stderr)
            return 1
        return 0
    finally:
        backend.close()


if __name__ == "__main__":
    sys.exit(main())
