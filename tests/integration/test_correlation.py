"""Pod correlation over a real unix socket: a PodResources server says which pods hold which devices; the outlet
runs in its own thread on a real node state fed by the simulated backend. The Kubernetes side is a recording fake
here (the API server is the edge); tests/conformance/apiserver/test_correlation.py runs it against a real one."""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from plugin.app import App
from plugin.devices.simulated import SimulatedBackend
from plugin.devtools.standin import KubeletStandin
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.kube.errors import ApiFailure
from plugin.kube.protocols import PodApi
from plugin.kube.views import PodView
from plugin.kubelet.resources import WholeGpus
from plugin.outlets.correlation import (
    CorrelationSettings,
    Correlator,
    Holding,
    PodResourcesClient,
    PodResourcesError,
)
from tests.conftest import NodeFile
from tests.fakes.podresources import PodResourcesServer
from tests.integration.conftest import make_config

WAIT = 10.0
GPU = "nvidia.com/gpu"


class RecordingApi:
    """The API server edge: records every call; ``evict_answers`` scripts the eviction API's replies."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.cond = threading.Condition()
        self.evict_answers: list[int] = []  # HTTP status per eviction attempt; 201 when empty
        self.missing: set[tuple[str, str]] = set()
        self.failing: dict[str, int] = {}  # call kind -> how many more of its calls fail with a 503

    def _record(self, kind: str, detail: Any) -> None:
        with self.cond:
            left = self.failing.get(kind, 0)
            if left:
                self.failing[kind] = left - 1
            self.calls.append((f"{kind}-refused" if left else kind, detail))
            self.cond.notify_all()
        if left:
            raise ApiFailure(503, f"{kind} refused: the API server is unavailable")

    def of(self, kind: str) -> list[Any]:
        with self.cond:
            return [d for k, d in self.calls if k == kind]

    def wait(self, kind: str, n: int = 1, timeout: float = WAIT) -> list[Any]:
        with self.cond:
            assert self.cond.wait_for(lambda: len([1 for k, _ in self.calls if k == kind]) >= n, timeout), \
                f"expected {n} {kind} calls, got {self.calls}"
        return self.of(kind)

    def get_pod(self, namespace: str, name: str) -> PodView:
        if (namespace, name) in self.missing:
            raise ApiFailure(404, f"pods {name!r} not found")
        return PodView(uid=f"uid-{namespace}-{name}", node_name="node-a")

    def create_event(self, namespace: str, body: Mapping[str, Any]) -> str:
        self._record("event", dict(body))
        return "ev-1"

    def patch_pod_annotations(self, namespace: str, name: str, annotations: Mapping[str, str | None]) -> None:
        self._record("annotate", (namespace, name, dict(annotations)))

    def evict_pod(self, namespace: str, name: str, uid: str) -> None:
        status = self.evict_answers.pop(0) if self.evict_answers else 201
        self._record("evict", (namespace, name, uid, status))
        if status != 201:
            raise ApiFailure(status, "Cannot evict pod as it would violate the pod's disruption budget.")

    def close(self) -> None:
        pass


@dataclass
class Rig:
    node: NodeFile
    backend: SimulatedBackend
    state: NodeState
    monitor: Monitor
    kubelet: PodResourcesServer
    api: RecordingApi
    correlator: Correlator

    def fault(self, index: int, **signals: Any) -> None:
        self.node.set(index, **signals)
        assert self.backend.reload()
        self.monitor.poll_once()


def build(tmp: Path, api_factory: Callable[[RecordingApi], PodApi] | None = None, **settings: Any) -> Rig:
    node = NodeFile(tmp / "node.json")
    backend = SimulatedBackend(node.path)
    state = NodeState()
    monitor = Monitor(backend, state, HealthConfig(clear_after_polls=1), 5.0, threading.Event())
    kubelet = PodResourcesServer(tmp / "pr.sock")
    kubelet.start()
    api = RecordingApi()
    opts: dict[str, Any] = {"states": frozenset({"Unhealthy"}), "resources": (WholeGpus(),), "node_name": "node-a",
                            "lookup_retry_initial_s": 0.05, "evict_retry_initial_s": 0.05}
    opts.update(settings)
    factory = (lambda: api_factory(api)) if api_factory is not None else (lambda: api)
    corr = Correlator(state, CorrelationSettings(**opts), PodResourcesClient(tmp / "pr.sock"), factory,
                      rng=random.Random(7))
    monitor.poll_once()  # the devices appear: Absent -> Healthy transitions, nothing to act on
    return Rig(node, backend, state, monitor, kubelet, api, corr)


@pytest.fixture
def rig(short_socket_dir: Path) -> Iterator[Rig]:
    r = build(short_socket_dir)
    r.correlator.start()
    yield r
    r.correlator.stop()
    r.kubelet.stop()
    r.backend.close()


def test_client_lists_every_device_held_over_the_socket(short_socket_dir: Path) -> None:
    server = PodResourcesServer(short_socket_dir / "pr.sock")
    client = PodResourcesClient(short_socket_dir / "pr.sock")
    with pytest.raises(PodResourcesError, match="does not exist"):
        client.list()
    server.start()
    try:
        server.assign("ml", "train-0", "worker", GPU, "GPU-a", "GPU-b")
        server.assign("ml", "train-0", "sidecar", "example.com/nic", "nic-0")
        assert client.list() == [Holding("ml", "train-0", "worker", GPU, "GPU-a"),
                                 Holding("ml", "train-0", "worker", GPU, "GPU-b"),
                                 Holding("ml", "train-0", "sidecar", "example.com/nic", "nic-0")]
        server.fail = grpc.StatusCode.UNAVAILABLE
        with pytest.raises(PodResourcesError, match="UNAVAILABLE"):
            client.list()
    finally:
        client.close()
        server.stop()


def test_unhealthy_device_gets_an_event_on_exactly_the_pods_holding_it(rig: Rig) -> None:
    uuids = rig.node.uuids
    rig.kubelet.assign("ml", "train-0", "worker", GPU, uuids[2], uuids[3])
    rig.kubelet.assign("ml", "train-1", "worker", GPU, uuids[0])
    rig.kubelet.assign("ml", "nic-user", "main", "example.com/gpu", uuids[2])  # same ID, another plugin's resource
    rig.fault(2, row_remap_failure=True)
    events = rig.api.wait("event")
    assert len(events) == 1
    ev = events[0]
    assert ev["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": "ml", "name": "train-0",
                                    "uid": "uid-ml-train-0"}
    assert ev["type"] == "Warning" and ev["reason"] == "GPUUnhealthy"
    assert uuids[2] in ev["message"] and "row-remap-failure" in ev["message"] and "worker" in ev["message"]
    assert uuids[3] not in ev["message"]
    assert ev["source"] == {"component": "gpu-health-device-plugin", "host": "node-a"}
    assert rig.api.of("annotate") == [] and rig.api.of("evict") == []  # both off by default
    assert rig.correlator.stats.events_posted == 1

    # The same state on later polls is not news; a recovery and a new failure is.
    rig.monitor.poll_once()
    rig.fault(2, row_remap_failure=None)
    rig.fault(2, row_remap_failure=True)
    assert len(rig.api.wait("event", 2)) == 2
    assert rig.correlator.stats.events_posted == 2


def test_degraded_is_ignored_unless_configured(short_socket_dir: Path) -> None:
    for states, expect in ((frozenset({"Unhealthy"}), 0), (frozenset({"Degraded", "Unhealthy"}), 1)):
        tmp = short_socket_dir / ("a" if expect else "b")
        tmp.mkdir()
        r = build(tmp, states=states)
        try:
            r.kubelet.assign("ml", "p", "c", GPU, r.node.uuids[3])
            r.fault(3, temperature_c=89)  # thermal slowdown: Degraded
            r.correlator.step(0.0)
            assert len(r.api.of("event")) == expect
            assert r.kubelet.calls == expect  # nothing bad: the kubelet is not even asked
        finally:
            r.kubelet.stop()
            r.backend.close()


def test_annotation_and_eviction_when_enabled(short_socket_dir: Path) -> None:
    r = build(short_socket_dir, annotate=True, evict=True)
    try:
        uuid = r.node.uuids[1]
        r.kubelet.assign("ml", "train-0", "worker", GPU, uuid)
        r.fault(1, row_remap_failure=True)
        r.correlator.step(0.0)
        assert r.api.of("annotate") == [("ml", "train-0", {"gpu-health.io/failing-devices": f"{uuid}=Unhealthy"})]
        assert r.api.of("evict") == [("ml", "train-0", "uid-ml-train-0", 201)]
        assert r.correlator.stats.evictions_evicted == 1
    finally:
        r.kubelet.stop()
        r.backend.close()


def test_eviction_refused_by_a_disruption_budget_is_retried_while_the_device_stays_bad(short_socket_dir: Path) -> None:
    r = build(short_socket_dir, evict=True)
    try:
        r.kubelet.assign("ml", "train-0", "worker", GPU, r.node.uuids[1])
        r.api.evict_answers = [429, 429]
        r.fault(1, row_remap_failure=True)
        t = 100.0
        next_at = r.correlator.step(t)
        assert [e[3] for e in r.api.of("evict")] == [429]
        assert r.correlator.stats.evictions_blocked == 1
        assert t < next_at < t + 1  # retried soon, with back-off
        assert r.correlator.step(t + 0.01) > t and len(r.api.of("evict")) == 1  # not before it is due
        next_at = r.correlator.step(next_at)
        next_at = r.correlator.step(next_at)
        assert [e[3] for e in r.api.of("evict")] == [429, 429, 201]
        assert r.correlator.stats.evictions_evicted == 1 and next_at == float("inf")

        # A budget that keeps refusing while the device recovers: the retry is dropped, the pod stays.
        r.kubelet.assign("ml", "train-1", "worker", GPU, r.node.uuids[4])
        r.api.evict_answers = [429]
        r.fault(4, row_remap_failure=True)
        next_at = r.correlator.step(t)
        assert r.api.of("evict")[-1][1:] == ("train-1", "uid-ml-train-1", 429)
        r.fault(4, row_remap_failure=None)
        assert r.correlator.step(next_at) == float("inf")
        assert len(r.api.of("evict")) == 4
    finally:
        r.kubelet.stop()
        r.backend.close()


def test_kubelet_unavailable_is_retried_and_the_pod_still_told(short_socket_dir: Path) -> None:
    r = build(short_socket_dir)
    try:
        r.kubelet.assign("ml", "p", "c", GPU, r.node.uuids[5])
        r.kubelet.fail = grpc.StatusCode.UNAVAILABLE
        r.fault(5, row_remap_failure=True)
        next_at = r.correlator.step(10.0)
        assert r.correlator.stats.lookup_failures == 1 and r.api.of("event") == []
        assert 10.0 < next_at < 11.0
        r.kubelet.fail = None
        r.correlator.step(next_at)
        assert len(r.api.of("event")) == 1
        # A pod that is gone from the API server by the time we look is left alone.
        r.kubelet.assign("ml", "gone", "c", GPU, r.node.uuids[6])
        r.api.missing.add(("ml", "gone"))
        r.fault(6, row_remap_failure=True)
        r.correlator.step(next_at + 1)
        assert len(r.api.of("event")) == 1
    finally:
        r.kubelet.stop()
        r.backend.close()


def test_event_is_kept_and_retried_with_backoff_until_posted_exactly_once(short_socket_dir: Path) -> None:
    """Building the client fails twice, then posting the Event fails three times: the pod/device/state is kept and
    retried with growing, capped, jittered delays, and exactly one Event goes out in the end."""
    builds = {"n": 0}

    def factory(api: RecordingApi) -> PodApi:
        builds["n"] += 1
        if builds["n"] <= 2:
            raise ApiFailure(None, "cannot configure a Kubernetes client: no service account token yet")
        return api

    r = build(short_socket_dir, api_factory=factory, annotate=True, act_retry_initial_s=1.0, act_retry_max_s=4.0)
    try:
        uuid = r.node.uuids[1]
        r.kubelet.assign("ml", "train-0", "worker", GPU, uuid)
        r.api.failing = {"event": 3, "annotate": 1}
        r.fault(1, row_remap_failure=True)
        t = 100.0
        delays = []
        for _ in range(50):
            next_at = r.correlator.step(t)
            if next_at == float("inf"):
                break
            assert next_at > t  # a back-off, never a hot loop
            delays.append(next_at - t)
            t = next_at
        assert builds["n"] == 3 and len(r.api.of("event-refused")) == 3
        assert len(delays) == 5  # two client builds and three refused Events, each followed by a back-off
        caps = [min(4.0, 1.0 * 2**n) for n in range(len(delays))]  # doubling from 1 s, capped at 4 s
        assert all(cap / 2 <= d <= cap for d, cap in zip(delays, caps, strict=True)), delays
        assert len(set(delays)) == len(delays)  # jittered: no two retries in lockstep
        events = r.api.of("event")
        assert len(events) == 1 and uuid in events[0]["message"]
        assert events[0]["involvedObject"]["uid"] == "uid-ml-train-0"
        assert r.api.of("annotate") == [("ml", "train-0", {"gpu-health.io/failing-devices": f"{uuid}=Unhealthy"})]
        assert r.correlator.stats.events_posted == 1 and r.correlator.stats.event_failures == 5
        r.monitor.poll_once()
        assert r.correlator.step(t + 1000.0) == float("inf") and len(r.api.of("event")) == 1  # told once
    finally:
        r.kubelet.stop()
        r.backend.close()


def test_retry_stops_when_the_device_no_longer_is_in_that_state(short_socket_dir: Path) -> None:
    r = build(short_socket_dir)
    try:
        r.kubelet.assign("ml", "train-0", "worker", GPU, r.node.uuids[2])
        r.api.failing = {"event": 1000}
        r.fault(2, row_remap_failure=True)
        next_at = r.correlator.step(100.0)
        assert 100.0 < next_at < float("inf") and len(r.api.of("event-refused")) == 1
        r.fault(2, row_remap_failure=None)  # recovered before the API server came back
        r.api.failing = {}
        assert r.correlator.step(next_at) == float("inf")
        assert r.api.of("event") == [] and len(r.api.of("event-refused")) == 1
    finally:
        r.kubelet.stop()
        r.backend.close()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=WAIT) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_app_serves_metrics_probes_and_correlates(short_socket_dir: Path, dev_root: Path) -> None:
    """The wiring: a plugin process's App with a kubelet stand-in and a PodResources server."""
    node = NodeFile(short_socket_dir / "node.json")
    kubelet = KubeletStandin(short_socket_dir / "dp")
    kubelet.start()
    pr = PodResourcesServer(short_socket_dir / "pr.sock")
    pr.start()
    pr.assign("ml", "train-0", "worker", GPU, node.uuids[2])
    cfg = make_config(short_socket_dir, node, dev_root, metrics_address="127.0.0.1:0",
                      pod_resources_socket=short_socket_dir / "pr.sock")
    app = App(cfg)
    assert app.correlator is not None and app.metrics_server is not None
    api = RecordingApi()
    app.correlator._api_factory = lambda: api  # the API server edge
    app.start()
    try:
        base = f"http://127.0.0.1:{app.metrics_server.port}"
        assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8), WAIT)
        assert app.supervisor.registered_event.wait(WAIT)
        code, body = get(base + "/readyz")
        assert code == 200, body
        assert get(base + "/healthz")[0] == 200
        node.set(2, row_remap_failure=True)
        event = api.wait("event")[0]
        assert event["involvedObject"]["name"] == "train-0"
        code, text = get(base + "/metrics")
        assert code == 200
        lines = set(text.splitlines())
        assert f'gpu_health_device_state{{device="{node.uuids[2]}",state="Unhealthy"}} 1.0' in lines
        assert "gpu_health_registered 1.0" in lines
        assert 'gpu_health_listandwatch_streams{resource="nvidia.com/gpu"} 1.0' in lines
        assert "gpu_health_pod_events_total 1.0" in lines
        # The eight devices appearing at start, then the fault.
        assert {ln for ln in lines if ln.startswith("gpu_health_transitions_total{")} == {
            'gpu_health_transitions_total{reason="none",to="Healthy"} 8.0',
            'gpu_health_transitions_total{reason="row-remap-failure",to="Unhealthy"} 1.0'}
    finally:
        app.stop.set()
        app.shutdown()
        kubelet.stop()
        pr.stop()
    assert json.dumps(cfg.effective())  # the new options are JSON-safe for the start-up log


