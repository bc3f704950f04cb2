"""The DRA driver as the kubelet sees it: NodePrepareResources / NodeUnprepareResources over a unix socket, with
the CDI specs and the checkpoint on disk, the node state published with GPUs, and the API server faked at the edge
(ResourceClaims as resource.k8s.io/v1 returns them)."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.dra.v1 import api_pb2, api_pb2_grpc
from api.dra.v1beta1 import api_pb2 as beta_pb2
from api.dra.v1beta1 import api_pb2_grpc as beta_grpc
from plugin.dra import driver as dra
from plugin.dra.checkpoint import Checkpoint
from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from plugin.kube.errors import ApiFailure
from tests.fakes.node_devices import Node

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

    def start(self, allow_unhealthy: bool = False) -> None:
        self.stop()
        self.driver = dra.Driver(self.state, self.api, NODE, self.cdi_dir, self.state_dir, self.dev_dir,
                                 allow_unhealthy=allow_unhealthy)
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
