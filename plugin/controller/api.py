"""The API calls the controller makes, one method per verb and resource, over the project's own client
(plugin/kube/client.py). The reconciler and the watcher depend on the :class:`ControllerApi` protocol, the
leader elector on its Lease part, :class:`LeaseApi`.

The Node LIST comes one page at a time, each fetched only when the one before has been used: a real GPU node's
JSON (its images, conditions and managed fields) is about 20 KB on the wire and 50 KB once parsed, so a whole
fleet's LIST held at once is hundreds of MiB at 5,000 Nodes, where the controller keeps a few KB of facts per Node.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, Protocol
from urllib.parse import quote

from plugin.kube.client import JSON, MERGE_PATCH, KubeClient

# Nodes per LIST page. A page's raw answer, its text and its parsed JSON are alive together while it is read: at
# 5,000 real-sized Nodes a LIST in pages of 100 peaked at 80 MiB of RSS, in pages of 500 (the API server's own chunk
# size) at 121 MiB, in pages of 50 at 75 MiB for twice the requests (bench/bench_fleet.py --list-probe).
LIST_PAGE = 100


class NodePage(NamedTuple):
    items: list[dict[str, Any]]
    resource_version: str  # the list's: every page of one LIST is served from the same snapshot


class LeaseApi(Protocol):
    """What the leader elector needs: the Lease, read and written."""

    def get_lease(self, namespace: str, name: str) -> dict[str, Any]: ...
    def create_lease(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]: ...
    def update_lease(self, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]: ...


class ControllerApi(LeaseApi, Protocol):
    def list_node_pages(self, selector: str) -> Iterator[NodePage]: ...
    def watch_nodes(self, selector: str, resource_version: str, timeout_s: int) -> Iterator[dict[str, Any]]: ...
    def get_node(self, name: str) -> dict[str, Any]: ...
    def patch_node(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]: ...
    def create_event(self, namespace: str, body: Mapping[str, Any]) -> str: ...
    def list_pods_on(self, node: str) -> list[dict[str, Any]]: ...
    def evict_pod(self, namespace: str, name: str, uid: str) -> None: ...
    def close(self) -> None: ...


def _q(s: str) -> str:
    return quote(s, safe="")


def _lease_path(namespace: str, name: str = "") -> str:
    base = f"/apis/coordination.k8s.io/v1/namespaces/{_q(namespace)}/leases"
    return f"{base}/{_q(name)}" if name else base


class KubeControllerApi:
    def __init__(self, client: KubeClient, watch_read_timeout_s: float = 120.0, page_size: int = LIST_PAGE) -> None:
        self.client = client
        self.watch_read_timeout_s = watch_read_timeout_s
        self.page_size = page_size

    def list_node_pages(self, selector: str) -> Iterator[NodePage]:
        """The Nodes, one page per step of the iterator: the next page is requested only when the caller asks for
        it, after this one's JSON has been let go here (the caller lets go of its items before asking)."""
        cont = ""
        while True:
            query = {"limit": str(self.page_size)}
            if selector:
                query["labelSelector"] = selector
            if cont:
                query["continue"] = cont
            page = self.client.request("GET", "/api/v1/nodes", query=query)
            meta = page.get("metadata") or {}
            cont = str(meta.get("continue") or "")
            rv = str(meta.get("resourceVersion") or "")
            items = [i for i in page.get("items") or [] if isinstance(i, dict)]
            del page, meta
            yield NodePage(items, rv)
            del items
            if not cont:
                return

    def watch_nodes(self, selector: str, resource_version: str, timeout_s: int) -> Iterator[dict[str, Any]]:
        query = {"resourceVersion": resource_version, "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_s)}
        if selector:
            query["labelSelector"] = selector
        return self.client.watch("/api/v1/nodes", query, self.watch_read_timeout_s)

    def get_node(self, name: str) -> dict[str, Any]:
        return self.client.request("GET", f"/api/v1/nodes/{_q(name)}")

    def patch_node(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return self.client.request("PATCH", f"/api/v1/nodes/{_q(name)}", dict(patch), MERGE_PATCH)

    def get_lease(self, namespace: str, name: str) -> dict[str, Any]:
        return self.client.request("GET", _lease_path(namespace, name))

    def create_lease(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.client.request("POST", _lease_path(namespace), dict(body), JSON)

    def update_lease(self, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.client.request("PUT", _lease_path(namespace, name), dict(body), JSON)

    def create_event(self, namespace: str, body: Mapping[str, Any]) -> str:
        return self.client.create_event(namespace, body)

    def list_pods_on(self, node: str) -> list[dict[str, Any]]:
        doc = self.client.request("GET", "/api/v1/pods", query={"fieldSelector": f"spec.nodeName={node}"})
        return [p for p in doc.get("items") or [] if isinstance(p, dict)]

    def evict_pod(self, namespace: str, name: str, uid: str) -> None:
        self.client.evict_pod(namespace, name, uid)

    def close(self) -> None:
        self.client.close()
