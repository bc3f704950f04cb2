"""The node condition's reason styles (plugin/outlets/condition_reasons.py): the EKS names for every XID class and
reason code the health engine knows, which reason a node with several faulty GPUs is named by, ``ours`` unchanged,
and the option's bad values refused in one line."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from plugin.config import OPTIONS, ConfigError, load
from plugin.devices.model import EventKind, GpuEvent
from plugin.health.config import APPLICATION_XIDS, DEGRADED_XIDS, FATAL_XIDS, HealthConfig
from plugin.health.node_state import DeviceStatus, NodeState, Snapshot
from plugin.health.policy import classify_event
from plugin.health.reasons import REASONS, SPECS, Action, Reason, ReasonSpec, Source, State
from plugin.outlets.condition import desired_condition
from plugin.outlets.condition_reasons import EKS_GENERIC, EKS_NAMES, OURS, STYLES, condition_reason, eks_name
from tests.fakes.node_devices import gpu, status

T0 = 1_767_225_600.0
# The API server's rule for a condition reason (metav1.Condition, also what kubectl and controllers expect of a
# node condition's): a letter, then letters, digits, '_', ',' or ':', not ending in ',' or ':'; at most 1024. EKS
# names are CamelCase on top: an upper-case letter first, no separators.
API_REASON = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")
CAMEL = re.compile(r"[A-Z][A-Za-z0-9]*")


def valid_eks_reason(name: str) -> bool:
    return len(name) <= 1024 and API_REASON.fullmatch(name) is not None and CAMEL.fullmatch(name) is not None


def r(code: str, severity: State, action: Action = Action.RESET_GPU, first_seen: float = T0) -> Reason:
    return Reason(code, severity, f"{code} seen", Source.POLL, action, first_seen)


# One XID of each class the REASONS table documents, with the class's default membership (health/config.py).
UNKNOWN_XID = 999
assert UNKNOWN_XID not in FATAL_XIDS | DEGRADED_XIDS | APPLICATION_XIDS


def xid_of_class(row_code: str, xid_class: str) -> int:
    if "<n>" not in row_code:
        return int(row_code.split("-")[1])  # a row of one XID's own (xid-79)
    return {"fatal": min(FATAL_XIDS - {64, 79, 95}), "degraded": min(DEGRADED_XIDS),
            "application": min(APPLICATION_XIDS), "unknown": UNKNOWN_XID}[xid_class]


@pytest.mark.parametrize("row", [s for s in REASONS if s.xid_class], ids=lambda s: f"{s.code}-{s.xid_class}")
def test_every_xid_class_gets_the_eks_xid_name_through_the_real_policy(row: ReasonSpec) -> None:
    """Each XID row of REASONS: the policy's own condition for an XID of that class, as a device reason, names the
    XID's number, an Error when it made the device Unhealthy and a Warning otherwise."""
    n = xid_of_class(row.code, row.xid_class)
    _, cond = classify_event(GpuEvent("GPU-1", EventKind.XID, n, T0), HealthConfig())
    assert cond is not None, row
    reason = Reason.of(cond, T0)
    name = eks_name(reason)
    assert name == f"NvidiaXID{n}{'Error' if cond.severity is State.UNHEALTHY else 'Warning'}"
    assert valid_eks_reason(name)
    # A fatal XID makes the node's condition False under the XID's own name.
    if row.xid_class == "fatal":
        assert condition_reason("eks", "False", reason) == f"NvidiaXID{n}Error"


def test_an_unhealthy_severity_xid_is_an_error_whatever_its_class() -> None:
    # An override can make a repeated application XID Unhealthy: the name follows the severity the device got.
    assert eks_name(r("xid-13-repeated", State.UNHEALTHY)) == "NvidiaXID13Error"
    assert eks_name(r("xid-13-repeated", State.DEGRADED)) == "NvidiaXID13Warning"
    assert eks_name(r("xid-48", State.UNHEALTHY)) == "NvidiaXID48Error"


def test_every_reason_code_gets_a_valid_eks_reason_and_the_table_has_no_stale_codes() -> None:
    assert set(EKS_NAMES) <= set(SPECS), sorted(set(EKS_NAMES) - set(SPECS))
    for spec in SPECS.values():
        status_ = "False" if spec.severity is State.UNHEALTHY else "Unknown"
        name = condition_reason("eks", status_, r(spec.code, spec.severity, spec.action))
        assert valid_eks_reason(name), (spec.code, name)
        assert name == EKS_NAMES.get(spec.code, eks_name(r(spec.code, spec.severity)) or EKS_GENERIC[status_])
    for name in [*EKS_GENERIC.values(), *EKS_NAMES.values(), *OURS.values()]:
        assert valid_eks_reason(name), name


@pytest.mark.parametrize(("code", "severity", "status_", "expected"), [
    ("ecc-uncorrected", State.UNHEALTHY, "False", "NvidiaDoubleBitError"),
    ("nvlink-down", State.UNHEALTHY, "False", "NvidiaNVLinkError"),
    ("row-remap-failure", State.UNHEALTHY, "False", "NvidiaPageRetirement"),
    ("gpu-lost", State.UNHEALTHY, "False", "NvidiaDeviceCountMismatch"),
    ("temperature-shutdown", State.UNHEALTHY, "False", "NvidiaThermalError"),
    ("fabric-unhealthy", State.UNHEALTHY, "False", "NvidiaFabricError"),
    # No EKS name: the generic one of the status.
    ("recovery-action-reboot", State.UNHEALTHY, "False", "NvidiaGPUUnhealthy"),
    ("external-dcgm-health", State.UNHEALTHY, "False", "NvidiaGPUUnhealthy"),
    ("nvml-error", State.UNKNOWN, "Unknown", "NvidiaGPUStateUnknown"),
])
def test_eks_names_of_our_other_codes(code: str, severity: State, status_: str, expected: str) -> None:
    assert condition_reason("eks", status_, r(code, severity)) == expected


