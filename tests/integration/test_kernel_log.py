"""The kernel log as a source (``--kernel-log``): the real reader thread over a FIFO or a file in the kmsg format,
feeding the real health engine over a simulated node and a real state dir. Each test waits for the reader to have
handed a record on (``wait_read``), never for a time."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plugin.devices.kernellog import CURSOR_FILE, MAX_BATCH, KernelLog
from plugin.devices.model import EventKind, EventOrigin, GpuEvent
from plugin.devices.simulated import SimulatedBackend
from plugin.health.config import HealthConfig
from plugin.health.monitor import SAME_EVENT_WINDOW_S, Monitor
from plugin.health.node_state import NodeState
from plugin.health.reasons import Source, State
from plugin.health.store import StateStore
from tests.conformance.skips import skip_or_fail

ROOT = Path(__file__).resolve().parents[2]
NOW = 1_767_225_600.0
UPTIME = 3_600.0  # the node booted an hour before NOW
BOOT = "0b1e0000-0000-4000-8000-000000000001"
PCI = ("0000:18:00", "0000:28:00")


def uuid(i: int) -> str:
    return f"GPU-5a1e0000-0000-4000-8000-{i:012d}"


def rec(seq: int, message: str, at_s: float = UPTIME - 60) -> str:
    """One record as /dev/kmsg hands it out: priority, sequence, microseconds since boot, flags; message."""
    return f"4,{seq},{int(at_s * 1e6)},-;{message}\n"


def xid(seq: int, code: int, gpu: int = 0, at_s: float = UPTIME - 60) -> str:
    return rec(seq, f"NVRM: Xid (PCI:{PCI[gpu]}): {code}, pid=4242, name=train, details", at_s)


class Node:
    """Two simulated GPUs at known PCI addresses, the engine over them, and a kernel log reader on ``log_path``.
    ``restart()`` is a plugin restart (same state dir, same boot unless told)."""

    def __init__(self, tmp: Path, fifo: bool = True, log_path: Path | None = None) -> None:
        self.tmp = tmp
        self.node_file = tmp / "node.json"
        self.node_file.write_text(json.dumps({"gpus": [
            {"uuid": uuid(i), "index": i, "numa_node": 0, "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559,
             "nvlink_peers": [], "pcie_switch": None, "pci_bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0",
             "signals": {}} for i in range(2)]}))
        self.state_dir = tmp / "state"
        self.state_dir.mkdir()
        self.log_path = log_path or tmp / "kmsg"
        if fifo and log_path is None:
            os.mkfifo(self.log_path)
        self.batches: list[list[GpuEvent]] = []
        self.reader: KernelLog | None = None
        self.writer: int | None = None
        self.boot = BOOT
        self.start()

    def start(self) -> None:
        self.backend = SimulatedBackend(self.node_file, clock=lambda: NOW)
        self.state = NodeState()
        self.monitor = Monitor(self.backend, self.state, HealthConfig(), 5.0, threading.Event(),
                               StateStore(self.state_dir), clock=lambda: NOW, boot_id=self.boot)
        self.monitor.poll_once()
        self.reader = KernelLog(self.log_path, self.state_dir, self.boot, self.monitor.gpu_for_pci, self.deliver,
                                clock=lambda: NOW, uptime=lambda: UPTIME, retry_s=0.05, file_poll_s=0.05,
                                unknown_gpu=self.monitor.note_unknown_gpu)
        self.reader.start()

    def deliver(self, events: list[GpuEvent]) -> None:
        self.batches.append(list(events))
        self.monitor.handle_events(events)

    def write(self, text: str) -> None:
        if self.log_path.is_fifo():
            if self.writer is None:
                self.writer = os.open(self.log_path, os.O_WRONLY)  # waits for the reader's open: it is running
            os.write(self.writer, text.encode())
        else:
            with self.log_path.open("a") as f:
                f.write(text)

    def hang_up(self) -> None:
        if self.writer is not None:
            os.close(self.writer)
            self.writer = None

    def stop(self) -> None:
        self.hang_up()
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def restart(self, boot: str | None = None) -> None:
        self.stop()
        if boot is not None:
            self.boot = boot
        self.start()

    @property
    def kl(self) -> KernelLog:
        assert self.reader is not None
        return self.reader

    def device(self, i: int) -> Any:
        d = self.state.snapshot().get(uuid(i))
        assert d is not None
        return d

    def codes(self, i: int) -> list[str]:
        return [r.code for r in self.device(i).reasons]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    n.stop()


def test_an_xid_in_the_kernel_log_is_the_gpus_reason_with_its_source(node: Node) -> None:
    node.write(rec(0, "Linux version 6.8.0") + xid(1, 79, gpu=1) + rec(2, "usb 1-1: new device"))
    assert node.kl.wait_read(2)
    d = node.device(1)
    assert d.state == State.UNHEALTHY
    [r] = d.reasons
    assert (r.code, r.source, r.action) == ("xid-79", Source.KERNEL_LOG, "reboot-node")
    # The record's own time (a minute before now), not the time it was read: the XID was logged before we looked.
    assert r.first_seen == pytest.approx(NOW - 60)
    assert node.device(0).state == State.HEALTHY
    assert node.monitor.xids_seen == {(uuid(1), 79): 1}


def test_fallen_off_the_bus_is_xid_79_and_an_init_failure_for_no_gpu_is_counted_and_said_once(
        node: Node, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "plugin.devices.kernellog")
    node.write(rec(0, "NVRM: GPU 0000:18:00.0: GPU has fallen off the bus.")
               + rec(1, "NVRM: GPU 0000:5e:00.0: RmInitAdapter failed! (0x26:0x56:1474)")
               + rec(2, "NVRM: GPU 0000:5e:00.0: RmInitAdapter failed! (0x26:0x56:1474)")
               + rec(3, "nvidia-nvswitch3: SXid (PCI:0000:c6:00.0): 24007, Fatal, Link 32 sourcetrack timeout"))
    assert node.kl.wait_read(3)
    assert node.codes(0) == ["xid-79"] and node.codes(1) == []
    assert node.kl.stats.driver_lines == {"xid": 0, "fell-off-bus": 1, "init-failed": 2, "sxid": 1}
    assert node.kl.stats.unmatched == {"xid": 0, "fell-off-bus": 0, "init-failed": 2, "sxid": 1}
    said = said_by_reader(caplog)
    assert len(said) == 2 and "init-failed at PCI 0000:5e:00.0" in said[0] and "sxid at PCI 0000:c6:00.0" in said[1]


def test_a_gpu_the_kernel_log_names_and_nvml_does_not_list_is_the_nodes_gpu_missing(node: Node) -> None:
    node.write(rec(0, "NVRM: GPU 0000:5e:00.0: RmInitAdapter failed! (0x26:0x56:1474)")
               + rec(1, "nvidia-nvswitch3: SXid (PCI:0000:c6:00.0): 24007, Fatal, Link 32 sourcetrack timeout"))
    assert node.kl.wait_read(1)
    node.monitor.poll_once()
    node.monitor.poll_once()  # two polls, as for the bus
    [r] = node.state.snapshot().node_reasons
    assert r.code == "gpu-missing"
    assert r.message == "the kernel log names 0000:5e:00.0 (init-failed), which NVML does not list"  # no SXid
    assert [d.state for d in node.state.snapshot().devices] == [State.HEALTHY, State.HEALTHY]


def test_an_init_failure_of_a_gpu_nvml_lists_makes_it_unavailable(node: Node) -> None:
    node.write(rec(0, "NVRM: GPU 0000:28:00.0: RmInitAdapter failed! (0x22:0xffff:667)"))
    assert node.kl.wait_read(0)
    assert node.codes(1) == ["gpu-unavailable"] and node.device(1).reasons[0].source == Source.KERNEL_LOG


def test_after_a_restart_the_same_boots_records_are_read_once(node: Node) -> None:
    node.write(xid(0, 13) + xid(1, 13) + rec(2, "something else"))
    assert node.kl.wait_read(2)
    assert json.loads((node.state_dir / CURSOR_FILE).read_text()) == {"boot_id": BOOT, "seq": 2}
    node.restart()
    # The ring still holds records 0-2 (a new reader of /dev/kmsg starts at its oldest): only 3 and 4 are new.
    node.write(xid(0, 13) + xid(1, 13) + rec(2, "something else") + xid(3, 13) + xid(4, 31, gpu=1))
    assert node.kl.wait_read(4)
    assert node.kl.stats.records == 2 and node.kl.stats.lost == 0
    assert node.monitor.xids_seen == {(uuid(0), 13): 1, (uuid(1), 31): 1}


def said_by_reader(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The kernel log reader's own lines: the monitor's transitions reach caplog too wherever an earlier test (or
    ``--log-level``) put the root logger at INFO, as the kernel-log-relay command's basicConfig does in process."""
    return [r.getMessage() for r in caplog.records if r.name == "plugin.devices.kernellog"]


