"""The supervisor's serve -> register -> watch loop over real sockets, against the kubelet stand-in: one registration
per kubelet however its signals interleave, back-off (not a hot loop) when serving fails, sockets born with their mode
without touching the process umask, and a dead loop failing /healthz."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from api.deviceplugin.v1beta1 import api_pb2
from plugin.app import App
from plugin.devtools.standin import KubeletStandin
from plugin.health.node_state import NodeState
from plugin.kubelet import supervisor as supervisor_mod
from plugin.kubelet.allocation import AllocationConfig
from plugin.kubelet.resources import WholeGpus
from plugin.kubelet.supervisor import Supervisor
from plugin.outlets.health_api import HealthServer
from plugin.outlets.metrics import MetricsServer, Probes, Sources, build_registry
from tests.conftest import NodeFile
from tests.integration.conftest import Env, make_config

WAIT = 10.0  # upper bound for something already on its way


class Records(logging.Handler):
    """The supervisor's log records, with a condition to wait on."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self.cond:
            self.records.append(record)
            self.cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout)

    def matching(self, needle: str) -> list[logging.LogRecord]:
        with self.cond:
            return [r for r in self.records if needle in r.getMessage()]


@pytest.fixture
def records() -> Iterator[Records]:
    logger = logging.getLogger("plugin.kubelet.supervisor")
    handler, level = Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_kubelet_sock_created_mid_round_registers_once(env: Env) -> None:
    sup, k = env.app.supervisor, env.kubelet
    held, release = threading.Event(), threading.Event()

    def hold_first(request: api_pb2.RegisterRequest) -> None:
        if not held.is_set():
            held.set()
            release.wait(WAIT)

    k.register_gate = hold_first
    k.restart()  # our socket wiped, kubelet.sock created in place
    assert held.wait(WAIT), "the plugin never registered with the new kubelet"
    # The round is inside Register with the new kubelet; the watchdog's report of its kubelet.sock arrives now.
    sup.kubelet_socket_created()
    release.set()
    assert sup.wait_settled(WAIT)
    assert len(k.registrations) == 2  # a second one would let the first stream's end disconnect the new client
    view = k.view()
    assert view is not None and view.connected and view.endpoint == k.registrations[-1][2]
    # A report about the kubelet already registered with is judged stale when taken, and dropped.
    sup.kubelet_socket_created()
    assert sup.wait_settled(WAIT)
    assert len(k.registrations) == 2


@pytest.mark.parametrize("rename", [False, True], ids=["bind-in-place", "rename"])
def test_a_new_kubelet_is_registered_with_once_however_its_socket_appears(
        short_socket_dir: Path, dev_root: Path, rename: bool) -> None:
    node = NodeFile(short_socket_dir / "node.json")
    kubelet = KubeletStandin(short_socket_dir / "dp", rename=rename)
    kubelet.start()
    app = App(make_config(short_socket_dir, node, dev_root))
    app.start()
    try:
        assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8), WAIT)
        first = kubelet.registrations[-1][2]
        # A kubelet that comes back without wiping the dir: only kubelet.sock appearing tells of it.
        kubelet.stop()
        kubelet.start()
        assert kubelet.wait_for(lambda: len(kubelet.registrations) == 2 and kubelet.capacity() == (8, 8), WAIT)
        assert app.supervisor.wait_settled(WAIT)
        assert len(kubelet.registrations) == 2 and kubelet.registrations[-1][2] != first
    finally:
        app.stop.set()
        app.shutdown()
        kubelet.stop()


def _read_only_under(monkeypatch: pytest.MonkeyPatch, top: Path) -> None:
    """Make the OS answer EROFS for anything created or removed inside ``top``, as a read-only mount does (chmod
    does not stop root, who runs these tests)."""
    for name in ("mkdir", "unlink", "replace", "rename"):
        real = getattr(os, name)

        def refuse(path: object, *args: object, _real: Callable[..., object] = real, **kwargs: object) -> object:
            if Path(os.fsdecode(path)).parent == top:  # type: ignore[arg-type]
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))  # type: ignore[arg-type]
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(os, name, refuse)


