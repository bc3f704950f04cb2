"""Reading a process's /metrics and probes over loopback, for the tests that run the controller or the plugin as a
process of its own: a free port to give it, one GET, one sample of a series."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int, path: str) -> tuple[int, str]:
    """(HTTP status, body); (0, "") while nothing listens yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def sample(text: str, series: str) -> float | None:
    """The value of an unlabelled series in an exposition, None when it is absent."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None
