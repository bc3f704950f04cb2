"""The local cluster (scripts/local-cluster) for the user stories: started once per session with the plugin deployed
from its own image the way users deploy it, and taken down at the end with a check that nothing is left.

Needs root, Go, buildah, mmdebstrap and the CNI plugins (see docs/local-cluster.md). Where one is missing the
tests are skipped with the reason, except with CI=true, where that is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.localcluster import cli
from scripts.localcluster import cluster as lc
from tests.conftest import NodeFile

REPO = Path(__file__).resolve().parent.parent.parent
NS = "e2e"
RES = "nvidia.com/gpu"
DRA_DRIVER = "gpu.gpu-health.io"


def _unavailable(message: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message}\n(CI=true: a missing prerequisite of the local cluster is a failure)", pytrace=False)
    pytest.skip(message)


class Local:
    """The running cluster, as the tests drive it: kubectl, the node file, and the kubelet process."""

    def __init__(self, c: lc.Cluster, info: dict[str, Any]) -> None:
        self.c = c
        self.info = info
        self.node = info["node_name"]
        path = Path(info["node_file"])
        self.node_file = NodeFile.__new__(NodeFile)
        self.node_file.path = path
        self.node_file.doc = json.loads(path.read_text())
        self.env = {**os.environ, "KUBECONFIG": info["kubeconfig"],
                    "PATH": f"{REPO / '.venv' / 'bin'}:{c.layout.bin}:{os.environ.get('PATH', '')}"}

    # kubectl ---------------------------------------------------------------------------------------------------

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120) -> str:
        p = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True, env=self.env,
                           timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {p.stderr.strip()}")
        return p.stdout

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """helm (built from its Go module, scripts/helm.py) against the cluster, its own state under the work dir."""
        from scripts import helm as helm_build

        home = self.c.layout.work / "helm"
        env = {**self.env, "HELM_CONFIG_HOME": str(home / "config"), "HELM_CACHE_HOME": str(home / "cache"),
               "HELM_DATA_HOME": str(home / "data")}
        p = subprocess.run([str(helm_build.build()), *args], capture_output=True, text=True, env=env,
                           timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed: {p.stderr.strip()}")
        return p

    def apply(self, *objs: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}))

    def get(self, kind: str, name: str, ns: str | None = None) -> dict[str, Any]:
        args = ["get", kind, name, "-o", "json"] + (["-n", ns] if ns else [])
        doc: dict[str, Any] = json.loads(self.kubectl(*args))
        return doc

    def wait(self, target: str, condition: str, timeout: float = 120, ns: str | None = None) -> None:
        """kubectl wait: a watch on the object, not a poll of ours."""
        self.kubectl("wait", target, f"--for={condition}", f"--timeout={int(timeout)}s",
                     *(["-n", ns] if ns else []), timeout=timeout + 15)

    def node_json(self) -> dict[str, Any]:
        return self.get("node", self.node)

    def gpus(self, field: str = "allocatable") -> int:
        return int(self.node_json()["status"].get(field, {}).get(RES, "0"))

    def wait_gpus(self, value: int, field: str = "allocatable", timeout: float = 90) -> None:
        self.wait(f"node/{self.node}", f"jsonpath={{.status.{field}.nvidia\\.com/gpu}}={value}", timeout)

    def annotation(self, index: int) -> dict[str, Any] | None:
        raw = self.node_json()["metadata"].get("annotations", {}).get(f"gpu-health.io/gpu.{index}")
        return json.loads(raw) if raw else None

    def events(self, ns: str, kind: str, name: str) -> list[dict[str, Any]]:
        out = self.kubectl("get", "events", "-n", ns, "-o", "json",
                           f"--field-selector=involvedObject.kind={kind},involvedObject.name={name}")
        items: list[dict[str, Any]] = json.loads(out)["items"]
        return items

    def logs(self, pod: str, ns: str = NS) -> str:
        return self.kubectl("logs", "-n", ns, pod)

    def plugin_pods(self) -> list[dict[str, Any]]:
        out = self.kubectl("get", "pods", "-n", "gpu-health-system", "-o", "json",
                           "-l", "app.kubernetes.io/name=gpu-health-device-plugin")
        items: list[dict[str, Any]] = json.loads(out)["items"]
        return items

    # Workloads -------------------------------------------------------------------------------------------------

    def gpu_pod(self, name: str, gpus: int, command: str = "echo NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES; "
                "ls /dev | grep nvidia; sleep 100000", restart: str = "Never") -> dict[str, Any]:
        return {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
            "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": 1,
                     "containers": [self.container(gpus, command)]},
        }

    def container(self, gpus: int, command: str) -> dict[str, Any]:
        return {"name": "work", "image": self.info["workload_image"], "imagePullPolicy": "Never",
                "command": ["sh", "-c", command], "resources": {"limits": {RES: str(gpus)}}}

    def visible_devices(self, pod: str, ns: str = NS) -> list[str]:
        self.wait(f"pod/{pod}", "condition=Ready", 120, ns)
        deadline = time.monotonic() + 30
        while True:  # the first line can trail Ready by a moment: kubectl logs has no watch for "a line exists"
            for line in self.logs(pod, ns).splitlines():
                if line.startswith("NVIDIA_VISIBLE_DEVICES="):
                    return line.split("=", 1)[1].split(",")
            assert time.monotonic() < deadline, f"{pod} never printed NVIDIA_VISIBLE_DEVICES"
            time.sleep(0.5)

    def unschedulable(self, pod: str, ns: str = NS, timeout: float = 60) -> str:
        """Wait for the scheduler's verdict on a pod that cannot fit; returns its message."""
        self.wait(f"pod/{pod}", "condition=PodScheduled=false", timeout, ns)
        conds = self.get("pod", pod, ns)["status"]["conditions"]
        return next(str(c.get("message", "")) for c in conds if c["type"] == "PodScheduled")

    def index_of(self, uuid: str) -> int:
        return next(g["index"] for g in self.node_file.doc["gpus"] if g["uuid"] == uuid)

    def signals(self, index: int, **signals: Any) -> None:
        """Rewrite the node file (atomically) as a fault injector would; None removes a signal."""
        sig = self.node_file.doc["gpus"][index].setdefault("signals", {})
        for k, v in signals.items():
            if v is None:
                sig.pop(k, None)
            else:
                sig[k] = v
        self.node_file.write()

    def clear_gpu(self, index: int, code: str, note: str) -> None:
        """The operator's way back for a fault a reset does not mend (xid-79 asks for a reboot): ``clear`` through
        ``kubectl exec`` in the node's plugin pod (docs/operations.md), then the XID history gone from the node file
        as after the repair."""
        [pod] = [p for p in self.plugin_pods() if not p["metadata"].get("deletionTimestamp")]
        self.kubectl("exec", "-n", pod["metadata"]["namespace"], pod["metadata"]["name"], "--",
                     "gpu-health-plugin", "clear", str(index), "--reason", code, "--note", note)
        self.signals(index, xid_events=None)

    def reset_gpu(self, index: int) -> None:
        """What a GPU reset looks like to NVML: the recovery action asks for one, then goes back to none."""
        self.signals(index, recovery_action="gpu_reset")
        self.wait_annotation(index, lambda a: any(r["code"].startswith("recovery-action") for r in a["reasons"]))
        self.signals(index, recovery_action="none", xid_events=None)

    def wait_annotation(self, index: int, predicate: Callable[[dict[str, Any]], bool], timeout: float = 60) -> \
            dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            a = self.annotation(index)
            if a is not None and predicate(a):
                return a
            assert time.monotonic() < deadline, f"annotation gpu.{index} never matched: {a}"
            time.sleep(0.5)

    def allocated_health(self, pod: str, ns: str = NS) -> dict[str, str]:
        """Device ID -> health from the pod's status.containerStatuses[].allocatedResourcesStatus (KEP-4680)."""
        out: dict[str, str] = {}
        for cs in self.get("pod", pod, ns)["status"].get("containerStatuses", []):
            for res in cs.get("allocatedResourcesStatus", []) or []:
                for r in res.get("resources", []) or []:
                    out[r["resourceID"]] = r.get("health", "")
        return out

    def resource_slice(self) -> dict[str, Any] | None:
        """The node's ResourceSlice of our DRA driver, None while there is none (one at most: 8 GPUs fit one)."""
        out = json.loads(self.kubectl("get", "resourceslices", "-o", "json",
                                      f"--field-selector=spec.nodeName={self.node},spec.driver={DRA_DRIVER}"))
        items: list[dict[str, Any]] = out["items"]
        assert len(items) <= 1, [i["metadata"]["name"] for i in items]
        return items[0] if items else None

    def reboot(self) -> dict[str, Any]:
        """The node "reboots" (scripts/local-cluster reboot, docs/local-cluster.md "Rebooting the node"): the kubelet,
        the containers and containerd stopped, a new boot id, what a reboot clears taken out of the node file, then
        containerd and the kubelet started again. The node file is read back, since the reboot rewrote it."""
        info = self.c.reboot()
        self.node_file.doc = json.loads(self.node_file.path.read_text())
        return info

    def restart_kubelet(self) -> None:
        """Stop the kubelet process and start it again with the same command line."""
        lay = self.c.layout
        pid = lc.component_pid(lay, "kubelet")
        assert pid is not None, "the kubelet is not running"
        argv = lc.cmdline(pid)
        lc.stop_pid(pid)
        lc.spawn(lay, "kubelet", argv)


