"""The plugin as a real process on ``--backend nvml``, its pynvml loading the NVML stand-in (tests/nvml_standin)
instead of a driver: every GPU model the stand-in knows comes up Healthy at the kubelet, a link fault and an XID
reach it, and an unchanged node sends the kubelet nothing.

Before the NVML backend was fixed (d4a9051), this process crashed at its first poll on h100-sxm and gb200 (the fabric
structure passed by value) and reported every GPU Unhealthy ``nvlink-down`` on the other models (inactive link slots
read as links that went down); the first test here is that defect, end to end.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from plugin.devtools.standin import KubeletStandin
from tests.fakes import nvml_standin as standin
from tests.fakes.nvml_standin import StandinNode

pytest.importorskip("pynvml")

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.2
# Polls an unchanged node must go through without a ListAndWatch update. Counted from the plugin's own poll counter,
# not from a clock, so a slow machine only makes the test longer.
IDLE_POLLS = 5

# profile -> (the product name NVML reports, checks inspect must show: the whole string, or its prefix for "off: ").
PROFILES: dict[str, tuple[str, dict[str, str]]] = {
    "a100-sxm": ("NVIDIA A100-SXM4-80GB", {"nvlink": "on", "fabric": "off: ", "row_remap": "on"}),
    "h100-sxm": ("NVIDIA H100 80GB HBM3", {"nvlink": "on", "fabric": "on", "row_remap": "on"}),
    # 18 link slots, none ever trained (no bridge): the check is off, and no link reads as down.
    "h100-pcie": ("NVIDIA H100 PCIe", {"nvlink": "off: ", "fabric": "off: ", "row_remap": "on"}),
    "l40s": ("NVIDIA L40S", {"nvlink": "off: ", "fabric": "off: ", "row_remap": "on"}),
    "t4": ("Tesla T4", {"nvlink": "off: ", "fabric": "off: ", "row_remap": "off: ", "retired_pages": "on"}),
    "gb200": ("NVIDIA GB200", {"nvlink": "on", "fabric": "on", "row_remap": "on"}),
}


@dataclass
class Plugin:
    proc: subprocess.Popen[bytes]
    log: Path
    state_dir: Path
    metrics: str
    env: dict[str, str]
    # Every ListAndWatch snapshot the kubelet stand-in received, in order: id -> health.
    snapshots: list[dict[str, str]] = field(default_factory=list)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def polls(self) -> int:
        """The plugin's own count of completed polls (its /metrics summary)."""
        n = self.sample("gpu_health_poll_duration_seconds_count")
        if n is None:
            raise AssertionError("no gpu_health_poll_duration_seconds_count in /metrics")
        return int(n)

    def sample(self, series: str) -> float | None:
        """One sample of the plugin's /metrics, named as exposed with its labels (``name{a="b"}``)."""
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.rsplit(" ", 1)[0] == series:
                return float(line.split()[-1])
        return None

    def cli(self, *args: str) -> Any:
        """A ``gpu-health-plugin`` subcommand with ``-o json``, under the plugin's environment (so ``inspect``'s own
        pynvml loads the stand-in too), parsed."""
        r = subprocess.run([sys.executable, "-m", "plugin", *args, "--state-dir", str(self.state_dir), "-o", "json"],
                           cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "VIOLATION" not in r.stderr and "Traceback" not in r.stderr, r.stderr
        return json.loads(r.stdout)


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


@pytest.fixture
def lib_dir() -> Path:
    return standin.library_dir_or_skip()


def start(root: Path, node: StandinNode, kubelet: KubeletStandin, lib_dir: Path, *extra: str) -> Plugin:
    env = standin.env_for_subprocess(node.path, lib_dir)
    metrics, log_path = free_port(), root / "plugin.log"
    snapshots: list[dict[str, str]] = []

    def record() -> None:
        view = kubelet.view()
        if view is not None and view.connected:
            snapshots.append({k: h for k, (h, _) in view.devices.items()})

    kubelet.on_update = record
    # The log goes to a file, not a pipe: a pipe nobody reads would stall the plugin once it filled.
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "plugin", "run", "--backend", "nvml", "--device-plugin-dir", str(root / "dp"),
             "--state-dir", str(root / "state"), "--poll-interval", str(POLL_S), "--metrics-address", metrics,
             *extra],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return Plugin(proc, log_path, root / "state", metrics, env, snapshots)


