"""The Kubernetes API client (plugin/kube/client.py) over real HTTP on loopback: what the server receives for
each call, how every kind of failure is mapped, the kept-alive connection, and each way of configuring it
(kubeconfig tokens, client certificates over TLS, the in-cluster service account and its rotating token).

Node and Event calls go to the HTTP-level fake API server (tests/fakes/fake_apiserver.py); pods, TLS and the odd
cases to a small server here that answers what each test tells it to.
"""

from __future__ import annotations

import base64
import json
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from plugin.kube import config as kubeconfig_module
from plugin.kube.client import KubeClient
from plugin.kube.errors import ApiFailure
from plugin.kube.views import NodeView, PodView
from tests.fakes.fake_apiserver import FakeApiServer

FM = "fieldManager=gpu-health-device-plugin&timeout=10000ms"  # writes carry the client's timeout to the server
CONDITION = {"type": "GPUHealthy", "status": "True", "reason": "GPUsHealthy", "message": "8 of 8 healthy",
             "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}


# A server that answers as told --------------------------------------------------------------------------------


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    peer_cn: str | None


Answer = tuple[int, dict[str, str], bytes]


def ok(doc: dict[str, Any]) -> Answer:
    return 200, {"Content-Type": "application/json"}, json.dumps(doc).encode()


@dataclass
class TinyServer:
    """Loopback HTTP(S); ``respond(seen)`` makes each answer. ``close_idle`` closes every connection after its
    answer without saying so (as an API server's idle timeout or a load balancer does)."""

    respond: Callable[[Seen], Answer]
    tls: ssl.SSLContext | None = None
    close_idle: bool = False
    host: str = "127.0.0.1"
    seen: list[Seen] = field(default_factory=list)
    connections: int = 0
    closed: int = 0  # connections the server has closed
    changed: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def setup(self) -> None:
                srv.connections += 1
                super().setup()

            def _handle(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                cert = self.connection.getpeercert() if isinstance(self.connection, ssl.SSLSocket) else None
                cn = dict(x[0] for x in cert["subject"]).get("commonName") if cert else None
                seen = Seen(self.command, self.path, dict(self.headers), json.loads(raw) if raw else None, cn)
                srv.seen.append(seen)
                status, headers, data = srv.respond(seen)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                self.close_connection = srv.close_idle

            do_GET = do_PATCH = do_POST = do_PUT = do_DELETE = _handle

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET

        class Server(ThreadingHTTPServer):
            address_family = family
            daemon_threads = True

            def shutdown_request(self, request: Any) -> None:
                super().shutdown_request(request)
                with srv.changed:
                    srv.closed += 1
                    srv.changed.notify_all()

        self._server = Server((self.host, 0), Handler)
        if self.tls is not None:
            self._server.socket = self.tls.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        scheme = "https" if self.tls else "http"
        self.url = f"{scheme}://[{self.host}]:{self.port}" if ":" in self.host else f"{scheme}://{self.host}:{self.port}"
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def kubeconfig(directory: Path, cluster: dict[str, Any], user: dict[str, Any], name: str = "kubeconfig") -> Path:
    path = directory / name
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": cluster}], "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    return path


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


# Certificates: a throw-away CA, a server certificate for the loopback addresses, a client certificate ----------


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path

    def server_context(self, require_client_cert: bool = False) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.server_cert, self.server_key)
        if require_client_cert:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(cafile=str(self.ca))
        return ctx


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other-ca"):
        run("req", "-x509", *key, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2", "-subj", f"/CN={ca}")
    for who, cn, ext in (("server", "apiserver", "subjectAltName=IP:127.0.0.1,IP:::1\n"),
                         ("client", "plugin", "extendedKeyUsage=clientAuth\n")):
        (d / f"{who}.ext").write_text(ext)
        run("req", *key, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={cn}")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{who}.crt", "-days", "2", "-extfile", f"{who}.ext")
    return Pki(d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key",
               d / "other-ca.crt")


@pytest.fixture()
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer().start()
    server.add_node("n1", {"example.com/owner": "ops"})
    yield server
    server.stop()


def failure(call: Callable[[], object]) -> ApiFailure:
    with pytest.raises(ApiFailure) as info:
        call()
    return info.value


# Each call, as the API server receives it ---------------------------------------------------------------------


def test_node_and_event_calls_as_the_server_receives_them(api: FakeApiServer, tmp_path: Path) -> None:
    client = KubeClient(api.kubeconfig(tmp_path))
    try:
        view = client.get_node("n1")
        assert view == NodeView("n1", "uid-n1", "100", {"example.com/owner": "ops"}, api.conditions("n1"))
        after = client.patch_node_annotations("n1", {"gpu-health.io/gpu.0": "x", "example.com/owner": None}, "100")
        assert after.annotations == {"gpu-health.io/gpu.0": "x"} and after.resource_version == "101"
        client.patch_node_annotations("n1", {"gpu-health.io/gpu.0": "y"}, None)
        cond = client.patch_node_condition("n1", CONDITION)
        assert [c["type"] for c in cond.conditions] == ["Ready", "GPUHealthy"]
        body = {"metadata": {"generateName": "n1.gpu-health.", "namespace": "default"}, "reason": "GPUUnhealthy",
                "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "uid-n1"}, "count": 1}
        name = client.create_event("default", body)
        assert name == "n1.gpu-health.00001"
        client.patch_event("default", name, {"count": 2})
    finally:
        client.close()
    got = [(r.method, r.path, r.content_type, r.body) for r in api.requests]
    assert got == [
        ("GET", "/api/v1/nodes/n1", "", None),
        ("PATCH", f"/api/v1/nodes/n1?{FM}", "application/merge-patch+json",
         {"metadata": {"annotations": {"gpu-health.io/gpu.0": "x", "example.com/owner": None},
                       "resourceVersion": "100"}}),
        ("PATCH", f"/api/v1/nodes/n1?{FM}", "application/merge-patch+json",
         {"metadata": {"annotations": {"gpu-health.io/gpu.0": "y"}}}),
        ("PATCH", f"/api/v1/nodes/n1/status?{FM}", "application/strategic-merge-patch+json",
         {"status": {"conditions": [CONDITION]}}),
        ("POST", f"/api/v1/namespaces/default/events?{FM}", "application/json",
         {"apiVersion": "v1", "kind": "Event", **body}),
        ("PATCH", f"/api/v1/namespaces/default/events/{name}?{FM}", "application/merge-patch+json", {"count": 2}),
    ]
    assert {r.authorization for r in api.requests} == {"Bearer test-token"}
    assert api.events[("default", name)]["count"] == 2


def test_pod_calls_as_the_server_receives_them(tmp_path: Path) -> None:
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "uid-p"}, "spec": {"nodeName": "n1"}}
    srv = TinyServer(lambda s: ok(pod) if s.method != "POST" else (201, {}, b'{"kind":"Status","status":"Success"}'))
    try:
        client = KubeClient(kubeconfig(tmp_path, {"server": srv.url}, {"token": "t"}))
        assert client.get_pod("ns", "p") == PodView(uid="uid-p", node_name="n1")
        client.patch_pod_annotations("ns", "p", {"gpu-health.io/devices": "gpu.1=Unhealthy"})
        client.evict_pod("ns", "p", "uid-p")
        client.evict_pod("ns", "p", "")
        client.close()
    finally:
        srv.stop()
    got = [(s.method, s.path, s.headers.get("Content-Type"), s.body) for s in srv.seen]
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "p", "namespace": "ns"}}
    assert got == [
        ("GET", "/api/v1/namespaces/ns/pods/p", None, None),
        ("PATCH", f"/api/v1/namespaces/ns/pods/p?{FM}", "application/merge-patch+json",
         {"metadata": {"annotations": {"gpu-health.io/devices": "gpu.1=Unhealthy"}}}),
        ("POST", f"/api/v1/namespaces/ns/pods/p/eviction?{FM}", "application/json",
         {**eviction, "deleteOptions": {"kind": "DeleteOptions", "preconditions": {"uid": "uid-p"}}}),
        ("POST", f"/api/v1/namespaces/ns/pods/p/eviction?{FM}", "application/json", eviction),
    ]
    assert {s.headers["Authorization"] for s in srv.seen} == {"Bearer t"}
    assert srv.connections == 1  # kept alive


