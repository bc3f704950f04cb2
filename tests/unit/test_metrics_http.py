"""The metrics HTTP server on the wire: keep-alive and pipelining, the answers to every path and method, malformed,
oversized, slow and vanishing clients, and stop() closing what is still open. Raw sockets on loopback, so every
byte the server writes is seen."""

from __future__ import annotations

import email.utils
import http.client
import logging
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from types import SimpleNamespace

import pytest

from plugin.health.node_state import NodeState
from plugin.outlets.metrics import MetricsServer, Probes, Sources, build_registry
from plugin.serve import http as server
from plugin.serve.exposition import Family, GaugeFamily

WAIT = 10.0


@pytest.fixture
def srv() -> Iterator[MetricsServer]:
    # A supervisor that is registered, and no health loops.
    registered = SimpleNamespace(record=SimpleNamespace(registered=True, registrations=1, last_error=""),
                                 failure=lambda: None)
    s = MetricsServer("127.0.0.1:0", build_registry(Sources(NodeState())), Probes(None, registered, 30.0))
    s.start()
    yield s
    s.stop()


def connect(s: MetricsServer, host: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection((host, s.port), timeout=WAIT)


def read_response(sock: socket.socket, buf: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One response off ``sock`` (``buf`` holds what was read past it)."""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        assert data, f"connection closed mid-response: {bytes(buf)!r}"
        buf += data
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    length = int(headers["content-length"])
    while len(rest) < length:
        data = sock.recv(65536)
        assert data
        rest += data
    buf[:] = rest[length:]
    assert status.startswith("HTTP/1.1 "), status
    return int(status.split()[1]), headers, rest[:length]


def closed(sock: socket.socket, within: float = WAIT) -> bool:
    """Whether the server closes the connection (EOF, or a reset) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def ends(sock: socket.socket) -> bool:
    """Whether the server ends the connection, after whatever it had already written is read."""
    sock.settimeout(WAIT)
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def exchange(s: MetricsServer, data: bytes, *, wait_close: bool = False) -> tuple[int, dict[str, str], bytes, bool]:
    """One request on a connection of its own; with ``wait_close``, also whether the server then closes it."""
    with connect(s) as sock:
        sock.sendall(data)
        code, headers, body = read_response(sock, bytearray())
        return code, headers, body, closed(sock) if wait_close else False


def test_keep_alive_serves_requests_one_after_another_on_one_connection(srv: MetricsServer) -> None:
    with connect(srv) as sock:
        buf = bytearray()
        for path, want in (("/metrics", 200), ("/healthz", 200), ("/readyz", 200), ("/nope", 404), ("/metrics", 200)):
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            code, headers, body = read_response(sock, buf)
            assert code == want and "connection" not in headers
        assert body.startswith(b"# HELP gpu_health_device_state ")
        assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"


def test_pipelined_requests_are_answered_in_order(srv: MetricsServer) -> None:
    with connect(srv) as sock:
        sock.sendall(b"GET /readyz HTTP/1.1\r\n\r\nGET /nope HTTP/1.1\r\n\r\nGET /livez HTTP/1.1\r\n"
                     b"Connection: close\r\n\r\n")
        buf = bytearray()
        answers = [read_response(sock, buf) for _ in range(3)]
        assert [a[0] for a in answers] == [200, 404, 200]
        assert answers[0][2] == b"ok: registered with the kubelet (1 registrations)\n"
        assert answers[1][2] == b"not found: try /metrics, /healthz or /readyz\n"
        assert closed(sock)


def test_http_client_reuses_its_connection(srv: MetricsServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=WAIT)
    try:
        conn.request("GET", "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        resp = conn.getresponse()
        body = resp.read()
        first = conn.sock
        assert resp.status == 200 and body.endswith(b"# EOF\n")
        assert resp.getheader("Content-Type") == ("application/openmetrics-text; version=1.0.0; charset=utf-8; "
                                                  "escaping=underscores")
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == b"ok: no health loops configured\n"
        assert conn.sock is first
        date = resp.getheader("Date")
        assert date is not None and abs(email.utils.parsedate_to_datetime(date).timestamp() - time.time()) < 60
    finally:
        conn.close()


@pytest.mark.parametrize(("request_bytes", "code", "body"), [
    (b"garbage\r\n\r\n", 400, b"Bad request syntax ('garbage')\n"),
    (b"GET / HTTP/1.x\r\n\r\n", 400, b"Bad request version ('HTTP/1.x')\n"),
    (b"GET / HTTP/1.1 extra\r\n\r\n", 400, b"Bad request version ('extra')\n"),
    (b"GET / x HTTP/1.1\r\n\r\n", 400, b"Bad request syntax ('GET / x HTTP/1.1')\n"),
    (b"POST /x\r\n\r\n", 400, b"Bad HTTP/0.9 request type ('POST')\n"),
    (b"GET /metrics HTTP/2.0\r\n\r\n", 505, b"Invalid HTTP version (2.0)\n"),
    (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 501, b"Unsupported method ('POST')\n"),
    (b"get /metrics HTTP/1.1\r\n\r\n", 501, b"Unsupported method ('get')\n"),
    (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414, b"Request-URI Too Long\n"),
    (b"GET / HTTP/1.1\r\nX: " + b"y" * 70_000 + b"\r\n\r\n", 431, b"Request header fields too large\n"),
    (b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 100 + b"\r\n", 431, b"Too many headers\n"),
    # Three header lines of 4 KB: each far below a line limit, together over the head's 8 KiB.
    (b"GET / HTTP/1.1\r\n" + (b"X: " + b"y" * 4000 + b"\r\n") * 3 + b"\r\n", 431,
     b"Request header fields too large\n"),
])
def test_bad_requests_are_answered_and_the_connection_closed(srv: MetricsServer, request_bytes: bytes, code: int,
                                                             body: bytes) -> None:
    got, headers, text, was_closed = exchange(srv, request_bytes, wait_close=True)
    assert (got, text) == (code, body)
    assert headers["connection"] == "close" and was_closed
    # The server is none the worse for it.
    assert exchange(srv, b"GET /healthz HTTP/1.1\r\n\r\n")[0] == 200


def test_ninety_nine_headers_are_fine(srv: MetricsServer) -> None:
    assert exchange(srv, b"GET /healthz HTTP/1.1\r\n" + b"X: y\r\n" * 99 + b"\r\n")[0] == 200


def test_a_head_of_exactly_the_cap_is_fine(srv: MetricsServer) -> None:
    head = b"GET /healthz HTTP/1.1\r\nX: \r\n\r\n"
    head = head.replace(b"X: ", b"X: " + b"y" * (server.MAX_HEAD_BYTES - len(head)))
    assert len(head) == server.MAX_HEAD_BYTES == 8192
    assert exchange(srv, head)[0] == 200


def test_head_is_not_implemented_and_has_no_body(srv: MetricsServer) -> None:
    with connect(srv) as sock:
        sock.sendall(b"HEAD /metrics HTTP/1.1\r\n\r\n")
        sock.settimeout(WAIT)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 501 ") and b"Content-Length: 28" in head and rest == b""


def test_http_1_0_closes_unless_asked_to_keep_alive(srv: MetricsServer) -> None:
    code, headers, _, was_closed = exchange(srv, b"GET /healthz HTTP/1.0\r\n\r\n", wait_close=True)
    assert code == 200 and was_closed and "connection" not in headers
    with connect(srv) as sock:
        sock.sendall(b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        assert read_response(sock, bytearray())[0] == 200
        assert not closed(sock, within=0.3)


def test_http_0_9_gets_the_bare_body(srv: MetricsServer) -> None:
    with connect(srv) as sock:
        sock.sendall(b"GET /healthz\r\n\r\n")
        sock.settimeout(WAIT)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data == b"ok: no health loops configured\n"


def test_expect_100_continue_and_path_forms(srv: MetricsServer) -> None:
    with connect(srv) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nExpect: 100-continue\r\n\r\n")
        buf = bytearray()
        while len(buf) < 25:
            buf += sock.recv(65536)
        assert bytes(buf).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        del buf[:25]
        assert read_response(sock, buf)[0] == 200
    assert exchange(srv, b"GET //metrics HTTP/1.1\r\n\r\n")[0] == 200  # as http.server reduced it
    assert exchange(srv, b"GET /metrics?name=x HTTP/1.1\r\n\r\n")[0] == 200
    assert exchange(srv, b"GET http://x/metrics HTTP/1.1\r\n\r\n")[0] == 404
    # A folded Accept header still asks for OpenMetrics.
    _, headers, body, _ = exchange(srv, b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;\r\n"
                                        b" version=1.0.0\r\n\r\n")
    assert headers["content-type"].startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_client_that_vanishes_mid_request_costs_nothing(srv: MetricsServer, caplog: pytest.LogCaptureFixture,
                                                          capfd: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.DEBUG, logger="plugin.serve.http")
    for partial in (b"GET /metrics HTTP/1.1\r\nAcc", b"GET /met", b"G"):
        with connect(srv) as sock:
            sock.sendall(partial)
    # One that resets the connection while the server writes a large answer to it.
    sock = connect(srv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.sendall(b"GET /metrics HTTP/1.1\r\n\r\n" * 50)
    sock.close()
    assert exchange(srv, b"GET /healthz HTTP/1.1\r\n\r\n")[0] == 200
    assert errors(caplog) == []
    assert "Traceback" not in capfd.readouterr().err


class FakeClock:
    """The server's monotonic clock, moved by the test: a deadline passes when the test says so, never by waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def start(limits: server.Limits, clock: FakeClock | None = None) -> MetricsServer:
    s = MetricsServer("127.0.0.1:0", build_registry(Sources(NodeState()), process=False), Probes(None, None, 30.0),
                      limits=limits, clock=clock or time.monotonic)
    s.start()
    return s


def test_a_dribbling_client_is_cut_at_the_head_deadline_and_does_not_hold_up_another() -> None:
    clock = FakeClock()
    s = start(server.Limits(head_s=1.0), clock)
    try:
        with connect(s) as loris:
            loris.sendall(b"GET /metrics HTTP/1.1\r\n")
            # Connections are accepted in order: once a later one is answered, the clock of this one runs.
            assert exchange(s, b"GET /healthz HTTP/1.1\r\n\r\n")[0] == 200
            # A header line every 0.4 s: each gap is well inside the deadline, as a per-recv timeout would see it.
            for _ in range(3):
                clock.now += 0.4
                loris.sendall(b"X-Slow: y\r\n")
                assert exchange(s, b"GET /metrics HTTP/1.1\r\n\r\n")[0] == 200  # meanwhile, others are served
            # 1.2 s after the connection opened, its head still incomplete: answered 408 and closed.
            code, headers, _ = read_response(loris, bytearray())
            assert code == 408 and headers["connection"] == "close"
            assert closed(loris)
    finally:
        s.stop()


def test_a_connection_that_never_sends_is_closed_at_the_head_deadline() -> None:
    clock = FakeClock()
    s = start(server.Limits(head_s=1.0, idle_s=600.0), clock)
    try:
        with connect(s) as silent:
            assert exchange(s, b"GET /healthz HTTP/1.1\r\n\r\n")[0] == 200  # the silent one is accepted by now
            clock.now += 1.5
            assert closed(silent)  # not the keep-alive idle time: no request came at all
    finally:
        s.stop()


def test_an_idle_keep_alive_connection_is_closed_after_a_while() -> None:
    clock = FakeClock()
    s = start(server.Limits(head_s=1.0, idle_s=5.0), clock)
    try:
        with connect(s) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
            assert read_response(sock, bytearray())[0] == 200
            clock.now += 4.0  # past the head deadline, within the idle one: kept
            sock.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
            assert read_response(sock, bytearray())[0] == 200
            clock.now += 5.5
            assert closed(sock)
    finally:
        s.stop()


def test_connections_beyond_the_cap_get_no_thread_and_the_longest_waiting_is_closed() -> None:
    s = start(server.Limits(connections=4))
    socks: list[socket.socket] = []
    try:
        threads = threading.active_count()
        for _ in range(4):
            socks.append(connect(s))
            socks[-1].sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
            assert read_response(socks[-1], bytearray())[0] == 200  # accepted, now idle on keep-alive
        assert s.connections() == 4 and threading.active_count() == threads
        # The fifth is served: the one that has waited longest for its next request makes room.
        code, _, _, _ = exchange(s, b"GET /metrics HTTP/1.1\r\n\r\n")
        assert code == 200
        assert closed(socks[0])
        assert threading.active_count() == threads
        for sock in socks[1:]:
            sock.sendall(b"GET /readyz HTTP/1.1\r\n\r\n")
        # Forty more, silent: none gets a thread, the server never holds more than four.
        more = [connect(s) for _ in range(40)]
        socks += more
        assert exchange(s, b"GET /healthz HTTP/1.1\r\n\r\n")[0] == 200
        assert s.connections() <= 4 and threading.active_count() == threads
        assert sum(closed(sock) for sock in more[:36]) == 36  # the oldest make way for the newest
    finally:
        for sock in socks:
            sock.close()
        s.stop()


class Big:
    """A registry whose answer is about a megabyte: a few of them fill every socket buffer on the way."""

    def collect(self) -> Iterable[Family]:
        family = GaugeFamily("big", "filler", labels=["i"])
        for i in range(20_000):
            family.add_metric([f"{i:040d}"], i)
        yield family


def test_a_client_that_never_reads_its_answers_is_cut_at_the_send_deadline() -> None:
    clock = FakeClock()
    s = MetricsServer("127.0.0.1:0", Big(), Probes(None, None, 30.0),
                      limits=server.Limits(head_s=600.0, idle_s=600.0, send_s=5.0), clock=clock)
    s.start()
    try:
        with socket.socket() as hog:
            # Its own window small and fixed, the server's send buffer bounded: the first answer cannot all leave.
            hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            hog.connect(("127.0.0.1", s.port))
            hog.setblocking(False)
            hog.send(b"GET /metrics HTTP/1.1\r\n\r\n" * 40)  # 40 answers of a megabyte, never read
            assert exchange(s, b"GET /healthz HTTP/1.1\r\n\r\n")[0] == 200  # others are served meanwhile
            clock.now += 6.0  # its answer stuck for longer than the send deadline: cut off
            hog.setblocking(True)
            assert ends(hog)
    finally:
        s.stop()


def test_stop_closes_open_connections(srv: MetricsServer) -> None:
    with connect(srv) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
        assert read_response(sock, bytearray())[0] == 200
        srv.stop()
        assert closed(sock, within=5.0)


class Broken:
    def collect(self) -> Iterable[Family]:
        raise RuntimeError("boom")


def test_a_broken_collector_is_a_500_and_the_connection_stays(caplog: pytest.LogCaptureFixture) -> None:
    s = MetricsServer("127.0.0.1:0", Broken(), Probes(None, None, 30.0))
    s.start()
    try:
        with connect(s) as sock:
            buf = bytearray()
            sock.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
            assert read_response(sock, buf)[:3:2] == (500, b"metrics collection failed\n")
            sock.sendall(b"GET /readyz HTTP/1.1\r\n\r\n")
            assert read_response(sock, buf)[0] == 503
        assert "metrics collection failed" in errors(caplog)
    finally:
        s.stop()


def test_a_port_in_use_is_logged_and_survived(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        s = MetricsServer(f"127.0.0.1:{taken.getsockname()[1]}", Broken(), Probes(None, None, 30.0))
        s.start()
        assert s.error is not None and "cannot serve metrics on 127.0.0.1:" in s.error
        assert any("continuing without /metrics" in m for m in errors(caplog))
        with pytest.raises(RuntimeError):
            _ = s.port
        s.stop()


def test_ipv6_loopback_keeps_alive() -> None:
    s = MetricsServer("[::1]:0", build_registry(Sources(NodeState()), process=False), Probes(None, None, 30.0))
    try:
        s.start()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        if s.error is not None:
            pytest.skip(f"no IPv6 loopback here: {s.error}")
        with connect(s, "::1") as sock:
            buf = bytearray()
            for _ in range(2):
                sock.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
                assert read_response(sock, buf)[0] == 200
    finally:
        s.stop()


def test_the_http_date_is_rfc_7231() -> None:
    for t in (0.0, 951_782_400.0, time.time()):
        assert server.http_date(t) == email.utils.formatdate(t, usegmt=True)
