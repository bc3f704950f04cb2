"""The ResourceSlice admission policy (manifests/base/resourceslicepolicy.yaml) on a real kube-apiserver, with the
plugin's own Pod-bound token.

DRA mode's grant (components/dra/rbac.yaml) lets the plugin's account create, update and delete every ResourceSlice
in the cluster; the policy confines that to the slice of the plugin's own node and driver. Here the grant is
bound as shipped (its rules and the base ClusterRole's, bound to a service account of the plugin's name in a
namespace of this module's own) and the policy is applied as shipped. The plugin's own writer
(plugin/dra/slicewriter.py, with its real client) creates, updates and deletes node A's slice through a token
bound to a Pod on node A, as the kubelet projects it; every write of another node's slice, of another driver's,
of a slice spread over nodes, under another node's pool or name, or without a node association, is refused with a
message naming the node or driver, and the stored slices stay as they were; through the beta versions of the API
too (on a server of this module's own that serves them).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plugin.devices.simulated import builtin_node, parse_node
from plugin.dra import slices as rs
from plugin.dra.slicewriter import SliceWriter
from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from plugin.kube.client import KubeClient
from plugin.kube.names import DEFAULT_PREFIX
from tests.conformance.apiserver.apiserver_peer import ApiServerPeer, PeerStartError, wait_until
from tests.conformance.apiserver.shipped_rbac import dra_grants
from tests.conftest import FakeClock
from tests.fakes.node_devices import status

pytestmark = [pytest.mark.conformance, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
MANIFESTS = REPO / "manifests"
POLICY_FILE = MANIFESTS / "base" / "resourceslicepolicy.yaml"
NAMESPACE = "rsp-test"  # not manifests/base's namespace, which other modules apply and check
SERVICE_ACCOUNT = "gpu-health-device-plugin"
NODE_A = "rsp-node-a"
NODE_B = "rsp-node-b"
# A node name near the limit: the plugin cuts its slice name and ends it in a hash (resourceslices.slice_name).
NODE_LONG = ".".join(["rsp-long-" + "a" * 54, "b" * 63, "c" * 63, "d" * 49])
POD_A = "gpu-health-device-plugin-rsp-a"
POD_LONG = "gpu-health-device-plugin-rsp-long"
OTHER_DRIVER = "other.example.com"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
T0 = 1_767_225_600.0
GPUS = [s.gpu for s in parse_node(builtin_node())]
BETAS = ("v1beta1", "v1beta2")


def our_slice(node: str, **changes: Any) -> dict[str, Any]:
    """The slice the plugin on ``node`` would write (its own pure function), with ``changes`` to spec."""
    body = rs.desired_slice(GPUS, {}, rs.SliceSettings(node_name=node))
    body["spec"].update(changes)
    return body


def other_drivers_slice(node: str) -> dict[str, Any]:
    body = rs.desired_slice(GPUS[:1], {}, rs.SliceSettings(node_name=node, driver=OTHER_DRIVER))
    for d in body["spec"]["devices"]:
        d["attributes"] = {k.replace(rs.DRIVER, OTHER_DRIVER): v for k, v in d["attributes"].items()}
        if "capacity" in d:
            d["capacity"] = {k.replace(rs.DRIVER, OTHER_DRIVER): v for k, v in d["capacity"].items()}
    return body


def assert_denied(result: Any, *fragments: str) -> None:
    assert result.status == 403, f"expected 403, got {result.status}: {result.message[:300]}"
    assert "ValidatingAdmissionPolicy" in result.message, result.message  # the policy's, not RBAC's
    for fragment in fragments:
        assert fragment in result.message, f"{fragment!r} not in {result.message!r}"


class Cluster:
    def __init__(self, apiserver: Any) -> None:
        self.apiserver = apiserver

    def get(self, name: str) -> dict[str, Any] | None:
        r = self.apiserver.request("GET", f"{SLICES}/{name}")
        if r.status == 404:
            return None
        assert r.ok, r.message
        return dict(r.body)

    def put_as_admin(self, body: dict[str, Any]) -> dict[str, Any]:
        """Create ``body`` as the admin (replacing a leftover of an earlier test), for the plugin to be tried on."""
        name = body["metadata"]["name"]
        if self.get(name) is not None:
            assert self.apiserver.request("DELETE", f"{SLICES}/{name}").ok
        r = self.apiserver.request("POST", SLICES, body)
        assert r.ok, r.message
        return dict(r.body)


def _bind_pod(apiserver: Any, pod: str, node: str) -> str:
    apiserver.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "namespace": NAMESPACE},
                     "spec": {"nodeName": node, "serviceAccountName": SERVICE_ACCOUNT,
                              "containers": [{"name": "plugin", "image": "gpu-health-device-plugin:test"}]}})
    return str(apiserver.token_for_pod(NAMESPACE, SERVICE_ACCOUNT, pod))


def deploy(apiserver: Any) -> dict[str, Any]:
    """Nodes A, B and a long-named one, the DRA grant and the policy as shipped, the plugin's Pods and tokens."""
    for name in (NODE_A, NODE_B):
        apiserver.create_node(name)
    # A hostname label cannot hold a name this long: the Node is made without one.
    long_node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE_LONG}}
    assert apiserver.request("POST", "/api/v1/nodes", long_node).ok

    objs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": SERVICE_ACCOUNT, "namespace": NAMESPACE}},
    ]
    objs += dra_grants("rsp-test", SERVICE_ACCOUNT, NAMESPACE)
    apiserver.apply(objs)
    # The policy exactly as shipped (it matches the service-account name in any namespace).
    apiserver.kubectl("apply", "-f", str(POLICY_FILE))
    token = _bind_pod(apiserver, POD_A, NODE_A)
    long_token = _bind_pod(apiserver, POD_LONG, NODE_LONG)

    # The plugin's account may write every slice as far as RBAC goes: what stops it below is the policy alone. A
    # dry run: node B's slice is never written.
    probe = our_slice(NODE_B)

    def policy_in_force() -> bool:
        r = apiserver.request("POST", f"{SLICES}?dryRun=All", probe, token=token)
        return r.status == 403 and "ValidatingAdmissionPolicy" in r.message

    wait_until(policy_in_force, "the RBAC grant and the admission policy to be in force")
    return {"token": token, "long_token": long_token, "cluster": Cluster(apiserver)}


