"""The plugin over real unix sockets against the kubelet stand-in: registration, streams, restarts, bad input."""

from __future__ import annotations

import stat
import threading
import time
from pathlib import Path

import grpc
import pytest

from api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugin.app import App
from plugin.devtools.standin import KubeletStandin
from tests.conftest import NodeFile, wait_until
from tests.integration.conftest import Env, make_config


def test_registration_as_the_kubelet_checks_it(env: Env) -> None:
    (_when, resource, endpoint) = env.kubelet.registrations[0]
    assert resource == "nvidia.com/gpu" and "/" not in endpoint and endpoint.endswith(".sock")
    sock = env.cfg.device_plugin_dir / endpoint
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    view = env.kubelet.view()
    assert view is not None and view.options.get_preferred_allocation_available
    assert set(view.devices) == set(env.node.uuids)
    assert [view.devices[u][1] for u in env.node.uuids] == [(0,), (0,), (0,), (0,), (1,), (1,), (1,), (1,)]


def test_fault_and_recovery_reach_the_kubelet(env: Env) -> None:
    env.node.set(2, nvlink_down=[0])
    assert env.wait_kubelet(lambda: env.kubelet.capacity() == (8, 7))
    assert env.kubelet.health(env.node.uuids[2]) == "Unhealthy"
    env.node.clear(2)
    assert env.wait_kubelet(lambda: env.kubelet.capacity() == (8, 8))


def test_degraded_is_still_allocatable(env: Env) -> None:
    env.node.set(1, row_remap_pending=True)
    assert env.wait_state(lambda: env.app.state.snapshot().get(env.node.uuids[1]).state.value == "Degraded")
    assert env.kubelet.capacity() == (8, 8)


def test_kubelet_restart_re_registers_and_keeps_health(env: Env) -> None:
    env.node.set(5, xid_events=[79])
    assert env.wait_kubelet(lambda: env.kubelet.capacity() == (8, 7))
    first_endpoint = env.kubelet.registrations[-1][2]
    env.kubelet.restart()
    assert env.wait_kubelet(lambda: len(env.kubelet.registrations) == 2 and env.kubelet.capacity() == (8, 7)
                            and env.kubelet.view() is not None and env.kubelet.view().connected)  # type: ignore
    assert env.kubelet.registrations[-1][2] != first_endpoint  # a fresh socket name per server instance
    assert env.kubelet.health(env.node.uuids[5]) == "Unhealthy"
    assert not (env.cfg.device_plugin_dir / first_endpoint).exists()
    # Both signals of the restart (our socket deleted, kubelet.sock created) are judged: one registration.
    assert env.app.supervisor.wait_settled(10)
    assert len(env.kubelet.registrations) == 2


def test_our_socket_deleted_triggers_re_registration(env: Env) -> None:
    endpoint = env.kubelet.registrations[-1][2]
    (env.cfg.device_plugin_dir / endpoint).unlink()
    assert env.wait_kubelet(lambda: len(env.kubelet.registrations) == 2)
    assert env.app.supervisor.wait_settled(10)
    assert len(env.kubelet.registrations) == 2
    assert env.kubelet.registrations[-1][2] != endpoint
    assert env.wait_kubelet(lambda: env.kubelet.capacity() == (8, 8))


def test_registration_waits_for_a_late_kubelet(short_socket_dir: Path, dev_root: Path) -> None:
    node = NodeFile(short_socket_dir / "node.json")
    app = App(make_config(short_socket_dir, node, dev_root))
    app.start()
    kubelet = KubeletStandin(short_socket_dir / "dp")
    try:
        # The kubelet is late only once the plugin already serves with nobody to register with.
        assert wait_until(lambda: any(p.name != "kubelet.sock" for p in (short_socket_dir / "dp").glob("*.sock")),
                          lambda t: time.sleep(min(t, 0.05))), "the plugin never started serving"
        kubelet.start()  # creates kubelet.sock: the plugin registers at once
        assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8), 10)
        assert app.supervisor.wait_settled(10)  # the kubelet sees our devices before Register returns to us
        assert app.supervisor.record.registered
        assert len(kubelet.registrations) == 1 and app.supervisor.record.registrations == 1
    finally:
        app.stop.set()
        app.shutdown()
        kubelet.stop()


