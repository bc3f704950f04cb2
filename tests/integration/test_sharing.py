"""Several resources over real unix sockets against the kubelet stand-in: a mixed-MIG node with time-slicing,
health reaching every derived device, Allocate and GetPreferredAllocation per resource, and a kubelet restart that
re-registers every resource together."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.deviceplugin.v1beta1 import api_pb2
from plugin.app import App
from plugin.devtools.standin import KubeletStandin
from plugin.sharing.config import parse_sharing
from tests.conftest import NodeFile
from tests.integration.conftest import Env, make_config
from tests.unit.test_resources import mig_node

SHARED = "nvidia.com/gpu.shared"
SMALL = "nvidia.com/mig-1g.10gb"
BIG = "nvidia.com/mig-3g.40gb"
ALL = ("nvidia.com/gpu", SHARED, SMALL, BIG)


def start(root: Path, dev_root: Path, kubelet: KubeletStandin, **extra: Any) -> Env:
    node = NodeFile(root / "node.json", mig_node())
    sharing = parse_sharing({"timeSlicing": {"resources": [
        {"name": "nvidia.com/gpu", "replicas": 4, "rename": SHARED, "devices": [2, 3],
         "failRequestsGreaterThanOne": True}]}})
    cfg = make_config(root, node, dev_root, mig_strategy="mixed", sharing=sharing, **extra)
    app = App(cfg)
    app.start()
    return Env(root, node, kubelet, app, cfg)


@pytest.fixture
def env(short_socket_dir: Path, dev_root: Path) -> Iterator[Env]:
    kubelet = KubeletStandin(short_socket_dir / "dp")
    kubelet.start()
    e = start(short_socket_dir, dev_root, kubelet)
    assert e.wait_kubelet(lambda: all(kubelet.capacity(r)[0] > 0 for r in ALL)), "not every resource registered"
    yield e
    e.app.stop.set()
    e.app.shutdown()
    kubelet.stop()


def test_every_resource_registered_with_its_devices(env: Env) -> None:
    k = env.kubelet
    u = env.node.uuids
    assert sorted(r for _, r, _ in k.registrations) == sorted(ALL)
    endpoints = {e for _, _, e in k.registrations}
    assert len(endpoints) == 4  # one server and socket per resource
    assert {r: k.capacity(r) for r in ALL} == {"nvidia.com/gpu": (4, 4), SHARED: (8, 8), SMALL: (4, 4), BIG: (2, 2)}
    assert set(k.view("nvidia.com/gpu").devices) == set(u[4:])  # type: ignore[union-attr]
    assert set(k.view(SHARED).devices) == {f"{g}::{n}" for g in u[2:4] for n in range(4)}  # type: ignore
    assert k.view(BIG).devices == {"MIG-0c": ("Healthy", (0,)), "MIG-1c": ("Healthy", (0,))}  # type: ignore


def test_health_reaches_replicas_and_mig_devices(env: Env) -> None:
    k = env.kubelet
    u = env.node.uuids
    env.node.set(3, nvlink_down=[0])  # a shared GPU: its four replicas, nothing else
    assert env.wait_kubelet(lambda: k.capacity(SHARED) == (8, 4))
    assert {i for i, (h, _) in k.view(SHARED).devices.items() if h != "Healthy"} == \
        {f"{u[3]}::{n}" for n in range(4)}  # type: ignore[union-attr]
    env.node.set(1, mig_events=[{"gpu_instance_id": 7, "xid": 79}])  # one GPU instance of GPU 1
    assert env.wait_kubelet(lambda: k.capacity(SMALL) == (4, 3))
    assert k.health("MIG-1a", SMALL) == "Unhealthy" and k.capacity(BIG) == (2, 2)
    assert k.capacity("nvidia.com/gpu") == (4, 4)
    env.node.set(3, nvlink_down=None)
    assert env.wait_kubelet(lambda: k.capacity(SHARED) == (8, 8))


def test_allocate_and_preferred_per_resource(env: Env) -> None:
    k = env.kubelet
    u = env.node.uuids
    resp = k.allocate([f"{u[2]}::1"], SHARED)
    assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == u[2]
    with pytest.raises(grpc.RpcError) as err:
        k.allocate([f"{u[2]}::1", f"{u[3]}::0"], SHARED)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "failRequestsGreaterThanOne" in (err.value.details() or "")
    resp = k.allocate(["MIG-0c"], BIG)
    assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == "MIG-0c"
    with pytest.raises(grpc.RpcError) as err:
        k.allocate([u[5]], SMALL)  # a whole GPU is not a device of a MIG resource
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and u[5] in (err.value.details() or "")
    got = k.preferred(list(k.view(SHARED).devices), [], 2, SHARED)  # type: ignore[union-attr]
    assert {i.split("::")[0] for i in got} == {u[2], u[3]}  # distributed (the default)
    assert set(k.preferred(u[4:], [u[6]], 2)) == {u[6], u[7]}


def test_kubelet_restart_re_registers_every_resource_and_keeps_health(env: Env) -> None:
    k = env.kubelet
    env.node.set(2, xid_events=[79])  # latched: must survive the restart
    assert env.wait_kubelet(lambda: k.capacity(SHARED) == (8, 4))
    before = {e for _, _, e in k.registrations}
    k.restart()
    assert env.wait_kubelet(lambda: len(k.registrations) >= 8 and all(
        (v := k.view(r)) is not None and v.connected and v.endpoint not in before for r in ALL))
    assert k.capacity(SHARED) == (8, 4) and k.capacity(SMALL) == (4, 4)
    # Every resource registered again, each exactly once: our sockets deleted and kubelet.sock created are two
    # signals of one kubelet instance, judged together by the supervisor.
    assert env.app.supervisor.wait_settled(10)
    assert sorted(r for _, r, _ in k.registrations[4:]) == sorted(ALL)
    assert not any((env.cfg.device_plugin_dir / e).exists() for e in before)


class FlakyKubelet(KubeletStandin):
    """Refuses one resource's first registration, as a kubelet that is still starting might."""

    def __init__(self, plugin_dir: Path, refuse: str) -> None:
        super().__init__(plugin_dir)
        self.refuse = refuse
        self.refused = 0

    def Register(self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext) -> api_pb2.Empty:
        if request.resource_name == self.refuse and self.refused == 0:
            self.refused += 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "not ready yet")
        return super().Register(request, context)


def test_a_failed_registration_retries_only_what_is_missing(short_socket_dir: Path, dev_root: Path) -> None:
    kubelet = FlakyKubelet(short_socket_dir / "dp", refuse=SMALL)
    kubelet.start()
    e = start(short_socket_dir, dev_root, kubelet)
    try:
        assert e.wait_kubelet(lambda: all(kubelet.capacity(r)[0] > 0 for r in ALL))
        assert kubelet.refused == 1
        # Registering the others again would give the kubelet a second plugin on the same socket.
        assert sorted(r for _, r, _ in kubelet.registrations) == sorted(ALL)
        # The kubelet connects to a plugin inside its Register call, so it may see every device before our loop has
        # recorded the round as done.
        assert e.app.supervisor.wait_settled(10)
        assert e.app.supervisor.record.failures == 1 and e.app.supervisor.record.registered
    finally:
        e.app.stop.set()
        e.app.shutdown()
        kubelet.stop()
