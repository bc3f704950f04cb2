"""The DRA checkpoint: prepared claims survive a restart, and a damaged file never stops the plugin."""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from plugin.dra.checkpoint import Checkpoint, CheckpointTooNew, CheckpointUnreadable, PreparedClaim, PreparedDevice

U1 = "6b1f0c2e-3d4a-4b5c-8d6e-7f8091a2b3c4"
U2 = "0e9d8c7b-6a59-4847-b635-241302f1e0d9"
CLAIM = PreparedClaim(uid=U1, namespace="team-a", name="train", devices=(
    PreparedDevice(request_names=("gpus",), pool="node-1", device="gpu-0", uuid="GPU-0", minor=0,
                   cdi_ids=(f"gpu.gpu-health.io/gpu={U1}-gpu-0",)),
    PreparedDevice(request_names=("gpus", "extra"), pool="node-1", device="gpu-5", uuid="GPU-5", minor=7,
                   cdi_ids=(f"gpu.gpu-health.io/gpu={U1}-gpu-5",)),
))


def test_round_trip_and_layout(tmp_path: Path) -> None:
    state = tmp_path / "state"  # created on first save
    cp = Checkpoint(state)
    assert cp.load() == {}
    other = PreparedClaim(uid=U2, namespace="b", name="c", devices=CLAIM.devices[:1])
    cp.save({U1: CLAIM, U2: other})
    assert Checkpoint(state).load() == {U1: CLAIM, U2: other}
    doc = json.loads((state / Checkpoint.FILE).read_text())
    assert doc["version"] == 1
    assert doc["claims"][U1] == {"namespace": "team-a", "name": "train", "devices": [
        {"request_names": ["gpus"], "pool": "node-1", "device": "gpu-0", "uuid": "GPU-0", "minor": 0,
         "cdi_ids": [f"gpu.gpu-health.io/gpu={U1}-gpu-0"]},
        {"request_names": ["gpus", "extra"], "pool": "node-1", "device": "gpu-5", "uuid": "GPU-5", "minor": 7,
         "cdi_ids": [f"gpu.gpu-health.io/gpu={U1}-gpu-5"]}]}
    cp.save({})
    assert cp.load() == {}
    assert os.listdir(state) == [Checkpoint.FILE]


@pytest.mark.parametrize(("content", "why"), [
    ("{not json", "Expecting property name"),
    ("[]", "expected a JSON object"),
    ('{"version": 0, "claims": {}}', "unknown version 0"),
    ('{"version": "2", "claims": {}}', "unknown version '2'"),
    ('{"claims": {}}', "unknown version None"),
    ('{"version": 1, "claims": {"../../x": {"namespace": "a", "name": "b", "devices": []}}}',
     "claims['../../x']: the key is not a claim UID"),
    ('{"version": 1, "claims": []}', "claims: expected an object"),
    (json.dumps({"version": 1, "claims": {U1: {"namespace": "a", "name": "b", "devices": [
        {"request_names": ["r"], "pool": "p", "device": "gpu-0", "uuid": "GPU-0", "minor": "0", "cdi_ids": []}]}}}),
     f"claims['{U1}'].minor: expected an integer"),
    (json.dumps({"version": 1, "claims": {U1: {"namespace": "a", "devices": []}}}),
     f"claims['{U1}'].name: expected a string"),
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
    cp.save({U1: CLAIM})
    assert cp.load() == {U1: CLAIM}


def test_failed_save_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cp = Checkpoint(tmp_path)
    cp.save({U1: CLAIM})

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        cp.save({})
    monkeypatch.undo()
    assert cp.load() == {U1: CLAIM}
    assert os.listdir(tmp_path) == [Checkpoint.FILE]


def _raise(err: int) -> Callable[[Path], bytes]:
    def read(path: Path) -> bytes:
        raise OSError(err, os.strerror(err), str(path))
    return read


@pytest.mark.parametrize(("setup", "why"), [
    ("directory", "Is a directory"),
    (errno.EIO, "Input/output error"),
    (errno.EACCES, "Permission denied"),
])
def test_a_read_error_is_not_damage_the_file_is_kept_and_the_error_names_it(tmp_path: Path, setup: str | int,
                                                                           why: str) -> None:
    cp = Checkpoint(tmp_path)
    cp.save({U1: CLAIM})
    if setup == "directory":
        cp.path.unlink()
        cp.path.mkdir()
    else:
        cp = Checkpoint(tmp_path, read=_raise(int(setup)))
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CheckpointUnreadable) as exc:
        cp.load()
    assert str(cp.path) in str(exc.value) and why in str(exc.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing moved aside
    if setup != "directory":
        assert Checkpoint(tmp_path).load() == {U1: CLAIM}


def test_a_checkpoint_from_a_newer_plugin_is_refused_and_kept(tmp_path: Path) -> None:
    cp = Checkpoint(tmp_path)
    text = json.dumps({"version": 2, "claims": {U1: {"whatever": "a newer plugin wrote"}}})
    cp.path.write_text(text)
    with pytest.raises(CheckpointTooNew) as exc:
        cp.load()
    assert exc.value.version == 2 and exc.value.path == cp.path
    assert str(exc.value) == (f"DRA checkpoint {cp.path} is version 2; this plugin reads version 1: a newer plugin "
                              "wrote it (run that one, or remove the file once no claim is prepared on this node)")
    assert cp.path.read_text() == text and os.listdir(tmp_path) == [Checkpoint.FILE]
