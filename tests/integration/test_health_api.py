"""The node-local health stream and its CLI: List, Watch, resume by sequence number, status/watch output."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc

from api.gpuhealth.v1alpha1 import health_pb2, health_pb2_grpc
from tests.integration.conftest import Env


def _stub(env: Env) -> tuple[grpc.Channel, health_pb2_grpc.DeviceHealthStub]:
    ch = grpc.insecure_channel(f"unix://{env.cfg.health_socket_path}")
    return ch, health_pb2_grpc.DeviceHealthStub(ch)


def test_list_has_states_and_reasons(env: Env) -> None:
    env.node.set(3, temperature_c=90)
    assert env.wait_state(lambda: env.app.state.snapshot().get(env.node.uuids[3]).state.value == "Degraded")
    ch, stub = _stub(env)
    with ch:
        resp = stub.List(health_pb2.ListRequest(), timeout=5)
    by_id = {d.id: d for d in resp.devices}
    d = by_id[env.node.uuids[3]]
    assert d.state == "Degraded" and d.kubelet_health == "Healthy"
    assert [(r.code, r.source, r.action) for r in d.reasons] == [("thermal-slowdown", "poll", "none")]
    assert "90 C" in d.reasons[0].message


def test_watch_streams_every_transition_and_resumes(env: Env) -> None:
    ch, stub = _stub(env)
    with ch:
        stream = stub.Watch(health_pb2.WatchRequest())
        first = next(stream)
        assert first.WhichOneof("event") == "snapshot" and len(first.snapshot.devices) == 8
        env.node.set(6, xid_events=[48])
        t = next(stream).transition
        assert (t.id, t.from_state, t.to_state) == (env.node.uuids[6], "Healthy", "Unhealthy")
        assert t.reasons[0].code == "xid-48" and t.reasons[0].source == "event"
        env.node.set(7, temperature_c=89)
        t2 = next(stream).transition
        assert t2.seq == t.seq + 1 and t2.to_state == "Degraded"
        stream.cancel()
        # Resume after the first: only the second is replayed, no snapshot.
        resumed = stub.Watch(health_pb2.WatchRequest(since_seq=t.seq))
        again = next(resumed)
        assert again.WhichOneof("event") == "transition" and again.transition.seq == t2.seq
        resumed.cancel()
        # A resume point the server never issued (or one older than its history) gets a snapshot marked resync.
        stale = stub.Watch(health_pb2.WatchRequest(since_seq=10**9))
        ev = next(stale)
        assert ev.WhichOneof("event") == "snapshot" and ev.resync is True
        stale.cancel()


def test_status_and_watch_cli(env: Env) -> None:
    env.node.set(4, nvlink_down=[2])
    assert env.wait_kubelet(lambda: env.kubelet.capacity() == (8, 7))
    sock = str(env.cfg.health_socket_path)
    r = subprocess.run([sys.executable, "-m", "plugin", "status", "--health-socket", sock, "--output", "json"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    dev = {d["id"]: d for d in doc["devices"]}[env.node.uuids[4]]
    assert dev["state"] == "Unhealthy" and dev["since"].endswith("Z")
    assert dev["reasons"] == [{"code": "nvlink-down", "message": "NVLink down: link 2", "action": "reset-gpu",
                              "source": "poll", "severity": "Unhealthy"}]
    assert (dev["index"], dev["kubelet_health"], dev["action"]) == (4, "Unhealthy", "reset-gpu")
    table = subprocess.run([sys.executable, "-m", "plugin", "status", "--health-socket", sock],
                           capture_output=True, text=True, timeout=30)
    [row] = [line for line in table.stdout.splitlines() if line.startswith(env.node.uuids[4])]
    assert row.split()[1:4] == ["4", "Unhealthy", "Unhealthy"] and "reset-gpu" in row.split()
    assert row.endswith("nvlink-down: NVLink down: link 2") and table.stdout.startswith("ID")
    # watch replays from sequence 0 isn't possible (0 = snapshot), so resume from before the last transition.
    seq = env.app.state.snapshot().seq
    w = subprocess.run([sys.executable, "-m", "plugin", "watch", "--health-socket", sock, "--output", "json",
                        "--since", str(seq - 1), "--count", "1"], capture_output=True, text=True, timeout=30)
    assert w.returncode == 0, w.stderr
    line = json.loads(w.stdout.strip())
    assert set(line) == {"seq", "id", "from", "to", "reasons", "time"}
    assert line["seq"] == seq and line["to"] == "Unhealthy" and line["reasons"][0]["code"] == "nvlink-down"


def test_cli_without_a_plugin_says_so(tmp_path: object) -> None:
    r = subprocess.run([sys.executable, "-m", "plugin", "status", "--health-socket", "/nonexistent/h.sock"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "no health socket" in r.stderr
