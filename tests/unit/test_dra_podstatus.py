"""The pod-condition writer of DRA mode (plugin/dra/podstatus.py) on a virtual clock: device health in the status
of a pod that asked for nvidia.com/gpu with no claim. The fake API server at the edge keeps pods as the real one
does for these calls: a strategic merge of ``status.conditions`` by type, the UID in the patch refused for another
pod of the name (422, as 1.37.2 answers), 404 for a missing pod, and failures on demand. The real server, the
shipped RBAC and admission policy: tests/conformance/apiserver/test_pod_status_policy.py; a real cluster: story 53."""

from __future__ import annotations

import copy
import json
import logging
import random
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from plugin.dra.checkpoint import Checkpoint, PodRef, PreparedClaim, PreparedDevice
from plugin.dra.podstatus import (
    EXTENDED_RESOURCE_CLAIM,
    STATE_FILE,
    PodConditionSettings,
    PodConditionWriter,
    Verdict,
    desired_verdicts,
    extended_resource_pod,
    verdict,
)
from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from plugin.kube.errors import ApiFailure
from plugin.validation import FieldError
from tests.conftest import FakeClock
from tests.fakes.node_devices import Node, gpu, status

T0 = 1_767_225_600.0
TYPE = "gpu-health.io/DevicesHealthy"
NS = "team-a"


def pod_uid(name: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"pod/{name}"))


def claim_uid(name: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"claim/{name}"))


def prepared(name: str, *indexes: int, pod: str | None = None, shares: int = 1) -> PreparedClaim:
    devs = tuple(PreparedDevice(request_names=("container-0-request-0",), pool="n", device=f"gpu-{i}",
                                uuid=gpu(i).uuid, minor=i, cdi_ids=(), share_id=f"s{s}" if shares > 1 else "")
                 for i in indexes for s in range(shares))
    return PreparedClaim(uid=claim_uid(name), namespace=NS, name=name, devices=devs,
                         pod=PodRef(NS, pod, pod_uid(pod)) if pod else None)


@dataclass
class FakePods:
    """The API server's pods, by namespace and name."""

    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    calls: list[tuple[str, int]] = field(default_factory=list)
    fail_next: list[ApiFailure] = field(default_factory=list)
    closed: int = 0

    def add(self, name: str, uid: str | None = None) -> None:
        self.pods[(NS, name)] = {"metadata": {"name": name, "namespace": NS, "uid": uid or pod_uid(name)},
                                 "status": {"conditions": [{"type": "Ready", "status": "True"}]}}

    def patch_pod_status_condition(self, namespace: str, name: str, uid: str, condition: Mapping[str, str]) -> None:
        if self.fail_next:
            f = self.fail_next.pop(0)
            self.calls.append((name, f.status or 0))
            raise f
        pod = self.pods.get((namespace, name))
        if pod is None:
            self.calls.append((name, 404))
            raise ApiFailure(404, f'pods "{name}" not found')
        if pod["metadata"]["uid"] != uid:
            # What kube-apiserver 1.37.2 answers (tests/conformance/apiserver/test_pod_status_policy.py).
            self.calls.append((name, 422))
            raise ApiFailure(422, f'Pod "{name}" is invalid: metadata.uid: Invalid value: "{uid}": field is '
                                  f'immutable')
        self.calls.append((name, 200))
        conds = pod["status"]["conditions"]
        for c in conds:
            if c["type"] == condition["type"]:
                c.update(condition)
                break
        else:
            conds.append(dict(condition))

    def condition(self, name: str) -> dict[str, str] | None:
        return next((copy.deepcopy(c) for c in self.pods[(NS, name)]["status"]["conditions"] if c["type"] == TYPE),
                    None)

    def close(self) -> None:
        self.closed += 1


