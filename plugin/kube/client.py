"""The Kubernetes API as the cluster outlets use it: the calls they make, the views they read back, and the one
error type every failure becomes (:class:`ApiFailure`, with the HTTP status and ``Retry-After`` when there is one).

The outlets depend on small protocols (:class:`KubeApi` for the node reporter, :class:`PodApi` for pod
correlation, :class:`SliceApi` and :class:`ClaimApi` for the DRA driver); tests hand them fakes. :class:`KubeClient`
implements them all.

Why a client of our own on the standard library (issue 14): the plugin makes a handful of calls (read a Node or a
Pod; merge-patch annotations; strategic-merge-patch the node condition; create and patch Events; evict a Pod), and a
general client library with its HTTP stack cost about 6 MiB of resident memory for them. What it supports:

- in a Pod: the service account (``KUBERNETES_SERVICE_HOST``/``_PORT``, its ``ca.crt``, its token read again every
  minute and after a 401, since bound tokens rotate);
- a kubeconfig file: the current context's cluster (``server``, ``certificate-authority``/``-data``,
  ``insecure-skip-tls-verify``) and user (``token``, ``tokenFile``, ``client-certificate``/``-key`` and their
  ``-data``, ``username``/``password``); relative paths are relative to the file's directory, as kubectl reads them.
  Exec credential plugins, ``auth-provider`` and ``proxy-url`` are refused when the client is built, naming what;
  HTTP proxies from the environment are not used;
- one kept-alive HTTP/1.1 connection per client, opened again when the server closed it, with a timeout on connect
  and on every read; one request at a time, so threads may share a client.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import select
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote, urlencode, urlsplit

from plugin.kube.names import COMPONENT

if TYPE_CHECKING:
    import http.client

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
JSON = "application/json"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
STRICT = {"fieldValidation": "Strict"}


class ApiFailure(Exception):
    def __init__(self, status: int | None, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


@dataclass(frozen=True)
class NodeView:
    """What we know of the Node on the server: enough to compute patches and address Events."""

    name: str
    uid: str
    resource_version: str
    annotations: dict[str, str]
    conditions: list[dict[str, Any]] = field(default_factory=list)


class KubeApi(Protocol):
    def get_node(self, name: str) -> NodeView: ...
    def patch_node_annotations(self, name: str, patch: Mapping[str, str | None],
                               resource_version: str | None) -> NodeView: ...
    def patch_node_condition(self, name: str, condition: Mapping[str, str]) -> NodeView: ...
    def create_event(self, namespace: str, body: Mapping[str, Any]) -> str: ...
    def patch_event(self, namespace: str, name: str, body: Mapping[str, Any]) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class PodView:
    uid: str
    node_name: str


class PodApi(Protocol):
    def get_pod(self, namespace: str, name: str) -> PodView: ...
    def create_event(self, namespace: str, body: Mapping[str, Any]) -> str: ...
    def patch_pod_annotations(self, namespace: str, name: str, annotations: Mapping[str, str | None]) -> None: ...
    def evict_pod(self, namespace: str, name: str, uid: str) -> None: ...
    def close(self) -> None: ...


class SliceApi(Protocol):
    """What the ResourceSlice writer calls (DRA driver mode)."""

    def get_node(self, name: str) -> NodeView: ...
    def get_resource_slice(self, name: str) -> dict[str, Any] | None: ...
    def create_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]: ...
    def update_resource_slice(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]: ...
    def delete_resource_slice(self, name: str) -> None: ...
    def close(self) -> None: ...


class ClaimApi(Protocol):
    """What the DRA driver reads when the kubelet asks it to prepare a claim."""

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...
    def close(self) -> None: ...


SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# How long a token read from a file is used before the file is read again: the kubelet rotates a projected
# service-account token well before it expires, and the API server counts requests that still carry the old one as
# stale (serviceaccount_stale_tokens_total). client-go reads the file once a minute; so do we. A 401 reads it at once
# too, and sends the request again once when the token changed (as the client before ours did).
TOKEN_REFRESH_S = 60.0


class KubeClient:
    """The protocols above over one keep-alive HTTP(S) connection: in-cluster service-account
    config, or a kubeconfig file outside. Safe to share between threads (one request at a time)."""

    def __init__(self, kubeconfig: Path | None = None, timeout_s: float = 10.0,
                 service_account: Path = SERVICE_ACCOUNT, component: str = COMPONENT) -> None:
        try:
            if kubeconfig is not None:
                self._target = _from_kubeconfig(Path(kubeconfig).expanduser())
            else:
                self._target = _from_service_account(service_account)
        except Exception as exc:  # any malformed input: the caller sees one kind of failure, with its cause
            where = f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster service account (or --kubeconfig)"
            detail = str(exc) if isinstance(exc, _ConfigError) else f"{type(exc).__name__}: {exc}"
            raise ApiFailure(None, f"cannot configure a Kubernetes client from {where}: {_one_line(detail)}") from None
        self._timeout_s = timeout_s
        self._component = component  # our User-Agent and field manager
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._watches: set[http.client.HTTPConnection] = set()

    # The calls ------------------------------------------------------------------------------------------------

    def get_node(self, name: str) -> NodeView:
        return _node_view(self._request("GET", f"/api/v1/nodes/{_q(name)}"))

    def patch_node_annotations(self, name: str, patch: Mapping[str, str | None],
                               resource_version: str | None) -> NodeView:
        meta: dict[str, Any] = {"annotations": dict(patch)}
        if resource_version:
            meta["resourceVersion"] = resource_version  # a precondition: 409 if the node moved on
        return _node_view(self._request("PATCH", f"/api/v1/nodes/{_q(name)}", {"metadata": meta}, MERGE_PATCH))

    def patch_node_condition(self, name: str, condition: Mapping[str, str]) -> NodeView:
        # Strategic merge on conditions (merge key: type) touches our condition only.
        body = {"status": {"conditions": [dict(condition)]}}
        return _node_view(self._request("PATCH", f"/api/v1/nodes/{_q(name)}/status", body, STRATEGIC_PATCH))

    def create_event(self, namespace: str, body: Mapping[str, Any]) -> str:
        event = {"apiVersion": "v1", "kind": "Event", **body}
        created = self._request("POST", f"/api/v1/namespaces/{_q(namespace)}/events", event, JSON)
        return str((created.get("metadata") or {}).get("name"))

    def patch_event(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        self._request("PATCH", f"/api/v1/namespaces/{_q(namespace)}/events/{_q(name)}", dict(body), MERGE_PATCH)

    def get_pod(self, namespace: str, name: str) -> PodView:
        pod = self._request("GET", f"/api/v1/namespaces/{_q(namespace)}/pods/{_q(name)}")
        return PodView(uid=(pod.get("metadata") or {}).get("uid") or "",
                       node_name=(pod.get("spec") or {}).get("nodeName") or "")

    def patch_pod_annotations(self, namespace: str, name: str, annotations: Mapping[str, str | None]) -> None:
        body = {"metadata": {"annotations": dict(annotations)}}
        self._request("PATCH", f"/api/v1/namespaces/{_q(namespace)}/pods/{_q(name)}", body, MERGE_PATCH)

    def evict_pod(self, namespace: str, name: str, uid: str) -> None:
        body: dict[str, Any] = {"apiVersion": "policy/v1", "kind": "Eviction",
                                "metadata": {"name": name, "namespace": namespace}}
        if uid:
            # The UID precondition: never evict a new pod that took the old one's name after our lookup.
            body["deleteOptions"] = {"kind": "DeleteOptions", "preconditions": {"uid": uid}}
        self._request("POST", f"/api/v1/namespaces/{_q(namespace)}/pods/{_q(name)}/eviction", body, JSON)

    def get_resource_slice(self, name: str) -> dict[str, Any] | None:
        try:
            return self._request("GET", f"{SLICES}/{_q(name)}")
        except ApiFailure as f:
            if f.status == 404:
                return None
            raise

    def create_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        # Strict: a field the server does not know is refused instead of dropped, so a mistake in our body fails
        # once, loudly, rather than making every comparison with the stored copy differ.
        return self._request("POST", SLICES, dict(body), JSON, STRICT)

    def update_resource_slice(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        # A PUT, not a patch: the slice is ours whole, and the body's metadata.resourceVersion makes a write from
        # a stale read fail with 409.
        return self._request("PUT", f"{SLICES}/{_q(name)}", dict(body), JSON, STRICT)

    def delete_resource_slice(self, name: str) -> None:
        try:
            self._request("DELETE", f"{SLICES}/{_q(name)}")
        except ApiFailure as f:
            if f.status != 404:  # already gone is what we wanted
                raise

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        return self._request("GET", f"/apis/resource.k8s.io/v1/namespaces/{_q(namespace)}/resourceclaims/{_q(name)}")

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

    def request(self, method: str, path: str, body: Any = None, content_type: str | None = None,
                query: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Any other call, for a client (the fleet controller) that builds its own: the decoded JSON answer, or
        :class:`ApiFailure`."""
        return self._request(method, path, body, content_type, query)

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
                raise ApiFailure(None, f"{type(exc).__name__}: {_one_line(str(exc))}") from None
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
                    raise ApiFailure(None, f"watch stream broke: {type(exc).__name__}: {_one_line(str(exc))}") \
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

    # HTTP -----------------------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: Any = None, content_type: str | None = None,
                 query: Mapping[str, str] | None = None) -> dict[str, Any]:
        t = self._target
        url = t.prefix + path
        params = dict(query or {})
        if method != "GET":
            params["fieldManager"] = self._component
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
            raise ApiFailure(None, f"{type(exc).__name__}: {_one_line(str(exc))}") from None
        raise ApiFailure(status, _status_message(data) or reason or "no reason given", _seconds(retry_after))

    def _send(self, method: str, url: str, payload: bytes | None, headers: dict[str, str],
              auth: str | None) -> tuple[int, str, str | None, bytes]:
        if auth:
            headers = {**headers, "Authorization": auth}
        for attempt in range(2):
            if self._conn is not None and _closed_by_peer(self._conn):
                self._drop()  # the server (or a load balancer) closed it while idle: not an error
            reused = self._conn is not None and self._conn.sock is not None
            conn = self._connection()
            try:
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
                resp = conn.getresponse()
                data = resp.read()
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


