"""The device API mapping both ways, on plain values: our state -> our one condition and the status written back with
every other provider's conditions kept; other providers' conditions -> external reasons, malformed ones refused."""

from __future__ import annotations

import pytest

from plugin.health.reasons import Action, Reason, Source, State
from plugin.nvsentinel.gpuconditions import (
    CODE_MAX,
    CONDITION_TYPE,
    EXTERNAL_SEVERITY,
    MESSAGE_MAX,
    GpuCondition,
    camel,
    differs,
    external_code,
    external_reasons,
    merged_status,
    physical,
    verdict,
)
from plugin.outlets.metrics import label_code


def reason(code: str, severity: State, action: Action = Action.RESET_GPU, seen: float = 1.0,
           message: str = "m") -> Reason:
    return Reason(code, severity, message, Source.POLL, action, seen)


@pytest.mark.parametrize(("code", "word"), [("ecc-uncorrected", "EccUncorrected"), ("xid-79", "Xid79"),
                                            ("xid-13-repeated", "Xid13Repeated"), ("gpu-lost", "GpuLost")])
def test_a_reason_code_becomes_an_upper_camel_case_reason(code: str, word: str) -> None:
    assert camel(code) == word


def test_each_state_maps_to_one_status_and_the_worst_reason_names_the_condition() -> None:
    assert verdict(State.HEALTHY, ()) == verdict(State.HEALTHY, ())
    healthy = verdict(State.HEALTHY, ())
    assert (healthy.status, healthy.reason, healthy.action) == ("True", "Healthy", "")
    bad = verdict(State.UNHEALTHY, (reason("xid-79", State.UNHEALTHY, Action.REBOOT_NODE, message="fell off"),
                                    reason("thermal-slowdown", State.DEGRADED, Action.NONE)))
    assert (bad.status, bad.reason, bad.action) == ("False", "Xid79", "reboot-node")
    assert bad.message == "Unhealthy: xid-79: fell off (+1 more)"
    degraded = verdict(State.DEGRADED, (reason("thermal-slowdown", State.DEGRADED, Action.NONE),))
    assert (degraded.status, degraded.reason, degraded.action) == ("False", "ThermalSlowdown", "")
    unknown = verdict(State.UNKNOWN, (reason("nvml-error", State.UNKNOWN, Action.CONTACT_SUPPORT),))
    assert (unknown.status, unknown.action) == ("Unknown", "contact-support")
    assert verdict(State.UNKNOWN, ()).reason == "Unknown"


def test_a_mig_devices_fault_is_charged_to_its_physical_gpu() -> None:
    xid = reason("xid-79", State.UNHEALTHY)
    gpus = physical([("GPU-a", State.HEALTHY, ()), ("GPU-a", State.UNHEALTHY, (xid,)),
                     ("GPU-a", State.UNHEALTHY, (xid,)), ("GPU-b", State.HEALTHY, ())])
    assert gpus == {"GPU-a": (State.UNHEALTHY, (xid,)), "GPU-b": (State.HEALTHY, ())}


def test_our_condition_is_replaced_and_every_other_providers_kept() -> None:
    theirs = GpuCondition("NVMLReady", "False", "XidError", "XID 79", 50.0)
    ours_before = GpuCondition(CONDITION_TYPE, "True", "Healthy", "Healthy", 10.0)
    v = verdict(State.UNHEALTHY, (reason("xid-79", State.UNHEALTHY, Action.REBOOT_NODE),))
    conditions, action = merged_status([ours_before, theirs], "", v, 100.0, "")
    assert conditions == (theirs, v.condition(100.0))
    assert action == "reboot-node"


def test_our_transition_time_moves_only_with_our_status() -> None:
    before = GpuCondition(CONDITION_TYPE, "False", "Xid79", "old message", 10.0)
    v = verdict(State.UNHEALTHY, (reason("ecc-uncorrected", State.UNHEALTHY),))
    (c,), _ = merged_status([before], "", v, 100.0, "")
    assert c.last_transition == 10.0 and c.reason == "EccUncorrected"
    (c,), _ = merged_status([before], "", verdict(State.HEALTHY, ()), 100.0, "")
    assert c.last_transition == 100.0


def test_another_providers_recommended_action_is_never_overwritten_and_ours_is_cleared_when_healed() -> None:
    v = verdict(State.UNHEALTHY, (reason("xid-79", State.UNHEALTHY, Action.REBOOT_NODE),))
    assert merged_status([], "drain-and-page-someone", v, 1.0, "")[1] == "drain-and-page-someone"
    assert merged_status([], "reset-gpu", v, 1.0, "reset-gpu")[1] == "reboot-node"  # ours from before
    assert merged_status([], "reboot-node", verdict(State.HEALTHY, ()), 1.0, "reboot-node")[1] == ""
    # After our own restart we do not know what we wrote: one of our actions beside our condition is ours.
    ours = GpuCondition(CONDITION_TYPE, "False", "Xid79", "m", 1.0)
    assert merged_status([ours], "reboot-node", verdict(State.HEALTHY, ()), 1.0, None)[1] == ""
    assert merged_status([], "reboot-node", verdict(State.HEALTHY, ()), 1.0, None)[1] == "reboot-node"


