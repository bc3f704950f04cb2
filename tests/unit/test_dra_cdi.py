"""CDI specs of prepared DRA claims: the spec a runtime reads (names, version, edits) and its atomic file."""

from __future__ import annotations

import json
import os
import re
import stat
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugin.dra import cdi

UID = "0f6c3e1a-7d2b-4c55-9a8e-2b1d3c4e5f60"  # starts with a digit, as UIDs often do
GPUS = [cdi.CdiGpu(device="gpu-3", uuid="GPU-3333", minor=3), cdi.CdiGpu(device="gpu-1", uuid="GPU-1111", minor=1)]

# The CDI spec's own rules, written out here rather than taken from the module under test: a kind is
# "<vendor>/<class>" (vendor a DNS subdomain, class alphanumerics with - _ . inside), a device name alphanumerics
# with - _ . inside; a name starting with a digit and hostPath on a device node both need spec 0.5.0.
VENDOR = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
CLASS = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
DEVICE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?")


def version(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


def test_spec_names_every_gpu_of_the_claim_in_claim_order() -> None:
    spec = cdi.build_spec(UID, GPUS, "/host/dev", exists=lambda p: False)
    assert spec["kind"] == "gpu.gpu-health.io/gpu" == cdi.KIND
    vendor, cls = spec["kind"].split("/")
    assert VENDOR.fullmatch(vendor) and CLASS.fullmatch(cls)
    assert (0, 5, 0) <= version(spec["cdiVersion"]) <= (0, 8, 0)
    assert [d["name"] for d in spec["devices"]] == [f"{UID}-gpu-3", f"{UID}-gpu-1"]
    assert all(DEVICE_NAME.fullmatch(d["name"]) for d in spec["devices"])
    assert [d["containerEdits"] for d in spec["devices"]] == [
        {"deviceNodes": [{"path": "/dev/nvidia3", "hostPath": "/host/dev/nvidia3", "permissions": "rw"}]},
        {"deviceNodes": [{"path": "/dev/nvidia1", "hostPath": "/host/dev/nvidia1", "permissions": "rw"}]},
    ]
    edits = spec["containerEdits"]
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=GPU-3333,GPU-1111"]
    assert edits["deviceNodes"] == [{"path": "/dev/nvidiactl", "hostPath": "/host/dev/nvidiactl", "permissions": "rw"}]


def test_uvm_nodes_only_when_the_host_has_them() -> None:
    asked: list[str] = []

    def exists(p: str) -> bool:
        asked.append(p)
        return p.endswith("/nvidia-uvm")

    spec = cdi.build_spec(UID, GPUS[:1], "/d", exists=exists)
    assert [n["path"] for n in spec["containerEdits"]["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert sorted(asked) == ["/d/nvidia-uvm", "/d/nvidia-uvm-tools"]


def test_a_spec_needs_a_device() -> None:
    with pytest.raises(ValueError, match=UID):
        cdi.build_spec(UID, [], "/d", exists=lambda p: True)


def test_ids_and_file_name() -> None:
    assert cdi.cdi_id(UID, "gpu-3") == f"gpu.gpu-health.io/gpu={UID}-gpu-3"
    assert cdi.spec_file_name(UID) == f"gpu.gpu-health.io-{UID}.json"
    assert cdi.cdi_id(UID, "gpu-0", driver="gpu.example.com") == f"gpu.example.com/gpu={UID}-gpu-0"


def test_write_replaces_whole_and_remove_is_idempotent(tmp_path: Path) -> None:
    spec_dir = tmp_path / "cdi"  # created on first write
    first = cdi.build_spec(UID, GPUS, "/dev", exists=lambda p: False)
    path = cdi.write_spec(spec_dir, UID, first)
    assert path == spec_dir / f"gpu.gpu-health.io-{UID}.json"
    assert json.loads(path.read_text()) == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # the runtime may read it as another user
    second = cdi.build_spec(UID, GPUS[:1], "/dev", exists=lambda p: False)
    cdi.write_spec(spec_dir, UID, second)
    assert json.loads(path.read_text()) == second
    assert os.listdir(spec_dir) == [path.name]  # no temp file left behind
    assert cdi.spec_exists(spec_dir, UID)
    assert cdi.remove_spec(spec_dir, UID) is True
    assert cdi.remove_spec(spec_dir, UID) is False
    assert cdi.remove_spec(tmp_path / "never-made", UID) is False
    assert not cdi.spec_exists(spec_dir, UID)


def test_failed_write_keeps_the_old_spec_and_leaves_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = cdi.build_spec(UID, GPUS, "/dev", exists=lambda p: False)
    path = cdi.write_spec(tmp_path, UID, old)

    def broken_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        cdi.write_spec(tmp_path, UID, cdi.build_spec(UID, GPUS[:1], "/dev", exists=lambda p: False))
    assert json.loads(path.read_text()) == old
    assert os.listdir(tmp_path) == [path.name]


@pytest.mark.parametrize("bad", ["../x", "", "uid-1", "0f6c3e1a-7d2b-4c55-9a8e-2b1d3c4e5f60/../y"])
def test_no_file_name_is_built_from_anything_but_a_claim_uid(tmp_path: Path, bad: str) -> None:
    """The driver checks UIDs before it gets here; this is the last line, where the name is made."""
    for make in (lambda: cdi.spec_file_name(bad), lambda: cdi.write_spec(tmp_path, bad, {}),
                 lambda: cdi.remove_spec(tmp_path, bad), lambda: cdi.spec_exists(tmp_path, bad),
                 lambda: cdi.build_spec(bad, GPUS, "/dev", exists=lambda p: False)):
        with pytest.raises(ValueError, match="not a UUID"):
            make()
    assert list(tmp_path.iterdir()) == []
    assert cdi.is_claim_uid(UID) and cdi.is_claim_uid(UID.upper()) and not cdi.is_claim_uid(bad)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.uuids().map(str), st.uuids().map(lambda u: str(u).upper())))
def test_any_text_as_a_uid_is_refused_or_names_a_file_inside_the_dir(text: str) -> None:
    try:
        name = cdi.spec_file_name(text)
    except ValueError as exc:
        assert repr(text) in str(exc)
        return
    assert name == f"gpu.gpu-health.io-{text}.json" and "/" not in name and ".." not in name
    assert str(uuid.UUID(text)) == text.lower()
