"""The DRA ResourceSlice, the pure part: devices and their attributes from the GPUs, taints from health, and what
the writer needs to write only on a change (the comparison with the server's copy, the pool generation)."""

from __future__ import annotations

import copy
import json
import re
import time
from dataclasses import replace
from typing import Any

import kubernetes_validate
import pytest

from plugin.devices.model import Gpu
from plugin.devices.simulated import builtin_node, parse_node
from plugin.dra import slices as rs
from plugin.health.node_state import DeviceStatus, NodeState
from plugin.health.reasons import Action, KubeletHealth, Reason, Source, State
from plugin.validation import FieldError, is_dns_subdomain, is_qualified_name
from tests.fakes.node_devices import gpu, status

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z
D = rs.DRIVER
NODE = "gpu-node-1"
SETTINGS = rs.SliceSettings(node_name=NODE)

# The API server's own rules, written out here rather than taken from the module under test (apimachinery's
# IsDNS1123Label, IsValidLabelValue and IsCIdentifier).
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ATTRIBUTE_TYPES = {"int", "bool", "string", "version"}


def sim_gpus() -> list[Gpu]:
    return [s.gpu for s in parse_node(builtin_node())]


def healthy(gpus: list[Gpu]) -> dict[str, DeviceStatus]:
    return {g.uuid: status(g, since=T0) for g in gpus}


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def as_stored(obj: dict[str, Any], generation: int = 1, **labels: str) -> dict[str, Any]:
    """``obj`` as a GET returns it: with the fields the API server adds, and labels another writer put on."""
    stored = copy.deepcopy(obj)
    stored["spec"]["pool"]["generation"] = generation
    stored["metadata"].update({"resourceVersion": "4711", "uid": "0b6e-uid", "generation": 9,
                               "creationTimestamp": "2026-01-01T00:00:00Z",
                               "managedFields": [{"manager": "gpu-health-device-plugin", "operation": "Update"}]})
    stored["metadata"]["labels"] = {**stored["metadata"].get("labels", {}), **labels}
    return stored


def devices(obj: dict[str, Any]) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = obj["spec"]["devices"]
    return result


def taints(obj: dict[str, Any], index: int) -> list[dict[str, str]]:
    result: list[dict[str, str]] = devices(obj)[index].get("taints", [])
    return result


# The devices -----------------------------------------------------------------------------------------------------

