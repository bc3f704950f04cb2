"""One small HTTP/1.1 server for ``/metrics``, ``/healthz`` (``/livez``) and ``/readyz``: one thread, non-blocking
sockets, every cost bounded whatever the clients do.

The port listens on every address of a node, so any pod of the cluster can reach it, and the process lives under a
memory limit. A thread per connection with generous line limits let 30 local connections take the plugin from 15
to 210 MiB in two seconds. Here one thread serves every connection from a selector, and :class:`Limits` bounds the
rest: at most ``connections`` open connections (a new one makes room by closing the one that has waited longest,
so a flood cannot lock a scraper out), at most ``head_bytes`` of request line and headers buffered per connection
(431, or 414 for a request line alone over it), at most one answer pending per connection (the next request is
not read until the answer is written), and a deadline per phase: a whole request head within ``head_s`` (from the
accept, or from the first byte of a later request on a kept-alive connection: sending a byte now and then does not
extend it), ``idle_s`` between requests, ``send_s`` for an answer to leave. What that costs at most is in
docs/observability.md; bench/bench_http_abuse.py measures it on the running plugin.

It answers what the http.server handler it replaced answered: GET (every other method 501), keep-alive for
HTTP/1.1 unless the client says ``Connection: close``, ``Expect: 100-continue``, HTTP/0.9's bare body, 431 for
more than 99 headers, anything malformed 400, each error closing the connection. Not http.server itself: it loads
http.client and the email package, over 1 MiB of RSS for parsing three paths.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from plugin.serve.exposition import Collector, choose_encoder
from plugin.validation import split_host_port

log = logging.getLogger(__name__)

# A scrape or a probe sends a request line and a few short headers: a few hundred bytes.
MAX_HEAD_BYTES = 8192
# Prometheus replicas and the kubelet's probes need a handful; each connection costs a socket, a head buffer and
# at most one pending answer, never a thread.
MAX_CONNECTIONS = 64
HEAD_S = 10.0  # a whole request head, however slowly its bytes trickle in
IDLE_S = 120.0  # a keep-alive connection waiting for its next request: longer than the usual scrape interval
SEND_S = 30.0  # for an answer to leave, to a client that does not read
# After an answer that closes the connection: what the client still sends is read and dropped for a while, so that
# closing with unread bytes does not reset the connection before the client has read the answer.
LINGER_S = 2.0
LINGER_BYTES = 1 << 20
MAX_HEADERS = 100  # header lines, the blank one that ends them included
# Per connection, in the kernel (which doubles them for its bookkeeping): a head is at most 8 KiB, and 64 KiB in
# flight keeps a scrape of a few hundred KB to a few round trips.
SOCKET_RCVBUF = 16384
SOCKET_SNDBUF = 65536
BACKLOG = 1024  # capped by net.core.somaxconn (4096 on current kernels)
MAX_WAIT_S = 1.0  # the longest the loop sleeps with connections open: deadlines are checked at least this often

TEXT = "text/plain; charset=utf-8"
NOT_FOUND = b"not found: try /metrics, /healthz or /readyz\n"
_PHRASES = {100: "Continue", 200: "OK", 400: "Bad Request", 404: "Not Found", 408: "Request Timeout",
            414: "Request-URI Too Long", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            501: "Not Implemented", 503: "Service Unavailable", 505: "HTTP Version Not Supported"}
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


@dataclass(frozen=True)
class Limits:
    """What one client may cost; the defaults are what the plugin and the controller run with."""

    connections: int = MAX_CONNECTIONS
    head_bytes: int = MAX_HEAD_BYTES
    head_s: float = HEAD_S
    idle_s: float = IDLE_S
    send_s: float = SEND_S
    linger_s: float = LINGER_S


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


def head_end(buf: bytes | bytearray) -> int:
    """The length of the request head at the start of ``buf`` (its blank line included), or -1 while incomplete.
    A blank request line is a head of its own, which :func:`parse_head` takes for the client's goodbye."""
    first = buf.find(b"\n")
    if first < 0:
        return -1
    if first == 0 or (first == 1 and buf[0] == 0x0D):
        return first + 1
    ends = [i + len(sep) for sep in (b"\n\r\n", b"\n\n") if (i := buf.find(sep, first)) >= 0]
    return min(ends) if ends else -1


def head_error(buf: bytes | bytearray, limit: int) -> HttpError:
    """Why a head that does not end within ``limit`` bytes is refused."""
    if buf.find(b"\n", 0, limit) < 0:
        return HttpError(414, "Request-URI Too Long")
    return HttpError(431, "Request header fields too large")


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