def stop(plugin: Plugin) -> str:
    """SIGTERM, then the whole log; a clean exit and a log free of tracebacks and stand-in violations asserted."""
    if plugin.proc.poll() is None:
        plugin.proc.send_signal(signal.SIGTERM)
        try:
            plugin.proc.wait(15)
        except subprocess.TimeoutExpired:
            plugin.proc.kill()
            plugin.proc.wait(5)
    out = plugin.output()
    assert plugin.proc.returncode == 0, out
    assert "Traceback" not in out, out
    # The stand-in prints "nvml-standin: VIOLATION: ..." where a real driver would have undefined behaviour.
    assert "VIOLATION" not in out, out
    return out


def health(kubelet: KubeletStandin) -> dict[str, str]:
    view = kubelet.view()
    return {} if view is None else {k: h for k, (h, _) in view.devices.items()}


def updates(kubelet: KubeletStandin) -> int:
    view = kubelet.view()
    return 0 if view is None else view.updates


def wait_polls(plugin: Plugin, n: int) -> None:
    """Until the plugin has completed ``n`` more polls, asking its /metrics once a poll interval (a bound of 50
    intervals a poll only ends a plugin that stopped polling)."""
    target = plugin.polls() + n
    for _ in range(50 * n):
        if plugin.polls() >= target:
            return
        assert plugin.proc.poll() is None, plugin.output()
        time.sleep(POLL_S)
    raise AssertionError(f"the plugin did not complete {n} polls in {50 * n} poll intervals")


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_profile_comes_up_healthy_and_stays_quiet(profile: str, short_socket_dir: Path,
                                                         kubelet: KubeletStandin, lib_dir: Path) -> None:
    name, checks = PROFILES[profile]
    node = StandinNode.of_profile(short_socket_dir / "node.json", profile)
    plugin = start(short_socket_dir, node, kubelet, lib_dir)
    try:
        assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8) or plugin.proc.poll() is not None, 30), \
            f"the kubelet saw {health(kubelet)}\n{plugin.output()}"
        assert plugin.proc.poll() is None, plugin.output()
        assert health(kubelet) == {u: "Healthy" for u in node.uuids}

        # Idle: an unchanged node goes through several polls and the kubelet hears nothing more.
        seen = updates(kubelet)
        wait_polls(plugin, IDLE_POLLS)
        assert updates(kubelet) == seen, f"updates on an unchanged node: {plugin.snapshots[seen - 1:]}"
        # Nothing was ever reported Unhealthy (the old defect was a flip to nvlink-down at the first poll).
        assert all(h == "Healthy" for snap in plugin.snapshots for h in snap.values()), plugin.snapshots

        status = plugin.cli("status")
        assert {d["id"]: d["state"] for d in status["devices"]} == {u: "Healthy" for u in node.uuids}

        report = plugin.cli("inspect")
        gpus = report["gpus"]
        assert [g["uuid"] for g in gpus] == node.uuids
        for g in gpus:
            assert g["name"] == name
            for signal_name, want in checks.items():
                got = g["checks"][signal_name]
                assert got == want or (want.endswith(": ") and got.startswith(want)), (g["index"], signal_name, got)
            assert not [s for s, how in g["checks"].items() if not how.startswith(("on", "off: "))], g["checks"]
    finally:
        stop(plugin)


