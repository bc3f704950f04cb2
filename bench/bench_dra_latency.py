#!/usr/bin/env python3
"""DRA driver mode (docs/dra.md): how long a fatal GPU fault takes to reach the two places DRA shows it, on the real
local cluster (scripts/local-cluster) with the plugin deployed as the DaemonSet in ``--mode dra``. Needs root.

One pod holds a ResourceClaim for all 8 GPUs. Then, --faults times, XID 48 (reset-gpu) is written into one GPU's
signals in the simulated node file (rotating the GPUs), and two background `kubectl get --watch -o json` streams
(timestamped on arrival) give

    (a) t0 -> the device in the node's ResourceSlice carries the taint gpu-health.io/unhealthy (NoSchedule)
    (b) t0 -> the pod's allocatedResourcesStatus shows the device Unhealthy with our reason as the message

t0 is taken just before the atomic rewrite of the node file. Each fault is cleared with a GPU reset as NVML shows
one; recovery is timed from the last write to the taint gone and the device Healthy in pod status again.

    python bench/bench_dra_latency.py              # up, deploy DRA mode, 10 faults, down
    python bench/bench_dra_latency.py --faults 4

tests/e2e/test_stories_dra.py runs the same measurement (``run``) on the cluster the stories share.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import machine, summary_ms  # noqa: E402
from bench.bench_local_cluster import NodeFile, Watch, down_checked, recovery_asked  # noqa: E402
from scripts.localcluster import cli  # noqa: E402
from scripts.localcluster import cluster as lc  # noqa: E402

DRIVER = "gpu.gpu-health.io"
OVERLAY = "local-cluster-dra"
POD = "dra-all-gpus"
WAIT_S = 120.0

Obj = dict[str, Any]


class Cluster(Protocol):
    """What the measurement needs of the cluster: scripts/localcluster's Cluster is one."""

    @property
    def layout(self) -> lc.Layout: ...

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> Any: ...


def taint_of(s: Obj, index: int) -> Obj | None:
    for d in s.get("spec", {}).get("devices", []) or []:
        if d.get("name") == f"gpu-{index}":
            taints = d.get("taints") or []
            return taints[0] if taints else None
    return None


def tainted(index: int, key: str) -> Callable[[Obj], bool]:
    return lambda s: (taint_of(s, index) or {}).get("key") == key


def untainted(index: int) -> Callable[[Obj], bool]:
    return lambda s: any(d.get("name") == f"gpu-{index}" for d in s.get("spec", {}).get("devices", []) or []) \
        and taint_of(s, index) is None


def pod_device(pod: Obj, index: int) -> tuple[str, str] | None:
    """(health, message) of GPU ``index`` in the pod's allocatedResourcesStatus: the kubelet names a DRA device by
    its first CDI ID, ours ending in ``-gpu-<index>``."""
    for cs in pod.get("status", {}).get("containerStatuses", []) or []:
        for res in cs.get("allocatedResourcesStatus", []) or []:
            for r in res.get("resources", []) or []:
                if str(r.get("resourceID", "")).endswith(f"-gpu-{index}"):
                    return str(r.get("health", "")), str(r.get("message", ""))
    return None


def shows(index: int, health: str, in_message: str = "") -> Callable[[Obj], bool]:
    def check(pod: Obj) -> bool:
        got = pod_device(pod, index)
        return got is not None and got[0] == health and in_message in got[1]
    return check


