"""The DRA driver as the kubelet sees it: NodePrepareResources / NodeUnprepareResources over a unix socket, with
the CDI specs and the checkpoint on disk, the node state published with GPUs, and the API server faked at the edge
(ResourceClaims as resource.k8s.io/v1 returns them)."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.dra.v1 import api_pb2, api_pb2_grpc
from api.dra.v1beta1 import api_pb2 as beta_pb2
from api.dra.v1beta1 import api_pb2_grpc as beta_grpc
from plugin.devices.model import MigDevice
from plugin.dra import driver as dra
from plugin.dra.checkpoint import Checkpoint
from plugin.dra.slices import SliceSettings
from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from plugin.kube.errors import ApiFailure
from tests.fakes.node_devices import Node, status

NODE = "gpu-node-1"
DRIVER = "gpu.gpu-health.io"
T0 = 1_767_225_600.0


class FakeClaims:
    """The API server's ResourceClaims, by namespace and name."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.failures: dict[tuple[str, str], ApiFailure] = {}
        self.calls: list[tuple[str, str]] = []

    def add(self, namespace: str, name: str, uid: str, results: list[dict[str, Any]] | None) -> None:
        obj: dict[str, Any] = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                               "metadata": {"name": name, "namespace": namespace, "uid": uid},
                               "spec": {"devices": {"requests": [{"name": "gpus"}]}}, "status": {}}
        if results is not None:
            obj["status"]["allocation"] = {"devices": {"results": results}}
        self.objects[(namespace, name)] = obj

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        self.calls.append((namespace, name))
        if (namespace, name) in self.failures:
            raise self.failures[(namespace, name)]
        if (namespace, name) not in self.objects:
            raise ApiFailure(404, f'resourceclaims.resource.k8s.io "{name}" not found')
        return copy.deepcopy(self.objects[(namespace, name)])


