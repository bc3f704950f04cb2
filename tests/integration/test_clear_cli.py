"""``gpu-health-plugin clear`` and the Clear RPC at their edges (issue 34): the real health server on a unix socket over
a NodeState the test drives, with a stand-in for the monitor's ``clear`` that records what it is asked and refuses as
told; the CLI runs as a real process where its exit code and its streams are what is tested. What the monitor decides
is tested with the real plugin in test_clear_app.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import pytest

from api.gpuhealth.v1alpha1 import health_pb2, health_pb2_grpc
from plugin.health.node_state import Clearance, NodeState
from plugin.health.reasons import State
from plugin.health.tracker import ClearRefused
from plugin.outlets.health_api import HealthServer
from tests.fakes.node_devices import Node, status

T0 = 1_767_225_600.0
CLI = [sys.executable, "-m", "plugin"]


@dataclass
class FakeMonitor:
    """The monitor's clear: answers ``result`` or raises ``refuse``, and keeps the calls it got."""

    result: list[tuple[str, str]] = field(default_factory=list)
    refuse: str = ""
    calls: list[tuple[str | None, str | None, str]] = field(default_factory=list)

    def clear(self, device_id: str | None, code: str | None, note: str,
              now: float | None = None) -> list[tuple[str, str]]:
        self.calls.append((device_id, code, note))
        if self.refuse:
            raise ClearRefused(self.refuse)
        return self.result


@dataclass
class Served:
    sock: Path
    node: Node
    monitor: FakeMonitor
    server: HealthServer

    def cli(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, "clear", *argv, "--health-socket", str(self.sock)], capture_output=True,
                              text=True, timeout=60)


@pytest.fixture
def served(short_socket_dir: Path) -> Iterator[Served]:
    state = NodeState()
    node = Node(state, n=4)
    node.publish(T0)
    node.set(3, State.UNHEALTHY, "xid-79", now=T0 + 1)
    monitor = FakeMonitor()
    server = HealthServer(short_socket_dir / "health.sock", state, clearer=monitor)
    server.start()
    yield Served(short_socket_dir / "health.sock", node, monitor, server)
    server.stop()


def _one_line_no_traceback(err: str) -> str:
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err.strip()


def _rpc(sock: Path, **req: object) -> health_pb2.ClearResponse:
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        return health_pb2_grpc.DeviceHealthStub(ch).Clear(health_pb2.ClearRequest(**req), timeout=10)


def test_clear_prints_one_line_per_cleared_reason_and_passes_what_was_asked(served: Served) -> None:
    uuid = served.node.gpus[3].uuid
    served.monitor.result = [(uuid, "ecc-uncorrected"), (uuid, "xid-79")]
    r = served.cli("3", "--note", " reseated, ticket 123 ")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"cleared ecc-uncorrected on {uuid}", f"cleared xid-79 on {uuid}"]
    assert served.monitor.calls == [("3", None, "reseated, ticket 123")]
    j = served.cli("--all", "--reason", "xid-79", "--note", "fleet-wide reboot", "-o", "json")
    assert j.returncode == 0, j.stderr
    assert json.loads(j.stdout) == {"cleared": [{"id": uuid, "code": "ecc-uncorrected"},
                                                {"id": uuid, "code": "xid-79"}]}
    assert served.monitor.calls[-1] == (None, "xid-79", "fleet-wide reboot")


def test_nothing_to_clear_on_all_devices_is_said_and_is_not_an_error(served: Served) -> None:
    r = served.cli("--all", "--note", "after maintenance")
    assert r.returncode == 0 and r.stdout == ""
    assert _one_line_no_traceback(r.stderr) == "gpu-health-plugin clear: nothing to clear on any device"


def test_a_refusal_is_the_monitors_one_line_and_exit_1(served: Served) -> None:
    uuid = served.node.gpus[3].uuid
    served.monitor.refuse = f"{uuid}: gpu-lost cannot be cleared: the GPU is still lost (NVML cannot reach it)"
    r = served.cli(uuid, "--reason", "gpu-lost", "--note", "reseated")
    assert r.returncode == 1 and r.stdout == ""
    assert _one_line_no_traceback(r.stderr) == f"gpu-health-plugin clear: {served.monitor.refuse}"
    with pytest.raises(grpc.RpcError) as exc:
        _rpc(served.sock, device=uuid, note="reseated")
    assert exc.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert exc.value.details() == served.monitor.refuse


@pytest.mark.parametrize(("argv", "words"), [
    (["9"], "device '9': no such device on this node"),
    (["GPU-nope"], "device 'GPU-nope': no such device on this node"),
])
def test_what_the_node_lacks_or_a_malformed_code_is_named_and_the_monitor_is_not_asked(
        served: Served, argv: list[str], words: str) -> None:
    r = served.cli(*argv, "--note", "reseated")
    assert r.returncode == 1
    assert words in _one_line_no_traceback(r.stderr)
    assert served.monitor.calls == []


