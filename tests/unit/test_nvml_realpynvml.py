"""The NVML backend through the real nvidia-ml-py on the C stand-in, for what only the real binding can show: the
defects a Python fake of pynvml hid (a structure passed by value, absent link slots read as links down, handles
compared with ``==``), links that were up and went down across a restart, the event mask, recovery actions past
the ones we knew, and a call that never returns.

The stand-in checks every pointer, handle and structure version as nvml.h declares them; each test ends with no
violation recorded."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plugin.devices.nvml import EV_DBE, EV_GPU_UNAVAILABLE, EV_RECOVERY_ACTION, EV_XID, NvmlBackend, handle_key
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from tests.fakes import nvml_standin as standin
from tests.fakes.nvml_standin import StandinNode

pynvml = pytest.importorskip("pynvml")

PROFILES = ("a100-sxm", "h100-sxm", "h100-pcie", "l40s", "t4", "gb200")


@pytest.fixture(scope="module", autouse=True)
def loaded() -> None:
    standin.load_in_process(standin.library_dir_or_skip())


@pytest.fixture(autouse=True)
def no_violation() -> Iterator[None]:
    standin.reset_violations()
    yield
    assert standin.violations() == []


class Node:
    """A stand-in node and the backends opened on it, closed at the end of the test."""

    def __init__(self, tmp_path: Path, profile: str = "h100-sxm") -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.file = StandinNode(tmp_path / f"node-{profile}.json", profile=profile)
        self.state_dir = tmp_path / "state"
        self._backends: list[NvmlBackend] = []
        self._env = standin.use_node(self.file.path)
        self._env.__enter__()

    def backend(self, state_dir: Path | None = None) -> NvmlBackend:
        b = NvmlBackend(state_dir=state_dir or self.state_dir)
        self._backends.append(b)
        return b

    def monitor(self, b: NvmlBackend, cfg: HealthConfig | None = None, **kw: Any) -> tuple[Monitor, NodeState]:
        state = NodeState()
        return Monitor(b, state, cfg or HealthConfig(), 5.0, threading.Event(), **kw), state

    def close(self) -> None:
        for b in self._backends:
            b.close()
        self._env.__exit__(None, None, None)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    n.close()


def states(state: NodeState) -> dict[int, tuple[State, tuple[str, ...]]]:
    return {d.gpu.index: (d.state, tuple(r.code for r in d.reasons)) for d in state.snapshot().devices
            if d.mig is None}


# The two defects that took every GPU out on a real node -------------------------------------------------------------

@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("past_links", ["invalid_argument", "disabled"])
@pytest.mark.parametrize("field_values", [True, False])
def test_a_healthy_node_of_every_profile_reads_healthy(tmp_path: Path, profile: str, past_links: str,
                                                       field_values: bool) -> None:
    """The real library's answers for what a GPU lacks (slots past its links, PCIe cards without a bridge, no NVLink,
    no fabric, no page retirement) are absent signals, never faults or errors. ``past_links``: how a slot past the
    GPU's links answers (real drivers: INVALID_ARGUMENT; NVIDIA's mock: FEATURE_DISABLED). Without field values (an
    older driver) the links are probed one call at a time up to the binding's maximum."""
    n = Node(tmp_path, profile)
    try:
        n.file.nvml(None, past_links=past_links)
        if not field_values:
            n.file.doc["nvml"]["fail"] = {"nvmlDeviceGetFieldValues": "function_not_found"}
            n.file.write()
        b = n.backend()
        monitor, state = n.monitor(b)
        for _ in range(3):
            monitor.poll_once()
        assert states(state) == {i: (State.HEALTHY, ()) for i in range(8)}
        assert b.call_errors == 0
    finally:
        n.close()


@pytest.mark.parametrize("profile", ["h100-sxm", "gb200"])
def test_fabric_health_is_read_through_a_pointer_to_a_versioned_structure(tmp_path: Path, profile: str) -> None:
    """Passing the structure itself, as the backend did, is undefined behaviour in the driver's library (a crash
    at the first poll on every Hopper and Blackwell node); the stand-in records it as a violation."""
    n = Node(tmp_path, profile)
    try:
        b = n.backend()
        gpu = b.discover().gpus[1]
        assert b.read(gpu).fabric_health == "healthy"
        n.file.set(1, fabric_health="limited_capacity")
        assert b.read(gpu).fabric_health == "limited_capacity"
        assert b.describe()[1]["fabric_state"] == "completed"
        assert b.call_errors == 0
    finally:
        n.close()


