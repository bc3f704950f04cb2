"""Shared GPUs in DRA mode (plugin/dra/shares.py): which devices the sharing section selects, how the slice says
a device takes several claims, and how a cluster that drops that is recognised."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from plugin.dra.shares import Shareable, replicas, resource_of, share, sharing_dropped
from plugin.sharing.config import parse_sharing

D = "gpu.gpu-health.io"


def _sharing(*entries: dict[str, Any]) -> Any:
    return parse_sharing({"timeSlicing": {"resources": list(entries)}})


def _node() -> list[Shareable]:
    gpus = [Shareable(f"gpu-{i}", "nvidia.com/gpu", i, (f"GPU-{i}",)) for i in range(3)]
    migs = [Shareable(f"gpu-3-mig-{gi}-0", "nvidia.com/mig-1g.10gb", 3, ("GPU-3", f"MIG-3-{gi}")) for gi in (7, 8)]
    return gpus + migs


def test_resource_of_names_mig_instances_as_the_mixed_strategy_does() -> None:
    assert resource_of("nvidia.com/gpu", None) == "nvidia.com/gpu"
    assert resource_of("nvidia.com/gpu", "1g.10gb") == "nvidia.com/mig-1g.10gb"


def test_all_devices_of_the_named_resource_and_no_other() -> None:
    assert replicas(_node(), _sharing({"name": "nvidia.com/gpu", "replicas": 4})) == \
        {"gpu-0": 4, "gpu-1": 4, "gpu-2": 4}
    assert replicas(_node(), _sharing({"name": "nvidia.com/mig-1g.10gb", "replicas": 2})) == \
        {"gpu-3-mig-7-0": 2, "gpu-3-mig-8-0": 2}


def test_a_count_takes_the_first_devices_of_its_resource_a_list_takes_indices_and_uuids() -> None:
    assert replicas(_node(), _sharing({"name": "nvidia.com/gpu", "replicas": 3, "devices": 2})) == \
        {"gpu-0": 3, "gpu-1": 3}
    assert replicas(_node(), _sharing({"name": "nvidia.com/gpu", "replicas": 3, "devices": [2, "gpu-0"]})) == \
        {"gpu-0": 3, "gpu-2": 3}
    # A MIG UUID picks that instance; its GPU's UUID picks all of the GPU's instances.
    assert replicas(_node(), _sharing({"name": "nvidia.com/mig-1g.10gb", "replicas": 2,
                                       "devices": ["MIG-3-8"]})) == {"gpu-3-mig-8-0": 2}
    assert replicas(_node(), _sharing({"name": "nvidia.com/mig-1g.10gb", "replicas": 2,
                                       "devices": ["GPU-3"]})) == {"gpu-3-mig-7-0": 2, "gpu-3-mig-8-0": 2}


def test_no_sharing_section_or_one_replica_shares_nothing() -> None:
    assert replicas(_node(), parse_sharing(None)) == {}
    assert replicas(_node(), _sharing({"name": "nvidia.com/gpu", "replicas": 1})) == {}


def _device(memory: str | None = "80Gi") -> dict[str, Any]:
    d: dict[str, Any] = {"name": "gpu-0", "attributes": {f"{D}/uuid": {"string": "GPU-0"}}}
    if memory:
        d["capacity"] = {f"{D}/memory": {"value": memory}}
    return d


def test_a_shared_device_takes_that_many_claims_of_one_share_each_and_memory_only_when_asked() -> None:
    d = _device()
    share(d, 4, D)
    assert d["allowMultipleAllocations"] is True
    assert d["capacity"][f"{D}/shares"] == {
        "value": "4", "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}}}
    # Without a policy a request that names no memory would consume all of it: one claim per GPU again.
    assert d["capacity"][f"{D}/memory"] == {
        "value": "80Gi", "requestPolicy": {"default": "0", "validRange": {"min": "0"}}}
    d2 = _device(memory=None)
    share(d2, 2, D)
    assert set(d2["capacity"]) == {f"{D}/shares"}


def test_the_policies_are_valid_by_the_api_servers_rules() -> None:
    """The rules of resource.k8s.io/v1 validation (validateRequestPolicyRange): min <= default <= max <= value,
    min <= value; a step divides default - min. An invalid slice would be refused whole."""
    d = _device()
    share(d, 7, D)
    for cap in d["capacity"].values():
        value = cap["value"]
        total = 80 * 2**30 if value.endswith("Gi") else int(value)
        policy = cap["requestPolicy"]
        r = policy["validRange"]
        lo, default = int(r["min"]), int(policy["default"])
        hi = int(r.get("max", total))
        assert 0 <= lo <= default <= hi <= total
        assert lo <= total
        if "step" in r:
            assert (default - lo) % int(r["step"]) == 0 and (hi - lo) % int(r["step"]) == 0


def _slice(*devices: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"devices": list(devices)}}


def test_a_server_that_drops_the_field_is_recognised_and_one_that_keeps_it_is_not() -> None:
    shared = _device()
    share(shared, 2, D)
    sent = _slice(shared, _device())
    assert not sharing_dropped(sent, copy.deepcopy(sent))
    stored = copy.deepcopy(sent)
    for dev in stored["spec"]["devices"]:
        dev.pop("allowMultipleAllocations", None)
        for cap in (dev.get("capacity") or {}).values():
            cap.pop("requestPolicy", None)
    assert sharing_dropped(sent, stored)
    # Nothing sent shared: nothing to drop, whatever the server holds.
    assert not sharing_dropped(_slice(_device()), _slice(_device()))
    assert not sharing_dropped(_slice(), {})


@pytest.mark.parametrize("count", [2, 16, 1024])
def test_share_is_idempotent_so_a_rebuilt_slice_compares_equal(count: int) -> None:
    a, b = _device(), _device()
    share(a, count, D)
    share(b, count, D)
    share(b, count, D)
    assert a == b
