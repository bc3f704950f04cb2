"""The NVSentinel stand-in itself, through plain gRPC clients: what the plugin-facing tests
(test_nvsentinel_plugin.py) rely on it to do, and that its generated Go code is that of our protos."""

from __future__ import annotations

import os
from collections.abc import Iterator

import grpc
import pytest

from api.nvsentinel.deviceapi.v1alpha1 import gpu_pb2
from api.nvsentinel.platformconnector import health_event_pb2 as pb
from api.nvsentinel.platformconnector import health_event_pb2_grpc as pb_grpc
from scripts import gen_go_peer
from tests.conformance.nvsentinel.peer import DeviceApiClient, NvsentinelPeer
from tests.conformance.skips import build_or_skip

pytestmark = pytest.mark.conformance

UUID0 = "GPU-5A1E0000-0000-4000-8000-000000000000"
UUID1 = "GPU-5A1E0000-0000-4000-8000-000000000001"


@pytest.fixture
def peer(nvsentinel_peer: NvsentinelPeer) -> NvsentinelPeer:
    return nvsentinel_peer


@pytest.fixture
def devices(peer: NvsentinelPeer) -> Iterator[DeviceApiClient]:
    with DeviceApiClient(peer.device_socket) as client:
        yield client


def event(**fields: object) -> pb.HealthEvent:
    base: dict[str, object] = {
        "version": 1, "agent": "test-agent", "componentClass": "GPU", "checkName": "TestCheck", "nodeName": "node-a",
        "isFatal": True, "isHealthy": False, "message": "xid 79", "recommendedAction": pb.RESTART_BM,
        "errorCode": ["79"], "entitiesImpacted": [pb.Entity(entityType="GPU", entityValue=UUID0)],
    }
    base.update(fields)
    return pb.HealthEvent(**base)  # type: ignore[arg-type]


def send(peer: NvsentinelPeer, *events: pb.HealthEvent) -> None:
    with grpc.insecure_channel(f"unix://{peer.connector_socket}") as ch:
        pb_grpc.PlatformConnectorStub(ch).HealthEventOccurredV1(pb.HealthEvents(version=1, events=events), timeout=10)


def rpc_code(call: object) -> grpc.StatusCode:
    assert callable(call)
    with pytest.raises(grpc.RpcError) as info:
        call()
    code: grpc.StatusCode = info.value.code()  # type: ignore[attr-defined]
    return code


def test_connector_records_each_batch_and_reads_unset_strategy_as_execute_remediation(peer: NvsentinelPeer) -> None:
    send(peer, event(), event(processingStrategy=pb.STORE_ONLY, isFatal=False, isHealthy=True, errorCode=[]))
    send(peer, event(checkName="Other"))
    assert [b["call"] for b in peer.batches()] == [1, 2]
    first, second, third = peer.events()
    assert first["processingStrategy"] == "EXECUTE_REMEDIATION" and first["rawProcessingStrategy"] == "UNSPECIFIED"
    assert second["processingStrategy"] == "STORE_ONLY" and second["rawProcessingStrategy"] == "STORE_ONLY"
    assert first["entitiesImpacted"] == [{"entityType": "GPU", "entityValue": UUID0}]
    assert (first["isFatal"], first["isHealthy"], first["errorCode"]) == (True, False, ["79"])
    assert first["recommendedAction"] == "RESTART_BM" and first["agent"] == "test-agent"
    assert (second["isFatal"], second["isHealthy"]) == (False, True)  # false is recorded, not left out
    assert third["checkName"] == "Other"
    assert peer.wait_events(lambda e: e["checkName"] == "Other", timeout=1) == [third]


def test_connector_refuses_custom_action_without_its_name_and_events_it_cannot_place(peer: NvsentinelPeer) -> None:
    custom = event(recommendedAction=pb.CUSTOM)
    assert rpc_code(lambda: send(peer, event(), custom)) == grpc.StatusCode.INVALID_ARGUMENT
    send(peer, event(recommendedAction=pb.CUSTOM, customRecommendedAction="drain-and-call"))
    for missing in ("nodeName", "checkName", "agent"):
        assert rpc_code(lambda m=missing: send(peer, event(**{m: ""}))) == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[misc]
    assert [e["customRecommendedAction"] for e in peer.events()] == ["drain-and-call"]  # refused batches: nothing
    peer.restart(strict=False)  # NVSentinel itself takes them
    send(peer, event(nodeName=""))
    assert peer.events()[-1]["nodeName"] == ""


def test_fail_first_refuses_the_first_calls_with_the_code_given(peer: NvsentinelPeer) -> None:
    peer.restart(fail_first=2, fail_code="UNAVAILABLE")
    assert rpc_code(lambda: send(peer, event())) == grpc.StatusCode.UNAVAILABLE
    assert rpc_code(lambda: send(peer, event())) == grpc.StatusCode.UNAVAILABLE
    send(peer, event())
    assert [b["call"] for b in peer.batches()] == [3]


