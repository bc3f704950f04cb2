#!/usr/bin/env python3
"""How long a fatal GPU fault takes to show in the three places a user looks, on the real local cluster
(scripts/local-cluster, docs/local-cluster.md): the Node's allocatable count, the pod's
status.containerStatuses[].allocatedResourcesStatus, and the plugin's node annotation. Needs root.

The cluster is brought up and the plugin deployed as the DaemonSet from its own image; one pod holds all 8 GPUs.
Then, --faults times, XID 48 (reset-gpu) is written into one GPU's signals in the simulated node file (rotating the
GPUs), and three background `kubectl get --watch -o json` streams (timestamped on arrival) give

    (a) t0 -> Node allocatable nvidia.com/gpu 8 -> 7     floor: the kubelet's node-status period
    (b) t0 -> the pod's allocatedResourcesStatus shows that device Unhealthy
    (c) t0 -> annotation gpu-health.io/gpu.<index> shows state Unhealthy

t0 is taken just before the atomic rewrite of the node file. Each fault is then cleared with a GPU reset as NVML
shows one (recovery action gpu_reset, then none, XIDs dropped); recovery is timed from that last write to
allocatable 8 again. The cluster is always taken down at the end, and the host checked for leftovers.

    python bench/bench_local_cluster.py                 # warm up, deploy, 20 faults
    python bench/bench_local_cluster.py --cold          # ... then a cold up (empty caches) as well
    python bench/bench_local_cluster.py --faults 0 --cold
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import machine, summary_ms  # noqa: E402
from scripts.localcluster import binaries, cli  # noqa: E402
from scripts.localcluster import cluster as lc  # noqa: E402

NS = "bench"
POD = "all-gpus"
RES = "nvidia.com/gpu"
WAIT_S = 120.0

Obj = dict[str, Any]


class Watch:
    """Every object a `kubectl get --watch -o json` prints, with the monotonic time its last byte arrived."""

    def __init__(self, argv: list[str]) -> None:
        self.events: list[tuple[float, Obj]] = []
        self._cond = threading.Condition()
        self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        decoder = codecs.getincrementaldecoder("utf-8")()
        json_decoder = json.JSONDecoder()
        buf = ""
        while True:
            chunk = os.read(fd, 1 << 16)
            arrived = time.monotonic()
            if not chunk:
                break
            buf += decoder.decode(chunk)
            # kubectl prints the documents back to back: take off every complete one, keep the partial rest.
            while True:
                buf = buf.lstrip()
                if not buf:
                    break
                try:
                    obj, end = json_decoder.raw_decode(buf)
                except ValueError:
                    break
                buf = buf[end:]
                with self._cond:
                    self.events.append((arrived, obj))
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[Obj], bool], since: float, timeout: float = WAIT_S,
                 what: str = "") -> float:
        """The arrival time of the first object that arrived at or after ``since`` and matches."""
        deadline = time.monotonic() + timeout
        i = 0
        with self._cond:
            while True:
                while i < len(self.events):
                    t, obj = self.events[i]
                    i += 1
                    if t >= since and predicate(obj):
                        return t
                left = deadline - time.monotonic()
                if left <= 0 or self._proc.poll() is not None:
                    last = self.events[-1][1] if self.events else None
                    raise lc.ClusterError(f"timed out waiting for {what}; watch alive: {self._proc.poll() is None};"
                                          f" last object: {json.dumps(last)[:300] if last else None}")
                self._cond.wait(min(left, 1.0))

    def latest(self) -> Obj | None:
        with self._cond:
            return self.events[-1][1] if self.events else None

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._thread.join(10)


def allocatable(node: Obj) -> int:
    return int(node.get("status", {}).get("allocatable", {}).get(RES, "0"))


def annotation(node: Obj, index: int) -> Obj | None:
    raw = node.get("metadata", {}).get("annotations", {}).get(f"gpu-health.io/gpu.{index}")
    return json.loads(raw) if raw else None


def pod_health(pod: Obj) -> dict[str, str]:
    out: dict[str, str] = {}
    for cs in pod.get("status", {}).get("containerStatuses", []) or []:
        for res in cs.get("allocatedResourcesStatus", []) or []:
            for r in res.get("resources", []) or []:
                out[r["resourceID"]] = r.get("health", "")
    return out


def state_is(index: int, state: str) -> Callable[[Obj], bool]:
    return lambda node: (annotation(node, index) or {}).get("state") == state


def recovery_asked(index: int) -> Callable[[Obj], bool]:
    return lambda node: any(str(r.get("code", "")).startswith("recovery-action")
                            for r in (annotation(node, index) or {}).get("reasons", []))


def device_is(uuid: str, health: str) -> Callable[[Obj], bool]:
    return lambda pod: pod_health(pod).get(uuid) == health


class NodeFile:
    """The simulated node file, rewritten atomically as a fault injector would."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.doc: Obj = json.loads(path.read_text())

    def uuid(self, index: int) -> str:
        return str(self.doc["gpus"][index]["uuid"])

    def signals(self, index: int, **signals: Any) -> float:
        """Apply the signals (None removes one); returns the monotonic time just before the rewrite."""
        sig = self.doc["gpus"][index].setdefault("signals", {})
        for k, v in signals.items():
            if v is None:
                sig.pop(k, None)
            else:
                sig[k] = v
        text = json.dumps(self.doc)
        tmp = self.path.with_name(f".{self.path.name}.bench.tmp")
        t0 = time.monotonic()
        tmp.write_text(text)
        os.replace(tmp, self.path)
        return t0


