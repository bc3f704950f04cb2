"""The fleet controller (`gpu-health-controller`) against a real kube-apiserver: each rule, the release after the
recovery hold, the circuit breaker under a correlated failure, leader hand-over when the leader is killed, an
operator's cordon and label left alone, dry run, a two-minute API outage, bad config.

The controller runs as its own process, with the least-privilege RBAC of manifests/components/controller and its
service account's token, so every call it makes is one that RBAC allows. Node writes are counted from the API
server's audit log, not from the controller's own counters. Each test selects its own Nodes by a label of its own,
so the session's other Nodes are not part of its fleet.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.apiserver.flaky_proxy import FlakyProxy
from tests.conformance.apiserver.scrape import free_port, sample, scrape

pytestmark = [pytest.mark.conformance, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
NS = "gpu-health-system"
SA = "gpu-health-controller"
LEASE = "gpu-health-controller"
CONTROLLER_USER = f"system:serviceaccount:{NS}:{SA}"
GROUP_LABEL = "fleet-test.gpu-health.io/group"
OUTAGE_S = float(os.environ.get("GPU_HEALTH_OUTAGE_SECONDS", "120"))
PREFIX = "gpu-health.io"


def wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.2)  # the API server and the controller are other processes: nothing in-process to wait on


def ok(result: Any) -> Any:
    assert result.ok, f"HTTP {result.status}: {result.message}"
    return result.body


# The cluster side -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def controller_rbac(apiserver: Any) -> Path:
    """The controller component's namespace, service account and RBAC, applied as rendered by kustomize; a
    kubeconfig with its service account's token."""
    rendered = apiserver.kubectl("kustomize", str(REPO / "manifests" / "overlays" / "controller")).stdout
    docs = [d for d in _yaml_docs(rendered)
            if d.get("kind") in ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                                 "RoleBinding")
            and (d.get("kind") == "Namespace" or "controller" in d["metadata"]["name"])]
    assert {d["kind"] for d in docs} >= {"ServiceAccount", "ClusterRole", "Role"}, "component RBAC not rendered"
    apiserver.apply(docs)
    token = apiserver.token_for_service_account(NS, SA)
    return Path(apiserver.kubeconfig_for_token(token, "controller"))


def _yaml_docs(text: str) -> list[dict[str, Any]]:
    import yaml

    return [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]


def device(index: int, state: str = "Healthy", code: str = "", action: str = "none",
           since: str = "2026-01-01T00:00:00Z") -> str:
    reasons = [{"code": code, "message": code, "action": action}] if code else []
    return json.dumps({"id": f"GPU-{index:08d}-0000-4000-8000-000000000000", "state": state, "action": action,
                       "since": since, "reasons": reasons}, separators=(",", ":"))


