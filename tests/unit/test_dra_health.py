"""The node state as the kubelet's DRA health report: one line per published device (a whole GPU, or a MIG instance
under --mig-strategy mixed), named as in the ResourceSlice."""

from __future__ import annotations

from dataclasses import replace

import pytest

from plugin.dra.health import HEALTH_SERVICE_NAMES, MESSAGE_MAX, DeviceReport, HealthSettings, device_health
from plugin.dra.slices import device_names, published_devices
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


def test_under_mixed_the_instances_are_reported_by_the_slices_names_with_their_parents_faults() -> None:
    g0, g1, g2 = gpu(0, migs=2), gpu(1, migs=2), gpu(2)  # GPU 2 is not in MIG mode: it stays whole
    m0, m1 = g0.mig_devices, g1.mig_devices
    st = NodeState()
    # As the monitor publishes them: GPU 1's fault is its instances' too; one instance of GPU 0 has one of its own.
    st.publish([status(g0), status(g0, mig=m0[0]), status(g0, State.UNKNOWN, "nvml-error", mig=m0[1]),
                status(g1, State.UNHEALTHY, "xid-79"), *(status(g1, State.UNHEALTHY, "xid-79", mig=m) for m in m1),
                status(g2)], T0)
    snap = st.snapshot()
    mixed = settings(mig_strategy="mixed")
    assert [(r.device, r.health, r.message.split(":")[0]) for r in device_health(snap, None, mixed)] == [
        ("gpu-0-mig-1-0", "HEALTHY", ""), ("gpu-0-mig-2-0", "UNKNOWN", "nvml-error"),
        ("gpu-1-mig-1-0", "UNHEALTHY", "xid-79"), ("gpu-1-mig-2-0", "UNHEALTHY", "xid-79"),
        ("gpu-2", "HEALTHY", "")]
    # The names of the slice of that snapshot, and none the slice does not publish.
    published = [d.name for d in published_devices(snap.devices, "mixed")]
    assert [r.device for r in device_health(snap, None, mixed)] == published
    # Under none the same snapshot is three whole GPUs, GPU 1's fault on gpu-1.
    assert [(r.device, r.health) for r in device_health(snap, None, settings())] == [
        ("gpu-0", "HEALTHY"), ("gpu-1", "UNHEALTHY"), ("gpu-2", "HEALTHY")]


def test_a_destroyed_instance_is_no_longer_reported() -> None:
    nd = node(n=1, migs=3)
    mixed = settings(mig_strategy="mixed")
    assert [r.device for r in device_health(nd.state.snapshot(), None, mixed)] == [
        "gpu-0-mig-1-0", "gpu-0-mig-2-0", "gpu-0-mig-3-0"]
    g = nd.gpus[0]
    gone = g.mig_devices[1]
    nd.gpus[0] = replace(g, mig_devices=(g.mig_devices[0], g.mig_devices[2]))
    nd.current = {k: replace(v, gpu=nd.gpus[0]) for k, v in nd.current.items() if k != gone.uuid}
    nd.publish(T0 + 5)
    assert [r.device for r in device_health(nd.state.snapshot(), None, mixed)] == ["gpu-0-mig-1-0", "gpu-0-mig-3-0"]


def test_a_strategy_dra_mode_does_not_publish_under_is_refused() -> None:
    for bad in ("single", "MIXED"):
        with pytest.raises(FieldError) as exc:
            settings(mig_strategy=bad)
        assert exc.value.field == "mig_strategy"


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
