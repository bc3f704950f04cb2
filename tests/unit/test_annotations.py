"""Cluster reporting, the pure parts: annotation schema and patches, the node condition, Event aggregation, and the
timing primitives (token bucket, back-off, debounce) the writer and bench/fleet_sim.py share."""

from __future__ import annotations

import json
import random
import time

import pytest

from plugin.backoff import Backoff
from plugin.config import ConfigError, load
from plugin.health.node_state import ABSENT, NodeState, Transition
from plugin.health.reasons import Reason, State
from plugin.kube.ratelimit import TokenBucket, WriteScheduler
from plugin.outlets.condition import desired_condition
from plugin.outlets.events import EventAggregator, event_for
from plugin.schema import annotations as ann
from plugin.validation import check_condition_type, check_prefix
from tests.fakes.node_devices import MESSAGES, Node, gpu, reason, status

P = "gpu-health.io"
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def snapshot(*devices):  # type: ignore[no-untyped-def]
    s = NodeState()
    s.publish(list(devices), T0)
    return s.snapshot()


def test_keys_are_short_stable_and_carry_the_uuid_in_the_value() -> None:
    g3, g12 = gpu(3, migs=2), gpu(12)
    snap = snapshot(status(g3), status(g3, mig=g3.mig_devices[1]), status(g12))
    d = ann.desired_annotations(snap, {}).annotations
    assert set(d) == {f"{P}/schema", f"{P}/state", f"{P}/summary", f"{P}/devices", f"{P}/gpu.3",
                      f"{P}/gpu.3.mig.2.0", f"{P}/gpu.12"}
    assert d[f"{P}/devices"] == '{"total":3,"gpus":2}'
    assert all(len(k.split("/", 1)[1]) <= 63 for k in d)
    assert json.loads(d[f"{P}/gpu.3"])["id"] == g3.uuid
    mig = json.loads(d[f"{P}/gpu.3.mig.2.0"])
    assert (mig["id"], mig["parent"], mig["profile"]) == (g3.mig_devices[1].uuid, g3.uuid, "1g.10gb")
    assert d[f"{P}/schema"] == ann.SCHEMA_VERSION


def test_clashing_names_fall_back_to_a_hash_of_the_id() -> None:
    a, b = gpu(1), gpu(1)
    b = type(b)(uuid="GPU-other", index=1)
    names = ann.device_names([status(a), status(b)])
    assert names == {a.uuid: ann.hashed_name(a.uuid), "GPU-other": ann.hashed_name("GPU-other")}
    assert all(ann.is_our_key(f"{P}/{n}", P) for n in names.values())


def test_device_value_has_state_reasons_action_since_and_last_transition() -> None:
    g = gpu(0)
    dev = status(g, State.UNHEALTHY, "thermal-slowdown", "xid-79", since=T0 + 60)
    last = Transition(7, g.uuid, "Healthy", "Unhealthy", dev.reasons, T0 + 61)
    v = json.loads(ann.device_value(dev, last))
    assert v["state"] == "Unhealthy" and v["action"] == "reboot-node"  # from the worst reason, not the first
    assert [r["code"] for r in v["reasons"]] == ["xid-79", "thermal-slowdown"]
    assert v["reasons"][0]["message"] == MESSAGES["xid-79"] and v["reasons"][0]["action"] == "reboot-node"
    assert v["since"] == "2026-01-01T00:01:00Z" and v["lastTransition"] == "2026-01-01T00:01:01Z"
    assert v["from"] == "Healthy"
    first = ann.device_value(dev, last)
    with pytest.MonkeyPatch.context() as mp:
        # A later poll of an unchanged device must give the same bytes (else every poll is a write): only the
        # inputs, never the clock, may shape the value.
        mp.setattr(time, "time", lambda: T0 + 86_400.0)
        assert ann.device_value(dev, last) == first
    long = status(g, State.DEGRADED)
    long = type(long)(long.id, g, State.DEGRADED, (Reason("x", State.DEGRADED, "m" * 500, "poll", "none", T0),),
                      T0, "Healthy")
    assert len(json.loads(ann.device_value(long, None))["reasons"][0]["message"]) == ann.MESSAGE_MAX


