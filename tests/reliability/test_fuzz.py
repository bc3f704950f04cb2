"""Hypothesis fuzzing: every RPC over the real socket with generated requests (oversized lists, odd IDs, extreme
sizes), and random config files. Only OK or clean error statuses; the server alive afterwards; config errors name
a field and the CLI exits 2."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugin.config import ConfigError, load
from plugin.devices.simulated import SimulatedBackend
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.kubelet.allocation import AllocationConfig
from plugin.kubelet.resources import WholeGpus
from plugin.kubelet.server import DevicePluginServicer
from plugin.kubelet.supervisor import PluginServer, plugin_options

pytestmark = pytest.mark.slow
CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
UUIDS = SimulatedBackend().discover().gpus
REAL_IDS = [g.uuid for g in UUIDS]
ids = st.one_of(st.sampled_from(REAL_IDS), st.text(max_size=80), st.text(min_size=200, max_size=5000),
                st.just(""), st.just("GPU-5a1e0000-0000-4000-8000-00000000000\x00"))
id_lists = st.lists(ids, max_size=40)
SETTINGS = settings(max_examples=2500, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    import tempfile

    state = NodeState()
    stop = threading.Event()
    monitor = Monitor(SimulatedBackend(), state, HealthConfig(), 60.0, stop)
    monitor.poll_once()
    with tempfile.TemporaryDirectory(prefix="ghdp-fuzz-") as d:
        servicer = DevicePluginServicer(state, WholeGpus(), AllocationConfig(), plugin_options())
        server = PluginServer(Path(d), WholeGpus(), servicer)
        server.start()
        with grpc.insecure_channel(f"unix://{server.path}",
                                   options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            yield ch
            # Alive afterwards: a normal request still gets a normal answer.
            resp = api_pb2_grpc.DevicePluginStub(ch).Allocate(api_pb2.AllocateRequest(container_requests=[
                api_pb2.ContainerAllocateRequest(devices_ids=REAL_IDS[:1])]), timeout=5)
            assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == REAL_IDS[0]
        server.stop(0)
        stop.set()


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> api_pb2_grpc.DevicePluginStub:
    return api_pb2_grpc.DevicePluginStub(channel)


def code_of(call: Any) -> grpc.StatusCode:
    try:
        call()
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]


@SETTINGS
@given(st.lists(id_lists, max_size=12))
def test_fuzz_allocate(stub: api_pb2_grpc.DevicePluginStub, containers: list[list[str]]) -> None:
    req = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=c)
                                                      for c in containers])
    assert code_of(lambda: stub.Allocate(req, timeout=10)) in CLEAN


@SETTINGS
@given(st.lists(st.tuples(id_lists, id_lists, st.integers(min_value=-(2**31), max_value=2**31 - 1)), max_size=8))
def test_fuzz_preferred_allocation(stub: api_pb2_grpc.DevicePluginStub,
                                   requests: list[tuple[list[str], list[str], int]]) -> None:
    req = api_pb2.PreferredAllocationRequest(container_requests=[
        api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=a, must_include_deviceIDs=m,
                                                    allocation_size=n) for a, m, n in requests])
    code = code_of(lambda: stub.GetPreferredAllocation(req, timeout=10))
    assert code in CLEAN


@SETTINGS
@given(id_lists)
def test_fuzz_pre_start_and_options(stub: api_pb2_grpc.DevicePluginStub, devices: list[str]) -> None:
    assert code_of(lambda: stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=devices),
                                                  timeout=10)) == grpc.StatusCode.OK
    assert stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=10).get_preferred_allocation_available


@settings(max_examples=2500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=2000))
def test_fuzz_raw_bytes_as_allocate(channel: grpc.Channel, raw: bytes) -> None:
    """Arbitrary bytes on the wire, as a hostile or broken client would send them."""
    call = channel.unary_unary(
        "/v1beta1.DevicePlugin/Allocate", request_serializer=lambda b: b,
        response_deserializer=api_pb2.AllocateResponse.FromString)
    code = code_of(lambda: call(raw, timeout=10))
    assert code in CLEAN | {grpc.StatusCode.INTERNAL}  # INTERNAL: the request did not parse


# Random config files ------------------------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=20))
keys = st.one_of(st.sampled_from(["version", "plugin", "health", "sharing", "pollInterval", "backend", "xid",
                                  "fatal", "flap", "max", "overrides", "kubeletHealth", "thresholds",
                                  "clearAfterPolls", "cdi", "resourceName", "latchHoldSeconds"]),
                 st.text(max_size=12))
docs = st.recursive(scalars, lambda children: st.one_of(st.lists(children, max_size=4),
                                                        st.dictionaries(keys, children, max_size=5)), max_leaves=20)


@settings(max_examples=1500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(keys, docs, max_size=6), st.booleans())
def test_random_config_files_give_a_clear_error_or_load(tmp_path: Path, doc: dict[str, Any], versioned: bool) -> None:
    if versioned:
        doc["version"] = "v1"
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(doc))
    try:
        load({}, {}, f)
    except ConfigError as exc:
        assert exc.field and str(exc).startswith(exc.field)


def test_random_bad_config_exits_2(tmp_path: Path) -> None:
    for i, text in enumerate(["version: v1\nhealth: {flap: {max: -1}}\n", "version: v1\nplugin: 7\n",
                              "- a\n- b\n", "version: v1\nhealth:\n  xid: {fatal: {}}\n"]):
        f = tmp_path / f"c{i}.yaml"
        f.write_text(text)
        r = subprocess.run([sys.executable, "-m", "plugin", "--config", str(f)], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2, (text, r.stderr)
        assert "invalid configuration" in r.stderr
