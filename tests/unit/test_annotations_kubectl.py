"""``kubectl gpu-health`` on node lists carrying annotations written by the real schema code."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plugin import kubectl_plugin
from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from plugin.schema.annotations import desired_annotations
from tests.fakes.node_devices import Node

T0 = 1_767_225_600.0


def node_doc(name: str, bad: dict[int, tuple[State, str]] | None = None) -> dict[str, object]:
    node = Node(NodeState(), n=4)
    for i, (state, code) in (bad or {}).items():
        node.set(i, state, code, now=T0)
    node.publish(T0)
    ann = desired_annotations(node.state.snapshot(), {}).annotations
    return {"kind": "Node", "metadata": {"name": name, "annotations": {**ann, "example.com/x": "y"}}}


@pytest.fixture()
def nodes_file(tmp_path: Path) -> Path:
    doc = {"kind": "List", "items": [node_doc("gpu-b", {2: (State.UNHEALTHY, "xid-79")}),
                                     node_doc("gpu-a", {0: (State.DEGRADED, "thermal-slowdown")}),
                                     {"kind": "Node", "metadata": {"name": "cpu-1", "annotations": {}}},
                                     # a GPU node whose agent writes nothing (not deployed there, or failing)
                                     {"kind": "Node", "metadata": {"name": "gpu-c"},
                                      "status": {"capacity": {"cpu": "64", "nvidia.com/gpu": "8"}}}]}
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps(doc))
    return path


def test_table_lists_every_device_sorted_with_reasons(nodes_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kubectl_plugin.main(["--from-file", str(nodes_file)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split() == ["NODE", "DEVICE", "ID", "STATE", "ACTION", "SINCE", "REASONS"]
    assert [ln.split()[:2] for ln in lines[1:]] == [[n, f"gpu.{i}"] for n in ("gpu-a", "gpu-b") for i in range(4)]
    bad = next(ln for ln in lines if ln.startswith("gpu-b") and "Unhealthy" in ln)
    assert "reboot-node" in bad and "xid-79: XID 79: GPU has fallen off the bus" in bad
    # The CPU node is no GPU node: not named unless asked for.
    assert err.strip() == ("1 node(s) without gpu-health.io annotations but with GPU capacity (is the agent running "
                           "there?): gpu-c")


def test_filters_by_node_glob_and_state(nodes_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kubectl_plugin.main(["--from-file", str(nodes_file), "--state", "unhealthy,Degraded", "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(d["node"], d["device"], d["state"]) for d in doc["devices"]] == [
        ("gpu-a", "gpu.0", "Degraded"), ("gpu-b", "gpu.2", "Unhealthy")]
    assert kubectl_plugin.main(["--from-file", str(nodes_file), "--node", "gpu-b", "--state", "Degraded"]) == 0
    assert capsys.readouterr().out.strip() == "No matching GPU devices."
    assert kubectl_plugin.main(["--from-file", str(nodes_file), "--node", "gpu-a*", "-o", "json"]) == 0
    assert {d["node"] for d in json.loads(capsys.readouterr().out)["devices"]} == {"gpu-a"}


def test_bad_state_is_named(nodes_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kubectl_plugin.main(["--from-file", str(nodes_file), "--state", "Broken"]) == 1
    assert "--state: expected one of Healthy, Degraded, Unknown, Unhealthy, got 'Broken'" in capsys.readouterr().err


def test_runs_kubectl_with_the_given_flags(tmp_path: Path, nodes_file: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A stand-in kubectl (the edge) records its arguments and prints the node list."""
    fake = tmp_path / "kubectl"
    record = tmp_path / "args.json"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"json.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n"
                    f"sys.stdout.write(open({str(nodes_file)!r}).read())\n")
    fake.chmod(0o755)
    assert kubectl_plugin.main(["--kubectl", str(fake), "--context", "prod", "-l", "gpu=true", "-s", "Unhealthy"]) == 0
    assert json.loads(record.read_text()) == ["get", "nodes", "-o", "json", "-l", "gpu=true", "--context", "prod"]
    assert "gpu.2" in capsys.readouterr().out
    fake.write_text("#!/bin/sh\necho 'error: You must be logged in to the server (Unauthorized)' >&2\nexit 1\n")
    assert kubectl_plugin.main(["--kubectl", str(fake)]) == 1
    assert "kubectl get nodes failed: error: You must be logged in" in capsys.readouterr().err


