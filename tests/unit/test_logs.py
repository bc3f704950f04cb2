"""Log levels: the API client's line per request stays out of an info-level log (an idle node of a 5,000-node fleet
would otherwise log every API call), and comes back with --log-level debug. Driven through the real client against
the fake API server, so a client that starts logging at info fails here."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from plugin import logs
from plugin.kube.client import KubeClient
from tests.fakes.fake_apiserver import FakeApiServer


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    watchdog = logging.getLogger("watchdog").level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("watchdog").setLevel(watchdog)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[KubeClient]:
    api = FakeApiServer().start()
    api.add_node("n")
    c = KubeClient(api.kubeconfig(tmp_path))
    try:
        yield c
    finally:
        c.close()
        api.stop()


def test_api_requests_are_not_logged_at_info(client: KubeClient, capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup("info", "json")
    client.get_node("n")
    client.patch_node_annotations("n", {"gpu-health.io/state": "Healthy"}, None)
    logging.getLogger("plugin.kube.client").warning("retrying")
    logging.getLogger("plugin.app").info("started")
    err = capsys.readouterr().err
    assert "/api/v1/nodes/n" not in err
    assert "retrying" in err and "started" in err


def test_debug_shows_them(client: KubeClient, capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup("debug", "text")
    client.get_node("n")
    err = capsys.readouterr().err
    assert "GET " in err and "/api/v1/nodes/n: 200" in err
