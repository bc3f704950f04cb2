"""The mapping of our health onto NVSentinel's health events (plugin/nvsentinel/healthevents.py): every reason code
has a check, states become isFatal/isHealthy, actions become recommended actions, XIDs their numbers, a MIG device's
reasons its parent GPU's, and the diff sends only what NVSentinel does not hold."""

from __future__ import annotations

from dataclasses import replace

import pytest

from api.nvsentinel.platformconnector import health_event_pb2 as pb
from plugin.health.config import DEFAULT_KUBELET_HEALTH
from plugin.health.node_state import DeviceStatus, NodeState, Snapshot
from plugin.health.reasons import REASONS, SPECS, Action, Reason, Source, State
from plugin.nvsentinel.healthevents import (
    AGENT,
    CHECK_NAMES,
    CHECKS,
    DRIVER,
    MEMORY,
    NVML,
    RECOMMENDED,
    THERMAL,
    XID,
    changes,
    check_of,
    gpu_checks,
    mapping_rows,
    pci_address,
    to_event,
)
from tests.fakes.node_devices import gpu, status

NOW = 1_767_225_600.0


def snap(*devices: DeviceStatus) -> Snapshot:
    state = NodeState()
    state.publish(devices, NOW)
    return state.snapshot()


def xid_reason(code: str, severity: State, action: Action, first_seen: float = NOW) -> Reason:
    return Reason(code, severity, f"{code} seen", Source.EVENT, action, first_seen)


def test_every_reason_code_has_a_check() -> None:
    """A new code in REASONS without a row here fails, so it cannot reach NVSentinel unmapped (or not at all)."""
    missing = sorted({s.code for s in REASONS} - set(CHECKS))
    assert not missing, f"reason codes with no NVSentinel check: {missing}"
    assert not set(CHECKS) - {s.code for s in REASONS}, "a row for a code REASONS no longer has"
    assert len(mapping_rows()) == len(REASONS)


def test_check_names_are_ours_and_camel_case() -> None:
    assert set(CHECK_NAMES) == set(CHECKS.values())
    for name in CHECK_NAMES:
        assert name.startswith("GpuHealth") and name.isalnum() and name[0].isupper()


@pytest.mark.parametrize(("code", "check"), [
    ("xid-79", XID), ("xid-13", XID), ("xid-31-repeated", XID), ("xid-154", XID),
    ("ecc-uncorrected", MEMORY), ("row-remap-failure", MEMORY), ("temperature-shutdown", THERMAL),
    ("gpu-lost", DRIVER), ("nvml-error", NVML),
    ("external-gpufallenoffbus", None), ("some-future-code", None),
])
def test_codes_a_device_carries_find_their_check(code: str, check: str | None) -> None:
    assert check_of(code) == check


def test_every_action_has_a_recommended_action() -> None:
    assert set(RECOMMENDED) == set(Action)
    assert RECOMMENDED[Action.REBOOT_NODE] == pb.RESTART_BM
    assert RECOMMENDED[Action.RESET_GPU] == pb.COMPONENT_RESET
    assert RECOMMENDED[Action.CONTACT_SUPPORT] == pb.CONTACT_SUPPORT
    # Remedies NVSentinel does not perform must not start one of its own.
    assert RECOMMENDED[Action.RESTART_APP] == RECOMMENDED[Action.DRAIN] == RECOMMENDED[Action.NONE] == pb.NONE


def test_an_unhealthy_xid_becomes_a_fatal_event_with_the_xid_number() -> None:
    g = replace(gpu(2), pci_bus_id="00000000:17:00.0")
    gpus, checks = gpu_checks(snap(status(g, State.UNHEALTHY, "xid-79")))
    assert gpus == {g.uuid}
    c = checks[(g.uuid, XID)]
    e = to_event(c, node_name="node-a", now=NOW + 0.5, store_only=False)
    assert (e.agent, e.componentClass, e.checkName) == (AGENT, "GPU", XID)
    assert e.isFatal and not e.isHealthy
    assert list(e.errorCode) == ["79"]
    assert e.recommendedAction == pb.RESTART_BM
    # As NVSentinel's GPU monitor names a GPU (its index, PCI address cut to a 4-digit domain, UUID): its GPU reset
    # needs the GPU_UUID entity, and its quarantine matches a recovery by exactly these entities.
    assert [(x.entityType, x.entityValue) for x in e.entitiesImpacted] == [("GPU", str(g.index)),
                                                                         ("PCI", "0000:17:00.0"),
                                                                         ("GPU_UUID", g.uuid)]
    assert e.nodeName == "node-a" and e.version == 1
    assert e.generatedTimestamp.ToNanoseconds() == int((NOW + 0.5) * 1e9)
    assert e.processingStrategy == pb.EXECUTE_REMEDIATION
    assert dict(e.metadata) == {"state": "Unhealthy", "codes": "xid-79", "action": "reboot-node"}
    assert e.message == "XID 79: GPU has fallen off the bus"


def test_degraded_and_unknown_are_not_fatal() -> None:
    g0, g1 = gpu(0), gpu(1)
    _, checks = gpu_checks(snap(status(g0, State.DEGRADED, "thermal-slowdown"), status(g1, State.UNKNOWN,
                                                                                      "nvml-error")))
    thermal = to_event(checks[(g0.uuid, THERMAL)], node_name="n", now=NOW, store_only=False)
    nvml = to_event(checks[(g1.uuid, NVML)], node_name="n", now=NOW, store_only=False)
    assert not thermal.isFatal and not thermal.isHealthy and thermal.recommendedAction == pb.NONE
    assert not nvml.isFatal and not nvml.isHealthy and nvml.recommendedAction == pb.CONTACT_SUPPORT
    assert list(nvml.errorCode) == ["nvml-error"]