def until(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    """Polls a condition the API offers no watch for in kubectl's terms (a field inside a list, an Event)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: never happened"
        time.sleep(0.3)


class NodeWatch:
    """Every value of one field of the Node, as a `kubectl get --watch` sees them, recorded in the background."""

    def __init__(self, local: Local, jsonpath: str) -> None:
        self.values: list[str] = []
        self._proc = subprocess.Popen(
            ["kubectl", "get", "node", local.node, "--watch", "--output-watch-events=false", "-o",
             f"jsonpath={jsonpath}{{\"\\n\"}}"], stdout=subprocess.PIPE, text=True, env=local.env)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self.values.append(line.strip())

    def stop(self) -> list[str]:
        self._proc.terminate()
        self._proc.wait(10)
        self._thread.join(10)
        return self.values


# Seconds each step of bringing the cluster up took, for the summary at the end of the run.
TIMES: dict[str, float] = {}


def _timed(name: str, step: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        started = time.monotonic()
        try:
            return step()
        finally:
            TIMES[name] = time.monotonic() - started
    return run


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if TIMES:
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in TIMES.items())
        terminalreporter.write_line(f"local cluster: {parts}")


def _reuse(c: lc.Cluster) -> Local | None:
    """GPU_HEALTH_E2E_REUSE=1: the cluster already up (scripts/local-cluster up, or a run with GPU_HEALTH_E2E_KEEP=1),
    kept up after the run, for working on one story at a time. The plugin image is brought up to date with the
    working tree (built again only when its sources changed) and imported, so new pods run the current code. Each
    story file says what it needs; a file run this way may find what an earlier run left."""
    if os.environ.get("GPU_HEALTH_E2E_REUSE") != "1":
        return None
    status = c.status()
    if status is None or not status["running"]:
        return None
    from scripts.localcluster import images

    c.import_image(images.build_plugin(log=lc.log).archive)
    loc = Local(c, status)
    loc.kubectl("create", "namespace", NS, check=False)
    return loc


@pytest.fixture(scope="session")
def local() -> Iterator[Local]:
    if os.geteuid() != 0:
        _unavailable("the local cluster needs root")
    c = lc.Cluster()
    reused = _reuse(c)
    if reused is not None:
        yield reused
        return
    try:
        c.down()
        started = time.monotonic()
        info = c.up(_timed("images", cli._images), _timed("binaries", cli._binaries), ready_timeout=240,
                    nvml_standin=_timed("nvml stand-in", lc.build_nvml_standin))
        TIMES["up"] = time.monotonic() - started
        _timed("deploy", c.deploy)()
    except lc.ClusterError as exc:
        logs = c.layout.logs
        c.down()
        _unavailable(f"the local cluster did not come up: {exc} (logs were in {logs})")
        raise
    loc = Local(c, info)
    loc.kubectl("create", "namespace", NS)
    try:
        yield loc
    finally:
        # GPU_HEALTH_E2E_KEEP=1 leaves the cluster up for a look after a failure.
        if os.environ.get("GPU_HEALTH_E2E_KEEP") != "1":
            c.down()
            left = lc.leftovers(c.layout)
            assert left.empty(), f"down left things behind: {left}"