# Configuration --------------------------------------------------------------------------------------------------


class _ConfigError(Exception):
    """A kubeconfig or service account we cannot use; the message says what and where."""


class _Auth:
    """The Authorization header: none, fixed (an inline token, basic), or a token file read again now and then."""

    def __init__(self, fixed: str | None = None, token_file: Path | None = None) -> None:
        self._fixed = fixed
        self._file = token_file
        self._bearer: str | None = None
        self._read_at = 0.0

    def header(self) -> str | None:
        if self._file is None:
            return self._fixed
        if self._bearer is None or time.monotonic() - self._read_at >= TOKEN_REFRESH_S:
            self._read()
        return self._bearer

    def reread(self) -> bool:
        """After a 401: read the token file again; True when it now holds another token (worth one more try)."""
        if self._file is None:
            return False
        before = self._bearer
        self._read()
        return self._bearer != before

    def _read(self) -> None:
        assert self._file is not None
        self._bearer = f"Bearer {self._file.read_text().strip()}"
        self._read_at = time.monotonic()


@dataclass(frozen=True)
class _Target:
    host: str
    port: int
    prefix: str  # a path the server lives under (an API proxy's), "" for most
    tls: ssl.SSLContext | None
    auth: _Auth


def _from_service_account(root: Path) -> _Target:
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise _ConfigError("KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set (not in a Pod?)")
    auth = _Auth(token_file=root / "token")
    auth.header()  # a missing token is a configuration failure now, not a failed request later
    tls = ssl.create_default_context(cafile=str(root / "ca.crt"))
    return _Target(host.strip("[]"), int(port), "", tls, auth)