def test_kubelet_rejection_is_retried_and_reported(short_socket_dir: Path, dev_root: Path) -> None:
    node = NodeFile(short_socket_dir / "node.json")
    kubelet = KubeletStandin(short_socket_dir / "dp")
    kubelet.start()
    app = App(make_config(short_socket_dir, node, dev_root, resource_name="nvidia.com/gpu"))
    app.supervisor.resources[0] = type(app.supervisor.resources[0])(name="kubernetes.io/gpu")  # type: ignore
    app.start()
    try:
        assert kubelet.wait_for(lambda: len(kubelet.rejections) >= 2, 10)  # retried with backoff
        assert "invalid extended resource name" in app.supervisor.record.last_error
    finally:
        app.stop.set()
        app.shutdown()
        kubelet.stop()


def _stub(env: Env) -> tuple[grpc.Channel, api_pb2_grpc.DevicePluginStub]:
    ch = grpc.insecure_channel(f"unix://{env.cfg.device_plugin_dir / env.kubelet.registrations[-1][2]}")
    return ch, api_pb2_grpc.DevicePluginStub(ch)


@pytest.mark.parametrize(("call", "needle", "code"), [
    (lambda s, u: s.Allocate(api_pb2.AllocateRequest()), "container_requests", grpc.StatusCode.INVALID_ARGUMENT),
    (lambda s, u: s.Allocate(api_pb2.AllocateRequest(container_requests=[
        api_pb2.ContainerAllocateRequest(devices_ids=["GPU-nope"])])), "GPU-nope", grpc.StatusCode.INVALID_ARGUMENT),
    (lambda s, u: s.Allocate(api_pb2.AllocateRequest(container_requests=[
        api_pb2.ContainerAllocateRequest(devices_ids=[u[0], u[0]])])), "twice", grpc.StatusCode.INVALID_ARGUMENT),
    (lambda s, u: s.Allocate(api_pb2.AllocateRequest(container_requests=[
        api_pb2.ContainerAllocateRequest(devices_ids=["x" * 5000])])), "xxxx", grpc.StatusCode.INVALID_ARGUMENT),
    (lambda s, u: s.GetPreferredAllocation(api_pb2.PreferredAllocationRequest(container_requests=[
        api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=u, allocation_size=-3)])), "-3",
     grpc.StatusCode.INVALID_ARGUMENT),
])
def test_bad_input_over_the_socket(env: Env, call: object, needle: str, code: grpc.StatusCode) -> None:
    ch, stub = _stub(env)
    with ch, pytest.raises(grpc.RpcError) as err:
        call(stub, env.node.uuids)  # type: ignore[operator]
    assert err.value.code() == code and needle in (err.value.details() or "")
    # The server is still fine afterwards.
    with _stub(env)[0] as ch2:
        api_pb2_grpc.DevicePluginStub(ch2).GetDevicePluginOptions(api_pb2.Empty(), timeout=5)


def test_many_streams_each_get_updates_and_leaving_frees_them(env: Env) -> None:
    servicer = env.app.supervisor.servers[0].servicer
    ch, stub = _stub(env)
    streams = [stub.ListAndWatch(api_pb2.Empty()) for _ in range(20)]
    firsts = [next(s) for s in streams]
    assert all(len(f.devices) == 8 for f in firsts)
    assert servicer.wait_for_streams(21, 5)  # 20 + the kubelet's own
    env.node.set(0, nvlink_down=[1])
    seconds = [next(s) for s in streams]
    assert all(sum(d.health == "Unhealthy" for d in s.devices) == 1 for s in seconds)
    for s in streams:
        s.cancel()
    ch.close()
    assert servicer.wait_for_streams(1, 5)


def test_concurrent_allocates(env: Env) -> None:
    ch, stub = _stub(env)
    errors: list[Exception] = []

    def one(i: int) -> None:
        try:
            resp = stub.Allocate(api_pb2.AllocateRequest(container_requests=[
                api_pb2.ContainerAllocateRequest(devices_ids=[env.node.uuids[i % 8]])]), timeout=10)
            assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == env.node.uuids[i % 8]
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ch.close()
    assert errors == []
