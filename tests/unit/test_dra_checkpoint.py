"""The DRA checkpoint: prepared claims survive a restart, and a damaged file never stops the plugin."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from plugin.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice

CLAIM = PreparedClaim(uid="uid-1", namespace="team-a", name="train", devices=(
    PreparedDevice(request_names=("gpus",), pool="node-1", device="gpu-0", uuid="GPU-0", minor=0,
                   cdi_ids=("gpu.gpu-health.io/gpu=uid-1-gpu-0",)),
    PreparedDevice(request_names=("gpus", "extra"), pool="node-1", device="gpu-5", uuid="GPU-5", minor=7,
                   cdi_ids=("gpu.gpu-health.io/gpu=uid-1-gpu-5",)),
))


def test_round_trip_and_layout(tmp_path: Path) -> None:
    state = tmp_path / "state"  # created on first save
    cp = Checkpoint(state)
    assert cp.load() == {}
    other = PreparedClaim(uid="uid-2", namespace="b", name="c", devices=CLAIM.devices[:1])
    cp.save({"uid-1": CLAIM, "uid-2": other})
    assert Checkpoint(state).load() == {"uid-1": CLAIM, "uid-2": other}
    doc = json.loads((state / Checkpoint.FILE).read_text())
    assert doc["version"] == 1
    assert doc["claims"]["uid-1"] == {"namespace": "team-a", "name": "train", "devices": [
        {"request_names": ["gpus"], "pool": "node-1", "device": "gpu-0", "uuid": "GPU-0", "minor": 0,
         "cdi_ids": ["gpu.gpu-health.io/gpu=uid-1-gpu-0"]},
        {"request_names": ["gpus", "extra"], "pool": "node-1", "device": "gpu-5", "uuid": "GPU-5", "minor": 7,
         "cdi_ids": ["gpu.gpu-health.io/gpu=uid-1-gpu-5"]}]}
    cp.save({})
    assert cp.load() == {}
    assert os.listdir(state) == [Checkpoint.FILE]


@pytest.mark.parametrize(("content", "why"), [
    ("{not json", "Expecting property name"),
    ("[]", "expected a JSON object"),
    ('{"version": 9, "claims": {}}', "unknown version 9"),
    ('{"version": 1, "claims": []}', "claims: expected an object"),
    ('{"version": 1, "claims": {"u": {"namespace": "a", "name": "b", "devices": [{"request_names": ["r"], '
     '"pool": "p", "device": "gpu-0", "uuid": "GPU-0", "minor": "0", "cdi_ids": []}]}}}',
     "claims['u'].minor: expected an integer"),
    ('{"version": 1, "claims": {"u": {"namespace": "a", "devices": []}}}', "claims['u'].name: expected a string"),
])
def test_damaged_file_is_moved_aside_with_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                    content: str, why: str) -> None:
    cp = Checkpoint(tmp_path)
    cp.path.write_text(content)
    with caplog.at_level(logging.WARNING, "plugin.dra.checkpoint"):
        assert cp.load() == {}
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    msg = record.getMessage()
    assert str(cp.path) in msg and why in msg and "dra-checkpoint.corrupt" in msg
    assert (tmp_path / "dra-checkpoint.corrupt").read_text() == content
    assert not cp.path.exists()
    # The next save starts a good file again.
    cp.save({"uid-1": CLAIM})
    assert cp.load() == {"uid-1": CLAIM}


def test_failed_save_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cp = Checkpoint(tmp_path)
    cp.save({"uid-1": CLAIM})

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        cp.save({})
    monkeypatch.undo()
    assert cp.load() == {"uid-1": CLAIM}
    assert os.listdir(tmp_path) == [Checkpoint.FILE]