def test_the_binding_own_fabric_structure_is_used_where_it_has_one(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-ml-py 12.560 (the oldest declared) has no v3 structure: the backend's copy of nvml.h's layout reads
    the same summary through the same call."""
    monkeypatch.delattr(pynvml, "c_nvmlGpuFabricInfo_v3_t", raising=False)
    node.file.set(2, fabric_health="unhealthy")
    b = node.backend()
    assert b.read(b.discover().gpus[2]).fabric_health == "unhealthy"


# NVLink: a link seen up that goes down is a fault; a slot never up is topology --------------------------------------

def test_a_link_seen_active_that_goes_down_is_a_fault_and_a_restart_still_knows(node: Node, tmp_path: Path) -> None:
    b = node.backend()
    monitor, state = node.monitor(b)
    monitor.poll_once()
    node.file.set(2, nvlink_down=[4])
    monitor.poll_once()
    [reason] = state.snapshot().get(node.file.uuids[2]).reasons  # type: ignore[union-attr]
    assert (reason.code, reason.message) == ("nvlink-down", "NVLink down: link 4")
    # The plugin restarts while the link is still down: the state dir remembers link 4 was up.
    b.close()
    again = node.backend()
    _, state2 = node.monitor(again)
    Monitor(again, state2, HealthConfig(), 5.0, threading.Event()).poll_once()
    assert states(state2)[2] == (State.UNHEALTHY, ("nvlink-down",))
    assert states(state2)[3] == (State.HEALTHY, ())
    # A node whose state dir is new has never seen link 4: a slot not active is topology there.
    fresh = node.backend(tmp_path / "other-state")
    monitor3, state3 = node.monitor(fresh)
    monitor3.poll_once()
    assert states(state3)[2] == (State.HEALTHY, ())
    assert fresh.describe()[2]["links_active"] == 17


def test_a_link_that_never_trained_is_caught_by_the_expected_count_per_model(node: Node) -> None:
    node.file.nvml(5, links_trained=16)
    b = node.backend()
    _, plain = node.monitor(b)
    Monitor(b, plain, HealthConfig(), 5.0, threading.Event()).poll_once()
    assert states(plain)[5] == (State.HEALTHY, ())
    expecting = HealthConfig(nvlink_expected_links={"NVIDIA H100 80GB HBM3": 18})
    monitor, state = node.monitor(b, expecting)
    monitor.poll_once()
    assert states(state)[5] == (State.UNHEALTHY, ("nvlink-down",))
    assert "16 of 18 links active" in state.snapshot().get(node.file.uuids[5]).reasons[0].message  # type: ignore
    assert states(state)[4] == (State.HEALTHY, ())


def test_a_link_that_trains_after_start_is_watched_from_then_on(node: Node) -> None:
    node.file.nvml(0, links_trained=17)
    b = node.backend()
    monitor, state = node.monitor(b)
    monitor.poll_once()
    node.file.nvml(0, links_trained=None)  # link 17 comes up
    monitor.poll_once()
    assert b.memory.links_seen(node.file.uuids[0]) == frozenset(range(18))
    node.file.set(0, nvlink_down=[17])
    monitor.poll_once()
    assert states(state)[0] == (State.UNHEALTHY, ("nvlink-down",))


def test_nvlink_is_read_in_one_field_values_call_per_gpu_per_poll(node: Node) -> None:
    """An H100 has 18 links: the old reads took a state and four counter calls each, 90 calls per GPU per poll."""
    b = node.backend()
    gpus = b.discover().gpus
    b.read(gpus[0])  # the first read of each check writes its crash marker; count a steady one
    standin.reset_call_counts()
    r = b.read(gpus[0])
    assert r.nvlink_down == () and r.nvlink_active_count == 18
    assert standin.call_count("nvmlDeviceGetFieldValues") == 1
    assert standin.call_count("nvmlDeviceGetNvLinkState") == 0
    assert standin.call_count("nvmlDeviceGetNvLinkErrorCounter") == 0


def test_probing_past_the_gpus_links_counts_no_call_error(node: Node) -> None:
    """Without the link-count field the probe runs up to the binding's maximum (36 in 13.615): the slot after the
    GPU's last link answers INVALID_ARGUMENT, which ends the probe and is not an error."""
    node.file.doc["nvml"]["fail"] = {"nvmlDeviceGetFieldValues": "not_supported"}
    node.file.write()
    b = node.backend()
    assert b.describe()[0]["link_slots"] == 18 and b.call_errors == 0
    assert b.read(b.discover().gpus[0]).nvlink_down == ()


# Events: matched to their GPU by the handle's address, never by a call on that GPU -------------------------------

def test_two_handles_of_one_gpu_are_one_key_and_unequal_objects(node: Node) -> None:
    node.backend()
    a, c = pynvml.nvmlDeviceGetHandleByIndex(3), pynvml.nvmlDeviceGetHandleByIndex(3)
    assert a != c  # ctypes pointers compare by identity: the old match fell through to a call on the GPU
    assert handle_key(a) == handle_key(c) != handle_key(pynvml.nvmlDeviceGetHandleByIndex(4))


def test_a_lost_gpus_unavailable_event_reaches_that_gpu_without_asking_it(node: Node) -> None:
    b = node.backend()
    b.discover()
    standin.reset_call_counts()
    node.file.append_xid(5, 48)
    node.file.set(6, lost=True)
    got = {(e.uuid, e.kind.value, e.code) for e in standin.next_events(b, 2)}
    assert got == {(node.file.uuids[5], "xid", 48), (node.file.uuids[6], "gpu-unavailable", 0)}
    assert standin.call_count("nvmlDeviceGetUUID") == 0


def test_every_event_kind_is_registered_where_the_driver_has_it(tmp_path: Path) -> None:
    for driver, mask in (("570.124.06", EV_XID | EV_DBE | EV_GPU_UNAVAILABLE | EV_RECOVERY_ACTION),
                         ("550.54.15", EV_XID | EV_DBE)):
        n = Node(tmp_path / driver)
        try:
            n.file.doc["nvml"]["driver_version"] = driver
            n.file.write()
            b = n.backend()
            assert {g["events"] for g in b.describe()} == {mask}
            n.file.set(1, ecc_uncorrected_volatile=1)
            kinds = {e.kind.value for e in standin.next_events(b, 1)}
            assert kinds == {"ecc-dbe"}
            if mask & EV_RECOVERY_ACTION:
                n.file.set(2, recovery_action="drain_and_reset")
                [e] = standin.next_events(b, 1)
                assert (e.uuid, e.kind.value, e.code) == (n.file.uuids[2], "recovery-action", 4)
        finally:
            n.close()


# Recovery actions: every value nvml.h defines, and the ones it may add -------------------------------------------

@pytest.mark.parametrize(("raw", "action", "code", "state"), [
    (0, "none", None, State.HEALTHY),
    (5, "recover_imex_domain", "recovery-action-imex", State.UNHEALTHY),
    (6, "bus_reset", "recovery-action-reset", State.UNHEALTHY),
    (7, "system_reboot", "recovery-action-reboot", State.UNHEALTHY),
    (9, "unknown", "recovery-action-unknown", State.UNKNOWN),
])
def test_recovery_actions_past_four_are_never_read_as_none(node: Node, raw: int, action: str, code: str | None,
                                                           state: State) -> None:
    node.file.nvml(4, recovery_action_raw=raw)
    b = node.backend()
    monitor, st = node.monitor(b)
    monitor.poll_once()
    assert b.read(b.discover().gpus[4]).recovery_action == action
    assert states(st)[4] == (state, (code,) if code else ())


def test_an_older_driver_answers_the_recovery_field_per_field(node: Node) -> None:
    node.file.doc["nvml"]["driver_version"] = "550.54.15"
    node.file.write()
    b = node.backend()
    r = b.read(b.discover().gpus[0])
    assert r.recovery_action is None and r.errors == () and b.call_errors == 0


# A call that never returns --------------------------------------------------------------------------------------

def test_a_hung_call_turns_the_gpus_it_blocks_unknown_and_they_recover_when_it_returns(node: Node) -> None:
    b = node.backend()
    stop = threading.Event()
    state = NodeState()
    monitor = Monitor(b, state, HealthConfig(), 0.05, stop, stall_s=0.3)
    monitor.start(persist=False)
    try:
        node.file.nvml(3, hang=["nvmlDeviceGetTemperature"])
        def stalled(snap: Any) -> bool:
            return all(d.state == State.UNKNOWN for d in snap.devices if d.gpu.index >= 3)

        standin.wait_state(state, stalled)
        s = states(state)
        assert {i: s[i] for i in range(3, 8)} == {i: (State.UNKNOWN, ("nvml-stalled",)) for i in range(3, 8)}
        assert {i: s[i][0] for i in range(3)} == {i: State.HEALTHY for i in range(3)}
        message = state.snapshot().get(node.file.uuids[3]).reasons[0].message  # type: ignore[union-attr]
        assert "nvmlDeviceGetTemperature" in message
        node.file.nvml(3, hang=None)  # the driver answers again
        standin.wait_state(state, lambda snap: all(d.state == State.HEALTHY for d in snap.devices))
        assert states(state) == {i: (State.HEALTHY, ()) for i in range(8)}
    finally:
        stop.set()
        node.file.nvml(3, hang=None)
        monitor.join(5)


# What is watched --------------------------------------------------------------------------------------------------

def test_inspect_prints_what_nvml_reported_and_which_checks_are_off(tmp_path: Path) -> None:
    n = StandinNode.of_profile(tmp_path / "node.json", "h100-pcie")
    env = standin.env_for_subprocess(n.path)
    (tmp_path / "state").mkdir()  # a plugin's state dir that holds nothing yet
    table = subprocess.run([sys.executable, "-m", "plugin", "inspect", "--state-dir", str(tmp_path / "state")],
                           env=env, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    first = table.stdout.splitlines()[:2]
    assert first[0].startswith(f"GPU 0  {n.uuids[0]}  NVIDIA H100 PCIe  (Hopper, driver 570.124.06)")
    assert "NVLink 0 active of 18 slots" in first[1]
    assert "nvlink         off: no active link among 18 slots" in table.stdout
    out = subprocess.run([sys.executable, "-m", "plugin", "inspect", "-o", "json"], env=env, capture_output=True,
                         text=True, timeout=60)
    doc = json.loads(out.stdout)
    assert len(doc["gpus"]) == 8 and doc["driver"] == "570.124.06"
    assert doc["gpus"][7]["checks"]["fabric"].startswith("off: ")
    assert doc["gpus"][7]["checks"]["ecc"] == "on" and doc["gpus"][7]["ecc_mode"] is True


# The names: what the backend calls exists in the installed binding, and what the binding resolves exists in a library
# built against nvml.h --------------------------------------------------------------------------------------------

def _backend_calls() -> set[str]:
    import re

    from plugin.devices import nvml

    return set(re.findall(r'"(nvml(?:Device|System|Event|Shutdown)[A-Za-z0-9_]*)"', Path(nvml.__file__).read_text()))


def test_every_call_the_backend_makes_is_in_the_installed_binding_and_resolves_to_an_nvml_h_symbol() -> None:
    """Run on the newest nvidia-ml-py and, in CI, on the oldest the package declares (12.560): a wrapper missing
    there reads as an absent check, so it must be one the backend can do without, never a core one."""
    import inspect
    import re

    optional = {"nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetPciInfo"}  # fallbacks only
    missing = {name for name in _backend_calls() if not hasattr(pynvml, name)}
    assert missing <= optional, f"the installed nvidia-ml-py lacks {sorted(missing)}"
    lib = standin._library()

    def symbols(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        """The C functions a wrapper resolves, through the wrappers it delegates to."""
        source = inspect.getsource(getattr(pynvml, name))
        found = set(re.findall(r'_nvmlGetFunctionPointer\("([A-Za-z0-9_]+)"\)', source))
        for other in set(re.findall(r"\b(nvml[A-Za-z0-9_]+)\(", source)) - {name} - seen:
            if callable(getattr(pynvml, other, None)) and other.startswith("nvmlDevice"):
                found |= symbols(other, seen | {name})
        return found

    for name in sorted(_backend_calls() - missing):
        resolved = symbols(name)
        assert resolved, f"pynvml.{name} resolves no C function"
        for symbol in resolved:
            assert hasattr(lib, symbol), f"pynvml.{name} calls {symbol}, which the nvml.h-checked stand-in lacks"


def test_inspect_names_a_state_dir_that_is_not_one(tmp_path: Path) -> None:
    n = StandinNode(tmp_path / "node.json")
    (tmp_path / "file").touch()
    run = subprocess.run([sys.executable, "-m", "plugin", "inspect", "--state-dir", str(tmp_path / "file")],
                         env=standin.env_for_subprocess(n.path), capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == f"gpu-health-plugin inspect: --state-dir {tmp_path / 'file'}: not a directory\n"