@pytest.mark.parametrize("text", ['{"kind": "List", "items": [', '{\n  "kind": x}'])
def test_bad_json_names_the_input_and_the_position(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str], text: str) -> None:
    with pytest.raises(json.JSONDecodeError) as bad:  # where json itself places the error
        json.loads(text)
    position = f"line {bad.value.lineno} column {bad.value.colno}"
    saved = tmp_path / "nodes.json"
    saved.write_text(text)
    assert kubectl_plugin.main(["--from-file", str(saved)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kubectl gpu-health: --from-file {saved}: ") and position in err
    assert len(err.splitlines()) == 1
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert kubectl_plugin.main(["--from-file", "-"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kubectl gpu-health: --from-file -: stdin: ") and position in err


def test_unreadable_or_odd_inputs_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.json"
    assert kubectl_plugin.main(["--from-file", str(missing)]) == 1
    assert f"--from-file {missing}: cannot read" in capsys.readouterr().err
    binary = tmp_path / "nodes.bin"
    binary.write_bytes(b"\xff\xfe\x00{")
    assert kubectl_plugin.main(["--from-file", str(binary)]) == 1
    assert f"--from-file {binary}: cannot read" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"items": 5}'))
    assert kubectl_plugin.main(["--from-file", "-"]) == 1
    assert "--from-file -: stdin: not a node list" in capsys.readouterr().err


def test_a_value_nested_past_the_bound_is_left_out_and_named_not_a_crash(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # Before: json.loads raised RecursionError and the command died with a traceback (issue 35, 1).
    bad = node_doc("gpu-b")
    bad["metadata"]["annotations"]["gpu-health.io/gpu.3"] = "[" * 1000 + "]" * 1000  # type: ignore[index]
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps({"kind": "List", "items": [bad, node_doc("gpu-a")]}))
    assert kubectl_plugin.main(["--from-file", str(path)]) == 0
    out, err = capsys.readouterr()
    assert [ln.split()[:2] for ln in out.splitlines()[1:]] == [
        *([["gpu-a", f"gpu.{i}"] for i in range(4)]), *([["gpu-b", f"gpu.{i}"] for i in range(3)])]
    assert "gpu-b: gpu-health.io/gpu.3: nested deeper than 8 levels" in err, err


def test_all_nodes_names_the_nodes_without_gpus_too_and_never_an_empty_name(
        tmp_path: Path, nodes_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kubectl_plugin.main(["--from-file", str(nodes_file), "--all-nodes"]) == 0
    assert capsys.readouterr().err.strip() == "2 node(s) without gpu-health.io annotations: cpu-1, gpu-c"
    nameless = tmp_path / "nameless.json"
    nameless.write_text(json.dumps({"kind": "List", "items": [
        {"kind": "Node", "metadata": {}, "status": {"capacity": {"nvidia.com/gpu": "4"}}},
        {"kind": "Node", "metadata": {"name": "cpu-1"}}]}))
    assert kubectl_plugin.main(["--from-file", str(nameless), "--all-nodes"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "No matching GPU devices with health annotations."
    assert err.strip() == "2 node(s) without gpu-health.io annotations: <no name>, cpu-1"
    assert kubectl_plugin.main(["--from-file", str(nameless), "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["nodesWithoutData"] == ["<no name>"]


def test_dash_n_is_kubectls_namespace_ignored_for_nodes_and_node_still_picks(
        nodes_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # -n once meant --node: now it is what every kubectl user types it for, taken and ignored (nodes have no
    # namespace), and said so, since ignoring it silently would hide that it no longer picks a node.
    assert kubectl_plugin.main(["--from-file", str(nodes_file), "-n", "gpu-a", "-o", "json"]) == 0
    out, err = capsys.readouterr()
    assert {d["node"] for d in json.loads(out)["devices"]} == {"gpu-a", "gpu-b"}
    assert err.splitlines()[0] == ("kubectl gpu-health: -n/--namespace gpu-a ignored: nodes are not namespaced "
                                   "(--node NAME picks nodes)")
    assert kubectl_plugin.main(["--from-file", str(nodes_file), "--node", "gpu-a", "-o", "json"]) == 0
    assert {d["node"] for d in json.loads(capsys.readouterr().out)["devices"]} == {"gpu-a"}
    # In the fleet view -n is what it means there: the namespace of the controller's Lease.
    assert kubectl_plugin.build_fleet_parser().parse_args(["-n", "ops"]).namespace == "ops"


def test_a_node_name_that_matches_nothing_is_an_error(nodes_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kubectl_plugin.main(["--from-file", str(nodes_file), "--node", "gpu-z"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == "kubectl gpu-health: no node matches --node gpu-z\n"
    # One of two names that matches nothing is as much a typo.
    assert kubectl_plugin.main(["--from-file", str(nodes_file), "--node", "gpu-a", "--node", "gpu-*x"]) == 1
    assert capsys.readouterr().err == "kubectl gpu-health: no node matches --node gpu-*x\n"


def test_into_a_closed_pipe_it_exits_quietly(nodes_file: Path) -> None:
    """`kubectl gpu-health | head -1` once head has its line: the reader is gone before the table is written."""
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([sys.executable, "-m", "plugin.kubectl_plugin", "--from-file", str(nodes_file)],
                              stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr and "Exception ignored" not in proc.stderr
