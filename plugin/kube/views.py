"""What the API calls hand back besides raw JSON: the few fields of a Node or Pod the node agent reads, and one
page of the controller's Node LIST."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass(frozen=True)
class NodeView:
    """What we know of the Node on the server: enough to compute patches and address Events."""

    name: str
    uid: str
    resource_version: str
    annotations: dict[str, str]
    conditions: list[dict[str, Any]] = field(default_factory=list)
    # Read for one label (GPU Feature Discovery's nvidia.com/gpu.count); not part of what a patch is computed from.
    labels: dict[str, str] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class PodView:
    uid: str
    node_name: str


class NodePage(NamedTuple):
    items: list[dict[str, Any]]
    resource_version: str  # the list's: every page of one LIST is served from the same snapshot


def node_view(doc: dict[str, Any]) -> NodeView:
    meta = doc.get("metadata") or {}
    conditions = (doc.get("status") or {}).get("conditions") or []
    return NodeView(name=meta.get("name") or "", uid=meta.get("uid") or "",
                    resource_version=meta.get("resourceVersion") or "",
                    annotations=dict(meta.get("annotations") or {}), conditions=[dict(c) for c in conditions],
                    labels={str(k): str(v) for k, v in (meta.get("labels") or {}).items()})
