"""The plugin as a real process: SIGTERM clean-up, state kept across restarts, NVML missing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from plugin.devtools.standin import KubeletStandin
from tests.conftest import NodeFile

ROOT = Path(__file__).resolve().parents[2]


def start_plugin(root: Path, *extra: str, backend: str = "simulated") -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "plugin", "run", "--backend", backend, "--device-plugin-dir", str(root / "dp"),
            "--state-dir", str(root / "state"), "--dev-root", str(root), "--poll-interval", "0.1", *extra]
    if backend == "simulated":
        args += ["--simulated-node", str(root / "node.json")]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def list_devices(socket: Path) -> list[str]:
    """The device IDs the health API at ``socket`` answers with."""
    import grpc

    from api.gpuhealth.v1alpha1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"unix://{socket}") as ch:
        resp = health_pb2_grpc.DeviceHealthStub(ch).List(health_pb2.ListRequest(), timeout=10)
    return [d.id for d in resp.devices]


def grace_period() -> int:
    """The DaemonSet's terminationGracePeriodSeconds: past it the kubelet kills the plugin."""
    import yaml

    doc = yaml.safe_load((ROOT / "manifests" / "base" / "daemonset.yaml").read_text())
    return int(doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])


def stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """SIGTERM, and the exit within the grace period (TimeoutExpired otherwise): how fast it stops on a quiet
    machine is a benchmark's figure, not this test's."""
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=grace_period())
    return proc.returncode, out


def test_sigterm_ends_streams_removes_sockets_and_exits_0(short_socket_dir: Path,
                                                          kubelet: KubeletStandin) -> None:
    NodeFile(short_socket_dir / "node.json")
    proc = start_plugin(short_socket_dir)
    try:
        assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8), 30)
        endpoint = kubelet.registrations[-1][2]
        assert (short_socket_dir / "dp" / endpoint).exists()
        assert (short_socket_dir / "state" / "health.sock").exists()
    finally:
        rc, out = stop(proc)
    assert rc == 0, out
    assert not (short_socket_dir / "dp" / endpoint).exists()
    assert not (short_socket_dir / "state" / "health.sock").exists()
    view = kubelet.view()
    assert view is not None and kubelet.wait_for(lambda: not view.connected, 5)  # the stream ended
    assert "effective config" in out and "stopped" in out


def test_json_logs_carry_the_effective_config(short_socket_dir: Path, kubelet: KubeletStandin) -> None:
    import json

    NodeFile(short_socket_dir / "node.json")
    proc = start_plugin(short_socket_dir, "--log-format", "json", "--log-level", "info")
    try:
        assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8), 30)
    finally:
        rc, out = stop(proc)
    assert rc == 0
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert all({"time", "level", "logger", "msg"} <= set(line) for line in lines)
    first = next(line for line in lines if line["msg"].startswith("effective config"))
    effective = json.loads(first["msg"].split(":", 1)[1])
    assert effective["backend"] == "simulated" and effective["poll_interval"] == 0.1


def test_latched_fault_survives_a_plugin_restart(short_socket_dir: Path, kubelet: KubeletStandin) -> None:
    node = NodeFile(short_socket_dir / "node.json")
    proc = start_plugin(short_socket_dir)
    try:
        assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8), 30)
        node.set(2, xid_events=[79])
        assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 7), 10)
    finally:
        stop(proc)
    # Killed hard this time, after restart: the state dir, not the XID list, carries the fault.
    proc = start_plugin(short_socket_dir)
    try:
        assert kubelet.wait_for(lambda: len(kubelet.registrations) == 2 and kubelet.capacity() == (8, 7), 30)
        # The very first snapshot after the restart already had it: the kubelet never saw 8 healthy.
        assert kubelet.health(node.uuids[2]) == "Unhealthy"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = start_plugin(short_socket_dir)
        assert kubelet.wait_for(lambda: len(kubelet.registrations) == 3 and kubelet.capacity() == (8, 7), 30)
    finally:
        if proc.poll() is None:
            stop(proc)


