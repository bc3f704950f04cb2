"""Smoke test on a real NVIDIA GPU: the NVML backend discovers every GPU, reads every signal without raising, the
policy classifies the readings, and the event wait returns. Prints what it saw (record it in docs/gpu-smoke.md)."""

from __future__ import annotations

import json
import threading
from dataclasses import asdict

import pytest

from plugin.devices.nvml import NvmlBackend
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.health.policy import evaluate_reading

pytestmark = pytest.mark.gpu


def test_real_gpu_discovery_readings_and_events() -> None:
    backend = NvmlBackend()
    try:
        d = backend.discover()
        assert d.error is None and d.gpus, d.error
        report = {"driver": d.driver_version, "gpus": []}
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
        print(json.dumps(report, indent=1, default=str))
    finally:
        backend.close()
