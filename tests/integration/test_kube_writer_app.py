"""Cluster reporting wired into the whole plugin: simulated node, kubelet stand-in, and the fake API server.

The kubelet keeps getting health while the API server refuses writes; the failure shows in the health stream; the
annotations converge when the API server answers again.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.gpuhealth.v1alpha1 import health_pb2
from plugin.app import App
from plugin.devtools.standin import KubeletStandin
from tests.conftest import NodeFile
from tests.fakes.fake_apiserver import FakeApiServer
from tests.integration.conftest import Env, make_config

NODE = "gpu-node-int"
P = "gpu-health.io"


@pytest.fixture()
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer().start()
    server.add_node(NODE, {"example.com/owner": "ops"})
    yield server
    server.stop()


@pytest.fixture()
def reporting_env(short_socket_dir: Path, dev_root: Path, api: FakeApiServer) -> Iterator[Env]:
    node = NodeFile(short_socket_dir / "node.json")
    kubelet = KubeletStandin(short_socket_dir / "dp")
    kubelet.start()
    cfg = make_config(short_socket_dir, node, dev_root, node_name=NODE, kubeconfig=api.kubeconfig(short_socket_dir),
                      report_debounce=0.05, report_min_interval=0.05)
    app = App(cfg)
    assert app.kube_reporter is not None
    app.kube_reporter._sched.backoff.initial = 0.05  # fast retries; the policy itself is tested in unit tests
    app.kube_reporter._sched.backoff.maximum = 0.2
    app.start()
    e = Env(short_socket_dir, node, kubelet, app, cfg)
    assert e.wait_kubelet(lambda: kubelet.capacity() == (8, 8)), "plugin never registered"
    yield e
    app.stop.set()
    app.shutdown()
    kubelet.stop()


def _device(api: FakeApiServer, index: int) -> dict[str, object]:
    raw = (api.nodes[NODE]["metadata"].get("annotations") or {}).get(f"{P}/gpu.{index}")
    return json.loads(raw) if raw else {}


def test_annotations_follow_faults_and_survive_an_api_outage(reporting_env: Env, api: FakeApiServer) -> None:
    e = reporting_env
    assert api.wait_for(lambda: _device(api, 0).get("state") == "Healthy"), api.requests[-3:]
    e.node.set(2, xid_events=[79])
    assert api.wait_for(lambda: _device(api, 2).get("state") == "Unhealthy")
    assert api.annotations(NODE)["example.com/owner"] == "ops"

    api.fail(503, count=10_000)  # the API server goes away
    e.node.set(5, xid_events=[79])
    uuid5 = e.node.uuids[5]
    assert e.wait_kubelet(lambda: e.kubelet.health(uuid5) == "Unhealthy"), "the kubelet path waited on the API"
    reporter = e.app.kube_reporter
    assert reporter is not None
    assert e.wait_state(lambda: not reporter.status().ok)
    listed = e.app.health_server.servicer.List(health_pb2.ListRequest(), None)  # type: ignore[arg-type]
    assert "HTTP 503" in listed.outlet_errors["kube"]
    assert _device(api, 5).get("state") == "Healthy"  # not written yet

    api.clear_faults()  # it comes back: the reporter converges
    assert api.wait_for(lambda: _device(api, 5).get("state") == "Unhealthy")
    assert e.wait_state(lambda: reporter.status().ok)
    listed = e.app.health_server.servicer.List(health_pb2.ListRequest(), None)  # type: ignore[arg-type]
    assert dict(listed.outlet_errors) == {}


def test_an_idle_node_polling_every_tenth_of_a_second_writes_nothing(reporting_env: Env,
                                                                     api: FakeApiServer) -> None:
    """The reporter's pacing here is 20 writes/s, so a ``since`` that moved with each poll would show at once."""
    e = reporting_env
    assert api.wait_for(lambda: all(_device(api, i).get("state") == "Healthy" for i in range(8)))
    polls = e.app.monitor.polls
    patches = api.count("PATCH")

    def patched() -> int:  # called by wait_for under the server's lock: read the list without taking it again
        return sum(1 for r in api.requests if r.method == "PATCH")

    # Waits on the fake server's request events: returns early (and fails) at the first PATCH.
    assert not api.wait_for(lambda: patched() > patches, timeout=3.0), api.requests[-3:]
    assert e.app.monitor.polls - polls >= 10  # the plugin really was polling all along
    e.node.set(4, xid_events=[79])
    assert api.wait_for(lambda: _device(api, 4).get("state") == "Unhealthy")
    assert not api.wait_for(lambda: patched() > patches + 1, timeout=1.0), api.requests[-3:]