def run_faults(c: Cluster, info: Obj, faults: int, ns: str, gpus: list[int] | None = None) -> Obj:
    """Inject ``faults`` faults (on ``gpus`` in turn, default all 8) and time both outlets; the claim and pod are
    made in ``ns`` and removed at the end."""
    kubectl = [str(c.layout.bin / "kubectl"), f"--kubeconfig={c.layout.kubeconfig}"]
    nf = NodeFile(Path(info["node_file"]))
    order = gpus or list(range(8))
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": POD, "namespace": ns},
             "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                 "deviceClassName": DRIVER, "allocationMode": "All"}}]}}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD, "namespace": ns},
           "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                    "resourceClaims": [{"name": "gpus", "resourceClaimName": POD}],
                    "containers": [{"name": "work", "image": info["workload_image"], "imagePullPolicy": "Never",
                                    "command": ["sleep", "1000000"], "resources": {"claims": [{"name": "gpus"}]}}]}}
    lc.run([*kubectl, "apply", "-f", "-"], input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                             "items": [claim, pod]}))
    c.kubectl("wait", f"pod/{POD}", "-n", ns, "--for=condition=Ready", "--timeout=120s", timeout=130)
    slice_w = Watch([*kubectl, "get", "resourceslices", "--watch", "-o", "json",
                     f"--field-selector=spec.nodeName={lc.NODE_NAME},spec.driver={DRIVER}"])
    pod_w = Watch([*kubectl, "get", "pod", POD, "-n", ns, "--watch", "-o", "json"])
    node_w = Watch([*kubectl, "get", "node", lc.NODE_NAME, "--watch", "-o", "json"])
    rows: list[Obj] = []
    try:
        for i in order:
            slice_w.wait_for(untainted(i), 0.0, what=f"gpu-{i} untainted before the first fault")
        for k in range(faults):
            i = order[k % len(order)]
            t0 = nf.signals(i, xid_events=[48])
            ta = slice_w.wait_for(tainted(i, "gpu-health.io/unhealthy"), t0, WAIT_S, f"fault {k}: taint")
            tb = pod_w.wait_for(shows(i, "Unhealthy", "xid-48"), t0, WAIT_S, f"fault {k}: pod status")
            t_ask = nf.signals(i, recovery_action="gpu_reset")
            # The plugin must have seen the reset asked for before the latch may clear (the node annotation).
            node_w.wait_for(recovery_asked(i), t_ask, WAIT_S, f"fault {k}: recovery action seen")
            t_reset = nf.signals(i, recovery_action="none", xid_events=None)
            tr = slice_w.wait_for(untainted(i), t_reset, WAIT_S, f"fault {k}: taint removed")
            tp = pod_w.wait_for(shows(i, "Healthy"), t_reset, WAIT_S, f"fault {k}: pod status Healthy")
            rows.append({"gpu": i, "taint": ta - t0, "pod_status": tb - t0, "untaint": tr - t_reset,
                         "pod_healthy": tp - t_reset})
            print(f"fault {k} gpu {i}: taint {ta - t0:.2f}s pod status {tb - t0:.2f}s, recovery: untaint "
                  f"{tr - t_reset:.2f}s pod {tp - t_reset:.2f}s", file=sys.stderr, flush=True)
    finally:
        slice_w.stop()
        pod_w.stop()
        node_w.stop()
        c.kubectl("delete", "-n", ns, f"pod/{POD}", f"resourceclaim/{POD}", "--grace-period=1",
                  "--ignore-not-found", "--wait=true", check=False, timeout=120)

    def fig(key: str) -> dict[str, float]:
        s = summary_ms([r[key] for r in rows])
        return {"n": s["n"], "p50_ms": round(s["p50_ms"]), "max_ms": round(s["max_ms"])}

    return {"faults": len(rows), "fault_to_taint": fig("taint"), "fault_to_pod_status_message": fig("pod_status"),
            "reset_to_taint_removed": fig("untaint"), "reset_to_pod_status_healthy": fig("pod_healthy"),
            "per_fault_s": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=10, help="faults to inject")
    ap.add_argument("--timeout", type=float, default=240, help="seconds to wait for each component in up")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench: needs root (the local cluster does)", file=sys.stderr)
        return 2
    c = lc.Cluster()
    if c.status() is not None:
        print("bench: a local cluster is already up; `scripts/local-cluster down` it first", file=sys.stderr)
        return 2
    try:
        info = c.up(cli._images, cli._binaries, ready_timeout=args.timeout)
        c.kubectl("apply", "-k", str(c.overlay(OVERLAY)), timeout=120)
        c.kubectl("-n", "gpu-health-system", "rollout", "status", "daemonset/gpu-health-device-plugin",
                  "--timeout=180s", timeout=200)
        c.kubectl("create", "namespace", "bench")
        started = time.monotonic()
        result = run_faults(c, info, args.faults, "bench")
        result["seconds"] = round(time.monotonic() - started, 1)
    finally:
        clean = down_checked(c)
    print(json.dumps({"bench": "dra_latency", "machine": machine(), "command": "python bench/bench_dra_latency.py "
                      f"--faults {args.faults}", **result, "leftovers_after_down": not clean}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
