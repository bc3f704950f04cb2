"""The API calls the controller makes, one method per verb and resource, over the project's own client
(plugin/outlets/kubeapi.py). The reconciler and the leader elector depend on the :class:`ControllerApi` protocol.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol
from urllib.parse import quote

from plugin.outlets.kubeapi import JSON, MERGE_PATCH, KubeClient

LIST_PAGE = 500  # Nodes per LIST page: the API server's own default chunk size for paginated lists


class LeaseApi(Protocol):
    """What the leader elector needs: the Lease, read and written."""

    def get_lease(self, namespace: str, name: str) -> dict[str, Any]: ...
    def create_lease(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]: ...
    def update_lease(self, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]: ...


class ControllerApi(LeaseApi, Protocol):
    def list_nodes(self, selector: str) -> tuple[list[dict[str, Any]], str]: ...
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
    def __init__(self, client: KubeClient, watch_read_timeout_s: float = 120.0) -> None:
        self.client = client
        self.watch_read_timeout_s = watch_read_timeout_s

    def list_nodes(self, selector: str) -> tuple[list[dict[str, Any]], str]:
        items: list[dict[str, Any]] = []
        cont = ""
        while True:
            query = {"limit": str(LIST_PAGE)}
            if selector:
                query["labelSelector"] = selector
            if cont:
                query["continue"] = cont
            page = self.client.request("GET", "/api/v1/nodes", query=query)
            items.extend(i for i in page.get("items") or [] if isinstance(i, dict))
            meta = page.get("metadata") or {}
            cont = str(meta.get("continue") or "")
            if not cont:
                return items, str(meta.get("resourceVersion") or "")

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