def test_resource_slice_and_claim_calls_as_the_server_receives_them(tmp_path: Path) -> None:
    slices = "/apis/resource.k8s.io/v1/resourceslices"
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "n1-d"},
            "spec": {"driver": "d", "nodeName": "n1"}}
    stored = {**body, "metadata": {"name": "n1-d", "resourceVersion": "7"}}
    missing = (404, {"Content-Type": "application/json"},
               b'{"kind":"Status","message":"resourceslices \\"gone\\" not found","reason":"NotFound"}')

    def respond(seen: Seen) -> Answer:
        if "/gone" in seen.path:
            return missing
        return ok(stored)

    srv = TinyServer(respond)
    try:
        client = KubeClient(kubeconfig(tmp_path, {"server": srv.url}, {"token": "t"}))
        assert client.get_resource_slice("n1-d") == stored
        assert client.get_resource_slice("gone") is None
        assert client.create_resource_slice(body) == stored
        assert client.update_resource_slice("n1-d", stored) == stored
        client.delete_resource_slice("n1-d")
        client.delete_resource_slice("gone")  # already gone: no failure
        assert client.get_resource_claim("ns", "claim-1") == stored
        claim = failure(lambda: client.get_resource_claim("ns", "gone"))
        client.close()
    finally:
        srv.stop()
    strict = f"fieldValidation=Strict&{FM}"
    got = [(s.method, s.path, s.headers.get("Content-Type"), s.body) for s in srv.seen]
    assert got == [
        ("GET", f"{slices}/n1-d", None, None),
        ("GET", f"{slices}/gone", None, None),
        ("POST", f"{slices}?{strict}", "application/json", body),
        ("PUT", f"{slices}/n1-d?{strict}", "application/json", stored),
        ("DELETE", f"{slices}/n1-d?{FM}", None, None),
        ("DELETE", f"{slices}/gone?{FM}", None, None),
        ("GET", "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/claim-1", None, None),
        ("GET", "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/gone", None, None),
    ]
    assert claim.status == 404 and "not found" in claim.message