def test_appearing_devices_do_not_count_as_transitions() -> None:
    """Every plugin start makes each device appear (Absent -> state); that must not rewrite the annotations."""
    hist = [Transition(1, "a", ABSENT, "Healthy", (), 1.0), Transition(2, "a", "Healthy", "Degraded", (), 2.0),
            Transition(3, "a", "Degraded", ABSENT, (), 3.0), Transition(4, "a", ABSENT, "Degraded", (), 4.0)]
    assert ann.last_transitions(hist)["a"].seq == 2


def test_summary_counts_states_and_names_the_worst_devices() -> None:
    gs = [gpu(i) for i in range(8)]
    devs = [status(g) for g in gs]
    devs[5] = status(gs[5], State.DEGRADED, "thermal-slowdown")
    devs[3] = status(gs[3], State.UNHEALTHY, "xid-79")
    d = ann.desired_annotations(snapshot(*devs), {}).annotations
    assert d[f"{P}/state"] == "Unhealthy"
    assert d[f"{P}/summary"] == ("Unhealthy: 8 devices (6 Healthy, 1 Degraded, 1 Unhealthy); "
                                 "gpu.3 Unhealthy xid-79 (reboot-node), gpu.5 Degraded thermal-slowdown (none)")
    assert ann.desired_annotations(snapshot(*(status(g) for g in gs)), {}).annotations[f"{P}/summary"] == \
        "Healthy: 8 devices (8 Healthy)"


def test_merge_patch_touches_only_our_keys() -> None:
    current = {f"{P}/gpu.0": "old", f"{P}/gpu.9": "gone device", f"{P}/schema": "v1", f"{P}/note": "by hand",
               "example.com/owner": "ops", f"sub.{P}/x": "y"}
    desired = {f"{P}/gpu.0": "new", f"{P}/schema": "v1", f"{P}/gpu.1": "added"}
    assert ann.merge_patch(current, desired, P) == {f"{P}/gpu.0": "new", f"{P}/gpu.1": "added", f"{P}/gpu.9": None}
    assert ann.merge_patch({**current, **desired, f"{P}/gpu.9": None}, desired, P) == {f"{P}/gpu.9": None}
    assert ann.merge_patch({**desired, "example.com/owner": "ops"}, desired, P) == {}


def test_full_mig_node_is_far_under_the_api_limit() -> None:
    node = Node(NodeState(), n=8, migs=7)
    for i in range(8):
        node.current[node.gpus[i].uuid] = status(node.gpus[i], State.UNHEALTHY, "xid-79", "ecc-uncorrected")
    node.publish(T0)
    d = ann.desired_annotations(node.state.snapshot(), {}, P, ann.DEFAULT_MAX_BYTES)
    assert d.truncated == 0 and len(d.annotations) == 4 + 8 + 56
    assert ann.size_of(d.annotations) < ann.API_LIMIT_BYTES // 8, ann.size_of(d.annotations)


def test_size_cap_truncates_with_a_marker_and_keeps_the_worst() -> None:
    node = Node(NodeState(), n=8, migs=7)
    node.current[node.gpus[6].uuid] = status(node.gpus[6], State.UNHEALTHY, "xid-79")
    node.publish(T0)
    snap = node.state.snapshot()
    full = ann.desired_annotations(snap, {}, P, 10**6).annotations
    for cap in (4000, 2500):
        d = ann.desired_annotations(snap, {}, P, cap)
        assert ann.size_of(d.annotations) <= cap
        assert d.truncated > 0 and d.annotations[f"{P}/truncated"].startswith(f"{d.truncated} device entries")
        assert f"{P}/gpu.6" in d.annotations  # the Unhealthy one is kept
        assert d.annotations[f"{P}/summary"] == full[f"{P}/summary"]  # the counts still cover every device
        assert ann.is_our_key(f"{P}/truncated", P)
    # Between the two steps: messages dropped, every device kept.
    minimal = ann.desired_annotations(snap, {}, P, ann.size_of(full) - 1)
    assert minimal.truncated == 0 and f"{P}/truncated" not in minimal.annotations
    assert "message" not in json.loads(minimal.annotations[f"{P}/gpu.6"])["reasons"][0]


def test_parse_node_reads_back_what_we_write_and_skips_garbage() -> None:
    g0, g1 = gpu(0), gpu(10)
    d = ann.desired_annotations(snapshot(status(g0, State.UNHEALTHY, "xid-79"), status(g1)), {}).annotations
    entries = ann.parse_node("n1", {**d, f"{P}/gpu.2": "not json", "example.com/x": "{}"})
    assert [(e.key, e.id, e.state, e.action) for e in entries] == [
        ("gpu.0", g0.uuid, "Unhealthy", "reboot-node"), ("gpu.10", g1.uuid, "Healthy", "none")]
    assert entries[0].reasons[0]["code"] == "xid-79"


