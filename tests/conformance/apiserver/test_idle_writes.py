"""An idle node never writes its Node; a fault is one write. The real plugin process, polling every 0.3 s, against
the real kube-apiserver; writes are counted from the server's audit log (and the Node's resourceVersion), never
from the plugin's own counters.

The 60 s of quiet are the point of the test: it waits for the absence of writes, so it has to let the time pass.
Each quiet window also proves the plugin was at work in it (its poll count, from its own /metrics, moved on): a
plugin that had stopped polling would write nothing too.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plugin.devtools.standin import KubeletStandin
from plugin.schema.annotations import parse_node
from tests.conformance.apiserver.scrape import free_port, sample, scrape
from tests.conftest import NodeFile

pytestmark = [pytest.mark.conformance, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[3]
IDLE_S = float(os.environ.get("GPU_HEALTH_IDLE_SECONDS", "60"))


def wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)  # the API server is another process: nothing in-process to wait on


def test_idle_node_writes_nothing_for_a_minute_and_a_fault_is_one_write(apiserver: Any, short_socket_dir: Path,
                                                                        dev_root: Path) -> None:
    name = f"idle-{secrets.token_hex(3)}"
    apiserver.create_node(name)
    kubeconfig = apiserver.kubeconfig  # the admin's: RBAC is not what this test is about (test_annotations.py)
    node = NodeFile(short_socket_dir / "node.json")
    kubelet = KubeletStandin(short_socket_dir / "dp")
    kubelet.start()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "plugin", "run", "--backend", "simulated", "--simulated-node", str(node.path),
         "--device-plugin-dir", str(short_socket_dir / "dp"), "--state-dir", str(short_socket_dir / "state"),
         "--dev-root", str(dev_root), "--poll-interval", "0.3", "--metrics-address", f"127.0.0.1:{port}",
         "--node-name", name, "--kubeconfig", str(kubeconfig), "--node-condition", "true",
         "--correlate-on", "none"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def get_node() -> dict[str, Any]:
        r = apiserver.request("GET", f"/api/v1/nodes/{name}")
        assert r.ok, r.body
        return dict(r.body)

    def device_states() -> dict[str, str]:
        return {e.id: e.state for e in parse_node(name, get_node()["metadata"].get("annotations") or {})}

    def polls() -> float:
        code, text = scrape(port, "/metrics")
        assert code == 200, text
        return sample(text, "gpu_health_poll_duration_seconds_count") or 0.0

    def condition() -> dict[str, Any] | None:
        conditions = get_node()["status"].get("conditions") or []
        return next((c for c in conditions if c["type"] == "GPUHealthy"), None)

    try:
        assert kubelet.wait_for(lambda: kubelet.capacity() == (8, 8), 60)
        wait(lambda: device_states() == dict.fromkeys(node.uuids, "Healthy") and condition() is not None, 60,
             "the first reconcile")
        start_writes = len(apiserver.node_writes(name))
        start_rv = get_node()["metadata"]["resourceVersion"]
        polls_before = polls()
        time.sleep(IDLE_S)
        assert polls() - polls_before >= IDLE_S / 0.3 / 4, "the plugin was not polling through the quiet minute"
        idle = apiserver.node_writes(name)[start_writes:]
        assert idle == [], f"an idle node wrote its Node {len(idle)} times in {IDLE_S:g} s: {idle}"
        assert get_node()["metadata"]["resourceVersion"] == start_rv
        assert proc.poll() is None

        node.set(3, xid_events=[79])
        wait(lambda: device_states().get(node.uuids[3]) == "Unhealthy", 60, "the fault on the annotations")
        wait(lambda: (condition() or {}).get("status") == "False", 60, "the fault on the condition")
        settled_rv = get_node()["metadata"]["resourceVersion"]
        # The reporter's debounce and token bucket are each well under this: a second write would show.
        polls_before = polls()
        time.sleep(15)
        assert polls() - polls_before >= 10, "the plugin was not polling after the fault"
        after = apiserver.node_writes(name)[start_writes:]
        by_kind = {"annotations": [w for w in after if w["subresource"] == ""],
                   "condition": [w for w in after if w["subresource"] == "status"]}
        assert [len(by_kind["annotations"]), len(by_kind["condition"])] == [1, 1], after
        assert all(w["verb"] == "patch" and w["code"] == 200 for w in after), after
        assert get_node()["metadata"]["resourceVersion"] == settled_rv
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        kubelet.stop()
    assert proc.returncode == 0, out
