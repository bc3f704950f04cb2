"""Issue 37, "switch one pool, and back" (docs/migrate.md), on the real local cluster: the node moves from a plugin
answering as NVIDIA's does to ours and back, the way the page tells an operator of the GPU Operator to do it, while
the kubelet's own count of allocatable `nvidia.com/gpu` is sampled ten times a second and a watch on the Node records
every value it reports.

NVIDIA's plugin is played by tests/fakes/nvidia_device_plugin.py: the same resource from the same directory on
NVIDIA's socket name, the GPUs by UUID, Allocate with NVIDIA_VISIBLE_DEVICES only. It runs from the plugin's own
image (whose venv has grpc and the generated API) as a DaemonSet selecting `nvidia.com/gpu.deploy.device-plugin:
"true"`, as the operator's does. Ours is the chart with the local cluster's values and
docs/recipes/canary-pool-values.yaml. Since NVIDIA's plugin leaves device nodes to the NVIDIA runtime (absent here)
and ours returns them, a workload's `ls /dev` tells which plugin admitted it.

pytest takes the files in name order: this one runs after test_stories_dra_chart.py, whose story 27 left no plugin and
no plugin namespace, and leaves the cluster the same way for test_stories_nvml.py (no plugin of either kind, no
plugin namespace, no annotations, neither label). Run alone, the conftest has deployed overlays/local-cluster:
story 50 removes it first.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.podresources.v1 import api_pb2, api_pb2_grpc
from tests.e2e.conftest import NS, REPO, RES, Local, NodeWatch, until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PLUGIN_NS = "gpu-health-system"
CHART = str(REPO / "charts" / "gpu-health-device-plugin")
RELEASE = "gpu-health-device-plugin"
CANARY = REPO / "docs" / "recipes" / "canary-pool-values.yaml"
HELM_VALUES = ["-f", str(REPO / "scripts" / "localcluster" / "helm-values.yaml"), "-f", str(CANARY)]
OURS_LABEL = "gpu-health.io/device-plugin"  # what canary-pool-values.yaml selects
THEIRS_LABEL = "nvidia.com/gpu.deploy.device-plugin"  # what the GPU Operator's device plugin selects
THEIRS_NS = "nvidia-standin"
THEIRS_APP = "nvidia-device-plugin-daemonset"
THEIRS_DS = f"daemonset/{THEIRS_APP}"
STANDIN = REPO / "tests" / "fakes" / "nvidia_device_plugin.py"
# The kubelet's device-plugin directory is fixed, whatever its --root-dir (docs/local-cluster.md).
DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")
ALLOCATABLE = "{.status.allocatable.nvidia\\.com/gpu}"


class KubeletAllocatable:
    """The kubelet's allocatable `nvidia.com/gpu`, read live from its PodResources API (GetAllocatableResources: the
    devices its device manager holds healthy) every 0.1 s in the background. The Node's status carries the same
    number but is written every 10 s or so, and a plugin hand-over that leaves the kubelet with no plugin for a few
    seconds can fall between two writes; it cannot fall between these samples."""

    def __init__(self, local: Local) -> None:
        self.samples: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._channel = grpc.insecure_channel(f"unix://{local.info['pod_resources_socket']}")
        self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                resp = self._stub.GetAllocatableResources(api_pb2.AllocatableResourcesRequest(), timeout=5)
                self.samples.append(sum(len(d.device_ids) for d in resp.devices if d.resource_name == RES))
            except grpc.RpcError as exc:
                self.errors.append(str(exc.code()))
            self._stop.wait(0.1)  # the sampling period, not a wait for something

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join(10)
        self._channel.close()
        return self.samples


def _never_below_8(kubelet: KubeletAllocatable, node: list[str]) -> None:
    samples = kubelet.samples
    assert not kubelet.errors, kubelet.errors
    assert len(samples) > 20, samples  # seconds of samples, or the check below says nothing
    assert min(samples) == max(samples) == 8, sorted(set(samples))
    assert node and {int(v or 0) for v in node} == {8}, node


def _standin(local: Local) -> list[dict[str, Any]]:
    """NVIDIA's plugin as the GPU Operator deploys it, as far as the node can tell: a DaemonSet on the nodes labelled
    for it, the kubelet's device-plugin directory mounted, root. Ready once registered (the stand-in's ready file)."""
    privileged = {f"pod-security.kubernetes.io/{m}": "privileged" for m in ("enforce", "audit", "warn")}
    args = [a for u in local.node_file.uuids for a in ("--device", u)] + ["--ready-file", "/tmp/registered"]
    pod = {
        "nodeSelector": {THEIRS_LABEL: "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 5,
        "containers": [{
            "name": "nvidia-device-plugin-ctr", "image": local.info["plugin_image"], "imagePullPolicy": "Never",
            "command": ["/opt/venv/bin/python", "/standin/nvidia_device_plugin.py"], "args": args,
            "securityContext": {"runAsUser": 0},
            "readinessProbe": {"exec": {"command": ["test", "-f", "/tmp/registered"]}, "periodSeconds": 1},
            "volumeMounts": [{"name": "device-plugins", "mountPath": str(DEVICE_PLUGINS)},
                             {"name": "standin", "mountPath": "/standin", "readOnly": True}],
        }],
        "volumes": [{"name": "device-plugins", "hostPath": {"path": str(DEVICE_PLUGINS), "type": "Directory"}},
                    {"name": "standin", "configMap": {"name": "nvidia-standin"}}],
    }
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": THEIRS_NS, "labels": privileged}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "nvidia-standin", "namespace": THEIRS_NS},
         "data": {"nvidia_device_plugin.py": STANDIN.read_text()}},
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": THEIRS_APP, "namespace": THEIRS_NS},
         "spec": {"selector": {"matchLabels": {"app": THEIRS_APP}},
                  "template": {"metadata": {"labels": {"app": THEIRS_APP}}, "spec": pod}}},
    ]


def _label(local: Local, key: str, value: str | None) -> None:
    local.kubectl("label", "node", local.node, f"{key}={value}" if value is not None else f"{key}-", "--overwrite")


def _theirs(local: Local) -> list[dict[str, Any]]:
    out = local.kubectl("get", "pods", "-n", THEIRS_NS, "-l", f"app={THEIRS_APP}", "-o", "json", check=False)
    items: list[dict[str, Any]] = json.loads(out)["items"] if out else []
    return items


def _theirs_registered(local: Local) -> None:
    local.kubectl("-n", THEIRS_NS, "rollout", "status", THEIRS_DS, "--timeout=120s", timeout=140)
    [pod] = _theirs(local)
    assert all(c["ready"] for c in pod["status"]["containerStatuses"]), pod["status"]
    assert (DEVICE_PLUGINS / "nvidia-gpu.sock").is_socket()


def _state(local: Local, pod: str) -> tuple[str, str, int, str]:
    """What a restart or a replacement would change: UID, container ID, restarts, and that it runs."""
    p = local.get("pod", pod, NS)
    [cs] = p["status"]["containerStatuses"]
    return p["metadata"]["uid"], cs["containerID"], cs["restartCount"], next(iter(cs["state"]))


def _admitted(local: Local, name: str) -> tuple[list[str], int]:
    """Run a 1-GPU pod; its GPUs and how many NVIDIA device nodes its container has (ours returns them in Allocate,
    NVIDIA's leaves them to its runtime). The count is printed first, so it is in the log once the UUIDs are."""
    local.apply(local.gpu_pod(name, 1, "echo DEVICE_NODES=$(ls /dev | grep -c nvidia); "
                                       "echo NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES; sleep 100000"))
    uuids = local.visible_devices(name)
    [count] = [ln.split("=", 1)[1] for ln in local.logs(name).splitlines() if ln.startswith("DEVICE_NODES=")]
    return uuids, int(count)


PODS: dict[str, tuple[str, str, int, str]] = {}


@pytest.fixture(scope="module", autouse=True)
def _cleared_at_the_end(local: Local) -> Iterator[None]:
    """Whatever a story left: no workload of ours, neither plugin, no plugin namespace, no annotations, no label."""
    yield
    for name in ("theirs", "ours", "back"):
        local.kubectl("delete", "pod", "-n", NS, name, "--grace-period=1", "--ignore-not-found", "--wait=true",
                      timeout=120)
    if json.loads(local.helm("list", "-n", PLUGIN_NS, "-o", "json").stdout):
        local.helm("uninstall", RELEASE, "-n", PLUGIN_NS, "--wait", "--timeout=2m", timeout=180)
    local.kubectl("delete", "namespace", THEIRS_NS, "--ignore-not-found", "--wait=true", timeout=180)
    until("the stand-in's socket gone", lambda: not (DEVICE_PLUGINS / "nvidia-gpu.sock").exists(), timeout=30)
    local.c.remove_reporting()
    local.kubectl("delete", "namespace", PLUGIN_NS, "--ignore-not-found", "--wait=true", timeout=180)
    for key in (OURS_LABEL, THEIRS_LABEL):
        _label(local, key, None)


def test_50_nvidias_plugin_serves_the_node_and_a_pod_runs_under_it(local: Local) -> None:
    if local.kubectl("get", "-n", PLUGIN_NS, "daemonset/gpu-health-device-plugin", "--ignore-not-found", "-o",
                     "name").strip():
        # Run alone: the conftest's kustomize install goes whole (Helm takes over no object it did not create).
        local.kubectl("delete", "-k", str(local.c.overlay()), "--wait=true", timeout=240)
        until("our plugin's pods gone", lambda: not local.plugin_pods(), timeout=120)
        local.wait_gpus(0)
        local.c.remove_reporting()
    # A clean node: no fault in the node file, no latch in the state dir, so ours finds the 8 GPUs NVIDIA's lists.
    for g in local.node_file.doc["gpus"]:
        g["signals"] = {}
    local.node_file.write()
    (local.c.layout.work / "plugin-state" / "state.json").unlink(missing_ok=True)

    # The GPU Operator's state: its label on the GPU node, its plugin there.
    _label(local, THEIRS_LABEL, "true")
    local.apply(*_standin(local))
    _theirs_registered(local)
    local.wait_gpus(8)
    local.wait_gpus(8, "capacity")
    uuids, device_nodes = _admitted(local, "theirs")
    assert len(uuids) == 1 and uuids[0] in local.node_file.uuids and device_nodes == 0, (uuids, device_nodes)
    PODS["theirs"] = _state(local, "theirs")
    assert PODS["theirs"][2:] == (0, "running")


def test_51_ours_joins_then_nvidias_leaves_and_allocatable_never_drops(local: Local) -> None:
    kubelet = KubeletAllocatable(local)
    watch = NodeWatch(local, ALLOCATABLE)
    try:
        # docs/migrate.md, "The switch", step 1: ours on the node, next to NVIDIA's.
        local.kubectl("apply", "-f", str(REPO / "manifests" / "base" / "namespace.yaml"))
        local.helm("install", RELEASE, CHART, "-n", PLUGIN_NS, *HELM_VALUES, "--wait", "--timeout=3m", timeout=240)
        assert local.plugin_pods() == []  # the canary values: nowhere until a node is labelled
        _label(local, OURS_LABEL, "true")
        local.kubectl("-n", PLUGIN_NS, "rollout", "status", "daemonset/gpu-health-device-plugin", "--timeout=180s",
                      timeout=200)
        [ours] = local.plugin_pods()
        assert all(c["ready"] for c in ours["status"]["containerStatuses"])  # ready = registered
        # Step 2: NVIDIA's off the node; its pod goes and takes its socket with it.
        _label(local, THEIRS_LABEL, "false")
        until("NVIDIA's plugin pod gone", lambda: not _theirs(local), timeout=60)
        until("NVIDIA's socket gone", lambda: not (DEVICE_PLUGINS / "nvidia-gpu.sock").exists(), timeout=30)
        # The checks: allocatable as before, the running pod untouched, a new pod admitted (by ours: device nodes).
        local.wait_gpus(8)
        assert _state(local, "theirs") == PODS["theirs"]
        uuids, device_nodes = _admitted(local, "ours")
        assert len(uuids) == 1 and uuids[0] in local.node_file.uuids and device_nodes > 0, local.logs("ours")
        PODS["ours"] = _state(local, "ours")
        table = local.kubectl("gpu-health", "--node", local.node)
        for u in local.node_file.uuids:
            row = next(ln for ln in table.splitlines() if u in ln)
            assert "Healthy" in row.split(), row
        assert _state(local, "theirs") == PODS["theirs"]
    finally:
        seen = watch.stop()
        kubelet.stop()
    _never_below_8(kubelet, seen)


def test_52_nvidias_returns_then_ours_leaves_and_allocatable_never_drops(local: Local) -> None:
    kubelet = KubeletAllocatable(local)
    watch = NodeWatch(local, ALLOCATABLE)
    try:
        # docs/migrate.md, "Rollback", step 1: NVIDIA's back, next to ours.
        _label(local, THEIRS_LABEL, "true")
        _theirs_registered(local)
        # Step 2: ours off the node; the DaemonSet stops its pod, which removes its socket.
        _label(local, OURS_LABEL, None)
        until("our plugin's pod gone", lambda: not local.plugin_pods(), timeout=60)
        local.wait_gpus(8)
        for name in ("theirs", "ours"):
            assert _state(local, name) == PODS[name], name
        uuids, device_nodes = _admitted(local, "back")
        # Admitted by NVIDIA's again.
        assert len(uuids) == 1 and uuids[0] in local.node_file.uuids and device_nodes == 0, (uuids, device_nodes)
        for name in ("theirs", "ours"):
            assert _state(local, name) == PODS[name], name
    finally:
        seen = watch.stop()
        kubelet.stop()
    _never_below_8(kubelet, seen)
