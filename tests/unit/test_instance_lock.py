"""plugin.lock in the state dir: one owner at a time, and with ``wait`` (--handover) a successor that takes it once
the owner lets go."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from plugin.startup import InstanceLock, StartupError


def test_a_held_lock_refuses_a_second_owner_naming_the_holder(tmp_path: Path) -> None:
    first = InstanceLock.acquire(tmp_path, "--state-dir")
    try:
        with pytest.raises(StartupError, match=rf"--state-dir {tmp_path} is in use .*\(pid {os.getpid()} on "):
            InstanceLock.acquire(tmp_path, "--state-dir")
    finally:
        first.release()


def test_a_waiting_successor_takes_the_lock_only_once_the_holder_lets_go(tmp_path: Path) -> None:
    first = InstanceLock.acquire(tmp_path, "--state-dir")
    successor = InstanceLock.acquire(tmp_path, "--state-dir", wait=True)
    try:
        assert first.held and not successor.held
        assert successor.holder.startswith(f"pid {os.getpid()}")
        assert not successor.try_take()
        assert not successor.try_take()  # asking again changes nothing while it is held
        first.release()
        assert successor.try_take() and successor.held
        # It is the owner now: a third instance is refused, and the file names the successor.
        with pytest.raises(StartupError, match="is in use"):
            InstanceLock.acquire(tmp_path, "--state-dir")
        assert (tmp_path / "plugin.lock").read_text().split()[0] == str(os.getpid())
    finally:
        successor.release()
        first.release()
    assert not successor.held
    InstanceLock.acquire(tmp_path, "--state-dir").release()  # released for good


def test_a_successor_released_before_the_hand_over_leaves_the_holders_record(tmp_path: Path) -> None:
    first = InstanceLock.acquire(tmp_path, "--state-dir")
    try:
        record = (tmp_path / "plugin.lock").read_text()
        successor = InstanceLock.acquire(tmp_path, "--state-dir", wait=True)
        successor.release()
        # It never held the lock, so it must not have emptied the file the holder wrote.
        assert (tmp_path / "plugin.lock").read_text() == record
        another = InstanceLock.acquire(tmp_path, "--state-dir", wait=True)
        assert not another.try_take()
        another.release()
    finally:
        first.release()
