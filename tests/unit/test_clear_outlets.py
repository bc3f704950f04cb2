"""A clearance reaches every outlet (issue 34): the node annotations (encoded and decoded back, within the size cap),
the Events (a clearance that changes no state is a Normal GPUFaultCleared naming the device, the codes and why; one
that changes it carries the note), the health API's messages, `kubectl gpu-health`, and the Clear request checks the
server makes before it asks the monitor. Pure functions on hand-made device states: no socket, no clock."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from plugin import kubectl_plugin
from plugin.health.node_state import ABSENT, Clearance, DeviceStatus, NodeState, Snapshot, Transition
from plugin.health.reasons import State
from plugin.outlets import health_api
from plugin.outlets.events import CLEARED, EventAggregator, event_for
from plugin.schema import annotations as ann
from tests.fakes.node_devices import Node, gpu, reason, status

P = "gpu-health.io"
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z
REBOOTED = Clearance(("xid-79",), "node rebooted", T0 + 60)
BY_HAND = Clearance(("ecc-uncorrected", "xid-79"), "by the operator: reseated, ticket 123", T0 + 120)


def snapshot(*devices: DeviceStatus) -> Snapshot:
    s = NodeState()
    s.publish(list(devices), T0)
    return s.snapshot()


# Annotations --------------------------------------------------------------------------------------------------------

def test_a_cleared_device_carries_its_clearance_and_decodes_back() -> None:
    g0, g1 = gpu(0), gpu(1)
    snap = snapshot(replace(status(g0), cleared=REBOOTED),
                    replace(status(g1, State.UNHEALTHY, "ecc-uncorrected", since=T0), cleared=BY_HAND))
    desired = ann.desired_annotations(snap, {}, P)
    doc = json.loads(desired.annotations[f"{P}/gpu.0"])
    assert doc["cleared"] == {"codes": ["xid-79"], "why": "node rebooted", "at": "2026-01-01T00:01:00Z"}
    assert list(doc)[-1] == "cleared"  # after the reasons: the key order of docs/annotations.md
    back = {e.key: e for e in ann.decode(desired.annotations, P, "n1").devices}
    assert back["gpu.0"].cleared == ann.ClearedEntry(("xid-79",), "node rebooted", "2026-01-01T00:01:00Z")
    assert back["gpu.0"].cleared.text == REBOOTED.text == "cleared xid-79: node rebooted"
    assert back["gpu.1"].cleared == ann.ClearedEntry(("ecc-uncorrected", "xid-79"),
                                                     "by the operator: reseated, ticket 123", "2026-01-01T00:02:00Z")
    assert back["gpu.1"].state == "Unhealthy" and back["gpu.1"].code == "ecc-uncorrected"


def test_a_device_never_cleared_has_no_clearance_key() -> None:
    desired = ann.desired_annotations(snapshot(status(gpu(0))), {}, P)
    assert "cleared" not in json.loads(desired.annotations[f"{P}/gpu.0"])
    assert ann.decode(desired.annotations, P).devices[0].cleared is None


def test_a_long_note_is_bounded_and_the_size_cap_drops_the_why_before_any_device() -> None:
    note = Clearance(("xid-79",), "by the operator: " + "x" * 400, T0)
    devices = [replace(status(gpu(i), State.UNHEALTHY, "xid-79"), cleared=note) for i in range(8)]
    full = ann.desired_annotations(snapshot(*devices), {}, P)
    why = json.loads(full.annotations[f"{P}/gpu.0"])["cleared"]["why"]
    assert len(why) == ann.WHY_MAX and why.endswith("...")
    # A cap between the minimal and the full size: the messages and the why go, every device and its codes stay.
    minimal = ann.desired_annotations(snapshot(*devices), {}, P, max_bytes=ann.size_of(full.annotations) - 1)
    assert minimal.truncated == 0
    for e in ann.decode(minimal.annotations, P).devices:
        assert e.cleared == ann.ClearedEntry(("xid-79",), "", "2026-01-01T00:00:00Z")
        assert e.cleared.text == "cleared xid-79"


@pytest.mark.parametrize("raw", ['"yes"', "[]", '{"codes":"xid-79","at":5}'])
def test_a_clearance_edited_by_hand_decodes_to_what_is_there(raw: str) -> None:
    value = '{"id":"GPU-0","state":"Healthy","reasons":[],"cleared":' + raw + "}"
    (e,) = ann.decode({f"{P}/state": "Healthy", f"{P}/gpu.0": value}, P).devices
    assert e.state == "Healthy"
    if raw.startswith("{"):
        assert e.cleared == ann.ClearedEntry((), "", "5")
    else:
        assert e.cleared is None


def test_a_clearance_that_kept_the_state_is_not_the_last_transition() -> None:
    # lastTransition/from say when the state last changed; a note-only transition is the value's `cleared`.
    changed = Transition(5, "GPU-0", "Healthy", "Unhealthy", (), T0)
    noted = Transition(6, "GPU-0", "Unhealthy", "Unhealthy", (), T0 + 60, note=REBOOTED.text)
    appeared = Transition(7, "GPU-1", ABSENT, "Healthy", (), T0 + 60, note=REBOOTED.text)
    assert ann.last_transitions([changed, noted, appeared]) == {"GPU-0": changed}


# Events -------------------------------------------------------------------------------------------------------------

def test_a_clearance_that_keeps_the_state_is_a_normal_fault_cleared_event_with_what_is_left() -> None:
    left = (reason("ecc-uncorrected", T0),)
    t = Transition(9, "GPU-3", "Unhealthy", "Unhealthy", left, T0 + 60,
                   note="cleared xid-79 by the operator: reseated, ticket 123")
    spec = event_for(t, "gpu.3")
    assert spec is not None
    assert (spec.reason, spec.type) == (CLEARED, "Normal") == ("GPUFaultCleared", "Normal")
    assert spec.message == ("gpu.3 (GPU-3): cleared xid-79 by the operator: reseated, ticket 123; still Unhealthy: "
                            "ecc-uncorrected: 2 volatile uncorrected ECC errors (action: reset-gpu)")


def test_a_device_that_appears_cleared_after_a_reboot_gets_an_event() -> None:
    t = Transition(1, "GPU-3", ABSENT, "Healthy", (), T0, note=REBOOTED.text)
    spec = event_for(t, "gpu.3")
    assert spec is not None and (spec.reason, spec.type) == ("GPUFaultCleared", "Normal")
    assert spec.message == "gpu.3 (GPU-3): cleared xid-79: node rebooted"
    # Without a note a device appearing Healthy is no news, as before.
    assert event_for(replace(t, note=""), "gpu.3") is None


def test_a_clearance_that_changes_the_state_keeps_its_event_reason_and_adds_the_note() -> None:
    t = Transition(9, "GPU-3", "Unhealthy", "Healthy", (), T0, note="cleared xid-79 by the operator: reseated")
    spec = event_for(t, "gpu.3")
    assert spec is not None and (spec.reason, spec.type) == ("GPURecovered", "Normal")
    assert spec.message == "gpu.3 (GPU-3): Unhealthy -> Healthy (cleared xid-79 by the operator: reseated)"
    plain = event_for(replace(t, note=""), "gpu.3")
    assert plain is not None and plain.message == "gpu.3 (GPU-3): Unhealthy -> Healthy"


def _flush(agg: EventAggregator, now: float) -> list[tuple[str, str, str, int]]:
    out = []
    for e in agg.due(now):
        body = agg.create_body(e, "uid", "default")
        out.append((body["reason"], body["type"], body["message"], body["count"]))
        agg.created(e, "ev", now)
    return out


def test_one_reboot_clearing_several_gpus_is_one_event_with_the_note_once() -> None:
    agg = EventAggregator("n1", burst_s=1.0)
    names = {f"GPU-{i}": f"gpu.{i}" for i in range(8)}
    agg.observe([Transition(i + 1, f"GPU-{i}", ABSENT, "Healthy", (), T0, note=REBOOTED.text) for i in range(4)],
                names, 0.0)
    assert _flush(agg, 1.0) == [("GPUFaultCleared", "Normal",
                                 "4 GPUs (gpu.0, gpu.1, gpu.2, gpu.3): cleared xid-79: node rebooted", 1)]


def test_two_different_clearances_are_never_folded_into_one_event() -> None:
    agg = EventAggregator("n1", burst_s=1.0)
    names = {"GPU-3": "gpu.3", "GPU-4": "gpu.4"}
    left = (reason("ecc-uncorrected", T0),)
    agg.observe([Transition(1, "GPU-3", "Unhealthy", "Unhealthy", left, T0, note="cleared xid-79: node rebooted"),
                 Transition(2, "GPU-4", "Unhealthy", "Unhealthy", left, T0, note="cleared xid-79 by the operator: x")],
                names, 0.0)
    got = sorted(m for _, _, m, _ in _flush(agg, 1.0))
    assert [m.split(";")[0] for m in got] == ["gpu.3 (GPU-3): cleared xid-79: node rebooted",
                                              "gpu.4 (GPU-4): cleared xid-79 by the operator: x"]
    # The same clearance of the same device again within the window is the same Event, counted.
    agg.observe([Transition(3, "GPU-3", "Unhealthy", "Unhealthy", left, T0 + 5, note="cleared xid-79: node rebooted")],
                names, 20.0)
    due = agg.due(21.0)
    assert len(due) == 1 and not agg.needs_create(due[0], 21.0)
    assert agg.patch_body(due[0])["count"] == 2


def test_a_transition_that_neither_changes_nor_clears_is_still_no_event() -> None:
    assert event_for(Transition(1, "GPU-0", "Unhealthy", "Unhealthy", (), T0), "gpu.0") is None


# The health API's messages and request checks -----------------------------------------------------------------------

def test_list_and_watch_messages_carry_the_clearance_and_the_note() -> None:
    d = replace(status(gpu(2)), cleared=REBOOTED)
    pb = health_api.status_pb(d)
    assert (pb.cleared, pb.cleared_at) == ("cleared xid-79: node rebooted", T0 + 60)
    assert (health_api.status_pb(status(gpu(2))).cleared, health_api.status_pb(status(gpu(2))).cleared_at) == ("", 0)
    t = health_api.transition_pb(Transition(4, d.id, "Unhealthy", "Healthy", (), T0 + 60, note=REBOOTED.text))
    assert t.note == "cleared xid-79: node rebooted" and t.from_state == "Unhealthy"


def test_the_node_state_makes_a_noted_transition_the_stream_carries() -> None:
    state = NodeState()
    node = Node(state, n=2)
    node.set(1, State.UNHEALTHY, "xid-79", now=T0)
    before = state.snapshot().seq
    node.current[node.gpus[1].uuid] = replace(status(node.gpus[1], State.HEALTHY, since=T0 + 60), cleared=REBOOTED)
    node.publish(T0 + 60)
    (t,) = state.transitions_since(before) or []
    assert health_api.transition_pb(t).note == REBOOTED.text


@pytest.mark.parametrize(("note", "why"), [
    ("", "required"),
    ("   ", "required"),
    ("x" * 257, "at most 256 characters, got 257"),
    ("two\nlines", "one line of printable characters"),
    ("bell\a", "one line of printable characters"),
])
def test_a_bad_note_is_invalid_argument(note: str, why: str) -> None:
    with pytest.raises(health_api.BadClear) as exc:
        health_api.check_note(note)
    assert exc.value.code is grpc.StatusCode.INVALID_ARGUMENT and why in str(exc.value)


def test_a_good_note_is_kept_trimmed() -> None:
    assert health_api.check_note("  reseated, ticket 123 ") == "reseated, ticket 123"
    assert health_api.check_note("x" * 256) == "x" * 256


def test_the_request_names_one_device_or_all_a_reason_code_and_a_device_the_node_has() -> None:
    g = gpu(3, migs=1)
    snap = snapshot(status(gpu(0)), status(g, mig=g.mig_devices[0]))
    ok = [("3", False, ""), (g.uuid, False, "xid-79"), (g.mig_devices[0].uuid, False, ""),
          ("", True, "xid-79-repeated"), ("0", False, "nvlink-down")]
    for device, everything, code in ok:
        health_api.check_clear(snap, device, everything, code)  # raises nothing
    bad = [("", False, "", grpc.StatusCode.INVALID_ARGUMENT, "name one device"),
           ("3", True, "", grpc.StatusCode.INVALID_ARGUMENT, "not both"),
           ("3", False, "XID 79", grpc.StatusCode.INVALID_ARGUMENT, "reason: expected a reason code"),
           ("3", False, "-79", grpc.StatusCode.INVALID_ARGUMENT, "'-79'"),
           ("7", False, "", grpc.StatusCode.NOT_FOUND, "device '7': no such device on this node"),
           ("GPU-nope", False, "", grpc.StatusCode.NOT_FOUND, "'GPU-nope'"),
           ("-1", False, "", grpc.StatusCode.NOT_FOUND, "'-1'")]
    for device, everything, code, status_code, words in bad:
        with pytest.raises(health_api.BadClear) as exc:
            health_api.check_clear(snap, device, everything, code)
        assert exc.value.code is status_code and words in str(exc.value), (device, code, str(exc.value))


# kubectl gpu-health --------------------------------------------------------------------------------------------------

def test_kubectl_gpu_health_shows_the_clearance_after_the_reasons(tmp_path: object,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    snap = snapshot(replace(status(gpu(0)), cleared=REBOOTED), status(gpu(1)))
    annotations = ann.desired_annotations(snap, {}, P).annotations
    entries, _ = kubectl_plugin.collect([{"kind": "Node", "metadata": {"name": "n1", "annotations": annotations}}],
                                        P, [], set())
    table = kubectl_plugin.render_table(entries).splitlines()
    assert table[1].endswith("   - [cleared xid-79: node rebooted at 2026-01-01T00:01:00Z]")
    assert table[2].endswith("   -")
    doc = kubectl_plugin._entry_json(entries[0])
    assert doc["cleared"] == {"codes": ["xid-79"], "why": "node rebooted", "at": "2026-01-01T00:01:00Z"}
    assert "cleared" not in kubectl_plugin._entry_json(entries[1])


def test_the_examples_of_docs_annotations_md_are_what_the_code_writes() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "annotations.md").read_text()
    one = Clearance(("xid-79",), "by the operator: reseated, ticket 123", T0 + 120)
    value = ann.desired_annotations(snapshot(replace(status(gpu(3)), cleared=one)), {}, P).annotations[f"{P}/gpu.3"]
    assert f'`{value[value.index(chr(34) + "cleared"):-1]}`' in doc
    agg = EventAggregator("n1", burst_s=1.0)
    agg.observe([Transition(i + 1, f"GPU-{i}", ABSENT, "Healthy", (), T0, note=REBOOTED.text) for i in range(4)],
                {f"GPU-{i}": f"gpu.{i}" for i in range(4)}, 0.0)
    ((_, _, message, _),) = _flush(agg, 1.0)
    assert f"`{message}`" in doc
    snap = snapshot(replace(status(gpu(0)), cleared=REBOOTED))
    entries, _ = kubectl_plugin.collect([{"kind": "Node", "metadata": {
        "name": "n1", "annotations": ann.desired_annotations(snap, {}, P).annotations}}], P, [], set())
    assert "`" + kubectl_plugin._reasons(entries[0]) + "`" in doc
