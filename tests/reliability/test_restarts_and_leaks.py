"""Reliability against the real plugin process: 100 kubelet restarts, 1,000 ListAndWatch connect/disconnect cycles,
SIGKILL in the middle of state-file writes. Each bounded in count and time."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from bench._common import fd_count, thread_count
from plugin.devtools.standin import KubeletStandin
from plugin.health.store import StateStore
from tests.conftest import NodeFile

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


# gRPC's thread pools start workers lazily up to their bound, so a few more threads than at the baseline is growth of
# a bounded pool, not a leak; a leak of one thread per cycle would show as hundreds.
POOL_SLACK = 8


def settles(measure: Callable[[], int], limit: int, timeout: float = 10.0) -> int:
    """Resources are released asynchronously (gRPC closes sockets on its own threads): re-read until at or under
    ``limit`` or the timeout, then return the last value."""
    deadline = time.monotonic() + timeout
    value = measure()
    while value > limit and time.monotonic() < deadline:
        time.sleep(0.05)  # polling /proc: there is no event to wait on for another process's fd table
        value = measure()
    return value


@pytest.fixture
def plugin(short_socket_dir: Path) -> Iterator[tuple[subprocess.Popen[str], KubeletStandin, NodeFile]]:
    node = NodeFile(short_socket_dir / "node.json")
    kubelet = KubeletStandin(short_socket_dir / "dp")
    kubelet.start()
    proc = subprocess.Popen([sys.executable, "-m", "plugin", "run", "--backend", "simulated", "--simulated-node",
                             str(node.path), "--device-plugin-dir", str(short_socket_dir / "dp"), "--state-dir",
                             str(short_socket_dir / "state"), "--dev-root", str(short_socket_dir),
                             "--log-level", "warning"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8), 30)
    yield proc, kubelet, node
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=15)
    kubelet.stop()


def test_100_kubelet_restarts(plugin: tuple[subprocess.Popen[str], KubeletStandin, NodeFile]) -> None:
    proc, kubelet, node = plugin
    node.set(6, xid_events=[79])
    assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 7), 10)
    kubelet.restart()  # one restart to warm up every code path before the baseline
    assert kubelet.wait_for(lambda: len(kubelet.registrations) == 2 and kubelet.capacity() == (8, 7), 10)
    base_fds, base_threads = fd_count(proc.pid), thread_count(proc.pid)
    for i in range(100):
        n = len(kubelet.registrations)
        kubelet.restart()
        assert kubelet.wait_for(lambda n=n: len(kubelet.registrations) > n and kubelet.capacity() == (8, 7)
                                and kubelet.view() is not None and kubelet.view().connected, 10), (  # type: ignore
            f"restart {i}: not re-registered with health kept")
    assert len(kubelet.registrations) == 102  # exactly one registration per restart
    assert kubelet.health(node.uuids[6]) == "Unhealthy"
    assert settles(lambda: fd_count(proc.pid), base_fds) <= base_fds
    assert settles(lambda: thread_count(proc.pid), base_threads) <= base_threads + POOL_SLACK


def test_1000_list_and_watch_cycles(plugin: tuple[subprocess.Popen[str], KubeletStandin, NodeFile]) -> None:
    proc, kubelet, node = plugin
    endpoint = kubelet.plugin_dir / kubelet.registrations[-1][2]
    with grpc.insecure_channel(f"unix://{endpoint}") as ch:
        stub = api_pb2_grpc.DevicePluginStub(ch)
        for _ in range(20):  # warm-up
            s = stub.ListAndWatch(api_pb2.Empty())
            next(s)
            s.cancel()
        base_fds, base_threads = fd_count(proc.pid), thread_count(proc.pid)
        for i in range(1000):
            s = stub.ListAndWatch(api_pb2.Empty())
            assert len(next(s).devices) == 8, i
            s.cancel()
    assert settles(lambda: fd_count(proc.pid), base_fds) <= base_fds
    assert settles(lambda: thread_count(proc.pid), base_threads) <= base_threads + POOL_SLACK
    # Still serving normally.
    assert kubelet.capacity() == (8, 8)
    node.set(0, nvlink_down=[1])
    assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 7), 10)


WRITER = """
import sys
from pathlib import Path
from plugin.health.store import StateStore
store = StateStore(Path(sys.argv[1]))
blob = "x" * 400_000
i = 0
while True:
    store.save({"devices": {}, "generation": i, "blob": blob})
    print(i, flush=True)  # after save returns: generation i is durable
    i += 1
"""


def test_sigkill_during_state_writes_never_corrupts(tmp_path: Path) -> None:
    import random

    rng = random.Random(7)
    for round_ in range(20):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True)
        assert p.stdout is not None
        # Let a few whole writes complete first, so the kill lands between two saves of the same process, not
        # before the file exists.
        warm = rng.randint(1, 4)
        while int(p.stdout.readline()) < warm:
            pass
        time.sleep(rng.uniform(0.0, 0.2))  # a random point inside the write loop is the whole idea
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        # Only whole lines: the writer may die between a number and its newline.
        done = [int(line) for line in p.stdout.read().splitlines(keepends=True) if line.endswith("\n")]
        p.stdout.close()
        durable = done[-1] if done else warm
        doc = StateStore(tmp_path).load()
        assert doc.get("blob") == "x" * 400_000, f"round {round_}: torn or missing state"
        # The file holds the last save that returned, or the one in flight if its rename had landed: never an
        # older version (a lost write) nor one from an earlier round.
        assert doc["generation"] in (durable, durable + 1), (
            f"round {round_}: state has generation {doc['generation']}, last durable save was {durable}")
    assert not (tmp_path / "state.corrupt").exists()
