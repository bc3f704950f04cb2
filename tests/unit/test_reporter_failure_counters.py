"""Each kind of failed API request of the cluster reporter has its own counter and metric: a failed Node read or a
failed Event is not counted as a failed annotation write (the alert on annotation writes would fire for the wrong
cause, and an Event outage would hide among them). Real reporter, real client, HTTP-level fake API."""

from __future__ import annotations

import random
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from plugin.kube.client import KubeClient
from plugin.outlets.metrics import Sources, build_registry
from plugin.outlets.reporter import KubeReporter, ReporterSettings
from tests.conftest import FakeClock
from tests.fakes.fake_apiserver import FakeApiServer, Request
from tests.fakes.node_devices import Node

NODE = "gpu-node-1"
T0 = 1_767_225_600.0


def scrape(registry: object) -> dict[str, float]:
    text = generate_latest(registry).decode()  # type: ignore[arg-type]
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def run_until(rep: KubeReporter, clock: FakeClock, t: float) -> None:
    for _ in range(10_000):
        deadline = rep.tick(clock.now)
        if clock.now >= t:
            return
        clock.now = min(max(deadline, clock.now), t)
    raise AssertionError("reporter did not settle")


def test_reads_writes_events_and_client_failures_are_counted_apart(tmp_path: Path) -> None:
    api = FakeApiServer().start()
    try:
        api.add_node(NODE)
        kubeconfig = api.kubeconfig(tmp_path)
        state = NodeState()
        node = Node(state, n=4)
        clock = FakeClock(1000.0)
        builds = {"n": 0}

        def factory() -> KubeClient:
            builds["n"] += 1
            # The first build fails as a bad kubeconfig would; the client is built again after the back-off.
            return KubeClient(tmp_path / "missing" if builds["n"] == 1 else kubeconfig)

        rep = KubeReporter(state, ReporterSettings(node_name=NODE), factory, clock=clock,
                           wall=lambda: T0 + clock.now, rng=random.Random(5))
        registry = build_registry(Sources(state, annotations=rep.status), process=False)

        def is_get(r: Request) -> bool:
            return r.method == "GET"

        def is_node_patch(r: Request) -> bool:
            return r.method == "PATCH" and "/nodes/" in r.path

        def is_event_post(r: Request) -> bool:
            return r.method == "POST" and "/events" in r.path

        api.fail(503, count=2, when=is_get)
        node.publish(T0)
        run_until(rep, clock, 1200.0)
        s = rep.status()
        assert (s.client_failures, s.read_failures, s.write_failures, s.event_failures) == (1, 2, 0, 0)
        assert s.writes == 1 and s.ok  # converged after the failed reads
        api.fail(500, count=1, when=is_node_patch)
        api.fail(500, count=1, when=is_event_post)
        node.set(2, State.UNHEALTHY, "xid-79", now=T0 + clock.now)
        run_until(rep, clock, 1800.0)
        s = rep.status()
        assert (s.client_failures, s.read_failures, s.write_failures, s.event_failures) == (1, 2, 1, 1)
        assert s.failures == 5 and s.ok and s.writes == 2 and s.events_written == 1
        m = scrape(registry)
        assert m["gpu_health_annotation_write_failures_total"] == 1
        assert m["gpu_health_annotation_writes_total"] == 2
        assert m["gpu_health_node_read_failures_total"] == 2
        assert m["gpu_health_node_reads_total"] == s.reads >= 2
        assert m["gpu_health_node_event_failures_total"] == 1
        assert m["gpu_health_node_events_total"] == 1
        assert m["gpu_health_api_client_failures_total"] == 1
    finally:
        api.stop()
