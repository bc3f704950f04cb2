"""``gpu-health-plugin clear`` against the whole plugin on the simulated node (issue 34): refused with one line while
the condition is still present (a lost GPU still lost, a polled fault still seen), accepted once only a latch is
left, and the clearance then in the history, the health stream (List and Watch) and the kubelet's view."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc

from api.gpuhealth.v1alpha1 import health_pb2, health_pb2_grpc
from tests.integration.conftest import Env

CLI = [sys.executable, "-m", "plugin"]


def _clear(env: Env, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "clear", *argv, "--health-socket", str(env.cfg.health_socket_path)],
                          capture_output=True, text=True, timeout=60)


def _state(env: Env, index: int) -> str:
    d = env.app.state.snapshot().get(env.node.uuids[index])
    return d.state.value if d is not None else ""


def test_clear_is_refused_while_the_fault_is_present_and_accepted_once_only_the_latch_is_left(env: Env) -> None:
    uuids = env.node.uuids
    env.node.set(2, lost=True)
    env.node.set(3, xid_events=[79])
    env.node.set(4, nvlink_down=[0])
    assert env.wait_state(lambda: _state(env, 2) == _state(env, 3) == _state(env, 4) == "Unhealthy")
    before = env.app.state.snapshot().seq

    lost = _clear(env, "2", "--note", "reseated")
    assert lost.returncode == 1 and lost.stdout == "" and "Traceback" not in lost.stderr
    assert lost.stderr.strip() == f"gpu-health-plugin clear: {uuids[2]}: the GPU is still lost (NVML cannot reach it)"
    seen = _clear(env, uuids[4], "--reason", "nvlink-down", "--note", "reseated the bridge")
    assert seen.returncode == 1 and len(seen.stderr.splitlines()) == 1
    assert f"{uuids[4]}: nvlink-down is still present" in seen.stderr
    assert env.app.state.snapshot().seq == before  # a refusal changes nothing

    with grpc.insecure_channel(f"unix://{env.cfg.health_socket_path}") as ch:
        stub = health_pb2_grpc.DeviceHealthStub(ch)
        stream = stub.Watch(health_pb2.WatchRequest(since_seq=before))
        ok = _clear(env, "3", "--reason", "xid-79", "--note", "reseated, ticket 123")
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.splitlines() == [f"cleared xid-79 on {uuids[3]}"]
        t = next(stream).transition
        stream.cancel()
        assert (t.id, t.from_state, t.to_state) == (uuids[3], "Unhealthy", "Healthy")
        assert t.note == "cleared xid-79: by the operator: reseated, ticket 123"
        listed = {d.id: d for d in stub.List(health_pb2.ListRequest(), timeout=10).devices}
    assert listed[uuids[3]].state == "Healthy" and listed[uuids[3]].cleared == t.note
    assert listed[uuids[3]].cleared_at == t.time
    assert listed[uuids[2]].state == listed[uuids[4]].state == "Unhealthy"
    noted = [h for h in env.app.state.history() if h.note]
    assert [(h.id, h.note) for h in noted] == [(uuids[3], t.note)]
    # The kubelet gets the GPU back: 5 of 8 healthy while GPUs 2, 3 and 4 were out, 6 now.
    assert env.wait_kubelet(lambda: env.kubelet.capacity() == (8, 6))

    status = subprocess.run([*CLI, "status", "--health-socket", str(env.cfg.health_socket_path), "-o", "json"],
                            capture_output=True, text=True, timeout=60)
    dev = {d["id"]: d for d in json.loads(status.stdout)["devices"]}[uuids[3]]
    assert dev["state"] == "Healthy" and dev["cleared"]["text"] == t.note
