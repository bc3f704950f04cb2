"""The safety promises of the automated parts on the real local cluster: what they may never do, shown end to end
with the real API server's admission, the real kubelet and the plugin's own bound service-account token.

Runs after test_stories_dra.py on the same cluster (pytest takes the files in name order), which left no plugin
installed; each story here says what it needs and the last one leaves nothing behind.

- 30: a flood of slow, huge-header connections on the plugin's metrics port does not grow it past 16 MiB, kill it
  or keep a scrape from being answered (docs/reliability.md, the HTTP server's bounds).
- 31: the breaker's limit holds when a quarantined node stops looking like a GPU node (docs/fleet.md).
- 32: a node agent cannot forge the controller's record, and the controller never undoes an operator's cordon.
- 44: the agent's own token writes an annotation nested a thousand deep on its node: the controller reports that node
  once, goes on quarantining another failing node, and stays ready (issue 35; docs/fleet.md).
- 33: the plugin's token cannot write another node's ResourceSlice, nor another driver's (docs/dra.md).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Local, until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PLUGIN_NS = "gpu-health-system"
DRIVER = "gpu.gpu-health.io"
METRICS = ("127.0.0.1", 9402)  # the local cluster's plugin is on the host network (manifests/components/local-cluster)
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/token"
CONTROLLER_OVERLAY = "local-cluster-controller"
CONTROLLER_PREFIX = "controller.gpu-health.io"
TAINT = "gpu-health.io/quarantine"
FAKES = ("fake-gpu-a", "fake-gpu-b", "fake-gpu-c")


def _until(what: str, check: Callable[[], Any], timeout: float = 90) -> Any:
    return until(what, check, timeout)


def _clean_node(local: Local) -> None:
    """A node with no fault and no latched state: earlier stories latched faults in the shared state dir."""
    for g in local.node_file.doc["gpus"]:
        g["signals"] = {}
    local.node_file.write()
    (local.c.layout.work / "plugin-state" / "state.json").unlink(missing_ok=True)


def _deploy_plugin(local: Local, overlay: str = "local-cluster") -> dict[str, Any]:
    local.kubectl("apply", "-k", str(local.c.overlay(overlay)), timeout=120)
    local.kubectl("-n", PLUGIN_NS, "rollout", "status", "daemonset/gpu-health-device-plugin", "--timeout=180s",
                  timeout=200)
    [pod] = [p for p in local.plugin_pods() if not p["metadata"].get("deletionTimestamp")]
    return pod


def _plugin_token(local: Local, pod: dict[str, Any]) -> str:
    """The token the kubelet projected into the plugin's pod: bound to the pod, so it carries the pod's node."""
    return local.kubectl("exec", "-n", PLUGIN_NS, pod["metadata"]["name"], "--", "cat", TOKEN_PATH).strip()


def _as_plugin(local: Local, token: str, *args: str, stdin: str | None = None) -> tuple[bool, str]:
    """kubectl with the plugin's token instead of the admin's: (allowed, what the API server said)."""
    import subprocess

    p = subprocess.run(["kubectl", f"--token={token}", *args], input=stdin, capture_output=True, text=True,
                       env=local.env, timeout=60)
    return p.returncode == 0, (p.stdout + p.stderr).strip()


# 30: the metrics server under abuse ----------------------------------------------------------------------------

def _plugin_pid() -> int:
    """The plugin's process as the host sees it (containerd runs it in a pid namespace the host can read)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"gpu-health-plugin") for a in argv[:2]) and any(b"--simulated-node" in a for a in argv):
            return int(proc.name)
    raise AssertionError("the plugin's process was not found")


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def _scrape() -> tuple[float, bytes]:
    started = time.monotonic()
    with urllib.request.urlopen(f"http://{METRICS[0]}:{METRICS[1]}/metrics", timeout=5) as resp:
        body = resp.read()
    return time.monotonic() - started, body


