"""An HTTP-level fake of the few kube-apiserver endpoints the cluster reporter uses, on loopback.

Real HTTP, so the real client (plugin/kube/client.py) and our error handling are what is tested; the real
API server is used by tests/conformance/apiserver/test_annotations*.py. Implemented here:

- ``GET/PATCH /api/v1/nodes/{name}``: JSON merge patch; a ``metadata.resourceVersion`` in the patch is a
  precondition (409 when stale), as on the real server;
- ``PATCH /api/v1/nodes/{name}/status``: strategic merge of ``status.conditions`` by ``type``;
- ``POST /api/v1/namespaces/{ns}/events`` (``generateName``) and ``PATCH .../events/{name}`` (merge).

Faults: ``fail(status, count, retry_after)`` answers the next ``count`` requests with that status;
``drop(count)`` closes the connection without answering; ``edit_node`` changes a node behind the client's back.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

_NODE = re.compile(r"^/api/v1/nodes/([^/?]+)(/status)?$")
_EVENTS = re.compile(r"^/api/v1/namespaces/([^/]+)/events(?:/([^/?]+))?$")


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge(out.get(k), v)
    return out


@dataclass
class Request:
    method: str
    path: str
    body: Any
    content_type: str
    authorization: str


class FakeApiServer:
    def __init__(self, token: str = "test-token") -> None:
        self.token = token
        self.nodes: dict[str, dict[str, Any]] = {}
        self.events: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[Request] = []
        self._rv = itertools.count(100)
        self._names = itertools.count(1)
        self._faults: list[tuple[str, int, float | None, Callable[[Request], bool]]] = []
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified after every request
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                req = Request(self.command, self.path, body, self.headers.get("Content-Type", ""),
                              self.headers.get("Authorization", ""))
                with fake.changed:
                    fake.requests.append(req)
                    fault = fake._take_fault(req)
                    if fault is not None and fault[0] == "drop":
                        fake.changed.notify_all()
                        self.close_connection = True
                        self.wfile.flush()
                        self.connection.shutdown(2)
                        return
                    if fault is not None:
                        _, status, retry_after, _ = fault
                        result = (status, _status(status, "injected fault"), retry_after)
                    elif req.authorization != f"Bearer {fake.token}":
                        result = (401, _status(401, "Unauthorized"), None)
                    else:
                        result = (*fake._serve(req), None)
                    fake.changed.notify_all()
                status, doc, retry_after = result
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if retry_after is not None:
                    self.send_header("Retry-After", str(int(retry_after)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_POST = do_PUT = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fake-apiserver",
                                        daemon=True)

    # Lifecycle ------------------------------------------------------------------------------------------------

    def start(self) -> FakeApiServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def kubeconfig(self, directory: Path, token: str | None = None) -> Path:
        path = directory / "fake-apiserver.kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": token or self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }))
        return path

    # Test helpers ---------------------------------------------------------------------------------------------

    def add_node(self, name: str, annotations: dict[str, str] | None = None) -> None:
        with self.lock:
            self.nodes[name] = {
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": str(next(self._rv)),
                             "annotations": dict(annotations or {})},
                "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                           "message": "ok", "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                                           "lastTransitionTime": "2026-01-01T00:00:00Z"}]},
            }

    def annotations(self, name: str) -> dict[str, str]:
        with self.lock:
            return dict(self.nodes[name]["metadata"].get("annotations") or {})

    def conditions(self, name: str) -> list[dict[str, Any]]:
        with self.lock:
            return copy.deepcopy(self.nodes[name]["status"].get("conditions") or [])

    def edit_node(self, name: str, annotations: dict[str, str | None]) -> None:
        """Someone else (an operator, another controller) changes the node: a new resourceVersion."""
        with self.changed:
            node = self.nodes[name]
            node["metadata"] = merge(node["metadata"], {"annotations": annotations})
            node["metadata"]["resourceVersion"] = str(next(self._rv))

    def fail(self, status: int, count: int = 1, retry_after: float | None = None,
             when: Callable[[Request], bool] = lambda r: True) -> None:
        with self.lock:
            self._faults.extend([("status", status, retry_after, when)] * count)

    def drop(self, count: int = 1) -> None:
        with self.lock:
            self._faults.extend([("drop", 0, None, lambda r: True)] * count)

    def clear_faults(self) -> None:
        with self.lock:
            self._faults.clear()

    def count(self, method: str, path_re: str = ".*") -> int:
        with self.lock:
            return sum(1 for r in self.requests if r.method == method and re.search(path_re, r.path))

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Wait until ``predicate()`` (evaluated under the lock after each request) holds."""
        with self.changed:
            return self.changed.wait_for(predicate, timeout)

    # Serving --------------------------------------------------------------------------------------------------

    def _take_fault(self, req: Request) -> tuple[str, int, float | None, Callable[[Request], bool]] | None:
        for i, f in enumerate(self._faults):
            if f[3](req):
                return self._faults.pop(i)
        return None

    def _serve(self, req: Request) -> tuple[int, dict[str, Any]]:
        path = req.path.split("?", 1)[0]
        m = _NODE.match(path)
        if m:
            return self._node(req, m.group(1), bool(m.group(2)))
        m = _EVENTS.match(path)
        if m:
            return self._event(req, m.group(1), m.group(2))
        return 404, _status(404, f"no route {req.method} {path}")

    def _node(self, req: Request, name: str, status: bool) -> tuple[int, dict[str, Any]]:
        node = self.nodes.get(name)
        if node is None:
            return 404, _status(404, f'nodes "{name}" not found', "NotFound")
        if req.method == "GET":
            return 200, copy.deepcopy(node)
        if req.method != "PATCH":
            return 405, _status(405, "method not allowed")
        if status:
            if req.content_type != "application/strategic-merge-patch+json":
                return 415, _status(415, f"unsupported patch type {req.content_type}")
            conditions = node["status"].setdefault("conditions", [])
            for c in (req.body or {}).get("status", {}).get("conditions", []):
                for i, old in enumerate(conditions):
                    if old["type"] == c["type"]:
                        conditions[i] = merge(old, c)
                        break
                else:
                    conditions.append(c)
        else:
            if req.content_type != "application/merge-patch+json":
                return 415, _status(415, f"unsupported patch type {req.content_type}")
            patch = copy.deepcopy(req.body or {})
            want_rv = patch.get("metadata", {}).pop("resourceVersion", None)
            if want_rv is not None and want_rv != node["metadata"]["resourceVersion"]:
                return 409, _status(409, f'Operation cannot be fulfilled on nodes "{name}": the object has been '
                                         "modified; please apply your changes to the latest version and try again",
                                    "Conflict")
            merged = merge(node, patch)
            node.clear()
            node.update(merged)
        node["metadata"]["resourceVersion"] = str(next(self._rv))
        return 200, copy.deepcopy(node)

    def _event(self, req: Request, ns: str, name: str | None) -> tuple[int, dict[str, Any]]:
        if req.method == "POST" and name is None:
            ev = copy.deepcopy(req.body)
            meta = ev.setdefault("metadata", {})
            meta["name"] = meta.get("name") or f"{meta.get('generateName', 'event.')}{next(self._names):05d}"
            meta["namespace"] = ns
            meta["resourceVersion"] = str(next(self._rv))
            self.events[(ns, meta["name"])] = ev
            return 201, copy.deepcopy(ev)
        if req.method == "PATCH" and name is not None:
            ev = self.events.get((ns, name))
            if ev is None:
                return 404, _status(404, f'events "{name}" not found', "NotFound")
            self.events[(ns, name)] = merge(ev, req.body)
            return 200, copy.deepcopy(self.events[(ns, name)])
        return 405, _status(405, "method not allowed")


def _status(code: int, message: str, reason: str = "") -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