# Failures -----------------------------------------------------------------------------------------------------


def test_conflict_and_throttling_are_mapped_with_the_servers_message(api: FakeApiServer, tmp_path: Path) -> None:
    client = KubeClient(api.kubeconfig(tmp_path))
    conflict = failure(lambda: client.patch_node_annotations("n1", {"a": "b"}, "99"))
    assert (conflict.status, conflict.retry_after) == (409, None)
    assert conflict.message.startswith('Operation cannot be fulfilled on nodes "n1": the object has been modified')
    api.fail(429, retry_after=7)
    throttled = failure(lambda: client.get_node("n1"))
    assert (throttled.status, throttled.message, throttled.retry_after) == (429, "injected fault", 7.0)
    assert str(throttled) == "HTTP 429: injected fault"
    missing = failure(lambda: client.get_node("nope"))
    assert (missing.status, missing.message) == (404, 'nodes "nope" not found')
    assert client.get_node("n1").name == "n1"  # the connection survived the error answers


def test_an_error_without_a_status_body_takes_the_reason_phrase(tmp_path: Path) -> None:
    answers = iter([(503, {"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}, b"upstream gone"),
                    (500, {"Content-Type": "application/json"}, b'{"kind":"Status","message":""}')])
    srv = TinyServer(lambda s: next(answers))
    try:
        client = KubeClient(kubeconfig(tmp_path, {"server": srv.url}, {}))
        gone = failure(lambda: client.get_node("n1"))
        assert (gone.status, gone.message, gone.retry_after) == (503, "Service Unavailable", None)
        empty = failure(lambda: client.get_node("n1"))
        assert (empty.status, empty.message) == (500, "Internal Server Error")
        assert "Authorization" not in srv.seen[0].headers  # a user with no credentials sends none
    finally:
        srv.stop()


def test_connection_refused_and_a_silent_server_are_transport_failures(api: FakeApiServer, tmp_path: Path) -> None:
    path = api.kubeconfig(tmp_path)
    api.stop()
    refused = failure(lambda: KubeClient(path).get_node("n1"))
    assert refused.status is None and refused.message == "ConnectionRefusedError: [Errno 111] Connection refused"
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (the backlog), never answers
        cfg = kubeconfig(tmp_path, {"server": f"http://127.0.0.1:{silent.getsockname()[1]}"}, {}, "silent")
        slow = failure(lambda: KubeClient(cfg, timeout_s=0.3).get_node("n1"))
    assert slow.status is None and slow.message == "TimeoutError: timed out"


def test_the_timeout_bounds_the_whole_call_not_each_read(tmp_path: Path) -> None:
    """A server that trickles its answer a byte at a time, each byte well within the timeout: the old per-read
    timeout waited for all of it (the controller's fencing bound would not hold); the call now gives up at its
    timeout, with most of the answer unsent."""
    body = b'{"metadata":{"name":"n1"}}'.ljust(400)
    sent = []
    with socket.create_server(("127.0.0.1", 0)) as srv:
        def trickle() -> None:
            peer, _ = srv.accept()
            with peer:
                peer.recv(65536)
                peer.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body))
                try:
                    for i in range(len(body)):
                        peer.sendall(body[i:i + 1])
                        sent.append(i)
                        time.sleep(0.02)  # the pace of the trickle, not a wait for an event
                except OSError:
                    pass  # the client gave up and closed

        server = threading.Thread(target=trickle)
        server.start()
        cfg = kubeconfig(tmp_path, {"server": f"http://127.0.0.1:{srv.getsockname()[1]}"}, {})
        gave_up = failure(lambda: KubeClient(cfg, timeout_s=1.0).patch_node("n1", {"metadata": {}}))
        server.join()
    assert gave_up.status is None and gave_up.message == "TimeoutError: timed out", gave_up.message
    assert len(sent) < len(body), "the client read the whole trickle"