def _from_kubeconfig(path: Path) -> _Target:
    import yaml  # only here: in a cluster the plugin reads no kubeconfig

    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict):
        raise _ConfigError("not a kubeconfig (no mapping at the top)")
    context_name = doc.get("current-context")
    if not context_name:
        raise _ConfigError("no current-context")
    context = _named(doc, "contexts", "context", context_name)
    cluster = _named(doc, "clusters", "cluster", context.get("cluster"))
    user = _named(doc, "users", "user", context["user"]) if context.get("user") else {}
    base = path.parent

    def file(key: str, section: dict[str, Any]) -> str:
        # Relative paths are relative to the kubeconfig's directory, as kubectl reads them.
        return str(base / str(section[key]))

    if cluster.get("proxy-url"):
        raise _ConfigError(f"cluster {context.get('cluster')!r}: proxy-url is not supported")
    url = urlsplit(str(cluster.get("server") or ""))
    if url.scheme not in ("http", "https") or not url.hostname:
        raise _ConfigError(f"cluster {context.get('cluster')!r}: server {cluster.get('server')!r} is not an "
                           "http(s) URL")
    tls: ssl.SSLContext | None = None
    if url.scheme == "https":
        if cluster.get("certificate-authority"):
            tls = ssl.create_default_context(cafile=file("certificate-authority", cluster))
        elif cluster.get("certificate-authority-data"):
            tls = ssl.create_default_context(cadata=_b64(cluster["certificate-authority-data"]).decode())
        elif cluster.get("insecure-skip-tls-verify"):
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            tls.check_hostname = False
            tls.verify_mode = ssl.CERT_NONE
        else:
            tls = ssl.create_default_context()
        if user.get("client-certificate") or user.get("client-certificate-data"):
            _load_client_cert(tls, user, file)
    user_name = context.get("user")
    if user.get("tokenFile"):
        auth = _Auth(token_file=Path(file("tokenFile", user)))
    elif user.get("token"):
        auth = _Auth(fixed=f"Bearer {user['token']}")
    elif user.get("exec"):
        raise _ConfigError(f"user {user_name!r}: exec credential plugins are not supported (use a token, a "
                           "tokenFile or a client certificate)")
    elif user.get("username") and user.get("password"):
        basic = base64.b64encode(f"{user['username']}:{user['password']}".encode()).decode()
        auth = _Auth(fixed=f"Basic {basic}")
    elif user.get("auth-provider"):
        raise _ConfigError(f"user {user_name!r}: auth-provider is not supported (use a token, a tokenFile or a "
                           "client certificate)")
    else:
        auth = _Auth()
    port = url.port or (443 if url.scheme == "https" else 80)
    return _Target(url.hostname, port, url.path.rstrip("/"), tls, auth)