def test_a_clearance_that_keeps_the_device_failing_is_not_news_for_its_pods(short_socket_dir: Path) -> None:
    # A clearance is a transition of its own (from == to) when another reason keeps the state: the pods were told
    # when the device entered it, and must not be told (or evicted) again for a fault that just left.
    r = build(short_socket_dir, annotate=True, evict=True)
    try:
        uuids = r.node.uuids
        r.kubelet.assign("ml", "train-0", "worker", GPU, uuids[2])
        r.node.set(2, row_remap_failure=True, xid_events=[48])
        assert r.backend.reload()
        r.monitor.handle_events(r.backend.wait_events(0))
        r.monitor.poll_once()
        r.correlator.step(0.0)
        assert len(r.api.of("event")) == 1 and len(r.api.of("evict")) == 1
        assert r.monitor.clear(uuids[2], "xid-48", "reset by hand") == [(uuids[2], "xid-48")]
        [t] = [t for t in r.state.history() if t.note]
        assert t.from_state == t.to_state == "Unhealthy"
        for _ in range(3):
            r.correlator.step(0.0)
        assert len(r.api.of("event")) == 1 and len(r.api.of("evict")) == 1 and len(r.api.of("annotate")) == 1
    finally:
        r.kubelet.stop()
        r.backend.close()