def test_after_a_reboot_the_new_boots_whole_ring_is_read(node: Node) -> None:
    node.write(xid(0, 13) + xid(1, 13))
    assert node.kl.wait_read(1)
    node.restart(boot="0b1e0000-0000-4000-8000-000000000002")
    # Seconds after boot, before the plugin was up: NVSentinel #1532's XIDs 79 and 154.
    node.write(rec(0, "Linux version 6.8.0", at_s=0.0) + xid(1, 79, at_s=17.0) + xid(2, 154, at_s=17.1))
    assert node.kl.wait_read(2)
    assert node.codes(0) == ["xid-79"]
    assert node.device(0).reasons[0].first_seen == pytest.approx(NOW - UPTIME + 17.0)
    assert node.kl.stats.lost == 0


def test_a_ring_that_wrapped_past_the_cursor_is_said_once_and_reading_goes_on(
        node: Node, caplog: pytest.LogCaptureFixture) -> None:
    node.write(rec(0, "a") + rec(1, "b"))
    assert node.kl.wait_read(1)
    node.restart()
    caplog.set_level(logging.WARNING, "plugin.devices.kernellog")
    node.write(rec(500, "the ring holds only 500 on") + xid(501, 48) + rec(502, "c"))
    assert node.kl.wait_read(502)
    assert node.kl.stats.lost == 1
    [said] = said_by_reader(caplog)
    assert "records 2-499 were overwritten before they were read" in said
    assert node.codes(0) == ["xid-48"]