@pytest.mark.parametrize("failure", ["path over the unix limit", "read-only plugin dir"])
def test_a_serve_failure_backs_off_instead_of_looping(short_socket_dir: Path, records: Records,
                                                      monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    if failure == "path over the unix limit":
        plugin_dir, needle = short_socket_dir / ("d" * 100), "unix limit"
        plugin_dir.mkdir()
    else:
        plugin_dir, needle = short_socket_dir / "dp", "Read-only file system"
        plugin_dir.mkdir()
        _read_only_under(monkeypatch, plugin_dir)
    sup = Supervisor(plugin_dir, [WholeGpus()], NodeState(), AllocationConfig(dev_root=short_socket_dir),
                     threading.Event(), backoff_initial_s=0.05, backoff_max_s=0.4)
    sup.start()
    try:
        # Back-off from 0.05 s doubling to 0.4 s fits about 8 attempts in the window; a hot loop makes thousands
        # (15,085 in 5 s before). The window ends early if the count is exceeded.
        assert not records.wait_for(lambda: len(records.matching("cannot serve")) > 20, 2.0)
    finally:
        sup.shutdown()
    attempts = records.matching("cannot serve")
    assert len(attempts) >= 2  # it does retry
    assert sup.record.serve_failures == len(attempts)
    loud = [r for r in attempts if r.levelno >= logging.WARNING]
    assert 1 <= len(loud) <= 2 and needle in loud[0].getMessage()  # once per streak, not once per attempt
    assert "cannot serve nvidia.com/gpu" in sup.record.last_error and not sup.record.registered


def test_sockets_are_born_with_their_mode_and_the_umask_is_never_touched(
        short_socket_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real_umask = os.umask

    def recording_umask(mask: int) -> int:
        calls.append(mask)
        return real_umask(mask)

    monkeypatch.setattr(os, "umask", recording_umask)
    dp = short_socket_dir / "dp"
    kubelet = KubeletStandin(dp)
    kubelet.start()
    state = NodeState()
    sup = Supervisor(dp, [WholeGpus()], state, AllocationConfig(dev_root=short_socket_dir), threading.Event())
    health = HealthServer(short_socket_dir / "state" / "health.sock", state)
    health.start()
    sup.start()
    try:
        assert sup.registered_event.wait(WAIT)
        endpoint = kubelet.registrations[-1][2]
        assert stat.S_IMODE((dp / endpoint).stat().st_mode) == 0o600
        assert stat.S_IMODE(health.path.stat().st_mode) == 0o660  # docs/health.md: the node's admins group
        assert calls == []  # process-wide: changing it from a worker thread races every other thread's files
        assert sorted(p.name for p in dp.iterdir()) == sorted(["kubelet.sock", endpoint])  # nothing left behind
        assert [p.name for p in health.path.parent.iterdir()] == ["health.sock"]
    finally:
        sup.shutdown()
        health.stop(grace_s=0)
        kubelet.stop()


class Unexpected(Exception):
    pass


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=WAIT) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_dead_supervisor_loop_fails_healthz(short_socket_dir: Path, records: Records,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    raised = threading.Event()

    def broken_register(*args: object, **kwargs: object) -> None:
        raised.set()
        raise Unexpected("something nobody handles")

    monkeypatch.setattr(supervisor_mod, "register", broken_register)  # the kubelet edge answers the unforeseen
    state = NodeState()
    sup = Supervisor(short_socket_dir / "dp", [WholeGpus()], state, AllocationConfig(dev_root=short_socket_dir),
                     threading.Event())
    probes = Probes(None, sup, 30.0)
    assert probes.liveness()[0]
    server = MetricsServer("127.0.0.1:0", build_registry(Sources(state, supervisor=sup), process=False), probes)
    server.start()
    sup.start()
    try:
        assert raised.wait(WAIT)
        assert sup.wait_for(lambda: not sup.alive(), WAIT)
        ok, text = probes.liveness()
        assert not ok and "supervisor loop died" in text and "something nobody handles" in text
        assert _get(f"http://127.0.0.1:{server.port}/healthz") == 503
        assert records.matching("supervisor loop died")
    finally:
        server.stop()
        sup.shutdown()