def test_a_link_fault_and_an_xid_reach_the_kubelet(short_socket_dir: Path, kubelet: KubeletStandin,
                                                  lib_dir: Path) -> None:
    node = StandinNode.of_profile(short_socket_dir / "node.json", "h100-sxm")
    plugin = start(short_socket_dir, node, kubelet, lib_dir)
    uuids = node.uuids
    try:
        assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8) or plugin.proc.poll() is not None, 30), \
            plugin.output()

        # A polled signal: link 3 of GPU 2 (one of its NVSwitch links, seen active at start) goes down.
        node.set(2, nvlink_down=[3])
        assert kubelet.wait_for(lambda: kubelet.health(uuids[2]) == "Unhealthy", 30), plugin.output()
        assert health(kubelet) == {u: "Unhealthy" if i == 2 else "Healthy" for i, u in enumerate(uuids)}

        # An event: XID 79 on GPU 5. The stand-in raises XIDs only through nvmlEventSetWait_v2 (no poll reads them),
        # so this reaching the kubelet is the event thread's work.
        node.append_xid(5, 79)
        assert kubelet.wait_for(lambda: kubelet.health(uuids[5]) == "Unhealthy", 30), plugin.output()
        assert kubelet.capacity() == (8, 6)

        reasons = {d["id"]: [r["code"] for r in d["reasons"]] for d in plugin.cli("status")["devices"]}
        assert "nvlink-down" in reasons[uuids[2]], reasons
        assert "xid-79" in reasons[uuids[5]], reasons
        assert all(not reasons[u] for i, u in enumerate(uuids) if i not in (2, 5)), reasons
    finally:
        out = stop(plugin)
    assert "nvlink" in out.lower() and "79" in out  # the transitions were logged



def test_the_kernel_log_brings_what_nvml_missed_and_counts_what_both_saw_once(
        short_socket_dir: Path, kubelet: KubeletStandin, lib_dir: Path) -> None:
    node = StandinNode.of_profile(short_socket_dir / "node.json", "h100-sxm")
    uuids = node.uuids
    kmsg = short_socket_dir / "kmsg"

    def line(seq: int, text: str) -> str:
        # The record's time on the clock the kernel stamps with (the plugin reads the same one).
        return f"4,{seq},{int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)},-;{text}\n"

    def xid(seq: int, gpu: int, code: int) -> str:
        bus = node.gpu(gpu)["pci_bus_id"].split(":", 1)[1].rsplit(".", 1)[0].lower()
        return line(seq, f"NVRM: Xid (PCI:0000:{bus}): {code}, pid=77, name=train, Graphics Exception")

    # Logged before the plugin was up: NVML's event set can never report it.
    kmsg.write_text(line(0, "Linux version 6.8.0") + xid(1, 2, 48))
    plugin = start(short_socket_dir, node, kubelet, lib_dir, "--kernel-log", str(kmsg))
    try:
        assert kubelet.wait_for(lambda: kubelet.health(uuids[2]) == "Unhealthy" or plugin.proc.poll() is not None,
                                30), plugin.output()
        assert health(kubelet) == {u: "Unhealthy" if i == 2 else "Healthy" for i, u in enumerate(uuids)}

        # XID 13 on GPU 5, which the driver both logs and signals: one XID, not two. Then one more through NVML
        # alone on GPU 6, after it in the stand-in's queue, so when that one is counted GPU 5's NVML event is too.
        node.append_xid(5, 13)
        with kmsg.open("a") as f:
            f.write(xid(2, 5, 13))
        node.append_xid(6, 13)
        def series(uuid: str, code: int) -> str:
            return f'gpu_health_xid_events_total{{device="{uuid}",xid="{code}"}}'

        assert kubelet.wait_for(lambda: plugin.sample(series(uuids[6], 13)) == 1.0
                                and plugin.sample('gpu_health_kernel_log_driver_lines_total{kind="xid"}') == 2.0,
                                30), plugin.output()
        assert plugin.sample(series(uuids[5], 13)) == 1.0
        assert plugin.sample(series(uuids[2], 48)) == 1.0
        assert plugin.sample("gpu_health_kernel_log_readable") == 1.0
        reasons = {d["id"]: [(r["code"], r["source"]) for r in d["reasons"]] for d in plugin.cli("status")["devices"]}
        assert reasons[uuids[2]] == [("xid-48", "kernel-log")], reasons
    finally:
        stop(plugin)