def _named(doc: dict[str, Any], list_key: str, item_key: str, name: object) -> dict[str, Any]:
    for entry in doc.get(list_key) or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            item = entry.get(item_key) or {}
            if not isinstance(item, dict):
                break
            return item
    raise _ConfigError(f"{item_key} {name!r} not found in {list_key}")


def _load_client_cert(tls: ssl.SSLContext, user: dict[str, Any], file: Callable[[str, dict[str, Any]], str]) -> None:
    """ssl loads a certificate and key only from files: inline ones go to private temporary files, removed as soon
    as they are loaded."""
    written: list[str] = []
    try:
        paths = []
        for key in ("client-certificate", "client-key"):
            if user.get(f"{key}-data"):
                fd, name = tempfile.mkstemp(prefix="gpu-health-", suffix=".pem")  # mode 0600
                written.append(name)
                with os.fdopen(fd, "wb") as f:
                    f.write(_b64(user[f"{key}-data"]))
                paths.append(name)
            elif user.get(key):
                paths.append(file(key, user))
            else:
                raise _ConfigError(f"{key} (or {key}-data) is missing")
        tls.load_cert_chain(paths[0], paths[1])
    finally:
        for name in written:
            os.unlink(name)


def _b64(value: object) -> bytes:
    return base64.b64decode(str(value), validate=True)


# Helpers --------------------------------------------------------------------------------------------------------


def _node_view(doc: dict[str, Any]) -> NodeView:
    meta = doc.get("metadata") or {}
    conditions = (doc.get("status") or {}).get("conditions") or []
    return NodeView(name=meta.get("name") or "", uid=meta.get("uid") or "",
                    resource_version=meta.get("resourceVersion") or "",
                    annotations=dict(meta.get("annotations") or {}), conditions=[dict(c) for c in conditions])


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
    return _one_line(message) if isinstance(message, str) else ""


def _q(segment: str) -> str:
    return quote(segment, safe="")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _seconds(v: str | None) -> float | None:
    try:
        return max(0.0, float(v)) if v else None
    except ValueError:
        return None  # an HTTP date: rare from the API server, and the back-off still applies
