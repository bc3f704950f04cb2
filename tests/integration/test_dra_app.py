"""The App in DRA mode, wired as ``run`` wires it: the DRA driver instead of the device-plugin supervisor, /readyz
true only once the kubelet took the registration, the health stream fed by the real monitor, and an API server that
cannot be reached costing a per-claim error, never the process, and all of it on /metrics. The kubelet is played by
grpc clients."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.dra.v1 import api_pb2 as dra_pb2
from api.dra.v1 import api_pb2_grpc as dra_grpc
from api.drahealth.v1 import api_pb2 as h_pb2
from api.drahealth.v1 import api_pb2_grpc as h_grpc
from api.gpuhealth.v1alpha1 import health_pb2
from api.gpuhealth.v1alpha1 import health_pb2_grpc as health_grpc
from api.pluginregistration.v1 import api_pb2 as reg_pb2
from api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from plugin.app import App
from plugin.config import load
from tests.conftest import NodeFile, write_kubeconfig
from tests.integration.test_dra_server import poll

DRIVER = "gpu.gpu-health.io"
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, body = _probe(port, "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def _probe(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _kubelet(a: App) -> health_pb2.KubeletRegistration:
    with grpc.insecure_channel(f"unix://{a.cfg.health_socket_path}") as ch:
        return health_grpc.DeviceHealthStub(ch).List(health_pb2.ListRequest(), timeout=10).kubelet


@pytest.fixture
def app(short_socket_dir: Path, dev_root: Path) -> Iterator[tuple[App, int, NodeFile]]:
    root = short_socket_dir
    node = NodeFile(root / "node.json")
    # An API server nobody listens on: the slice writer and the claim reads fail and back off.
    kubeconfig = write_kubeconfig(root / "kubeconfig", f"http://127.0.0.1:{_free_port()}")
    port = _free_port()
    flags = {"mode": "dra", "backend": "simulated", "simulated_node": str(node.path), "node_name": "gpu-node-1",
             "kubeconfig": str(kubeconfig), "state_dir": str(root / "state"), "dev_root": str(dev_root),
             "device_plugin_dir": str(root / "dp"), "dra_plugin_dir": str(root / "plugins" / DRIVER),
             "dra_registry_dir": str(root / "registry"), "cdi_spec_dir": str(root / "cdi"),
             "poll_interval": "0.1", "metrics_address": f"127.0.0.1:{port}", "annotations": "false",
             "events": "false"}
    a = App(load(flags, {}, None))
    a.start()
    yield a, port, node
    a.stop.set()
    a.shutdown()


def test_dra_mode_serves_the_kubelet_through_dra_only_and_is_ready_once_registered(
        app: tuple[App, int, NodeFile], short_socket_dir: Path) -> None:
    a, port, node = app
    assert a.supervisor is None and a.dra is not None and a.correlator is None
    # No device-plugin socket: a GPU is never offered both ways.
    assert not (short_socket_dir / "dp").exists() or not any((short_socket_dir / "dp").iterdir())
    reg_path = short_socket_dir / "registry" / f"{DRIVER}-reg.sock"
    assert reg_path.is_socket()
    assert _probe(port, "/readyz")[0] == 503
    assert not _kubelet(a).registered
    with grpc.insecure_channel(f"unix://{reg_path}") as ch:
        stub = reg_grpc.RegistrationStub(ch)
        info = stub.GetInfo(reg_pb2.InfoRequest(), timeout=5)
        assert (info.type, info.name) == ("DRAPlugin", DRIVER)
        assert info.endpoint == str(short_socket_dir / "plugins" / DRIVER / "dra.sock")
        stub.NotifyRegistrationStatus(reg_pb2.RegistrationStatus(plugin_registered=True), timeout=5)
    status, body = _probe(port, "/readyz")
    assert status == 200 and "registered with the kubelet" in body, body
    # `status` reads the same record through the health API, with the mode it was made in.
    kubelet = _kubelet(a)
    assert (kubelet.mode, kubelet.registered, kubelet.registrations) == ("dra", True, 1)
    with grpc.insecure_channel(f"unix://{info.endpoint}") as ch:
        # The health stream comes from the monitor: a fault on the node file arrives with its reason.
        stream = h_grpc.DRAResourceHealthStub(ch).NodeWatchResources(h_pb2.NodeWatchResourcesRequest(), timeout=20)
        first = next(stream)
        assert sorted(d.device.device_name for d in first.devices) == [f"gpu-{i}" for i in range(8)]
        assert {d.device.pool_name for d in first.devices} == {"gpu-node-1"}
        node.set(3, xid_events=[79])
        for report in stream:
            got = {d.device.device_name: d for d in report.devices}
            if got["gpu-3"].health == h_pb2.UNHEALTHY:
                assert got["gpu-3"].message.startswith("xid-79"), got["gpu-3"].message
                assert got["gpu-2"].health == h_pb2.HEALTHY
                break
        assert _metrics(port)[("gpu_health_dra_health_streams", ())] == 1
        stream.cancel()
        # The API server is unreachable: the claim gets an error of its own naming it; the process serves on.
        uid = "3c9e7f1a-2b4d-4e6f-8a1c-0d2e4f6a8b0c"
        resp = dra_grpc.DRAPluginStub(ch).NodePrepareResources(dra_pb2.NodePrepareResourcesRequest(
            claims=[dra_pb2.Claim(namespace="ns", uid=uid, name="c")]), timeout=10)
        assert resp.claims[uid].error and "c" in resp.claims[uid].error
    assert _probe(port, "/healthz")[0] == 200

    # /metrics has DRA mode's series next to the node state's, in the format Prometheus parses.
    def slice_read_failed() -> bool:
        return _metrics(port)[("gpu_health_dra_slice_failures_total", (("kind", "read"),))] >= 1

    assert poll(slice_read_failed)
    m = _metrics(port)
    assert m[("gpu_health_registered", ())] == 1 and m[("gpu_health_registrations_total", ())] == 1
    assert m[("gpu_health_dra_slice_ok", ())] == 0 and m[("gpu_health_dra_slice_writes_total", ())] == 0
    assert m[("gpu_health_dra_slice_last_error_timestamp_seconds", ())] > 0
    assert m[("gpu_health_dra_claim_results_total", (("operation", "prepare"), ("result", "api-error")))] == 1
    assert m[("gpu_health_dra_claim_results_total", (("operation", "prepare"), ("result", "ok")))] == 0
    assert m[("gpu_health_dra_prepared_claims", ())] == 0
    assert m[("gpu_health_dra_health_streams", ())] == 0 and m[("gpu_health_devices", ())] == 8
    assert not any(name.startswith("gpu_health_listandwatch") for name, _ in m)  # no device-plugin servers here


def test_mig_strategy_mixed_reaches_the_slice_prepare_and_the_health_stream(short_socket_dir: Path,
                                                                           dev_root: Path) -> None:
    """--mig-strategy mixed as ``run`` wires it: GPU 1's seven instances are the devices of the health stream (from
    the real monitor, its fault theirs), the slice writer and Prepare judge under the same strategy."""
    root = short_socket_dir
    node = NodeFile(root / "node.json")
    parent = node.doc["gpus"][1]["uuid"]
    node.doc["gpus"][1]["mig_devices"] = [
        {"uuid": f"MIG-{gi:08d}-1111-4000-8000-000000000001", "gpu_instance_id": gi, "profile": "1g.10gb",
         "memory_mib": 9856} for gi in range(7, 14)]
    node.write()
    kubeconfig = write_kubeconfig(root / "kubeconfig", f"http://127.0.0.1:{_free_port()}")
    flags = {"mode": "dra", "backend": "simulated", "simulated_node": str(node.path), "node_name": "gpu-node-1",
             "kubeconfig": str(kubeconfig), "state_dir": str(root / "state"), "dev_root": str(dev_root),
             "dra_plugin_dir": str(root / "plugins" / DRIVER), "dra_registry_dir": str(root / "registry"),
             "cdi_spec_dir": str(root / "cdi"), "poll_interval": "0.1", "metrics_address": "off",
             "annotations": "false", "events": "false", "mig_strategy": "mixed"}
    a = App(load(flags, {}, None))
    a.start()
    try:
        assert a.dra is not None and a.dra.slice_writer.settings.mig_strategy == "mixed"
        instances = [f"gpu-1-mig-{gi}-0" for gi in range(7, 14)]
        with grpc.insecure_channel(f"unix://{root / 'plugins' / DRIVER / 'dra.sock'}") as ch:
            stream = h_grpc.DRAResourceHealthStub(ch).NodeWatchResources(h_pb2.NodeWatchResourcesRequest(),
                                                                         timeout=20)
            first = next(stream)
            assert [d.device.device_name for d in first.devices] == ["gpu-0", *instances,
                                                                    *(f"gpu-{i}" for i in range(2, 8))]
            node.set(1, xid_events=[79])
            for report in stream:
                got = {d.device.device_name: d for d in report.devices}
                if got[instances[0]].health == h_pb2.UNHEALTHY:
                    assert all(got[n].health == h_pb2.UNHEALTHY and got[n].message.startswith("xid-79")
                               for n in instances)
                    assert got["gpu-0"].health == got["gpu-2"].health == h_pb2.HEALTHY
                    break
            stream.cancel()
        published = a.dra.driver._devices_by_name(a.dra.slice_writer.settings)
        assert sorted(published) == sorted(["gpu-0", *instances, *(f"gpu-{i}" for i in range(2, 8))])
        assert {d.gpu.uuid for n, d in published.items() if n in instances} == {parent}
    finally:
        a.stop.set()
        a.shutdown()


def test_a_checkpoint_from_a_newer_plugin_stops_the_start_with_one_line(short_socket_dir: Path,
                                                                        dev_root: Path) -> None:
    """A downgrade must not forget what a newer plugin prepared: the start is refused, exit 2, naming the file and
    its version, and the file stays as it was."""
    root = short_socket_dir
    node = NodeFile(root / "node.json")
    kubeconfig = write_kubeconfig(root / "kubeconfig", "http://127.0.0.1:9")
    checkpoint = root / "state" / "dra-checkpoint.json"
    checkpoint.parent.mkdir()
    text = '{"version": 7, "claims": {}}'
    checkpoint.write_text(text)
    args = ["--mode", "dra", "--backend", "simulated", "--simulated-node", str(node.path), "--node-name", "n1",
            "--kubeconfig", str(kubeconfig), "--state-dir", str(root / "state"), "--dev-root", str(dev_root),
            "--dra-plugin-dir", str(root / "pl"), "--dra-registry-dir", str(root / "reg"),
            "--cdi-spec-dir", str(root / "cdi"), "--metrics-address", "off"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_HEALTH_")}
    r = subprocess.run([sys.executable, "-m", "plugin", "run", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=30)
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("gpu-health-plugin:")]
    assert len(errors) == 1, r.stderr
    assert str(checkpoint) in errors[0] and "is version 7" in errors[0] and "reads version 1" in errors[0]
    assert r.returncode == 2, r.stderr
    assert checkpoint.read_text() == text and sorted(p.name for p in checkpoint.parent.iterdir()) == [
        "dra-checkpoint.json", "plugin.lock"]
    assert not (root / "reg" / f"{DRIVER}-reg.sock").exists()


def test_the_sharing_section_reaches_the_slice_as_run_wires_it(short_socket_dir: Path, dev_root: Path) -> None:
    """The config file's sharing section, loaded as ``run`` loads it, gives the slice writer's GPU 3 three claims."""
    from plugin.dra.slices import published_devices, resource_slice
    root = short_socket_dir
    node = NodeFile(root / "node.json")
    cfg_file = root / "config.yaml"
    cfg_file.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                        "      - name: nvidia.com/gpu\n        replicas: 3\n        devices: [3]\n")
    kubeconfig = write_kubeconfig(root / "kubeconfig", f"http://127.0.0.1:{_free_port()}")
    flags = {"mode": "dra", "backend": "simulated", "simulated_node": str(node.path), "node_name": "gpu-node-1",
             "kubeconfig": str(kubeconfig), "state_dir": str(root / "state"), "dev_root": str(dev_root),
             "dra_plugin_dir": str(root / "plugins" / DRIVER), "dra_registry_dir": str(root / "registry"),
             "cdi_spec_dir": str(root / "cdi"), "poll_interval": "0.1", "metrics_address": "off",
             "annotations": "false", "events": "false"}
    a = App(load(flags, {}, cfg_file))
    a.start()
    try:
        assert a.dra is not None
        settings = a.dra.slice_writer.settings
        devices = resource_slice(published_devices(a.state.snapshot().devices), settings)["spec"]["devices"]
        assert {d["name"]: d["capacity"][f"{DRIVER}/shares"]["value"]
                for d in devices if d.get("allowMultipleAllocations")} == {"gpu-3": "3"}
    finally:
        a.stop.set()
        a.shutdown()
