from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from plugin.app import App
from plugin.config import Config
from plugin.devtools.standin import KubeletStandin
from plugin.health.config import HealthConfig
from plugin.health.node_state import NodeState
from tests.conftest import NodeFile


@dataclass
class Env:
    root: Path
    node: NodeFile
    kubelet: KubeletStandin
    app: App
    cfg: Config

    def wait_kubelet(self, predicate: object, timeout: float = 10.0) -> bool:
        return self.kubelet.wait_for(predicate, timeout)  # type: ignore[arg-type]

    def wait_state(self, predicate: object, timeout: float = 10.0) -> bool:
        return wait_state(self.app.state, predicate, timeout)


def wait_state(state: NodeState, predicate: object, timeout: float = 10.0) -> bool:
    """Re-check ``predicate`` at each change of the node state until it holds or the deadline passes."""
    import time

    deadline = time.monotonic() + timeout
    version = -1
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        version = state.wait_for_change(version, 0.2).version
    return True


def make_config(root: Path, node: NodeFile, dev_root: Path, **extra: object) -> Config:
    extra.setdefault("metrics_address", "off")  # the metrics tests bind their own ephemeral port
    return Config(backend="simulated", simulated_node=node.path, device_plugin_dir=root / "dp",
                  state_dir=root / "state", dev_root=dev_root, poll_interval=0.1,
                  health=HealthConfig(clear_after_polls=2), **extra)  # type: ignore[arg-type]


@contextmanager
def running_app(root: Path, dev_root: Path, **extra: object) -> Iterator[Env]:
    """The whole plugin on the simulated 8-GPU node, registered with a kubelet stand-in; ``extra`` sets options."""
    node = NodeFile(root / "node.json")
    kubelet = KubeletStandin(root / "dp")
    kubelet.start()
    cfg = make_config(root, node, dev_root, **extra)
    app = App(cfg)
    app.start()
    e = Env(root, node, kubelet, app, cfg)
    try:
        assert e.wait_kubelet(lambda: kubelet.capacity() == (8, 8)), "plugin never registered"
        yield e
    finally:
        app.stop.set()
        app.shutdown()
        kubelet.stop()


@pytest.fixture
def env(short_socket_dir: Path, dev_root: Path) -> Iterator[Env]:
    with running_app(short_socket_dir, dev_root) as e:
        yield e


@pytest.fixture
def kubelet(short_socket_dir: Path) -> Iterator[KubeletStandin]:
    """The kubelet stand-in on the device-plugin dir a plugin process under test registers in."""
    k = KubeletStandin(short_socket_dir / "dp")
    k.start()
    yield k
    k.stop()
