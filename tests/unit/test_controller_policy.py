"""The controller's pure parts: what it keeps of a Node (nodes.py), the quarantine rules (policy.py) and the patches
(patches.py), the last applied as the API server would (JSON merge patch) so that a quarantine and its release are
checked on the Node they leave behind."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from plugin.controller import patches
from plugin.controller.nodes import CONTROLLER, Keys, NodeFacts, facts_of
from plugin.controller.policy import CAPACITY_GAP, REBOOT_REQUIRED, UNHEALTHY_DEVICES, Rules, assess
from tests.fakes.controller_api import T0, P, device, gpu_node, merge_patch, plain_node, rfc

KEYS = Keys(P)
OWN = f"controller.{P}"  # the controller's own record, where the agent's account cannot write
OPERATOR_TAINT = {"key": "example.com/maintenance", "value": "disk", "effect": "NoSchedule"}


def facts(doc: dict[str, Any], keys: Keys = KEYS) -> NodeFacts:
    return facts_of(doc, keys)


def with_rv(doc: dict[str, Any], rv: str = "7") -> dict[str, Any]:
    doc["metadata"]["resourceVersion"] = rv
    return doc


# nodes.py ---------------------------------------------------------------------------------------------------------


def test_gpu_counts_sum_every_nvidia_gpu_and_mig_resource_and_skip_the_rest() -> None:
    doc = plain_node("n")
    doc["status"]["capacity"] = {"cpu": "64", "nvidia.com/gpu": "4", "nvidia.com/gpu.shared": "8",
                                 "nvidia.com/mig-1g.10gb": "7", "example.com/gpu": "9", "nvidia.com/gpu.odd": "1k"}
    doc["status"]["allocatable"] = {"nvidia.com/gpu": "3", "nvidia.com/mig-1g.10gb": "7"}
    f = facts(doc)
    assert (f.gpu_capacity, f.gpu_allocatable) == (19, 10)
    assert f.is_gpu_node and not f.annotated


def test_a_node_is_a_gpu_node_by_capacity_or_by_our_state_annotation() -> None:
    assert not facts(plain_node("cpu")).is_gpu_node
    doc = plain_node("agent-only")
    doc["metadata"]["annotations"] = {f"{P}/state": "Unknown"}
    f = facts(doc)
    assert f.is_gpu_node and f.annotated and f.node_state == "Unknown"


def test_devices_are_read_from_their_keys_only_and_sorted() -> None:
    doc = gpu_node("n", {1: "Unhealthy"}, gpus=2)
    ann = doc["metadata"]["annotations"]
    _, value = device(0, "Degraded", node="n")
    ann[f"{P}/gpu.0.mig.1.0"] = json.dumps({"id": "MIG-a", "parent": "GPU-n-0", "state": "Unhealthy",
                                            "action": "reset-gpu", "since": rfc(T0 + 5),
                                            "reasons": [{"code": "xid-48", "message": "m", "action": "reset-gpu"}]})
    ann[f"{P}/dev.0123456789abcdef"] = json.dumps({"id": "GPU-x", "state": "Healthy", "action": "none"})
    ann[f"{P}/gpu.note"] = "set by hand"  # not a device key: an operator's note under our prefix
    ann[f"{P}/gpu.5"] = "{not json"  # a broken value is skipped, not fatal
    ann[f"{P}/gpu.6"] = "[1, 2]"
    ann["example.com/gpu.7"] = value  # another prefix
    f = facts(doc)
    assert [d.key for d in f.devices] == ["dev.0123456789abcdef", "gpu.0", "gpu.0.mig.1.0", "gpu.1"]
    other, gpu0, mig, gpu1 = f.devices
    assert (mig.state, mig.action, mig.code) == ("Unhealthy", "reset-gpu", "xid-48")
    # A GPU is known by the node's own numbering of the ids: the MIG device is on gpu.0's GPU (GPU-n-0), no other.
    assert mig.gpu == gpu0.gpu and len({other.gpu, gpu0.gpu, gpu1.gpu}) == 3
    assert other.code == "" and gpu1.code == "ecc-uncorrected"
    # The MIG device belongs to GPU 0: three physical GPUs, not four.
    assert f.device_total == 3


def test_the_gpu_total_is_the_agents_count_else_the_entries_and_unknown_once_an_older_agent_truncated() -> None:
    doc = gpu_node("n", gpus=2)  # as an older agent writes it: no count key
    ann = doc["metadata"]["annotations"]
    ann[f"{P}/summary"] = "Unhealthy: 8 devices (6 Healthy, 2 Unhealthy); gpu.2 ..."  # for people: never parsed
    assert facts(doc).device_total == 2
    ann[f"{P}/truncated"] = "6 device entries omitted: over the 65536-byte cap"
    assert facts(doc).device_total is None
    ann[f"{P}/devices"] = '{"total":8,"gpus":8}'
    assert facts(doc).device_total == 8
    del ann[f"{P}/truncated"]
    ann[f"{P}/devices"] = '{"total":1,"gpus":1}'  # never fewer than the entries show
    assert facts(doc).device_total == 2


def test_an_unknown_total_leaves_the_share_rule_out_and_the_count_rule_in() -> None:
    doc = gpu_node("n", {0: "Unhealthy"}, gpus=2)
    doc["metadata"]["annotations"][f"{P}/truncated"] = "6 device entries omitted: over the 65536-byte cap"
    share = Rules(unhealthy_devices=0, unhealthy_fraction=0.5)
    assert assess(facts(doc), share).reason is None
    a = assess(facts(doc), Rules(unhealthy_devices=1))
    assert a.reason == UNHEALTHY_DEVICES and a.message.startswith("1 of an unknown number of GPUs Unhealthy: gpu.0")
    doc["metadata"]["annotations"][f"{P}/devices"] = '{"total":8,"gpus":8}'
    assert assess(facts(doc), Rules(unhealthy_devices=0, unhealthy_fraction=0.125)).reason == UNHEALTHY_DEVICES
    assert assess(facts(doc), share).reason is None


def test_our_quarantine_is_read_only_when_quarantined_by_names_this_controller() -> None:
    ours = {f"{OWN}/quarantined-by": CONTROLLER, f"{OWN}/quarantine-reason": "reboot-required",
            f"{OWN}/quarantined-at": rfc(T0), f"{OWN}/quarantine-owns": "taint, cordon,,label"}
    taint = {"key": f"{P}/quarantine", "value": "reboot-required", "effect": "NoSchedule"}
    f = facts(gpu_node("n", annotations=ours, taints=[taint]))
    assert f.quarantine is not None
    assert (f.quarantine.reason, f.quarantine.at, f.quarantine.owns, f.quarantine.drained) == (
        "reboot-required", T0, frozenset({"taint", "cordon", "label"}), False)
    assert not f.foreign_taint
    someone = facts(gpu_node("n", annotations={**ours, f"{OWN}/quarantined-by": "ops-team"}, taints=[taint]))
    assert someone.quarantine is None and someone.foreign_taint
    drained = facts(gpu_node("n", annotations={**ours, f"{OWN}/quarantine-drained": rfc(T0)}))
    assert drained.quarantine is not None and drained.quarantine.drained


def test_the_agents_prefix_never_makes_a_node_ours() -> None:
    """The admission policy lets the node agent write any annotation under its prefix: a record there, forged or
    left by an older controller, is not ours, and our taint beside it is a foreign one."""
    forged = {f"{P}/quarantined-by": CONTROLLER, f"{P}/quarantine-reason": "reboot-required",
              f"{P}/quarantined-at": rfc(T0), f"{P}/quarantine-owns": "taint,cordon"}
    taint = {"key": f"{P}/quarantine", "value": "reboot-required", "effect": "NoSchedule"}
    f = facts(gpu_node("n", annotations=forged, taints=[taint], unschedulable=True))
    assert f.quarantine is None and f.foreign_taint
    assert KEYS.by == f"controller.{P}/quarantined-by" and KEYS.owner == f"controller.{P}"
    assert all(k.startswith(f"controller.{P}/") for k in KEYS.ours())
    assert KEYS.taint == f"{P}/quarantine" and KEYS.breaker == f"{P}/breaker"


def test_another_prefix_reads_its_own_keys() -> None:
    doc = gpu_node("n", {0: "Unhealthy"})
    f = facts(doc, Keys("example.com"))
    assert not f.annotated and f.devices == ()
    assert Keys("example.com").taint == "example.com/quarantine"


def test_a_heartbeat_leaves_the_decision_key_alone_and_a_device_change_moves_it() -> None:
    a = gpu_node("n")
    b = copy.deepcopy(a)
    b["metadata"]["resourceVersion"] = "999"
    b["status"]["conditions"][0]["lastHeartbeatTime"] = rfc(T0 + 40)
    b["status"]["images"] = [{"names": ["x"], "sizeBytes": 1}]
    assert facts(a).decision_key() == facts(b).decision_key()
    for change in ({"metadata": {"annotations": dict([device(3, "Unhealthy", node="n")])}},
                   {"metadata": {"labels": {"pool": "b"}}}, {"spec": {"unschedulable": True}},
                   {"spec": {"taints": [OPERATOR_TAINT]}}, {"status": {"allocatable": {"nvidia.com/gpu": "7"}}}):
        assert facts(merge_patch(a, change)).decision_key() != facts(a).decision_key(), change


def test_parse_time_accepts_rfc3339_and_nothing_else() -> None:
    from plugin.controller.nodes import parse_time

    assert parse_time("2026-01-01T00:00:00Z") == T0
    assert parse_time("2026-01-01T01:00:00+01:00") == T0
    for bad in ("", "yesterday", None, 5):
        assert parse_time(bad) is None


# policy.py --------------------------------------------------------------------------------------------------------


def test_a_healthy_or_degraded_node_breaks_no_rule_and_is_fit() -> None:
    doc = gpu_node("n", {2: "Degraded"})
    doc["metadata"]["annotations"].update([device(5, action="none", since=None, node="n")])
    a = assess(facts(doc), Rules())
    assert a.reason is None and a.fit


def test_an_unknown_device_is_no_rule_but_not_fit_either() -> None:
    a = assess(facts(gpu_node("n", {3: "Unknown"})), Rules())
    assert a.reason is None and not a.fit


def test_a_node_without_visible_gpus_is_never_fit() -> None:
    stock = gpu_node("n", annotated=False)
    stock["status"]["capacity"] = stock["status"]["allocatable"] = {"cpu": "8"}
    a = assess(facts(stock), Rules())
    assert a.reason is None and not a.fit
    withdrawn = gpu_node("n", gpus=0)  # the agent's state annotation, no device entry, no capacity
    withdrawn["status"]["capacity"] = withdrawn["status"]["allocatable"] = {"cpu": "8"}
    withdrawn["metadata"]["annotations"][f"{P}/state"] = "Healthy"
    assert not assess(facts(withdrawn), Rules()).fit
    # Device entries alone are enough (DRA mode has no extended resource in capacity).
    dra = gpu_node("n")
    dra["status"]["capacity"] = dra["status"]["allocatable"] = {"cpu": "8"}
    assert assess(facts(dra), Rules()).fit


def test_one_unhealthy_gpu_fires_the_default_count_rule() -> None:
    a = assess(facts(gpu_node("n", {6: "Unhealthy"})), Rules())
    assert a.reason == UNHEALTHY_DEVICES and not a.fit
    assert a.message.startswith("1 of 8 GPUs Unhealthy: gpu.6 ecc-uncorrected")


@pytest.mark.parametrize(("count", "fraction", "bad", "fires"), [
    (2, 0.0, 1, False), (2, 0.0, 2, True), (0, 0.0, 8, False),  # count only; 0 turns the rule off
    (0, 0.25, 1, False), (0, 0.25, 2, True), (0, 0.5, 3, False), (0, 0.5, 4, True),  # fraction of 8 GPUs only
    (5, 0.25, 2, True), (2, 0.75, 2, True),  # either one fires it
])
def test_the_count_and_fraction_thresholds(count: int, fraction: float, bad: int, fires: bool) -> None:
    f = facts(gpu_node("n", dict.fromkeys(range(bad), "Unhealthy")))
    a = assess(f, Rules(unhealthy_devices=count, unhealthy_fraction=fraction))
    assert (a.reason == UNHEALTHY_DEVICES) is fires
    assert not a.fit  # a bad device below the thresholds still keeps a quarantined node in


def test_mig_devices_count_once_per_physical_gpu() -> None:
    doc = gpu_node("n", gpus=2)
    ann = doc["metadata"]["annotations"]
    for gi in (1, 2, 3, 4):
        ann[f"{P}/gpu.0.mig.{gi}.0"] = json.dumps({"id": f"MIG-{gi}", "parent": "GPU-n-0", "state": "Unhealthy",
                                                   "action": "reset-gpu"})
    a = assess(facts(doc), Rules(unhealthy_devices=2, unhealthy_fraction=0.5))
    assert a.reason == UNHEALTHY_DEVICES and a.message.startswith("1 of 2 GPUs Unhealthy")
    assert a.message.endswith("gpu.0.mig.3.0 Unhealthy (+1 more)")  # four devices, three shown
    assert assess(facts(doc), Rules(unhealthy_devices=2)).reason is None


def test_reboot_node_fires_first_and_only_for_a_device_not_healthy() -> None:
    f = facts(gpu_node("n", {1: "Unhealthy"}, reboot=(3,)))
    a = assess(f, Rules())
    assert a.reason == REBOOT_REQUIRED and a.message == "reboot-node asked for by gpu.3 xid-79"
    assert assess(f, Rules(reboot_required=False)).reason == UNHEALTHY_DEVICES
    doc = gpu_node("n")
    doc["metadata"]["annotations"].update([device(2, "Healthy", action="reboot-node", node="n")])
    assert assess(facts(doc), Rules()).reason is None


def test_capacity_gap_only_for_nodes_without_our_annotations() -> None:
    stock = facts(gpu_node("n", annotated=False, allocatable=6))
    a = assess(stock, Rules())
    assert a.reason == CAPACITY_GAP and "2 of 8 GPUs not allocatable" in a.message and not a.fit
    assert assess(stock, Rules(capacity_gap=3)).reason is None
    assert assess(stock, Rules(capacity_gap=2)).reason == CAPACITY_GAP
    assert assess(stock, Rules(capacity_gap=0)).reason is None  # off
    healthy = assess(facts(gpu_node("n", annotated=False)), Rules())
    assert healthy.reason is None and healthy.fit
    # Our annotations are the better signal: a gap on an annotated node (e.g. GPUs held back for MIG) is no rule.
    assert assess(facts(gpu_node("n", allocatable=0)), Rules()).reason is None


# patches.py -------------------------------------------------------------------------------------------------------


def apply(doc: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """As the API server applies a merge patch whose resourceVersion matched: the version moves on."""
    assert patch["metadata"]["resourceVersion"] == doc["metadata"]["resourceVersion"]
    out: dict[str, Any] = merge_patch(doc, patch)
    out["metadata"]["resourceVersion"] = str(int(doc["metadata"]["resourceVersion"]) + 1)
    return out


def quarantine(doc: dict[str, Any], cordon: bool = False, label: str = "") -> dict[str, Any]:
    p = patches.quarantine(facts(doc), KEYS, reason="reboot-required", message="reboot-node asked for by gpu.3",
                           now=rfc(T0), cordon=cordon, label=label)
    return apply(doc, p)


def release(doc: dict[str, Any]) -> dict[str, Any]:
    return apply(doc, patches.release(facts(doc), KEYS))


def without_rv(doc: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    del out["metadata"]["resourceVersion"]
    # The API server omits empty and false fields; the fake keeps what a patch sent.
    for key in ("taints", "unschedulable"):
        if out["spec"].get(key) in ([], False):
            del out["spec"][key]
    return out


def test_quarantine_adds_our_taint_and_records_what_it_added() -> None:
    before = with_rv(gpu_node("n", taints=[OPERATOR_TAINT]))
    after = quarantine(before, cordon=True, label=f"{P}/quarantined=true")
    assert after["spec"]["taints"] == [OPERATOR_TAINT, {"key": f"{P}/quarantine", "value": "reboot-required",
                                                         "effect": "NoSchedule"}]
    assert after["spec"]["unschedulable"] is True
    assert after["metadata"]["labels"] == {f"{P}/quarantined": "true"}
    ann = after["metadata"]["annotations"]
    assert ann[f"{OWN}/quarantined-by"] == CONTROLLER
    assert ann[f"{OWN}/quarantine-reason"] == "reboot-required"
    assert ann[f"{OWN}/quarantine-message"] == "reboot-node asked for by gpu.3"
    assert ann[f"{OWN}/quarantined-at"] == "2026-01-01T00:00:00Z"
    assert ann[f"{OWN}/quarantine-owns"] == "taint,cordon,label"
    assert ann[f"{OWN}/quarantine-label"] == f"{P}/quarantined=true"
    f = facts(after)
    assert f.quarantine is not None and f.quarantine.owns == {"taint", "cordon", "label"} and f.quarantine.at == T0
    assert f.quarantine.label == f"{P}/quarantined=true"


def test_quarantine_owns_nothing_an_operator_had_set_already() -> None:
    mine = {"key": f"{P}/quarantine", "value": "manual", "effect": "NoSchedule"}
    before = with_rv(gpu_node("n", taints=[mine], unschedulable=True, labels={f"{P}/quarantined": "by-hand"}))
    after = quarantine(before, cordon=True, label=f"{P}/quarantined=true")
    assert after["spec"]["taints"] == [mine]  # not a second taint of the same key and effect
    assert after["metadata"]["labels"] == {f"{P}/quarantined": "by-hand"}
    assert after["metadata"]["annotations"][f"{OWN}/quarantine-owns"] == ""
    assert without_rv(release(after)) == without_rv(before)


@pytest.mark.parametrize("cordon", [False, True])
@pytest.mark.parametrize("label", ["", f"{P}/quarantined=true", "example.com/out="])
def test_release_restores_the_node_exactly_as_it_was(cordon: bool, label: str) -> None:
    before = with_rv(gpu_node("n", taints=[OPERATOR_TAINT], labels={"pool": "a"},
                              annotations={f"{P}/note": "kept", "example.com/owner": "ops"}))
    q = quarantine(before, cordon=cordon, label=label)
    assert q != before
    assert without_rv(release(q)) == without_rv(before)


def test_release_leaves_taints_added_after_the_quarantine() -> None:
    q = quarantine(with_rv(gpu_node("n")))
    lifecycle = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}
    q = merge_patch(q, {"spec": {"taints": [*q["spec"]["taints"], lifecycle]}})
    assert release(q)["spec"]["taints"] == [lifecycle]


def test_a_cordon_an_operator_added_during_the_quarantine_is_theirs() -> None:
    q = merge_patch(quarantine(with_rv(gpu_node("n"))), {"spec": {"unschedulable": True}})
    assert release(q)["spec"]["unschedulable"] is True


def test_every_patch_carries_the_resource_version_it_was_decided_on() -> None:
    doc = with_rv(gpu_node("n"), "41")
    q = quarantine(doc)
    f = facts(q)
    for p in (patches.no_execute(f, KEYS, reason="r", now=rfc(T0)), patches.drained(f, KEYS, now=rfc(T0)),
              patches.release(f, KEYS)):
        assert p["metadata"]["resourceVersion"] == "42"


def test_no_execute_adds_a_second_taint_once_and_release_takes_both() -> None:
    before = with_rv(gpu_node("n", taints=[OPERATOR_TAINT]))
    q = quarantine(before)
    ne = apply(q, patches.no_execute(facts(q), KEYS, reason="reboot-required", now=rfc(T0 + 300)))
    assert ne["spec"]["taints"][1:] == [
        {"key": f"{P}/quarantine", "value": "reboot-required", "effect": "NoSchedule"},
        {"key": f"{P}/quarantine", "value": "reboot-required", "effect": "NoExecute", "timeAdded": rfc(T0 + 300)}]
    assert ne["metadata"]["annotations"][f"{OWN}/quarantine-owns"] == "noexecute,taint"
    again = patches.no_execute(facts(ne), KEYS, reason="reboot-required", now=rfc(T0 + 600))
    assert again["spec"]["taints"] == ne["spec"]["taints"]
    assert without_rv(release(ne)) == without_rv(before)


def test_an_operators_no_execute_taint_of_our_key_outlives_the_release() -> None:
    q = quarantine(with_rv(gpu_node("n")))
    theirs = {"key": f"{P}/quarantine", "value": "manual", "effect": "NoExecute"}
    q = merge_patch(q, {"spec": {"taints": [*q["spec"]["taints"], theirs]}})
    ne = patches.no_execute(facts(q), KEYS, reason="reboot-required", now=rfc(T0))
    assert ne["spec"]["taints"] == q["spec"]["taints"]  # theirs already does it: nothing added, nothing owned
    assert ne["metadata"]["annotations"][f"{OWN}/quarantine-owns"] == "taint"
    assert release(apply(q, ne))["spec"]["taints"] == [theirs]


def test_drained_marks_the_node_and_release_clears_the_mark() -> None:
    q = quarantine(with_rv(gpu_node("n")))
    d = apply(q, patches.drained(facts(q), KEYS, now=rfc(T0 + 60)))
    assert d["metadata"]["annotations"][f"{OWN}/quarantine-drained"] == rfc(T0 + 60)
    f = facts(d)
    assert f.quarantine is not None and f.quarantine.drained
    assert f"{OWN}/quarantine-drained" not in release(d)["metadata"]["annotations"]
