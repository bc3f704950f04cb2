"""The ``status``, ``watch`` and ``demo`` commands at their edges: closed pipes, a plugin that goes away, where the
socket is, bad flag values. The health API is the real server on a unix socket over a NodeState that the test
drives; the CLI runs as a real process where its exit and its streams are what is tested."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

from plugin import cli
from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from plugin.outlets.health_api import HealthServer
from tests.fakes.node_devices import Node

T0 = 1_767_225_600.0
CLI = [sys.executable, "-m", "plugin"]


@dataclass
class Served:
    dir: Path
    sock: Path
    node: Node
    server: HealthServer
    now: float = T0

    def transition(self, index: int, state: State, *codes: str) -> None:
        self.now += 1
        self.node.set(index, state, *codes, now=self.now)


@pytest.fixture
def served(short_socket_dir: Path) -> Iterator[Served]:
    state = NodeState()
    node = Node(state, n=4)
    node.publish(T0)  # four devices appear: transitions #1..#4
    server = HealthServer(short_socket_dir / "health.sock", state)
    server.start()
    yield Served(short_socket_dir, short_socket_dir / "health.sock", node, server)
    server.stop()


class Lines:
    """Lines of a child's stream, read on a thread so that a test can wait for the next one with a deadline."""

    def __init__(self, stream: IO[str]) -> None:
        self._q: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._q.put(line)
        self._q.put(None)

    def next(self, timeout: float = 30.0) -> str | None:
        """The next line, or None at the end of the stream."""
        line = self._q.get(timeout=timeout)
        if line is not None:
            self.seen.append(line)
        return line

    def rest(self, timeout: float = 30.0) -> str:
        while self.next(timeout) is not None:
            pass
        return "".join(self.seen)


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipe" not in err, err


# Closed pipes (`status | head -1`, `watch | head -1`) ------------------------------------------------------------

