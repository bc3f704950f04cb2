"""One small HTTP/1.1 server for ``/metrics``, ``/healthz`` (``/livez``) and ``/readyz``, a thread per connection.

It is built on socketserver, not http.server: http.server loads http.client and the email package, over 1 MiB of
RSS for parsing three paths. It answers what the http.server handler it replaces answered: GET (every other method
501), keep-alive for HTTP/1.1 unless the client says ``Connection: close``, ``Expect: 100-continue``, a request line
over 64 KiB 414, a header line over 64 KiB or more than 99 headers 431, anything malformed 400, each error closing
the connection. What it adds: a client that goes quiet cannot hold its thread forever (:data:`IDLE_S`,
:data:`HEAD_S`, :data:`SEND_S`), and :meth:`MetricsServer.stop` closes the connections still open.
"""

from __future__ import annotations

import errno
import logging
import socket
import socketserver
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from plugin.outlets.metrics.exposition import Collector, choose_encoder
from plugin.validation import split_host_port

log = logging.getLogger(__name__)

IDLE_S = 120.0  # a keep-alive connection waiting for its next request: longer than the usual scrape interval
HEAD_S = 10.0  # from a request's first byte to the end of its headers, however slowly they trickle in
SEND_S = 30.0  # to hand one response to a client that does not read
MAX_LINE = 65536
MAX_HEADERS = 100  # header lines, the blank one that ends them included

TEXT = "text/plain; charset=utf-8"
NOT_FOUND = b"not found: try /metrics, /healthz or /readyz\n"
_PHRASES = {100: "Continue", 200: "OK", 400: "Bad Request", 404: "Not Found", 414: "Request-URI Too Long",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 501: "Not Implemented",
            503: "Service Unavailable", 505: "HTTP Version Not Supported"}
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


class ProbeSource(Protocol):
    """What answers ``/healthz`` and ``/readyz``: the plugin's :class:`~plugin.outlets.metrics.probes.Probes`, or the
    fleet controller's own."""

    def liveness(self) -> tuple[bool, str]: ...
    def readiness(self) -> tuple[bool, str]: ...


def http_date(now: float | None = None) -> str:
    t = time.gmtime(now)
    return (f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year:04d} "
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT")


class HttpError(Exception):
    """A request we answer with an error status and then close the connection on."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Request:
    line: str
    method: str
    path: str
    version: str  # "HTTP/0.9" for a two-word request line: answered with the bare body, as HTTP/0.9 has it
    headers: dict[str, str]  # lower-case names; the first of repeated ones
    close: bool  # close the connection after answering


class Reader:
    """Lines from a socket under two clocks: :data:`IDLE_S` for the first byte of a request, then :data:`HEAD_S`
    for the rest of its head, so a client sending a byte now and then cannot keep a thread waiting."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()
        self._deadline: float | None = None

    def next_request(self) -> None:
        self._deadline = None

    def _fill(self) -> bool:
        if self._deadline is None and self._buf:  # a pipelined request already began
            self._deadline = time.monotonic() + HEAD_S
        if self._deadline is None:
            timeout = IDLE_S
        else:
            timeout = self._deadline - time.monotonic()
            if timeout <= 0:
                raise TimeoutError("request head not complete in time")
        self._sock.settimeout(timeout)
        data = self._sock.recv(65536)
        if not data:
            return False
        if self._deadline is None:
            self._deadline = time.monotonic() + HEAD_S
        self._buf += data
        return True

    def readline(self, limit: int) -> bytes:
        """Up to and including the next LF, at most ``limit`` bytes; what is left when the peer closed."""
        while True:
            end = self._buf.find(b"\n", 0, limit)
            if end >= 0:
                end += 1
            elif len(self._buf) >= limit:
                end = limit
            elif self._fill():
                continue
            else:
                end = len(self._buf)
            line = bytes(self._buf[:end])
            del self._buf[:end]
            return line


