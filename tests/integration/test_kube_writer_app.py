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


def test_a_gpu_on_the_bus_that_nvml_misses_is_the_nodes_annotation_condition_and_event(
        short_socket_dir: Path, dev_root: Path, api: FakeApiServer) -> None:
    from tests.unit.test_gpu_missing import bus, function

    sysfs = short_socket_dir / "sys"
    bus(sysfs, 8)  # the simulated node's 8 GPUs, at the addresses its node file gives them
    node = NodeFile(short_socket_dir / "node.json")
    kubelet = KubeletStandin(short_socket_dir / "dp")
    kubelet.start()
    cfg = make_config(short_socket_dir, node, dev_root, node_name=NODE, kubeconfig=api.kubeconfig(short_socket_dir),
                      report_debounce=0.05, report_min_interval=0.05, sysfs_root=sysfs,
                      node_condition=True)
    app = App(cfg)
    app.start()

    def ours() -> dict[str, str]:  # read inside wait_for, under the server's lock: never api.annotations() there
        return dict(api.nodes[NODE]["metadata"].get("annotations") or {})

    try:
        assert api.wait_for(lambda: ours().get(f"{P}/state") == "Healthy")
        assert f"{P}/node" not in api.annotations(NODE)
        # A ninth GPU on the bus that never initialised: NVML lists 8.
        function(sysfs, "0000:98:00.0", 0x10DE, 0x030200)
        assert api.wait_for(lambda: f"{P}/node" in ours()), api.requests[-3:]
        ann = api.annotations(NODE)
        assert ann[f"{P}/state"] == "Unhealthy"
        assert json.loads(ann[f"{P}/node"])["reasons"][0]["message"] == \
            "1 GPU on the PCI bus not seen by NVML: 0000:98:00.0"
        assert kubelet.capacity() == (8, 8)  # the kubelet's 8 are all fine

        def events(reason: str) -> list[dict[str, object]]:
            return [e for e in list(api.events.values()) if e.get("reason") == reason]  # no lock taken

        assert api.wait_for(lambda: len(events("GPUMissing")) == 1)
        [ev] = events("GPUMissing")
        assert ev["type"] == "Warning" and "0000:98:00.0" in str(ev["message"])
        cond = [c for c in api.nodes[NODE]["status"].get("conditions", []) if c["type"] == "GPUHealthy"]
        assert cond and cond[0]["status"] == "False" and cond[0]["message"].startswith("gpu-missing")
        # It goes from the bus (pulled for repair): the key goes, the state is Healthy, the Event says so.
        for f in (sysfs / "bus" / "pci" / "devices" / "0000:98:00.0").iterdir():
            f.unlink()
        (sysfs / "bus" / "pci" / "devices" / "0000:98:00.0").rmdir()
        assert api.wait_for(lambda: f"{P}/node" not in ours())
        assert api.annotations(NODE)[f"{P}/state"] == "Healthy"
        assert api.wait_for(lambda: len(events("GPUMissingResolved")) == 1)
        assert len(events("GPUMissing")) == 1
    finally:
        app.stop.set()
        app.shutdown()
        kubelet.stop()


def test_the_nodes_gpu_count_label_is_the_expected_count(short_socket_dir: Path, dev_root: Path,
                                                         api: FakeApiServer) -> None:
    """GPU Feature Discovery's nvidia.com/gpu.count says 9; NVML (the simulated node) lists 8."""
    with api.lock:
        api.nodes[NODE]["metadata"]["labels"] = {"nvidia.com/gpu.count": "9", "nvidia.com/gpu.present": "true"}
    node = NodeFile(short_socket_dir / "node.json")
    kubelet = KubeletStandin(short_socket_dir / "dp")
    kubelet.start()
    cfg = make_config(short_socket_dir, node, dev_root, node_name=NODE, kubeconfig=api.kubeconfig(short_socket_dir),
                      report_debounce=0.05, report_min_interval=0.05)
    app = App(cfg)
    app.start()

    def ours() -> dict[str, str]:
        return dict(api.nodes[NODE]["metadata"].get("annotations") or {})

    try:
        assert api.wait_for(lambda: f"{P}/node" in ours()), api.requests[-3:]
        assert json.loads(ours()[f"{P}/node"])["reasons"][0]["message"] == "NVML sees 8 of the 9 GPUs expected"
        assert app.monitor.expected_gpus == 9
    finally:
        app.stop.set()
        app.shutdown()
        kubelet.stop()


IDLE_S = 60.0  # the "a minute of an unchanged node"