def parse_head(head: bytes) -> Request | None:
    """A whole request head (as :func:`head_end` cut it), or None for a blank request line."""
    lines = [part + "\n" for part in head.decode("iso-8859-1").split("\n")[:-1]]
    line = lines[0].rstrip("\r\n")
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
    fields = lines[1:-1]  # the last line is the blank one
    if len(fields) + 1 > MAX_HEADERS:
        raise HttpError(431, "Too many headers")
    headers = _headers(fields)
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


# What a connection is doing; also the order in which connections make room for a new one: one that is only
# draining after its last answer first, then the one waiting longest for a request, then one still being answered.
LINGER, READ, WRITE = 0, 1, 2


class _Conn:
    __slots__ = ("buf", "close_after", "closed", "deadline", "lingered", "out", "peer", "phase", "since", "sock",
                 "started")

    def __init__(self, sock: socket.socket, peer: str, now: float, limits: Limits) -> None:
        self.sock = sock
        self.peer = peer
        self.buf = bytearray()  # request bytes read and not yet answered: at most head_bytes + 1
        self.out = bytearray()  # the answer being written
        self.phase = READ
        self.since = now
        self.deadline = now + limits.head_s  # the first request's head is due from the accept on
        self.started = True  # the head clock runs
        self.close_after = False
        self.lingered = 0
        self.closed = False


