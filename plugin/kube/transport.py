"""The HTTP under the API client: one kept-alive HTTP/1.1 connection, opened again when the server closed it; one
request at a time, so threads may share it; a watch on a connection of its own. Every failure is :class:`ApiFailure`.

A call's timeout bounds the whole call, connect to the answer's last byte, not each read: the controller's fencing
(docs/fleet.md) counts on a write being given up within it. A write also carries it as the API server's ``timeout``
parameter, so that the server gives up on it too instead of working on for its own minute."""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from plugin.kube.config import Target
from plugin.kube.errors import ApiFailure, one_line

if TYPE_CHECKING:
    import http.client

log = logging.getLogger(__name__)


class Transport:
    def __init__(self, target: Target, timeout_s: float, component: str) -> None:
        self._target = target
        self._timeout_s = timeout_s
        self._component = component  # our User-Agent and field manager
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._watches: set[http.client.HTTPConnection] = set()

    def close(self) -> None:
        """Close the connection without waiting: a request in flight on another thread (a stopping outlet's) fails
        at once instead of holding the caller for up to the timeout. Open watches end too."""
        for conn in list(self._watches):
            _shut(conn)
        if self._lock.acquire(blocking=False):
            try:
                self._drop()
            finally:
                self._lock.release()
            return
        if self._conn is not None:
            _shut(self._conn)  # wakes the thread blocked on it, which then drops the connection



    def watch(self, path: str, query: Mapping[str, str], read_timeout_s: float) -> Iterator[dict[str, Any]]:
        """A watch: the events of ``GET path?watch=1&...`` one by one, on a connection of its own (a watch holds its
        connection for minutes; the calls must not queue behind it). Ends when the server ends the stream; a
        failure to connect or a non-2xx answer is :class:`ApiFailure`, and so is a broken stream. ``close()`` from
        another thread ends it."""
        import http.client

        t = self._target
        url = t.prefix + path + "?" + urlencode({**query, "watch": "1"})
        headers = {"Accept": "application/json", "User-Agent": self._component}
        auth = t.auth.header()
        if auth:
            headers["Authorization"] = auth
        conn: http.client.HTTPConnection
        if t.tls is None:
            conn = http.client.HTTPConnection(t.host, t.port, timeout=read_timeout_s)
        else:
            conn = http.client.HTTPSConnection(t.host, t.port, timeout=read_timeout_s, context=t.tls)
        with self._lock:
            self._watches.add(conn)
        try:
            try:
                conn.request("GET", url, headers=headers)
                resp = conn.getresponse()
            except Exception as exc:
                raise ApiFailure(None, f"{type(exc).__name__}: {one_line(str(exc))}") from None
            if not 200 <= resp.status < 300:
                if resp.status == 401:
                    t.auth.reread()
                data = resp.read()
                raise ApiFailure(resp.status, _status_message(data) or resp.reason or "no reason given",
                                 _seconds(resp.getheader("Retry-After")))
            while True:
                try:
                    line = resp.readline()
                except Exception as exc:
                    raise ApiFailure(None, f"watch stream broke: {type(exc).__name__}: {one_line(str(exc))}") \
                        from None
                if not line:
                    return
                if line.strip():
                    try:
                        event = json.loads(line)
                    except ValueError:
                        raise ApiFailure(None, "watch stream broke: a line that is not JSON") from None
                    if isinstance(event, dict):
                        yield event
        finally:
            with self._lock:
                self._watches.discard(conn)
            conn.close()

    def request(self, method: str, path: str, body: Any = None, content_type: str | None = None,
                query: Mapping[str, str] | None = None) -> dict[str, Any]:
        """One call: the decoded JSON answer, or :class:`ApiFailure`."""
        t = self._target
        url = t.prefix + path
        params = dict(query or {})
        if method != "GET":
            params["fieldManager"] = self._component
            params["timeout"] = f"{max(1, int(self._timeout_s * 1000))}ms"
        if params:
            url += "?" + urlencode(params)
        payload = json.dumps(body, separators=(",", ":")).encode() if body is not None else None
        headers = {"Accept": "application/json", "User-Agent": self._component}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            with self._lock:
                status, reason, retry_after, data = self._send(method, url, payload, headers, t.auth.header())
                if status == 401 and t.auth.reread():
                    # The token file may hold a newer token than the one just refused.
                    status, reason, retry_after, data = self._send(method, url, payload, headers, t.auth.header())
            # One line per call at debug only: at info an idle fleet's log pipeline would carry every API call.
            log.debug("%s %s: %d %s", method, url, status, reason)
            if 200 <= status < 300:
                doc = json.loads(data) if data else {}
                return doc if isinstance(doc, dict) else {}
        except Exception as exc:  # refused, reset, timeout, TLS, DNS, an unreadable token or body: "API trouble"
            raise ApiFailure(None, f"{type(exc).__name__}: {one_line(str(exc))}") from None
        raise ApiFailure(status, _status_message(data) or reason or "no reason given", _seconds(retry_after))

    def _send(self, method: str, url: str, payload: bytes | None, headers: dict[str, str],
              auth: str | None) -> tuple[int, str, str | None, bytes]:
        if auth:
            headers = {**headers, "Authorization": auth}
        deadline = time.monotonic() + self._timeout_s
        for attempt in range(2):
            if self._conn is not None and _closed_by_peer(self._conn):
                self._drop()  # the server (or a load balancer) closed it while idle: not an error
            reused = self._conn is not None and self._conn.sock is not None
            conn = self._connection()
            try:
                if conn.sock is None:
                    conn.timeout = max(0.001, deadline - time.monotonic())  # the connect's share of the call
                _left(conn, deadline)
                conn.request(method, url, body=payload, headers=headers)
            except ConnectionError:
                self._drop()
                # The peer closed a kept-alive connection under us: the request never reached it, so a fresh
                # connection may carry it. A fresh connection that fails this way is the server's answer.
                if reused and attempt == 0:
                    continue
                raise
            except BaseException:
                self._drop()
                raise
            try:
                _left(conn, deadline)
                resp = conn.getresponse()
                data = _read(resp, conn, deadline)
            except BaseException:
                self._drop()  # sent, perhaps acted on: never sent again
                raise
            if resp.will_close:
                self._drop()
            return resp.status, resp.reason, resp.getheader("Retry-After"), data
        raise AssertionError("unreachable")

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            # Here, not at the top: http.client brings the email package (about 2 MiB), which a plugin that does
            # not report to the cluster should not carry.
            import http.client

            t = self._target
            if t.tls is None:
                self._conn = http.client.HTTPConnection(t.host, t.port, timeout=self._timeout_s)
            else:
                self._conn = http.client.HTTPSConnection(t.host, t.port, timeout=self._timeout_s, context=t.tls)
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None



