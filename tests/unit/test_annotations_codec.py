"""The annotation codec both ways: what the agent encodes, every reader decodes back (plugin/schema/annotations.py),
for whole GPUs, MIG devices, hashed names, a truncated node, and Nodes written by an agent older than the count key.
And the one order of reasons every output shares (plugin/health/reasons.py)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from plugin.devices.model import Gpu
from plugin.health.config import DEFAULT_KUBELET_HEALTH
from plugin.health.node_state import DeviceStatus, NodeState, Snapshot, Transition
from plugin.health.reasons import SPECS, Action, Reason, Source, State, worst_first
from plugin.kube.names import DEFAULT_PREFIX
from plugin.schema import annotations as ann
from tests.fakes.node_devices import Node, gpu, reason, status

P = "gpu-health.io"
T0 = 1_767_225_600.0
REPO = Path(__file__).resolve().parents[2]


def snapshot(*devices: DeviceStatus) -> Snapshot:
    s = NodeState()
    s.publish(list(devices), T0)
    return s.snapshot()


def roundtrip(snap: Snapshot, last: dict[str, Transition] | None = None, max_bytes: int = ann.DEFAULT_MAX_BYTES,
              prefix: str = P) -> tuple[ann.Desired, ann.NodeAnnotations]:
    desired = ann.desired_annotations(snap, last or {}, prefix, max_bytes)
    # Another tool's keys, beside and under the prefix, are never read as ours.
    around = {"example.com/gpu.0": "{}", f"{prefix}/note": "set by hand", f"{prefix}/gpu.x": '{"state":"Healthy"}'}
    return desired, ann.decode({**around, **desired.annotations}, prefix, node="n1")


def test_whole_gpus_decode_to_what_was_encoded() -> None:
    g0, g1, g10 = gpu(0), gpu(1), gpu(10)
    sick = status(g1, State.UNHEALTHY, "thermal-slowdown", "xid-79", since=T0 + 60)
    snap = snapshot(status(g0), sick, status(g10, State.DEGRADED, "thermal-slowdown"))
    last = {g1.uuid: Transition(4, g1.uuid, "Healthy", "Unhealthy", sick.reasons, T0 + 61)}
    _, got = roundtrip(snap, last)
    assert (got.schema, got.state, got.annotated, got.truncated) == (ann.SCHEMA_VERSION, "Unhealthy", True, False)
    assert got.summary.startswith("Unhealthy: 3 devices (1 Healthy, 1 Degraded, 1 Unhealthy)")
    assert (got.device_count, got.gpu_count) == (3, 3)
    assert [(e.key, e.id, e.state) for e in got.devices] == [
        ("gpu.0", g0.uuid, "Healthy"), ("gpu.1", g1.uuid, "Unhealthy"), ("gpu.10", g10.uuid, "Degraded")]
    one = got.devices[1]
    assert (one.node, one.action, one.code, one.gpu) == ("n1", "reboot-node", "xid-79", g1.uuid)
    assert [r["code"] for r in one.reasons] == ["xid-79", "thermal-slowdown"]
    assert one.reasons[0] == {"code": "xid-79", "message": reason("xid-79", 0).message, "action": "reboot-node"}
    assert (one.since, one.last_transition, one.from_state) == ("2026-01-01T00:01:00Z", "2026-01-01T00:01:01Z",
                                                                "Healthy")
    healthy = got.devices[0]
    assert (healthy.action, healthy.code, healthy.reasons, healthy.last_transition) == ("none", "", (), "")


def test_mig_devices_decode_with_their_parent_and_count_as_their_gpu() -> None:
    g2, g3 = gpu(2, migs=3), gpu(3)
    m1, m2, m3 = g2.mig_devices
    snap = snapshot(status(g2), status(g2, mig=m1), status(g2, mig=m2),
                    status(g2, State.UNHEALTHY, "ecc-uncorrected", mig=m3), status(g3))
    _, got = roundtrip(snap)
    assert (got.device_count, got.gpu_count) == (5, 2)
    mig = next(e for e in got.devices if e.key == "gpu.2.mig.3.0")
    assert (mig.id, mig.parent, mig.gpu, mig.profile) == (g2.mig_devices[2].uuid, g2.uuid, g2.uuid, "1g.10gb")
    assert (mig.state, mig.code) == ("Unhealthy", "ecc-uncorrected")
    assert [e.key for e in got.devices] == ["gpu.2", "gpu.2.mig.1.0", "gpu.2.mig.2.0", "gpu.2.mig.3.0", "gpu.3"]


def test_hashed_names_decode_like_index_names() -> None:
    a, b = gpu(1), Gpu(uuid="GPU-other", index=1, name="x")
    _, got = roundtrip(snapshot(status(a), status(b, State.UNKNOWN, "nvml-error")))
    assert {e.key: e.id for e in got.devices} == {ann.hashed_name(a.uuid): a.uuid,
                                                  ann.hashed_name("GPU-other"): "GPU-other"}
    assert (got.device_count, got.gpu_count, got.state) == (2, 2, "Unknown")


def test_a_truncated_node_still_decodes_its_full_count() -> None:
    node = Node(NodeState(), n=8, migs=7)
    node.current[node.gpus[5].uuid] = status(node.gpus[5], State.UNHEALTHY, "xid-79")
    node.publish(T0)
    desired, got = roundtrip(node.state.snapshot(), max_bytes=3000)
    assert desired.truncated > 0 and got.truncated
    assert len(got.devices) == 64 - desired.truncated
    assert (got.device_count, got.gpu_count) == (64, 8)
    assert ("gpu.5", "Unhealthy") in [(e.key, e.state) for e in got.devices]  # the worst are kept


def test_an_older_agents_node_counts_its_entries_or_nothing_once_truncated() -> None:
    g = gpu(0, migs=2)
    desired, _ = roundtrip(snapshot(status(g), *(status(g, mig=m) for m in g.mig_devices), status(gpu(1))))
    old = {k: v for k, v in desired.annotations.items() if k != f"{P}/{ann.COUNT_KEY}"}
    got = ann.decode(old, P)
    assert (got.device_count, got.gpu_count) == (4, 2)
    truncated = {**old, f"{P}/{ann.TRUNCATED_KEY}": "60 device entries omitted: over the 65536-byte cap"}
    got = ann.decode(truncated, P)
    assert got.truncated and (got.device_count, got.gpu_count) == (None, None)
    assert len(got.devices) == 4  # the entries themselves still decode


@pytest.mark.parametrize("bad", ["", "7", "[7, 1]", "{not json", '{"total":8}', '{"total":-1,"gpus":1}',
                                 '{"total":true,"gpus":1}', '{"total":"8","gpus":"8"}'])
def test_a_count_that_is_not_ours_is_no_count(bad: str) -> None:
    desired, _ = roundtrip(snapshot(status(gpu(0)), status(gpu(1))))
    got = ann.decode({**desired.annotations, f"{P}/{ann.COUNT_KEY}": bad}, P)
    assert (got.device_count, got.gpu_count) == (2, 2)
    got = ann.decode({**desired.annotations, f"{P}/{ann.COUNT_KEY}": bad, f"{P}/{ann.TRUNCATED_KEY}": "1"}, P)
    assert (got.device_count, got.gpu_count) == (None, None)


def test_values_that_are_not_ours_are_skipped_or_left_blank() -> None:
    got = ann.decode({f"{P}/state": "Healthy", f"{P}/gpu.0": "not json", f"{P}/gpu.1": "[1]",
                      f"{P}/gpu.2": '{"id":"GPU-2","state":5,"reasons":7}',
                      f"{P}/gpu.3": '{"state":"Degraded","reasons":["x",{"code":"flapping"}]}'}, P)
    assert [(e.key, e.id, e.state, e.code) for e in got.devices] == [("gpu.2", "GPU-2", "", ""),
                                                                      ("gpu.3", "", "Degraded", "flapping")]
    assert got.devices[1].gpu == "gpu.3"  # no id: the key names the device
    assert [e.key for e in ann.parse_node("n", {f"{P}/gpu.2": '{"state":5}', f"{P}/gpu.3": '{"state":"x"}'})] == [
        "gpu.3"]
    blank = ann.decode({}, P)
    assert (blank.annotated, blank.state, blank.schema, blank.devices, blank.device_count) == (False, "", "", (), 0)


def test_another_prefix_encodes_and_decodes_its_own_keys() -> None:
    desired, got = roundtrip(snapshot(status(gpu(0), State.UNHEALTHY, "xid-79")), prefix="example.com")
    assert all(k.startswith("example.com/") for k in desired.annotations)
    assert [e.key for e in got.devices] == ["gpu.0"] and got.state == "Unhealthy"
    assert ann.decode(desired.annotations, P).devices == ()


# One order of reasons ---------------------------------------------------------------------------------------------

def _r(code: str, severity: State, action: Action, first_seen: float) -> Reason:
    return Reason(code, severity, code, Source.POLL, action, first_seen)


def test_worst_first_is_severity_then_action_then_first_seen_then_code() -> None:
    reasons = [_r("a", State.DEGRADED, Action.NONE, 1), _r("b", State.UNHEALTHY, Action.RESET_GPU, 5),
               _r("c", State.UNHEALTHY, Action.REBOOT_NODE, 9), _r("d", State.UNHEALTHY, Action.RESET_GPU, 2),
               _r("e", State.UNHEALTHY, Action.RESET_GPU, 2), _r("f", State.UNKNOWN, Action.CONTACT_SUPPORT, 0)]
    assert [r.code for r in worst_first(reversed(reasons))] == ["c", "d", "e", "b", "f", "a"]


def test_a_device_status_and_a_transition_hold_their_reasons_worst_first() -> None:
    """Ordered where they are made, so no reader sorts: a writer's order (the tracker's, a MIG device's own reasons
    before its GPU's) never shows."""
    g = gpu(0)
    given = (_r("hot", State.DEGRADED, Action.NONE, 0), _r("flapping", State.UNHEALTHY, Action.CONTACT_SUPPORT, 9),
             _r("ecc", State.UNHEALTHY, Action.RESET_GPU, 1))
    d = status(g)
    d = type(d)(d.id, g, State.UNHEALTHY, given, T0, d.kubelet_health)
    assert [r.code for r in d.reasons] == ["flapping", "ecc", "hot"]
    t = Transition.from_dict({"seq": 1, "id": g.uuid, "from": "Healthy", "to": "Unhealthy", "time": T0,
                              "reasons": [r.to_dict() for r in given]})
    assert [r.code for r in t.reasons] == ["flapping", "ecc", "hot"]
    value = json.loads(ann.device_value(d, None))
    assert value["action"] == "contact-support" and [r["code"] for r in value["reasons"]] == ["flapping", "ecc", "hot"]