@pytest.mark.parametrize("bad", ["", "Gpu-Health.io", "-x.io", "a..b", "kubernetes.io", "node.k8s.io", "x" * 254])
def test_prefix_validation(bad: str) -> None:
    with pytest.raises(ValueError):
        check_prefix(bad)


def test_config_options_validate_and_node_name_comes_from_node_name_env() -> None:
    cfg = load({}, {"NODE_NAME": "gpu-node-7"}, None)
    assert cfg.node_name == "gpu-node-7" and cfg.source["node_name"] == "env"
    assert load({}, {"NODE_NAME": "a", "GPU_HEALTH_NODE_NAME": "b"}, None).node_name == "b"
    assert (cfg.annotations, cfg.events, cfg.node_condition, cfg.annotation_prefix) == (True, True, False, P)
    assert (cfg.report_debounce, cfg.report_min_interval, cfg.report_resync_interval) == (1.0, 10.0, 600.0)
    with pytest.raises(ConfigError, match=r"--annotation-prefix.*DNS subdomain"):
        load({"annotation_prefix": "Not_A_Domain"}, {}, None)
    with pytest.raises(ConfigError, match=r"GPU_HEALTH_NODE_CONDITION_TYPE.*kubelet"):
        load({}, {"GPU_HEALTH_NODE_CONDITION_TYPE": "Ready"}, None)
    with pytest.raises(ConfigError, match=r"NODE_NAME.*node name"):
        load({}, {"NODE_NAME": "Bad Name"}, None)
    with pytest.raises(ConfigError, match=r"--annotation-max-bytes.*positive integer"):
        load({"annotation_max_bytes": "0"}, {}, None)


# The node condition ---------------------------------------------------------------------------------------------

def test_condition_is_false_with_reasons_while_a_device_is_unhealthy() -> None:
    g = [gpu(i) for i in range(3)]
    c = desired_condition(snapshot(status(g[0]), status(g[1], State.UNHEALTHY, "xid-79", "ecc-uncorrected"),
                                   status(g[2], State.DEGRADED, "thermal-slowdown")), "GPUHealthy")
    assert (c.type, c.status, c.reason) == ("GPUHealthy", "False", "GPUUnhealthy")
    assert c.message == f"1 of 3 GPU devices Unhealthy: gpu.1 ({g[1].uuid}): xid-79, ecc-uncorrected"
    ok = desired_condition(snapshot(status(g[0]), status(g[2], State.DEGRADED, "thermal-slowdown")), "GPUHealthy")
    assert (ok.status, ok.reason) == ("True", "GPUsHealthy") and "1 Degraded" in ok.message
    unk = desired_condition(snapshot(status(g[0], State.UNKNOWN, "nvml-error")), "GPUHealthy")
    assert (unk.status, unk.reason) == ("Unknown", "GPUStateUnknown")