def test_status_into_a_closed_pipe_exits_quietly(served: Served) -> None:
    """The reader is gone before status writes (what `status | head -1` comes to once head has its line)."""
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([*CLI, "status", "--health-socket", str(served.sock)], stdout=w,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    _no_traceback(proc.stderr)
    assert proc.returncode == 0 and proc.stderr == ""


def test_watch_into_a_pipe_closed_after_one_line_exits_quietly(served: Served) -> None:
    # Resume after #1: #2..#4 are replayed at once.
    proc = subprocess.Popen([*CLI, "watch", "--health-socket", str(served.sock), "--since", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        first = proc.stdout.readline()
        assert first.startswith("#2 ")
        proc.stdout.close()  # head -1 exits
        served.transition(2, State.UNHEALTHY, "xid-79")  # the next write meets the closed pipe
        rc = proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    _no_traceback(err)
    assert rc == 0


def test_status_piped_into_head_in_a_shell(served: Served) -> None:
    """The pipeline as a user types it, with pipefail so the CLI's own exit counts."""
    cmd = " ".join([*CLI, "status", "--health-socket", str(served.sock)]) + " | head -1"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=60)
    _no_traceback(proc.stderr)
    assert proc.returncode == 0
    assert proc.stdout.split() == ["ID", "IDX", "STATE", "KUBELET", "SINCE", "ACTION", "REASONS"]


# watch says what it is doing ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("output", ["table", "json"])
def test_watch_says_connected_and_when_the_plugin_goes_away(served: Served, output: str) -> None:
    proc = subprocess.Popen([*CLI, "watch", "--health-socket", str(served.sock), "-o", output],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    out, err = Lines(proc.stdout), Lines(proc.stderr)
    try:
        hello = err.next()
        assert hello is not None and "connected" in hello and str(served.sock) in hello and "waiting" in hello
        served.transition(1, State.UNHEALTHY, "xid-79")
        line = out.next()
        assert line is not None
        if output == "json":
            assert json.loads(line)["to"] == "Unhealthy"
        else:
            assert line.startswith("#5 ") and "Healthy -> Unhealthy" in line
            assert "xid-79: XID 79: GPU has fallen off the bus (action: reboot-node)" in line
        served.server.stop()  # the plugin goes away
        rc = proc.wait(timeout=60)
        rest_out, rest_err = out.rest(), err.rest()
    finally:
        proc.kill()
        proc.wait()
    _no_traceback(rest_err)
    assert rc != 0
    gone = rest_err.splitlines()[-1]
    assert f"the plugin at {served.sock}" in gone
    # stdout carried the transition and nothing else, in either format
    assert rest_out.splitlines() == [line.rstrip("\n")]


def test_no_socket_names_it_and_how_to_set_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["watch", "--state-dir", str(tmp_path / "nowhere")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert str(tmp_path / "nowhere" / "health.sock") in err
    assert "--health-socket" in err and "--state-dir" in err


def test_a_socket_nobody_serves_is_reported(short_socket_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plugin that died without removing its socket: an error at once, not a watch that waits forever."""
    path = short_socket_dir / "health.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    for command in ("status", "watch"):
        assert cli.main([command, "--health-socket", str(path)]) == 1
        err = capsys.readouterr().err
        assert f"cannot reach the plugin at {path}" in err and "UNAVAILABLE" in err


# Where the socket is -------------------------------------------------------------------------------------------

def _listed(capsys: pytest.CaptureFixture[str], *argv: str) -> int:
    rc = cli.main(["status", "-o", "json", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return len(json.loads(out)["devices"])


def test_state_dir_finds_the_socket_with_the_plugins_precedence(served: Served, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    for var in ("GPU_HEALTH_HEALTH_SOCKET", "GPU_HEALTH_STATE_DIR"):
        monkeypatch.delenv(var, raising=False)
    assert _listed(capsys, "--state-dir", str(served.dir)) == 4
    monkeypatch.chdir(served.dir.parent)
    assert _listed(capsys, "--state-dir", served.dir.name) == 4  # relative to the working directory
    monkeypatch.setenv("GPU_HEALTH_STATE_DIR", str(served.dir))
    assert _listed(capsys) == 4
    # As in the plugin: GPU_HEALTH_HEALTH_SOCKET beats any state dir, and --health-socket beats it.
    monkeypatch.setenv("GPU_HEALTH_HEALTH_SOCKET", str(served.dir / "other.sock"))
    assert cli.main(["status", "--state-dir", str(served.dir)]) == 1
    assert str(served.dir / "other.sock") in capsys.readouterr().err
    assert _listed(capsys, "--health-socket", str(served.sock)) == 4


def test_output_choices_are_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    for command, choices in (("status", "{table,wide,json}"), ("watch", "{table,json}")):
        with pytest.raises(SystemExit) as exc:
            cli.main([command, "--help"])
        assert exc.value.code == 0
        text = capsys.readouterr().out
        assert choices in text and "--state-dir" in text and "GPU_HEALTH_STATE_DIR" in text


# demo --duration ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "soon"])
def test_demo_rejects_a_duration_that_is_not_a_positive_number(value: str) -> None:
    proc = subprocess.run([*CLI, "demo", "--plain", "--duration", value], capture_output=True, text=True,
                          timeout=60)
    _no_traceback(proc.stderr)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "argument --duration" in proc.stderr.splitlines()[-1] and repr(value) in proc.stderr


# What status shows: each device's action and message, the kubelet registration, cut to the terminal ------------

@dataclass
class Record:
    """The registration record as the supervisor keeps it (plugin/kubelet/supervisor.py), set by the test."""

    registered: bool = True
    registrations: int = 2
    last_registered_at: float = T0
    last_error: str = ""
    outlet_errors: dict[str, str] = field(default_factory=dict)  # the reporter's, by outlet


@pytest.fixture
def registered(short_socket_dir: Path) -> Iterator[tuple[Path, Node, Record]]:
    state = NodeState()
    node = Node(state, n=3)
    node.set(1, State.DEGRADED, "thermal-slowdown", now=T0)
    node.set(2, State.UNHEALTHY, "xid-79", "ecc-uncorrected", now=T0)
    record = Record()
    server = HealthServer(short_socket_dir / "health.sock", state, registration=("device-plugin", lambda: record),
                          outlet_errors=lambda: record.outlet_errors)
    server.start()
    yield short_socket_dir / "health.sock", node, record
    server.stop()


def _status(capsys: pytest.CaptureFixture[str], sock: Path, *argv: str) -> list[str]:
    """stdout's lines, then stderr's: the table is all of stdout, what it does not say is on stderr."""
    assert cli.main(["status", "--health-socket", str(sock), *argv]) == 0
    out, err = capsys.readouterr()
    return out.splitlines() + err.splitlines()


def test_status_shows_action_message_and_the_kubelet_registration(
        registered: tuple[Path, Node, Record], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    sock, node, record = registered
    monkeypatch.setenv("COLUMNS", "40")  # captured stdout is no terminal: lines stay whole whatever it says
    assert cli.main(["status", "--health-socket", str(sock)]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 + 3  # the header and a row per device: a script's rows, nothing else
    assert err.splitlines() == ["kubelet: registered (device-plugin, 2 registrations, last at 2026-01-01T00:00:00Z)"]
    lines = _status(capsys, sock)
    assert lines[0].split() == ["ID", "IDX", "STATE", "KUBELET", "SINCE", "ACTION", "REASONS"]
    hot = next(ln for ln in lines if ln.startswith(node.gpus[1].uuid))
    assert hot.split()[1:6] == ["1", "Degraded", "Healthy", "2026-01-01T00:00:00Z", "none"]
    assert hot.endswith("thermal-slowdown: temperature 90C at or above slowdown threshold 87C")
    lost = next(ln for ln in lines if ln.startswith(node.gpus[2].uuid))
    assert lost.split()[5] == "reboot-node"  # the worst reason's action, as the annotations say it
    assert "xid-79: XID 79: GPU has fallen off the bus; ecc-uncorrected: 2 volatile" in lost
    assert lines[-1] == "kubelet: registered (device-plugin, 2 registrations, last at 2026-01-01T00:00:00Z)"
    record.registered, record.last_error = False, "kubelet.sock does not exist (is the kubelet running?)"
    assert _status(capsys, sock)[-1] == ("kubelet: NOT registered (device-plugin): kubelet.sock does not exist "
                                         "(is the kubelet running?)")
    record.outlet_errors["kube"] = "PATCH node gpu-a: 403 Forbidden"
    assert _status(capsys, sock)[-2:] == [
        "kubelet: NOT registered (device-plugin): kubelet.sock does not exist (is the kubelet running?)",
        "outlet kube failing: PATCH node gpu-a: 403 Forbidden"]


def test_status_wraps_to_the_terminal_and_wide_never_does(registered: tuple[Path, Node, Record],
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    sock, node, _ = registered
    full = ["xid-79: XID 79: GPU has fallen off the bus", "ecc-uncorrected: 2 volatile uncorrected ECC errors"]
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    for columns in (140, 100):  # room for the reasons beside the columns, and not
        monkeypatch.setenv("COLUMNS", str(columns))
        lines = _status(capsys, sock)
        # The rows' columns are what they are (a UUID is 40 characters); the reasons wrap to what is left.
        assert all(len(ln) <= columns for ln in lines[1:] if ln.startswith(" ") or columns == 140), lines
        at = next(i for i, ln in enumerate(lines) if ln.startswith(node.gpus[2].uuid))
        assert lines[at].split()[5] == "reboot-node"
        # Each reason on lines of its own, under the REASONS column or indented under the row; nothing lost.
        more = [ln for ln in lines[at + 1:at + 6] if ln.startswith(" ")]
        beside = lines[at][lines[0].index("REASONS"):]
        assert bool(beside) == (columns == 140), lines
        assert " ".join([beside, *(ln.strip() for ln in more)]).strip() == " ".join(full), lines
        assert len(more) >= 2 and not [ln for ln in lines if ln.endswith("\u2026")]
    wide = _status(capsys, sock, "-o", "wide")
    row = next(ln for ln in wide if ln.startswith(node.gpus[2].uuid))
    assert row.endswith("xid-79: XID 79: GPU has fallen off the bus (action: reboot-node); ecc-uncorrected: 2 "
                        "volatile uncorrected ECC errors (action: reset-gpu)")
    assert not [ln for ln in wide if ln.startswith(" ")]


def test_status_json_carries_what_the_table_shows(registered: tuple[Path, Node, Record],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    sock, node, _ = registered
    doc = json.loads("\n".join(_status(capsys, sock, "-o", "json")))
    hot = doc["devices"][1]
    assert (hot["id"], hot["index"], hot["state"], hot["kubelet_health"], hot["action"], hot["since"]) == (
        node.gpus[1].uuid, 1, "Degraded", "Healthy", "none", "2026-01-01T00:00:00Z")
    assert hot["reasons"][0]["message"] == "temperature 90C at or above slowdown threshold 87C"
    assert doc["devices"][2]["kubelet_health"] == "Unhealthy" and doc["devices"][2]["action"] == "reboot-node"
    assert doc["kubelet"] == {"mode": "device-plugin", "registered": True, "registrations": 2,
                              "last_registered_at": "2026-01-01T00:00:00Z", "last_error": ""}
    assert doc["outlet_errors"] == {}


def test_status_of_a_plugin_that_does_not_report_registration_says_so(served: Served,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # An older plugin leaves the field unset: "unknown", never "not registered".
    assert _status(capsys, served.sock)[-1] == "kubelet: registration not reported (the plugin predates it)"
    assert cli.main(["status", "--health-socket", str(served.sock), "-o", "json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["kubelet"] is None and err == ""


# Subcommands mistyped, flags unknown -------------------------------------------------------------------------------

def test_a_mistyped_subcommand_is_named_with_the_nearest(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["statu"]) == 2
    assert capsys.readouterr().err == "gpu-health-plugin: unknown subcommand 'statu'; did you mean 'status'?\n"
    assert cli.main(["frobnicate"]) == 2
    assert "unknown subcommand 'frobnicate' (one of: run, demo, status" in capsys.readouterr().err


def test_an_unknown_flag_of_run_prints_runs_usage(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["run", "--no-such-flag"], ["--no-such-flag"]):  # the default run too
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: gpu-health-plugin run ") and "--poll-interval" in err
        assert err.splitlines()[-1] == "gpu-health-plugin run: error: unrecognized arguments: --no-such-flag"


# Ctrl-C ------------------------------------------------------------------------------------------------------------

def test_ctrl_c_stops_run_with_exit_130_and_no_error(short_socket_dir: Path) -> None:
    from tests.conftest import NodeFile

    NodeFile(short_socket_dir / "node.json")
    sock = short_socket_dir / "state" / "health.sock"
    proc = subprocess.Popen(
        [*CLI, "run", "--backend", "simulated", "--simulated-node", str(short_socket_dir / "node.json"),
         "--device-plugin-dir", str(short_socket_dir / "dp"), "--state-dir", str(short_socket_dir / "state"),
         "--dev-root", str(short_socket_dir), "--metrics-address", "off"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    out = Lines(proc.stdout)
    try:
        while "health API serving on" not in (out.next() or "health API serving on"):
            pass
        # The plugin's own view of its registration, through the health API: no kubelet here, so not registered.
        status = subprocess.run([*CLI, "status", "-o", "json", "--health-socket", str(sock)], capture_output=True,
                                text=True, timeout=60)
        kubelet = json.loads(status.stdout)["kubelet"]
        assert kubelet["mode"] == "device-plugin" and kubelet["registered"] is False and kubelet["last_error"]
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
        text = out.rest()
    finally:
        proc.kill()
        proc.wait()
    assert rc == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert not [ln for ln in text.splitlines() if " ERROR " in ln], text
    # One line from the Ctrl-C on: the one saying so.
    said = text.splitlines()
    at = next(i for i, ln in enumerate(said) if "received SIGINT, shutting down" in ln)
    assert said[at + 1:] == [], text
