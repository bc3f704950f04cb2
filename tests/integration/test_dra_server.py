"""The DRA server as the kubelet meets it: the registration socket in plugins_registry (GetInfo, then
NotifyRegistrationStatus), the driver's endpoint with DRAPlugin and the DRAResourceHealth streams of both versions,
sockets that come back when deleted, and a stop that leaves nothing behind. The node state and the driver are
real; only the API server's ResourceClaims are faked."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest

from api.dra.v1 import api_pb2 as dra_pb2
from api.dra.v1 import api_pb2_grpc as dra_grpc
from api.drahealth.v1 import api_pb2 as h1_pb2
from api.drahealth.v1 import api_pb2_grpc as h1_grpc
from api.drahealth.v1alpha1 import api_pb2 as h1a_pb2
from api.drahealth.v1alpha1 import api_pb2_grpc as h1a_grpc
from api.pluginregistration.v1 import api_pb2 as reg_pb2
from api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from plugin.dra.driver import Driver
from plugin.dra.health import HealthSettings
from plugin.dra.server import DraServer
from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from plugin.kube.errors import ApiFailure
from plugin.outlets.metrics import Sources, build_registry
from tests.fakes.node_devices import Node
from tests.unit.test_metrics import scrape, value

NODE = "gpu-node-1"
DRIVER = "gpu.gpu-health.io"
T0 = 1_767_225_600.0

HEALTH = {"v1": (h1_pb2, h1_grpc), "v1alpha1": (h1a_pb2, h1a_grpc)}


class NoClaims:
    """The API server, which knows no ResourceClaim: enough for the driver to answer a prepare."""

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        raise ApiFailure(404, f'resourceclaims.resource.k8s.io "{name}" not found')


def poll(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Re-check a file-system fact until it holds or the deadline passes (no event to wait on from outside)."""
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            return False
        tick.wait(0.02)
    return True


class Kubelet:
    """What the kubelet does with our sockets, as gRPC clients."""

    def __init__(self, server: DraServer) -> None:
        self.server = server

    def info(self) -> reg_pb2.PluginInfo:
        with grpc.insecure_channel(f"unix://{self.server.registration_path}") as ch:
            return reg_grpc.RegistrationStub(ch).GetInfo(reg_pb2.InfoRequest(), timeout=5)

    def notify(self, registered: bool, error: str = "") -> None:
        with grpc.insecure_channel(f"unix://{self.server.registration_path}") as ch:
            reg_grpc.RegistrationStub(ch).NotifyRegistrationStatus(
                reg_pb2.RegistrationStatus(plugin_registered=registered, error=error), timeout=5)

    def watch(self, version: str, endpoint: str, timeout: float = 10.0) -> tuple[grpc.Channel, Any]:
        pb, grpc_mod = HEALTH[version]
        ch = grpc.insecure_channel(f"unix://{endpoint}")
        stream = grpc_mod.DRAResourceHealthStub(ch).NodeWatchResources(pb.NodeWatchResourcesRequest(),
                                                                       timeout=timeout)
        return ch, stream


class Env:
    def __init__(self, root: Path, tmp: Path, dev_dir: str, heartbeat_s: float = 20.0, timeout_s: int = 60,
                 degraded_as: str = "Healthy") -> None:
        self.state = NodeState()
        self.node = Node(self.state, n=4)
        self.node.publish(T0)
        self.driver = Driver(self.state, NoClaims(), NODE, tmp / "cdi", tmp / "checkpoint", dev_dir)
        self.settings = HealthSettings(pool=NODE, heartbeat_s=heartbeat_s, timeout_s=timeout_s,
                                       degraded_as=degraded_as)
        self.server = DraServer(root / "plugins" / DRIVER, root / "plugins_registry", self.state, self.driver,
                                self.settings)
        self.kubelet = Kubelet(self.server)


@pytest.fixture
def make_env(short_socket_dir: Path, tmp_path: Path, dev_root: Path) -> Iterator[Callable[..., Env]]:
    made: list[Env] = []

    def make(**kw: Any) -> Env:
        env = Env(short_socket_dir, tmp_path, str(dev_root / "dev"), **kw)
        env.server.start()
        made.append(env)
        return env

    yield make
    for env in made:
        env.server.stop()


@pytest.fixture
def env(make_env: Callable[..., Env]) -> Env:
    return make_env()