def _version(word: str) -> tuple[int, int]:
    if not word.startswith("HTTP/"):
        raise ValueError(word)
    parts = word.split("/", 1)[1].split(".")
    if len(parts) != 2 or not all(p.isdigit() and len(p) <= 10 for p in parts):
        raise ValueError(word)
    return int(parts[0]), int(parts[1])


def _headers(lines: list[str]) -> dict[str, str]:
    """Header fields the way the email parser that http.server used reads them: a line starting with a space or a
    tab continues the one before, and the first line that is no ``name: value`` ends the fields."""
    fields: list[list[str]] = []
    for line in lines:
        if line[:1] in (" ", "\t"):
            if fields:
                fields[-1][1] += line
            continue
        name, colon, value = line.partition(":")
        if not colon or any(not ("!" <= ch <= "~") for ch in name):
            break
        if name:
            fields.append([name, value.lstrip(" \t")])
    out: dict[str, str] = {}
    for name, value in fields:
        out.setdefault(name.lower(), value.rstrip("\r\n"))
    return out


def read_request(reader: Reader) -> Request | None:
    """The next request's head, or None when the client closed (or sent a blank request line)."""
    raw = reader.readline(MAX_LINE + 1)
    if len(raw) > MAX_LINE:
        raise HttpError(414, "Request-URI Too Long")
    if not raw:
        return None
    line = raw.decode("iso-8859-1").rstrip("\r\n")
    words = line.split()
    if not words:
        return None
    version, close = "HTTP/0.9", True
    if len(words) >= 3:
        try:
            number = _version(words[-1])
        except ValueError:
            raise HttpError(400, f"Bad request version ({words[-1]!r})") from None
        if number >= (2, 0):
            raise HttpError(505, f"Invalid HTTP version ({words[-1].split('/', 1)[1]})")
        version, close = words[-1], number < (1, 1)
    if not 2 <= len(words) <= 3:
        raise HttpError(400, f"Bad request syntax ({line!r})")
    method, path = words[:2]
    if len(words) == 2 and method != "GET":
        raise HttpError(400, f"Bad HTTP/0.9 request type ({method!r})")
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    lines: list[str] = []
    while True:
        raw = reader.readline(MAX_LINE + 1)
        if len(raw) > MAX_LINE:
            raise HttpError(431, "Line too long")
        if len(lines) + 1 > MAX_HEADERS:
            raise HttpError(431, "Too many headers")
        if raw in (b"\r\n", b"\n", b""):
            break
        lines.append(raw.decode("iso-8859-1"))
    headers = _headers(lines)
    connection = headers.get("connection", "").lower()
    if connection == "close":
        close = True
    elif connection == "keep-alive":
        close = False
    return Request(line, method, path, version, headers, close)


def response(code: int, body: bytes, content_type: str, *, close: bool = False, head: bool = False) -> bytes:
    """Status line, headers and body in one buffer: one write, so no second segment waits on a delayed ACK."""
    lines = [f"HTTP/1.1 {code} {_PHRASES.get(code, '')}", f"Date: {http_date()}"]
    if close:
        lines.append("Connection: close")
    lines += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}", "", ""]
    return "\r\n".join(lines).encode("latin-1") + (b"" if head else body)


