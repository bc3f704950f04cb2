"""The node state as the kubelet's DRA health report: one line per whole GPU, named as in the ResourceSlice."""

from __future__ import annotations

from dataclasses import replace

import pytest

from plugin.dra.health import HEALTH_SERVICE_NAMES, MESSAGE_MAX, DeviceReport, HealthSettings, device_health
from plugin.dra.slices import device_names
from plugin.health.node_state import NodeState
from plugin.health.reasons import Action, Reason, Source, State
from plugin.validation import FieldError
from tests.fakes.node_devices import Node, gpu, status

T0 = 1_767_225_600.0
POOL = "gpu-node-1"


def settings(**kw: object) -> HealthSettings:
    return HealthSettings(pool=POOL, **kw)  # type: ignore[arg-type]


def node(n: int = 4, migs: int = 0) -> Node:
    nd = Node(NodeState(), n=n, migs=migs)
    nd.publish(T0)
    return nd


def by_device(reports: list[DeviceReport]) -> dict[str, DeviceReport]:
    return {r.device: r for r in reports}


def test_every_state_maps_to_the_kubelets_three() -> None:
    nd = node()
    nd.set(1, State.DEGRADED, "thermal-slowdown", now=T0)
    nd.set(2, State.UNHEALTHY, "xid-79", now=T0)
    nd.set(3, State.UNKNOWN, "nvml-error", now=T0)
    got = device_health(nd.state.snapshot(), None, settings())
    assert got == [
        DeviceReport(POOL, "gpu-0", "HEALTHY", ""),
        DeviceReport(POOL, "gpu-1", "HEALTHY",
                     "thermal-slowdown: temperature 90C at or above slowdown threshold 87C"),
        DeviceReport(POOL, "gpu-2", "UNHEALTHY", "xid-79: XID 79: GPU has fallen off the bus"),
        DeviceReport(POOL, "gpu-3", "UNKNOWN", "nvml-error: NVML calls failed for 3 consecutive polls"),
    ]


def test_degraded_can_be_told_as_unhealthy() -> None:
    nd = node()
    nd.set(1, State.DEGRADED, "thermal-slowdown", now=T0)
    got = by_device(device_health(nd.state.snapshot(), None, settings(degraded_as="Unhealthy")))
    assert got["gpu-1"].health == "UNHEALTHY" and got["gpu-1"].message.startswith("thermal-slowdown: ")
    assert got["gpu-0"].health == "HEALTHY"


def test_the_message_is_the_top_reason_short_and_on_one_line() -> None:
    g = gpu(0)
    long_msg = "line one\n  " + "x" * 400
    reasons = (Reason("thermal-slowdown", State.DEGRADED, "hot", Source.POLL, Action.NONE, T0),
               Reason("xid-79", State.UNHEALTHY, long_msg, Source.EVENT, Action.RESET_GPU, T0))
    st = NodeState()
    st.publish([replace(status(g, State.UNHEALTHY), reasons=reasons)], T0)
    (r,) = device_health(st.snapshot(), None, settings())
    assert r.health == "UNHEALTHY"
    assert r.message.startswith("xid-79: line one xxx") and "\n" not in r.message
    assert len(r.message) == MESSAGE_MAX and r.message.endswith("...")


def test_a_state_without_reasons_still_says_which() -> None:
    g = gpu(0)
    st = NodeState()
    st.publish([status(g, State.UNKNOWN)], T0)
    assert device_health(st.snapshot(), None, settings()) == [DeviceReport(POOL, "gpu-0", "UNKNOWN", "Unknown")]


def test_only_whole_gpus_with_the_slices_names() -> None:
    nd = node(n=2, migs=2)
    snap = nd.state.snapshot()
    assert len(snap.devices) == 6
    got = device_health(snap, None, settings())
    assert [r.device for r in got] == ["gpu-0", "gpu-1"]
    # Names handed in win (the slice writer's), and a GPU the slice does not name is not reported.
    names = device_names([nd.gpus[1]])
    assert [r.device for r in device_health(snap, names, settings())] == ["gpu-1"]


def test_duplicate_indexes_fall_back_to_the_slices_hashed_names() -> None:
    a, b = gpu(0), replace(gpu(1), index=0)
    st = NodeState()
    st.publish([status(a), status(b)], T0)
    got = [r.device for r in device_health(st.snapshot(), None, settings())]
    names = device_names([a, b])
    assert got == [names[a.uuid], names[b.uuid]] and all(n.startswith("dev-") for n in got)


def test_health_service_names_are_the_kubelets() -> None:
    assert HEALTH_SERVICE_NAMES == ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")


@pytest.mark.parametrize(("kw", "field"), [
    ({"degraded_as": "Degraded"}, "degraded_as"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": True}, "timeout_s"),
    ({"heartbeat_s": 0}, "heartbeat_s"),
    ({"timeout_s": 30, "heartbeat_s": 11}, "heartbeat_s"),
    ({"pool": ""}, "pool"),
])
def test_bad_settings_name_the_field(kw: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"pool": POOL, **kw}
    with pytest.raises(FieldError) as exc:
        HealthSettings(**args)  # type: ignore[arg-type]
    assert exc.value.field == field


def test_defaults_keep_three_heartbeats_per_timeout() -> None:
    s = settings()
    assert (s.degraded_as, s.timeout_s, s.heartbeat_s) == ("Healthy", 60, 20.0)
    assert settings(timeout_s=30, heartbeat_s=10).heartbeat_s == 10