class Harness:
    def __init__(self, state_dir: Path, server: FakePods | None = None, degraded_as: str = "Healthy",
                 claims: dict[str, PreparedClaim] | None = None) -> None:
        self.server = server or FakePods()
        self.clock = FakeClock(1000.0)
        self.wall = FakeClock(T0)
        self.state = NodeState()
        self.node = Node(self.state, n=8)
        self.claims: dict[str, PreparedClaim] = claims if claims is not None else {}
        self.writer = PodConditionWriter(self.state, PodConditionSettings(degraded_as=degraded_as),
                                         lambda: dict(self.claims), lambda: self.server, state_dir,
                                         debounce_s=1.0, min_interval_s=10.0, backoff_max_s=300.0, clock=self.clock,
                                         wall=self.wall, rng=random.Random(3))

    def run_to(self, t: float) -> None:
        for _ in range(10_000):
            deadline = self.writer.tick(self.clock.now)
            if self.clock.now >= t:
                return
            step = min(max(deadline, self.clock.now), t)
            self.wall.now += step - self.clock.now
            self.clock.now = step
        raise AssertionError("the writer did not settle")

    def for_(self, seconds: float) -> None:
        self.run_to(self.clock.now + seconds)

    def prepare(self, c: PreparedClaim) -> None:
        self.claims[c.uid] = c
        self.writer.claims_changed()

    def unprepare(self, c: PreparedClaim) -> None:
        del self.claims[c.uid]
        self.writer.claims_changed()

    def set(self, index: int, state: State, *codes: str) -> None:
        self.node.set(index, state, *codes, now=self.wall.now)


def started(tmp_path: Path) -> tuple[Harness, PreparedClaim]:
    h = Harness(tmp_path)
    h.node.publish(T0)
    h.server.add("train")
    c = prepared("train-extended-resources-x1", 2, 3, pod="train")
    h.prepare(c)
    h.for_(5)
    h.server.calls.clear()
    return h, c


# Which claims are a pod's ---------------------------------------------------------------------------------------

def scheduler_claim(annotation: str | None = "true", controller: bool = True, kind: str = "Pod") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "train-extended-resources-x1", "namespace": NS, "uid": claim_uid("c"),
                            "ownerReferences": [{"apiVersion": "v1", "kind": kind, "name": "train",
                                                 "uid": pod_uid("train"), "controller": controller,
                                                 "blockOwnerDeletion": True}]}
    if annotation is not None:
        meta["annotations"] = {EXTENDED_RESOURCE_CLAIM: annotation}
    return {"metadata": meta}


def test_the_scheduler_made_claim_of_a_pod_names_the_pod() -> None:
    assert extended_resource_pod(scheduler_claim()) == PodRef(NS, "train", pod_uid("train"))


@pytest.mark.parametrize("claim", [
    scheduler_claim(annotation=None),  # a claim from a template: the kubelet shows its health itself
    scheduler_claim(annotation="false"),
    scheduler_claim(controller=False),
    scheduler_claim(kind="Job"),
    {"metadata": "not an object"},
    {},
])
def test_any_other_claim_names_no_pod(claim: dict[str, Any]) -> None:
    assert extended_resource_pod(claim) is None


# What the condition says ----------------------------------------------------------------------------------------

S = PodConditionSettings()


def sr(v: Verdict) -> tuple[str, str]:
    return v.status, v.reason


def test_all_healthy_is_true_and_names_the_devices() -> None:
    v = verdict([("gpu-2", status(gpu(2))), ("gpu-3", status(gpu(3)))], S)
    assert v == Verdict("True", "Healthy", "gpu-2, gpu-3 Healthy")


def test_an_unhealthy_device_is_false_with_its_reason() -> None:
    v = verdict([("gpu-2", status(gpu(2))), ("gpu-3", status(gpu(3), State.UNHEALTHY, "ecc-uncorrected"))], S)
    assert (v.status, v.reason) == ("False", "Unhealthy")
    assert v.message.startswith("gpu-3 Unhealthy: ecc-uncorrected: "), v.message
    assert "gpu-2" not in v.message


def test_degraded_follows_the_kubelet_health_mapping() -> None:
    devices = [("gpu-2", status(gpu(2), State.DEGRADED, "thermal-slowdown"))]
    assert sr(verdict(devices, S)) == ("True", "Degraded")
    assert sr(verdict(devices, PodConditionSettings(degraded_as="Unhealthy"))) == ("False", "Degraded")


def test_unknown_or_gone_is_unknown_and_unhealthy_wins_over_both() -> None:
    assert sr(verdict([("gpu-2", status(gpu(2), State.UNKNOWN, "nvml-error"))], S)) == ("Unknown", "Unknown")
    gone = verdict([("gpu-2", None)], S)
    assert gone == Verdict("Unknown", "Unknown", "gpu-2 Unknown: not on the node now")
    both = verdict([("gpu-2", None), ("gpu-3", status(gpu(3), State.UNHEALTHY, "xid-79"))], S)
    assert sr(both) == ("False", "Unhealthy")