def test_the_same_xid_from_nvml_and_the_kernel_log_counts_once(node: Node) -> None:
    # xid-13 is an application XID: its repeats are counted, so a double count would be seen at once.
    nvml = GpuEvent(uuid(0), EventKind.XID, 13, NOW - 1.0)
    node.monitor.handle_events([nvml])
    node.write(xid(0, 13, at_s=UPTIME - 1.0 + 0.3))
    assert node.kl.wait_read(0)
    assert node.monitor.xids_seen == {(uuid(0), 13): 1}
    # The kernel log first this time, NVML a moment later; then a second XID 13 from each: two in all, not four.
    node.write(xid(1, 13, at_s=UPTIME - 0.5))
    assert node.kl.wait_read(1)
    node.monitor.handle_events([GpuEvent(uuid(0), EventKind.XID, 13, NOW - 0.2)])
    assert node.monitor.xids_seen == {(uuid(0), 13): 2}
    # Two NVML events with no kernel line are two; one further apart than the window is its own.
    node.monitor.handle_events([GpuEvent(uuid(0), EventKind.XID, 13, NOW), GpuEvent(uuid(0), EventKind.XID, 13, NOW)])
    node.write(xid(2, 13, at_s=UPTIME - 60 * SAME_EVENT_WINDOW_S))
    assert node.kl.wait_read(2)
    assert node.monitor.xids_seen == {(uuid(0), 13): 5}


def test_a_flood_of_one_xid_is_one_transition_with_a_count_and_a_few_hand_overs(tmp_path: Path) -> None:
    n = Node(tmp_path, fifo=False)
    try:
        lines = 200_000
        line = xid(0, 95).split(";", 1)[1]
        with n.log_path.open("w") as f:
            f.writelines(f"3,{s},{int((UPTIME - 30) * 1e6) + s},-;{line}" for s in range(lines))
        assert n.kl.wait_read(lines - 1, timeout=120)
        assert n.monitor.xids_seen == {(uuid(0), 95): lines}
        # Every batch folded into one event with its count; no batch was larger than the bound.
        assert len(n.batches) <= lines // MAX_BATCH + 2
        assert all(len(b) == 1 and b[0].origin == EventOrigin.KERNEL_LOG for b in n.batches)
        assert sum(b[0].repeats for b in n.batches) == lines
        # After the GPUs' first appearance (Absent -> Healthy), the flood's one transition.
        assert [(t.id, t.from_state, t.to_state) for t in n.state.history() if t.from_state != "Absent"] == \
            [(uuid(0), State.HEALTHY, State.UNHEALTHY)]
    finally:
        n.stop()


def test_malformed_and_cut_records_are_skipped_and_counted(node: Node) -> None:
    node.write("not a record\n" + xid(0, 79) + " DEVICE=+pci:0000:18:00.0\n" + "4,1,oops,-;bad time\n"
               + xid(2, 79, gpu=1) + "4,3,77")
    assert node.kl.wait_read(2)
    node.hang_up()  # the writer leaves with record 3 half-written
    assert node.kl.wait(lambda k: k.stats.malformed == 3, timeout=10)
    assert node.codes(0) == ["xid-79"] and node.codes(1) == ["xid-79"]
    assert node.kl.stats.records == 2
    # A writer coming back is read on from the cursor: the FIFO is opened again.
    node.write(xid(0, 79) + xid(4, 13))
    assert node.kl.wait_read(4)
    assert node.monitor.xids_seen == {(uuid(0), 79): 1, (uuid(1), 79): 1, (uuid(0), 13): 1}