def kubelet_periods(c: lc.Cluster) -> dict[str, str]:
    """The kubelet's own node-status settings, from its configz (what it runs with, not what we assume)."""
    p = c.kubectl("get", "--raw", f"/api/v1/nodes/{lc.NODE_NAME}/proxy/configz", check=False)
    try:
        cfg = json.loads(p.stdout)["kubeletconfig"]
        return {"nodeStatusUpdateFrequency": str(cfg["nodeStatusUpdateFrequency"]),
                "nodeStatusReportFrequency": str(cfg.get("nodeStatusReportFrequency", "")),
                "source": "kubelet configz"}
    except (ValueError, KeyError):
        return {"nodeStatusUpdateFrequency": "10s", "source": "kubelet default (configz unreadable)"}


def plugin_poll_interval(c: lc.Cluster) -> str:
    p = c.kubectl("-n", "gpu-health-system", "get", "configmap", "-o", "json", check=False)
    try:
        for cm in json.loads(p.stdout)["items"]:
            for text in cm.get("data", {}).values():
                for line in text.splitlines():
                    if line.strip().startswith("pollInterval:"):
                        return f"{line.split(':', 1)[1].strip()}s"
    except (ValueError, KeyError):
        pass
    return "unknown"


def run_faults(c: lc.Cluster, info: Obj, faults: int) -> Obj:
    kubectl = [str(c.layout.bin / "kubectl"), f"--kubeconfig={c.layout.kubeconfig}"]
    nf = NodeFile(Path(info["node_file"]))
    c.kubectl("create", "namespace", NS)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD, "namespace": NS},
           "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "work", "image": info["workload_image"], "imagePullPolicy": "Never",
                                    "command": ["sleep", "1000000"], "resources": {"limits": {RES: "8"}}}]}}
    lc.run([*kubectl, "apply", "-f", "-"], input=json.dumps(pod))
    c.kubectl("wait", f"pod/{POD}", "-n", NS, "--for=condition=Ready", "--timeout=120s", timeout=130)

    node_w = Watch([*kubectl, "get", "node", lc.NODE_NAME, "--watch", "-o", "json"])
    pod_w = Watch([*kubectl, "get", "pod", POD, "-n", NS, "--watch", "-o", "json"])
    rows: list[Obj] = []
    try:
        start = 0.0
        node_w.wait_for(lambda n: allocatable(n) == 8, start, what="allocatable 8 before the first fault")
        pod_w.wait_for(lambda p: "Unhealthy" not in pod_health(p).values(), start,
                       what="the pod to show no device Unhealthy")
        for k in range(faults):
            i = k % 8
            uuid = nf.uuid(i)
            t0 = nf.signals(i, xid_events=[48])
            ta = node_w.wait_for(lambda n: allocatable(n) == 7, t0, what=f"fault {k}: allocatable 7")
            tb = pod_w.wait_for(device_is(uuid, "Unhealthy"), t0, what=f"fault {k}: pod device Unhealthy")
            tc = node_w.wait_for(state_is(i, "Unhealthy"), t0, what=f"fault {k}: annotation Unhealthy")
            # Clear the latch the way a GPU reset looks to NVML.
            t_ask = nf.signals(i, recovery_action="gpu_reset")
            node_w.wait_for(recovery_asked(i), t_ask, what=f"fault {k}: recovery-action reason")
            t_reset = nf.signals(i, recovery_action="none", xid_events=None)
            tr = node_w.wait_for(lambda n: allocatable(n) == 8, t_reset, what=f"fault {k}: allocatable 8 again")
            th = node_w.wait_for(state_is(i, "Healthy"), t_reset, what=f"fault {k}: annotation Healthy again")
            tp = pod_w.wait_for(device_is(uuid, "Healthy"), t_reset, what=f"fault {k}: pod device Healthy again")
            rows.append({"gpu": i, "a": ta - t0, "b": tb - t0, "c": tc - t0, "recovery_allocatable": tr - t_reset,
                         "recovery_annotation": th - t_reset, "recovery_pod": tp - t_reset})
            print(f"fault {k} gpu {i}: a {rows[-1]['a']:.2f}s b {rows[-1]['b']:.2f}s c {rows[-1]['c']:.2f}s "
                  f"recovery {rows[-1]['recovery_allocatable']:.2f}s", file=sys.stderr, flush=True)
    finally:
        node_w.stop()
        pod_w.stop()

    def fig(key: str) -> dict[str, float]:
        s = summary_ms([r[key] for r in rows])
        return {"n": s["n"], "p50_ms": round(s["p50_ms"]), "max_ms": round(s["max_ms"])}

    periods = kubelet_periods(c)
    return {
        "faults": len(rows),
        "a_allocatable_8_to_7": {**fig("a"), "floor": "kubelet node-status period",
                                 "kubelet_node_status_update_period": periods["nodeStatusUpdateFrequency"],
                                 "period_source": periods["source"]},
        "b_pod_allocatedResourcesStatus_unhealthy": fig("b"),
        "c_annotation_unhealthy": fig("c"),
        "recovery_reset_to_allocatable_8": fig("recovery_allocatable"),
        "recovery_reset_to_annotation_healthy": fig("recovery_annotation"),
        "recovery_reset_to_pod_device_healthy": fig("recovery_pod"),
        "plugin_poll_interval": plugin_poll_interval(c),
        "per_fault_s": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
    }


