"""Our NVSentinel protos (api/nvsentinel) against NVSentinel's own descriptors, recorded in nvsentinel/wire.json:
every message, field, enum value and method we declare must be theirs, with the same number, type, label and
streaming, or NVSentinel misreads what we send. We may declare less than they do (an unknown field is skipped by
the decoder); never something else. No Go needed: the record is committed, the Go peer is generated from ours.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor

from api.nvsentinel.deviceapi.v1alpha1 import gpu_pb2
from api.nvsentinel.platformconnector import health_event_pb2

pytestmark = pytest.mark.conformance

WIRE = Path(__file__).resolve().parent / "nvsentinel" / "wire.json"
OURS = {"datamodels": health_event_pb2.DESCRIPTOR, "nvidia.device.v1alpha1": gpu_pb2.DESCRIPTOR}
T = descriptor_pb2.FieldDescriptorProto
Shape = dict[str, Any]


def _messages(messages: Any, prefix: str, out: Shape) -> Shape:
    for m in messages:
        name = prefix + m.name
        out[name] = {f.name: {"number": f.number, "type": T.Type.Name(f.type), "label": T.Label.Name(f.label),
                              "typeName": f.type_name} for f in m.field}
        _messages(m.nested_type, name + ".", out)
    return out


def shape(descriptor: FileDescriptor) -> Shape:
    """What of one of our files reaches the wire, in wire.json's form."""
    fd = descriptor_pb2.FileDescriptorProto()
    descriptor.CopyToProto(fd)
    return {
        "package": fd.package,
        "messages": _messages(fd.message_type, "", {}),
        "enums": {e.name: {v.name: v.number for v in e.value} for e in fd.enum_type},
        "services": {s.name: {m.name: {"input": m.input_type, "output": m.output_type,
                                       "clientStreaming": m.client_streaming, "serverStreaming": m.server_streaming}
                              for m in s.method} for s in fd.service},
    }


def differences(ours: Shape, theirs: Shape) -> list[str]:
    """Everything we declare that theirs lacks or declares otherwise (empty: we are a part of theirs)."""
    out: list[str] = []
    for kind in ("messages", "enums", "services"):
        for name, members in ours[kind].items():
            if name not in theirs[kind]:
                out.append(f"{kind[:-1]} {name}: not in NVSentinel's")
                continue
            for member, facts in members.items():
                their = theirs[kind][name].get(member)
                if their != facts:
                    out.append(f"{name}.{member}: ours {facts}, theirs {their}")
    return out


@pytest.fixture(scope="module")
def wire() -> Shape:
    doc: Shape = json.loads(WIRE.read_text())
    return doc["packages"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("package", sorted(OURS))
def test_what_we_declare_is_nvsentinels_on_the_wire(wire: Shape, package: str) -> None:
    ours = shape(OURS[package])
    assert ours["package"] == package and package in wire
    assert differences(ours, wire[package]) == []
    source = wire[package]["source"]
    assert source["repo"] and len(source["commit"]) == 40 and source["path"].endswith(".proto")


def test_the_record_covers_the_calls_the_plugin_makes(wire: Shape) -> None:
    # Guards against a record trimmed down to agree with us: these are the calls and values the sender and the
    # device-API client put on the wire.
    assert wire["datamodels"]["services"]["PlatformConnector"]["HealthEventOccurredV1"]["input"] == \
        ".datamodels.HealthEvents"
    assert wire["datamodels"]["enums"]["ProcessingStrategy"]["STORE_ONLY"] == 2
    assert wire["datamodels"]["enums"]["RecommendedAction"]["RESTART_BM"] == 24
    methods = wire["nvidia.device.v1alpha1"]["services"]["GpuService"]
    assert methods["WatchGpus"]["serverStreaming"] is True
    assert {"CreateGpu", "UpdateGpuStatus", "ListGpus", "WatchGpus"} <= set(methods)


@pytest.mark.parametrize("mutate, expected", [
    (lambda t: t["messages"]["HealthEvent"]["nodeName"].update(number=12), "HealthEvent.nodeName"),
    (lambda t: t["messages"]["HealthEvent"]["errorCode"].update(label="LABEL_OPTIONAL"), "HealthEvent.errorCode"),
    (lambda t: t["enums"]["RecommendedAction"].pop("RESTART_BM"), "RecommendedAction.RESTART_BM"),
    (lambda t: t["messages"].pop("Entity"), "message Entity"),
    (lambda t: t["services"]["PlatformConnector"]["HealthEventOccurredV1"].update(serverStreaming=True),
     "PlatformConnector.HealthEventOccurredV1"),
])
def test_a_wire_difference_is_reported(wire: Shape, mutate: Any, expected: str) -> None:
    theirs = copy.deepcopy(wire["datamodels"])
    mutate(theirs)
    found = differences(shape(OURS["datamodels"]), theirs)
    assert len(found) == 1 and found[0].startswith(expected), found
