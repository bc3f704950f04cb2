"""The metrics collector: what a scrape says about devices, transitions, XIDs, NVML errors, the kubelet link and the
other outlets, parsed back from the exposition format the way Prometheus reads it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from plugin.app import App
from plugin.config import Config
from plugin.devices.model import GpuEvent
from plugin.devices.nvml import NvmlBackend
from plugin.devices.simulated import SimulatedBackend
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import DeviceStatus, NodeState
from plugin.health.reasons import Reason, State
from plugin.kubelet.allocation import AllocationConfig
from plugin.kubelet.resources import WholeGpus
from plugin.kubelet.supervisor import Supervisor
from plugin.outlets.correlation import CorrelationStats
from plugin.outlets.metrics import Sources, build_registry, label_code
from plugin.outlets.reporter import ReporterStatus
from tests.conftest import FakeClock, NodeFile
from tests.fakes import nvml_standin

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(registry: object) -> Samples:
    text = generate_latest(registry).decode()  # type: ignore[arg-type]
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def named(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


@dataclass
class Node:
    file: NodeFile
    backend: SimulatedBackend
    state: NodeState
    monitor: Monitor
    clock: FakeClock

    def fault(self, index: int, **signals: object) -> None:
        self.file.set(index, **signals)
        assert self.backend.reload()
        self.monitor.poll_once()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    nf = NodeFile(tmp_path / "node.json")
    backend = SimulatedBackend(nf.path)
    state = NodeState()
    clock = FakeClock()
    monitor = Monitor(backend, state, HealthConfig(clear_after_polls=1), 5.0, threading.Event(), clock=clock)
    yield Node(nf, backend, state, monitor, clock)
    backend.close()


def test_device_state_is_one_for_the_current_state_and_zero_for_the_other_three(node: Node) -> None:
    reg = build_registry(Sources(node.state, node.monitor), process=False)
    node.monitor.poll_once()
    node.fault(2, row_remap_failure=True)
    s = scrape(reg)
    states = named(s, "gpu_health_device_state")
    assert len(states) == 8 * 4
    for uuid in node.file.uuids:
        per_device = {dict(k)["state"]: v for k, v in states.items() if dict(k)["device"] == uuid}
        assert set(per_device) == {"Healthy", "Degraded", "Unknown", "Unhealthy"}
        assert sum(per_device.values()) == 1
    bad = node.file.uuids[2]
    assert value(s, "gpu_health_device_state", device=bad, state="Unhealthy") == 1
    assert value(s, "gpu_health_device_state", device=bad, state="Healthy") == 0
    assert value(s, "gpu_health_device_reason", device=bad, reason="row-remap-failure") == 1
    assert value(s, "gpu_health_device_kubelet_healthy", device=bad) == 0
    assert value(s, "gpu_health_device_kubelet_healthy", device=node.file.uuids[0]) == 1
    assert value(s, "gpu_health_devices") == 8

    # A scrape after recovery flips the gauge back; nothing is left stuck at 1.
    node.fault(2, row_remap_failure=None)
    s = scrape(reg)
    assert value(s, "gpu_health_device_state", device=bad, state="Healthy") == 1
    assert value(s, "gpu_health_device_state", device=bad, state="Unhealthy") == 0
    assert value(s, "gpu_health_device_reason", device=bad, reason="row-remap-failure") is None


def test_transitions_are_counted_by_state_entered_and_leading_reason(node: Node) -> None:
    node.monitor.poll_once()  # the devices appear before the collector exists: not counted below
    reg = build_registry(Sources(node.state, node.monitor), process=False)
    assert named(scrape(reg), "gpu_health_transitions_total") == {}
    node.fault(2, row_remap_failure=True)
    node.fault(3, temperature_c=89)
    node.fault(2, row_remap_failure=None)
    s = scrape(reg)
    assert value(s, "gpu_health_transitions_total", to="Unhealthy", reason="row-remap-failure") == 1
    assert value(s, "gpu_health_transitions_total", to="Degraded", reason="thermal-slowdown") == 1
    assert value(s, "gpu_health_transitions_total", to="Healthy", reason="none") == 1
    # Counters only grow: a second scrape with nothing new reports the same numbers, not zero or double.
    assert named(scrape(reg), "gpu_health_transitions_total") == named(s, "gpu_health_transitions_total")


def test_a_clearance_that_keeps_the_state_is_not_counted_as_entering_it(node: Node) -> None:
    node.monitor.poll_once()
    reg = build_registry(Sources(node.state, node.monitor), process=False)
    node.file.set(2, row_remap_failure=True, xid_events=[48])
    assert node.backend.reload()
    node.monitor.handle_events(node.backend.wait_events(0))
    node.monitor.poll_once()
    before = named(scrape(reg), "gpu_health_transitions_total")
    assert sum(before.values()) == 1
    node.monitor.clear(node.file.uuids[2], "xid-48", "reset by hand")  # Unhealthy -> Unhealthy, with a note
    assert [t.note for t in node.state.history() if t.note]
    assert named(scrape(reg), "gpu_health_transitions_total") == before


def test_transitions_lost_from_a_full_history_are_counted_as_missed() -> None:
    state = NodeState(history=4)
    reg = build_registry(Sources(state), process=False)
    gpu = SimulatedBackend(None).discover().gpus[0]
    for i in range(10):
        st = State.UNHEALTHY if i % 2 == 0 else State.HEALTHY
        state.publish([DeviceStatus(gpu.uuid, gpu, st, (), float(i), "Healthy")], float(i))
    s = scrape(reg)
    assert value(s, "gpu_health_transitions_missed_total") == 10
    assert named(s, "gpu_health_transitions_total") == {}
    state.publish([DeviceStatus(gpu.uuid, gpu, State.DEGRADED, (), 11.0, "Healthy")], 11.0)
    assert value(scrape(reg), "gpu_health_transitions_total", to="Degraded", reason="none") == 1


def test_xids_are_counted_by_device_and_number(node: Node) -> None:
    node.monitor.poll_once()
    reg = build_registry(Sources(node.state, node.monitor), process=False)
    a, b = node.file.uuids[0], node.file.uuids[1]
    now = node.clock()
    node.monitor.handle_events([GpuEvent(a, "xid", 13, now), GpuEvent(a, "xid", 13, now),
                                GpuEvent(b, "xid", 79, now), GpuEvent(b, "ecc-dbe", 0, now)])
    s = scrape(reg)
    assert value(s, "gpu_health_xid_events_total", device=a, xid="13") == 2
    assert value(s, "gpu_health_xid_events_total", device=b, xid="79") == 1
    assert len(named(s, "gpu_health_xid_events_total")) == 2  # the ECC event is not an XID
    assert value(s, "gpu_health_driver_events_total") == 4


def test_nvml_call_errors_come_from_the_backend(tmp_path: Path) -> None:
    backend, node = nvml_standin.open_backend(tmp_path)
    state = NodeState()
    monitor = Monitor(backend, state, HealthConfig(), 5.0, threading.Event())
    reg = build_registry(Sources(state, monitor, backend), process=False)
    monitor.poll_once()
    assert value(scrape(reg), "gpu_health_nvml_call_errors_total") == 0
    node.nvml(1, fail={"nvmlDeviceGetTemperature": "unknown"})
    monitor.poll_once()
    monitor.poll_once()
    assert value(scrape(reg), "gpu_health_nvml_call_errors_total") == backend.call_errors >= 2
    backend.close()


def test_poll_duration_is_a_summary_with_cumulative_count_and_sum(node: Node) -> None:
    reg = build_registry(Sources(node.state, node.monitor), process=False)
    for _ in range(5):
        node.monitor.poll_once()
    s = scrape(reg)
    assert value(s, "gpu_health_poll_duration_seconds_count") == 5
    total = value(s, "gpu_health_poll_duration_seconds_sum")
    assert total is not None and total == pytest.approx(sum(node.monitor.poll_durations))
    q = {dict(k)["quantile"]: v for k, v in named(s, "gpu_health_poll_duration_seconds").items()}
    assert set(q) == {"0.5", "0.9", "0.99"} and 0 < q["0.5"] <= q["0.99"] <= max(node.monitor.poll_durations)
    assert value(s, "gpu_health_loop_last_run_timestamp_seconds", loop="poll") == node.clock()


def test_registration_and_streams_come_from_the_supervisor(node: Node, tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "dp", [WholeGpus()], node.state, AllocationConfig(dev_root=tmp_path),
                     threading.Event())
    reg = build_registry(Sources(node.state, supervisor=sup), process=False)
    s = scrape(reg)
    assert value(s, "gpu_health_registered") == 0
    assert value(s, "gpu_health_registrations_total") == 0
    assert value(s, "gpu_health_listandwatch_streams", resource="nvidia.com/gpu") == 0
    sup.record.registered = True
    sup.record.registrations = 2
    sup.record.failures = 3
    sup.record.last_registered_at = 1234.5
    s = scrape(reg)
    assert value(s, "gpu_health_registered") == 1
    assert value(s, "gpu_health_registrations_total") == 2
    assert value(s, "gpu_health_registration_failures_total") == 3
    assert value(s, "gpu_health_last_registration_timestamp_seconds") == 1234.5


def test_annotation_and_correlation_status_come_from_their_outlets(node: Node) -> None:
    s = scrape(build_registry(Sources(node.state), process=False))
    assert value(s, "gpu_health_annotation_writes_total") is None  # the outlet is off: no series at all
    # ``failures`` is every kind together; only the failed writes are annotation write failures.
    ann = ReporterStatus(node="n", writes=7, failures_by_kind={"write": 2, "read": 3, "event": 4},
                         events_written=5, last_error="boom")
    assert ann.failures == 9
    corr = CorrelationStats(events_posted=3, evictions_evicted=1, evictions_blocked=2)
    reg = build_registry(Sources(node.state, annotations=lambda: ann, correlation=lambda: corr), process=False)
    s = scrape(reg)
    assert value(s, "gpu_health_annotation_writes_total") == 7
    assert value(s, "gpu_health_annotation_write_failures_total") == 2
    assert value(s, "gpu_health_node_read_failures_total") == 3
    assert value(s, "gpu_health_node_event_failures_total") == 4
    assert value(s, "gpu_health_node_events_total") == 5
    assert value(s, "gpu_health_api_client_failures_total") == 0
    assert value(s, "gpu_health_pod_events_total") == 3
    assert value(s, "gpu_health_pod_evictions_total", result="evicted") == 1
    assert value(s, "gpu_health_pod_evictions_total", result="blocked") == 2
    assert value(s, "gpu_health_pod_evictions_total", result="failed") == 0


def test_the_app_gives_a_collector_to_each_part_that_is_on(tmp_path: Path) -> None:
    def app_with(backend: NvmlBackend | SimulatedBackend) -> App:
        # No node name: the cluster reporter is off; the correlator is on by default (--correlate-on Unhealthy).
        cfg = Config(backend="simulated", device_plugin_dir=tmp_path / "dp", state_dir=tmp_path / "state",
                     dev_root=tmp_path, metrics_address="127.0.0.1:0")
        app = App(cfg, backend)
        assert app.kube_reporter is None and app.correlator is not None and app.metrics_server is not None
        return app

    nvml, node = nvml_standin.open_backend(tmp_path / "nvml")
    app = app_with(nvml)
    node.nvml(1, fail={"nvmlDeviceGetTemperature": "unknown"})
    app.monitor.poll_once()
    assert app.metrics_server is not None
    s = scrape(app.metrics_server.registry)
    assert value(s, "gpu_health_nvml_call_errors_total") == nvml.call_errors >= 1
    assert value(s, "gpu_health_devices") == 8 and value(s, "gpu_health_registered") == 0
    assert value(s, "gpu_health_poll_duration_seconds_count") == app.monitor.polls == 1
    assert value(s, "gpu_health_pod_resources_lookups_total") == 0
    assert value(s, "gpu_health_annotation_writes_total") is None and value(s, "gpu_health_node_reads_total") is None
    app.backend.close()

    app = app_with(SimulatedBackend(None))
    app.monitor.poll_once()
    assert app.metrics_server is not None
    assert value(scrape(app.metrics_server.registry), "gpu_health_nvml_call_errors_total") == 0
    app.backend.close()


def test_label_values_never_carry_free_text() -> None:
    assert label_code("xid-79") == "xid-79" and label_code("row-remap-pending") == "row-remap-pending"
    assert label_code("GPU fell off the bus at 12:00") == "other"
    assert label_code("x" * 100) == "other"
    state = NodeState()
    gpu = SimulatedBackend(None).discover().gpus[0]
    bad = Reason("Oops: free text", State.UNHEALTHY, "message", "poll", "none", 0.0)
    state.publish([DeviceStatus(gpu.uuid, gpu, State.UNHEALTHY, (bad,), 0.0, "Unhealthy")], 0.0)
    reg = build_registry(Sources(state), process=False)
    state.publish([DeviceStatus(gpu.uuid, gpu, State.DEGRADED, (bad,), 1.0, "Healthy")], 1.0)
    s = scrape(reg)
    assert value(s, "gpu_health_device_reason", device=gpu.uuid, reason="other") == 1
    assert value(s, "gpu_health_transitions_total", to="Degraded", reason="other") == 1
    allowed = {"device", "state", "reason", "to", "xid", "loop", "resource", "result", "quantile"}
    for (_, labels), _v in s.items():
        assert {k for k, _ in labels} <= allowed


def test_process_metrics_and_private_registries(node: Node) -> None:
    a = build_registry(Sources(node.state, node.monitor))
    b = build_registry(Sources(node.state, node.monitor))  # a second one side by side: no duplicate error
    s = scrape(a)
    assert (value(s, "process_resident_memory_bytes") or 0) > 0
    assert value(s, "process_start_time_seconds") == pytest.approx(value(scrape(b), "process_start_time_seconds"))
    assert value(s, "process_start_time_seconds") <= time.time()  # type: ignore[operator]