@pytest.fixture(scope="module")
def deployed(apiserver: Any) -> dict[str, Any]:
    return deploy(apiserver)


@pytest.fixture(scope="module")
def beta_server(apiserver_binaries: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A server of its own that also serves resource.k8s.io v1beta1 and v1beta2, as a cluster that still serves
    them does (1.37 does not by default), with the same grant and policy."""
    versions = ",".join(f"resource.k8s.io/{v}=true" for v in BETAS)
    for attempt in range(3):
        try:
            peer = ApiServerPeer.start(apiserver_binaries, workdir=tmp_path_factory.mktemp("apiserver-beta"),
                                       extra_apiserver_args=[f"--runtime-config={versions}"])
            break
        except PeerStartError as exc:  # the free ports are picked before they are bound: another process can win
            if attempt == 2 or "address already in use" not in str(exc):
                raise
    try:
        yield peer, deploy(peer)
    finally:
        peer.stop()


@pytest.fixture()
def token(deployed: dict[str, Any]) -> str:
    return str(deployed["token"])


@pytest.fixture()
def cluster(deployed: dict[str, Any]) -> Cluster:
    c: Cluster = deployed["cluster"]
    return c


class PluginWriter:
    """The plugin's own slice writer and client, through the plugin's token, on a hand-driven clock."""

    def __init__(self, apiserver: Any, token: str, node: str) -> None:
        self.clock = FakeClock(1000.0)
        self.state = NodeState()
        self.statuses = {g.uuid: status(g, since=T0) for g in GPUS}
        kubeconfig = apiserver.kubeconfig_for_token(token, f"plugin-{node[:20]}")
        self.writer = SliceWriter(self.state, rs.SliceSettings(node_name=node), lambda: KubeClient(kubeconfig),
                                  debounce_s=1.0, min_interval_s=10.0, resync_s=600.0, backoff_max_s=60.0,
                                  clock=self.clock, rng=random.Random(9))

    def publish(self) -> None:
        self.state.publish(list(self.statuses.values()), T0 + self.clock.now)

    def set(self, index: int, state: State, *codes: str) -> None:
        g = next(g for g in GPUS if g.index == index)
        self.statuses[g.uuid] = status(g, state, *codes, since=T0 + self.clock.now)
        self.publish()

    def run_for(self, seconds: float) -> None:
        end = self.clock.now + seconds
        for _ in range(10_000):
            deadline = self.writer.tick(self.clock.now)
            if self.clock.now >= end:
                return
            self.clock.now = min(max(deadline, self.clock.now), end)
        raise AssertionError("the writer did not settle")


# What the plugin does is let through --------------------------------------------------------------------------

@pytest.mark.parametrize("node", [NODE_A, NODE_LONG], ids=["node-a", "long-node-name"])
def test_the_plugins_writer_creates_updates_and_deletes_its_own_slice(apiserver: Any, deployed: dict[str, Any],
                                                                     cluster: Cluster, node: str) -> None:
    w = PluginWriter(apiserver, deployed["token"] if node == NODE_A else deployed["long_token"], node)
    name = w.writer.name
    if cluster.get(name) is not None:
        assert apiserver.request("DELETE", f"{SLICES}/{name}").ok
    w.publish()
    w.run_for(5)  # create, with the Node as owner (read through the base grant)
    stored = cluster.get(name)
    assert stored is not None, w.writer.status()
    assert (stored["spec"]["nodeName"], stored["spec"]["driver"], stored["spec"]["pool"]["name"]) == (
        node, rs.DRIVER, node)
    assert stored["metadata"]["ownerReferences"][0]["name"] == node
    w.set(3, State.UNHEALTHY, "xid-79")
    w.run_for(30)  # update: a PUT at the next pool generation
    stored = cluster.get(name)
    assert stored is not None and stored["spec"]["pool"]["generation"] == 2
    assert [d["taints"][0]["key"] for d in stored["spec"]["devices"] if d.get("taints")] == [
        f"{DEFAULT_PREFIX}/{rs.UNHEALTHY_KEY}"]
    w.writer.stop()
    w.writer.delete_slice()  # delete (the uninstall path)
    assert cluster.get(name) is None
    s = w.writer.status()
    assert (s.ok, s.writes, s.failures) == (True, 3, 0), s


# What it must not do is refused --------------------------------------------------------------------------------

def test_another_nodes_slice_cannot_be_created_updated_or_deleted(apiserver: Any, token: str,
                                                                  cluster: Cluster) -> None:
    b = our_slice(NODE_B)
    name = b["metadata"]["name"]
    if cluster.get(name) is not None:
        assert apiserver.request("DELETE", f"{SLICES}/{name}").ok
    assert_denied(apiserver.request("POST", SLICES, b, token=token),
                  f"running on node {NODE_A} may not create a ResourceSlice of node {NODE_B}")
    assert cluster.get(name) is None

    stored = cluster.put_as_admin(b)
    changed = copy.deepcopy(stored)
    changed["spec"]["devices"] = changed["spec"]["devices"][:1]  # phantom or vanished GPUs on node B
    assert_denied(apiserver.request("PUT", f"{SLICES}/{name}", changed, token=token),
                  f"running on node {NODE_A} may not update a ResourceSlice of node {NODE_B}")
    assert_denied(apiserver.request("DELETE", f"{SLICES}/{name}", token=token),
                  f"running on node {NODE_A} may not delete a ResourceSlice of node {NODE_B}")
    assert cluster.get(name) == stored


def test_another_drivers_slice_on_its_own_node_is_refused(apiserver: Any, token: str, cluster: Cluster) -> None:
    other = other_drivers_slice(NODE_A)
    name = other["metadata"]["name"]
    if cluster.get(name) is not None:
        assert apiserver.request("DELETE", f"{SLICES}/{name}").ok
    assert_denied(apiserver.request("POST", SLICES, other, token=token),
                  f"may only create ResourceSlices of driver {rs.DRIVER}, not of driver {OTHER_DRIVER}")
    assert cluster.get(name) is None
    stored = cluster.put_as_admin(other)
    changed = copy.deepcopy(stored)
    changed["spec"]["devices"] = []
    assert_denied(apiserver.request("PUT", f"{SLICES}/{name}", changed, token=token),
                  f"may only update ResourceSlices of driver {rs.DRIVER}, not of driver {OTHER_DRIVER}")
    assert_denied(apiserver.request("DELETE", f"{SLICES}/{name}", token=token),
                  f"may only delete ResourceSlices of driver {rs.DRIVER}, not of driver {OTHER_DRIVER}")
    assert cluster.get(name) == stored


SPREAD = {
    "all-nodes": {"allNodes": True},
    "node-selector": {"nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": [NODE_A, NODE_B]}]}]}},
}


@pytest.mark.parametrize("spread", SPREAD, ids=list(SPREAD))
def test_a_slice_spread_over_nodes_is_refused(apiserver: Any, token: str, cluster: Cluster, spread: str) -> None:
    body = our_slice(NODE_A)
    del body["spec"]["nodeName"]
    body["spec"].update(SPREAD[spread])
    body["metadata"]["name"] = f"rsp-spread-{spread}"
    # Valid as such: the admin may publish it, so what refuses the plugin is the policy, not validation.
    assert apiserver.request("POST", f"{SLICES}?dryRun=All", body).ok
    assert_denied(apiserver.request("POST", SLICES, body, token=token),
                  f"running on node {NODE_A} may not create a ResourceSlice for all nodes, a node selector or "
                  f"per-device node selection")
    assert cluster.get(body["metadata"]["name"]) is None


def test_per_device_node_selection_is_refused(apiserver: Any, token: str, cluster: Cluster) -> None:
    body = our_slice(NODE_A)
    del body["spec"]["nodeName"]
    body["spec"]["perDeviceNodeSelection"] = True
    for d in body["spec"]["devices"]:
        d["nodeName"] = NODE_B
    body["metadata"]["name"] = "rsp-spread-per-device"
    admin = apiserver.request("POST", f"{SLICES}?dryRun=All", body)
    if not admin.ok or not admin.body["spec"].get("perDeviceNodeSelection"):
        pytest.skip(f"this API server does not keep perDeviceNodeSelection (DRAPartitionableDevices off): "
                    f"{admin.status} {admin.message}")
    assert_denied(apiserver.request("POST", SLICES, body, token=token), "per-device node selection")
    assert cluster.get(body["metadata"]["name"]) is None


def test_another_nodes_pool_or_slice_name_is_refused(apiserver: Any, token: str, cluster: Cluster) -> None:
    # Both on node A, of our driver: only the pool or the name is node B's, which would break node B's pool or
    # keep node B's plugin from creating its slice.
    in_bs_pool = our_slice(NODE_A, pool={"name": NODE_B, "generation": 1, "resourceSliceCount": 1})
    in_bs_pool["metadata"]["name"] = "rsp-in-b-pool"
    assert_denied(apiserver.request("POST", SLICES, in_bs_pool, token=token),
                  f"running on node {NODE_A} names its ResourceSlice pool after its node, not {NODE_B}")
    squat = our_slice(NODE_A)
    squat["metadata"]["name"] = rs.slice_name(rs.SliceSettings(node_name=NODE_B))
    if cluster.get(squat["metadata"]["name"]) is not None:  # node B's own, left by another test
        assert apiserver.request("DELETE", f"{SLICES}/{squat['metadata']['name']}").ok
    assert_denied(apiserver.request("POST", SLICES, squat, token=token),
                  f"may only create the ResourceSlice named {NODE_A}-{rs.DRIVER}, not {NODE_B}-{rs.DRIVER}")
    assert cluster.get("rsp-in-b-pool") is None
    assert cluster.get(squat["metadata"]["name"]) is None


def test_a_token_without_node_association_is_refused(apiserver: Any, deployed: dict[str, Any],
                                                     cluster: Cluster) -> None:
    unbound = apiserver.token_for_service_account(NAMESPACE, SERVICE_ACCOUNT)
    assert "authentication.kubernetes.io/node-name" not in (apiserver.whoami(unbound).get("extra") or {})
    a = our_slice(NODE_A)
    name = a["metadata"]["name"]
    if cluster.get(name) is not None:
        assert apiserver.request("DELETE", f"{SLICES}/{name}").ok
    assert_denied(apiserver.request("POST", SLICES, a, token=unbound), "no node association")
    stored = cluster.put_as_admin(a)
    assert_denied(apiserver.request("DELETE", f"{SLICES}/{name}", token=unbound), "no node association")
    assert cluster.get(name) == stored
    assert apiserver.request("DELETE", f"{SLICES}/{name}").ok


@pytest.mark.parametrize("version", BETAS)
def test_an_older_api_version_is_judged_the_same(beta_server: Any, version: str) -> None:
    # Equivalent match: a write through a beta version is converted to v1 and judged by the same rules.
    apiserver, deployed = beta_server
    token, cluster = deployed["token"], deployed["cluster"]
    b = our_slice(NODE_B)
    b["apiVersion"] = f"resource.k8s.io/{version}"
    if version == "v1beta1":  # v1beta1 nests a device's fields under `basic`
        b["spec"]["devices"] = [{"name": d["name"], "basic": {k: v for k, v in d.items() if k != "name"}}
                                for d in b["spec"]["devices"]]
    path = f"/apis/resource.k8s.io/{version}/resourceslices"
    if cluster.get(b["metadata"]["name"]) is not None:  # left by the other version's run
        assert apiserver.request("DELETE", f"{SLICES}/{b['metadata']['name']}").ok
    assert apiserver.request("POST", f"{path}?dryRun=All", b).ok  # valid as such: the admin may write it
    assert_denied(apiserver.request("POST", path, b, token=token),
                  f"running on node {NODE_A} may not create a ResourceSlice of node {NODE_B}")
    assert cluster.get(b["metadata"]["name"]) is None
    stored = cluster.put_as_admin(our_slice(NODE_B))
    assert_denied(apiserver.request("DELETE", f"{path}/{b['metadata']['name']}", token=token),
                  f"may not delete a ResourceSlice of node {NODE_B}")
    assert cluster.get(b["metadata"]["name"]) == stored
    # Its own slice, through the same version, passes.
    a = copy.deepcopy(b)
    a["metadata"]["name"] = rs.slice_name(rs.SliceSettings(node_name=NODE_A))
    a["spec"].update(nodeName=NODE_A, pool={"name": NODE_A, "generation": 1, "resourceSliceCount": 1})
    if cluster.get(a["metadata"]["name"]) is not None:
        assert apiserver.request("DELETE", f"{SLICES}/{a['metadata']['name']}").ok
    created = apiserver.request("POST", path, a, token=token)
    assert created.ok, created.message[:300]
    assert apiserver.request("DELETE", f"{path}/{a['metadata']['name']}", token=token).ok


def test_other_accounts_are_not_judged(apiserver: Any, deployed: dict[str, Any], cluster: Cluster) -> None:
    # The admin (and so the kubelet, the scheduler, other drivers) writes any node's slice as before.
    b = our_slice(NODE_B)
    stored = cluster.put_as_admin(b)
    assert apiserver.request("DELETE", f"{SLICES}/{stored['metadata']['name']}").ok