def plugin_annotations(bad: dict[int, tuple[str, str, str]] | None = None, since: str = "2026-01-01T00:00:00Z",
                       gpus: int = 8) -> dict[str, str]:
    """What the node agent writes: each device, the worst state, a summary. ``bad``: index -> (state, code,
    action)."""
    bad = bad or {}
    out = {f"{PREFIX}/schema": "v1"}
    for i in range(gpus):
        state, code, action = bad.get(i, ("Healthy", "", "none"))
        out[f"{PREFIX}/gpu.{i}"] = device(i, state, code, action, since)
    worst = "Unhealthy" if any(s == "Unhealthy" for s, _, _ in bad.values()) else (
        "Degraded" if bad else "Healthy")
    out[f"{PREFIX}/state"] = worst
    out[f"{PREFIX}/summary"] = f"{worst}: {gpus} devices ({gpus - len(bad)} Healthy, {len(bad)} other)"
    return out


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Fleet:
    """The Nodes of one test, all carrying its group label."""

    def __init__(self, apiserver: Any, tag: str) -> None:
        self.api = apiserver
        self.group = f"{tag}-{secrets.token_hex(3)}"
        self.selector = f"{GROUP_LABEL}={self.group}"

    def node(self, short: str, *, annotated: bool = True, labels: dict[str, str] | None = None) -> str:
        name = f"{self.group}-{short}"
        self.api.create_node(name, labels={GROUP_LABEL: self.group, **(labels or {})},
                             annotations=plugin_annotations() if annotated else {})
        return name

    def get(self, name: str) -> dict[str, Any]:
        return ok(self.api.request("GET", f"/api/v1/nodes/{name}"))

    def poke(self, name: str) -> None:
        """A change the controller decides on and writes nothing for: a label of the test's own."""
        ok(self.api.request("PATCH", f"/api/v1/nodes/{name}",
                            {"metadata": {"labels": {"fleet-test.gpu-health.io/poke": secrets.token_hex(3)}}},
                            content_type="application/merge-patch+json"))

    def set_devices(self, name: str, bad: dict[int, tuple[str, str, str]] | None = None) -> None:
        """Write the devices' states the way the plugin does (a merge patch of its annotations)."""
        ok(self.api.request("PATCH", f"/api/v1/nodes/{name}",
                            {"metadata": {"annotations": plugin_annotations(bad, since=now_rfc3339())}},
                            content_type="application/merge-patch+json"))

    def fail(self, name: str) -> None:
        self.set_devices(name, {2: ("Unhealthy", "ecc-uncorrected", "reset-gpu")})

    def heal(self, name: str) -> None:
        self.set_devices(name, {})

    def set_allocatable(self, name: str, gpus: int) -> None:
        ok(self.api.request("PATCH", f"/api/v1/nodes/{name}/status",
                            {"status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}},
                            content_type="application/merge-patch+json"))

    def quarantine_of(self, name: str) -> dict[str, Any] | None:
        node = self.get(name)
        ann = node["metadata"].get("annotations") or {}
        if ann.get(f"controller.{PREFIX}/quarantined-by") != "gpu-health-controller":
            return None
        taints = [t for t in node["spec"].get("taints") or [] if t["key"] == f"{PREFIX}/quarantine"]
        return {"reason": ann.get(f"controller.{PREFIX}/quarantine-reason"),
                "owns": ann.get(f"controller.{PREFIX}/quarantine-owns"),
                "taints": taints, "unschedulable": bool(node["spec"].get("unschedulable")),
                "labels": node["metadata"].get("labels") or {}}

    def quarantined(self, names: list[str]) -> list[str]:
        return [n for n in names if self.quarantine_of(n) is not None]

    def controller_writes(self, name: str) -> list[dict[str, Any]]:
        return [w for w in self.api.node_writes(name) if w["user"] == CONTROLLER_USER and w["code"] < 300]

    def events(self, name: str, reason: str, namespace: str = "default") -> list[dict[str, Any]]:
        items = ok(self.api.request(
            "GET", f"/api/v1/namespaces/{namespace}/events?fieldSelector=involvedObject.name={name},reason={reason}"))
        return list(items.get("items") or [])


class ControllerProc:
    """One `gpu-health-controller` process with a config file of the test's."""

    def __init__(self, workdir: Path, kubeconfig: Path, selector: str, identity: str, config: dict[str, Any],
                 *extra: str) -> None:
        self.workdir = workdir
        self.identity = identity
        cfg = {"version": "v1", "kubeconfig": str(kubeconfig), "namespace": NS, "identity": identity,
               "nodeSelector": selector, "metricsAddress": f"127.0.0.1:{free_port()}", **config}
        self.metrics = str(cfg["metricsAddress"])
        # Short terms, so that a hand-over is quick; the write timeout below the fencing bound (6 s - 3 s).
        cfg.setdefault("leaderElection", {"leaseDuration": "6s", "renewDeadline": "3s", "retryPeriod": "0.5s",
                                          "writeTimeout": "2.5s"})
        path = workdir / f"{identity}.yaml"
        path.write_text(json.dumps(cfg))  # JSON is YAML
        self.log = workdir / f"{identity}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "plugin.controller.main", "--config", str(path),
                                          *extra], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(5)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def activity(self) -> tuple[float, float]:
        """(watch events received, nodes decided as the leader), from its /metrics."""
        code, text = scrape(int(self.metrics.rsplit(":", 1)[1]), "/metrics")
        assert code == 200, text
        return (sample(text, "gpu_health_controller_node_watch_events_total") or 0.0,
                sample(text, "gpu_health_controller_decisions_total") or 0.0)


