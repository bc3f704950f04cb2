"""The pieces both gRPC servers share: NodeState.follow (a stream's wait for change), client_left, and
UnixGrpcServer (bind with a mode, confirm, stop and remove the socket)."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import grpc
import pytest

from plugin.health.node_state import NodeState, Snapshot
from plugin.sockets import UnixGrpcServer, client_left

WAIT = 5.0


def _next_within(it: Iterator[Snapshot], timeout: float = WAIT) -> Snapshot | None:
    """next(it), None once it ended, on another thread: a stream that wrongly blocks fails the test, not hangs it."""
    got: list[Snapshot | None] = []
    t = threading.Thread(target=lambda: got.append(next(it, None)), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "follow blocked"
    return got[0]


def test_follow_yields_at_once_then_on_change_and_ends_when_told() -> None:
    state = NodeState()
    state.publish([], 0.0, backend_error="first")
    gone = threading.Event()
    stream = state.follow(-1, gone.is_set, 60.0)
    assert _next_within(stream) is state.snapshot()  # nothing newer needed: -1 is no snapshot's version
    state.publish([], 1.0, backend_error="second")
    snap = _next_within(stream)
    assert snap is state.snapshot() and snap.backend_error == "second"
    gone.set()
    state.poke()
    assert _next_within(stream) is None


def test_follow_repeats_after_a_recheck_and_ends_when_the_state_closes() -> None:
    state = NodeState()
    stream = state.follow(state.snapshot().version, lambda: False, 0.05)
    assert _next_within(stream) is state.snapshot()  # the recheck: the same snapshot again, for the caller to judge
    state.close()
    assert _next_within(stream) is None


def test_client_left_sets_its_event_then_wakes() -> None:
    ctx, woken = mock.Mock(spec=grpc.ServicerContext), []
    left = client_left(ctx, lambda: woken.append(left.is_set()))
    assert not left.is_set() and not woken
    (on_done,), _ = ctx.add_callback.call_args
    on_done()  # what gRPC does when the call ends
    assert left.is_set() and woken == [True]  # set before the wake-up, so the woken stream sees it


def _ready(ch: grpc.Channel) -> None:
    grpc.channel_ready_future(ch).result(timeout=WAIT)


def test_a_server_is_born_with_its_mode_and_its_socket_goes_with_it(short_socket_dir: Path) -> None:
    path = short_socket_dir / "s.sock"
    server = UnixGrpcServer(path, 0o640, lambda s: None, 2, "test")
    server.start(_ready)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    server.stop(0)
    assert not path.exists()
    server.stop(0)  # again, with the socket gone: nothing to do


def test_a_failed_confirm_is_raised(short_socket_dir: Path) -> None:
    server = UnixGrpcServer(short_socket_dir / "s.sock", 0o600, lambda s: None, 2, "test")

    def refuse(ch: grpc.Channel) -> None:
        raise RuntimeError("no answer")

    with pytest.raises(RuntimeError, match="no answer"):
        server.start(refuse)
    server.stop(0)


def test_a_socket_that_cannot_be_removed_is_logged_not_raised(short_socket_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    path = short_socket_dir / "s.sock"
    server = UnixGrpcServer(path, 0o600, lambda s: None, 2, "test")
    server.start()

    def read_only(p: object, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(p))  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", read_only)
    with caplog.at_level(logging.DEBUG, logger="plugin.sockets"):
        server.stop(0)  # shutting down on a read-only mount goes on with the rest of the shutdown
    assert [r.levelno for r in caplog.records if "cannot remove" in r.getMessage()] == [logging.DEBUG]
