"""The stand-in for NVIDIA's device plugin (tests/fakes/nvidia_device_plugin.py), which the migration story runs on
the local cluster, answers the kubelet as NVIDIA's plugin does: NVIDIA's socket name, the GPUs by UUID, Allocate
with NVIDIA_VISIBLE_DEVICES and no device nodes, registered again after a kubelet restart, its socket gone at stop.
Checked here against the kubelet stand-in, so the story's premise does not rest on the story alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from plugin.devtools.standin import KubeletStandin
from tests.fakes import nvidia_device_plugin as nvidia

UUIDS = [f"GPU-{i:08d}-0000-0000-0000-000000000000" for i in range(3)]


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[KubeletStandin, threading.Event, threading.Thread, Path]]:
    kubelet = KubeletStandin(tmp_path)
    kubelet.start()
    stop = threading.Event()
    ready = tmp_path / "ready"
    t = threading.Thread(target=nvidia.serve, args=(tmp_path, UUIDS, ready, stop), daemon=True)
    t.start()
    try:
        yield kubelet, stop, t, ready
    finally:
        stop.set()
        t.join(10)
        kubelet.stop()


def test_it_registers_nvidias_socket_and_lists_the_gpus_by_uuid(
        running: tuple[KubeletStandin, threading.Event, threading.Thread, Path]) -> None:
    kubelet, _, _, ready = running
    assert kubelet.wait_for(lambda: kubelet.capacity() == (3, 3), 10), kubelet.capacity()
    view = kubelet.view()
    assert view is not None and view.endpoint == "nvidia-gpu.sock"
    assert sorted(view.devices) == UUIDS
    # Written once Register has returned, which is a moment after the kubelet side saw it.
    deadline = time.monotonic() + 10
    while not ready.exists():
        assert time.monotonic() < deadline, "no ready file"
        time.sleep(0.05)
    assert ready.read_text() == "registered\n"


def test_allocate_names_the_uuids_and_leaves_the_device_nodes_to_the_runtime(
        running: tuple[KubeletStandin, threading.Event, threading.Thread, Path]) -> None:
    kubelet, _, _, _ = running
    assert kubelet.wait_for(lambda: kubelet.capacity() == (3, 3), 10)
    [resp] = kubelet.allocate(UUIDS[:2]).container_responses
    assert dict(resp.envs) == {"NVIDIA_VISIBLE_DEVICES": ",".join(UUIDS[:2])}
    assert not resp.devices and not resp.mounts
    with pytest.raises(grpc.RpcError) as exc:
        kubelet.allocate(["GPU-nope"])
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_kubelet_restart_gets_a_new_registration_and_stop_removes_the_socket(
        running: tuple[KubeletStandin, threading.Event, threading.Thread, Path], tmp_path: Path) -> None:
    kubelet, stop, thread, ready = running
    assert kubelet.wait_for(lambda: len(kubelet.registrations) == 1, 10)
    kubelet.restart()
    assert kubelet.wait_for(lambda: len(kubelet.registrations) == 2 and kubelet.capacity() == (3, 3), 15), \
        kubelet.registrations
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
    assert not (tmp_path / "nvidia-gpu.sock").exists()
    assert not ready.exists()
    # The stream ended with the plugin: the kubelet holds the devices as unhealthy.
    assert kubelet.wait_for(lambda: kubelet.capacity() == (3, 0), 10)