def test_healthy_and_reasonless_conditions_take_the_generic_names() -> None:
    assert condition_reason("eks", "True", None) == "NvidiaGPUIsReady"
    # A healthy condition never takes a fault's name, even if a Degraded device has one.
    assert condition_reason("eks", "True", r("thermal-slowdown", State.DEGRADED)) == "NvidiaGPUIsReady"
    assert condition_reason("eks", "False", None) == "NvidiaGPUUnhealthy"
    assert condition_reason("eks", "Unknown", None) == "NvidiaGPUStateUnknown"


def test_ours_is_unchanged_whatever_the_reason() -> None:
    for worst in (None, r("xid-79", State.UNHEALTHY), r("nvml-error", State.UNKNOWN)):
        assert [condition_reason("ours", s, worst) for s in ("False", "Unknown", "True")] == \
            ["GPUUnhealthy", "GPUStateUnknown", "GPUsHealthy"]


def snapshot(*devices: DeviceStatus) -> Snapshot:
    s = NodeState()
    s.publish(list(devices), T0)
    return s.snapshot()


def _replace(d: DeviceStatus, reasons: tuple[Reason, ...]) -> DeviceStatus:
    return dataclasses.replace(d, reasons=reasons)


def test_several_faulty_gpus_name_the_node_by_the_worst_reason_and_keep_our_message() -> None:
    ecc = r("ecc-uncorrected", State.UNHEALTHY, Action.RESET_GPU, first_seen=T0 - 60)
    bus = r("xid-79", State.UNHEALTHY, Action.REBOOT_NODE)
    hot = r("thermal-slowdown", State.DEGRADED, Action.NONE, first_seen=T0 - 600)
    snap = snapshot(status(gpu(0)), _replace(status(gpu(1), State.UNHEALTHY), (ecc,)),
                    _replace(status(gpu(2), State.DEGRADED), (hot,)),
                    _replace(status(gpu(3), State.UNHEALTHY), (bus,)))
    eks = desired_condition(snap, "AcceleratedHardwareReady", "eks")
    ours = desired_condition(snap, "AcceleratedHardwareReady")
    # Both Unhealthy; the node reboot XID 79 asks for is the heavier action, so it names the node, though the ECC
    # fault came first. The Degraded GPU sets nothing.
    assert (eks.type, eks.status, eks.reason) == ("AcceleratedHardwareReady", "False", "NvidiaXID79Error")
    assert eks.message == ours.message and "gpu.1" in eks.message and "gpu.3" in eks.message
    assert ours.reason == "GPUUnhealthy"
    # Two equally heavy faults: the one seen first.
    early = r("nvlink-down", State.UNHEALTHY, Action.RESET_GPU, first_seen=T0 - 3600)
    snap2 = snapshot(_replace(status(gpu(1), State.UNHEALTHY), (ecc,)), _replace(status(gpu(4), State.UNHEALTHY),
                                                                                 (early,)))
    assert desired_condition(snap2, "AcceleratedHardwareReady", "eks").reason == "NvidiaNVLinkError"
    healthy = desired_condition(snapshot(status(gpu(0)), _replace(status(gpu(2), State.DEGRADED), (hot,))),
                                "AcceleratedHardwareReady", "eks")
    assert (healthy.status, healthy.reason) == ("True", "NvidiaGPUIsReady")


# The option ---------------------------------------------------------------------------------------------------

def test_the_option_offers_exactly_the_styles_the_table_knows() -> None:
    opt = next(o for o in OPTIONS if o.name == "node_condition_reasons")
    assert opt.choices == STYLES and (opt.flag, opt.key) == ("--node-condition-reasons", "plugin.nodeConditionReasons")
    assert load({}, {}, None).node_condition_reasons == "ours"
    assert load({}, {"GPU_HEALTH_NODE_CONDITION_REASONS": "eks"}, None).node_condition_reasons == "eks"


def test_a_bad_style_is_refused_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load({"node_condition_reasons": "aws"}, {}, None)
    assert err.value.field == "--node-condition-reasons"
    r_ = subprocess.run([sys.executable, "-m", "plugin", "run", "--node-condition-reasons", "EKS"],
                        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert r_.returncode == 2 and "Traceback" not in r_.stderr
    lines = r_.stderr.strip().splitlines()
    assert len(lines) == 1 and "--node-condition-reasons" in lines[0] and "'EKS'" in lines[0], r_.stderr
    f = tmp_path / "c.yaml"
    f.write_text("version: v1\nplugin:\n  nodeConditionReasons: gke\n")
    r_ = subprocess.run([sys.executable, "-m", "plugin", "run", "--config", str(f)], capture_output=True, text=True,
                        timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert r_.returncode == 2 and len(r_.stderr.strip().splitlines()) == 1
    assert "plugin.nodeConditionReasons" in r_.stderr


@pytest.mark.parametrize("kubelets", ["Ready", "MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable"])
def test_a_kubelet_condition_type_is_refused_at_start_in_one_line(kubelets: str) -> None:
    r_ = subprocess.run([sys.executable, "-m", "plugin", "run", "--node-condition-type", kubelets],
                        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    lines = r_.stderr.strip().splitlines()
    assert r_.returncode == 2 and len(lines) == 1, r_.stderr
    assert "--node-condition-type" in lines[0] and "kubelet" in lines[0]