def at_work(c: ControllerProc, fleet: Fleet, poke: str, seconds: float) -> None:
    """A window in which something must not happen, shown to be one in which ``c`` was at work: a change to
    ``poke`` (a label of the test's, which it decides on and writes nothing for) is seen and decided in it. A
    controller that had not acted yet, or had stopped, would pass the check that follows without this."""
    seen, decided = c.activity()
    fleet.poke(poke)
    time.sleep(seconds)  # an absence cannot be awaited: the window has to pass
    wait(lambda: (a := c.activity())[0] > seen and a[1] > decided, 30,
         f"{c.identity} seeing and deciding the change to {poke}\n{c.output()[-2000:]}")


@pytest.fixture
def run_controller(apiserver: Any, controller_rbac: Path, tmp_path: Path
                   ) -> Iterator[Callable[..., ControllerProc]]:
    started: list[ControllerProc] = []
    _delete_lease(apiserver)

    def start(fleet: Fleet, config: dict[str, Any], identity: str = "c1", kubeconfig: Path | None = None,
              extra: tuple[str, ...] = ()) -> ControllerProc:
        p = ControllerProc(tmp_path, kubeconfig or controller_rbac, fleet.selector, identity, config, *extra)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()
    _delete_lease(apiserver)


def _delete_lease(apiserver: Any) -> None:
    apiserver.request("DELETE", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{LEASE}")


def lease(apiserver: Any) -> dict[str, Any]:
    r = apiserver.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{LEASE}")
    return r.body if r.ok else {}


def breaker(apiserver: Any) -> dict[str, Any]:
    raw = ((lease(apiserver).get("metadata") or {}).get("annotations") or {}).get(f"{PREFIX}/breaker")
    return json.loads(raw) if raw else {}


FAST = {"release": {"recoveryHold": "3s"}, "breaker": {"maxQuarantinedFraction": 1.0}}


# The tests ------------------------------------------------------------------------------------------------------


def test_each_rule_quarantines_with_its_reason_and_leaves_the_rest_alone(apiserver: Any, run_controller: Any
                                                                         ) -> None:
    fleet = Fleet(apiserver, "rules")
    healthy = fleet.node("healthy")
    unhealthy = fleet.node("unhealthy")
    reboot = fleet.node("reboot")
    stock_gap = fleet.node("stock-gap", annotated=False)
    stock_ok = fleet.node("stock-ok", annotated=False)
    degraded = fleet.node("degraded")
    fleet.fail(unhealthy)
    fleet.set_devices(reboot, {3: ("Unhealthy", "xid-79", "reboot-node")})
    fleet.set_devices(degraded, {5: ("Degraded", "thermal-slowdown", "none")})
    fleet.set_allocatable(stock_gap, 6)
    fleet.set_allocatable(stock_ok, 7)
    c = run_controller(fleet, {**FAST, "policy": {"capacityGap": 2}})

    wait(lambda: len(fleet.quarantined([unhealthy, reboot, stock_gap])) == 3, 30,
         f"three nodes quarantined\n{c.output()}")
    for name, reason in ((unhealthy, "unhealthy-devices"), (reboot, "reboot-required"), (stock_gap, "capacity-gap")):
        q = fleet.quarantine_of(name)
        assert q is not None
        assert q["reason"] == reason
        assert q["owns"] == "taint"
        assert [(t["value"], t["effect"]) for t in q["taints"]] == [(reason, "NoSchedule")]
        assert len(fleet.controller_writes(name)) == 1
        (event,) = fleet.events(name, "GPUNodeQuarantined")
        assert reason in event["message"] and event["source"]["component"] == "gpu-health-controller"
    for name in (healthy, stock_ok, degraded):
        assert fleet.quarantine_of(name) is None
        assert fleet.controller_writes(name) == []
    # Idle: nothing changes, nothing is written (the Lease renewals are not Node writes).
    before = {n: len(apiserver.node_writes(n)) for n in (healthy, unhealthy, reboot, stock_gap)}
    at_work(c, fleet, stock_ok, 5)
    assert {n: len(apiserver.node_writes(n)) for n in before} == before
    assert c.proc.poll() is None


def test_release_after_the_hold_takes_back_only_what_it_added(apiserver: Any, run_controller: Any) -> None:
    fleet = Fleet(apiserver, "release")
    mine = fleet.node("plain")
    theirs = fleet.node("operator", labels={"example.com/team": "infra"})
    # The operator cordoned this one before anything failed, and set a taint of their own.
    ok(apiserver.request("PATCH", f"/api/v1/nodes/{theirs}",
                         {"spec": {"unschedulable": True,
                                   "taints": [{"key": "example.com/maintenance", "effect": "NoSchedule"}]}},
                         content_type="application/merge-patch+json"))
    fleet.fail(mine)
    fleet.fail(theirs)
    run_controller(fleet, {**FAST, "quarantine": {"cordon": True, "label": f"{PREFIX}/quarantined=true"}})

    wait(lambda: len(fleet.quarantined([mine, theirs])) == 2, 30, "both quarantined")
    q_mine, q_theirs = fleet.quarantine_of(mine), fleet.quarantine_of(theirs)
    assert q_mine is not None and q_theirs is not None
    assert q_mine["owns"] == "taint,cordon,label" and q_mine["unschedulable"]
    assert q_theirs["owns"] == "taint,label"  # the cordon was there already: not ours
    assert q_mine["labels"][f"{PREFIX}/quarantined"] == "true"

    healed_at = time.time()
    fleet.heal(mine)
    fleet.heal(theirs)
    wait(lambda: not fleet.quarantined([mine, theirs]), 30, "both released")
    released_after = time.time() - healed_at
    assert released_after >= 2.0  # the hold (3 s) counts from the devices' since, written at second resolution
    for name in (mine, theirs):
        node = fleet.get(name)
        ann = node["metadata"].get("annotations") or {}
        assert not [k for k in ann if k.startswith(f"{PREFIX}/quarantine")]
        assert f"{PREFIX}/quarantined" not in (node["metadata"].get("labels") or {})
        assert not [t for t in node["spec"].get("taints") or [] if t["key"] == f"{PREFIX}/quarantine"]
        (event,) = fleet.events(name, "GPUNodeReleased")
        assert "released" in event["message"]
    assert not fleet.get(mine)["spec"].get("unschedulable")
    node = fleet.get(theirs)
    assert node["spec"]["unschedulable"] is True  # the operator's cordon stays
    assert node["metadata"]["labels"]["example.com/team"] == "infra"
    assert [t["key"] for t in node["spec"]["taints"]] == ["example.com/maintenance"]


def test_a_repeat_offender_is_held_until_the_operator_asks(apiserver: Any, run_controller: Any) -> None:
    """Issue 34: with a repeat limit of 2, the second quarantine holds the node past the hold; the operator's
    request (an annotation under the controller's prefix, as `kubectl gpu-health fleet release` writes it) releases
    it and resets the count, on a real API server's merge patches."""
    own = f"controller.{PREFIX}"
    fleet = Fleet(apiserver, "repeat")
    node = fleet.node("n")
    fleet.fail(node)
    c = run_controller(fleet, {**FAST, "release": {"recoveryHold": "2s", "repeatLimit": 2, "repeatWindow": "1h"}})
    wait(lambda: fleet.quarantine_of(node), 30, "first quarantine")
    assert fleet.quarantine_of(node)["reason"] == "unhealthy-devices"  # type: ignore[index]
    fleet.heal(node)
    wait(lambda: fleet.quarantine_of(node) is None, 30, "first release")
    assert len(fleet.get(node)["metadata"]["annotations"][f"{own}/quarantine-history"].split(",")) == 1

    fleet.fail(node)
    wait(lambda: fleet.quarantine_of(node), 30, "second quarantine")
    q = fleet.quarantine_of(node)
    assert q is not None and q["reason"] == "repeat-offender"
    assert [t["value"] for t in q["taints"]] == ["repeat-offender"]
    fleet.heal(node)
    wait(lambda: fleet.events(node, "GPUNodeRepeatOffender"), 30, "the hold said")
    at_work(c, fleet, node, 3)  # past another hold (2 s), decided again: it must still be held
    assert fleet.quarantine_of(node) is not None

    ok(apiserver.request("PATCH", f"/api/v1/nodes/{node}",
                         {"metadata": {"annotations": {f"{own}/release": "replaced the board"}}},
                         content_type="application/merge-patch+json"))
    wait(lambda: fleet.quarantine_of(node) is None, 30, "released at the operator's request")
    ann = fleet.get(node)["metadata"]["annotations"]
    assert f"{own}/quarantine-history" not in ann and f"{own}/release" not in ann
    assert any("replaced the board" in e["message"] for e in fleet.events(node, "GPUNodeReleased"))


def test_breaker_quarantines_up_to_the_limit_under_a_correlated_failure(apiserver: Any, run_controller: Any
                                                                        ) -> None:
    fleet = Fleet(apiserver, "breaker")
    names = [fleet.node(f"n{i:02d}") for i in range(20)]
    c = run_controller(fleet, {"release": {"recoveryHold": "2s"}, "breaker": {"maxQuarantinedFraction": 0.1}})
    wait(lambda: (lease(apiserver).get("spec") or {}).get("holderIdentity"), 30, "a leader")
    failing = names[:6]  # 30% of the fleet, as a bad driver roll-out would
    for n in failing:
        fleet.fail(n)
    wait(lambda: breaker(apiserver).get("state") == "open", 30, f"breaker open\n{c.output()}")
    wait(lambda: len(fleet.quarantined(failing)) == 2, 30, "two quarantined")
    at_work(c, fleet, next(n for n in failing if not fleet.quarantine_of(n)), 3)  # nothing more: the limit is 2 of 20
    quarantined = fleet.quarantined(names)
    assert len(quarantined) == 2
    st = breaker(apiserver)
    assert st["limit"] == 2 and st["gpuNodes"] == 20 and st["quarantined"] == 2 and st["blocked"] == 4
    (blocked,) = fleet.events(LEASE, "GPUQuarantineBlocked", namespace=NS)
    assert "limit is 2 of 20" in blocked["message"]

    # The failure recedes on the nodes still in service: demand fits the limit, the breaker closes.
    for n in failing:
        if n not in quarantined:
            fleet.heal(n)
    wait(lambda: breaker(apiserver).get("state") == "closed", 30, "breaker closed")
    # Open again, then an operator resets it: it closes, finds the limit still full, and opens again.
    for n in names[6:9]:
        fleet.fail(n)
    wait(lambda: breaker(apiserver).get("state") == "open", 30, "breaker open again")
    apiserver.kubectl("annotate", "lease", "-n", NS, LEASE, f"{PREFIX}/breaker-reset=r1", "--overwrite")
    wait(lambda: fleet.events(LEASE, "GPUQuarantineResumed", namespace=NS) and
         any("reset by an operator (r1)" in e["message"]
             for e in fleet.events(LEASE, "GPUQuarantineResumed", namespace=NS)), 30, "the reset seen")
    wait(lambda: breaker(apiserver).get("resetSeen") == "r1", 30, "reset recorded on the lease")
    assert len(fleet.quarantined(names)) == 2


def test_leader_handover_when_the_leader_is_killed_acts_once(apiserver: Any, run_controller: Any) -> None:
    fleet = Fleet(apiserver, "handover")
    first, second, healthy = fleet.node("first"), fleet.node("second"), fleet.node("healthy")
    a = run_controller(fleet, FAST, identity="replica-a")
    b = run_controller(fleet, FAST, identity="replica-b")
    holder = wait(lambda: (lease(apiserver).get("spec") or {}).get("holderIdentity"), 30, "a leader")
    leader, standby = (a, b) if holder == "replica-a" else (b, a)
    fleet.fail(first)
    # The leader's action is done when its Event is out too (a leader killed between its write and its Event loses
    # the Event: the Node's annotations are the record, docs/fleet.md).
    wait(lambda: fleet.quarantined([first]) and fleet.events(first, "GPUNodeQuarantined"), 30,
         "first quarantined by the leader")

    leader.kill()  # SIGKILL: no hand-back; the standby must wait out the lease
    fleet.fail(second)
    wait(lambda: (lease(apiserver).get("spec") or {}).get("holderIdentity") == standby.identity, 30,
         f"the standby took over\n{standby.output()}")
    wait(lambda: fleet.quarantined([second]), 30, "second quarantined by the new leader")
    at_work(standby, fleet, healthy, 2)  # the new leader looked at every node when it took over: no write again
    for name in (first, second):
        assert len(fleet.controller_writes(name)) == 1, fleet.controller_writes(name)
        assert len(fleet.events(name, "GPUNodeQuarantined")) == 1
    assert fleet.controller_writes(healthy) == []
    assert int(lease(apiserver)["spec"]["leaseTransitions"]) >= 1


def test_dry_run_posts_events_and_writes_no_node(apiserver: Any, run_controller: Any) -> None:
    fleet = Fleet(apiserver, "dryrun")
    bad = fleet.node("bad")
    fleet.fail(bad)
    run_controller(fleet, {**FAST, "dryRun": True})
    wait(lambda: fleet.events(bad, "GPUQuarantineDryRun"), 30, "the dry-run Event")
    (event,) = fleet.events(bad, "GPUQuarantineDryRun")
    assert event["message"].startswith("would quarantine") and "unhealthy-devices" in event["message"]
    assert fleet.controller_writes(bad) == []
    assert fleet.quarantine_of(bad) is None


def test_api_outage_converges_and_acts_once(apiserver: Any, run_controller: Any, controller_rbac: Path,
                                            tmp_path: Path) -> None:
    host, port = apiserver.url.split("://", 1)[1].rsplit(":", 1)
    proxy = FlakyProxy((host, int(port)))
    try:
        import yaml

        cfg = yaml.safe_load(controller_rbac.read_text())
        cfg["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
        kubeconfig = tmp_path / "through-proxy.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(cfg))
        fleet = Fleet(apiserver, "outage")
        early, late = fleet.node("early"), fleet.node("late")
        fleet.fail(early)
        c = run_controller(fleet, {**FAST, "leaderElection": {"leaseDuration": "15s", "renewDeadline": "10s",
                                                              "retryPeriod": "2s"}}, kubeconfig=kubeconfig)
        wait(lambda: fleet.quarantined([early]), 30, "early quarantined")

        proxy.down()
        fleet.heal(early)  # while the controller cannot see: it must release later, once
        fleet.fail(late)
        time.sleep(OUTAGE_S)
        assert proxy.refused > 0  # the controller kept trying
        assert c.proc.poll() is None
        proxy.up = True

        wait(lambda: fleet.quarantined([late]) and not fleet.quarantined([early]), 90,
             f"converged after the outage\n{c.output()[-3000:]}")
        at_work(c, fleet, late, 3)
        assert len(fleet.controller_writes(early)) == 2  # quarantine, release
        assert len(fleet.controller_writes(late)) == 1
        assert len(fleet.events(late, "GPUNodeQuarantined")) == 1
    finally:
        proxy.close()


def _grace_period() -> int:
    import yaml

    doc = yaml.safe_load((REPO / "manifests" / "components" / "controller" / "deployment.yaml").read_text())
    return int(doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])


def _at(stamp: str) -> dt.datetime:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def test_sigterm_mid_storm_starts_no_write_and_hands_the_lease_back_after_the_last(
        apiserver: Any, run_controller: Any, controller_rbac: Path, tmp_path: Path) -> None:
    """Issue 35, 5: 1,000 failing nodes, an API server that takes 0.3 s to answer, 4 writers; SIGTERM once some
    quarantines have landed. The server receives no Node write the stop did not find in flight (one per writer at
    most), the Lease's hand-back comes after the last Node write was answered, and the process exits 0 within the
    Deployment's grace period. Before the fix the worker went on deciding for 10 s after the signal, then the pool
    was shut under it, and the Lease was handed back with writes in flight."""
    host, port = apiserver.url.split("://", 1)[1].rsplit(":", 1)
    proxy = FlakyProxy((host, int(port)), answer_delay_s=0.3)
    fleet = Fleet(apiserver, "storm")
    names = [f"{fleet.group}-{i:04d}" for i in range(1000)]
    failing = plugin_annotations({2: ("Unhealthy", "ecc-uncorrected", "reset-gpu")})
    try:
        import yaml

        cfg = yaml.safe_load(controller_rbac.read_text())
        cfg["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
        kubeconfig = tmp_path / "slow.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(cfg))
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda n: apiserver.create_node(n, labels={GROUP_LABEL: fleet.group},
                                                          annotations=failing), names))
        c = run_controller(fleet, {**FAST, "quarantine": {"writeConcurrency": 4}}, kubeconfig=kubeconfig)

        def writes() -> list[dict[str, Any]]:
            return [w for w in apiserver.audited("nodes", CONTROLLER_USER)
                    if w["verb"] == "patch" and w["name"].startswith(fleet.group + "-")]

        wait(lambda: len(writes()) >= 20, 120, f"a storm under way\n{c.output()[-3000:]}")
        signalled = dt.datetime.now(dt.UTC)
        c.proc.send_signal(signal.SIGTERM)
        grace = _grace_period()
        try:
            code = c.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {grace}s after SIGTERM (the kubelet kills it then)\n{c.output()[-3000:]}")
        assert code == 0, c.output()[-3000:]

        done = writes()
        late = [w for w in done if _at(w["received"]) > signalled]
        assert len(late) <= 4, f"{len(late)} Node writes reached the server after SIGTERM: {late[:3]} ..."
        assert 20 <= len(done) < len(names), "the stop did not come mid-storm"
        assert all(w["code"] < 300 for w in done), [w for w in done if w["code"] >= 300]
        renewals = [w for w in apiserver.audited("leases", CONTROLLER_USER) if w["name"] == LEASE]
        assert (lease(apiserver).get("spec") or {}).get("holderIdentity") == "", c.output()[-3000:]
        handed_back = renewals[-1]
        assert _at(handed_back["received"]) >= max(_at(w["answered"]) for w in done), (handed_back, done[-4:])
        assert "handed lease" in c.output() and "Traceback" not in c.output()
    finally:
        proxy.close()
        apiserver.request("DELETE", f"/api/v1/nodes?labelSelector={GROUP_LABEL}%3D{fleet.group}")


