"""``kubectl gpu-health`` on node lists carrying annotations written by the real schema code."""

from __future__ import annotations

import io
import json
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
                                     {"kind": "Node", "metadata": {"name": "cpu-1", "annotations": {}}}]}
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
    assert "1 node(s) without gpu-health.io annotations: cpu-1" in err


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