def test_nvml_missing_exits_with_a_clear_message(short_socket_dir: Path) -> None:
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this machine has an NVIDIA driver; the missing-library path cannot be shown here")
    env = dict(os.environ, LD_LIBRARY_PATH=str(short_socket_dir))
    r = subprocess.run([sys.executable, "-m", "plugin", "run", "--backend", "nvml", "--state-dir",
                        str(short_socket_dir / "s"), "--device-plugin-dir", str(short_socket_dir / "dp")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1
    assert "cannot start the nvml backend" in r.stderr and "--fail-on-init-error=false" in r.stderr


def test_nvml_missing_with_fail_on_init_error_false_serves_no_devices(short_socket_dir: Path,
                                                                      kubelet: KubeletStandin) -> None:
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this machine has an NVIDIA driver")
    proc = start_plugin(short_socket_dir, "--fail-on-init-error=false", backend="nvml")
    try:
        assert kubelet.wait_for(lambda: kubelet.view() is not None and kubelet.view().updates >= 1, 30)  # type: ignore
        assert kubelet.capacity() == (0, 0)  # registered, and nothing looks healthy
    finally:
        rc, out = stop(proc)
    assert rc == 0 and "NVML unavailable" in out


def test_relative_paths_are_taken_against_the_working_directory(short_socket_dir: Path,
                                                                 kubelet: KubeletStandin) -> None:
    import json

    node = NodeFile(short_socket_dir / "node.json")
    (short_socket_dir / "elsewhere").mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), GPU_HEALTH_HEALTH_SOCKET="api/health.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "plugin", "run", "--backend", "simulated", "--simulated-node", "node.json",
         "--device-plugin-dir", "dp", "--state-dir", "./state", "--dev-root", ".", "--poll-interval", "0.1",
         "--metrics-address", "off", "--log-format", "json"],
        cwd=short_socket_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8), 30)
        assert sorted(list_devices(short_socket_dir / "api" / "health.sock")) == sorted(node.uuids)
        assert (short_socket_dir / "state" / "plugin.lock").exists()
    finally:
        rc, out = stop(proc)
    assert rc == 0, out
    first = next(json.loads(line) for line in out.splitlines() if '"effective config' in line)
    effective = json.loads(first["msg"].split(":", 1)[1])
    root = str(short_socket_dir)
    assert effective["simulated_node"] == f"{root}/node.json"
    assert effective["device_plugin_dir"] == f"{root}/dp"
    assert effective["state_dir"] == f"{root}/state"
    assert effective["health_socket"] == f"{root}/api/health.sock"
    assert effective["dev_root"] == root


def test_a_second_instance_on_the_same_state_dir_refuses_and_the_first_keeps_serving(
        short_socket_dir: Path, kubelet: KubeletStandin) -> None:
    node = NodeFile(short_socket_dir / "node.json")
    first = start_plugin(short_socket_dir, "--metrics-address", "off")
    health_sock = short_socket_dir / "state" / "health.sock"
    try:
        assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8), 30)
        second = start_plugin(short_socket_dir, "--metrics-address", "off")
        try:
            out, _ = second.communicate(timeout=30)
        finally:
            if second.poll() is None:  # it started despite the first: that is the failure being tested
                second.kill()
                second.communicate()
        assert second.returncode == 1, out
        assert "Traceback" not in out
        assert f"--state-dir {short_socket_dir / 'state'} is in use by another gpu-health-plugin (pid {first.pid}" \
            in out
        # The first still owns its sockets and its registration.
        assert first.poll() is None
        assert sorted(list_devices(health_sock)) == sorted(node.uuids)
        assert len(kubelet.registrations) == 1
        # A holder that dies hard leaves the lock file behind, but not the lock: a new instance starts.
        first.kill()
        first.wait(10)
        first = start_plugin(short_socket_dir, "--metrics-address", "off")
        assert kubelet.wait_for(lambda: len(kubelet.registrations) == 2 and kubelet.capacity() == (8, 8), 30)
        assert sorted(list_devices(health_sock)) == sorted(node.uuids)
    finally:
        if first.poll() is None:
            rc, out = stop(first)
            assert rc == 0, out


def _readyz(address: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{address}/readyz", timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def _lock_holder_pid(root: Path) -> int:
    words = (root / "state" / "plugin.lock").read_text().split()
    return int(words[0]) if words else 0


def _latch_then_start_a_successor(root: Path, kubelet: KubeletStandin, node: NodeFile, index: int,
                                  old: subprocess.Popen[str], metrics: str = "off") -> subprocess.Popen[str]:
    """With ``old`` serving, latch XID 79 on GPU ``index``, then start a --handover successor and wait until the
    kubelet has its registration and its first device list."""
    assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8), 30)
    node.set(index, xid_events=[79])
    assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 7), 10)
    new = start_plugin(root, "--metrics-address", metrics, "--handover")
    assert kubelet.wait_for(lambda: len(kubelet.registrations) == 2, 30), old.pid
    view = kubelet.view()
    assert view is not None and kubelet.wait_for(lambda: view.updates > 0, 10)
    return new


