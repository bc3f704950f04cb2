"""Shared test helpers: node files, a fake clock, and readiness waits that block on events rather than sleeping."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from plugin.devices.simulated import builtin_node


class FakeClock:
    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class NodeFile:
    """A simulated node file that tests rewrite the way an operator (or a fault injector) would."""

    def __init__(self, path: Path, doc: dict[str, Any] | None = None) -> None:
        self.path = path
        self.doc = copy.deepcopy(doc or builtin_node())
        self.write()

    @property
    def uuids(self) -> list[str]:
        return [g["uuid"] for g in self.doc["gpus"]]

    def write(self, atomic: bool = True) -> None:
        text = json.dumps(self.doc)
        if atomic:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.path)
        else:
            with open(self.path, "r+" if self.path.exists() else "w") as f:
                f.seek(0)
                f.write(text)
                f.truncate()

    def set(self, index: int, atomic: bool = True, **signals: Any) -> None:
        sig = self.doc["gpus"][index]["signals"]
        for k, v in signals.items():
            if v is None:
                sig.pop(k, None)
            else:
                sig[k] = v
        self.write(atomic)

    def clear(self, index: int) -> None:
        self.doc["gpus"][index]["signals"] = {}
        self.write()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def node_file(tmp_path: Path) -> NodeFile:
    return NodeFile(tmp_path / "node.json")


@pytest.fixture
def dev_root(tmp_path: Path) -> Path:
    root = tmp_path / "host"
    (root / "dev").mkdir(parents=True)
    for name in [f"nvidia{i}" for i in range(8)] + ["nvidiactl", "nvidia-uvm"]:
        (root / "dev" / name).touch()
    return root


def wait_until(predicate: Callable[[], bool], wake: Callable[[float], Any], timeout: float = 10.0) -> bool:
    """Re-check ``predicate`` each time ``wake(remaining)`` returns (it blocks on a real event), up to timeout."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        wake(min(remaining, 0.5))
    return True


@pytest.fixture
def short_socket_dir() -> Iterator[Path]:
    """Unix socket paths are limited to ~107 bytes; pytest's tmp_path can exceed that."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ghdp-") as d:
        yield Path(d)


def write_kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig naming one API server and a token: enough to build the client, which dials only on a request."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    return path