def down_checked(c: lc.Cluster) -> bool:
    c.down()
    left = lc.leftovers(c.layout)
    if not left.empty():
        print(f"bench: down left things behind: {left}", file=sys.stderr)
    return left.empty()


def cold_up(c: lc.Cluster, timeout: float) -> Obj:
    """up with the plugin's cache (binaries, images) and Go's build cache both empty; Go's module cache stays."""
    saved = {k: os.environ.get(k) for k in ("GPU_HEALTH_CACHE_DIR", "GOCACHE")}
    tmp = Path(tempfile.mkdtemp(prefix="bench-cold-"))
    try:
        os.environ["GPU_HEALTH_CACHE_DIR"] = str(tmp / "cache")
        os.environ["GOCACHE"] = str(tmp / "gocache")
        phases: Obj = {}
        started = time.monotonic()
        c.up(timed(cli._images, phases, "images_s"), timed(cli._binaries, phases, "binaries_s"),
             ready_timeout=timeout)
        secs = time.monotonic() - started
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        clean = down_checked(c)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"seconds": round(secs, 1), "phases": phases, "plugin_cache": "empty (GPU_HEALTH_CACHE_DIR)",
            "go_build_cache": "empty (GOCACHE)", "go_modules": "Go module downloads cached (GOMODCACHE kept)",
            "leftovers_after_down": not clean}


def timed(fn: Callable[[], Any], phases: Obj, name: str) -> Callable[[], Any]:
    """fn, with its seconds recorded: up's build-or-reuse steps, apart from starting the components."""
    def go() -> Any:
        started = time.monotonic()
        try:
            return fn()
        finally:
            phases[name] = round(time.monotonic() - started, 1)
    return go


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=20, help="faults to inject (0: only time up and deploy)")
    ap.add_argument("--cold", action="store_true", help="also time a cold up (empty caches) at the end")
    ap.add_argument("--timeout", type=float, default=240, help="seconds to wait for each component in up")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench: needs root (the local cluster does)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    c = lc.Cluster()
    if c.status() is not None:
        print("bench: a local cluster is already up; `scripts/local-cluster down` it first", file=sys.stderr)
        return 2
    results: Obj = {"machine": machine(), "kubernetes": binaries.KUBERNETES_VERSION}
    ok = True
    try:
        if args.faults > 0 or not args.cold:
            phases: Obj = {}
            started = time.monotonic()
            info = c.up(timed(cli._images, phases, "images_s"), timed(cli._binaries, phases, "binaries_s"),
                        ready_timeout=args.timeout)
            results["up_warm_s"] = round(time.monotonic() - started, 1)
            results["up_warm_phases"] = phases
            started = time.monotonic()
            c.deploy()
            results["deploy_s"] = round(time.monotonic() - started, 1)
            if args.faults > 0:
                results["latency"] = run_faults(c, info, args.faults)
            results["leftovers_after_down"] = not down_checked(c)
            ok = not results["leftovers_after_down"]
        if args.cold:
            results["up_cold"] = cold_up(c, args.timeout)
            ok = ok and not results["up_cold"]["leftovers_after_down"]
    except (lc.ClusterError, KeyboardInterrupt) as exc:
        results["error"] = str(exc) or type(exc).__name__
        ok = False
    finally:
        if c.status() is not None or not lc.leftovers(c.layout).empty():
            results["leftovers_after_down"] = not down_checked(c)
    print(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