def test_a_long_message_is_cut() -> None:
    many = [(f"gpu-{i}", status(gpu(i), State.UNHEALTHY, "xid-79", "ecc-uncorrected")) for i in range(60)]
    assert len(verdict(many, S).message) <= 1024


def test_only_claims_with_a_pod_get_a_condition_and_a_shared_gpu_counts_once(tmp_path: Path) -> None:
    state = NodeState()
    node = Node(state, n=4)
    node.publish(T0)
    claims = [prepared("plain", 0), prepared("ext", 1, pod="train", shares=2)]
    assert desired_verdicts(claims, state.snapshot(), S) == {
        PodRef(NS, "train", pod_uid("train")): Verdict("True", "Healthy", "gpu-1 Healthy")}


def test_settings_name_the_bad_field() -> None:
    with pytest.raises(FieldError, match="degraded_as"):
        PodConditionSettings(degraded_as="Maybe")
    with pytest.raises(FieldError):
        PodConditionSettings(mig_strategy="single")
    assert PodConditionSettings(taint_prefix="example.com").condition_type == "example.com/DevicesHealthy"


# The writer -----------------------------------------------------------------------------------------------------

def test_nothing_is_written_before_the_first_snapshot(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.server.add("train")
    h.prepare(prepared("c", 1, pod="train"))
    h.for_(60)
    assert h.server.calls == []


def test_a_prepared_claim_of_a_pod_gets_one_condition_after_the_debounce(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.node.publish(T0)
    h.server.add("train")
    h.server.add("other")
    h.prepare(prepared("plain", 0))  # a claim a container names: the kubelet's own business
    h.prepare(prepared("train-ext", 2, 3, pod="train"))
    h.for_(0.5)
    assert h.server.calls == []
    h.for_(1)
    assert h.server.calls == [("train", 200)]
    assert h.server.condition("train") == {"type": TYPE, "status": "True", "reason": "Healthy",
                                           "message": "gpu-2, gpu-3 Healthy",
                                           "lastTransitionTime": "2026-01-01T00:00:01Z"}
    assert h.server.pods[(NS, "train")]["status"]["conditions"][0] == {"type": "Ready", "status": "True"}
    assert h.server.condition("other") is None
    s = h.writer.status()
    assert (s.ok, s.writes, s.pods, s.failures) == (True, 1, 1, 0)


def test_a_fault_and_its_reset_each_write_once_and_move_the_transition_time(tmp_path: Path) -> None:
    h, _ = started(tmp_path)
    first = h.server.condition("train")
    assert first is not None
    h.for_(100)
    h.set(3, State.UNHEALTHY, "ecc-uncorrected")
    h.for_(30)
    assert h.server.calls == [("train", 200)]
    bad = h.server.condition("train")
    assert bad is not None and (bad["status"], bad["reason"]) == ("False", "Unhealthy")
    assert bad["message"].startswith("gpu-3 Unhealthy: ecc-uncorrected"), bad
    assert bad["lastTransitionTime"] > first["lastTransitionTime"]
    # Another reason on the same device: the message changes, the status and its transition time do not.
    h.set(3, State.UNHEALTHY, "xid-79")
    h.for_(30)
    worse = h.server.condition("train")
    assert worse is not None and "xid-79" in worse["message"]
    assert worse["lastTransitionTime"] == bad["lastTransitionTime"]
    h.set(3, State.HEALTHY)
    h.for_(30)
    ok = h.server.condition("train")
    assert ok is not None and (ok["status"], ok["reason"]) == ("True", "Healthy")
    assert len(h.server.calls) == 3


def test_another_gpus_fault_writes_nothing(tmp_path: Path) -> None:
    h, _ = started(tmp_path)
    h.set(6, State.UNHEALTHY, "ecc-uncorrected")
    h.for_(60)
    assert h.server.calls == []


def test_an_unchanged_node_writes_nothing_for_a_minute_and_a_restart_writes_nothing(tmp_path: Path) -> None:
    h, c = started(tmp_path)
    h.node.publish(h.wall.now)  # the same statuses again
    h.for_(60)
    assert h.server.calls == []
    again = Harness(tmp_path, server=h.server, claims={c.uid: c})
    again.node.publish(T0)
    again.for_(60)
    assert h.server.calls == []
    # ...and the restarted writer still knows the transition time it wrote.
    again.set(2, State.UNHEALTHY, "xid-79")
    again.for_(30)
    assert h.server.calls == [("train", 200)]


def test_a_burst_within_the_debounce_that_comes_back_writes_nothing(tmp_path: Path) -> None:
    h, _ = started(tmp_path)
    h.set(3, State.UNHEALTHY, "ecc-uncorrected")
    h.for_(0.3)
    h.set(3, State.HEALTHY)
    h.for_(30)
    assert h.server.calls == []


def test_a_storm_of_changes_is_one_round_per_interval(tmp_path: Path) -> None:
    h, _ = started(tmp_path)
    for n in range(50):
        h.set(3, State.UNHEALTHY, ("xid-79", "ecc-uncorrected")[n % 2])
        h.for_(1.0)
    assert 4 <= len(h.server.calls) <= 6, h.server.calls  # 50 s at one round per 10 s


def test_an_unprepared_claim_is_forgotten_without_a_write(tmp_path: Path) -> None:
    h, c = started(tmp_path)
    h.unprepare(c)
    h.for_(30)
    assert h.server.calls == []
    assert json.loads((tmp_path / STATE_FILE).read_text())["pods"] == {}
    assert h.writer.status().pods == 0


@pytest.mark.parametrize("gone", ["deleted", "made again"])
def test_a_pod_gone_or_made_again_is_left_alone(tmp_path: Path, gone: str) -> None:
    h = Harness(tmp_path)
    h.node.publish(T0)
    if gone == "made again":
        h.server.add("train", uid=pod_uid("train-2"))
    h.server.add("eval")
    h.prepare(prepared("train-ext", 2, pod="train"))
    h.prepare(prepared("eval-ext", 4, pod="eval"))
    h.for_(5)
    code = 404 if gone == "deleted" else 422
    assert sorted(h.server.calls) == [("eval", 200), ("train", code)]
    h.set(2, State.UNHEALTHY, "ecc-uncorrected")
    h.for_(60)
    assert sorted(h.server.calls) == [("eval", 200), ("train", code)]  # never asked again
    assert h.writer.status().skipped == 1 and h.writer.status().ok
    if gone == "made again":
        assert h.server.condition("train") is None


def test_a_failing_server_backs_off_and_the_write_lands_once_it_answers(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    h, _ = started(tmp_path)
    h.server.fail_next = [ApiFailure(500, "etcdserver: leader changed"), ApiFailure(503, "unavailable")]
    with caplog.at_level(logging.WARNING, logger="plugin.dra.podstatus"):
        h.set(3, State.UNHEALTHY, "ecc-uncorrected")
        while not h.server.calls:
            h.for_(0.25)
        assert not h.writer.status().ok and h.server.calls == [("train", 500)]
        h.for_(60)
    assert h.server.calls == [("train", 500), ("train", 503), ("train", 200)]
    s = h.writer.status()
    assert s.ok and s.failures_by_kind == {"write": 2}
    assert sum("writing a pod's status failed" in r.getMessage() for r in caplog.records) == 2
    cond = h.server.condition("train")
    assert cond is not None and cond["status"] == "False"


def test_a_damaged_state_file_means_one_more_write_per_pod(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    h, c = started(tmp_path)
    (tmp_path / STATE_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="plugin.dra.podstatus"):
        again = Harness(tmp_path, server=h.server, claims={c.uid: c})
    assert any("written once more" in r.getMessage() for r in caplog.records)
    again.node.publish(T0)
    again.for_(30)
    assert h.server.calls == [("train", 200)]
    again.for_(60)
    assert h.server.calls == [("train", 200)]


def test_the_checkpoint_keeps_the_pod_and_an_older_entry_reads_without_one(tmp_path: Path) -> None:
    cp = Checkpoint(tmp_path)
    with_pod = prepared("ext", 1, pod="train")
    plain = prepared("plain", 2)
    cp.save({with_pod.uid: with_pod, plain.uid: plain})
    doc = json.loads(cp.path.read_text())
    assert doc["claims"][with_pod.uid]["pod"] == {"name": "train", "uid": pod_uid("train")}
    assert "pod" not in doc["claims"][plain.uid]
    assert cp.load() == {with_pod.uid: with_pod, plain.uid: plain}