@pytest.mark.parametrize(("config", "named"), [
    ({"version": "v1", "breaker": {"maxQuarantinedFraction": 2}}, "breaker.maxQuarantinedFraction"),
    ({"version": "v1", "release": {"recoveryHould": "10m"}}, "release.recoveryHould"),
    ({"version": "v2"}, "version"),
])
def test_bad_config_exits_2_naming_the_field(tmp_path: Path, config: dict[str, Any], named: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "plugin.controller.main", "--config", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert named in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.fixture
def drain_rbac(apiserver: Any, controller_rbac: Path) -> Iterator[None]:
    rendered = apiserver.kubectl("kustomize", str(REPO / "manifests" / "overlays" / "controller-drain")).stdout
    docs = [d for d in _yaml_docs(rendered) if d["metadata"]["name"] == "gpu-health-controller-drain"]
    assert {d["kind"] for d in docs} == {"ClusterRole", "ClusterRoleBinding"}
    apiserver.apply(docs)
    yield
    # Other tests check that the controller cannot evict without this component.
    for d in docs:
        apiserver.request("DELETE", f"/apis/rbac.authorization.k8s.io/v1/{d['kind'].lower()}s/{d['metadata']['name']}")


def test_drain_no_execute_and_metrics_on_a_quarantined_node(apiserver: Any, run_controller: Any,
                                                             drain_rbac: None) -> None:
    fleet = Fleet(apiserver, "drain")
    node = fleet.node("n")
    ns = fleet.group
    ok(apiserver.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                        "metadata": {"name": ns}}))
    # No controller-manager: the service account pods are admitted with is made by hand.
    ok(apiserver.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts",
                         {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}))

    def pod(name: str, labels: dict[str, str] | None = None, owner: str | None = None) -> None:
        meta: dict[str, Any] = {"name": name, "namespace": ns, "labels": labels or {}}
        if owner:
            meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": owner,
                                        "uid": "00000000-0000-4000-8000-000000000001", "controller": True}]
        ok(apiserver.request("POST", f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"nodeName": node, "automountServiceAccountToken": False,
                     "containers": [{"name": "c", "image": "registry.invalid/train:1"}]}}))
        # What the kubelet would report: Running and Ready (a Pending pod is evicted without asking its budget).
        ok(apiserver.request("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status",
                             {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
                             content_type="application/merge-patch+json"))

    def budget(allowed: int) -> None:
        path = f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets"
        if apiserver.request("GET", f"{path}/guarded").status == 404:
            ok(apiserver.request("POST", path, {
                "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                "metadata": {"name": "guarded", "namespace": ns},
                "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}}}))
        generation = ok(apiserver.request("GET", f"{path}/guarded"))["metadata"]["generation"]
        # The disruption controller's job, done by hand.
        ok(apiserver.request("PATCH", f"{path}/guarded/status", {"status": {
            "observedGeneration": generation, "disruptionsAllowed": allowed, "currentHealthy": 1 + allowed,
            "desiredHealthy": 1, "expectedPods": 1 + allowed}}, content_type="application/merge-patch+json"))

    def going(name: str) -> bool:
        r = apiserver.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}")
        return r.status == 404 or bool(r.body["metadata"].get("deletionTimestamp"))

    pod("plain")
    pod("guarded", {"app": "guarded"})
    pod("daemon", owner="node-agent")
    budget(0)
    port = free_port()
    run_controller(fleet, {**FAST, "metricsAddress": f"127.0.0.1:{port}",
                           "quarantine": {"noExecuteAfter": "2s"},
                           "drain": {"enabled": True, "evictionsPerMinute": 600}})
    wait(lambda: scrape(port, "/readyz")[0] == 200, 30, "ready")
    fleet.fail(node)
    wait(lambda: going("plain"), 30, "the plain pod evicted")
    wait(lambda: fleet.quarantine_of(node) and len(fleet.quarantine_of(node)["taints"]) == 2, 30,  # type: ignore[index]
         "the NoExecute taint after its grace")
    q = fleet.quarantine_of(node)
    assert q is not None and {t["effect"] for t in q["taints"]} == {"NoSchedule", "NoExecute"}
    assert q["owns"] == "noexecute,taint"
    wait(lambda: (sample(scrape(port, "/metrics")[1], "gpu_health_controller_evictions_blocked_total") or 0) >= 1,
         30, "an eviction the budget refused")
    assert not going("guarded")  # the budget holds it
    budget(1)
    wait(lambda: going("guarded"), 60, "the guarded pod evicted once its budget allows")
    wait(lambda: fleet.events(node, "GPUNodeDrained"), 60, "drained")
    assert not going("daemon")  # a DaemonSet's pod is never evicted
    assert f"controller.{PREFIX}/quarantine-drained" in fleet.get(node)["metadata"]["annotations"]
    status, text = scrape(port, "/metrics")
    assert status == 200
    assert sample(text, 'gpu_health_controller_quarantined_nodes{reason="unhealthy-devices"}') == 1
    assert sample(text, "gpu_health_controller_leader") == 1
    assert sample(text, 'gpu_health_controller_actions_total{action="evict"}') == 2
    assert sample(text, "gpu_health_controller_gpu_nodes") == 1
    assert scrape(port, "/healthz")[0] == 200

    fleet.heal(node)
    wait(lambda: fleet.quarantine_of(node) is None, 30, "released")
    assert not [t for t in fleet.get(node)["spec"].get("taints") or [] if t["key"] == f"{PREFIX}/quarantine"]
