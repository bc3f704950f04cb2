"""Our gRPC protos against the kubelet's own descriptors: every package, service, method, message, field (name,
number, type, label) and enum value of api/*/*.proto must be the kubelet's, or the kubelet and the plugin do not
understand each other on the wire.

tests/conformance/protowire (Go, k8s.io/kubelet at KUBELET_API_VERSION) prints the kubelet's FileDescriptorProtos;
the comparison ignores what never reaches the wire (comments, options, JSON names, file names). The APIs we own
completely (the DRA driver's) must be equal; for the two older ones we only need part of (the device-plugin and
PodResources APIs) ours must be a part of the kubelet's: a field we lack is skipped by the decoder, a field we
have with another number or type is a bug. Without Go the test skips, except with CI=true.
"""

from __future__ import annotations

import importlib
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, json_format

from tests.conformance.skips import build_or_skip

HERE = Path(__file__).resolve().parent
KUBELET_API_VERSION = "v0.37.2"

# kubelet API -> (our generated module, whether ours must be all of it)
APIS = {
    "deviceplugin/v1beta1": ("api.deviceplugin.v1beta1.api_pb2", False),
    "podresources/v1": ("api.podresources.v1.api_pb2", False),
    "pluginregistration/v1": ("api.pluginregistration.v1.api_pb2", True),
    "dra/v1": ("api.dra.v1.api_pb2", True),
    "dra/v1beta1": ("api.dra.v1beta1.api_pb2", True),
    "dra-health/v1": ("api.drahealth.v1.api_pb2", True),
    "dra-health/v1alpha1": ("api.drahealth.v1alpha1.api_pb2", True),
}

Shape = dict[str, Any]


def _fields(message: Shape) -> dict[str, Shape]:
    return {f["name"]: {k: f.get(k) for k in ("number", "type", "label", "typeName", "proto3Optional")}
            for f in message.get("field", [])}


def _messages(messages: list[Shape], prefix: str) -> dict[str, Shape]:
    """Every message (nested ones and map entries too) by full name, with its fields."""
    out: dict[str, Shape] = {}
    for m in messages:
        name = f"{prefix}.{m['name']}"
        out[name] = _fields(m)
        out.update(_messages(m.get("nestedType", []), name))
    return out


def shape(fd: Shape) -> Shape:
    """What of a FileDescriptorProto (as protojson) reaches the wire."""
    prefix = "." + fd.get("package", "")
    enums = {f"{prefix}.{e['name']}": {v["name"]: v["number"] for v in e.get("value", [])}
             for e in fd.get("enumType", [])}
    methods = {f"{s['name']}/{m['name']}": {"in": m["inputType"], "out": m["outputType"],
                                          "client_streaming": bool(m.get("clientStreaming")),
                                          "server_streaming": bool(m.get("serverStreaming"))}
               for s in fd.get("service", []) for m in s.get("method", [])}
    return {"package": fd.get("package", ""), "enums": enums, "methods": methods,
            "messages": _messages(fd.get("messageType", []), prefix)}


def ours(module: str) -> Shape:
    fd = descriptor_pb2.FileDescriptorProto.FromString(importlib.import_module(module).DESCRIPTOR.serialized_pb)
    return shape(json_format.MessageToDict(fd))


def not_in(part: Shape, whole: Shape, path: str = "") -> list[str]:
    """Where ``part`` has something ``whole`` lacks or has otherwise."""
    if isinstance(part, dict) and isinstance(whole, dict):
        out = []
        for k, v in part.items():
            where = f"{path}.{k}" if path else str(k)
            out += [f"{where}: ours only"] if k not in whole else not_in(v, whole[k], where)
        return out
    return [] if part == whole else [f"{path}: ours {part!r}, the kubelet's {whole!r}"]


@pytest.fixture(scope="module")
def kubelet_apis() -> dict[str, Shape]:
    exe = build_or_skip(HERE / "protowire", ".", "protowire", {"CGO_ENABLED": "0"}, version=KUBELET_API_VERSION)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True).stdout
    return {name: shape(fd) for name, fd in json.loads(out).items()}


@pytest.mark.conformance
@pytest.mark.parametrize("api", APIS)
def test_our_proto_speaks_the_kubelets_wire_contract(kubelet_apis: dict[str, Shape], api: str) -> None:
    module, complete = APIS[api]
    mine, theirs = ours(module), kubelet_apis[api]
    problems = not_in(mine, theirs)
    if complete:
        problems += [f"{p.split(':')[0]}: the kubelet's only" for p in not_in(theirs, mine)]
    assert not problems, f"{api} ({module}) differs from k8s.io/kubelet {KUBELET_API_VERSION}:\n  " + \
        "\n  ".join(problems)
    assert mine["methods"], "no service compared"


@pytest.mark.conformance
def test_the_comparison_finds_a_renumbered_field(kubelet_apis: dict[str, Shape]) -> None:
    # Guards the test above: a field with another number, a missing field and another package are all reported.
    theirs = kubelet_apis["dra/v1"]
    mine = json.loads(json.dumps(ours("api.dra.v1.api_pb2")))
    mine["messages"][".k8s.io.kubelet.pkg.apis.dra.v1.Device"]["pool_name"]["number"] = 7
    del mine["messages"][".k8s.io.kubelet.pkg.apis.dra.v1.Claim"]["uid"]
    mine["package"] = "dra.v1"
    problems = not_in(mine, theirs) + not_in(theirs, mine)
    assert any("Device.pool_name.number: ours 7, the kubelet's 2" in p for p in problems), problems
    assert any("Claim.uid" in p and "ours only" in p for p in problems), problems
    assert any(p.startswith("package:") for p in problems), problems