@contextmanager
def _flood(connections: int, seconds: float) -> Iterator[dict[str, int]]:
    """Connections that each start a request and then dribble 60 KiB header lines for at most ``seconds``: the
    shape that made the old server hold a thread and megabytes per connection. Loopback only, bounded in count,
    bytes and time."""
    stop = threading.Event()
    sent = {"bytes": 0, "refused": 0}
    lock = threading.Lock()
    line = b"X-Pad: " + b"a" * 60 * 1024 + b"\r\n"

    def one() -> None:
        try:
            s = socket.create_connection(METRICS, timeout=2)
        except OSError:
            with lock:
                sent["refused"] += 1
            return
        try:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            deadline = time.monotonic() + seconds
            for _ in range(64):  # at most 4 MiB a connection
                if stop.is_set() or time.monotonic() > deadline:
                    break
                s.sendall(line)
                with lock:
                    sent["bytes"] += len(line)
                stop.wait(0.05)
        except OSError:
            pass  # the server cut us off: what it should do
        finally:
            s.close()

    threads = [threading.Thread(target=one, daemon=True) for _ in range(connections)]
    for t in threads:
        t.start()
    try:
        yield sent
    finally:
        stop.set()
        for t in threads:
            t.join(10)


def test_30_a_flood_on_the_metrics_port_neither_grows_nor_kills_the_plugin(local: Local) -> None:
    _clean_node(local)
    pod = _deploy_plugin(local)
    local.wait_gpus(8)
    pid = _plugin_pid()
    _scrape()
    before = _rss_kib(pid)
    peak = before
    latencies: list[float] = []
    with _flood(connections=200, seconds=10) as sent:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            peak = max(peak, _rss_kib(pid))
            took, body = _scrape()
            assert b"gpu_health_" in body
            latencies.append(took)
    peak = max(peak, _rss_kib(pid))
    latencies.sort()
    print(f"flood: {sent['bytes'] / 2**20:.1f} MiB sent, {sent['refused']} connections refused; RSS {before / 1024:.1f}"
          f" -> peak {peak / 1024:.1f} MiB; scrape median {latencies[len(latencies) // 2] * 1000:.0f} ms, max "
          f"{latencies[-1] * 1000:.0f} ms over {len(latencies)} scrapes")
    assert (peak - before) / 1024 <= 16, (before, peak)
    # The same process, never restarted.
    assert _plugin_pid() == pid
    after = local.get("pod", pod["metadata"]["name"], PLUGIN_NS)["status"]["containerStatuses"][0]
    assert after["restartCount"] == 0 and "running" in after["state"]


# 31: the breaker's limit, whatever a quarantined node looks like now ----------------------------------------------

def _fake_node(local: Local, name: str, gpus: int, allocatable: int) -> None:
    """A Node with no kubelet behind it: the API object alone, its GPU counts written as a kubelet would. Its taint
    keeps the scheduler from placing a pod where nothing would run it (the controller's own, for one)."""
    local.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"e2e": "fake"}},
                 "spec": {"taints": [{"key": "e2e.example.com/no-kubelet", "effect": "NoSchedule"}]}})
    if gpus:
        _set_gpus(local, name, gpus, allocatable)


def _set_gpus(local: Local, name: str, gpus: int, allocatable: int) -> None:
    if gpus:
        rest = {"cpu": "8", "memory": "32Gi", "pods": "110"}
        status = {"capacity": {"nvidia.com/gpu": str(gpus), **rest},
                  "allocatable": {"nvidia.com/gpu": str(allocatable), **rest}}
        local.kubectl("patch", "node", name, "--subresource=status", "--type=merge", "-p",
                      json.dumps({"status": status}))
    else:  # the device plugin went away and the kubelet dropped the resource
        local.kubectl("patch", "node", name, "--subresource=status", "--type=json", "-p", json.dumps([
            {"op": "remove", "path": "/status/capacity/nvidia.com~1gpu"},
            {"op": "remove", "path": "/status/allocatable/nvidia.com~1gpu"}]))


