"""Probes: /healthz fails when the poller or the event thread is stuck past the threshold and recovers when it moves
again; /readyz follows the kubelet registration. Loops are stalled the way a hung driver call stalls them (a backend
call that does not return) and time moves on a fake clock, so nothing sleeps."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from plugin.devices.model import Discovery, Gpu, GpuEvent, Reading
from plugin.devices.simulated import SimulatedBackend
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.kubelet.allocation import AllocationConfig
from plugin.kubelet.resources import WholeGpus
from plugin.kubelet.supervisor import Supervisor
from plugin.outlets.metrics import MetricsServer, Probes, Sources, build_registry
from tests.conftest import FakeClock, NodeFile

POLL_S = 5.0
STALL_S = 30.0
WAIT = 10.0  # upper bound for a thread to reach a point it is already on its way to


class StallableBackend:
    """The simulated backend (the NVML edge) with switches that make reads or the event wait hang until released,
    as a hung driver call does, and events that tell the test where the loops are."""

    def __init__(self, inner: SimulatedBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.stall_reads = False
        self.stall_events = False
        self.read_stuck = threading.Event()
        self.events_stuck = threading.Event()
        self.release = threading.Event()
        self.discovered = threading.Event()
        self.wait_entered = threading.Event()

    def discover(self) -> Discovery:
        self.discovered.set()
        return self.inner.discover()

    def read(self, gpu: Gpu) -> Reading:
        if self.stall_reads:
            self.read_stuck.set()
            self.release.wait()
        return self.inner.read(gpu)

    def wait_events(self, timeout_s: float) -> Sequence[GpuEvent]:
        self.wait_entered.set()
        if self.stall_events:
            self.events_stuck.set()
            self.release.wait()
        return self.inner.wait_events(timeout_s)

    def watch(self, on_change: object) -> None:
        pass

    def unwatch(self) -> None:
        pass

    def close(self) -> None:
        self.release.set()
        self.inner.close()


@dataclass
class Loops:
    backend: StallableBackend
    monitor: Monitor
    clock: FakeClock
    probes: Probes
    stop: threading.Event

    def events_went_round(self) -> None:
        """Block until the event loop starts a new round: it stamps its time just before it waits for events."""
        self.backend.wait_entered.clear()
        assert self.backend.wait_entered.wait(WAIT), "event loop never went round"

    def poll_finished(self) -> None:
        """Ask for another poll and block until it starts: the loop is sequential, so the one before is done."""
        self.backend.discovered.clear()
        self.monitor.request_poll()
        assert self.backend.discovered.wait(WAIT), "poller never went round"

    def release(self) -> None:
        self.backend.stall_reads = self.backend.stall_events = False
        self.backend.release.set()


@pytest.fixture
def loops(tmp_path: Path) -> Iterator[Loops]:
    nf = NodeFile(tmp_path / "node.json")
    backend = StallableBackend(SimulatedBackend(nf.path))
    clock = FakeClock()
    stop = threading.Event()
    monitor = Monitor(backend, NodeState(), HealthConfig(), POLL_S, stop, clock=clock,  # type: ignore[arg-type]
                      event_wait_s=0.01)
    probes = Probes(monitor, None, STALL_S, clock=clock)
    monitor.start()
    yield Loops(backend, monitor, clock, probes, stop)
    stop.set()
    backend.close()
    monitor.join(WAIT)


def test_healthz_is_ok_while_both_loops_go_round(loops: Loops) -> None:
    loops.events_went_round()
    ok, text = loops.probes.liveness()
    assert ok, text
    assert "poll loop ran" in text and "events loop ran" in text


def test_healthz_fails_when_the_poller_is_stuck_past_interval_plus_threshold(loops: Loops) -> None:
    loops.backend.stall_reads = True
    loops.monitor.request_poll()
    assert loops.backend.read_stuck.wait(WAIT)
    loops.clock.advance(POLL_S + STALL_S - 1)
    loops.events_went_round()
    ok, text = loops.probes.liveness()
    assert ok, f"within interval + threshold the poller is not stuck yet: {text}"

    loops.clock.advance(2)
    loops.events_went_round()
    ok, text = loops.probes.liveness()
    assert not ok
    assert "poll loop stalled" in text and "events" not in text

    loops.release()
    loops.poll_finished()
    loops.events_went_round()
    ok, text = loops.probes.liveness()
    assert ok, text


def test_healthz_fails_when_the_event_thread_is_stuck(loops: Loops) -> None:
    loops.backend.stall_events = True
    assert loops.backend.events_stuck.wait(WAIT)
    loops.clock.advance(STALL_S + 1)
    ok, text = loops.probes.liveness()
    assert not ok
    assert "events loop stalled" in text and "poll loop stalled" not in text

    loops.release()
    loops.events_went_round()
    assert loops.probes.liveness()[0]


def test_healthz_fails_before_the_loops_ever_ran(tmp_path: Path) -> None:
    monitor = Monitor(SimulatedBackend(None), NodeState(), HealthConfig(), POLL_S, threading.Event())
    ok, text = Probes(monitor, None, STALL_S).liveness()
    assert not ok and "has not run yet" in text


def test_readyz_follows_kubelet_registration(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "dp", [WholeGpus()], NodeState(), AllocationConfig(dev_root=tmp_path),
                     threading.Event())
    probes = Probes(None, sup, STALL_S)
    sup.record.last_error = "kubelet.sock does not exist (is the kubelet running?)"
    ok, text = probes.readiness()
    assert not ok and "kubelet.sock does not exist" in text
    sup.record.registered = True
    sup.record.registrations = 1
    assert probes.readiness()[0]
    sup.record.registered = False  # the kubelet restarted; we are re-registering
    assert not probes.readiness()[0]
    assert not Probes(None, None, STALL_S).readiness()[0]


def get(url: str, accept: str = "") -> tuple[int, str, str]:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(req, timeout=WAIT) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def test_http_server_serves_metrics_and_probes(loops: Loops, tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "dp", [WholeGpus()], loops.monitor.state, AllocationConfig(dev_root=tmp_path),
                     threading.Event())
    registry = build_registry(Sources(loops.monitor.state, loops.monitor, supervisor=sup))
    server = MetricsServer("127.0.0.1:0", registry, Probes(loops.monitor, sup, STALL_S, clock=loops.clock))
    server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        code, ctype, body = get(base + "/metrics")
        assert code == 200 and ctype.startswith("text/plain")
        assert 'gpu_health_device_state{device="' in body and "process_resident_memory_bytes" in body
        code, ctype, body = get(base + "/metrics", accept="application/openmetrics-text; version=1.0.0")
        assert code == 200 and ctype.startswith("application/openmetrics-text") and body.endswith("# EOF\n")

        loops.events_went_round()
        assert get(base + "/healthz")[0] == 200
        code, _, body = get(base + "/readyz")
        assert code == 503 and "not registered" in body
        sup.record.registered = True
        assert get(base + "/readyz")[0] == 200

        loops.backend.stall_events = True
        assert loops.backend.events_stuck.wait(WAIT)
        loops.clock.advance(STALL_S + 1)
        code, _, body = get(base + "/healthz")
        assert code == 503 and "events loop stalled" in body
        assert get(base + "/nope")[0] == 404
    finally:
        server.stop()
    with pytest.raises(OSError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=2)
    # An HTTPError is an OSError too, but it is an answer (the 503 above): the server must be gone.
    assert not isinstance(err.value, urllib.error.HTTPError), err.value


def test_ipv6_and_bad_addresses(loops: Loops) -> None:
    registry = build_registry(Sources(loops.monitor.state), process=False)
    with pytest.raises(ValueError, match="HOST:PORT"):
        MetricsServer("9402", registry, loops.probes)
    try:
        server = MetricsServer("[::1]:0", registry, loops.probes)
        server.start()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert get(f"http://[::1]:{server.port}/metrics")[0] == 200
    finally:
        server.stop()
