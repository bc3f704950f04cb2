"""``kubectl gpu-health fleet``: the controller's quarantines and breaker, read from nodes and the Lease written by
the real code (the node agent's annotations, the controller's quarantine patch and its breaker's JSON).

The one fake is at the edge: a stand-in ``kubectl`` executable that records its arguments and prints saved objects.
"""

from __future__ import annotations

import io
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from plugin import kubectl_plugin
from plugin.controller import fleetview, nodes, patches
from plugin.controller.breaker import Breaker, BreakerState, limit_for
from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from plugin.schema.annotations import desired_annotations
from tests.fakes.fake_apiserver import merge
from tests.fakes.node_devices import Node

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z
PREFIX = "gpu-health.io"
KEYS = nodes.Keys(PREFIX)
RESET = ('kubectl annotate lease -n gpu-health-system gpu-health-controller gpu-health.io/breaker-reset="$(date +%s)"'
         " --overwrite")

Doc = dict[str, Any]


def agent_node(name: str, bad: dict[int, tuple[State, str]] | None = None, gpus: int = 4) -> Doc:
    """A node as the node agent leaves it: its annotations, and the GPUs in capacity and allocatable."""
    node = Node(NodeState(), n=gpus)
    for i, (state, code) in (bad or {}).items():
        node.set(i, state, code, now=T0)
    node.publish(T0)
    ann = desired_annotations(node.state.snapshot(), {}).annotations
    return {"kind": "Node", "metadata": {"name": name, "resourceVersion": "1", "annotations": dict(ann)},
            "status": {"capacity": {"nvidia.com/gpu": str(gpus), "cpu": "64"},
                       "allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "63"}}}


def stock_node(name: str, capacity: int = 8, allocatable: int | None = None) -> Doc:
    """A node of the stock device plugin: no annotations of ours, only the kubelet's counts."""
    return {"kind": "Node", "metadata": {"name": name, "resourceVersion": "1"},
            "status": {"capacity": {"nvidia.com/gpu": str(capacity)},
                       "allocatable": {"nvidia.com/gpu": str(capacity if allocatable is None else allocatable)}}}


def quarantine(doc: Doc, reason: str, message: str, at: str, cordon: bool = False) -> Doc:
    """The node after the controller's own quarantine patch reached it."""
    patch = patches.quarantine(nodes.facts_of(doc, KEYS), KEYS, reason=reason, message=message, now=at,
                               cordon=cordon, label="")
    return dict(merge(doc, patch))


def lease(breaker: BreakerState | str | None = None, holder: str | None = "gpu-health-controller-7d9f-abcde",
          name: str = "gpu-health-controller", namespace: str = "gpu-health-system") -> Doc:
    meta: Doc = {"name": name, "namespace": namespace}
    if breaker is not None:
        meta["annotations"] = {KEYS.breaker: breaker if isinstance(breaker, str) else breaker.to_json()}
    spec: Doc = {"leaseDurationSeconds": 15, "renewTime": "2026-01-01T00:06:00.000000Z"}
    if holder is not None:
        spec["holderIdentity"] = holder
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}


def tripped(quarantined: int, candidates: int, gpu_nodes: int, at: str = "2026-01-01T00:05:00Z") -> BreakerState:
    b = Breaker(0.1)
    assert b.trip(at, quarantined, candidates, gpu_nodes)
    return b.state


def write(tmp_path: Path, name: str, doc: object) -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def node_list(*items: Doc) -> Doc:
    return {"apiVersion": "v1", "kind": "List", "items": list(items)}


@pytest.fixture()
def small_fleet() -> Doc:
    return node_list(
        quarantine(agent_node("gpu-b", {2: (State.UNHEALTHY, "xid-79")}), "reboot-required",
                   "gpu.2 asks for reboot-node (xid-79)", "2026-01-01T00:02:00Z", cordon=True),
        quarantine(agent_node("gpu-a", {1: (State.UNHEALTHY, "ecc-uncorrected")}), "unhealthy-devices",
                   "1 of 4 devices Unhealthy", "2026-01-01T00:02:00Z"),
        quarantine(stock_node("gpu-c", 8, 6), "capacity-gap", "2 of 8 GPUs not allocatable",
                   "2026-01-01T00:01:00Z"),
        # An operator's taint of our key, none of the controller's annotations.
        {**stock_node("gpu-d"), "spec": {"taints": [{"key": KEYS.taint, "value": "manual", "effect": "NoSchedule"}]}},
        agent_node("gpu-e", {0: (State.DEGRADED, "thermal-slowdown")}),
        agent_node("gpu-f"),
        stock_node("gpu-g", 8, 7),
        {"kind": "Node", "metadata": {"name": "cpu-1"}, "status": {"capacity": {"cpu": "16"}}},
    )


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = kubectl_plugin.main(["fleet", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def ok(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The output of a run that must succeed without a word on stderr."""
    rc, out, err = run(capsys, *argv)
    assert (rc, err) == (0, "")
    return out


def table(out: str) -> list[list[str]]:
    """The table's rows, split on the column gaps (cells themselves hold single spaces)."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("NODE "))
    return [[c.strip() for c in ln.split("   ") if c.strip()] for ln in lines[start:]]


def test_table_header_and_order(tmp_path: Path, small_fleet: Doc, capsys: pytest.CaptureFixture[str]) -> None:
    closed = Breaker(0.1)
    closed.settle("2026-01-01T00:00:30Z", 3, 0, 7)
    rc, out, err = run(capsys, "--from-file", str(write(tmp_path, "nodes.json", small_fleet)),
                       "--lease-file", str(write(tmp_path, "lease.json", lease(closed.state))))
    assert (rc, err) == (0, "")
    assert out.splitlines()[0] == ("GPU nodes: 7, quarantined by gpu-health-controller: 3 (42.9%, limit 14.3% = 1), "
                                   "breaker: closed, leader: gpu-health-controller-7d9f-abcde")
    # Oldest quarantine first, a tie broken by name; a taint without the controller's annotations last.
    assert table(out) == [
        ["NODE", "REASON", "SINCE", "COUNT", "OWNS", "MESSAGE"],
        ["gpu-c", "capacity-gap", "2026-01-01T00:01:00Z", "-", "taint", "2 of 8 GPUs not allocatable"],
        ["gpu-a", "unhealthy-devices", "2026-01-01T00:02:00Z", "-", "taint", "1 of 4 devices Unhealthy"],
        ["gpu-b", "reboot-required", "2026-01-01T00:02:00Z", "-", "taint,cordon",
         "gpu.2 asks for reboot-node (xid-79)"],
        ["gpu-d", "manual", "-", "-", "-", "(taint without controller annotations)"],
    ]
    lines = out.splitlines()
    start = lines.index(next(ln for ln in lines if ln.startswith("NODE ")))
    columns = [ln.index(h) for h in ("REASON", "SINCE", "COUNT", "OWNS", "MESSAGE") for ln in lines[start:start + 1]]
    for ln in lines[start + 1:]:  # aligned: every cell starts under its heading
        assert all(ln[c - 3:c] == "   " and ln[c] != " " for c in columns)


def test_all_adds_candidates_never_healthy_or_already_quarantined(tmp_path: Path, small_fleet: Doc,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--from-file", str(write(tmp_path, "nodes.json", small_fleet)), "--all")
    assert rc == 0
    rows = table(out)[1:]
    assert [r[0] for r in rows] == ["gpu-c", "gpu-a", "gpu-b", "gpu-d", "gpu-e", "gpu-g"]
    summary = agent_node("gpu-e", {0: (State.DEGRADED, "thermal-slowdown")})["metadata"]["annotations"][KEYS.summary]
    assert rows[4] == ["gpu-e", "candidate: Degraded", "-", "-", "-", summary]
    assert rows[5] == ["gpu-g", "candidate: capacity-gap", "-", "-", "-",
                       "1 of 8 GPUs not allocatable (capacity minus allocatable)"]
    # Without --all the same fleet shows no candidates.
    assert "candidate" not in ok(capsys, "--from-file", str(write(tmp_path, "nodes.json", small_fleet)))


def test_breaker_open_at_5000_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The correlated failure of the issue: 1,500 bad nodes of 5,000, quarantined up to the limit, the rest blocked."""
    limit = limit_for(0.1, 5000)
    fleet = [stock_node(f"gpu-{i:04d}") for i in range(5000)]
    for i in range(limit):
        fleet[i] = quarantine(stock_node(f"gpu-{i:04d}", 8, 0), "capacity-gap", "8 of 8 GPUs not allocatable",
                              f"2026-01-01T00:0{i % 5}:00Z")
    rc, out, _ = run(capsys, "--from-file", str(write(tmp_path, "nodes.json", node_list(*fleet))),
                     "--lease-file", str(write(tmp_path, "lease.json", lease(tripped(limit, 1000, 5000)))))
    assert rc == 0
    header, why = out.splitlines()[:2]
    assert header == ("GPU nodes: 5000, quarantined by gpu-health-controller: 500 (10.0%, limit 10.0% = 500), "
                      f"breaker: open since 2026-01-01T00:05:00Z (blocked 1000 candidates; reset: {RESET}), "
                      "leader: gpu-health-controller-7d9f-abcde")
    assert why == f"breaker reason: {tripped(limit, 1000, 5000).reason}"
    rows = table(out)[1:]
    assert len(rows) == 500
    # By time, then name: all of minute 0 first, by name.
    assert [r[0] for r in rows[:3]] == ["gpu-0000", "gpu-0005", "gpu-0010"]
    assert rows[-1][0] == "gpu-0499" and rows[-1][2] == "2026-01-01T00:04:00Z"


def test_reset_command_carries_the_kubectl_flags_and_is_one_shell_command() -> None:
    cmd = fleetview.reset_command("ops", "ctl", "example.com", ["--context", "prod east", "--kubeconfig", "/k"])
    words = shlex.split(cmd)
    assert words == ["kubectl", "annotate", "lease", "-n", "ops", "ctl", "example.com/breaker-reset=$(date +%s)",
                     "--overwrite", "--context", "prod east", "--kubeconfig", "/k"]


@pytest.mark.parametrize(("value", "expected"), [
    # What the controller writes when it opens, then again after the failure recedes.
    (tripped(1, 3, 7), "breaker: open since 2026-01-01T00:05:00Z (blocked 3 candidates; reset: "),
    ('{"state": "closed", "since": "2026-01-01T00:09:00Z"}', "breaker: closed since 2026-01-01T00:09:00Z"),
    # Missing keys are unknown, not an error: an older or newer controller still reads.
    ('{"state": "open"}', f"breaker: open (reset: {RESET})"),
    ('{"state": "open", "blocked": 1}', "breaker: open (blocked 1 candidate; reset: "),
    ('{"limit": 3}', "breaker: unknown (no state in the breaker annotation)"),
    ("{", "breaker: unreadable (gpu-health.io/breaker on lease gpu-health-system/gpu-health-controller: not JSON: "
          "Expecting property name enclosed in double quotes at line 1 column 2)"),
    ("[1, 2]", "breaker: unreadable (gpu-health.io/breaker on lease gpu-health-system/gpu-health-controller: "
               "expected a JSON object, got list)"),
    ('{"state": "half-open"}', "breaker: unreadable (gpu-health.io/breaker on lease "
                               "gpu-health-system/gpu-health-controller: state: expected 'open' or 'closed', "
                               "got 'half-open')"),
    ('{"state": "open", "limit": "ten"}', "limit: expected a count, got 'ten')"),
    ('{"state": "open", "blocked": true}', "blocked: expected a count, got True)"),
    ('{"state": "open", "since": 5}', "since: expected a string, got 5)"),
    (None, "breaker: closed (never opened: no gpu-health.io/breaker on lease gpu-health-system/gpu-health-controller)"),
])
def test_breaker_states(tmp_path: Path, small_fleet: Doc, capsys: pytest.CaptureFixture[str],
                        value: BreakerState | str | None, expected: str) -> None:
    rc, out, err = run(capsys, "--from-file", str(write(tmp_path, "nodes.json", small_fleet)),
                       "--lease-file", str(write(tmp_path, "lease.json", lease(value))))
    assert (rc, err) == (0, "")
    assert expected in out.splitlines()[0]
    assert out.splitlines()[0].endswith(", leader: gpu-health-controller-7d9f-abcde")


def test_breaker_closed_again_after_the_failure_receded(tmp_path: Path, small_fleet: Doc,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    b = Breaker(0.1)
    b.trip("2026-01-01T00:05:00Z", 1, 3, 7)
    assert b.settle("2026-01-01T00:20:00Z", 1, 0, 7)
    doc = json.loads(ok(capsys, "--from-file", str(write(tmp_path, "nodes.json", small_fleet)), "-o", "json",
                        "--lease-file", str(write(tmp_path, "lease.json", lease(b.state, holder=None)))))
    assert doc["breaker"] == {"state": "closed", "since": "2026-01-01T00:20:00Z", "limit": 1, "gpuNodes": 7,
                              "quarantined": 1, "blocked": 0, "reason": b.state.reason, "detail": None}
    assert doc["lease"]["holder"] is None
    out = ok(capsys, "--from-file", str(write(tmp_path, "nodes.json", small_fleet)),
             "--lease-file", str(write(tmp_path, "lease.json", lease(b.state, holder=None))))
    assert out.splitlines()[0].endswith("breaker: closed since 2026-01-01T00:20:00Z, leader: none")
    assert out.splitlines()[1] == f"breaker reason: {b.state.reason}"


def test_missing_lease(tmp_path: Path, small_fleet: Doc, capsys: pytest.CaptureFixture[str]) -> None:
    nodes_file = str(write(tmp_path, "nodes.json", small_fleet))
    # What `kubectl get lease ... --ignore-not-found -o json` prints for a Lease that is not there: nothing.
    rc, out, err = run(capsys, "--from-file", nodes_file, "--lease-file", str(write(tmp_path, "lease.json", "")),
                       "--namespace", "ops", "--lease", "ctl")
    assert (rc, err) == (0, "")
    assert out.splitlines()[0] == ("GPU nodes: 7, quarantined by gpu-health-controller: 3 (42.9%), "
                                   "breaker: unknown (no lease ops/ctl: controller not deployed?)")
    out = ok(capsys, "--from-file", nodes_file, "--lease-file", str(write(tmp_path, "lease.json", node_list())))
    assert "breaker: unknown (no lease gpu-health-system/gpu-health-controller: controller not deployed?)" in out
    # Saved nodes and no saved Lease: offline stays offline, and says so.
    assert ok(capsys, "--from-file", nodes_file).splitlines()[0].endswith(
        "breaker: unknown (lease gpu-health-system/gpu-health-controller not read: nodes from --from-file, "
        "no --lease-file)")


def test_json_is_the_same_data(tmp_path: Path, small_fleet: Doc, capsys: pytest.CaptureFixture[str]) -> None:
    state = tripped(3, 2, 7)
    args = ("--from-file", str(write(tmp_path, "nodes.json", small_fleet)),
            "--lease-file", str(write(tmp_path, "lease.json", lease(state))), "--all")
    text_out = ok(capsys, *args)
    doc = json.loads(ok(capsys, *args, "-o", "json"))
    assert {k: doc[k] for k in ("controller", "gpuNodes", "quarantined", "reset")} == {
        "controller": "gpu-health-controller", "gpuNodes": 7, "quarantined": 3, "reset": RESET}
    assert doc["lease"] == {"namespace": "gpu-health-system", "name": "gpu-health-controller", "found": True,
                            "holder": "gpu-health-controller-7d9f-abcde", "renewTime": "2026-01-01T00:06:00.000000Z"}
    assert doc["breaker"] == {"state": "open", "since": state.since, "limit": state.limit, "gpuNodes": 7,
                              "quarantined": 3, "blocked": 2, "reason": state.reason, "detail": None}
    assert doc["nodes"][1] == {"node": "gpu-a", "status": "quarantined", "reason": "unhealthy-devices",
                               "since": "2026-01-01T00:02:00Z", "owns": ["taint"],
                               "message": "1 of 4 devices Unhealthy", "taints": ["NoSchedule"], "quarantines": 0,
                               "quarantineHistory": [], "repeatOffender": False, "releaseRequested": None}
    assert doc["nodes"][3]["status"] == "taint-only" and doc["nodes"][4]["status"] == "candidate"
    # The rows of the table, in the same order.
    assert [n["node"] for n in doc["nodes"]] == [r[0] for r in table(text_out)[1:]]


def test_gpu_nodes_and_gaps_as_the_controller_counts_them() -> None:
    """The view's count must be the controller's, or the percentage and the limit disagree."""
    docs: list[Doc] = [
        agent_node("a"), stock_node("b", 8, 5), stock_node("zero", 0),
        {"kind": "Node", "metadata": {"name": "mig"}, "status": {"capacity": {"nvidia.com/mig-1g.10gb": "7"},
                                                                 "allocatable": {"nvidia.com/mig-1g.10gb": "6"}}},
        {"kind": "Node", "metadata": {"name": "shared"}, "status": {"capacity": {"nvidia.com/gpu.shared": "16"}}},
        {"kind": "Node", "metadata": {"name": "odd"}, "status": {"capacity": {"nvidia.com/gpu": "1k"}}},
        {"kind": "Node", "metadata": {"name": "withdrawn", "annotations": {KEYS.state: "Unknown"}},
         "status": {"capacity": {"nvidia.com/gpu": "0"}}},
        {"kind": "Node", "metadata": {"name": "bare"}},
    ]
    for d in docs:
        facts = nodes.facts_of(d, KEYS)
        assert fleetview.is_gpu_node(d, PREFIX) == facts.is_gpu_node, d["metadata"]["name"]
        assert fleetview.capacity_gap(d) == max(0, facts.gpu_capacity - facts.gpu_allocatable)
    assert [d["metadata"]["name"] for d in docs if fleetview.is_gpu_node(d)] == [
        "a", "b", "mig", "shared", "withdrawn"]


def test_a_quarantined_node_without_gpus_still_counts_as_the_controller_counts_it() -> None:
    gone = quarantine(stock_node("gone", 8, 6), "capacity-gap", "2 of 8 GPUs not allocatable", "2026-01-01T00:01:00Z")
    gone["status"] = {"capacity": {"cpu": "8"}}  # the device plugin went away after the quarantine
    view = fleetview.fleet([gone, stock_node("b")], None)
    assert (view.gpu_nodes, view.quarantined) == (2, 1)


def test_times_that_do_not_parse_sort_after_those_that_do() -> None:
    def q(name: str, at: str) -> Doc:
        return {"kind": "Node", "metadata": {"name": name, "annotations": {
            KEYS.by: nodes.CONTROLLER, KEYS.at: at, KEYS.message: "two\nlines"}}}

    rows = fleetview.rows([q("n1", "soon"), q("n2", "2026-01-01T01:00:00+01:00"), q("n3", "2026-01-01T00:30:00Z"),
                           q("n4", "")])
    assert [(r.node, r.since) for r in rows] == [
        ("n2", "2026-01-01T01:00:00+01:00"), ("n3", "2026-01-01T00:30:00Z"), ("n1", "soon"), ("n4", None)]
    assert rows[0].message == "two lines"  # one line per row


def test_empty_fleet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--from-file", str(write(tmp_path, "nodes.json", node_list(agent_node("gpu-a")))),
                     "--lease-file", str(write(tmp_path, "lease.json", lease())), "--all")
    assert rc == 0
    assert out.splitlines()[2:] == ["No nodes quarantined by gpu-health-controller and no candidates."]


def fake_kubectl(tmp_path: Path, nodes_doc: object, lease_out: str, lease_rc: int = 0,
                 lease_err: str = "") -> tuple[Path, Path]:
    """A stand-in kubectl: records each call's arguments, prints the nodes or the Lease."""
    fake, record = tmp_path / "kubectl", tmp_path / "calls.jsonl"
    nodes_file = write(tmp_path, "served-nodes.json", nodes_doc)
    lease_file = write(tmp_path, "served-lease.json", lease_out)
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "if sys.argv[2] == 'nodes':\n"
        f"    sys.stdout.write(open({str(nodes_file)!r}).read()); sys.exit(0)\n"
        f"sys.stdout.write(open({str(lease_file)!r}).read())\n"
        f"sys.stderr.write({lease_err!r})\n"
        f"sys.exit({lease_rc})\n")
    fake.chmod(0o755)
    return fake, record


def calls(record: Path) -> list[list[str]]:
    return [json.loads(ln) for ln in record.read_text().splitlines()]


def test_runs_kubectl_for_nodes_and_lease(tmp_path: Path, small_fleet: Doc,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    fake, record = fake_kubectl(tmp_path, small_fleet, json.dumps(lease(tripped(3, 2, 7), namespace="ops")))
    rc, out, err = run(capsys, "--kubectl", str(fake), "--context", "prod", "--kubeconfig", "/etc/k.conf",
                       "--namespace", "ops", "--lease", "ctl")
    assert (rc, err) == (0, "")
    assert calls(record) == [
        ["get", "nodes", "-o", "json", "--kubeconfig", "/etc/k.conf", "--context", "prod"],
        ["get", "lease", "-n", "ops", "ctl", "-o", "json", "--ignore-not-found", "--kubeconfig", "/etc/k.conf",
         "--context", "prod"]]
    assert ('reset: kubectl annotate lease -n ops ctl gpu-health.io/breaker-reset="$(date +%s)" --overwrite '
            "--kubeconfig /etc/k.conf --context prod)") in out.splitlines()[0]
    assert [r[0] for r in table(out)[1:]] == ["gpu-c", "gpu-a", "gpu-b", "gpu-d"]


def test_lease_not_found_or_not_readable_through_kubectl(tmp_path: Path, small_fleet: Doc,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    fake, _ = fake_kubectl(tmp_path, small_fleet, "")
    rc, out, _ = run(capsys, "--kubectl", str(fake))
    assert rc == 0
    assert "breaker: unknown (no lease gpu-health-system/gpu-health-controller: controller not deployed?)" in out
    # Someone who may list nodes but not read Leases still gets the table.
    denied = ('Error from server (Forbidden): leases.coordination.k8s.io "gpu-health-controller" is forbidden: '
              'User "dev" cannot get resource "leases"\n')
    fake, _ = fake_kubectl(tmp_path, small_fleet, "", lease_rc=1, lease_err=denied)
    rc, out, _ = run(capsys, "--kubectl", str(fake))
    assert rc == 0
    assert f"breaker: unknown (kubectl get lease failed: {denied.strip()})" in out.splitlines()[0]
    assert len(table(out)) == 5


def test_nodes_not_readable_through_kubectl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = tmp_path / "kubectl"
    fake.write_text("#!/bin/sh\necho 'error: You must be logged in to the server (Unauthorized)' >&2\nexit 1\n")
    fake.chmod(0o755)
    rc, out, err = run(capsys, "--kubectl", str(fake))
    assert (rc, out) == (1, "")
    assert err == "kubectl gpu-health fleet: kubectl get nodes failed: error: You must be logged in to the server " \
                  "(Unauthorized)\n"


@pytest.mark.parametrize(("which", "text", "message"), [
    ("nodes", '{"kind": "List", "items": [', "not a JSON node list: Expecting value at line 1 column 28"),
    ("nodes", '{"items": 5}', "not a node list: 'items' is not a list"),
    ("lease", '{"kind": "Lease",', "not a JSON Lease: Expecting property name enclosed in double quotes at line 1 "
                                   "column 18"),
    ("lease", '{"kind": "Node", "metadata": {}}', "not a Lease: kind 'Node'"),
    ("lease", "[]", "not a Lease: kind 'list'"),
])
def test_bad_input_names_which_input(tmp_path: Path, small_fleet: Doc, capsys: pytest.CaptureFixture[str],
                                     which: str, text: str, message: str) -> None:
    nodes_file = write(tmp_path, "nodes.json", text if which == "nodes" else json.dumps(small_fleet))
    lease_file = write(tmp_path, "lease.json", text if which == "lease" else json.dumps(lease()))
    rc, out, err = run(capsys, "--from-file", str(nodes_file), "--lease-file", str(lease_file))
    flag, path = ("--from-file", nodes_file) if which == "nodes" else ("--lease-file", lease_file)
    assert (rc, out) == (2, "")
    assert err == f"kubectl gpu-health fleet: {flag} {path}: {message}\n"


def test_bad_lease_from_kubectl_and_from_stdin_are_named(tmp_path: Path, small_fleet: Doc,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    fake, _ = fake_kubectl(tmp_path, small_fleet, "<html>")
    rc, _, err = run(capsys, "--kubectl", str(fake))
    assert rc == 2
    assert err == (f"kubectl gpu-health fleet: {fake} get lease -n gpu-health-system gpu-health-controller -o json: "
                   "not a JSON Lease: Expecting value at line 1 column 1\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("nope"))
    rc, _, err = run(capsys, "--from-file", str(write(tmp_path, "nodes.json", small_fleet)), "--lease-file", "-")
    assert rc == 2 and err.startswith("kubectl gpu-health fleet: --lease-file -: stdin: not a JSON Lease: ")


@pytest.mark.parametrize(("argv", "message"), [
    (["--lease-file", "MISSING"], "--lease-file {tmp}/missing.json: cannot read: "),
    (["--from-file", "-", "--lease-file", "-"], "--lease-file -: stdin is already read by --from-file -"),
    (["--namespace", "Ops_1"], "--namespace: expected a namespace name (a lower-case DNS label), got 'Ops_1'"),
    (["--namespace", "a.b"], "--namespace: expected a namespace name (a lower-case DNS label), got 'a.b'"),
    (["--lease", "Bad Name"], "--lease: expected a Lease name (a lower-case DNS subdomain), got 'Bad Name'"),
    (["--prefix", "k8s.io"], "'k8s.io' is reserved for Kubernetes itself; use a domain you own"),
])
def test_bad_flags_exit_2_in_one_line(tmp_path: Path, small_fleet: Doc, capsys: pytest.CaptureFixture[str],
                                      argv: Sequence[str], message: str) -> None:
    nodes_file = str(write(tmp_path, "nodes.json", small_fleet))
    argv = [str(tmp_path / "missing.json") if a == "MISSING" else a for a in argv]
    rc, out, err = run(capsys, *(["--from-file", nodes_file] if "--from-file" not in argv else []), *argv)
    assert (rc, out) == (2, "")
    assert err.startswith(f"kubectl gpu-health fleet: {message.format(tmp=tmp_path)}")
    assert len(err.splitlines()) == 1


def test_default_view_is_unchanged(tmp_path: Path, small_fleet: Doc, capsys: pytest.CaptureFixture[str]) -> None:
    """Quarantined nodes still show their devices in the default view, which knows nothing of fleet flags."""
    nodes_file = str(write(tmp_path, "nodes.json", small_fleet))
    assert kubectl_plugin.main(["--from-file", nodes_file, "--state", "Unhealthy"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split() == ["NODE", "DEVICE", "ID", "STATE", "ACTION", "SINCE", "REASONS"]
    assert [ln.split()[:2] for ln in lines[1:]] == [["gpu-a", "gpu.1"], ["gpu-b", "gpu.2"]]
    assert err == ""
    # Bad JSON in the default view keeps its exit status 1.
    assert kubectl_plugin.main(["--from-file", str(write(tmp_path, "bad.json", "{"))]) == 1
    capsys.readouterr()
    # `fleet` is a word only in first place; elsewhere the default view's parser refuses it as it always did.
    with pytest.raises(SystemExit) as exit_:
        kubectl_plugin.main(["--from-file", nodes_file, "fleet"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: fleet" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kubectl_plugin.main(["--from-file", nodes_file, "--all"])
    assert "unrecognized arguments: --all" in capsys.readouterr().err
