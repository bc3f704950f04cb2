"""The client's watch and generic request (plugin/kube/client.py), used by the fleet controller: a chunked
stream of JSON events read one by one, the server ending it, failures as ApiFailure, close() from another thread
ending a watch blocked in a read, and query strings as the server receives them. Over real HTTP on loopback."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from plugin.kube.client import KubeClient
from plugin.kube.errors import ApiFailure

Handler = Callable[[BaseHTTPRequestHandler], None]


class StreamServer:
    def __init__(self, handle: Handler) -> None:
        self.requests: list[tuple[str, str, dict[str, list[str]], str]] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _any(self) -> None:
                url = urlsplit(self.path)
                outer.requests.append((self.command, url.path, parse_qs(url.query), self.headers.get("User-Agent", "")))
                handle(self)

            do_GET = do_PUT = do_POST = _any

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def chunk(h: BaseHTTPRequestHandler, data: bytes) -> None:
    h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    h.wfile.flush()


def start_stream(h: BaseHTTPRequestHandler) -> None:
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Transfer-Encoding", "chunked")
    h.end_headers()


def event(kind: str, name: str, rv: str) -> bytes:
    return json.dumps({"type": kind, "object": {"metadata": {"name": name, "resourceVersion": rv}}}).encode() + b"\n"


@pytest.fixture
def client_for(tmp_path: Path) -> Iterator[Callable[[StreamServer], KubeClient]]:
    made: list[KubeClient] = []

    def make(server: StreamServer) -> KubeClient:
        cfg = tmp_path / "kubeconfig"
        cfg.write_text(json.dumps({
            "current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
            "clusters": [{"name": "k", "cluster": {"server": f"http://127.0.0.1:{server.port}"}}],
            "users": [{"name": "u", "user": {"token": "t0k"}}]}))
        c = KubeClient(cfg, component="gpu-health-controller")
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_a_watch_yields_each_event_as_it_comes_even_split_across_chunks(client_for: Any) -> None:
    def handle(h: BaseHTTPRequestHandler) -> None:
        start_stream(h)
        first = event("ADDED", "a", "10")
        chunk(h, first[:7])  # one event in two chunks, then two events in one
        chunk(h, first[7:])
        chunk(h, event("MODIFIED", "a", "11") + b"\n" + event("BOOKMARK", "", "12"))
        chunk(h, b"")

    server = StreamServer(handle)
    try:
        client = client_for(server)
        got = list(client.watch("/api/v1/nodes", {"resourceVersion": "9", "allowWatchBookmarks": "true"}, 5))
        assert [(e["type"], e["object"]["metadata"]["resourceVersion"]) for e in got] == [
            ("ADDED", "10"), ("MODIFIED", "11"), ("BOOKMARK", "12")]
        method, path, query, agent = server.requests[0]
        assert (method, path, agent) == ("GET", "/api/v1/nodes", "gpu-health-controller")
        assert query == {"resourceVersion": ["9"], "allowWatchBookmarks": ["true"], "watch": ["1"]}
    finally:
        server.close()


def test_a_refused_watch_is_an_api_failure_with_the_status(client_for: Any) -> None:
    def handle(h: BaseHTTPRequestHandler) -> None:
        body = json.dumps({"kind": "Status", "message": "too old resource version: 9 (40)", "code": 410}).encode()
        h.send_response(410)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    server = StreamServer(handle)
    try:
        with pytest.raises(ApiFailure) as info:
            list(client_for(server).watch("/api/v1/nodes", {"resourceVersion": "9"}, 5))
        assert info.value.status == 410 and "too old resource version" in info.value.message
    finally:
        server.close()


def test_a_line_that_is_not_json_breaks_the_stream_loudly(client_for: Any) -> None:
    def handle(h: BaseHTTPRequestHandler) -> None:
        start_stream(h)
        chunk(h, event("ADDED", "a", "1") + b"{not json\n")
        chunk(h, b"")

    server = StreamServer(handle)
    try:
        stream = client_for(server).watch("/api/v1/nodes", {}, 5)
        assert next(stream)["type"] == "ADDED"
        with pytest.raises(ApiFailure, match="not JSON"):
            next(stream)
    finally:
        server.close()


def test_close_ends_a_watch_blocked_in_a_read(client_for: Any) -> None:
    release = threading.Event()

    def handle(h: BaseHTTPRequestHandler) -> None:
        start_stream(h)
        chunk(h, event("ADDED", "a", "1"))
        release.wait(30)  # then nothing: a quiet watch

    server = StreamServer(handle)
    try:
        client = client_for(server)
        ended, first = threading.Event(), threading.Event()
        outcome: list[object] = []

        def follow() -> None:
            try:
                for e in client.watch("/api/v1/nodes", {}, 60):
                    outcome.append(e["type"])
                    first.set()
            except ApiFailure as exc:
                outcome.append(exc)
            ended.set()

        t = threading.Thread(target=follow, daemon=True)
        t.start()
        assert first.wait(5)  # the first event is in; now the stream is quiet and the reader blocks
        client.close()
        assert ended.wait(5), "close() did not end the watch"
        assert outcome[0] == "ADDED"
    finally:
        release.set()
        server.close()


def test_request_sends_the_query_and_the_field_manager_on_writes(client_for: Any) -> None:
    def handle(h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        if length:
            h.rfile.read(length)
        body = json.dumps({"items": [], "metadata": {"resourceVersion": "7"}}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    server = StreamServer(handle)
    try:
        client = client_for(server)
        doc = client.request("GET", "/api/v1/nodes", query={"limit": "500", "labelSelector": "a=b"})
        assert doc["metadata"]["resourceVersion"] == "7"
        client.request("PUT", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l", {"kind": "Lease"},
                       "application/json")
        (_, _, q1, _), (m2, _, q2, _) = server.requests
        assert q1 == {"limit": ["500"], "labelSelector": ["a=b"]}
        assert m2 == "PUT" and q2 == {"fieldManager": ["gpu-health-controller"], "timeout": ["10000ms"]}
    finally:
        server.close()