def test_close_from_another_thread_ends_a_request_in_flight_at_once(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:
        cfg = kubeconfig(tmp_path, {"server": f"http://127.0.0.1:{silent.getsockname()[1]}"}, {})
        client = KubeClient(cfg, timeout_s=30.0)
        got: list[BaseException] = []

        def call() -> None:
            try:
                client.get_node("n1")
            except BaseException as exc:
                got.append(exc)

        worker = threading.Thread(target=call)
        worker.start()
        peer, _ = silent.accept()  # the request is on its way and will not be answered
        with peer:
            peer.recv(65536)
            t0 = time.monotonic()
            client.close()
            worker.join(5.0)
            assert time.monotonic() - t0 < 2.0 and not worker.is_alive()
    assert len(got) == 1 and isinstance(got[0], ApiFailure) and got[0].status is None, got


def test_a_request_sent_and_not_answered_is_never_sent_again(api: FakeApiServer, tmp_path: Path) -> None:
    client = KubeClient(api.kubeconfig(tmp_path))
    client.get_node("n1")
    api.drop()  # reads the request, then closes the connection: it may have been acted on
    dropped = failure(lambda: client.patch_node_annotations("n1", {"a": "b"}, None))
    assert dropped.status is None and dropped.message.startswith("RemoteDisconnected"), dropped.message
    assert api.count("PATCH") == 1
    assert client.get_node("n1").name == "n1"  # a fresh connection for the next call


def test_a_connection_the_server_closed_while_idle_is_opened_again(tmp_path: Path) -> None:
    srv = TinyServer(lambda s: ok({"metadata": {"name": "n1"}}), close_idle=True)
    try:
        client = KubeClient(kubeconfig(tmp_path, {"server": srv.url}, {}))
        for i in range(3):
            assert client.get_node("n1").name == "n1"
            with srv.changed:  # closed while the client is idle, not while it sends its next request
                assert srv.changed.wait_for(lambda: srv.closed == i + 1, 5.0)  # noqa: B023
        assert (len(srv.seen), srv.connections) == (3, 3)
    finally:
        srv.stop()


def test_one_client_serves_two_threads(api: FakeApiServer, tmp_path: Path) -> None:
    client = KubeClient(api.kubeconfig(tmp_path))
    errors: list[BaseException] = []

    def work(key: str) -> None:
        try:
            for i in range(25):
                client.patch_node_annotations("n1", {key: str(i)}, None)
                client.get_node("n1")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in ("a/x", "a/y")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert {k: api.annotations("n1")[k] for k in ("a/x", "a/y")} == {"a/x": "24", "a/y": "24"}


# Configuration ------------------------------------------------------------------------------------------------


def test_a_token_file_is_read_relative_to_the_kubeconfig_and_again_after_a_401(api: FakeApiServer,
                                                                             tmp_path: Path) -> None:
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "token").write_text("test-token\n")
    client = KubeClient(kubeconfig(tmp_path, {"server": api.url}, {"tokenFile": "secret/token", "token": "ignored"}))
    client.get_node("n1")
    api.token = "rotated"  # the server moved on to a new token; the file follows
    (tmp_path / "secret" / "token").write_text("rotated")
    assert client.get_node("n1").name == "n1"
    assert [r.authorization for r in api.requests] == ["Bearer test-token", "Bearer test-token", "Bearer rotated"]
    api.token = "unknown"  # refused, and the file has nothing newer: one request, the 401 reported
    refused = failure(lambda: client.get_node("n1"))
    assert refused.status == 401 and len(api.requests) == 4