def _left(conn: http.client.HTTPConnection, deadline: float) -> None:
    """What is left of the call's time becomes the socket's timeout for the next read; none left is a timeout."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    if conn.sock is not None:
        conn.sock.settimeout(left)


def _read(resp: http.client.HTTPResponse, conn: http.client.HTTPConnection, deadline: float) -> bytes:
    """The body in chunks, the time left checked between them: a server trickling its answer cannot stretch the
    call past its timeout one slow read at a time."""
    chunks = []
    while chunk := resp.read1(65536):
        chunks.append(chunk)
        if resp.length != 0:  # 0: the whole body is in, no further read to bound
            _left(conn, deadline)
    chunks.append(resp.read())  # nothing left to read: it closes the answer, so the connection takes the next call
    return b"".join(chunks)


def _shut(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _closed_by_peer(conn: http.client.HTTPConnection) -> bool:
    """An idle kept-alive connection that is readable has been closed (or spoken to out of turn) by the peer."""
    sock = conn.sock
    if sock is None:
        return False
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


def _status_message(data: bytes) -> str:
    """The ``message`` of the API server's Status body, if the body is one."""
    try:
        doc = json.loads(data)
    except ValueError:
        return ""
    message = doc.get("message") if isinstance(doc, dict) else None
    return one_line(message) if isinstance(message, str) else ""



def _seconds(v: str | None) -> float | None:
    try:
        return max(0.0, float(v)) if v else None
    except ValueError:
        return None  # an HTTP date: rare from the API server, and the back-off still applies