def _ours(local: Local, name: str) -> bool:
    return name in _quarantined(local)


def _quarantined(local: Local) -> set[str]:
    nodes: list[dict[str, Any]] = json.loads(local.kubectl("get", "nodes", "-o", "json"))["items"]
    return {str(n["metadata"]["name"]) for n in nodes
            if n["metadata"].get("annotations", {}).get(f"{CONTROLLER_PREFIX}/quarantined-by")
            == "gpu-health-controller"}


def _event(local: Local, name: str, reason: str) -> bool:
    return any(e["reason"] == reason for e in local.events("default", "Node", name))


def test_31_a_quarantined_node_that_loses_its_gpus_still_counts_against_the_limit(local: Local) -> None:
    local.kubectl("apply", "-k", str(local.c.overlay(CONTROLLER_OVERLAY)))
    local.kubectl("-n", PLUGIN_NS, "rollout", "status", "deployment/gpu-health-controller", "--timeout=180s",
                  timeout=200)
    # Four GPU nodes (the real one and three API objects): the default 10 % allows one quarantine.
    for name in FAKES:
        _fake_node(local, name, 8, 8)
    a, b, c = FAKES
    _set_gpus(local, a, 8, 6)  # two GPUs reported unhealthy: the capacity-gap rule
    _until(f"{a} quarantined", lambda: _ours(local, a))
    # Its device plugin goes away: the kubelet drops the resource. It is still ours, so it still counts.
    _set_gpus(local, a, 0, 0)
    _set_gpus(local, b, 8, 6)
    _until(f"{b} refused by the breaker", lambda: _event(local, b, "GPUQuarantineBlocked"))
    assert _quarantined(local) == {a}
    # a comes back whole; once released after the hold, b's turn comes.
    _set_gpus(local, a, 8, 8)
    _until(f"{a} released", lambda: not _ours(local, a))
    assert not [t for t in local.get("node", a)["spec"].get("taints") or [] if t["key"] == TAINT]
    _until(f"{b} quarantined once there is room", lambda: _ours(local, b))
    assert _quarantined(local) == {b}
    _set_gpus(local, b, 8, 8)
    _until(f"{b} released", lambda: not _ours(local, b))
    for name in FAKES:
        local.kubectl("delete", "node", name, "--wait=true")
    _ = c


# 32: a node agent cannot forge the controller's record; an operator's cordon stays -------------------------------