def test_a_token_file_is_read_again_after_a_while_without_a_401(api: FakeApiServer, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text("test-token")
    client = KubeClient(kubeconfig(tmp_path, {"server": api.url}, {"tokenFile": str(token)}))
    client.get_node("n1")
    token.write_text("second")
    client.get_node("n1")  # within the refresh period: the token read before
    monkeypatch.setattr(kubeconfig_module, "TOKEN_REFRESH_S", 0.0)
    api.token = "second"
    client.get_node("n1")
    assert [r.authorization for r in api.requests] == ["Bearer test-token"] * 2 + ["Bearer second"]


def test_basic_auth(api: FakeApiServer, tmp_path: Path) -> None:
    api.token = "unused"
    client = KubeClient(kubeconfig(tmp_path, {"server": api.url}, {"username": "admin", "password": "pw"}))
    assert failure(lambda: client.get_node("n1")).status == 401
    assert api.requests[0].authorization == "Basic " + base64.b64encode(b"admin:pw").decode()


def test_client_certificate_data_over_tls_and_no_key_left_on_disk(pki: Pki, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    srv = TinyServer(lambda s: ok({"metadata": {"name": "n1", "uid": s.peer_cn or ""}}),
                     tls=pki.server_context(require_client_cert=True))
    try:
        user = {"client-certificate-data": b64(pki.client_cert), "client-key-data": b64(pki.client_key)}
        client = KubeClient(kubeconfig(tmp_path, {"server": srv.url, "certificate-authority-data": b64(pki.ca)}, user))
        assert list(scratch.iterdir()) == []  # written for ssl to load, then removed
        assert client.get_node("n1").uid == "plugin"  # the server saw our client certificate
        assert "Authorization" not in srv.seen[0].headers
    finally:
        srv.stop()


def test_certificate_files_relative_to_the_kubeconfig_and_tls_failures(pki: Pki, tmp_path: Path) -> None:
    srv = TinyServer(lambda s: ok({"metadata": {"name": s.peer_cn or ""}}),
                     tls=pki.server_context(require_client_cert=True))
    try:
        pki_dir = Path(pki.ca).parent
        user = {"client-certificate": str(pki.client_cert.relative_to(pki_dir)),
                "client-key": str(pki.client_key.relative_to(pki_dir))}
        trusted = kubeconfig(pki_dir, {"server": srv.url, "certificate-authority": "ca.crt"}, user, "trusted.kcfg")
        assert KubeClient(trusted).get_node("x").name == "plugin"
        stranger = kubeconfig(tmp_path, {"server": srv.url, "certificate-authority": str(pki.other_ca)},
                              {"client-certificate": str(pki.client_cert), "client-key": str(pki.client_key)})
        bad = failure(lambda: KubeClient(stranger).get_node("x"))
        assert bad.status is None and bad.message.startswith("SSLCertVerificationError"), bad.message
    finally:
        srv.stop()


def test_insecure_skip_tls_verify(pki: Pki, tmp_path: Path) -> None:
    srv = TinyServer(lambda s: ok({"metadata": {"name": "n1"}}), tls=pki.server_context())
    try:
        cfg = kubeconfig(tmp_path, {"server": srv.url, "insecure-skip-tls-verify": True}, {"token": "t"})
        assert KubeClient(cfg).get_node("n1").name == "n1"
    finally:
        srv.stop()


@pytest.mark.parametrize("cluster,user,named", [
    ({}, {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": "aws"}},
     "user 'u': exec credential plugins are not supported"),
    ({}, {"auth-provider": {"name": "oidc"}}, "user 'u': auth-provider is not supported"),
    ({"proxy-url": "http://proxy:3128"}, {"token": "t"}, "cluster 'k': proxy-url is not supported"),
    ({"server": "unix:///run/k8s.sock"}, {"token": "t"}, "is not an http(s) URL"),
])
def test_unsupported_kubeconfig_features_are_refused_when_built(tmp_path: Path, cluster: dict[str, Any],
                                                                user: dict[str, Any], named: str) -> None:
    path = kubeconfig(tmp_path, {"server": "https://127.0.0.1:6443", **cluster}, user)
    refused = failure(lambda: KubeClient(path))
    assert refused.status is None and "\n" not in refused.message
    assert refused.message.startswith(f"cannot configure a Kubernetes client from kubeconfig {path}: ")
    assert named in refused.message


def test_broken_kubeconfigs_are_one_construction_failure(tmp_path: Path) -> None:
    cases = {"missing": None, "not-yaml": "clusters: [\n  - {", "no-context": "{}",
             "bad-cert": json.dumps({"current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "k"}}],
                                     "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:1",
                                                                            "certificate-authority-data": "!!"}}]})}
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(ApiFailure) as info:
            KubeClient(tmp_path / name)
        refused = info.value
        assert refused.status is None and "\n" not in refused.message, (name, refused.message)
        assert refused.message.startswith(f"cannot configure a Kubernetes client from kubeconfig {tmp_path / name}")