def uid(name: str) -> str:
    """A claim UID as the API server makes them (a UUID), the same for the same name."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"claim/{name}"))


def ours(device: str, request: str = "gpus") -> dict[str, Any]:
    return {"request": request, "driver": DRIVER, "pool": NODE, "device": device}


class Plugin:
    def __init__(self, root: Path, sock_dir: Path, dev_dir: str) -> None:
        self.state = NodeState()
        self.node = Node(self.state, n=8)
        self.node.publish(T0)
        self.api = FakeClaims()
        self.cdi_dir = root / "cdi"
        self.state_dir = root / "state"
        self.dev_dir = dev_dir
        self.socket = sock_dir / "dra.sock"
        self.server: grpc.Server | None = None
        self.driver: dra.Driver | None = None
        self.channel: grpc.Channel | None = None
        self.claims_changes = 0  # calls of the driver's claims_changed: the pod-condition writer's wake-up

    def _claims_changed(self) -> None:
        self.claims_changes += 1

    def start(self, allow_unhealthy: bool = False, mig_strategy: str = "none") -> None:
        self.stop()
        settings = SliceSettings(node_name=NODE, mig_strategy=mig_strategy)
        self.driver = dra.Driver(self.state, self.api, NODE, self.cdi_dir, self.state_dir, self.dev_dir,
                                 allow_unhealthy=allow_unhealthy, slice_settings=lambda: settings,
                                 claims_changed=self._claims_changed)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        dra.add_dra_services(self.server, self.driver)
        self.server.add_insecure_port(f"unix://{self.socket}")
        self.server.start()
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        self.v1 = api_pb2_grpc.DRAPluginStub(self.channel)
        self.beta = beta_grpc.DRAPluginStub(self.channel)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.server is not None:
            self.server.stop(None).wait()

    def prepare(self, *claims: tuple[str, str, str]) -> api_pb2.NodePrepareResourcesResponse:
        req = api_pb2.NodePrepareResourcesRequest(
            claims=[api_pb2.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims])
        resp: api_pb2.NodePrepareResourcesResponse = self.v1.NodePrepareResources(req, timeout=10)
        return resp

    def unprepare(self, *claims: tuple[str, str, str]) -> api_pb2.NodeUnprepareResourcesResponse:
        req = api_pb2.NodeUnprepareResourcesRequest(
            claims=[api_pb2.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims])
        resp: api_pb2.NodeUnprepareResourcesResponse = self.v1.NodeUnprepareResources(req, timeout=10)
        return resp

    def spec_path(self, uid: str) -> Path:
        return self.cdi_dir / f"gpu.gpu-health.io-{uid}.json"

    def checkpoint(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads((self.state_dir / Checkpoint.FILE).read_text())["claims"]
        return doc


@pytest.fixture
def plugin(tmp_path: Path, short_socket_dir: Path, dev_root: Path) -> Iterator[Plugin]:
    p = Plugin(tmp_path, short_socket_dir, str(dev_root / "dev"))
    p.start()
    yield p
    p.stop()


def devices(resp: Any, uid: str) -> list[tuple[list[str], str, str, list[str]]]:
    return [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids))
            for d in resp.claims[uid].devices]


def test_service_names_match_the_descriptors() -> None:
    assert dra.SERVICE_NAMES == ("v1.DRAPlugin", "v1beta1.DRAPlugin")
    assert dra.GRPC_SERVICE_NAMES == ("k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
                                      "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin")


def test_prepare_two_gpus_writes_spec_and_checkpoint_and_repeats_without_the_api(plugin: Plugin) -> None:
    uid = "7a1c0b9e-1111-4b2a-8c3d-000000000001"
    plugin.api.add("team-a", "train", uid, [
        ours("gpu-3"), ours("gpu-1"),
        {"request": "gpus", "driver": "other.example.com", "pool": NODE, "device": "gpu-0"},
        {"request": "gpus", "driver": DRIVER, "pool": "gpu-node-2", "device": "gpu-5"},
    ])
    resp = plugin.prepare(("team-a", uid, "train"))
    assert list(resp.claims) == [uid] and resp.claims[uid].error == ""
    want = [(["gpus"], NODE, "gpu-3", [f"gpu.gpu-health.io/gpu={uid}-gpu-3"]),
            (["gpus"], NODE, "gpu-1", [f"gpu.gpu-health.io/gpu={uid}-gpu-1"])]
    assert devices(resp, uid) == want

    spec = json.loads(plugin.spec_path(uid).read_text())
    assert spec["kind"] == "gpu.gpu-health.io/gpu"
    g3, g1 = plugin.node.gpus[3].uuid, plugin.node.gpus[1].uuid
    assert spec["containerEdits"]["env"] == [f"NVIDIA_VISIBLE_DEVICES={g3},{g1}"]
    dev = plugin.dev_dir
    # The test host has nvidia-uvm but not nvidia-uvm-tools.
    assert [(n["path"], n["hostPath"]) for n in spec["containerEdits"]["deviceNodes"]] == [
        ("/dev/nvidiactl", f"{dev}/nvidiactl"), ("/dev/nvidia-uvm", f"{dev}/nvidia-uvm")]
    assert {d["name"]: [(n["path"], n["hostPath"]) for n in d["containerEdits"]["deviceNodes"]]
            for d in spec["devices"]} == {f"{uid}-gpu-3": [("/dev/nvidia3", f"{dev}/nvidia3")],
                                          f"{uid}-gpu-1": [("/dev/nvidia1", f"{dev}/nvidia1")]}

    entry = plugin.checkpoint()[uid]
    assert (entry["namespace"], entry["name"]) == ("team-a", "train")
    assert [(d["device"], d["uuid"], d["pool"], d["request_names"], d["cdi_ids"]) for d in entry["devices"]] == [
        ("gpu-3", g3, NODE, ["gpus"], [f"gpu.gpu-health.io/gpu={uid}-gpu-3"]),
        ("gpu-1", g1, NODE, ["gpus"], [f"gpu.gpu-health.io/gpu={uid}-gpu-1"])]
    assert plugin.api.calls == [("team-a", "train")]

    # The kubelet asks again (its own restart): the same answer from the checkpoint, even with the GPU now
    # failing, and no API read.
    plugin.node.set(3, State.UNHEALTHY, "xid-79", now=T0 + 1)
    again = plugin.prepare(("team-a", uid, "train"))
    assert devices(again, uid) == want and again.claims[uid].error == ""
    # A spec lost since (a tmpfs CDI dir after a reboot) is written again, still without the API.
    plugin.spec_path(uid).unlink()
    assert devices(plugin.prepare(("team-a", uid, "train")), uid) == want
    assert json.loads(plugin.spec_path(uid).read_text()) == spec
    assert plugin.api.calls == [("team-a", "train")]


def test_a_pods_extended_resource_claim_keeps_its_pod_and_each_change_wakes_the_pod_condition_writer(
        plugin: Plugin) -> None:
    # As the scheduler makes it for a pod asking nvidia.com/gpu with no claim (KEP-5004): owned by the pod, annotated.
    pod_uid = "5b0e8f3a-2222-4c1d-9e0f-000000000009"
    ext, plain = uid("train-extended-resources-abcde"), uid("plain")
    plugin.api.add("team-a", "train-extended-resources-abcde", ext, [ours("gpu-2")])
    plugin.api.objects[("team-a", "train-extended-resources-abcde")]["metadata"].update(
        annotations={"resource.kubernetes.io/extended-resource-claim": "true"},
        ownerReferences=[{"apiVersion": "v1", "kind": "Pod", "name": "train", "uid": pod_uid, "controller": True,
                          "blockOwnerDeletion": True}])
    plugin.api.add("team-a", "plain", plain, [ours("gpu-4")])
    resp = plugin.prepare(("team-a", ext, "train-extended-resources-abcde"), ("team-a", plain, "plain"))
    assert resp.claims[ext].error == "" and resp.claims[plain].error == ""
    assert plugin.checkpoint()[ext]["pod"] == {"name": "train", "uid": pod_uid}
    assert "pod" not in plugin.checkpoint()[plain]
    assert plugin.claims_changes == 2
    plugin.prepare(("team-a", ext, "train-extended-resources-abcde"))  # a repeat changes nothing
    assert plugin.claims_changes == 2
    # A restarted plugin reads the pod back from the checkpoint.
    plugin.start()
    assert plugin.driver is not None
    prepared = plugin.driver.prepared()[ext]
    assert prepared.pod is not None and (prepared.pod.name, prepared.pod.uid) == ("train", pod_uid)
    plugin.unprepare(("team-a", ext, "train-extended-resources-abcde"))
    assert plugin.claims_changes == 3 and ext not in plugin.checkpoint()


def test_plugin_restart_unprepares_what_the_last_run_prepared(plugin: Plugin) -> None:
    claim = uid("restart")
    plugin.api.add("ns", "c", claim, [ours("gpu-0"), ours("gpu-0", request="more")])
    resp = plugin.prepare(("ns", claim, "c"))
    # One GPU serving two requests of the claim is one device naming both.
    assert devices(resp, claim) == [(["gpus", "more"], NODE, "gpu-0", [f"gpu.gpu-health.io/gpu={claim}-gpu-0"])]
    assert plugin.spec_path(claim).exists()

    plugin.start()  # a new process: a new Driver on the same dirs
    assert plugin.driver is not None and set(plugin.driver.prepared()) == {claim}
    out = plugin.unprepare(("ns", claim, "c"))
    assert list(out.claims) == [claim] and out.claims[claim].error == ""
    assert not plugin.spec_path(claim).exists()
    assert plugin.checkpoint() == {}
    # Once more, and a claim never seen: both already unprepared.
    out = plugin.unprepare(("ns", claim, "c"), ("ns", uid("never"), "x"))
    assert {u: c.error for u, c in out.claims.items()} == {claim: "", uid("never"): ""}


def test_unhealthy_device_fails_its_claim_only(plugin: Plugin) -> None:
    plugin.node.set(2, State.UNHEALTHY, "xid-79", now=T0 + 1)
    plugin.node.set(5, State.UNKNOWN, "nvml-error", now=T0 + 1)
    plugin.node.set(4, State.DEGRADED, "thermal-slowdown", now=T0 + 1)
    plugin.api.add("ns", "bad", uid("bad"), [ours("gpu-6"), ours("gpu-2")])
    plugin.api.add("ns", "unknown", uid("unknown"), [ours("gpu-5")])
    plugin.api.add("ns", "good", uid("good"), [ours("gpu-4")])
    resp = plugin.prepare(("ns", uid("bad"), "bad"), ("ns", uid("unknown"), "unknown"), ("ns", uid("good"), "good"))
    bad = resp.claims[uid("bad")]
    assert not bad.devices and "'gpu-2'" in bad.error and "Unhealthy (xid-79)" in bad.error and "ns/bad" in bad.error
    unknown = resp.claims[uid("unknown")]
    assert not unknown.devices and "'gpu-5'" in unknown.error and "Unknown (nvml-error)" in unknown.error
    # Degraded is usable: the kubelet health of a Degraded GPU is Healthy.
    assert resp.claims[uid("good")].error == "" and [d.device_name for d in resp.claims[uid("good")].devices] == [
        "gpu-4"]
    assert not plugin.spec_path(uid("bad")).exists() and not plugin.spec_path(uid("unknown")).exists()
    assert set(plugin.checkpoint()) == {uid("good")}

    plugin.start(allow_unhealthy=True)
    again = plugin.prepare(("ns", uid("bad"), "bad"))
    assert again.claims[uid("bad")].error == ""
    assert [d.device_name for d in again.claims[uid("bad")].devices] == ["gpu-6", "gpu-2"]


def test_claims_that_cannot_be_prepared(plugin: Plugin) -> None:
    plugin.api.add("ns", "elsewhere", uid("1"), [ours("gpu-99")])
    plugin.api.add("ns", "recreated", uid("new"), [ours("gpu-0")])
    plugin.api.add("ns", "pending", uid("3"), None)
    plugin.api.add("ns", "foreign", uid("4"), [{"request": "gpus", "driver": "other.example.com", "pool": NODE,
                                              "device": "gpu-0"}])
    plugin.api.failures[("ns", "forbidden")] = ApiFailure(403, "resourceclaims is forbidden")
    resp = plugin.prepare(("ns", uid("1"), "elsewhere"), ("ns", uid("old"), "recreated"), ("ns", uid("3"), "pending"),
                          ("ns", uid("4"), "foreign"), ("ns", uid("5"), "forbidden"), ("ns", uid("6"), "missing"))
    errors = {uid: c.error for uid, c in resp.claims.items()}
    assert all(not c.devices for c in resp.claims.values())
    assert "'gpu-99'" in errors[uid("1")] and NODE in errors[uid("1")]
    assert repr(uid("new")) in errors[uid("old")] and repr(uid("old")) in errors[uid("old")]
    assert errors[uid("3")] == "ResourceClaim ns/pending is not allocated"
    assert f"no device of driver {DRIVER} in pool {NODE}" in errors[uid("4")]
    assert "ns/forbidden" in errors[uid("5")] and "HTTP 403: resourceclaims is forbidden" in errors[uid("5")]
    assert "HTTP 404" in errors[uid("6")]
    assert not plugin.cdi_dir.exists() or list(plugin.cdi_dir.iterdir()) == []
    assert plugin.driver is not None and plugin.driver.prepared() == {}


@pytest.mark.parametrize(("claims", "field"), [
    ([("ns", uid("u1"), "a"), ("ns", "", "b")], "claims[1].uid is empty"),
    ([("ns", uid("u1"), "")], "claims[0].name is empty"),
    ([("ns", uid("u1"), "a"), ("ns", uid("u2"), "b"), ("", uid("u3"), "c")], "claims[2].namespace is empty"),
    ([("ns", uid("u1"), "a"), ("ns", uid("u1"), "a")], f"claims[1].uid {uid('u1')!r} repeats claims[0].uid"),
])
def test_malformed_request_fails_the_call_naming_the_field(plugin: Plugin, claims: list[tuple[str, str, str]],
                                                           field: str) -> None:
    plugin.api.add("ns", "a", uid("u1"), [ours("gpu-0")])
    for call in (plugin.prepare, plugin.unprepare):
        with pytest.raises(grpc.RpcError) as err:
            call(*claims)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == field
    assert plugin.api.calls == []  # nothing of a malformed batch is acted on
    assert plugin.driver is not None and plugin.driver.prepared() == {}


@pytest.mark.parametrize("bad", ["../../etc/cdi/x", "uid-1", "7a1c0b9e-1111-4b2a-8c3d-00000000000g",
                                 "7a1c0b9e11114b2a8c3d000000000001", "7a1c0b9e-1111-4b2a-8c3d-000000000001/..",
                                 " 7a1c0b9e-1111-4b2a-8c3d-000000000001", "7a1c0b9e-1111-4b2a-8c3d-000000000001\n"])
def test_a_claim_uid_that_is_not_a_uuid_fails_the_call_naming_the_claim(plugin: Plugin, bad: str) -> None:
    """The UID becomes a file name (the CDI spec, the checkpoint entry): it is checked before any is built."""
    plugin.api.add("ns", "a", uid("a"), [ours("gpu-0")])
    plugin.api.add("ns", "b", bad, [ours("gpu-1")])
    for call in (plugin.prepare, plugin.unprepare):
        with pytest.raises(grpc.RpcError) as err:
            call(("ns", uid("a"), "a"), ("ns", bad, "b"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == f"claims[1].uid {bad!r} of ResourceClaim ns/b is not a UUID"
    assert plugin.api.calls == []
    assert not plugin.cdi_dir.exists() and not plugin.state_dir.exists()
    # Upper-case hex is still a UUID.
    upper = uid("c").upper()
    plugin.api.add("ns", "c", upper, [ours("gpu-2")])
    assert plugin.prepare(("ns", upper, "c")).claims[upper].error == ""


def test_an_unreadable_checkpoint_fails_calls_with_unavailable_and_is_kept(plugin: Plugin) -> None:
    """A read error is no sign of a damaged file: the driver starts, answers UNAVAILABLE naming the file (the
    kubelet retries), and once the file reads again it answers from it."""
    claim = uid("kept")
    plugin.api.add("ns", "c", claim, [ours("gpu-0")])
    assert plugin.prepare(("ns", claim, "c")).claims[claim].error == ""
    path = plugin.state_dir / Checkpoint.FILE
    saved = path.read_bytes()
    path.unlink()
    path.mkdir()  # read() fails with EISDIR, as EACCES or EIO would
    plugin.start()
    for call in (plugin.prepare, plugin.unprepare):
        with pytest.raises(grpc.RpcError) as err:
            call(("ns", claim, "c"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert str(path) in err.value.details() and "Is a directory" in err.value.details()
    assert path.is_dir() and sorted(p.name for p in plugin.state_dir.iterdir()) == [Checkpoint.FILE]
    assert plugin.spec_path(claim).exists()
    path.rmdir()
    path.write_bytes(saved)
    out = plugin.unprepare(("ns", claim, "c"))  # the claim the file names is known again
    assert out.claims[claim].error == "" and not plugin.spec_path(claim).exists()
    assert plugin.checkpoint() == {}


def test_empty_batches_answer_empty(plugin: Plugin) -> None:
    assert dict(plugin.prepare().claims) == {}
    assert dict(plugin.unprepare().claims) == {}


def test_v1beta1_kubelet(plugin: Plugin) -> None:
    plugin.api.add("ns", "c", uid("beta"), [ours("gpu-7")])
    resp = plugin.beta.NodePrepareResources(beta_pb2.NodePrepareResourcesRequest(
        claims=[beta_pb2.Claim(namespace="ns", uid=uid("beta"), name="c")]), timeout=10)
    assert isinstance(resp, beta_pb2.NodePrepareResourcesResponse)
    assert devices(resp, uid("beta")) == [(["gpus"], NODE, "gpu-7", [f"gpu.gpu-health.io/gpu={uid('beta')}-gpu-7"])]
    assert plugin.spec_path(uid("beta")).exists()
    with pytest.raises(grpc.RpcError) as err:
        plugin.beta.NodePrepareResources(beta_pb2.NodePrepareResourcesRequest(
            claims=[beta_pb2.Claim(namespace="ns", uid="", name="c")]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details() == "claims[0].uid is empty"
    out = plugin.beta.NodeUnprepareResources(beta_pb2.NodeUnprepareResourcesRequest(
        claims=[beta_pb2.Claim(namespace="ns", uid=uid("beta"), name="c")]), timeout=10)
    assert out.claims[uid("beta")].error == ""
    assert not plugin.spec_path(uid("beta")).exists()


def test_parallel_batches_keep_every_claim(plugin: Plugin) -> None:
    for i in range(8):
        plugin.api.add("ns", f"c{i}", uid(str(i)), [ours(f"gpu-{i}")])
    with futures.ThreadPoolExecutor(max_workers=8) as pool:
        # Every claim twice, in parallel: each is read from the API once and prepared once.
        answers = list(pool.map(lambda i: plugin.prepare(("ns", uid(str(i % 8)), f"c{i % 8}")), range(16)))
    assert all(a.claims[uid(str(i % 8))].error == "" for i, a in enumerate(answers))
    assert sorted(plugin.api.calls) == sorted(("ns", f"c{i}") for i in range(8))
    assert set(plugin.checkpoint()) == {uid(str(i)) for i in range(8)}
    assert len(list(plugin.cdi_dir.iterdir())) == 8


# MIG instances (--mig-strategy mixed) -----------------------------------------------------------------------------

def mig_layout(plugin: Plugin, index: int, migs: tuple[MigDevice, ...], now: float = T0) -> None:
    """GPU ``index`` with exactly these MIG instances (none: not in MIG mode), each healthy, as discovery and the
    monitor publish a layout change."""
    old = plugin.node.gpus[index]
    for m in old.mig_devices:
        plugin.node.current.pop(m.uuid, None)
    g = replace(old, mig_devices=migs)
    plugin.node.gpus[index] = g
    plugin.node.current[g.uuid] = status(g, since=now)
    for m in migs:
        plugin.node.current[m.uuid] = status(g, since=now, mig=m)
    plugin.node.publish(now)


def instance(index: int, gi: int, ci: int = 0) -> MigDevice:
    return MigDevice(uuid=f"MIG-{index:04d}{gi:04d}-{ci:04d}-4000-8000-{gi:012d}",
                     parent_uuid=f"GPU-{index:08d}-aaaa-bbbb-cccc-{index:012d}", gpu_instance_id=gi,
                     compute_instance_id=ci, profile="1g.10gb", memory_mib=9856)


@pytest.fixture
def mig_plugin(plugin: Plugin) -> Plugin:
    """GPU 0 with three 1g.10gb instances and GPU 1 with two, the other six whole; the driver under mixed."""
    mig_layout(plugin, 0, (instance(0, 1), instance(0, 2), instance(0, 3)))
    mig_layout(plugin, 1, (instance(1, 7), instance(1, 8)))
    plugin.start(mig_strategy="mixed")
    return plugin


def test_prepare_of_mig_instances_hands_each_its_gpus_node_and_names_the_instances(mig_plugin: Plugin) -> None:
    p = mig_plugin
    claim = uid("mig")
    p.api.add("ns", "mig", claim, [ours("gpu-0-mig-2-0"), ours("gpu-1-mig-7-0"), ours("gpu-3")])
    resp = p.prepare(("ns", claim, "mig"))
    assert resp.claims[claim].error == ""
    assert devices(resp, claim) == [(["gpus"], NODE, n, [f"gpu.gpu-health.io/gpu={claim}-{n}"])
                                    for n in ("gpu-0-mig-2-0", "gpu-1-mig-7-0", "gpu-3")]
    spec = json.loads(p.spec_path(claim).read_text())
    dev = p.dev_dir
    # Each instance its own CDI device with its parent's /dev/nvidia<minor> (an instance has none of its own);
    # the control nodes once for the claim, as for whole GPUs; no capability nodes, as device-plugin mode.
    assert {d["name"]: [(n["path"], n["hostPath"]) for n in d["containerEdits"]["deviceNodes"]]
            for d in spec["devices"]} == {f"{claim}-gpu-0-mig-2-0": [("/dev/nvidia0", f"{dev}/nvidia0")],
                                          f"{claim}-gpu-1-mig-7-0": [("/dev/nvidia1", f"{dev}/nvidia1")],
                                          f"{claim}-gpu-3": [("/dev/nvidia3", f"{dev}/nvidia3")]}
    assert [n["path"] for n in spec["containerEdits"]["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    # The runtime hands the container the instances, not their GPUs.
    g3 = p.node.gpus[3].uuid
    assert spec["containerEdits"]["env"] == [
        f"NVIDIA_VISIBLE_DEVICES={instance(0, 2).uuid},{instance(1, 7).uuid},{g3}"]
    entry = p.checkpoint()[claim]
    assert [(d["device"], d["uuid"], d["minor"], d.get("parent_uuid")) for d in entry["devices"]] == [
        ("gpu-0-mig-2-0", instance(0, 2).uuid, 0, p.node.gpus[0].uuid),
        ("gpu-1-mig-7-0", instance(1, 7).uuid, 1, p.node.gpus[1].uuid),
        ("gpu-3", g3, 3, None)]
    out = p.unprepare(("ns", claim, "mig"))
    assert out.claims[claim].error == "" and not p.spec_path(claim).exists() and p.checkpoint() == {}


def test_a_gpu_published_as_instances_and_an_instance_under_none_are_no_devices_of_the_node(
        mig_plugin: Plugin) -> None:
    p = mig_plugin
    p.api.add("ns", "whole", uid("whole"), [ours("gpu-0")])
    err = p.prepare(("ns", uid("whole"), "whole")).claims[uid("whole")].error
    assert err == f"ResourceClaim ns/whole: device 'gpu-0' is not a GPU or MIG instance of node {NODE}"
    p.start(mig_strategy="none")  # the same node published whole: now gpu-0 is a device and its instances not
    p.api.add("ns", "inst", uid("inst"), [ours("gpu-0-mig-1-0")])
    assert "'gpu-0-mig-1-0' is not a GPU or MIG instance" in p.prepare(("ns", uid("inst"), "inst")).claims[
        uid("inst")].error
    assert p.prepare(("ns", uid("whole"), "whole")).claims[uid("whole")].error == ""
    assert p.driver is not None and p.driver.result_counts()[("prepare", "not-ours")] == 1


def test_a_fault_of_the_gpu_refuses_claims_on_its_instances_naming_the_instance(mig_plugin: Plugin) -> None:
    p = mig_plugin
    g0 = p.node.gpus[0]
    # As the monitor publishes it: the GPU's fault is every instance's.
    p.node.current[g0.uuid] = status(g0, State.UNHEALTHY, "xid-79", since=T0 + 1)
    for m in g0.mig_devices:
        p.node.current[m.uuid] = status(g0, State.UNHEALTHY, "xid-79", since=T0 + 1, mig=m)
    p.node.publish(T0 + 1)
    p.api.add("ns", "bad", uid("bad"), [ours("gpu-0-mig-3-0")])
    p.api.add("ns", "good", uid("good"), [ours("gpu-1-mig-8-0")])
    resp = p.prepare(("ns", uid("bad"), "bad"), ("ns", uid("good"), "good"))
    bad = resp.claims[uid("bad")]
    assert not bad.devices and bad.error == (
        f"ResourceClaim ns/bad: device 'gpu-0-mig-3-0' ({instance(0, 3).uuid}) is Unhealthy (xid-79); the claim "
        "does not tolerate its taint gpu-health.io/unhealthy=xid-79:NoSchedule; refusing to prepare it")
    assert resp.claims[uid("good")].error == ""
    assert set(p.checkpoint()) == {uid("good")}


def test_a_mig_layout_change_keeps_prepared_claims_until_the_kubelet_unprepares_them(mig_plugin: Plugin) -> None:
    p = mig_plugin
    claim = uid("before")
    p.api.add("ns", "before", claim, [ours("gpu-0-mig-1-0")])
    want = devices(p.prepare(("ns", claim, "before")), claim)
    spec = p.spec_path(claim).read_text()
    # GPU 0's instances are destroyed and one larger one made in their place.
    bigger = replace(instance(0, 5), profile="4g.40gb", memory_mib=40192)
    mig_layout(p, 0, (bigger,), now=T0 + 60)
    # The kubelet asks again (its restart): the claim is still prepared, as it was, without the API server.
    assert devices(p.prepare(("ns", claim, "before")), claim) == want
    assert p.spec_path(claim).read_text() == spec and set(p.checkpoint()) == {claim}
    assert p.api.calls == [("ns", "before")]
    # A claim allocated the destroyed instance (before the slice moved on) is not prepared: nothing to hand over.
    p.api.add("ns", "late", uid("late"), [ours("gpu-0-mig-1-0")])
    late = p.prepare(("ns", uid("late"), "late")).claims[uid("late")]
    assert not late.devices and "device 'gpu-0-mig-1-0' is not a GPU or MIG instance" in late.error
    p.api.add("ns", "new", uid("new"), [ours("gpu-0-mig-5-0")])
    assert p.prepare(("ns", uid("new"), "new")).claims[uid("new")].error == ""
    assert p.checkpoint()[uid("new")]["devices"][0]["uuid"] == bigger.uuid
    assert p.driver is not None and p.driver.result_counts()[("prepare", "not-ours")] == 1
    # After a plugin restart too, the old claim unprepares: its spec and checkpoint entry go.
    p.start(mig_strategy="mixed")
    assert p.unprepare(("ns", claim, "before")).claims[claim].error == ""
    assert not p.spec_path(claim).exists() and set(p.checkpoint()) == {uid("new")}


def shared(device: str, share: str, request: str = "gpus") -> dict[str, Any]:
    """An allocation result of a device the slice lets several claims hold: the scheduler gives each its shareID."""
    return {**ours(device, request), "shareID": share,
            "consumedCapacity": {f"{DRIVER}/shares": "1", f"{DRIVER}/memory": "0"}}


def test_two_claims_on_one_shared_gpu_each_get_it_with_their_share_id(plugin: Plugin) -> None:
    a, b = uid("share-a"), uid("share-b")
    sa, sb = "1f0c2b7e-0000-4000-8000-00000000000a", "1f0c2b7e-0000-4000-8000-00000000000b"
    plugin.api.add("ns", "a", a, [shared("gpu-4", sa)])
    plugin.api.add("ns", "b", b, [shared("gpu-4", sb)])
    resp = plugin.prepare(("ns", a, "a"), ("ns", b, "b"))
    assert {u: c.error for u, c in resp.claims.items()} == {a: "", b: ""}
    assert [d.share_id for d in resp.claims[a].devices] == [sa] and [d.share_id for d in resp.claims[b].devices] == [sb]
    # Both containers see the same GPU, each through its own claim's CDI device.
    g4 = plugin.node.gpus[4].uuid
    for u in (a, b):
        spec = json.loads(plugin.spec_path(u).read_text())
        assert spec["containerEdits"]["env"] == [f"NVIDIA_VISIBLE_DEVICES={g4}"]
        assert [d["name"] for d in spec["devices"]] == [f"{u}-gpu-4"]
    # The share survives a plugin restart: a repeated prepare answers it from the checkpoint.
    plugin.start()
    again = plugin.prepare(("ns", a, "a"))
    assert [d.share_id for d in again.claims[a].devices] == [sa]
    assert plugin.checkpoint()[a]["devices"][0]["share_id"] == sa
    # One claim unprepared leaves the other's prepared.
    assert plugin.unprepare(("ns", a, "a")).claims[a].error == ""
    assert set(plugin.checkpoint()) == {b} and plugin.spec_path(b).exists()


def test_two_shares_of_one_gpu_in_one_claim_are_two_devices_to_the_kubelet_and_one_to_the_container(
        plugin: Plugin) -> None:
    c = uid("two-shares")
    s1, s2 = "2e0c2b7e-0000-4000-8000-000000000001", "2e0c2b7e-0000-4000-8000-000000000002"
    plugin.api.add("ns", "c", c, [shared("gpu-6", s1, "first"), shared("gpu-6", s2, "second")])
    resp = plugin.prepare(("ns", c, "c"))
    assert resp.claims[c].error == ""
    assert [(list(d.request_names), d.device_name, d.share_id) for d in resp.claims[c].devices] == [
        (["first"], "gpu-6", s1), (["second"], "gpu-6", s2)]
    spec = json.loads(plugin.spec_path(c).read_text())
    assert [d["name"] for d in spec["devices"]] == [f"{c}-gpu-6"]
    assert spec["containerEdits"]["env"] == [f"NVIDIA_VISIBLE_DEVICES={plugin.node.gpus[6].uuid}"]


def test_a_v1beta1_kubelet_gets_a_shared_gpu_without_the_share_id_it_has_no_field_for(plugin: Plugin) -> None:
    c = uid("beta-share")
    plugin.api.add("ns", "c", c, [shared("gpu-2", "3e0c2b7e-0000-4000-8000-000000000001")])
    resp = plugin.beta.NodePrepareResources(beta_pb2.NodePrepareResourcesRequest(
        claims=[beta_pb2.Claim(namespace="ns", uid=c, name="c")]), timeout=10)
    assert devices(resp, c) == [(["gpus"], NODE, "gpu-2", [f"gpu.gpu-health.io/gpu={c}-gpu-2"])]
