"""pytest fixtures for the NVSentinel stand-in: ``nvsentinel_peer_exe`` (built once per session) and
``nvsentinel_peer`` (a running peer in a short temporary directory, stopped after the test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conformance.nvsentinel.peer import NvsentinelPeer, build_peer


@pytest.fixture(scope="session")
def nvsentinel_peer_exe() -> Path:
    return build_peer()


@pytest.fixture
def nvsentinel_peer(nvsentinel_peer_exe: Path, short_socket_dir: Path) -> Iterator[NvsentinelPeer]:
    peer = NvsentinelPeer(nvsentinel_peer_exe, short_socket_dir).start()
    yield peer
    peer.stop()