# In a cluster -------------------------------------------------------------------------------------------------


def _service_account(root: Path, pki: Pki, token: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "token").write_text(token)
    (root / "ca.crt").write_bytes(pki.ca.read_bytes())
    return root


def _bearer_checking(tokens: set[str]) -> Callable[[Seen], Answer]:
    def respond(s: Seen) -> Answer:
        if s.headers.get("Authorization", "").removeprefix("Bearer ") not in tokens:
            return 401, {"Content-Type": "application/json"}, b'{"kind":"Status","message":"Unauthorized"}'
        return ok({"metadata": {"name": "n1", "uid": "uid-n1", "resourceVersion": "7"}})
    return respond


def test_in_cluster_service_account_and_its_rotating_token(pki: Pki, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    accepted = {"first"}
    srv = TinyServer(_bearer_checking(accepted), tls=pki.server_context())
    try:
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(srv.port))
        sa = _service_account(tmp_path / "sa", pki, "first")
        client = KubeClient(service_account=sa)
        assert client.get_node("n1").resource_version == "7"
        accepted.clear()
        accepted.add("second")  # the kubelet rotated the token; the old one is no longer accepted
        (sa / "token").write_text("second")
        assert client.get_node("n1").resource_version == "7"
        assert [s.headers["Authorization"] for s in srv.seen] == ["Bearer first", "Bearer first", "Bearer second"]
        assert srv.connections == 1
    finally:
        srv.stop()


def test_in_cluster_over_ipv6_brackets_the_host(pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        srv = TinyServer(_bearer_checking({"t"}), tls=pki.server_context(), host="::1")
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    try:
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "::1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(srv.port))
        assert KubeClient(service_account=_service_account(tmp_path / "sa", pki, "t")).get_node("n1").name == "n1"
        assert srv.seen[0].headers["Host"] == f"[::1]:{srv.port}"
    finally:
        srv.stop()


def test_in_cluster_without_a_pod_environment_or_a_token_fails_when_built(pki: Pki, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    sa = _service_account(tmp_path / "sa", pki, "t")
    outside = failure(lambda: KubeClient(service_account=sa))
    assert outside.message == ("cannot configure a Kubernetes client from the in-cluster service account (or "
                               "--kubeconfig): KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set "
                               "(not in a Pod?)")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    (sa / "token").unlink()
    no_token = failure(lambda: KubeClient(service_account=sa))
    assert no_token.status is None and "FileNotFoundError" in no_token.message and "token" in no_token.message
