"""The recovery check (plugin/health/recovery.py, docs/recovery-check.md) with real processes: what it runs, what it
reports, one at a time, never on a busy GPU, and nothing of a check outliving its timeout or the plugin's stop.

The checks are small Python scripts run by this interpreter. Results are awaited on the ``wake`` the checker calls;
where only another process can tell (a pid it wrote, whether that pid still lives) the test polls with a deadline.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from plugin.devices.model import Gpu, MigDevice
from plugin.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice
from plugin.dra.holders import PreparedClaimHolders
from plugin.health.node_state import DeviceStatus, NodeState, Snapshot
from plugin.health.reasons import KubeletHealth, State
from plugin.health.recovery import (
    DETAIL_CHARS,
    CheckResult,
    CommandRecoveryChecker,
    RecoveryChecker,
    command_for,
    one_line,
    validate_template,
)
from plugin.kubelet.sharing import build_resources
from plugin.outlets.correlation import Holding, PodResourcesError
from plugin.outlets.holders import PodResourcesHolders, pods_holding
from plugin.sharing.config import SharingConfig, parse_sharing

WAIT = 30.0  # generous: two shared cores start Python slowly


def gpu(i: int) -> Gpu:
    return Gpu(uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000", index=i, pci_bus_id=f"00000000:{0x10 + i:02X}:00.0")


def script(tmp_path: Path, name: str, body: str) -> str:
    """A Python script file; the returned text is the start of a template that runs it."""
    path = tmp_path / name
    path.write_text(body)
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(path))}"


class Harness:
    """A checker with its wake counted and its stop at hand; the fixture stops it at the end of each test."""

    def __init__(self, template: str, timeout_s: float = WAIT, busy: Callable[[Gpu], str] = lambda g: "",
                 retry_s: float = 10.0, kill_grace_s: float = 5.0, lock_file: Path | None = None) -> None:
        self.stop = threading.Event()
        self.woke = threading.Semaphore(0)
        self.wakes = 0
        self.checker = CommandRecoveryChecker(template, timeout_s, busy, self._wake, self.stop, retry_s=retry_s,
                                              kill_grace_s=kill_grace_s, lock_file=lock_file)
        self.got: list[CheckResult] = []

    def _wake(self) -> None:
        self.wakes += 1
        self.woke.release()

    def result(self, uuid: str) -> CheckResult:
        """The result for ``uuid``, waiting on the wake for it."""
        deadline = time.monotonic() + WAIT
        while True:
            self.got += self.checker.results()
            found = [r for r in self.got if r.device_id == uuid]
            if found:
                return found[0]
            assert self.woke.acquire(timeout=max(0.0, deadline - time.monotonic())), f"no result for {uuid}"


@pytest.fixture
def harnesses() -> Iterator[list[Harness]]:
    made: list[Harness] = []
    yield made
    for h in made:
        h.stop.set()
        h.checker.join(5.0)


@pytest.fixture
def make(harnesses: list[Harness]) -> Callable[..., Harness]:
    def build(template: str, **kw: Any) -> Harness:
        h = Harness(template, **kw)
        harnesses.append(h)
        return h
    return build


def eventually(what: Callable[[], bool], why: str, timeout: float = WAIT) -> None:
    """Poll with a deadline: only for what no event reports (another process's files, its death)."""
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """Running, not a zombie (a grandchild killed in a container whose init does not reap stays one)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_the_checker_is_a_recovery_checker(make: Callable[..., Harness]) -> None:
    checker: RecoveryChecker = make("true").checker  # mypy: the class satisfies the monitor's protocol
    assert checker.waiting(gpu(0).uuid) == "" and checker.results() == []


# What runs ----------------------------------------------------------------------------------------------------------

def test_placeholders_are_substituted_per_argument_never_through_a_shell(tmp_path: Path,
                                                                        make: Callable[..., Harness]) -> None:
    out = tmp_path / "argv.json"
    run = script(tmp_path, "argv.py", f"import json, sys\nopen({str(out)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    h = make(run + " -i {index} --uuid={uuid} {pci} '{uuid}; touch pwned' '$(id)' {{literal}}")
    g = gpu(3)
    h.checker.request(g)
    r = h.result(g.uuid)
    assert r.passed and r.detail.startswith("exit 0 in "), r
    assert json.loads(out.read_text()) == ["-i", "3", f"--uuid={g.uuid}", "00000000:13:00.0",
                                           f"{g.uuid}; touch pwned", "$(id)", "{literal}"]
    assert not (tmp_path / "pwned").exists()
    assert command_for("dcgmi diag -r 1 -i {index}", g) == ["dcgmi", "diag", "-r", "1", "-i", "3"]


def test_a_failing_check_reports_its_exit_and_the_end_of_its_output_on_one_line(tmp_path: Path,
                                                                               make: Callable[..., Harness]) -> None:
    body = ("import sys\n"
            "for i in range(5000):\n    print(f'line {i}: checking memory bandwidth', flush=True)\n"
            "print('Diagnostic   |   Result', file=sys.stderr)\nprint('Memory  |  Fail - XID 48', file=sys.stderr)\n"
            "sys.exit(3)\n")
    h = make(script(tmp_path, "fail.py", body))
    g = gpu(1)
    h.checker.request(g)
    r = h.result(g.uuid)
    assert not r.passed
    assert r.detail.startswith("exit 3: …"), r.detail
    # The verdict at the end (stderr too) is kept, whitespace squeezed; the message stays one bounded line.
    assert r.detail.endswith("line 4999: checking memory bandwidth Diagnostic | Result Memory | Fail - XID 48")
    assert "\n" not in r.detail and len(r.detail) == len("exit 3: ") + DETAIL_CHARS
    assert h.checker.failures == 1 and h.checker.runs == 1


def test_a_check_that_says_nothing(tmp_path: Path, make: Callable[..., Harness]) -> None:
    h = make(script(tmp_path, "quiet.py", "import sys\nsys.exit(1)\n"))
    h.checker.request(gpu(0))
    assert h.result(gpu(0).uuid).detail == "exit 1 (no output)"


def test_a_command_that_cannot_start_is_a_failed_check_and_the_worker_goes_on(tmp_path: Path,
                                                                             make: Callable[..., Harness]) -> None:
    h = make(str(tmp_path / "no-such-dcgmi") + " diag -r 1 -i {index}")
    h.checker.request(gpu(0))
    h.checker.request(gpu(1))
    for i in (0, 1):
        r = h.result(gpu(i).uuid)
        assert r == CheckResult(gpu(i).uuid, False, f"cannot run {tmp_path / 'no-such-dcgmi'}: No such file or "
                                                    "directory")


def test_a_timeout_kills_the_whole_group_even_what_ignores_sigterm(tmp_path: Path,
                                                                  make: Callable[..., Harness]) -> None:
    pids = tmp_path / "pids"
    body = ("import os, signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
            f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
            "print('stuck in the memory test', flush=True)\n"
            "time.sleep(600)\n")
    h = make(script(tmp_path, "hang.py", body), timeout_s=1.0, kill_grace_s=0.2)
    h.checker.request(gpu(2))
    eventually(pids.exists, "the check never started")
    eventually(lambda: h.checker.waiting(gpu(2).uuid) == "running", "not shown as running")
    r = h.result(gpu(2).uuid)
    assert r == CheckResult(gpu(2).uuid, False, "timed out after 1 s: stuck in the memory test")
    leader, grandchild = (int(p) for p in pids.read_text().split())
    assert not alive(leader)
    eventually(lambda: not alive(grandchild), "the check's own child outlived its timeout", timeout=5.0)
    assert h.checker.waiting(gpu(2).uuid) == ""


def test_helpers_left_behind_by_a_passing_check_are_killed_with_it(tmp_path: Path,
                                                                  make: Callable[..., Harness]) -> None:
    pid = tmp_path / "pid"
    body = ("import subprocess, sys\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],"
            " stdout=subprocess.DEVNULL)\n"
            f"open({str(pid)!r}, 'w').write(str(child.pid))\n")
    h = make(script(tmp_path, "leaves.py", body))
    h.checker.request(gpu(0))
    assert h.result(gpu(0).uuid).passed
    eventually(lambda: not alive(int(pid.read_text())), "a helper of the check outlived it", timeout=5.0)


# One at a time ------------------------------------------------------------------------------------------------------

def test_one_check_at_a_time_on_the_node(tmp_path: Path, make: Callable[..., Harness]) -> None:
    log = tmp_path / "log"
    marker = tmp_path / "running"
    body = ("import os, sys, time\n"
            f"log = open({str(log)!r}, 'a')\n"
            # O_EXCL: a second check starting while one runs finds the marker and says so.
            f"try:\n    fd = os.open({str(marker)!r}, os.O_CREAT | os.O_EXCL)\n"
            "except FileExistsError:\n    log.write(f'overlap {sys.argv[1]}\\n'); sys.exit(9)\n"
            "log.write(f'start {sys.argv[1]} {time.monotonic()}\\n'); log.flush()\n"
            "time.sleep(0.3)\n"
            f"os.unlink({str(marker)!r})\n"
            "log.write(f'end {sys.argv[1]} {time.monotonic()}\\n')\n")
    h = make(script(tmp_path, "slow.py", body) + " {index}")
    gpus = [gpu(i) for i in range(4)]
    for g in gpus:
        h.checker.request(g)
        h.checker.request(g)  # asked again each poll: still one check
    assert all(h.result(g.uuid).passed for g in gpus)
    lines = [line.split() for line in log.read_text().splitlines()]
    assert not [x for x in lines if x[0] == "overlap"], lines
    spans: dict[str, dict[str, float]] = {}
    for kind, index, at in lines:
        spans.setdefault(index, {})[kind] = float(at)
    assert sorted(spans) == ["0", "1", "2", "3"], "one run per GPU, however often it was asked"
    ordered = sorted(spans.values(), key=lambda s: s["start"])
    assert all(a["end"] <= b["start"] for a, b in itertools.pairwise(ordered)), ordered
    assert h.checker.runs == 4 and h.wakes == 4


def test_the_node_lock_keeps_two_checkers_to_one_check(tmp_path: Path, make: Callable[..., Harness]) -> None:
    """Two plugin instances (a handover) share the state dir and its lock: the second waits for the first."""
    gate = tmp_path / "gate"
    started = tmp_path / "started"
    body = ("import os, sys, time\n"
            f"open({str(started)!r} + sys.argv[1], 'w').close()\n"
            f"while not os.path.exists({str(gate)!r}):\n    time.sleep(0.02)\n")
    run = script(tmp_path, "gated.py", body) + " {index}"
    lock = tmp_path / "recovery-check.lock"
    first, second = make(run, lock_file=lock), make(run, lock_file=lock, retry_s=0.05)
    first.checker.request(gpu(0))
    eventually(lambda: Path(f"{started}0").exists(), "the first check never started")
    second.checker.request(gpu(1))
    eventually(lambda: "another gpu-health-plugin" in second.checker.waiting(gpu(1).uuid), "the second did not wait")
    assert not Path(f"{started}1").exists()
    gate.touch()
    assert first.result(gpu(0).uuid).passed and second.result(gpu(1).uuid).passed


# Never on a busy GPU ----------------------------------------------------------------------------------------------

def test_a_busy_gpu_waits_until_it_is_free(tmp_path: Path, make: Callable[..., Harness]) -> None:
    ran = tmp_path / "ran"
    held = {gpu(0).uuid: "held by pod ml/train-0"}
    asked = threading.Semaphore(0)

    def busy(g: Gpu) -> str:
        asked.release()
        return held.get(g.uuid, "")

    # A retry an hour away: only a new request can make it look again.
    h = make(script(tmp_path, "ran.py", f"import sys\nopen({str(ran)!r}, 'a').write(sys.argv[1] + '\\n')\n")
             + " {index}", busy=busy, retry_s=3600.0)
    h.checker.request(gpu(0))
    assert asked.acquire(timeout=WAIT)
    eventually(lambda: h.checker.waiting(gpu(0).uuid) == "held by pod ml/train-0", "the wait does not say why")
    h.checker.request(gpu(0))  # the monitor asks again each poll: that alone does not make it look again
    assert not asked.acquire(timeout=0.2)
    assert not ran.exists(), "a check ran on a GPU a pod holds"
    del held[gpu(0).uuid]
    h.checker.request(gpu(1))  # a new request makes it look again, at every queued GPU
    assert h.result(gpu(0).uuid).passed and h.result(gpu(1).uuid).passed
    assert sorted(ran.read_text().split()) == ["0", "1"]


def test_a_busy_gpu_is_looked_at_again_after_the_retry(tmp_path: Path, make: Callable[..., Harness]) -> None:
    free = threading.Event()
    h = make("true", busy=lambda g: "" if free.is_set() else "held by pod ml/train-0", retry_s=0.05)
    h.checker.request(gpu(0))
    eventually(lambda: h.checker.waiting(gpu(0).uuid).startswith("held by"), "never judged busy")
    free.set()
    assert h.result(gpu(0).uuid).passed


def test_a_busy_answer_that_fails_counts_as_busy(tmp_path: Path, make: Callable[..., Harness]) -> None:
    ran = tmp_path / "ran"

    def busy(g: Gpu) -> str:
        raise OSError("kubelet socket gone")

    h = make(script(tmp_path, "ran.py", f"open({str(ran)!r}, 'w')\n"), busy=busy, retry_s=0.05)
    h.checker.request(gpu(0))
    eventually(lambda: h.checker.waiting(gpu(0).uuid) == "cannot tell whether a workload holds it: kubelet socket "
                                                          "gone", "the failure is not shown")
    assert not ran.exists()


# Cancel and stop ------------------------------------------------------------------------------------------------

def test_stop_kills_a_running_check_and_reports_nothing(tmp_path: Path, make: Callable[..., Harness]) -> None:
    pids = tmp_path / "pids"
    body = ("import os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
            "time.sleep(600)\n")
    h = make(script(tmp_path, "long.py", body))
    h.checker.request(gpu(0))
    eventually(pids.exists, "the check never started")
    h.stop.set()
    h.checker.join(5.0)
    leader, grandchild = (int(p) for p in pids.read_text().split())
    eventually(lambda: not alive(leader) and not alive(grandchild), "the check outlived the stop", timeout=5.0)
    assert h.checker.results() == [] and h.wakes == 0
    h.checker.request(gpu(1))  # after the stop nothing more is taken
    assert h.checker.waiting(gpu(1).uuid) == ""


def test_cancel_kills_a_running_check_and_drops_a_queued_one(tmp_path: Path, make: Callable[..., Harness]) -> None:
    pid = tmp_path / "pid"
    ran = tmp_path / "ran"
    body = ("import os, sys, time\n"
            f"open({str(ran)!r}, 'a').write(sys.argv[1] + '\\n')\n"
            f"if sys.argv[1] == '0':\n    open({str(pid)!r}, 'w').write(str(os.getpid()))\n    time.sleep(600)\n")
    h = make(script(tmp_path, "c.py", body) + " {index}")
    for i in (0, 1, 2):
        h.checker.request(gpu(i))
    eventually(pid.exists, "the first check never started")
    assert h.checker.waiting(gpu(1).uuid) == "queued"
    h.checker.cancel(gpu(1).uuid)  # its fault came back: the check it waited for is not wanted now
    assert h.checker.waiting(gpu(1).uuid) == ""
    h.checker.cancel(gpu(0).uuid)
    assert h.result(gpu(2).uuid).passed
    assert not alive(int(pid.read_text()))
    assert h.checker.results() == [] and [r.device_id for r in h.got] == [gpu(2).uuid]
    assert ran.read_text().split() == ["0", "2"]


# The template and the message ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("template", "error"), [
    ("dcgmi diag -r 1 -i {index}", None),
    ("/host/usr/bin/check --gpu={uuid} --bus {pci} --json {{\"level\": 1}}", None),
    ("", "expected a command, got an empty one"),
    ("dcgmi diag -i {gpu}", "unknown placeholder {gpu} (known: {index}, {uuid}, {pci}; {{ and }} are literal "
                            "braces)"),
    ("dcgmi diag -i{gpu}", "unknown placeholder {gpu} in '-i{gpu}'"),
    ("dcgmi diag -i {0}", "unknown placeholder {0}"),
    ("dcgmi diag -i {}", "unknown placeholder {}"),
    ("dcgmi diag -i {index:02}", "placeholder {index} in '{index:02}' takes no conversion or format"),
    ("dcgmi diag -i {index!r}", "placeholder {index} in '{index!r}' takes no conversion or format"),
    ("dcgmi diag -i {index", "unbalanced brace in '{index'"),
    ("dcgmi diag -i }", "unbalanced brace in '}'"),
    ("dcgmi diag 'unclosed", "cannot split the command like a shell would: no closing quotation"),
])
def test_template_validation(template: str, error: str | None) -> None:
    got = validate_template(template)
    if error is None:
        assert got is None
        return
    assert got is not None and got.startswith(error), got
    with pytest.raises(ValueError):
        CommandRecoveryChecker(template, 1.0, lambda g: "", lambda: None, threading.Event())


def test_one_line_keeps_the_end() -> None:
    assert one_line(b"  a\n\n b\t c \r\n") == "a b c"
    assert one_line(b"x" * 10 + b"END", limit=5) == "…xEND"
    assert one_line(b"bad \xff byte") == "bad \ufffd byte"
    assert one_line(b"\x1b[31mFail\x1b[0m\x00") == "Fail"


# Who holds a GPU ----------------------------------------------------------------------------------------------------

def _snapshot(gpus: list[Gpu]) -> Snapshot:
    state = NodeState()
    ok = (State.HEALTHY, (), 0.0, KubeletHealth.HEALTHY)
    devices = [DeviceStatus(g.uuid, g, *ok) for g in gpus]
    devices += [DeviceStatus(m.uuid, g, *ok, mig=m) for g in gpus for m in g.mig_devices]
    state.publish(devices, 0.0)
    return state.snapshot()


def test_pods_holding_a_gpu_whole_as_a_replica_or_through_a_mig_device() -> None:
    mig = MigDevice("MIG-aaaa", gpu(1).uuid, 1, 0, "1g.10gb")
    g0, g1 = gpu(0), Gpu(uuid=gpu(1).uuid, index=1, mig_devices=(mig,))
    snap = _snapshot([g0, g1])
    shared = build_resources("nvidia.com/gpu", "none", parse_sharing(
        {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}}))
    held = [Holding("a", "whole", "c", "nvidia.com/gpu", g0.uuid),
            Holding("b", "replica", "c", "nvidia.com/gpu", f"{g0.uuid}::3"),
            Holding("c", "mig", "c", "nvidia.com/mig-1g.10gb", "MIG-AAAA"),  # any case: the kubelet's string
            Holding("d", "other-plugin", "c", "example.com/gpu", f"{g1.uuid}::0"),
            Holding("e", "elsewhere", "c", "nvidia.com/gpu", gpu(7).uuid)]
    assert pods_holding(g0, held, snap, shared) == ["a/whole", "b/replica"]
    assert pods_holding(g1, held, snap, shared) == ["c/mig", "d/other-plugin"]
    assert pods_holding(gpu(2), held, snap, build_resources("nvidia.com/gpu", "none", SharingConfig())) == []


class _Lister:
    def __init__(self, held: list[Holding] | Exception) -> None:
        self.held = held
        self.closed = 0

    def list(self) -> list[Holding]:
        if isinstance(self.held, Exception):
            raise self.held
        return self.held

    def close(self) -> None:
        self.closed += 1


def test_pod_resources_busy_answer(tmp_path: Path) -> None:
    g = gpu(0)
    snap = _snapshot([g])
    resources = build_resources("nvidia.com/gpu", "none", SharingConfig())
    lister = _Lister([Holding("ml", "train-1", "c", "nvidia.com/gpu", g.uuid),
                      Holding("ml", "train-0", "c", "nvidia.com/gpu", g.uuid)])
    busy = PodResourcesHolders(tmp_path / "kubelet.sock", resources, lambda: snap, lister=lambda: lister)
    assert busy(g) == "held by pod ml/train-0 and 1 more" and lister.closed == 1
    assert busy(gpu(1)) == ""
    down = _Lister(PodResourcesError("List on kubelet.sock: UNAVAILABLE: connection refused"))
    busy = PodResourcesHolders(tmp_path / "kubelet.sock", resources, lambda: snap, lister=lambda: down)
    assert busy(g) == "cannot tell which pods hold it: List on kubelet.sock: UNAVAILABLE: connection refused"
    assert down.closed == 1
    # The real client, without a kubelet: never "free".
    real = PodResourcesHolders(tmp_path / "kubelet.sock", resources, lambda: snap)
    assert real(g).startswith(f"cannot tell which pods hold it: {tmp_path / 'kubelet.sock'} does not exist")


def test_prepared_claims_busy_answer(tmp_path: Path) -> None:
    busy = PreparedClaimHolders(tmp_path)
    assert busy(gpu(0)) == "", "nothing prepared yet"
    uid = "0b5a5c36-6f4b-4c38-9d1e-3f1b7f0c2a11"
    dev = PreparedDevice(("gpu",), "node-1", "gpu-0", gpu(0).uuid.lower(), 0, ("gpu.gpu-health.io/gpu=x",))
    Checkpoint(tmp_path).save({uid: PreparedClaim(uid, "ml", "train-0-gpu", (dev,))})
    assert busy(gpu(0)) == "held by claim ml/train-0-gpu"
    assert busy(gpu(1)) == ""
    path = tmp_path / Checkpoint.FILE
    path.write_text("{not json")
    assert busy(gpu(1)).startswith(f"cannot tell which claims hold it: the DRA checkpoint {path}: ")
    assert path.read_text() == "{not json", "the driver's file is read, never moved aside"
    path.write_text('{"version": 2, "claims": {}}')
    assert busy(gpu(1)).endswith("version 2, this plugin reads version 1")
    path.unlink()
    path.mkdir()
    assert busy(gpu(1)).startswith(f"cannot tell which claims hold it: cannot read the DRA checkpoint {path}: ")
    assert os.path.isdir(path)


def test_the_kubelet_is_asked_before_each_check_and_a_kubelet_that_fails_holds_every_gpu(
        tmp_path: Path, make: Callable[..., Harness]) -> None:
    """The checker with the real PodResources client against a stand-in kubelet on a unix socket."""
    import grpc

    from tests.fakes.podresources import PodResourcesServer

    kubelet = PodResourcesServer(tmp_path / "kubelet.sock")
    kubelet.start()
    try:
        g = gpu(0)
        resources = build_resources("nvidia.com/gpu", "none", SharingConfig())
        busy = PodResourcesHolders(kubelet.socket_path, resources, lambda: _snapshot([g]))
        kubelet.fail = grpc.StatusCode.UNAVAILABLE
        h = make("true", busy=busy, retry_s=0.05)
        h.checker.request(g)
        eventually(lambda: "UNAVAILABLE" in h.checker.waiting(g.uuid), "a kubelet that fails must hold the GPU")
        assert h.checker.waiting(g.uuid).startswith("cannot tell which pods hold it: List on ")
        kubelet.assign("ml", "train-0", "main", "nvidia.com/gpu", f"{g.uuid}::0")
        kubelet.fail = None
        eventually(lambda: h.checker.waiting(g.uuid) == "held by pod ml/train-0", "the pod is not seen")
        assert h.checker.results() == []
        calls = kubelet.calls
        kubelet.pods.clear()  # the pod ended
        assert h.result(g.uuid).passed
        assert kubelet.calls > calls
    finally:
        kubelet.stop()
