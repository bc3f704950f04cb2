"""Where the API server is and how to authenticate to it: the in-cluster service account (``KUBERNETES_SERVICE_HOST``/
``_PORT``, its ``ca.crt``, its token read again every minute and after a 401, since bound tokens rotate), or a
kubeconfig file: the current context's cluster (``server``, ``certificate-authority``/``-data``,
``insecure-skip-tls-verify``) and user (``token``, ``tokenFile``, ``client-certificate``/``-key`` and their
``-data``, ``username``/``password``); relative paths are relative to the file's directory, as kubectl reads them.
Exec credential plugins, ``auth-provider`` and ``proxy-url`` are refused, naming what; HTTP proxies from the
environment are not used."""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from plugin.kube.errors import ApiFailure, one_line

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# How long a token read from a file is used before the file is read again: the kubelet rotates a projected
# service-account token well before it expires, and the API server counts requests that still carry the old one as
# stale (serviceaccount_stale_tokens_total). client-go reads the file once a minute; so do we. A 401 reads it at once
# too, and sends the request again once when the token changed (as the client before ours did).
TOKEN_REFRESH_S = 60.0


class ConfigError(Exception):
    """A kubeconfig or service account we cannot use; the message says what and where."""


class Auth:
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
class Target:
    host: str
    port: int
    prefix: str  # a path the server lives under (an API proxy's), "" for most
    tls: ssl.SSLContext | None
    auth: Auth


def from_service_account(root: Path) -> Target:
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise ConfigError("KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set (not in a Pod?)")
    auth = Auth(token_file=root / "token")
    auth.header()  # a missing token is a configuration failure now, not a failed request later
    tls = ssl.create_default_context(cafile=str(root / "ca.crt"))
    return Target(host.strip("[]"), int(port), "", tls, auth)


def from_kubeconfig(path: Path) -> Target:
    import yaml  # only here: in a cluster the plugin reads no kubeconfig

    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict):
        raise ConfigError("not a kubeconfig (no mapping at the top)")
    context_name = doc.get("current-context")
    if not context_name:
        raise ConfigError("no current-context")
    context = _named(doc, "contexts", "context", context_name)
    cluster = _named(doc, "clusters", "cluster", context.get("cluster"))
    user = _named(doc, "users", "user", context["user"]) if context.get("user") else {}
    base = path.parent

    def file(key: str, section: dict[str, Any]) -> str:
        # Relative paths are relative to the kubeconfig's directory, as kubectl reads them.
        return str(base / str(section[key]))

    if cluster.get("proxy-url"):
        raise ConfigError(f"cluster {context.get('cluster')!r}: proxy-url is not supported")
    url = urlsplit(str(cluster.get("server") or ""))
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ConfigError(f"cluster {context.get('cluster')!r}: server {cluster.get('server')!r} is not an "
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
        auth = Auth(token_file=Path(file("tokenFile", user)))
    elif user.get("token"):
        auth = Auth(fixed=f"Bearer {user['token']}")
    elif user.get("exec"):
        raise ConfigError(f"user {user_name!r}: exec credential plugins are not supported (use a token, a "
                           "tokenFile or a client certificate)")
    elif user.get("username") and user.get("password"):
        basic = base64.b64encode(f"{user['username']}:{user['password']}".encode()).decode()
        auth = Auth(fixed=f"Basic {basic}")
    elif user.get("auth-provider"):
        raise ConfigError(f"user {user_name!r}: auth-provider is not supported (use a token, a tokenFile or a "
                           "client certificate)")
    else:
        auth = Auth()
    port = url.port or (443 if url.scheme == "https" else 80)
    return Target(url.hostname, port, url.path.rstrip("/"), tls, auth)


def _named(doc: dict[str, Any], list_key: str, item_key: str, name: object) -> dict[str, Any]:
    for entry in doc.get(list_key) or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            item = entry.get(item_key) or {}
            if not isinstance(item, dict):
                break
            return item
    raise ConfigError(f"{item_key} {name!r} not found in {list_key}")


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
                raise ConfigError(f"{key} (or {key}-data) is missing")
        tls.load_cert_chain(paths[0], paths[1])
    finally:
        for name in written:
            os.unlink(name)


def _b64(value: object) -> bytes:
    return base64.b64decode(str(value), validate=True)



def resolve(kubeconfig: Path | None, service_account: Path) -> Target:
    """The kubeconfig's target when one is named, else the service account's; any malformed input is one kind of
    failure, :class:`ApiFailure` without a status, naming where and why."""
    try:
        if kubeconfig is not None:
            return from_kubeconfig(Path(kubeconfig).expanduser())
        return from_service_account(service_account)
    except Exception as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster service account (or --kubeconfig)"
        detail = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
        raise ApiFailure(None, f"cannot configure a Kubernetes client from {where}: {one_line(detail)}") from None