def test_a_handover_successor_serves_next_to_the_holder_then_takes_its_state_over(
        short_socket_dir: Path, kubelet: KubeletStandin) -> None:
    """A surge rollout: the new plugin starts while the old one runs (--handover), registers at once with the
    latched fault the old one saved, leaves the state dir alone until the old one exits, then owns it."""
    node = NodeFile(short_socket_dir / "node.json")
    state = short_socket_dir / "state"
    health_sock = state / "health.sock"
    # One metrics port for both, as on the host's network: the successor serves it once the old one has gone.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        metrics = f"127.0.0.1:{probe.getsockname()[1]}"
    old = start_plugin(short_socket_dir, "--metrics-address", metrics)
    new: subprocess.Popen[str] | None = None
    try:
        new = _latch_then_start_a_successor(short_socket_dir, kubelet, node, 2, old, metrics)
        # Registered next to the old one, and its first snapshot already had the old one's latched fault.
        assert kubelet.health(node.uuids[2]) == "Unhealthy" and kubelet.capacity() == (8, 7)
        saved = (state / "state.json").stat().st_ino
        # Still the old one's: the lock, the health API (it answers) and the state file.
        assert _lock_holder_pid(short_socket_dir) == old.pid
        assert sorted(list_devices(health_sock)) == sorted(node.uuids)
        assert new.poll() is None
        rc, old_out = stop(old)
        assert rc == 0, old_out
        # The old one removed its health socket as it stopped; the new one serves it once it holds the lock.
        assert kubelet.wait_for(lambda: health_sock.exists() and _lock_holder_pid(short_socket_dir) == new.pid, 15)
        assert sorted(list_devices(health_sock)) == sorted(node.uuids)
        view = kubelet.view()
        assert view is not None and view.connected and len(kubelet.registrations) == 2  # no re-registration
        assert kubelet.capacity() == (8, 7)
        # The old one is gone, so what answers on the port is the successor: registered, hence ready.
        assert kubelet.wait_for(lambda: _readyz(metrics) == 200, 10)
        # It writes the state file now: a new fault, then a restart without it, keeps both latches.
        node.set(5, xid_events=[79])
        assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 6), 10)
        assert kubelet.wait_for(lambda: (state / "state.json").stat().st_ino != saved, 10)
        rc, new_out = stop(new)
        assert rc == 0, new_out
        assert "taking the state dir over when it exits" in new_out and "took the state dir" in new_out
        assert "serving them after the hand-over" in new_out and "continuing without" not in new_out
        assert "Traceback" not in new_out
        node.set(2, xid_events=None)
        node.set(5, xid_events=None)
        new = start_plugin(short_socket_dir, "--metrics-address", "off")
        assert kubelet.wait_for(lambda: len(kubelet.registrations) == 3 and kubelet.capacity() == (8, 6), 30)
    finally:
        for proc in (old, new):
            if proc is not None and proc.poll() is None:
                stop(proc)


def test_a_successor_stopped_before_the_handover_leaves_the_state_dir_to_its_holder(
        short_socket_dir: Path, kubelet: KubeletStandin) -> None:
    node = NodeFile(short_socket_dir / "node.json")
    state = short_socket_dir / "state"
    old = start_plugin(short_socket_dir, "--metrics-address", "off")
    try:
        new = _latch_then_start_a_successor(short_socket_dir, kubelet, node, 3, old)
        # Taken once the successor serves, a second after the fault: the holder wrote the fault long before.
        before = (state / "state.json").stat()
        rc, out = stop(new)
        assert rc == 0 and "Traceback" not in out, out
        # Not a byte of the state dir is the successor's: the file, the lock and the holder's health API.
        after = (state / "state.json").stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
        assert _lock_holder_pid(short_socket_dir) == old.pid
        assert sorted(list_devices(state / "health.sock")) == sorted(node.uuids)
        assert old.poll() is None
    finally:
        rc, out = stop(old)
        assert rc == 0, out