def test_differs_only_when_the_server_lacks_what_we_want() -> None:
    v = verdict(State.UNHEALTHY, (reason("xid-79", State.UNHEALTHY, Action.REBOOT_NODE),))
    there = [GpuCondition("NVMLReady", "True", "Ok", ""), v.condition(5.0)]
    assert not differs(there, "reboot-node", v, "reboot-node")
    assert not differs(there, "someone-elses", v, "")  # the action field is not ours to write
    assert differs(there, "", v, "")
    assert differs([there[0]], "reboot-node", v, "reboot-node")  # our condition gone (a server restart)


# Consumer --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("ctype", "code"), [
    ("NVMLReady", "external-nvml-ready"),
    ("DCGMHealth", "external-dcgm-health"),
    ("example.com/DiskOK", "external-example-com-disk-ok"),
    ("  weird__Type!!", "external-weird-type"),
])
def test_an_external_code_is_the_type_readable_in_lowercase_dashes(ctype: str, code: str) -> None:
    assert external_code(ctype) == code


def test_an_external_code_is_bounded_and_always_a_valid_label() -> None:
    code = external_code("very.long.domain.example.com/" + "Segment" * 20)
    assert len(code) <= CODE_MAX and label_code(code) == code


def test_the_severity_rule_is_one_table_true_is_fine() -> None:
    assert dict(EXTERNAL_SEVERITY) == {"False": State.UNHEALTHY, "Unknown": State.UNKNOWN}
    conditions = [GpuCondition("NVMLReady", "False", "XidError", "XID 79 on this GPU"),
                  GpuCondition("DCGMHealth", "Unknown", "", "no answer"),
                  GpuCondition("Fine", "True", "Ok", "all good")]
    reasons, rejected = external_reasons("gpu-a", conditions, "reboot-node", {}, 7.0)
    assert rejected == ()
    assert [(r.code, r.severity, r.action, r.source, r.first_seen) for r in reasons] == [
        ("external-nvml-ready", State.UNHEALTHY, Action.REBOOT_NODE, Source.EXTERNAL, 7.0),
        ("external-dcgm-health", State.UNKNOWN, Action.REBOOT_NODE, Source.EXTERNAL, 7.0)]
    assert reasons[0].message == "NVMLReady False: XidError: XID 79 on this GPU"


def test_an_action_that_is_not_ours_becomes_contact_support_and_first_seen_is_kept() -> None:
    c = [GpuCondition("NVMLReady", "False", "XidError", "x")]
    (r,), _ = external_reasons("gpu-a", c, "call-the-vendor", {"external-nvml-ready": 3.0}, 9.0)
    assert r.action is Action.CONTACT_SUPPORT and r.first_seen == 3.0
    (r,), _ = external_reasons("gpu-a", c, "none", {}, 9.0)
    assert r.action is Action.CONTACT_SUPPORT


def test_our_own_condition_and_the_aggregate_are_never_read_back() -> None:
    c = [GpuCondition(CONDITION_TYPE, "False", "Xid79", "ours"), GpuCondition("Ready", "False", "NotReady", "agg")]
    assert external_reasons("gpu-a", c, "reboot-node", {}, 1.0) == ((), ())


def test_a_malformed_condition_is_refused_alone_and_the_rest_taken() -> None:
    good = GpuCondition("NVMLReady", "False", "XidError", "x")
    conditions = [GpuCondition("", "False", "R", "m"), GpuCondition("Other", "Maybe", "R", "m"),
                  GpuCondition("Binary", "False", "R", "bytes \udcff that were not UTF-8"),
                  GpuCondition("Huge", "False", "R", "x" * 100_000), good]
    reasons, rejected = external_reasons("gpu-a", conditions, "", {}, 1.0)
    assert [r.code for r in reasons] == ["external-nvml-ready"]
    assert [r.kind for r in rejected] == ["empty-type", "bad-status", "bad-message", "bad-message"]
    assert "Maybe" in rejected[1].detail and "gpu-a" in rejected[1].detail


def test_a_long_message_is_kept_truncated_and_control_characters_blanked() -> None:
    (r,), _ = external_reasons("g", [GpuCondition("T", "False", "R", "line\nbreak " + "y" * 1000)], "", {}, 1.0)
    assert len(r.message) == MESSAGE_MAX and "\n" not in r.message and r.message.endswith("…")