@pytest.mark.parametrize(("req", "code", "words"), [
    ({"device": "3", "note": ""}, grpc.StatusCode.INVALID_ARGUMENT, "note: required"),
    ({"device": "3", "note": "x" * 300}, grpc.StatusCode.INVALID_ARGUMENT, "note: at most 256 characters, got 300"),
    ({"device": "3", "note": "a\nb"}, grpc.StatusCode.INVALID_ARGUMENT, "note: one line of printable characters"),
    ({"note": "why"}, grpc.StatusCode.INVALID_ARGUMENT, "name one device"),
    ({"device": "3", "all": True, "note": "why"}, grpc.StatusCode.INVALID_ARGUMENT, "not both"),
    ({"device": "7", "note": "why"}, grpc.StatusCode.NOT_FOUND, "device '7'"),
    ({"device": "3", "reason": "XID79", "note": "why"}, grpc.StatusCode.INVALID_ARGUMENT,
     "reason: expected a reason code such as xid-79 (lower-case, hyphenated), got 'XID79'"),
])
def test_the_server_checks_any_clients_request(served: Served, req: dict[str, object], code: grpc.StatusCode,
                                                 words: str) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        _rpc(served.sock, **req)
    assert exc.value.code() is code and words in (exc.value.details() or "")
    assert served.monitor.calls == []


def test_a_server_without_a_monitor_clears_nothing(short_socket_dir: Path) -> None:
    state = NodeState()
    Node(state, n=1).publish(T0)
    server = HealthServer(short_socket_dir / "h.sock", state)
    server.start()
    try:
        with pytest.raises(grpc.RpcError) as exc:
            _rpc(short_socket_dir / "h.sock", device="0", note="why")
        assert exc.value.code() is grpc.StatusCode.UNIMPLEMENTED
        r = subprocess.run([*CLI, "clear", "0", "--note", "why", "--health-socket", str(short_socket_dir / "h.sock")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1
        assert f"the plugin at {short_socket_dir / 'h.sock'} does not serve clear" in _one_line_no_traceback(r.stderr)
    finally:
        server.stop()


@pytest.mark.parametrize(("argv", "words"), [
    (["3"], "the following arguments are required: --note"),
    (["3", "--note", ""], "argument --note: required: say why"),
    (["3", "--note", "x" * 257], "argument --note: at most 256 characters, got 257"),
    (["3", "--note", "a\tb"], "argument --note: one line of printable characters"),
    (["--note", "why"], "name one DEVICE or --all"),
    (["", "--note", "why"], "name one DEVICE or --all"),
    (["3", "--reason", "XID 79", "--note", "why"], "argument --reason: expected a reason code such as xid-79"),
    (["3", "--all", "--note", "why"], "DEVICE and --all: name one, not both"),
])
def test_bad_flags_are_exit_2_with_one_line_naming_them_before_anything_is_dialled(
        served: Served, argv: list[str], words: str) -> None:
    r = served.cli(*argv)
    assert r.returncode == 2 and r.stdout == ""
    assert "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1].startswith("gpu-health-plugin clear: error: ")
    assert words in r.stderr.splitlines()[-1]
    assert served.monitor.calls == []


def test_no_socket_or_a_dead_one_is_one_line_and_exit_1(short_socket_dir: Path) -> None:
    missing = short_socket_dir / "none.sock"
    r = subprocess.run([*CLI, "clear", "3", "--note", "why", "--health-socket", str(missing)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert f"no health socket at {missing}" in _one_line_no_traceback(r.stderr)
    dead = short_socket_dir / "dead.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(dead))
    s.close()
    r = subprocess.run([*CLI, "clear", "3", "--note", "why", "--health-socket", str(dead)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    line = _one_line_no_traceback(r.stderr)
    assert f"cannot reach the plugin at {dead}" in line and "UNAVAILABLE" in line


def test_status_and_watch_show_the_clearance_and_the_note(served: Served) -> None:
    g = served.node.gpus[3]
    seq = served.node.state.snapshot().seq
    cleared = Clearance(("xid-79",), "by the operator: reseated", T0 + 2)
    served.node.current[g.uuid] = replace(status(g, State.HEALTHY, since=T0 + 2), cleared=cleared)
    served.node.publish(T0 + 2)
    sock = str(served.sock)
    w = subprocess.run([*CLI, "watch", "--health-socket", sock, "-o", "json", "--since", str(seq), "--count", "1"],
                       capture_output=True, text=True, timeout=60)
    assert w.returncode == 0, w.stderr
    line = json.loads(w.stdout)
    assert (line["from"], line["to"], line["note"]) == ("Unhealthy", "Healthy", "cleared xid-79: by the operator: "
                                                                                "reseated")
    t = subprocess.run([*CLI, "watch", "--health-socket", sock, "--since", str(seq), "--count", "1"],
                       capture_output=True, text=True, timeout=60)
    assert t.stdout.rstrip().endswith("Unhealthy -> Healthy  -  [cleared xid-79: by the operator: reseated]")
    s = subprocess.run([*CLI, "status", "--health-socket", sock, "-o", "json"], capture_output=True, text=True,
                       timeout=60)
    devices = {d["id"]: d for d in json.loads(s.stdout)["devices"]}
    assert devices[g.uuid]["cleared"] == {"text": "cleared xid-79: by the operator: reseated",
                                          "at": "2026-01-01T00:00:02Z"}
    assert "cleared" not in devices[served.node.gpus[0].uuid]
    table = subprocess.run([*CLI, "status", "--health-socket", sock], capture_output=True, text=True,
                           timeout=60).stdout.splitlines()
    row = next(i for i, r in enumerate(table) if r.startswith(g.uuid))
    assert table[row + 1] == "    cleared xid-79: by the operator: reseated at 2026-01-01T00:00:02Z"
    assert len(table) == 1 + 4 + 1  # the header, a row per device, one clearance line
