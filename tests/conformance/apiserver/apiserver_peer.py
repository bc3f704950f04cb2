"""A real kube-apiserver (plus etcd) on loopback, for tests.

Started the way controller-runtime's envtest starts one: etcd on random loopback ports with a temporary
data dir, then kube-apiserver against it with RBAC (and the Node authorizer), service-account token
issuing and validation, a static admin token, and a serving certificate from a throw-away CA. No
controller-manager, scheduler or kubelet runs: Pods never start, Nodes are plain objects, and the
`default` service account is not created automatically.

    peer = ApiServerPeer.start(binaries)        # binaries: {"etcd": path, "kube-apiserver": ..., ...}
    peer.kubectl("get", "nodes")
    token = peer.token_for_pod("ns", "sa", "pod")   # TokenRequest bound to the Pod (carries its node)
    kubeconfig = peer.kubeconfig_for_token(token, "plugin")
    peer.stop()

Only the standard library is used.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


class PeerStartError(RuntimeError):
    """etcd or kube-apiserver did not come up; the message carries the tail of its log."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class HttpResult:
    status: int
    body: Any  # parsed JSON when the server sent JSON, else text

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def message(self) -> str:
        if isinstance(self.body, dict):
            return str(self.body.get("message", self.body))
        return str(self.body)


