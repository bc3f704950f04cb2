"""The node condition (opt-in): pure functions from a snapshot to the condition we want on the Node.

``status`` is ``False`` while any device is Unhealthy (the condition says "GPUs are healthy"), ``Unknown`` while none
is Unhealthy but some device's state is Unknown, ``True`` otherwise. The reason is in the configured style
(``condition_reasons.py``), from the worst reason of the devices that set the status. Times are left to the
writer: a condition's ``lastTransitionTime`` changes only when its status does, and nothing here depends on the
clock, so an unchanged node never causes a write.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from plugin.health.node_state import Snapshot
from plugin.health.reasons import State
from plugin.kube.events import rfc3339, truncate
from plugin.outlets.condition_reasons import condition_reason, worst_reason
from plugin.schema.annotations import device_names


@dataclass(frozen=True)
class DesiredCondition:
    type: str
    status: str  # "True", "False", "Unknown"
    reason: str
    message: str

    def same_as(self, current: Mapping[str, Any] | None) -> bool:
        return current is not None and all(current.get(k) == getattr(self, k)
                                           for k in ("type", "status", "reason", "message"))

    def to_patch_item(self, current: Mapping[str, Any] | None, now: float) -> dict[str, str]:
        """The condition as written. ``lastTransitionTime`` is kept from the node while the status is the same;
        the heartbeat is only moved when we write (a periodic heartbeat would be a write per period per node)."""
        keep = current is not None and current.get("status") == self.status and current.get("lastTransitionTime")
        transition = str(current["lastTransitionTime"]) if keep and current is not None else rfc3339(now)
        return {"type": self.type, "status": self.status, "reason": self.reason, "message": self.message,
                "lastHeartbeatTime": rfc3339(now), "lastTransitionTime": transition}


def desired_condition(snapshot: Snapshot, ctype: str, style: str = "ours") -> DesiredCondition:
    names = device_names(snapshot.devices)
    unhealthy = [d for d in snapshot.devices if d.state is State.UNHEALTHY]
    unknown = [d for d in snapshot.devices if d.state is State.UNKNOWN]
    own = tuple(r for r in snapshot.node_reasons if r.severity is State.UNHEALTHY)
    n = len(snapshot.devices)
    if own:
        # The node's own reason (a GPU missing) outranks its devices': the node is short of a GPU whatever the rest
        # say, and its reason names the fault an operator acts on.
        status, bad = "False", unhealthy
        head = "; ".join(f"{r.code}: {r.message}" for r in own)
        if unhealthy:
            head += f"; {len(unhealthy)} of {n} GPU devices Unhealthy"
        parts = [f"{names[d.id]} ({d.id}): {', '.join(r.code for r in d.reasons) or 'no reason given'}"
                 for d in sorted(bad, key=lambda d: names[d.id])]
        message = head + (": " + "; ".join(parts) if parts else "")
        reason = condition_reason(style, status, worst_reason([own, *(d.reasons for d in bad)]))
        return DesiredCondition(ctype, status, reason, truncate(message))
    if unhealthy:
        status, bad = "False", unhealthy
        head = f"{len(unhealthy)} of {n} GPU devices Unhealthy"
    elif unknown or (not snapshot.devices and snapshot.backend_error):
        status, bad = "Unknown", unknown
        head = f"{len(unknown)} of {n} GPU devices in an unknown state"
        if snapshot.backend_error:
            head += f"; backend error: {snapshot.backend_error}"
    else:
        degraded = sum(1 for d in snapshot.devices if d.state is State.DEGRADED)
        status, bad = "True", []
        head = f"no Unhealthy GPU devices ({n} devices, {degraded} Degraded)"
    parts = []
    for d in sorted(bad, key=lambda d: names[d.id]):
        codes = ", ".join(r.code for r in d.reasons) or "no reason given"
        parts.append(f"{names[d.id]} ({d.id}): {codes}")
    message = head + (": " + "; ".join(parts) if parts else "")
    reason = condition_reason(style, status, worst_reason(d.reasons for d in bad))
    return DesiredCondition(ctype, status, reason, truncate(message))


def find_condition(conditions: list[dict[str, Any]] | None, ctype: str) -> dict[str, Any] | None:
    for c in conditions or []:
        if c.get("type") == ctype:
            return c
    return None