def test_32_the_agent_cannot_forge_the_controllers_record_and_the_operators_cordon_stays(local: Local) -> None:
    [pod] = [p for p in local.plugin_pods() if not p["metadata"].get("deletionTimestamp")]
    token = _plugin_token(local, pod)
    node = local.node
    # The plugin's own account writes its state, on its own node...
    ok, said = _as_plugin(local, token, "annotate", "node", node, "--overwrite", "gpu-health.io/e2e-probe=1")
    assert ok, said
    # ... but never the controller's record, our taint, the cordon or a label.
    for args in (["annotate", "node", node, "--overwrite", f"{CONTROLLER_PREFIX}/quarantined-by=gpu-health-controller"],
                 ["annotate", "node", node, "--overwrite", f"{CONTROLLER_PREFIX}/quarantine-owns=cordon"],
                 ["taint", "node", node, f"{TAINT}=forged:NoSchedule"],
                 ["cordon", node],
                 ["label", "node", node, "gpu-health.io/forged=1"]):
        _, said = _as_plugin(local, token, *args)  # kubectl cordon says the error but exits 0: judge by the text
        assert "denied request" in said, (args, said)
    meta, spec = local.node_json()["metadata"], local.node_json()["spec"]
    assert not [k for k in meta.get("annotations", {}) if k.startswith(f"{CONTROLLER_PREFIX}/")]
    assert "gpu-health.io/forged" not in meta.get("labels", {})
    assert not spec.get("unschedulable") and not [t for t in spec.get("taints") or [] if t["key"] == TAINT]
    local.kubectl("annotate", "node", node, "gpu-health.io/e2e-probe-")
    # An operator cordons the node. A compromised agent then writes what the old controller trusted: the
    # record under the agent's prefix and healthy devices since long ago. The policy lets it (its own prefix).
    local.kubectl("cordon", node)
    forged = {"gpu-health.io/quarantined-by": "gpu-health-controller", "gpu-health.io/quarantine-owns": "cordon",
              "gpu-health.io/quarantine-reason": "reboot-required", "gpu-health.io/quarantined-at":
              "2020-01-01T00:00:00Z"}
    ok, said = _as_plugin(local, token, "annotate", "node", node, "--overwrite",
                          *[f"{k}={v}" for k, v in forged.items()])
    assert ok, said
    # A real fault: the controller quarantines the node (the cordon is the operator's, not ours) ...
    latched = 2
    local.signals(latched, xid_events=[48])  # fatal, and a reset mends it
    _until("the controller's quarantine", lambda: _ours(local, node))
    owns = local.node_json()["metadata"]["annotations"][f"{CONTROLLER_PREFIX}/quarantine-owns"]
    assert "cordon" not in owns.split(","), owns
    # ... and releases it once healthy past the hold: its taint goes, the operator's cordon stays.
    local.reset_gpu(latched)
    local.wait_gpus(8)
    _until("the controller's release", lambda: not _ours(local, node))
    spec = local.node_json()["spec"]
    assert spec.get("unschedulable") is True
    assert not [t for t in spec.get("taints") or [] if t["key"] == TAINT]
    local.kubectl("uncordon", node)
    local.kubectl("annotate", "node", node, *[f"{k}-" for k in forged])
    local.kubectl("delete", "-k", str(local.c.overlay(CONTROLLER_OVERLAY)), "--wait=true", timeout=200)
    local.kubectl("delete", "-k", str(local.c.overlay("local-cluster")), "--wait=true", timeout=200)


# 44: one node's unreadable annotations neither stop the controller nor hide the other nodes ----------------------

def _controller_pod(local: Local) -> dict[str, Any]:
    pods = json.loads(local.kubectl("get", "pods", "-n", PLUGIN_NS, "-l",
                                    "app.kubernetes.io/name=gpu-health-controller", "-o", "json"))["items"]
    [pod] = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return dict(pod)


def _ready_since(pod: dict[str, Any]) -> str | None:
    """When the pod last became Ready (its readiness probe is the controller's /readyz); None while it is not."""
    ready = next((c for c in pod["status"].get("conditions") or [] if c["type"] == "Ready"), None)
    return str(ready["lastTransitionTime"]) if ready and ready["status"] == "True" else None


