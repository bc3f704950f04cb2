"""A core/v1 Event as we post it, written once for the node agent and the fleet controller: its body, the cap on its
message and the truncation, and the API server's time format."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from plugin.kube.names import COMPONENT

MESSAGE_MAX = 1024  # characters of an Event's or the node condition's message


def rfc3339(t: float) -> str:
    """Wall-clock seconds as the API server writes times: whole seconds, UTC."""
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def truncate(message: str, limit: int = MESSAGE_MAX) -> str:
    return message if len(message) <= limit else message[:limit - 3] + "..."


@dataclass(frozen=True)
class Involved:
    """The object an Event is about."""

    kind: str  # a core/v1 kind: Node, Pod
    name: str
    namespace: str = ""  # empty for a cluster-scoped object
    uid: str = ""  # empty when unknown: the Event still goes out, matched by kind and name only


def event_body(involved: Involved, namespace: str, *, reason: str, type_: str, message: str, count: int,
               first: float, last: float, host: str, stem: str | None = None,
               component: str = COMPONENT) -> dict[str, Any]:
    """A core/v1 Event in ``namespace`` about ``involved``: ``kubectl describe`` on that object lists it. ``first``
    and ``last`` are wall-clock seconds; ``host`` is the node we run on (empty when unknown); ``stem`` starts the
    generated name (the object's name unless given); ``component`` is who reports it (the plugin unless given)."""
    ref: dict[str, str] = {"apiVersion": "v1", "kind": involved.kind}
    if involved.namespace:
        ref["namespace"] = involved.namespace
    ref["name"] = involved.name
    if involved.uid:
        ref["uid"] = involved.uid
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{involved.name if stem is None else stem}.gpu-health.",
                     "namespace": namespace},
        "involvedObject": ref,
        "reason": reason,
        "message": truncate(message),
        "type": type_,
        "count": count,
        "firstTimestamp": rfc3339(first),
        "lastTimestamp": rfc3339(last),
        "source": {"component": component, **({"host": host} if host else {})},
        "reportingComponent": component,
        "reportingInstance": host or component,
    }