class _Connection(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        self.server.opened(sock)
        try:
            # Each response is one write, but one of several segments: with Nagle on, the last, short one waits
            # for the client's (delayed) ACK of those before, up to ~40 ms a scrape (bench/bench_metrics.py).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reader = Reader(sock)
            while self._one(sock, reader):
                pass
        except OSError as exc:  # the client went away or went quiet (TimeoutError is an OSError)
            log.debug("http %s: connection ended: %s", self.client_address[0], exc)
        finally:
            self.server.closed(sock)

    def _one(self, sock: socket.socket, reader: Reader) -> bool:
        """Answer one request; True to wait for another on this connection."""
        reader.next_request()
        try:
            req = read_request(reader)
        except HttpError as err:
            log.debug("http %s: %d %s", self.client_address[0], err.code, err.message)
            self._send(sock, response(err.code, (err.message + "\n").encode(), TEXT, close=True))
            return False
        if req is None:
            return False
        if req.headers.get("expect", "").lower() == "100-continue" and req.version >= "HTTP/1.1":
            self._send(sock, b"HTTP/1.1 100 Continue\r\n\r\n")
        if req.method != "GET":
            message = f"Unsupported method ({req.method!r})"
            self._send(sock, response(501, (message + "\n").encode(), TEXT, close=True, head=req.method == "HEAD"))
            log.debug('http "%s" 501', req.line)
            return False
        code, body, content_type = self._answer(req)
        if req.version == "HTTP/0.9":
            self._send(sock, body)
        else:
            self._send(sock, response(code, body, content_type))
        # Probes hit this every few seconds; access logs above debug would drown the health transitions.
        log.debug('http "%s" %d %d', req.line, code, len(body))
        return not req.close

    def _answer(self, req: Request) -> tuple[int, bytes, str]:
        path = req.path.split("?", 1)[0]
        if path == "/metrics":
            encoder, content_type = choose_encoder(req.headers.get("accept", ""))
            try:
                return 200, encoder(self.server.registry), content_type
            except Exception:  # a broken collector must not kill the server: say so and keep serving
                log.exception("metrics collection failed")
                return 500, b"metrics collection failed\n", TEXT
        if path in ("/healthz", "/livez"):
            ok, text = self.server.probes.liveness()
            return (200 if ok else 503), (text + "\n").encode(), TEXT
        if path == "/readyz":
            ok, text = self.server.probes.readiness()
            return (200 if ok else 503), (text + "\n").encode(), TEXT
        return 404, NOT_FOUND, TEXT

    @staticmethod
    def _send(sock: socket.socket, data: bytes) -> None:
        sock.settimeout(SEND_S)
        sock.sendall(data)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True  # a restarted plugin rebinds while the old connections sit in TIME_WAIT

    def __init__(self, address: tuple[str, int], registry: Collector, probes: ProbeSource) -> None:
        self.registry = registry
        self.probes = probes
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        super().__init__(address, _Connection)

    def opened(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.add(sock)

    def closed(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.discard(sock)

    def close_connections(self) -> None:
        with self._lock:
            socks = list(self._open)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes its thread, which closes it
            except OSError:
                pass

    def handle_error(self, request: object, client_address: object) -> None:
        # Called from inside the except block: one log record with the traceback rather than a dump on stderr.
        log.exception("http %s: request failed", client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """Serves the registry and the probes on ``HOST:PORT`` in its own threads; port 0 picks a free port."""

    def __init__(self, address: str, registry: Collector, probes: ProbeSource) -> None:
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

    def start(self, busy_ok: bool = False) -> None:
        """``busy_ok``: a port in use is expected (a successor on the host's network, whose predecessor holds it
        until the hand-over) and logged as such; the caller starts again later."""
        host, port = self.requested
        cls = _Server6 if ":" in host else _Server
        try:
            httpd = cls((host, port), self.registry, self.probes)
        except OSError as exc:
            self.error = f"cannot serve metrics on {host or '*'}:{port}: {exc.strerror or exc}"
            if busy_ok and exc.errno == errno.EADDRINUSE:
                log.info("%s (the previous instance's, on the host's network); serving them after the hand-over",
                         self.error)
                return
            # The kubelet path matters more than metrics: keep serving devices. The liveness probe (if one is
            # configured on this port) then fails, which makes the problem visible where it belongs.
            log.error("%s; continuing without /metrics, /healthz and /readyz", self.error)
            return
        self.error = None
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="metrics-http", daemon=True)
        self._thread.start()
        log.info("serving /metrics, /healthz and /readyz on %s:%d", host or "*", self.port)

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd.close_connections()
        if self._thread is not None:
            self._thread.join(2.0)