def test_44_an_agent_writing_an_unreadable_annotation_blinds_the_controller_to_its_node_only(local: Local) -> None:
    _clean_node(local)
    pod = _deploy_plugin(local)
    token = _plugin_token(local, pod)
    local.kubectl("apply", "-k", str(local.c.overlay(CONTROLLER_OVERLAY)))
    local.kubectl("-n", PLUGIN_NS, "rollout", "status", "deployment/gpu-health-controller", "--timeout=180s",
                  timeout=200)
    ready_at = _until("the controller ready", lambda: _ready_since(_controller_pod(local)))
    node, key = local.node, "gpu-health.io/gpu.0"
    _until("the agent's annotations", lambda: key in local.node_json()["metadata"].get("annotations", {}))
    kept = local.node_json()["metadata"]["annotations"][key]
    # A compromised agent, with its own bound token: its admission policy admits any value under its prefix.
    ok, said = _as_plugin(local, token, "annotate", "node", node, "--overwrite", f"{key}={'[' * 1000}{']' * 1000}")
    assert ok, said
    try:
        _until("the bad node reported", lambda: _event(local, node, "GPUAnnotationsUnreadable"))
        # The bad node changes again (decided again, not reported again); then another node fails.
        local.kubectl("label", "node", node, "--overwrite", "e2e.example.com/poke=1")
        a = FAKES[0]
        _fake_node(local, a, 8, 8)
        _set_gpus(local, a, 8, 6)
        _until(f"{a} quarantined while {node} cannot be read", lambda: _ours(local, a))
        reported = [e for e in local.events("default", "Node", node) if e["reason"] == "GPUAnnotationsUnreadable"]
        assert len(reported) == 1 and reported[0].get("count", 1) == 1, reported
        assert "cannot be read" in reported[0]["message"]
        assert not _ours(local, node)
        ctl = _controller_pod(local)
        assert _ready_since(ctl) == ready_at, ctl["status"].get("conditions")  # ready throughout, never flipped
        assert all(c["restartCount"] == 0 for c in ctl["status"]["containerStatuses"])
    finally:
        local.kubectl("annotate", "node", node, "--overwrite", f"{key}={kept}")
        local.kubectl("label", "node", node, "e2e.example.com/poke-")
        local.kubectl("delete", "node", FAKES[0], "--wait=true", "--ignore-not-found")
        local.kubectl("delete", "-k", str(local.c.overlay(CONTROLLER_OVERLAY)), "--wait=true", timeout=200)
        local.kubectl("delete", "-k", str(local.c.overlay("local-cluster")), "--wait=true", timeout=200)


# 33: no plugin pod writes another node's ResourceSlices -------------------------------------------------------------

def _slice_doc(name: str, node: str, driver: str = DRIVER) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
            "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1,
                                                                  "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0"}]}}


def test_33_the_plugins_token_writes_only_its_own_nodes_slices_of_its_own_driver(local: Local) -> None:
    _clean_node(local)
    pod = _deploy_plugin(local, "local-cluster-dra")
    token = _plugin_token(local, pod)
    _until("the node's ResourceSlice", lambda: json.loads(local.kubectl(
        "get", "resourceslices", "-o", "json", f"--field-selector=spec.nodeName={local.node}"))["items"])
    # Another node's slice (a phantom GPU the scheduler would place pods on), and another driver's on ours.
    _fake_node(local, "fake-gpu-a", 0, 0)
    for doc, needle in ((_slice_doc("e2e-phantom", "fake-gpu-a"), "fake-gpu-a"),
                        (_slice_doc("e2e-other-driver", local.node, "other.example.com"), "other.example.com")):
        ok, said = _as_plugin(local, token, "create", "-f", "-", stdin=json.dumps(doc))
        assert not ok and needle in said, said
    # A slice the admin made for another node stays: the plugin may not delete it.
    local.kubectl("create", "-f", "-", stdin=json.dumps(_slice_doc("e2e-admins", "fake-gpu-a")))
    ok, said = _as_plugin(local, token, "delete", "resourceslice", "e2e-admins")
    assert not ok and "fake-gpu-a" in said, said
    assert local.get("resourceslice", "e2e-admins")["spec"]["nodeName"] == "fake-gpu-a"
    # Its own slice, its own driver: the plugin published it with this token; a replace by the same token passes.
    own = json.loads(local.kubectl("get", "resourceslices", "-o", "json",
                                   f"--field-selector=spec.nodeName={local.node},spec.driver={DRIVER}"))["items"][0]
    own["metadata"].setdefault("annotations", {})["e2e.example.com/touched"] = "1"
    ok, said = _as_plugin(local, token, "replace", "-f", "-", stdin=json.dumps(own))
    assert ok, said
    local.kubectl("delete", "resourceslice", "e2e-admins")
    local.kubectl("delete", "node", "fake-gpu-a")
    local.kubectl("delete", "-k", str(local.c.overlay("local-cluster-dra")), "--wait=true", timeout=200)
    _until("the kubelet to wipe the ResourceSlice", lambda: not json.loads(local.kubectl(
        "get", "resourceslices", "-o", "json", f"--field-selector=spec.nodeName={local.node}"))["items"], 120)