@pytest.mark.slow
def test_an_idle_node_with_the_kernel_log_and_the_bus_watched_writes_and_logs_nothing(
        short_socket_dir: Path, dev_root: Path, api: FakeApiServer, caplog: pytest.LogCaptureFixture) -> None:
    """All three on: a kernel log whose writer is there and silent, every GPU on the bus and in NVML with the expected
    count met, and the busy-with-no-pod watch asking a PodResources server (a pod's process on GPU 3, held; a leaked
    one on GPU 5, busy-unallocated since start-up). For a full minute of wall time after start, polls every tenth of a
    second write nothing to the API server, the state dir or the log; and each watch shows it was at work."""
    import logging
    import os
    import time

    from plugin.health.reasons import State
    from tests.fakes.podresources import PodResourcesServer
    from tests.unit.test_gpu_missing import bus

    caplog.set_level(logging.DEBUG, "plugin")
    sysfs = short_socket_dir / "sys"
    bus(sysfs, 8)
    kmsg = short_socket_dir / "kmsg"
    os.mkfifo(kmsg)
    node = NodeFile(short_socket_dir / "node.json")
    node.set(3, compute_processes=[{"pid": 5151, "used_mib": 1000, "name": "python3"}])  # the pod's own work
    node.set(5, compute_processes=[{"pid": 4242, "used_mib": 30000, "name": "python3"}])  # leaked: no pod holds it
    pods = PodResourcesServer(short_socket_dir / "pr.sock")
    pods.assign("ml", "train-0", "main", "nvidia.com/gpu", node.uuids[3])
    pods.start()
    kubelet = KubeletStandin(short_socket_dir / "dp")
    kubelet.start()
    cfg = make_config(short_socket_dir, node, dev_root, node_name=NODE, kubeconfig=api.kubeconfig(short_socket_dir),
                      report_debounce=0.05, report_min_interval=0.05, sysfs_root=sysfs, expected_gpus=8,
                      kernel_log=kmsg, node_condition=True, pod_resources_socket=pods.socket_path, busy_grace=0.5)
    app = App(cfg)
    app.start()
    writer = os.open(kmsg, os.O_WRONLY)  # waits for the plugin's reader to open it
    try:
        os.write(writer, b"6,0,1000,-;Linux version 6.8.0\n")
        assert app.kernel_log is not None and app.kernel_log.wait_read(0)
        assert api.wait_for(lambda: _device(api, 5).get("state") == "Degraded")
        assert api.wait_for(lambda: any(c["type"] == "GPUHealthy" for c in api.nodes[NODE]["status"]["conditions"]))
        snap = app.state.snapshot()
        assert [r.code for r in snap.get(node.uuids[5]).reasons] == ["busy-unallocated"]  # type: ignore[union-attr]
        assert {d.id for d in snap.devices if d.state != State.HEALTHY} == {node.uuids[5]}
        assert snap.node_reasons == ()

        def writes() -> int:  # called under the server's lock (inside wait_for) too: never takes it
            return sum(1 for r in list(api.requests) if r.method != "GET")

        def quiet_for_a_second() -> bool:
            before = writes()
            return not api.wait_for(lambda: writes() > before, timeout=1.0)

        # Start-up is over once its writes have landed: a second with no new one. From here on nothing may move.
        while not quiet_for_a_second():
            pass
        seen, requests, logged = writes(), len(api.requests), len(caplog.records)
        version = app.state.snapshot().version
        polls, asked, pod_calls = app.monitor.polls, app.monitor.busy_watch.asked, pods.calls  # type: ignore[union-attr]
        bus_reads = [0]
        read_bus = app.monitor.inventory
        assert read_bus is not None

        def counted() -> object:  # the monitor's own bus read, counted: it reads sysfs at every poll
            bus_reads[0] += 1
            return read_bus()

        app.monitor.inventory = counted  # type: ignore[assignment]

        def files() -> dict[str, tuple[int, int]]:
            return {str(p.relative_to(cfg.state_dir)): (p.stat().st_mtime_ns, p.stat().st_size)
                    for p in sorted(cfg.state_dir.rglob("*")) if p.is_file()}

        state_files = files()
        assert state_files  # the saved state and the kernel log's cursor are there to be left alone

        began = time.monotonic()
        while (left := began + IDLE_S - time.monotonic()) > 0:
            # Waits on the fake server's request events: returns early (and fails) at the first write.
            assert not api.wait_for(lambda: writes() > seen, timeout=min(1.0, left)), api.requests[requests:]
            assert [r.getMessage() for r in caplog.records[logged:]] == []
            assert app.state.snapshot().version == version
            assert files() == state_files
        idle = time.monotonic() - began
        assert idle >= IDLE_S
        # Each watch was at work all along: polling and reading the bus (a poll every 0.1 s is 600 a minute; half that
        # on a loaded two-core machine), asking who holds the busy GPUs, and a kernel log that still reads.
        assert app.monitor.polls - polls >= idle / cfg.poll_interval / 2, (app.monitor.polls - polls, idle)
        assert bus_reads[0] >= idle / cfg.poll_interval / 2
        assert app.monitor.busy_watch.asked - asked >= idle / cfg.busy_grace / 2  # type: ignore[union-attr]
        assert pods.calls - pod_calls >= idle / cfg.busy_grace / 2
        assert app.monitor.gpus_missing == 0 and app.kernel_log.stats.records == 1
        os.write(writer, b"6,1,61000000,-;hello\n")
        assert app.kernel_log.wait_read(1)
    finally:
        os.close(writer)
        app.stop.set()
        app.shutdown()
        kubelet.stop()
        pods.stop()