def test_a_family_is_one_check_with_all_its_codes_worst_first() -> None:
    g = gpu(0)
    d = status(g, State.UNHEALTHY, "ecc-uncorrected", "thermal-slowdown")
    d = replace(d, reasons=(*d.reasons, Reason("row-remap-pending", State.DEGRADED, "remap pending", Source.POLL,
                                               SPECS["row-remap-pending"].action, NOW)))
    _, checks = gpu_checks(snap(d))
    assert set(checks) == {(g.uuid, MEMORY), (g.uuid, THERMAL)}
    mem = to_event(checks[(g.uuid, MEMORY)], node_name="n", now=NOW, store_only=False)
    assert list(mem.errorCode) == ["ecc-uncorrected", "row-remap-pending"]
    assert mem.message == "2 volatile uncorrected ECC errors (+1 more)"
    assert mem.isFatal and mem.recommendedAction == pb.COMPONENT_RESET


def test_restart_app_and_drain_travel_in_the_metadata() -> None:
    g = gpu(0)
    r = Reason("recovery-action-drain-p2p", State.DEGRADED, "drain p2p", Source.POLL, Action.DRAIN, NOW)
    d = DeviceStatus(g.uuid, g, State.DEGRADED, (r,), NOW, DEFAULT_KUBELET_HEALTH[State.DEGRADED])
    e = to_event(gpu_checks(snap(d))[1][(g.uuid, DRIVER)], node_name="n", now=NOW, store_only=False)
    assert e.recommendedAction == pb.NONE and e.metadata["action"] == "drain"


def test_a_mig_devices_reasons_are_charged_to_its_parent() -> None:
    g = gpu(3, migs=2)
    m0, m1 = g.mig_devices
    x = xid_reason("xid-31-repeated", State.DEGRADED, Action.CONTACT_SUPPORT)
    devs = (status(g), replace(status(g, mig=m0), state=State.DEGRADED, reasons=(x,)),
            replace(status(g, mig=m1), state=State.DEGRADED, reasons=(x,)))
    gpus, checks = gpu_checks(snap(*devs))
    assert gpus == {g.uuid}
    assert list(checks) == [(g.uuid, XID)]
    e = to_event(checks[(g.uuid, XID)], node_name="n", now=NOW, store_only=False)
    assert [x.entityValue for x in e.entitiesImpacted if x.entityType == "GPU_UUID"] == [g.uuid]
    assert list(e.errorCode) == ["31"], "one code though two MIG devices carry it"
    assert "PCI" not in [x.entityType for x in e.entitiesImpacted], "no PCI entity without an address"


def test_store_only() -> None:
    g = gpu(0)
    c = gpu_checks(snap(status(g, State.UNHEALTHY, "xid-79")))[1][(g.uuid, XID)]
    assert to_event(c, node_name="n", now=NOW, store_only=True).processingStrategy == pb.STORE_ONLY


def test_recovery_is_the_same_check_healthy() -> None:
    g = replace(gpu(1), pci_bus_id="0000:3b:00.0")
    _, bad = gpu_checks(snap(status(g, State.UNHEALTHY, "ecc-uncorrected")))
    healthy_gpus, none = gpu_checks(snap(status(g)))
    assert none == {}
    [rec] = changes(bad, healthy_gpus, none)
    e = to_event(rec, node_name="n", now=NOW, store_only=False)
    fault = to_event(bad[(g.uuid, MEMORY)], node_name="n", now=NOW, store_only=False)
    assert e.isHealthy and not e.isFatal and e.recommendedAction == pb.NONE and not e.errorCode
    assert (e.checkName, list(e.entitiesImpacted)) == (fault.checkName, list(fault.entitiesImpacted))


def test_changes_send_only_what_nvsentinel_does_not_hold() -> None:
    g0, g1 = gpu(0), gpu(1)
    gpus, now = gpu_checks(snap(status(g0, State.UNHEALTHY, "xid-79"), status(g1, State.DEGRADED,
                                                                               "thermal-slowdown")))
    assert {c.key for c in changes({}, gpus, now)} == set(now)
    assert changes(now, gpus, now) == []
    assert {c.key for c in changes(now, gpus, now, everything=True)} == set(now), "a resend repeats open checks"
    # Only the message moved (a temperature): no news for NVSentinel.
    moved = {k: replace(c, message=c.message + "!") for k, c in now.items()}
    assert changes(now, gpus, moved) == []
    # A GPU gone from the snapshot: its open check is left as it is, not declared recovered.
    assert changes(now, {g1.uuid}, {(g1.uuid, THERMAL): now[(g1.uuid, THERMAL)]}) == []


@pytest.mark.parametrize(("bus_id", "address"), [
    ("00000000:17:00.0", "0000:17:00.0"),  # NVML's 8-digit domain, cut as NVSentinel's metadata collector cuts it
    ("0000:AB:00.0", "0000:ab:00.0"),
    ("0001:17:00.0", "0001:17:00.0"),
    ("not-a-bus-id", "not-a-bus-id"),
])
def test_pci_addresses_are_written_as_nvsentinel_writes_them(bus_id: str, address: str) -> None:
    assert pci_address(bus_id) == address
