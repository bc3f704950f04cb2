"""Node state: transitions, bounded history, waits; the durable store and its crash safety."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

from plugin.devices.model import Gpu
from plugin.health.node_state import ABSENT, DeviceStatus, NodeState, Snapshot, Transition
from plugin.health.reasons import Reason, State
from plugin.health.store import StateStore

GPU = Gpu(uuid="GPU-a", index=0)


def status(state: State, code: str = "") -> DeviceStatus:
    reasons = (Reason(code, state, "m", "poll", "none", 1.0),) if code else ()
    return DeviceStatus("GPU-a", GPU, state, reasons, 1.0, "Healthy" if state == State.HEALTHY else "Unhealthy")


def test_publish_numbers_transitions_and_skips_no_ops() -> None:
    s = NodeState()
    t1 = s.publish([status(State.HEALTHY)], 1.0)
    assert [(t.seq, t.from_state, t.to_state) for t in t1] == [(1, ABSENT, "Healthy")]
    v = s.snapshot().version
    assert s.publish([status(State.HEALTHY)], 2.0) == [] and s.snapshot().version == v
    t2 = s.publish([status(State.UNHEALTHY, "xid-79")], 3.0)
    assert [(t.seq, t.from_state, t.to_state) for t in t2] == [(2, "Healthy", "Unhealthy")]
    assert t2[0].reasons[0].code == "xid-79"
    t3 = s.publish([], 4.0)
    assert [(t.seq, t.to_state) for t in t3] == [(3, ABSENT)]


def test_reason_change_without_state_change_bumps_version_only() -> None:
    s = NodeState()
    s.publish([status(State.DEGRADED, "a")], 1.0)
    v = s.snapshot().version
    assert s.publish([status(State.DEGRADED, "b")], 2.0) == []
    assert s.snapshot().version == v + 1


def test_bounded_history_and_resume() -> None:
    s = NodeState(history=4)
    states = [State.HEALTHY, State.DEGRADED]
    for i in range(10):
        s.publish([status(states[i % 2], "x" if i % 2 else "")], float(i))
    assert s.snapshot().seq == 10
    assert [t.seq for t in s.transitions_since(7) or []] == [8, 9, 10]
    assert s.transitions_since(10) == []
    assert s.transitions_since(2) is None  # fell out of the history: the client must resync


def _returns(wait: Callable[[], Snapshot]) -> Snapshot:
    """Run a wait with no timeout in a thread: only a wake-up can end it, so a missed notify shows as a hang."""
    out: list[Snapshot] = []
    t = threading.Thread(target=lambda: out.append(wait()), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the waiter was never woken"
    return out[0]


def test_wait_for_change_wakes_on_publish_and_on_close() -> None:
    s = NodeState()
    v = s.snapshot().version
    threading.Timer(0.05, lambda: s.publish([status(State.HEALTHY)], 1.0)).start()
    assert _returns(lambda: s.wait_for_change(v, None)).version == v + 1
    threading.Timer(0.05, s.close).start()
    assert _returns(lambda: s.wait_for_change(v + 1, None)).version == v + 1
    assert s.closed


def test_store_round_trip_and_atomic_replace(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    assert store.load() == {}
    store.save({"devices": {"GPU-a": {"latched": []}}})
    assert store.load()["devices"] == {"GPU-a": {"latched": []}}
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["state.json"]  # no temp file left behind


def test_store_survives_a_torn_temp_file_and_quarantines_corruption(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.save({"devices": {"GPU-a": {}}})
    (tmp_path / ".state-abc123").write_text('{"half')  # what a crash mid-write leaves: the real file is intact
    assert store.load()["devices"] == {"GPU-a": {}}
    store.path.write_text("{garbage")
    assert store.load() == {}
    assert (tmp_path / "state.corrupt").exists()


def test_transition_dict_round_trip() -> None:
    t = Transition(5, "GPU-a", "Healthy", "Degraded", (Reason("thermal-slowdown", State.DEGRADED, "hot", "poll",
                                                             "none", 2.0),), 3.0)
    assert Transition.from_dict(json.loads(json.dumps(t.to_dict()))) == t
