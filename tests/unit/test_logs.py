"""Log levels: the HTTP client's line per request stays out of an info-level log (an idle node of a 5,000-node
fleet would otherwise log every API call), and comes back with --log-level debug."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from plugin import logs


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    quiet = {n: logging.getLogger(n).level for n in ("httpx", "httpx2", "httpcore", "watchdog")}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for n, lvl in quiet.items():
        logging.getLogger(n).setLevel(lvl)


def test_http_client_requests_are_not_logged_at_info(capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup("info", "json")
    logging.getLogger("httpx2").info('HTTP Request: PATCH https://api/v1/nodes/n "HTTP/1.1 200 OK"')
    logging.getLogger("httpx").info("HTTP Request: GET https://api/v1/nodes/n")
    logging.getLogger("httpx2").warning("retrying")
    logging.getLogger("plugin.app").info("started")
    err = capsys.readouterr().err
    assert "HTTP Request" not in err
    assert "retrying" in err and "started" in err


def test_debug_shows_them(capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup("debug", "text")
    logging.getLogger("httpx2").info('HTTP Request: PATCH https://api/v1/nodes/n "HTTP/1.1 200 OK"')
    assert "HTTP Request" in capsys.readouterr().err