def test_an_unreadable_kernel_log_is_one_line_and_a_metric_and_is_read_once_it_can_be(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "plugin.devices.kernellog")
    n = Node(tmp_path, fifo=False)  # no file there yet
    try:
        assert n.kl.wait(lambda k: not k.stats.readable and k._unreadable_said, timeout=10)
        # The engine is untouched: the GPUs were read and stay Healthy.
        assert n.device(0).state == State.HEALTHY and n.device(1).state == State.HEALTHY
        n.log_path.write_text(xid(0, 79))
        assert n.kl.wait_read(0)
        assert n.kl.stats.readable and n.codes(0) == ["xid-79"]
        said = said_by_reader(caplog)
        assert len([m for m in said if "cannot be read" in m]) == 1
        assert said[-1].endswith(": reading")
    finally:
        n.stop()


def test_an_idle_kernel_log_writes_no_cursor(node: Node) -> None:
    node.write(xid(0, 79))
    assert node.kl.wait_read(0)
    cursor = node.state_dir / CURSOR_FILE
    before = cursor.stat().st_mtime_ns
    node.write(xid(0, 79))  # read before: nothing new, nothing written
    node.write(rec(1, "new"))
    assert node.kl.wait_read(1)
    after = cursor.stat().st_mtime_ns
    node.write(rec(1, "new"))
    node.hang_up()
    assert node.kl.wait(lambda k: k.stats.records == 2, timeout=10)
    assert cursor.stat().st_mtime_ns == after and after >= before


# The relay: a process of its own (the privileged container's), copying the kernel log to a FIFO the reader opens.

def start_relay(source: Path, fifo: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "plugin", "kernel-log-relay", "--from", str(source), "--to",
                             str(fifo)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_through_the_relay_a_restarted_reader_gets_the_ring_again_and_reads_only_what_is_new(tmp_path: Path) -> None:
    source = tmp_path / "ring"  # stands for /dev/kmsg: the relay reads it from its start for each reader
    source.write_text(rec(0, "Linux version 6.8.0") + xid(1, 79, gpu=1))
    n = Node(tmp_path, fifo=False)  # its log path is the relay's FIFO, made by the relay
    relay = start_relay(source, n.log_path)
    try:
        assert n.kl.wait_read(1, timeout=30)
        assert n.codes(1) == ["xid-79"]
        n.restart()  # the plugin restarts: the relay sees its reader go and serves the next one from the start
        with source.open("a") as f:
            f.write(xid(2, 13) + rec(3, "more"))
        assert n.kl.wait_read(3, timeout=30)
        assert n.monitor.xids_seen == {(uuid(0), 13): 1}  # record 1 was not read twice
        assert n.kl.stats.records == 2 and n.kl.stats.lost == 0 and n.kl.stats.malformed == 0
        assert n.log_path.is_fifo() and (n.log_path.stat().st_mode & 0o777) == 0o600
    finally:
        n.stop()
        relay.send_signal(signal.SIGTERM)
        out, _ = relay.communicate(timeout=15)
    assert relay.returncode == 0, out
    assert "Traceback" not in out


def test_the_relay_refuses_a_target_that_is_no_fifo(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    r = subprocess.run([sys.executable, "-m", "plugin", "kernel-log-relay", "--to", str(tmp_path / "file")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"gpu-health-plugin kernel-log-relay: --to {tmp_path / 'file'}: "
                                             f"{tmp_path / 'file'} exists and is not a FIFO"]


# The real kernel log of this machine: read only, nothing written to it.

def _ring_now() -> list[bytes]:
    """Every record /dev/kmsg holds now, as a fresh reader gets them (one per read)."""
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    out: list[bytes] = []
    try:
        while True:
            try:
                out.append(os.read(fd, 1 << 16))
            except BlockingIOError:
                return out
            except BrokenPipeError:
                continue
    finally:
        os.close(fd)


def test_the_real_dev_kmsg_is_read_record_by_record_with_nothing_malformed(tmp_path: Path) -> None:
    try:
        ring = _ring_now()
    except OSError as exc:
        skip_or_fail(f"/dev/kmsg cannot be read here ({exc.strerror}): root and a kernel log are this test's peer")
    last = int(ring[-1].split(b",", 2)[1])
    n = Node(tmp_path, log_path=Path("/dev/kmsg"))
    try:
        assert n.kl.wait_read(last, timeout=30)
        # Each record came whole from its own read (continuation lines with it), none refused as malformed; a ring
        # that dropped this boot's first records says so once.
        assert n.kl.stats.malformed == 0
        assert n.kl.stats.records >= len(ring) - 1
        assert n.kl.stats.lost == (0 if ring[0].split(b",", 2)[1] == b"0" else 1)
        assert json.loads((n.state_dir / CURSOR_FILE).read_text())["seq"] >= last
    finally:
        n.stop()
