"""The one Kubernetes API client of both programs: every call the node agent and the fleet controller make, one
method per verb and resource, over :mod:`plugin.kube.transport`. The node agent's outlets depend on the narrow
protocols in :mod:`plugin.kube.protocols`, the controller on its own (plugin/controller/api.py); tests hand them
fakes.

Why a client of our own on the standard library (issue 14): the programs make a handful of calls (read a Node or a
Pod; merge-patch annotations; strategic-merge-patch the node condition; create and patch Events; evict a Pod; list
and watch Nodes; a Lease), and a general client library with its HTTP stack cost about 6 MiB of resident memory for
them. :mod:`plugin.kube.config` says what configuration it reads.

The Node LIST comes one page at a time, each fetched only when the one before has been used: a real GPU node's
JSON (its images, conditions and managed fields) is about 20 KB on the wire and 50 KB once parsed, so a whole
fleet's LIST held at once is hundreds of MiB at 5,000 Nodes, where the controller keeps a few KB of facts per Node.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from plugin.kube import config
from plugin.kube.config import SERVICE_ACCOUNT
from plugin.kube.errors import ApiFailure
from plugin.kube.names import COMPONENT
from plugin.kube.transport import Transport
from plugin.kube.views import NodePage, NodeView, PodView, node_view

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
JSON = "application/json"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
STRICT = {"fieldValidation": "Strict"}
# Nodes per LIST page. A page's raw answer, its text and its parsed JSON are alive together while it is read: at
# 5,000 real-sized Nodes a LIST in pages of 100 peaked at 80 MiB of RSS, in pages of 500 (the API server's own chunk
# size) at 121 MiB, in pages of 50 at 75 MiB for twice the requests (bench/bench_fleet.py --list-probe).
LIST_PAGE = 100


class KubeClient:
    """Every call, over one keep-alive HTTP(S) connection: in-cluster service-account config, or a kubeconfig file
    outside. Safe to share between threads (one request at a time). ``transport`` replaces the HTTP (tests)."""

    def __init__(self, kubeconfig: Path | None = None, timeout_s: float = 10.0,
                 service_account: Path = SERVICE_ACCOUNT, component: str = COMPONENT, *,
                 list_page_size: int = LIST_PAGE, watch_read_timeout_s: float = 120.0,
                 transport: Transport | None = None) -> None:
        self._http = transport or Transport(config.resolve(kubeconfig, service_account), timeout_s, component)
        self.list_page_size = list_page_size
        self.watch_read_timeout_s = watch_read_timeout_s

    # Nodes ----------------------------------------------------------------------------------------------------

    def get_node(self, name: str) -> NodeView:
        return node_view(self._http.request("GET", f"/api/v1/nodes/{_q(name)}"))

    def patch_node_annotations(self, name: str, patch: Mapping[str, str | None],
                               resource_version: str | None) -> NodeView:
        meta: dict[str, Any] = {"annotations": dict(patch)}
        if resource_version:
            meta["resourceVersion"] = resource_version  # a precondition: 409 if the node moved on
        return node_view(self.patch_node(name, {"metadata": meta}))

    def patch_node_condition(self, name: str, condition: Mapping[str, str]) -> NodeView:
        # Strategic merge on conditions (merge key: type) touches our condition only.
        body = {"status": {"conditions": [dict(condition)]}}
        return node_view(self._http.request("PATCH", f"/api/v1/nodes/{_q(name)}/status", body, STRATEGIC_PATCH))

    def get_node_doc(self, name: str) -> dict[str, Any]:
        """The whole Node, for the controller, which reads more of it than :class:`NodeView` keeps."""
        return self._http.request("GET", f"/api/v1/nodes/{_q(name)}")

    def patch_node(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of the Node; a ``metadata.resourceVersion`` in it is a precondition (409 if the node
        moved on)."""
        return self._http.request("PATCH", f"/api/v1/nodes/{_q(name)}", dict(patch), MERGE_PATCH)

    def list_node_pages(self, selector: str) -> Iterator[NodePage]:
        """The Nodes, one page per step of the iterator: the next page is requested only when the caller asks for
        it, after this one's JSON has been let go here (the caller lets go of its items before asking)."""
        cont = ""
        while True:
            query = {"limit": str(self.list_page_size)}
            if selector:
                query["labelSelector"] = selector
            if cont:
                query["continue"] = cont
            page = self._http.request("GET", "/api/v1/nodes", query=query)
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
        return self._http.watch("/api/v1/nodes", query, self.watch_read_timeout_s)

    # Events ---------------------------------------------------------------------------------------------------

    def create_event(self, namespace: str, body: Mapping[str, Any]) -> str:
        event = {"apiVersion": "v1", "kind": "Event", **body}
        created = self._http.request("POST", f"/api/v1/namespaces/{_q(namespace)}/events", event, JSON)
        return str((created.get("metadata") or {}).get("name"))

    def patch_event(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        self._http.request("PATCH", f"/api/v1/namespaces/{_q(namespace)}/events/{_q(name)}", dict(body), MERGE_PATCH)

    # Pods -----------------------------------------------------------------------------------------------------

    def get_pod(self, namespace: str, name: str) -> PodView:
        pod = self._http.request("GET", f"/api/v1/namespaces/{_q(namespace)}/pods/{_q(name)}")
        return PodView(uid=(pod.get("metadata") or {}).get("uid") or "",
                       node_name=(pod.get("spec") or {}).get("nodeName") or "")

    def patch_pod_annotations(self, namespace: str, name: str, annotations: Mapping[str, str | None]) -> None:
        body = {"metadata": {"annotations": dict(annotations)}}
        self._http.request("PATCH", f"/api/v1/namespaces/{_q(namespace)}/pods/{_q(name)}", body, MERGE_PATCH)

    def evict_pod(self, namespace: str, name: str, uid: str) -> None:
        body: dict[str, Any] = {"apiVersion": "policy/v1", "kind": "Eviction",
                                "metadata": {"name": name, "namespace": namespace}}
        if uid:
            # The UID precondition: never evict a new pod that took the old one's name after our lookup.
            body["deleteOptions"] = {"kind": "DeleteOptions", "preconditions": {"uid": uid}}
        self._http.request("POST", f"/api/v1/namespaces/{_q(namespace)}/pods/{_q(name)}/eviction", body, JSON)

    def patch_pod_status_condition(self, namespace: str, name: str, uid: str, condition: Mapping[str, str]) -> None:
        # Strategic merge on conditions (merge key: type) touches this condition only. The UID in the patch makes
        # it a write to this pod only: a pod made again under the name has another, which the server refuses to
        # take (the kubelet's own status patches carry it for the same reason).
        body = {"metadata": {"uid": uid}, "status": {"conditions": [dict(condition)]}}
        self._http.request("PATCH", f"/api/v1/namespaces/{_q(namespace)}/pods/{_q(name)}/status", body,
                           STRATEGIC_PATCH)

    def list_pods_on(self, node: str) -> list[dict[str, Any]]:
        doc = self._http.request("GET", "/api/v1/pods", query={"fieldSelector": f"spec.nodeName={node}"})
        return [p for p in doc.get("items") or [] if isinstance(p, dict)]

    # Leases (the controller's leader election) ----------------------------------------------------------------

    def get_lease(self, namespace: str, name: str) -> dict[str, Any]:
        return self._http.request("GET", _lease_path(namespace, name))

    def create_lease(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._http.request("POST", _lease_path(namespace), dict(body), JSON)

    def update_lease(self, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._http.request("PUT", _lease_path(namespace, name), dict(body), JSON)

    # ResourceSlices and ResourceClaims (DRA) ------------------------------------------------------------------

    def get_resource_slice(self, name: str) -> dict[str, Any] | None:
        try:
            return self._http.request("GET", f"{SLICES}/{_q(name)}")
        except ApiFailure as f:
            if f.status == 404:
                return None
            raise

    def create_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        # Strict: a field the server does not know is refused instead of dropped, so a mistake in our body fails
        # once, loudly, rather than making every comparison with the stored copy differ.
        return self._http.request("POST", SLICES, dict(body), JSON, STRICT)

    def update_resource_slice(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        # A PUT, not a patch: the slice is ours whole, and the body's metadata.resourceVersion makes a write from
        # a stale read fail with 409.
        return self._http.request("PUT", f"{SLICES}/{_q(name)}", dict(body), JSON, STRICT)

    def delete_resource_slice(self, name: str) -> None:
        try:
            self._http.request("DELETE", f"{SLICES}/{_q(name)}")
        except ApiFailure as f:
            if f.status != 404:  # already gone is what we wanted
                raise

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        path = f"/apis/resource.k8s.io/v1/namespaces/{_q(namespace)}/resourceclaims/{_q(name)}"
        return self._http.request("GET", path)

    # Any other call -------------------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, content_type: str | None = None,
                query: Mapping[str, str] | None = None) -> dict[str, Any]:
        """A call this class has no method for (the benchmarks' own): the decoded JSON answer, or
        :class:`ApiFailure`."""
        return self._http.request(method, path, body, content_type, query)

    def watch(self, path: str, query: Mapping[str, str], read_timeout_s: float) -> Iterator[dict[str, Any]]:
        """The events of ``GET path?watch=1&...`` one by one, on a connection of their own."""
        return self._http.watch(path, query, read_timeout_s)

    def close(self) -> None:
        """Close the connection without waiting: a call in flight on another thread fails at once. Open watches
        end too."""
        self._http.close()


def _q(segment: str) -> str:
    return quote(segment, safe="")


def _lease_path(namespace: str, name: str = "") -> str:
    base = f"/apis/coordination.k8s.io/v1/namespaces/{_q(namespace)}/leases"
    return f"{base}/{_q(name)}" if name else base
