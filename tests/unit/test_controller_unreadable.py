"""A Node whose agent annotations cannot be read is counted three ways (issue 35, item 1): the
``gpu_health_controller_unreadable_nodes`` gauge, one log line a minute at most, one Event on that Node while it stays
so. Shown on the controller as ``gpu-health-controller`` wires it (plugin/controller/main.py: its reconciler, Node
watcher, elector and metrics registry), its three API clients swapped for the in-memory API server, on a virtual
clock for the reconcile steps: the LIST and the watch events go through the real NodeWatcher, the Lease through the
real elector, the metric is read from the registry /metrics serves.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from plugin.controller.config import load
from plugin.controller.main import Controller
from plugin.controller.reconciler import UNREADABLE_LOG_S
from plugin.schema.annotations import VALUE_MAX_BYTES, VALUE_MAX_DEPTH
from plugin.serve.exposition import encode_text
from tests.conftest import FakeClock
from tests.fakes.controller_api import T0, FakeControllerApi, P, device, gpu_node

DEEP = "[" * 1000 + "]" * 1000  # json.loads raises RecursionError on it; the agent's account can write it
BIG = json.dumps({"id": "GPU-bad-3", "state": "Unhealthy", "action": "reboot-node", "pad": "x" * VALUE_MAX_BYTES})
UNREADABLE_LINE = "cannot be read"
REASON = "GPUAnnotationsUnreadable"


class Running:
    """The controller of main.py on a fake API server. ``tick`` is one round of what its threads do: the elector's
    step (renewing the Lease), then one reconcile step at the virtual clock's time."""

    def __init__(self, tmp_path: Path, nodes: list[dict[str, Any]]) -> None:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9"}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
        cfg = load(["--kubeconfig", str(kubeconfig), "--metrics-address", "127.0.0.1:0", "--identity", "me",
                    "--write-concurrency", "1", "--max-quarantined-fraction", "0.5"], {})
        self.c = Controller(cfg)
        self.clock = FakeClock(T0)
        self.api = FakeControllerApi()
        self.api.clock = self.clock
        self.api.list_page_size = 2  # the unreadable Node sits in the middle of the LIST
        for n in nodes:
            self.api.add_node(n)
        # Nothing in this test talks to a real API server: the clients main.py built are replaced before any call.
        self.c.reconciler.api = self.api
        self.c.watcher.api = self.api
        self.c.leader.api = self.api
        assert self.c.metrics is not None
        self.registry = self.c.metrics.registry
        self.c.watcher.list_all()
        self.c.leader.step()
        assert self.c.leader.is_leader()

    def tick(self, seconds: float = 0.0) -> None:
        self.clock.now += seconds
        self.c.leader.step()
        for _ in range(6):
            if self.c.reconciler.step(self.clock.now) > self.clock.now:
                return

    def resync(self) -> None:
        """The watcher's hourly LIST (or one after a 410), page by page."""
        self.c.watcher.list_all()

    def watch_event(self, name: str) -> None:
        """One watch of the real watcher, resumed from its version, that delivers ``name`` as it is now."""
        self.api.streams = [[{"type": "MODIFIED", "object": self.api.node(name)}]]
        self.c.watcher.round()

    def unreadable_gauge(self) -> float:
        text = encode_text(self.registry).decode()
        [value] = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == "gpu_health_controller_unreadable_nodes"]
        return float(value)

    def told(self) -> list[str]:
        return [e["involvedObject"]["name"] for e in self.api.events if e["reason"] == REASON]

    def quarantined(self) -> list[str]:
        return sorted(n for n, d in self.api.nodes.items()
                      if f"controller.{P}/quarantined-by" in (d["metadata"].get("annotations") or {}))

    def ready(self) -> None:
        assert self.c.metrics is not None
        ok, why = self.c.metrics.probes.readiness()
        assert ok, why
        assert self.c.watcher.failures == 0 and self.c.watcher.last_error == ""


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture) -> Iterator[list[str]]:
    caplog.set_level(logging.WARNING, logger="plugin.controller")
    out: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if UNREADABLE_LINE in record.getMessage():
                out.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logging.getLogger("plugin.controller").addHandler(handler)
    try:
        yield out
    finally:
        logging.getLogger("plugin.controller").removeHandler(handler)


@pytest.mark.parametrize("value", [DEEP, BIG], ids=["nested-1000-deep", f"over-{VALUE_MAX_BYTES}-bytes"])
def test_an_unreadable_node_is_one_event_one_line_a_minute_and_the_gauge_until_it_reads_again(
        tmp_path: Path, lines: list[str], value: str) -> None:
    assert value.count("[") + value.count("{") > VALUE_MAX_DEPTH or len(value) > VALUE_MAX_BYTES
    bad = gpu_node("bad", {0: "Unhealthy"}, annotations={f"{P}/gpu.3": value})
    run = Running(tmp_path, [gpu_node("a0"), bad, gpu_node("a1"), gpu_node("z9", {2: "Unhealthy"})])
    assert run.unreadable_gauge() == 1  # counted as soon as the LIST is in: before any step
    run.tick()
    assert run.quarantined() == ["z9"]  # the readable failing node after it, decided
    assert run.told() == ["bad"]
    assert len(lines) == 1 and "bad" in lines[0] and f"{P}/gpu.3" in lines[0], lines
    run.ready()
    # Inside the minute, while it stays unreadable: resyncs, watch events of it (a heartbeat, another device
    # failing), steps. No second Event, no second line; the gauge stays 1.
    for i in range(5):
        run.tick(10.0)
        run.resync()
        run.api.heartbeat("bad", run.clock.now)
        run.watch_event("bad")
        if i == 2:
            run.api.edit("bad", {"metadata": {"annotations": dict([device(1, "Unhealthy", action="reset-gpu",
                                                                          code="ecc-uncorrected", node="bad")])}})
            run.watch_event("bad")
        run.tick()
        assert run.unreadable_gauge() == 1
    assert run.clock.now - T0 < UNREADABLE_LOG_S
    assert run.told() == ["bad"] and len(lines) == 1, (run.told(), lines)
    assert run.quarantined() == ["z9"]  # neither quarantined on its facts nor blocking another
    # The minute is up: one new line (at the first step after it), still no second Event.
    run.clock.now = T0 + UNREADABLE_LOG_S
    run.tick()
    assert len(lines) == 2 and run.told() == ["bad"], (run.told(), lines)
    run.tick(1.0)
    run.resync()
    assert len(lines) == 2
    # Its agent writes values it can read again: the gauge says 0 at once, no line after the next minute.
    run.api.edit("bad", {"metadata": {"annotations": {f"{P}/gpu.3": None}}})
    run.watch_event("bad")
    assert run.unreadable_gauge() == 0
    run.tick()
    assert run.quarantined() == ["bad", "z9"]  # decided on what it says now: two Unhealthy GPUs
    run.tick(2 * UNREADABLE_LOG_S)
    run.resync()
    run.tick()
    assert run.unreadable_gauge() == 0 and len(lines) == 2 and run.told() == ["bad"]
    run.ready()
    # Unreadable again, later: a new stretch, a new Event, a new line (the last was more than a minute ago).
    run.api.edit("bad", {"metadata": {"annotations": {f"{P}/node": value}}})
    run.watch_event("bad")
    run.tick()
    assert run.unreadable_gauge() == 1
    assert run.told() == ["bad", "bad"] and len(lines) == 3 and f"{P}/node" in lines[2], (run.told(), lines)
    run.ready()