def test_condition_transition_time_moves_only_with_the_status() -> None:
    g = gpu(0)
    c = desired_condition(snapshot(status(g, State.UNHEALTHY, "xid-79")), "GPUHealthy")
    current = {"type": "GPUHealthy", "status": "False", "reason": "GPUUnhealthy", "message": "older message",
               "lastTransitionTime": "2025-12-31T00:00:00Z"}
    assert not c.same_as(current)
    item = c.to_patch_item(current, T0)
    assert item["lastTransitionTime"] == "2025-12-31T00:00:00Z" and item["lastHeartbeatTime"] == "2026-01-01T00:00:00Z"
    flipped = c.to_patch_item({**current, "status": "True"}, T0)
    assert flipped["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert c.same_as({**item, "lastHeartbeatTime": "whenever"})


@pytest.mark.parametrize("bad", ["Ready", "DiskPressure", "has space", "x/" + "a" * 64, ""])
def test_condition_type_validation(bad: str) -> None:
    with pytest.raises(ValueError):
        check_condition_type(bad)


# Events ---------------------------------------------------------------------------------------------------------

def _t(seq: int, frm: str, to: str, *codes: str, t: float = T0) -> Transition:
    reasons = tuple(reason(c, t) for c in codes)
    return Transition(seq, "GPU-a", frm, to, reasons, t)


def test_events_only_for_transitions_into_or_out_of_bad_states() -> None:
    assert event_for(_t(1, ABSENT, "Healthy"), "gpu.0") is None
    assert event_for(_t(1, "Healthy", ABSENT), "gpu.0") is None
    into = event_for(_t(1, "Healthy", "Unhealthy", "xid-79"), "gpu.0")
    assert into is not None and (into.reason, into.type, into.codes) == ("GPUUnhealthy", "Warning", ("xid-79",))
    assert into.message == f"gpu.0 (GPU-a): Healthy -> Unhealthy: xid-79: {MESSAGES['xid-79']} (action: reboot-node)"
    out = event_for(_t(2, "Degraded", "Healthy"), "gpu.0")
    assert out is not None and (out.reason, out.type) == ("GPURecovered", "Normal")
    gone = event_for(_t(3, "Unhealthy", ABSENT), "gpu.0")
    assert gone is not None and gone.reason == "GPURemoved"


def test_event_aggregation_counts_repeats_and_paces_each_key() -> None:
    agg = EventAggregator("n1", window_s=600, min_interval_s=10, burst_s=1)
    names = {"GPU-a": "gpu.0"}
    assert agg.observe([_t(1, "Healthy", "Unhealthy", "xid-79"), _t(2, "Unhealthy", "Healthy"),
                        _t(3, "Healthy", "Unhealthy", "xid-79")], names, 0.0) == 3
    due = agg.due(1.0)  # the burst window closed
    assert sorted((e.spec.reason, e.pending) for e in due) == [("GPURecovered", 1), ("GPUUnhealthy", 2)]
    body = agg.create_body(due[0], "uid-1", "default")
    assert body["count"] == due[0].pending and body["involvedObject"] == {
        "apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "uid-1"}
    for e in due:
        agg.created(e, f"ev-{e.spec.reason}", 1.0)
    agg.observe([_t(4, "Unhealthy", "Healthy"), _t(5, "Healthy", "Unhealthy", "xid-79", t=T0 + 5)], names, 5.0)
    assert agg.due(6.0) == [] and agg.next_due() == 11.0  # paced: one request per key per interval
    again = agg.due(11.0)
    unhealthy = next(e for e in again if e.spec.reason == "GPUUnhealthy")
    assert not agg.needs_create(unhealthy, 11.0)
    assert agg.patch_body(unhealthy)["count"] == 3
    assert agg.needs_create(unhealthy, 601.0)  # outside the aggregation window a new Event starts


# Timing primitives ----------------------------------------------------------------------------------------------

def test_token_bucket_allows_one_per_interval() -> None:
    b = TokenBucket(10.0, 1.0, now=0.0)
    assert b.take(0.0) and not b.take(5.0)
    assert b.available_at(5.0) == pytest.approx(10.0)
    assert b.take(10.0) and not b.take(10.0)
    b.refund()
    assert b.take(10.0)


def test_backoff_grows_with_jitter_and_honours_retry_after() -> None:
    b = Backoff(1.0, 60.0, rng=random.Random(7))
    delays = [b.next_delay() for _ in range(10)]
    for n, d in enumerate(delays):
        cap = min(60.0, 2.0 ** n)
        assert cap / 2 <= d <= cap
    assert len({round(d, 6) for d in delays[-3:]}) == 3  # jittered, not lockstep
    b.reset()
    assert b.next_delay(retry_after=30.0) == 30.0


def test_write_scheduler_debounces_from_the_first_change() -> None:
    s = WriteScheduler(1.0, 10.0, Backoff(1.0, 300.0, rng=random.Random(1)), now=0.0)
    assert s.due_at(0.0) == float("inf")
    s.changed(0.2)
    s.changed(0.9)  # the window started at the first change
    assert s.due_at(0.9) == pytest.approx(1.2) and not s.try_start(1.1) and s.try_start(1.2)
    s.succeeded()
    s.changed(2.0)
    assert s.due_at(2.0) == pytest.approx(11.2)  # the bucket, not the debounce, decides now
    s.settled()
    assert s.due_at(3.0) == float("inf")
    s.changed(20.0)
    delay = s.failed(21.0)
    assert s.blocked(21.0) and s.due_at(21.0) == pytest.approx(21.0 + delay)
