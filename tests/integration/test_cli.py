"""The ``status``, ``watch`` and ``demo`` commands at their edges: closed pipes, a plugin that goes away, where the
socket is, bad flag values. The health API is the real server on a unix socket over a NodeState that the test
drives; the CLI runs as a real process where its exit and its streams are what is tested."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
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
    assert proc.returncode == 0 and proc.stdout.split() == ["ID", "IDX", "STATE", "KUBELET", "SINCE", "REASONS"]


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
    for command in ("status", "watch"):
        with pytest.raises(SystemExit) as exc:
            cli.main([command, "--help"])
        assert exc.value.code == 0
        text = capsys.readouterr().out
        assert "{table,json}" in text and "--state-dir" in text and "GPU_HEALTH_STATE_DIR" in text


# demo --duration ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "soon"])
def test_demo_rejects_a_duration_that_is_not_a_positive_number(value: str) -> None:
    proc = subprocess.run([*CLI, "demo", "--plain", "--duration", value], capture_output=True, text=True,
                          timeout=60)
    _no_traceback(proc.stderr)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "argument --duration" in proc.stderr.splitlines()[-1] and repr(value) in proc.stderr
