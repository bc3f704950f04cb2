"""One small HTTP server for ``/metrics``, ``/healthz`` and ``/readyz``, in threads of its own."""

from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from plugin.outlets.metrics.probes import Probes
from plugin.validation import split_host_port

log = logging.getLogger(__name__)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: Prometheus reuses its connection scrape after scrape
    # Headers and body go out as two writes; with Nagle on, the second waits for the client's delayed ACK of the
    # first, which added ~40 ms to every keep-alive request (bench/bench_metrics.py).
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            try:
                body = encoder(self.server.registry)
            except Exception:  # a broken collector must not kill the server: say so and keep serving
                log.exception("metrics collection failed")
                self._send(500, b"metrics collection failed\n", "text/plain; charset=utf-8")
                return
            self._send(200, body, content_type)
        elif path in ("/healthz", "/livez"):
            ok, text = self.server.probes.liveness()
            self._send(200 if ok else 503, (text + "\n").encode(), "text/plain; charset=utf-8")
        elif path == "/readyz":
            ok, text = self.server.probes.readiness()
            self._send(200 if ok else 503, (text + "\n").encode(), "text/plain; charset=utf-8")
        else:
            self._send(404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        # Probes hit this every few seconds; access logs would drown the health transitions.
        log.debug("http %s", format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    registry: CollectorRegistry
    probes: Probes


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """Serves the registry and the probes on ``HOST:PORT`` in its own threads; port 0 picks a free port."""

    def __init__(self, address: str, registry: CollectorRegistry, probes: Probes) -> None:
        host, port = split_host_port(address)
        self.requested = (host, port)
        self.registry = registry
        self.probes = probes
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("metrics server not started")
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        host, port = self.requested
        cls = _Server6 if ":" in host else _Server
        try:
            httpd = cls((host, port), _Handler)
        except OSError as exc:
            # The kubelet path matters more than metrics: keep serving devices. The liveness probe (if one is
            # configured on this port) then fails, which makes the problem visible where it belongs.
            self.error = f"cannot serve metrics on {host or '*'}:{port}: {exc.strerror or exc}"
            log.error("%s; continuing without /metrics, /healthz and /readyz", self.error)
            return
        httpd.registry = self.registry
        httpd.probes = self.probes
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="metrics-http", daemon=True)
        self._thread.start()
        log.info("serving /metrics, /healthz and /readyz on %s:%d", host or "*", self.port)

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(2.0)