def test_the_simulated_node_is_one_slice_of_eight_gpus_with_their_attributes_and_memory() -> None:
    gpus = sim_gpus()
    obj = rs.desired_slice(gpus, healthy(gpus), SETTINGS)
    assert (obj["apiVersion"], obj["kind"]) == ("resource.k8s.io/v1", "ResourceSlice")
    assert obj["metadata"]["name"] == f"{NODE}-{D}"
    assert obj["spec"]["driver"] == D and obj["spec"]["nodeName"] == NODE
    assert obj["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    devs = devices(obj)
    assert [d["name"] for d in devs] == [f"gpu-{i}" for i in range(8)]
    for g, d in zip(gpus, devs, strict=True):
        assert d["attributes"] == {
            f"{D}/uuid": {"string": g.uuid},
            f"{D}/type": {"string": "gpu"},
            f"{D}/index": {"int": g.index},
            f"{D}/productName": {"string": "NVIDIA H100 80GB HBM3"},
            f"{D}/numaNode": {"int": 0 if g.index < 4 else 1},
            f"{D}/nvlinkIsland": {"int": 0 if g.index < 4 else 4},
            f"{D}/pcieSwitch": {"string": f"sw{g.index // 2}"},
            f"{D}/pciBusID": {"string": g.pci_bus_id},
        }
        assert d["capacity"] == {f"{D}/memory": {"value": "81559Mi"}}
        assert "taints" not in d
    islands = {d["attributes"][f"{D}/nvlinkIsland"]["int"] for d in devs}
    assert len(islands) == 2  # two NVLink islands of four, as the built-in node is wired


def test_devices_are_in_index_order_whatever_the_discovery_order() -> None:
    gpus = sim_gpus()
    shuffled = gpus[5:] + gpus[:5]
    assert dumps(rs.desired_slice(shuffled, healthy(gpus), SETTINGS)) == \
        dumps(rs.desired_slice(gpus, healthy(gpus), SETTINGS))


def test_unknown_topology_is_left_out_and_long_strings_are_cut_to_the_api_limit() -> None:
    g = Gpu(uuid="GPU-x", index=0, name="N" * 70 + "\u00e9", numa_node=None, memory_mib=0, pci_bus_id="",
            pcie_switch=None)
    d = devices(rs.desired_slice([g], {}, SETTINGS))[0]
    assert set(d["attributes"]) == {f"{D}/uuid", f"{D}/type", f"{D}/index", f"{D}/productName",
                                    f"{D}/nvlinkIsland"}
    assert d["attributes"][f"{D}/productName"]["string"] == "N" * 64
    assert "capacity" not in d  # no memory reading: no capacity rather than a zero one


def test_attribute_names_and_values_keep_to_the_api_rules() -> None:
    gpus = sim_gpus()
    g = replace(gpus[0], name="\u00e9" * 40)  # two bytes each: a cut must not split a character
    for d in devices(rs.desired_slice([g, *gpus[1:]], healthy(gpus), SETTINGS)):
        assert len(d["attributes"]) + len(d.get("capacity", {})) <= rs.MAX_ATTRIBUTES
        for name in [*d["attributes"], *d.get("capacity", {})]:
            domain, _, ident = name.partition("/")
            assert domain == D and len(domain) <= 63 and is_dns_subdomain(domain)
            assert C_IDENTIFIER.fullmatch(ident) and len(ident) <= 32, name
        for value in d["attributes"].values():
            assert len(value) == 1 and set(value) <= ATTRIBUTE_TYPES  # exactly one of int/bool/string/version
            if "string" in value:
                assert len(value["string"].encode()) <= 64
    cut = devices(rs.desired_slice([g], {}, SETTINGS))[0]["attributes"][f"{D}/productName"]["string"]
    assert cut == "\u00e9" * 32


@pytest.mark.parametrize(("links", "want"), [
    ({0: (1,), 1: (0,), 2: ()}, {0: 0, 1: 0, 2: 2}),  # a GPU without peers is its own island
    ({0: (), 1: (2,), 2: (), 3: (2,)}, {0: 0, 1: 1, 2: 1, 3: 1}),  # a link counts from either end
    ({0: (7,), 1: ()}, {0: 0, 1: 1}),  # a peer not on the node joins nothing
    ({3: (2,), 2: (1,), 1: ()}, {1: 1, 2: 1, 3: 1}),  # a chain is one island, named by its lowest index
])
def test_nvlink_islands_are_the_connected_components(links: dict[int, tuple[int, ...]],
                                                    want: dict[int, int]) -> None:
    gpus = [Gpu(uuid=f"GPU-{i}", index=i, nvlink_peers=p) for i, p in links.items()]
    assert rs.nvlink_islands(gpus) == want


@pytest.mark.parametrize(("mib", "want"), [(81559, "81559Mi"), (81920, "80Gi"), (1536, "1536Mi"),
                                           (1024 * 1024, "1Ti"), (3 * 1024 ** 4, "3Ei")])
def test_memory_is_written_as_the_api_server_writes_a_quantity_back(mib: int, want: str) -> None:
    assert rs.memory_quantity(mib) == want


def test_device_names_are_dns_labels_and_fall_back_to_a_hash_on_a_clash() -> None:
    gpus = sim_gpus()
    assert rs.device_names(gpus) == {g.uuid: f"gpu-{g.index}" for g in gpus}
    a, b = Gpu(uuid="GPU-a", index=1), Gpu(uuid="GPU-b", index=1)
    odd = Gpu(uuid="GPU-c", index=-1)
    names = rs.device_names([a, b, odd, gpu(12)])
    assert names["GPU-a"] == rs.hashed_name("GPU-a") != names["GPU-b"] == rs.hashed_name("GPU-b")
    assert names["GPU-c"] == rs.hashed_name("GPU-c")
    assert names[gpu(12).uuid] == "gpu-12"
    assert all(DNS_LABEL.fullmatch(n) and len(n) <= 63 for n in names.values())
    # Stable: a restart names the same GPU the same.
    assert rs.device_names([gpu(12), odd, b, a]) == names


def test_the_slice_name_is_a_dns_subdomain_even_for_the_longest_node_name() -> None:
    long_a = ".".join(["a" * 63] * 3) + "." + "b" * 61
    long_b = long_a[:-1] + "c"
    assert len(long_a) == 253 and is_dns_subdomain(long_a)
    names = [rs.slice_name(rs.SliceSettings(node_name=n)) for n in (long_a, long_b)]
    assert names[0] != names[1]
    assert all(len(n) <= 253 and is_dns_subdomain(n) for n in names)
    assert rs.slice_name(SETTINGS) == f"{NODE}-{D}"


# Validation against the API's schema -----------------------------------------------------------------------------

def test_the_slice_validates_strictly_against_kubernetes_1_37_and_a_misspelling_does_not() -> None:
    gpus = sim_gpus()
    st = healthy(gpus)
    st[gpus[1].uuid] = status(gpus[1], State.UNHEALTHY, "xid-79", since=T0)
    st[gpus[2].uuid] = status(gpus[2], State.DEGRADED, "thermal-slowdown", since=T0)
    obj = rs.desired_slice(gpus, st, rs.SliceSettings(node_name=NODE, node_uid="6f1e-node-uid"))
    kubernetes_validate.validate(obj, "1.37.0", strict=True)
    bad = copy.deepcopy(obj)
    bad["spec"]["devices"][0]["atributes"] = bad["spec"]["devices"][0].pop("attributes")
    with pytest.raises(kubernetes_validate.ValidationError, match="atributes"):
        kubernetes_validate.validate(bad, "1.37.0", strict=True)
    bad = copy.deepcopy(obj)
    bad["spec"]["devices"][1]["taints"][0]["timeAdded"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.37.0", strict=True)


# Taints ----------------------------------------------------------------------------------------------------------

def test_an_unhealthy_device_is_tainted_with_its_top_reason_and_the_configured_effect() -> None:
    gpus = sim_gpus()
    st = healthy(gpus)
    # The worst reason names the taint, not the first one listed.
    st[gpus[3].uuid] = status(gpus[3], State.UNHEALTHY, "thermal-slowdown", "xid-79", since=T0 + 61)
    obj = rs.desired_slice(gpus, st, SETTINGS)
    assert taints(obj, 3) == [{"key": "gpu-health.io/unhealthy", "value": "xid-79", "effect": "NoSchedule",
                               "timeAdded": "2026-01-01T00:01:01Z"}]
    assert all(not taints(obj, i) for i in range(8) if i != 3)
    evict = rs.desired_slice(gpus, st, replace(SETTINGS, unhealthy_effect="NoExecute"))
    assert taints(evict, 3)[0]["effect"] == "NoExecute"
    other = rs.desired_slice(gpus, st, replace(SETTINGS, taint_prefix="health.example.com"))
    assert taints(other, 3)[0]["key"] == "health.example.com/unhealthy"


def test_a_degraded_device_gets_an_effect_none_taint_unless_turned_off() -> None:
    gpus = sim_gpus()
    st = healthy(gpus)
    st[gpus[5].uuid] = status(gpus[5], State.DEGRADED, "thermal-slowdown", since=T0)
    obj = rs.desired_slice(gpus, st, replace(SETTINGS, unhealthy_effect="NoExecute"))
    assert taints(obj, 5) == [{"key": "gpu-health.io/degraded", "value": "thermal-slowdown", "effect": "None",
                               "timeAdded": "2026-01-01T00:00:00Z"}]
    assert not taints(rs.desired_slice(gpus, st, replace(SETTINGS, degraded_taint=False)), 5)


def test_an_unknown_device_is_not_evicted_for_not_being_known_unless_asked() -> None:
    gpus = sim_gpus()
    st = healthy(gpus)
    st[gpus[0].uuid] = status(gpus[0], State.UNKNOWN, "nvml-error", since=T0)
    evict_unhealthy = replace(SETTINGS, unhealthy_effect="NoExecute")
    assert taints(rs.desired_slice(gpus, st, evict_unhealthy), 0) == [
        {"key": "gpu-health.io/unknown", "value": "nvml-error", "effect": "NoSchedule",
         "timeAdded": "2026-01-01T00:00:00Z"}]
    assert taints(rs.desired_slice(gpus, st, replace(SETTINGS, unknown_effect="NoExecute")), 0)[0]["effect"] == \
        "NoExecute"


@pytest.mark.parametrize(("state", "kubelet", "key", "effect"), [
    (State.UNHEALTHY, KubeletHealth.UNHEALTHY, "unhealthy", "NoExecute"),
    (State.UNHEALTHY, KubeletHealth.HEALTHY, "unhealthy", "None"),
    (State.UNKNOWN, KubeletHealth.UNHEALTHY, "unknown", "NoSchedule"),
    (State.UNKNOWN, KubeletHealth.HEALTHY, "unknown", "None"),
    (State.DEGRADED, KubeletHealth.HEALTHY, "degraded", "None"),
    # A Degraded device the mapping keeps from pods: claims kept off, no one evicted for it.
    (State.DEGRADED, KubeletHealth.UNHEALTHY, "degraded", "NoSchedule"),
])
def test_the_effect_follows_the_kubelet_health_mapping(state: State, kubelet: KubeletHealth, key: str,
                                                       effect: str) -> None:
    g = gpu(0)
    st = {g.uuid: replace(status(g, state, since=T0), kubelet_health=kubelet)}
    for degraded_taint in (True, False):
        settings = replace(SETTINGS, unhealthy_effect="NoExecute", degraded_taint=degraded_taint)
        got = taints(rs.desired_slice([g], st, settings), 0)
        if state is State.DEGRADED and kubelet is KubeletHealth.HEALTHY and not degraded_taint:
            assert got == []  # the informing taint is the one the setting turns off
            continue
        assert [(t["key"], t["effect"]) for t in got] == [(f"gpu-health.io/{key}", effect)]


@pytest.mark.parametrize(("toleration", "tolerated"), [
    ({"key": "gpu-health.io/unknown", "operator": "Exists", "effect": "NoSchedule"}, True),
    ({"key": "gpu-health.io/unknown", "operator": "Exists"}, True),
    ({"key": "gpu-health.io/unknown", "operator": "Exists", "effect": "NoExecute"}, False),
    ({"key": "gpu-health.io/unknown", "operator": "Equal", "value": "nvml-error"}, True),
    ({"key": "gpu-health.io/unknown", "value": "nvml-error"}, True),  # Equal is the default
    ({"key": "gpu-health.io/unknown", "value": "xid-79"}, False),
    ({"key": "gpu-health.io/unknown"}, False),  # Equal to an empty value
    ({"key": "gpu-health.io/unhealthy", "operator": "Exists"}, False),
    ({"operator": "Exists"}, True),
    ({"operator": "Exists", "effect": "NoSchedule"}, True),
    ({"key": "gpu-health.io/unknown", "operator": "Lt", "value": "nvml-error"}, False),  # no such operator
])
def test_tolerations_match_as_the_scheduler_matches_them(toleration: dict[str, str], tolerated: bool) -> None:
    g = gpu(0)
    st = status(g, State.UNKNOWN, "nvml-error", since=T0)
    taint = rs.device_taint(st, SETTINGS)
    assert taint is not None and (taint["key"], taint["effect"]) == ("gpu-health.io/unknown", "NoSchedule")
    assert rs.tolerates(toleration, taint) is tolerated
    assert rs.allocatable(st, SETTINGS, [toleration]) is tolerated
    assert rs.allocatable(st, SETTINGS, [{"key": "example.com/x", "operator": "Exists"}, toleration]) is tolerated
    assert not rs.allocatable(st, SETTINGS)


def test_an_informing_taint_or_none_leaves_a_device_allocatable_to_every_claim() -> None:
    g = gpu(0)
    for st in (status(g, since=T0), status(g, State.DEGRADED, "thermal-slowdown", since=T0), None):
        assert rs.allocatable(st, SETTINGS)


def test_healthy_or_not_yet_known_devices_have_no_taint_and_recovery_removes_it() -> None:
    gpus = sim_gpus()
    st = healthy(gpus)
    del st[gpus[6].uuid]  # no verdict yet
    obj = rs.desired_slice(gpus, st, SETTINGS)
    assert all("taints" not in d for d in devices(obj))
    st[gpus[6].uuid] = status(gpus[6], State.UNHEALTHY, "xid-79", since=T0)
    faulty = as_stored(rs.desired_slice(gpus, st, SETTINGS), generation=3)
    st[gpus[6].uuid] = status(gpus[6], State.HEALTHY, since=T0 + 300)
    recovered = rs.desired_slice(gpus, st, SETTINGS)
    assert "taints" not in devices(recovered)[6]
    assert rs.slice_changed(faulty, recovered) and rs.next_generation(faulty, recovered) == 4


def test_an_unhealthy_device_without_a_reason_has_a_taint_without_a_value() -> None:
    g = gpu(0)
    st = {g.uuid: DeviceStatus(g.uuid, g, State.UNHEALTHY, (), T0, KubeletHealth.UNHEALTHY)}
    obj = rs.desired_slice([g], st, SETTINGS)
    assert taints(obj, 0) == [{"key": "gpu-health.io/unhealthy", "effect": "NoSchedule",
                               "timeAdded": "2026-01-01T00:00:00Z"}]
    kubernetes_validate.validate(obj, "1.37.0", strict=True)


def test_taint_keys_and_values_are_valid_label_names_and_values_even_for_odd_reason_codes() -> None:
    long_a, long_b = "x" * 60 + "-first-ending", "x" * 60 + "-other-ending"
    for code in ("xid-79", "row-remap-failure", long_a, "bad code/with:chars", "-edge-", "a" * 63):
        v = rs.taint_value(code)
        assert len(v) <= 63 and LABEL_VALUE.fullmatch(v), (code, v)
        assert rs.taint_value(code) == v  # deterministic: the same code, the same bytes
    assert rs.taint_value("xid-79") == "xid-79" and rs.taint_value("a" * 63) == "a" * 63
    assert rs.taint_value("bad code/with:chars") == "bad-code-with-chars"
    assert rs.taint_value("-edge-") == "edge"
    assert rs.taint_value(long_a) != rs.taint_value(long_b)  # the hash keeps codes that share a start apart
    assert rs.taint_value(long_a).startswith("x" * 50)
    g = gpu(0)
    st = {g.uuid: DeviceStatus(g.uuid, g, State.UNHEALTHY,
                               (Reason(long_a, State.UNHEALTHY, "m", Source.POLL, Action.DRAIN, T0),), T0,
                               KubeletHealth.UNHEALTHY)}
    for prefix in ("gpu-health.io", "a-very.long.example.com"):
        (t,) = taints(rs.desired_slice([g], st, replace(SETTINGS, taint_prefix=prefix)), 0)
        assert is_qualified_name(t["key"]) and t["value"] == rs.taint_value(long_a)


def test_taints_can_be_turned_off_and_a_server_that_dropped_them_is_recognised() -> None:
    gpus = sim_gpus()
    st = healthy(gpus)
    st[gpus[2].uuid] = status(gpus[2], State.UNHEALTHY, "xid-79", since=T0)
    sent = rs.desired_slice(gpus, st, SETTINGS)
    stored = as_stored(sent)
    for d in devices(stored):
        d.pop("taints", None)  # what the API server does while the DRADeviceTaints gate is off
    assert rs.taints_dropped(sent, stored)
    assert not rs.taints_dropped(sent, as_stored(sent))
    assert not rs.taints_dropped(rs.desired_slice(gpus, healthy(gpus), SETTINGS), stored)
    untainted = rs.desired_slice(gpus, st, replace(SETTINGS, taints=False))
    # Without taints an Unhealthy device would be allocatable untainted: it is left out until it recovers, and the
    # others keep their names.
    assert [d["name"] for d in devices(untainted)] == [f"gpu-{i}" for i in range(8) if i != 2]
    assert all("taints" not in d for d in devices(untainted))
    assert rs.slice_changed(stored, untainted)
    # Once written, the stored copy matches: no write per poll.
    assert not rs.slice_changed(as_stored(untainted), rs.desired_slice(gpus, st, replace(SETTINGS, taints=False)))


@pytest.mark.parametrize(("state", "kubelet", "listed"), [
    (State.UNHEALTHY, KubeletHealth.UNHEALTHY, False),
    (State.UNKNOWN, KubeletHealth.UNHEALTHY, False),
    (State.DEGRADED, KubeletHealth.UNHEALTHY, False),
    (State.UNHEALTHY, KubeletHealth.HEALTHY, True),
    (State.UNKNOWN, KubeletHealth.HEALTHY, True),
    (State.DEGRADED, KubeletHealth.HEALTHY, True),
])
def test_without_taints_the_mapping_decides_which_devices_are_in_the_slice(state: State, kubelet: KubeletHealth,
                                                                          listed: bool) -> None:
    gpus = sim_gpus()
    st = healthy(gpus)
    st[gpus[4].uuid] = replace(status(gpus[4], state, since=T0), kubelet_health=kubelet)
    names = [d["name"] for d in devices(rs.desired_slice(gpus, st, replace(SETTINGS, taints=False)))]
    assert ("gpu-4" in names) is listed and len(names) == 8 - (not listed)
    kubernetes_validate.validate(rs.desired_slice(gpus, st, replace(SETTINGS, taints=False)), "1.37.0", strict=True)


# Writing only on a change ----------------------------------------------------------------------------------------

def test_the_same_node_gives_the_same_bytes_and_no_write() -> None:
    gpus = sim_gpus()
    st = healthy(gpus)
    st[gpus[4].uuid] = status(gpus[4], State.UNHEALTHY, "xid-79", since=T0 + 5)
    first = rs.desired_slice(gpus, st, SETTINGS)
    with pytest.MonkeyPatch.context() as mp:
        # Only the inputs shape the object, never the clock.
        mp.setattr(time, "time", lambda: T0 + 86_400.0)
        again = rs.desired_slice(list(gpus), dict(st), SETTINGS)
    assert dumps(again) == dumps(first)
    stored = as_stored(first, generation=7, team="ml-infra")
    assert not rs.slice_changed(stored, again)
    assert rs.next_generation(stored, again) == 7
    assert rs.update_body(stored, again) is None


def test_a_later_poll_with_the_same_states_gives_the_same_bytes() -> None:
    """The node state keeps ``since`` while a state holds, whatever a later poll computes; the slice follows."""
    gpus = sim_gpus()
    state = NodeState()

    def poll(now: float) -> str:
        devs = [status(g, State.DEGRADED if g.index == 2 else State.HEALTHY,
                       *(("thermal-slowdown",) if g.index == 2 else ()), since=now) for g in gpus]
        state.publish(devs, now)
        return dumps(rs.desired_slice(gpus, rs.device_statuses(state.snapshot().devices), SETTINGS))

    first = poll(T0)
    assert poll(T0 + 30) == first and poll(T0 + 3600) == first
    assert '"timeAdded":"2026-01-01T00:00:00Z"' in first


def test_a_changed_attribute_or_device_set_is_a_write_at_the_next_generation() -> None:
    gpus = sim_gpus()
    st = healthy(gpus)
    stored = as_stored(rs.desired_slice(gpus, st, SETTINGS), generation=5, team="ml-infra")
    renamed = [replace(gpus[0], name="NVIDIA H200"), *gpus[1:]]
    extra = Gpu(uuid="GPU-new", index=8, name="NVIDIA H100 80GB HBM3", memory_mib=81559)
    for new_gpus in (renamed, gpus[:7], [*gpus, extra]):
        desired = rs.desired_slice(new_gpus, {**st, "GPU-new": status(extra, since=T0)}, SETTINGS)
        assert rs.slice_changed(stored, desired)
        assert rs.next_generation(stored, desired) == 6
        body = rs.update_body(stored, desired)
        assert body is not None
        assert body["spec"]["pool"]["generation"] == 6
        assert body["metadata"]["resourceVersion"] == "4711"  # the replace is conditional: a race is a 409
        assert body["metadata"]["labels"] == {rs.MANAGED_BY: "gpu-health-device-plugin", "team": "ml-infra"}
        assert body["spec"]["devices"] == desired["spec"]["devices"]
        kubernetes_validate.validate(body, "1.37.0", strict=True)
    assert rs.update_body(None, rs.desired_slice(gpus, st, SETTINGS)) == rs.desired_slice(gpus, st, SETTINGS)


def test_a_taint_change_alone_bumps_the_generation_and_our_label_alone_does_not() -> None:
    """ResourcePool.Generation: a driver changing anything about a resource in the pool must change the
    generation; taints are part of the device."""
    gpus = sim_gpus()
    st = healthy(gpus)
    base = rs.desired_slice(gpus, st, SETTINGS)
    stored = as_stored(base, generation=2)
    st[gpus[1].uuid] = status(gpus[1], State.DEGRADED, "thermal-slowdown", since=T0)
    tainted = rs.desired_slice(gpus, st, SETTINGS)
    assert rs.slice_changed(stored, tainted) and rs.next_generation(stored, tainted) == 3
    st[gpus[1].uuid] = status(gpus[1], State.DEGRADED, "ecc-uncorrected", since=T0)  # a new reason, same state
    stored_tainted = as_stored(tainted, generation=3)
    reworded = rs.desired_slice(gpus, st, SETTINGS)
    assert taints(reworded, 1)[0]["timeAdded"] == taints(tainted, 1)[0]["timeAdded"]
    assert rs.slice_changed(stored_tainted, reworded) and rs.next_generation(stored_tainted, reworded) == 4
    unlabelled = as_stored(base, generation=2)
    del unlabelled["metadata"]["labels"][rs.MANAGED_BY]
    assert rs.slice_changed(unlabelled, base) and rs.next_generation(unlabelled, base) == 2
    owned = rs.desired_slice(gpus, healthy(gpus), replace(SETTINGS, node_uid="6f1e-node-uid"))
    assert rs.slice_changed(stored, owned) and rs.next_generation(stored, owned) == 2
    assert not rs.slice_changed(as_stored(owned), owned)


def test_an_immutable_field_changing_means_recreate() -> None:
    gpus = sim_gpus()
    stored = as_stored(rs.desired_slice(gpus, healthy(gpus), SETTINGS))
    assert not rs.must_recreate(stored, rs.desired_slice(gpus[:3], {}, SETTINGS))
    assert rs.must_recreate(stored, rs.desired_slice(gpus, {}, replace(SETTINGS, pool="pool-b")))
    assert rs.must_recreate(stored, rs.desired_slice(gpus, {}, replace(SETTINGS, node_name="gpu-node-2")))


# Settings --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("changes", "field"), [
    ({"node_name": ""}, "node_name"),
    ({"node_name": "Node_1"}, "node_name"),
    ({"driver": "GPU.example.com"}, "driver"),
    ({"driver": "a" * 60 + ".com"}, "driver"),
    ({"pool": "pool/Bad"}, "pool"),
    ({"taint_prefix": "health.kubernetes.io"}, "taint_prefix"),
    ({"unhealthy_effect": "PreferNoSchedule"}, "unhealthy_effect"),
    ({"unknown_effect": "None"}, "unknown_effect"),
])
def test_bad_settings_name_the_field(changes: dict[str, str], field: str) -> None:
    with pytest.raises(FieldError) as exc:
        rs.SliceSettings(**{"node_name": NODE, **changes})  # type: ignore[arg-type]
    assert exc.value.field == field


def test_too_many_gpus_for_one_slice_is_an_error_not_a_partial_slice() -> None:
    gpus = [Gpu(uuid=f"GPU-{i}", index=i) for i in range(rs.MAX_DEVICES + 1)]
    with pytest.raises(ValueError, match="at most 64"):
        rs.desired_slice(gpus, {}, SETTINGS)
    assert len(devices(rs.desired_slice(gpus[:-1], {}, SETTINGS))) == rs.MAX_DEVICES