@dataclass
class ApiServerPeer:
    url: str
    ca_file: Path
    admin_token: str
    kubeconfig: Path
    kubectl_path: Path
    workdir: Path
    etcd_url: str
    etcd_version: str = ""
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)
    _logs: dict[str, Path] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def start_retrying(cls, binaries: Mapping[str, os.PathLike | str], workdir: Callable[[], Path],
                       attempts: int = 3) -> ApiServerPeer:
        """``start`` in a fresh ``workdir()``, again when a port it picked was taken meanwhile: the free ports are
        picked before the processes bind them, and another process can win."""
        for attempt in range(attempts):
            try:
                return cls.start(binaries, workdir=workdir())
            except PeerStartError as exc:
                if attempt == attempts - 1 or "address already in use" not in str(exc):
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def start(
        cls,
        binaries: Mapping[str, os.PathLike | str],
        *,
        workdir: Path | None = None,
        ready_timeout: float = 180.0,
        extra_apiserver_args: Sequence[str] = (),
        extra_etcd_args: Sequence[str] = (),
    ) -> ApiServerPeer:
        work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="gpu-health-apiserver-"))
        pki = work / "pki"
        subprocess.run([str(binaries["testpki"]), str(pki)], check=True, capture_output=True, timeout=60)

        admin_token = secrets.token_hex(24)
        token_file = work / "tokens.csv"
        token_file.write_text(f'{admin_token},admin,admin-uid,"system:masters"\n')
        token_file.chmod(0o600)
        # Every write to a Node is audited, so tests count the plugin's writes from the server's side (a no-op
        # PATCH changes no resourceVersion and never shows on a watch, but it still costs the server).
        audit_policy = work / "audit-policy.json"
        audit_policy.write_text(json.dumps({
            "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
            "rules": [
                {"level": "Metadata", "verbs": ["create", "update", "patch", "delete"],
                 "resources": [{"group": "", "resources": ["nodes", "nodes/status"]}]},
                {"level": "Metadata", "verbs": ["update"],
                 "resources": [{"group": "coordination.k8s.io", "resources": ["leases"]}]},
                {"level": "None"},
            ],
        }))

        etcd_port, peer_port, secure_port = _free_port(), _free_port(), _free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        url = f"https://127.0.0.1:{secure_port}"
        peer = cls(
            url=url,
            ca_file=pki / "ca.crt",
            admin_token=admin_token,
            kubeconfig=work / "admin.kubeconfig",
            kubectl_path=Path(binaries["kubectl"]),
            workdir=work,
            etcd_url=etcd_url,
        )
        try:
            peer._spawn(
                "etcd",
                [
                    str(binaries["etcd"]),
                    "--name=default",
                    f"--data-dir={work / 'etcd'}",
                    f"--listen-client-urls={etcd_url}",
                    f"--advertise-client-urls={etcd_url}",
                    f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                    f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
                    "--unsafe-no-fsync",  # test data; durability does not matter
                    "--log-level=warn",
                    *extra_etcd_args,
                ],
            )
            peer._wait(
                "etcd",
                f"{etcd_url}/health",
                ready_timeout,
                lambda r: r.ok and isinstance(r.body, dict) and r.body.get("health") == "true",
            )
            version = peer.request("GET", f"{etcd_url}/version")
            if version.ok and isinstance(version.body, dict):
                peer.etcd_version = str(version.body.get("etcdserver", ""))
            peer._spawn(
                "kube-apiserver",
                [
                    str(binaries["kube-apiserver"]),
                    f"--etcd-servers={etcd_url}",
                    "--bind-address=127.0.0.1",
                    "--advertise-address=127.0.0.1",
                    f"--secure-port={secure_port}",
                    f"--cert-dir={work / 'certs'}",
                    f"--tls-cert-file={pki / 'serving.crt'}",
                    f"--tls-private-key-file={pki / 'serving.key'}",
                    f"--client-ca-file={pki / 'ca.crt'}",
                    f"--token-auth-file={token_file}",
                    "--authorization-mode=Node,RBAC",
                    f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                    f"--service-account-key-file={pki / 'sa.pub'}",
                    f"--service-account-signing-key-file={pki / 'sa.key'}",
                    "--service-cluster-ip-range=10.0.0.0/24",
                    "--allow-privileged=true",
                    "--endpoint-reconciler-type=none",
                    "--enable-priority-and-fairness=false",
                    "--profiling=false",
                    f"--audit-policy-file={audit_policy}",
                    f"--audit-log-path={work / 'audit.log'}",
                    "--audit-log-mode=blocking",  # an entry is on disk when the response is sent
                    # ValidatingAdmissionPolicy (GA, on by default since 1.30) and the node name in
                    # Pod-bound service-account tokens (ServiceAccountTokenPodNodeInfo, GA and locked on
                    # since 1.32) need no flags on 1.37; test_apiserver_peer.py checks both work.
                    *extra_apiserver_args,
                ],
            )
            peer._wait("kube-apiserver", f"{url}/readyz", ready_timeout, lambda r: r.ok)
            peer._write_kubeconfig(peer.kubeconfig, admin_token, "admin")
        except BaseException:
            peer.stop()
            raise
        return peer

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = self.workdir / f"{name}.log"
        self._logs[name] = log
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        proc.name = name  # type: ignore[attr-defined]
        self._procs.append(proc)

    def _wait(self, name: str, url: str, timeout: float, ready) -> None:
        proc = self._procs[-1]
        deadline = time.monotonic() + timeout
        delay = 0.05
        last = "no answer yet"
        while True:
            if proc.poll() is not None:
                raise PeerStartError(
                    f"{name} exited with code {proc.returncode} before it was ready; "
                    f"log tail:\n{_tail(self._logs[name])}"
                )
            try:
                result = self.request("GET", url)
                if ready(result):
                    return
                last = f"HTTP {result.status}: {str(result.body)[:500]}"
            except (OSError, urllib.error.URLError) as exc:
                last = str(exc)
            if time.monotonic() > deadline:
                raise PeerStartError(
                    f"{name} not ready after {timeout:.0f}s ({url}: {last}); log tail:\n{_tail(self._logs[name])}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    def stop(self) -> None:
        """Stop kube-apiserver, then etcd; keep the work dir if GPU_HEALTH_KEEP_APISERVER is set."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self._procs.clear()
        if not os.environ.get("GPU_HEALTH_KEEP_APISERVER"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _completed(self) -> Iterator[dict[str, Any]]:
        """The audit log's ResponseComplete entries, oldest first (a line being written right now is left out)."""
        try:
            text = (self.workdir / "audit.log").read_text()
        except FileNotFoundError:
            return
        for line in text.splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("stage") == "ResponseComplete":
                yield e

    def node_writes(self, name: str) -> list[dict[str, Any]]:
        """Every completed write to Node ``name`` (and its status) from the audit log, oldest first: verb,
        subresource, user, HTTP code and time."""
        return [{"verb": e.get("verb"), "subresource": ref.get("subresource", ""),
                 "user": (e.get("user") or {}).get("username", ""),
                 "code": (e.get("responseStatus") or {}).get("code"), "time": e.get("stageTimestamp", "")}
                for e in self._completed()
                if (ref := e.get("objectRef") or {}).get("resource") == "nodes" and ref.get("name") == name]

    def audited(self, resource: str, user: str) -> list[dict[str, Any]]:
        """Every completed write by ``user`` to ``resource`` (nodes, leases) from the audit log, oldest first: verb,
        name, HTTP code, and when the server received it and answered (RFC 3339, microseconds)."""
        return [{"verb": e.get("verb"), "name": ref.get("name", ""),
                 "code": (e.get("responseStatus") or {}).get("code"),
                 "received": e.get("requestReceivedTimestamp", ""), "answered": e.get("stageTimestamp", "")}
                for e in self._completed()
                if (ref := e.get("objectRef") or {}).get("resource") == resource
                and (e.get("user") or {}).get("username") == user]

    def log_tail(self, name: str = "kube-apiserver", lines: int = 40) -> str:
        return _tail(self._logs[name], lines)

    # ------------------------------------------------------------------ raw HTTP

    def _ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def request(
        self,
        method: str,
        path_or_url: str,
        body: Any = None,
        *,
        token: str | None = "admin",
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> HttpResult:
        """One HTTPS (or, for etcd, HTTP) request. ``token="admin"`` (default) uses the admin token,
        ``None`` sends no credentials, anything else is used as a bearer token."""
        url = path_or_url if "://" in path_or_url else self.url + path_or_url
        data = None
        headers = {"Accept": "application/json"}
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            headers["Content-Type"] = content_type
        if token == "admin":
            token = self.admin_token
        if token and url.startswith(self.url):
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        context = self._ssl_context() if url.startswith("https://") else None
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        text = raw.decode(errors="replace")
        try:
            parsed: Any = json.loads(text) if text else None
        except ValueError:
            parsed = text
        return HttpResult(status, parsed)

    # ------------------------------------------------------------------ kubectl and credentials

    def kubectl(
        self,
        *args: str,
        kubeconfig: os.PathLike | str | None = None,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess:
        """Run the built kubectl against this server (admin kubeconfig unless another is given)."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(kubeconfig or self.kubeconfig)
        env["KUBECACHEDIR"] = str(self.workdir / "kubectl-cache")
        proc = subprocess.run(
            [str(self.kubectl_path), *args], input=input, capture_output=True, text=True, env=env, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}):\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
            )
        return proc

    def _write_kubeconfig(self, path: Path, token: str, user: str) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "conformance", "cluster": {"server": self.url, "certificate-authority": str(self.ca_file)}}
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": "conformance", "user": user}}],
            "current-context": user,
        }
        path.write_text(json.dumps(config, indent=2) + "\n")
        path.chmod(0o600)
        return path

    def kubeconfig_for_token(self, token: str, name: str = "token") -> Path:
        """A kubeconfig file that authenticates with ``token``."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        return self._write_kubeconfig(self.workdir / f"{safe}-{secrets.token_hex(4)}.kubeconfig", token, name)

    def token_for_service_account(
        self,
        namespace: str,
        service_account: str,
        *,
        bound_pod: str | None = None,
        audiences: Sequence[str] = (),
        expiration_seconds: int = 3600,
    ) -> str:
        """Mint a token through the TokenRequest API, optionally bound to a Pod (by name and UID).

        A Pod-bound token for a Pod with ``spec.nodeName`` carries the node's name and UID; the API
        server then exposes them as the user extras ``authentication.kubernetes.io/node-name`` /
        ``node-uid`` (what the kubelet's projected token gives a real Pod)."""
        spec: dict[str, Any] = {"expirationSeconds": expiration_seconds}
        if audiences:
            spec["audiences"] = list(audiences)
        if bound_pod:
            pod = self.request("GET", f"/api/v1/namespaces/{namespace}/pods/{bound_pod}")
            if not pod.ok:
                raise AssertionError(f"pod {namespace}/{bound_pod}: HTTP {pod.status} {pod.message}")
            spec["boundObjectRef"] = {
                "kind": "Pod",
                "apiVersion": "v1",
                "name": bound_pod,
                "uid": pod.body["metadata"]["uid"],
            }
        result = self.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        if not result.ok:
            raise AssertionError(
                f"TokenRequest for {namespace}/{service_account}: HTTP {result.status} {result.message}"
            )
        return result.body["status"]["token"]

    def token_for_pod(self, namespace: str, service_account: str, pod: str, **kwargs: Any) -> str:
        return self.token_for_service_account(namespace, service_account, bound_pod=pod, **kwargs)

    def whoami(self, token: str) -> dict:
        """The user info the API server derives from ``token`` (SelfSubjectReview)."""
        result = self.request(
            "POST",
            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
            token=token,
        )
        if not result.ok:
            raise AssertionError(f"SelfSubjectReview: HTTP {result.status} {result.message}")
        return result.body["status"]["userInfo"]

    # ------------------------------------------------------------------ small object helpers

    def apply(self, obj: Mapping[str, Any] | Sequence[Mapping[str, Any]], *extra: str) -> None:
        """``kubectl apply`` one object or a list of objects as admin."""
        items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
        doc = {"apiVersion": "v1", "kind": "List", "items": items}
        self.kubectl(
            "apply", "--server-side", "--field-manager=conformance-test", "-f", "-", *extra, input=json.dumps(doc)
        )

    def create_node(
        self, name: str, *, labels: Mapping[str, str] | None = None, annotations: Mapping[str, str] | None = None
    ) -> dict:
        """Create a Node object (no kubelet behind it) with a Ready condition and some capacity."""
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                "annotations": dict(annotations or {}),
            },
            "status": {
                "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": "8"},
                "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": "8"},
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "kubelet is posting ready status",
                        "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                        "lastTransitionTime": "2026-01-01T00:00:00Z",
                    }
                ],
            },
        }
        result = self.request("POST", "/api/v1/nodes", body)
        if not result.ok:
            raise AssertionError(f"create node {name}: HTTP {result.status} {result.message}")
        return result.body


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """Polls another process's informers (the authorizer's, an admission plugin's): there is no event to wait on.
    Returns the predicate's first true value."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 1.5, 1.0)