class _Loop:
    """Everything on one thread: accept, read heads, answer, write, time out. Nothing here blocks but select()."""

    def __init__(self, listener: socket.socket, registry: Collector, probes: ProbeSource, limits: Limits,
                 clock: Callable[[], float]) -> None:
        self.listener = listener
        self.registry = registry
        self.probes = probes
        self.limits = limits
        self.clock = clock
        self.conns: dict[int, _Conn] = {}
        self.sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stopping = False
        self._listen_paused_until: float | None = None
        # Connections with another whole request already in their buffer: served one request a turn each, so a
        # client that pipelines hundreds cannot keep the loop from everyone else.
        self._more: list[_Conn] = []
        self._scratch = bytearray(65536)
        self.sel.register(listener, selectors.EVENT_READ, None)
        self.sel.register(self._wake_r, selectors.EVENT_READ, self._wake_r)

    def stop(self) -> None:
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:  # full or closed: the loop is awake or gone either way
            pass

    def run(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._turn()
                except Exception:  # a bug of ours outside any one connection: keep serving the probes
                    log.exception("metrics server loop failed; continuing")
                    time.sleep(0.1)  # not a hot loop of tracebacks if it fails every turn
        finally:
            for conn in list(self.conns.values()):
                self._close(conn)
            self.sel.close()
            self.listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _turn(self) -> None:
        events = self.sel.select(0.0 if self._more else self._timeout())
        more, self._more = self._more, []
        accept = False
        for key, _ in events:
            if key.data is None:
                accept = True
            elif key.data is self._wake_r:
                try:
                    self._wake_r.recv(64)
                except OSError:
                    pass
            else:
                conn: _Conn = key.data
                if not conn.closed:
                    self._guard(conn, self._on_ready)
        for conn in more:
            if not conn.closed and conn not in self._more:
                self._guard(conn, self._serve)
        if accept:  # after the reads: a request already here is answered before newcomers can push it out
            self._accept()
        self._expire()

    def _timeout(self) -> float | None:
        now = self.clock()
        due = [c.deadline for c in self.conns.values()]
        if self._listen_paused_until is not None:
            due.append(self._listen_paused_until)
        if not due:
            return None
        return max(0.0, min(min(due) - now, MAX_WAIT_S))

    def _guard(self, conn: _Conn, step: Callable[[_Conn], None]) -> None:
        try:
            step(conn)
        except OSError as exc:  # the client went away mid-way
            log.debug("http %s: connection ended: %s", conn.peer, exc)
            self._close(conn)
        except Exception:  # a bug of ours in one request must not stop the server for every other client
            log.exception("http %s: request failed", conn.peer)
            self._close(conn)

    # Connections ----------------------------------------------------------------------------------------------

    def _accept(self) -> None:
        # At most as many as may be open: one accepted in this turn is never closed to make room in the same turn.
        for _ in range(self.limits.connections):
            try:
                sock, addr = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors or memory: stop listening for a moment rather than spin on it.
                    log.warning("http: cannot accept a connection (%s); pausing for a second", exc.strerror or exc)
                    self.sel.unregister(self.listener)
                    self._listen_paused_until = self.clock() + 1.0
                return
            if len(self.conns) >= self.limits.connections:
                victim = min(self.conns.values(), key=lambda c: (c.phase, c.since))
                self._close(victim, reset=victim.phase == WRITE)
            sock.setblocking(False)
            # Each answer is one write, but may be several segments: with Nagle on, the last, short one waits for
            # the client's (delayed) ACK of those before, up to ~40 ms a scrape (bench/bench_metrics.py).
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            conn = _Conn(sock, str(addr[0]), self.clock(), self.limits)
            self.conns[sock.fileno()] = conn
            self.sel.register(sock, selectors.EVENT_READ, conn)
            self._guard(conn, self._on_ready)  # a client's request is usually here already

    def _close(self, conn: _Conn, *, reset: bool = False) -> None:
        if conn.closed:
            return
        conn.closed = True
        self.conns.pop(conn.sock.fileno(), None)
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        if reset:  # drop what the kernel still holds for a client that does not read, at once
            try:
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            except OSError:
                pass
        conn.sock.close()

    def _expire(self) -> None:
        now = self.clock()
        if self._listen_paused_until is not None and now >= self._listen_paused_until:
            self._listen_paused_until = None
            self.sel.register(self.listener, selectors.EVENT_READ, None)
        for conn in [c for c in self.conns.values() if now >= c.deadline]:
            if conn.phase == READ and conn.started and conn.buf:
                log.debug("http %s: request head not complete in %.0f s", conn.peer, self.limits.head_s)
                conn.buf.clear()
                self._guard(conn, lambda c: self._finish(c, response(408, b"Request Timeout\n", TEXT, close=True),
                                                         close=True))
            else:  # silent, idle, lingering, or not reading its answer
                self._close(conn, reset=conn.phase == WRITE)

    def _set_phase(self, conn: _Conn, phase: int, deadline: float) -> None:
        if phase != conn.phase:
            self.sel.modify(conn.sock, selectors.EVENT_WRITE if phase == WRITE else selectors.EVENT_READ, conn)
        conn.phase = phase
        conn.since = self.clock()
        conn.deadline = deadline

    # Reading, answering, writing ----------------------------------------------------------------------------

    def _on_ready(self, conn: _Conn) -> None:
        if conn.phase == WRITE:
            self._flush(conn)
            self._serve(conn)  # requests pipelined behind the one just answered
        elif conn.phase == LINGER:
            self._linger(conn)
        else:
            self._read(conn)

    def _read(self, conn: _Conn) -> None:
        room = self.limits.head_bytes + 1 - len(conn.buf)
        try:
            data = conn.sock.recv(max(room, 1))
        except BlockingIOError:
            return
        if not data:  # the client closed; a partial head has nobody to answer
            self._close(conn)
            return
        if not conn.started:
            conn.started = True
            conn.deadline = self.clock() + self.limits.head_s
        conn.buf += data
        self._serve(conn)

    def _serve(self, conn: _Conn) -> None:
        """Answer the request whose head is complete in the buffer, if there is one; one behind it waits for the
        next turn."""
        if not (conn.phase == READ and not conn.closed and conn.buf and self._serve_one(conn)):
            return
        if conn.phase == READ and not conn.closed and conn.buf:
            self._more.append(conn)

    def _serve_one(self, conn: _Conn) -> bool:
        """Answer the request at the start of the buffer; False while its head is incomplete."""
        end = head_end(conn.buf)
        if end < 0 or end > self.limits.head_bytes:
            if end > 0 or len(conn.buf) > self.limits.head_bytes:
                err = head_error(conn.buf, self.limits.head_bytes)
                conn.buf.clear()
                log.debug("http %s: %d %s", conn.peer, err.code, err.message)
                self._finish(conn, response(err.code, (err.message + "\n").encode(), TEXT, close=True), close=True)
                return True
            # Incomplete: a pipelined request begun behind an answer has its head clock run from now.
            if not conn.started:
                conn.started = True
                conn.deadline = self.clock() + self.limits.head_s
            return False
        head = bytes(conn.buf[:end])
        del conn.buf[:end]
        try:
            req = parse_head(head)
        except HttpError as err:
            log.debug("http %s: %d %s", conn.peer, err.code, err.message)
            self._finish(conn, response(err.code, (err.message + "\n").encode(), TEXT, close=True), close=True)
            return True
        if req is None:
            self._close(conn)
            return True
        out = b""
        if req.headers.get("expect", "").lower() == "100-continue" and req.version >= "HTTP/1.1":
            out = b"HTTP/1.1 100 Continue\r\n\r\n"
        if req.method != "GET":
            message = f"Unsupported method ({req.method!r})"
            log.debug('http "%s" 501', req.line)
            self._finish(conn, out + response(501, (message + "\n").encode(), TEXT, close=True,
                                              head=req.method == "HEAD"), close=True)
            return True
        code, body, content_type = self._answer(req)
        # Probes hit this every few seconds; access logs above debug would drown the health transitions.
        log.debug('http "%s" %d %d', req.line, code, len(body))
        if req.version == "HTTP/0.9":
            self._finish(conn, body, close=True)
        else:
            self._finish(conn, out + response(code, body, content_type), close=req.close)
        return True

    def _answer(self, req: Request) -> tuple[int, bytes, str]:
        path = req.path.split("?", 1)[0]
        if path == "/metrics":
            encoder, content_type = choose_encoder(req.headers.get("accept", ""))
            try:
                return 200, encoder(self.registry), content_type
            except Exception:  # a broken collector must not kill the server: say so and keep serving
                log.exception("metrics collection failed")
                return 500, b"metrics collection failed\n", TEXT
        if path in ("/healthz", "/livez"):
            ok, text = self.probes.liveness()
            return (200 if ok else 503), (text + "\n").encode(), TEXT
        if path == "/readyz":
            ok, text = self.probes.readiness()
            return (200 if ok else 503), (text + "\n").encode(), TEXT
        return 404, NOT_FOUND, TEXT

    def _finish(self, conn: _Conn, data: bytes, *, close: bool) -> None:
        conn.out += data
        conn.close_after = close
        self._set_phase(conn, WRITE, self.clock() + self.limits.send_s)
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        now = self.clock()  # before the client can have the answer: the next deadline counts from here
        while conn.out:
            try:
                sent = conn.sock.send(conn.out)
            except BlockingIOError:
                return  # the selector says when there is room again
            del conn.out[:sent]
        if conn.close_after:
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                self._close(conn)
                return
            self._set_phase(conn, LINGER, now + self.limits.linger_s)
            return
        conn.started = False  # until the next request's first byte (or one already here: _serve_one)
        self._set_phase(conn, READ, now + self.limits.idle_s)

    def _linger(self, conn: _Conn) -> None:
        try:
            n = conn.sock.recv_into(self._scratch)
        except BlockingIOError:
            return
        conn.lingered += n
        if n == 0 or conn.lingered > LINGER_BYTES:
            self._close(conn)


class MetricsServer:
    """Serves the registry and the probes on ``HOST:PORT`` from a thread of its own; port 0 picks a free port."""

    def __init__(self, address: str, registry: Collector, probes: ProbeSource, *, limits: Limits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        host, port = split_host_port(address)
        self.requested = (host, port)
        self.registry = registry
        self.probes = probes
        self.limits = limits or Limits()
        self.clock = clock
        self._loop: _Loop | None = None
        self._port = 0
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    @property
    def port(self) -> int:
        if self._loop is None:
            raise RuntimeError("metrics server not started")
        return self._port

    def connections(self) -> int:
        """Connections open now."""
        return len(self._loop.conns) if self._loop is not None else 0

    def start(self, busy_ok: bool = False) -> None:
        """``busy_ok``: a port in use is expected (a successor on the host's network, whose predecessor holds it
        until the hand-over) and logged as such; the caller starts again later."""
        host, port = self.requested
        try:
            listener = _listen(host, port)
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
        self._port = int(listener.getsockname()[1])
        self._loop = _Loop(listener, self.registry, self.probes, self.limits, self.clock)
        self._thread = threading.Thread(target=self._loop.run, name="metrics-http", daemon=True)
        self._thread.start()
        log.info("serving /metrics, /healthz and /readyz on %s:%d", host or "*", self._port)

    def stop(self) -> None:
        """Close the listener and every connection still open."""
        if self._loop is not None:
            self._loop.stop()
        if self._thread is not None:
            self._thread.join(2.0)
            if self._thread.is_alive():
                log.warning("metrics server thread did not stop within 2 s")


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted plugin rebinds past TIME_WAIT
        # Inherited by every accepted socket, set before listen() so the window is offered to match. Kernel
        # socket memory is charged to the container's memory cgroup like RSS: without a bound, a client that
        # sends a pipeline and reads nothing pins megabytes in each direction (autotuning grows both buffers).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_RCVBUF)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_SNDBUF)
        sock.bind((host, port))
        # A scraper's SYN dropped on a full accept queue is retried only a second later: a deep queue (kernel
        # memory, none of ours) means a flood must hold over a thousand connections before a scrape waits for that.
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