def health_of(resp: Any, pb: ModuleType) -> dict[str, tuple[str, str]]:
    return {d.device.device_name: (pb.HealthStatus.Name(d.health), d.message) for d in resp.devices}


def test_get_info_tells_the_kubelet_who_and_where(env: Env) -> None:
    info = env.kubelet.info()
    assert info.type == "DRAPlugin" and info.name == DRIVER
    assert info.endpoint == str(env.server.dra_path) and os.path.isabs(info.endpoint)
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth",
                                             "v1alpha1.DRAResourceHealth"]
    assert env.server.registration_path == env.server.registry_dir / f"{DRIVER}-reg.sock"
    # Born 0600, the kubelet (root) only.
    assert env.server.dra_path.stat().st_mode & 0o777 == 0o600
    assert env.server.registration_path.stat().st_mode & 0o777 == 0o600
    # The endpoint serves the driver: a claim the API server does not know is that claim's error.
    with grpc.insecure_channel(f"unix://{info.endpoint}") as ch:
        resp = dra_grpc.DRAPluginStub(ch).NodePrepareResources(dra_pb2.NodePrepareResourcesRequest(
            claims=[dra_pb2.Claim(namespace="ns", uid="0f6a2c1e-8d4b-4c3a-9e7f-5b1d2a3c4e5f", name="gone")]), timeout=5)
    assert "not found" in resp.claims["0f6a2c1e-8d4b-4c3a-9e7f-5b1d2a3c4e5f"].error