# One reader of the keys -------------------------------------------------------------------------------------------

def _constants(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string literal, the literal parts of f-strings included."""
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_no_module_but_the_codec_spells_our_annotation_keys() -> None:
    """A reader that knows a key's spelling or the device-key pattern would be a second codec: it takes the key
    names from plugin/schema/annotations.py (as controller/nodes.py's Keys does) and decodes through it."""
    codec = REPO / "plugin" / "schema" / "annotations.py"
    keys = ann.FIXED_KEYS
    found = []
    for path in sorted((REPO / "plugin").rglob("*.py")):
        if path == codec:
            continue
        for line, text in _constants(ast.parse(path.read_text(), str(path))):
            spelled = any(text == f"/{k}" or text.endswith(f"{DEFAULT_PREFIX}/{k}") for k in keys)
            pattern = "gpu\\." in text or "dev\\." in text or "mig\\." in text
            if spelled or pattern:
                found.append(f"{path.relative_to(REPO)}:{line}: {text!r}")
    assert not found, "annotation keys read outside the codec:\n" + "\n".join(found)


def test_the_key_check_would_catch_the_copies_it_replaced() -> None:
    copies = ('_DEVICE_KEY = re.compile(r"(gpu\\.\\d+(\\.mig\\.\\d+\\.\\d+)?|dev\\.[0-9a-f]{16})")',
              'truncated = annotations.get(f"{keys.prefix}/truncated")')
    for src in copies:
        texts = [t for _, t in _constants(ast.parse(src))]
        assert any("gpu\\." in t or t == "/truncated" for t in texts), src


# Values no agent of ours writes, too deep or too big to decode (issue 35, 1) ------------------------------------

DEEP = "[" * 1000 + "]" * 1000  # json.loads raises RecursionError on it: not a ValueError


@pytest.mark.parametrize("key", ["gpu.3", ann.COUNT_KEY])
def test_a_value_nested_past_the_bound_is_unreadable_not_an_exception(key: str) -> None:
    desired, _ = roundtrip(snapshot(status(gpu(0)), status(gpu(1))))
    got = ann.decode({**desired.annotations, f"{P}/{key}": DEEP}, P, "n")
    assert [u.key for u in got.unreadable] == [key]
    assert "nested deeper than" in got.unreadable[0].why
    assert [e.key for e in got.devices] == ["gpu.0", "gpu.1"]  # the rest still reads


def test_a_value_past_the_size_bound_is_unreadable() -> None:
    big = json.dumps({"id": "GPU-3", "state": "Healthy", "pad": "x" * ann.VALUE_MAX_BYTES})
    got = ann.decode({f"{P}/state": "Healthy", f"{P}/gpu.3": big}, P)
    assert [u.key for u in got.unreadable] == ["gpu.3"] and not got.devices
    assert f"{ann.VALUE_MAX_BYTES}" in got.unreadable[0].why


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    message = "[" * 500 + "{" * 500
    value = json.dumps({"id": "GPU-3", "state": "Unhealthy", "reasons": [{"code": "xid-79", "message": message}]})
    got = ann.decode({f"{P}/state": "Unhealthy", f"{P}/gpu.3": value}, P)
    assert not got.unreadable
    assert got.devices[0].reasons[0]["message"] == message


def test_what_the_agent_writes_at_its_largest_stays_readable() -> None:
    # Every reason of the table at once, on one device, with a clearance: more than any GPU can have.
    g = gpu(0)
    every = tuple(Reason(c, spec.severity, "m" * 300, Source.POLL, spec.action, T0) for c, spec in SPECS.items())
    desired, got = roundtrip(snapshot(DeviceStatus(g.uuid, g, State.UNHEALTHY, worst_first(every), T0,
                                                   DEFAULT_KUBELET_HEALTH[State.UNHEALTHY])))
    assert not got.unreadable and len(got.devices[0].reasons) == len(SPECS)
    assert all(len(v) <= ann.VALUE_MAX_BYTES for v in desired.annotations.values())