def test_create_is_idempotent_and_needs_a_name_and_a_uuid(peer: NvsentinelPeer, devices: DeviceApiClient) -> None:
    created = devices.create(UUID0)
    assert created.created and created.gpu.metadata.name == UUID0.lower() and created.gpu.resource_version > 0
    again = devices.create(UUID0)
    assert not again.created and again.gpu == created.gpu
    for gpu in (gpu_pb2.Gpu(spec=gpu_pb2.GpuSpec(uuid=UUID1)), gpu_pb2.Gpu(metadata=gpu_pb2.ObjectMeta(name="x"))):
        req = gpu_pb2.CreateGpuRequest(gpu=gpu)
        assert rpc_code(lambda r=req: devices.stub.CreateGpu(r, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[misc]
    assert [(w["operation"], w["name"]) for w in peer.device_writes()] == [("create", UUID0.lower())]


def test_status_write_replaces_the_status_and_refuses_a_stale_version(peer: NvsentinelPeer,
                                                                      devices: DeviceApiClient) -> None:
    name = devices.create(UUID0).gpu.metadata.name
    v1 = devices.get(name).resource_version
    ours = devices.set_condition(name, "OurHealth", "False", reason="XID79")
    assert ours.resource_version > v1
    theirs = devices.set_condition(name, "TheirCheck", "False", reason="Bad")
    assert [c.type for c in theirs.status.conditions] == ["OurHealth", "TheirCheck"]  # kept: read-modify-write
    stale = gpu_pb2.GpuStatus(conditions=[gpu_pb2.Condition(type="OurHealth", status="True")])
    assert rpc_code(lambda: devices.set_status(name, stale, v1)) == grpc.StatusCode.ABORTED
    replaced = devices.set_status(name, stale)  # 0: no version check, and the whole status goes
    assert [c.type for c in replaced.status.conditions] == ["OurHealth"]
    assert rpc_code(lambda: devices.set_status("gpu-unknown", stale)) == grpc.StatusCode.NOT_FOUND
    writes = peer.device_writes()
    assert [w["operation"] for w in writes] == ["create", "update_status", "update_status", "update_status"]
    assert [w["resource_version"] for w in writes] == sorted({w["resource_version"] for w in writes})
    assert writes[-1]["status"] == {"conditions": [{"type": "OurHealth", "status": "True"}]}


def test_update_replaces_the_whole_gpu_and_refuses_a_stale_version(devices: DeviceApiClient) -> None:
    name = devices.create(UUID0).gpu.metadata.name
    read = devices.set_condition(name, "TheirCheck", "False")
    moved = gpu_pb2.Gpu(metadata=gpu_pb2.ObjectMeta(name=name), spec=gpu_pb2.GpuSpec(uuid=UUID1),
                        resource_version=read.resource_version)
    updated = devices.stub.UpdateGpu(gpu_pb2.UpdateGpuRequest(gpu=moved), timeout=10).gpu
    assert updated.spec.uuid == UUID1 and not updated.status.conditions  # spec and status both replaced
    req = gpu_pb2.UpdateGpuRequest(gpu=moved)  # still names the version read before the update
    assert rpc_code(lambda: devices.stub.UpdateGpu(req, timeout=10)) == grpc.StatusCode.ABORTED


def test_watch_sends_every_gpu_as_added_then_each_change(devices: DeviceApiClient) -> None:
    devices.create(UUID1)
    devices.create(UUID0)
    stream = devices.watch(timeout=30)
    first = [next(stream), next(stream)]
    assert [(e.type, e.object.spec.uuid) for e in first] == [("ADDED", UUID0), ("ADDED", UUID1)]
    devices.set_condition(UUID1.lower(), "TheirCheck", "False")
    devices.stub.DeleteGpu(gpu_pb2.DeleteGpuRequest(name=UUID0.lower()), timeout=10)
    devices.create("GPU-new")
    changes = [next(stream) for _ in range(3)]
    assert [(e.type, e.object.metadata.name) for e in changes] == [
        ("MODIFIED", UUID1.lower()), ("DELETED", UUID0.lower()), ("ADDED", "gpu-new")]
    assert changes[0].object.status.conditions[0].type == "TheirCheck"


def test_sigterm_removes_both_sockets_and_the_peer_restarts_on_the_same_paths(peer: NvsentinelPeer,
                                                                             devices: DeviceApiClient) -> None:
    devices.create(UUID0)
    assert peer.stop() == 0
    assert not peer.connector_socket.exists() and not peer.device_socket.exists()
    peer.start()
    send(peer, event())
    assert devices.list() == []  # in memory, like NVSentinel's: providers register again
    assert len(peer.events()) == 1


def test_a_socket_left_by_a_killed_peer_does_not_stop_the_next(peer: NvsentinelPeer) -> None:
    assert peer.proc is not None
    peer.proc.kill()
    peer.proc.wait()
    assert peer.connector_socket.exists()  # SIGKILL: nothing cleaned up
    peer.proc = None
    peer.start()
    send(peer, event())


def test_committed_go_code_is_what_our_protos_generate() -> None:
    tools = gen_go_peer.PEER / "tools"
    # Built here first so a missing toolchain or proxy skips (fails with CI=true) instead of erroring.
    build_or_skip(tools, "google.golang.org/protobuf/cmd/protoc-gen-go", "protoc-gen-go", version="tools")
    build_or_skip(tools, "google.golang.org/grpc/cmd/protoc-gen-go-grpc", "protoc-gen-go-grpc", version="tools")
    assert gen_go_peer.stale_files() == [], "run scripts/gen_go_peer.py"
    assert os.path.isfile(gen_go_peer.PEER / "gen" / "platformconnector" / "health_event_grpc.pb.go")