def test_registration_status_is_counted_and_shown(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    st = env.server.status()
    assert st.serving and not st.registered and st.registrations == 0
    env.kubelet.info()
    env.kubelet.notify(False, "version v9 not supported")
    st = env.server.status()
    assert not st.registered and st.last_error == "version v9 not supported"
    assert any("version v9 not supported" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    env.kubelet.notify(True)
    st = env.server.status()
    assert st.registered and st.registrations == 1 and st.last_error == ""
    counts = env.server.registration.counts()
    assert counts.failures == 1 and counts.info_calls == 1


@pytest.mark.parametrize("version", ["v1", "v1alpha1"])
def test_health_stream_reports_all_devices_then_every_change(env: Env, version: str) -> None:
    pb, _ = HEALTH[version]
    ch, stream = env.kubelet.watch(version, str(env.server.dra_path))
    with ch:
        first = next(stream)
        assert health_of(first, pb) == {f"gpu-{i}": ("HEALTHY", "") for i in range(4)}
        d = first.devices[0]
        assert d.device.pool_name == NODE and d.health_check_timeout_seconds == 60
        assert abs(d.last_updated_time - time.time()) < 5
        # The heartbeat is 20 s and the stream's deadline 10 s: these arrive because the state changed.
        env.node.set(2, State.UNHEALTHY, "xid-79", now=T0 + 1)
        got = health_of(next(stream), pb)
        assert got["gpu-2"] == ("UNHEALTHY", "xid-79: XID 79: GPU has fallen off the bus")
        assert got["gpu-0"] == ("HEALTHY", "") and len(got) == 4  # a full report, not just the change
        env.node.set(1, State.DEGRADED, "thermal-slowdown", now=T0 + 2)
        got = health_of(next(stream), pb)
        assert got["gpu-1"] == ("HEALTHY", "thermal-slowdown: temperature 90C at or above slowdown threshold 87C")
        assert got["gpu-2"][0] == "UNHEALTHY"
        stream.cancel()
    assert env.server.health is not None
    health = env.server.health
    assert poll(lambda: health.active_streams == 0)


def test_open_health_streams_are_a_gauge_that_follows_the_served_socket(env: Env) -> None:
    """The metric counts the streams of the socket served now: a kubelet watching with both versions is two, one
    cancelled is one, and the streams of a socket served afresh (the old one deleted) end with it."""
    registry = build_registry(Sources(env.state, health_streams=env.server), process=False)
    assert value(scrape(registry), "gpu_health_dra_health_streams") == 0
    ch1, s1 = env.kubelet.watch("v1", str(env.server.dra_path))
    ch2, s2 = env.kubelet.watch("v1alpha1", str(env.server.dra_path))
    with ch1, ch2:
        next(s1), next(s2)
        assert value(scrape(registry), "gpu_health_dra_health_streams") == 2
        s2.cancel()
        assert poll(lambda: value(scrape(registry), "gpu_health_dra_health_streams") == 1)
        env.server.dra_path.unlink()
        assert poll(lambda: env.server.dra_path.is_socket() and env.server.status().recreated == 1)
        assert poll(lambda: value(scrape(registry), "gpu_health_dra_health_streams") == 0)
        ch3, s3 = env.kubelet.watch("v1", str(env.server.dra_path))
        with ch3:
            next(s3)
            assert value(scrape(registry), "gpu_health_dra_health_streams") == 1
            s3.cancel()
        s1.cancel()


def test_degraded_as_unhealthy_reaches_the_kubelet(make_env: Callable[..., Env]) -> None:
    env = make_env(degraded_as="Unhealthy")
    ch, stream = env.kubelet.watch("v1", str(env.server.dra_path))
    with ch:
        next(stream)
        env.node.set(3, State.DEGRADED, "thermal-slowdown", now=T0 + 1)
        assert health_of(next(stream), h1_pb2)["gpu-3"][0] == "UNHEALTHY"
        stream.cancel()


def test_heartbeat_repeats_the_full_report_without_a_hot_loop(make_env: Callable[..., Env]) -> None:
    """Between changes a stream sends only heartbeats. Both checks are ones a loaded machine cannot break (load
    only slows the stream down): three heartbeats take at least two intervals, and the reports sent over the whole
    stream are no more than its lifetime holds at one per interval (plus the first and one in flight). A report per
    wake-up would be thousands."""
    env = make_env(heartbeat_s=0.2, timeout_s=1)
    ch, stream = env.kubelet.watch("v1", str(env.server.dra_path))
    opened = time.monotonic()
    with ch:
        first = health_of(next(stream), h1_pb2)
        start = time.monotonic()
        beats = [health_of(next(stream), h1_pb2) for _ in range(3)]
        elapsed = time.monotonic() - start
        stream.cancel()
    assert env.server.health is not None
    assert poll(lambda: env.server.health is not None and env.server.health.active_streams == 0)
    lifetime = time.monotonic() - opened
    assert all(b == first and len(b) == 4 for b in beats)
    assert elapsed >= 0.4  # three heartbeats 0.2 s apart: the first two intervals at least
    assert env.server.health.reports_sent <= lifetime / 0.2 + 2, (env.server.health.reports_sent, lifetime)


def test_a_deleted_registration_socket_comes_back(env: Env) -> None:
    env.kubelet.notify(True)
    path = env.server.registration_path
    path.unlink()
    # Not by inode: the new socket may well get the number the old one had.
    assert poll(lambda: path.is_socket())
    # The kubelet dropped the registration with the socket; the new one is registered when it says so.
    assert not env.server.status().registered
    assert env.kubelet.info().name == DRIVER
    env.kubelet.notify(True)
    st = env.server.status()
    assert st.serving and st.registered and st.registrations == 2 and st.recreated == 1


def test_a_deleted_dra_socket_comes_back_and_streams_again(env: Env) -> None:
    path = env.server.dra_path
    path.unlink()
    assert poll(lambda: path.is_socket())
    ch, stream = env.kubelet.watch("v1alpha1", str(path))
    with ch:
        assert len(next(stream).devices) == 4
        stream.cancel()
    st = env.server.status()
    assert st.serving and st.recreated == 1


def test_stop_ends_streams_and_removes_both_sockets(make_env: Callable[..., Env]) -> None:
    env = make_env()
    ch, stream = env.kubelet.watch("v1", str(env.server.dra_path), timeout=30)
    with ch:
        next(stream)
        start = time.monotonic()
        env.server.stop()
        # The stream ends cleanly (the kubelet reads EOF and watches again later), well before its deadline.
        assert list(stream) == []
    assert time.monotonic() - start < 5
    assert not env.server.dra_path.exists() and not env.server.registration_path.exists()
    assert not env.server.status().serving


def test_a_failed_bind_is_a_clear_error_and_leaves_nothing(short_socket_dir: Path, tmp_path: Path,
                                                            dev_root: Path) -> None:
    e = Env(short_socket_dir, tmp_path, str(dev_root / "dev"))
    e.server.registry_dir.parent.mkdir(parents=True, exist_ok=True)
    e.server.registry_dir.write_text("not a dir")
    with pytest.raises(OSError) as exc:
        e.server.start()
    assert str(e.server.registry_dir) in str(exc.value)
    assert not e.server.dra_path.exists()
