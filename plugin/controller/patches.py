"""The Node patches the controller writes, computed apart from writing them: quarantine, the later NoExecute taint,
the drained mark, and the release that takes back exactly what the quarantine added.

Every patch is a JSON merge patch that carries the ``resourceVersion`` its facts were read at. Taints are a list
without a merge key, so a patch must send the whole list; the precondition makes the API server refuse it (409)
when anyone (the node lifecycle controller, an operator) changed the Node in between, instead of dropping their
taint. The caller then reads again and decides again.
"""

from __future__ import annotations

from typing import Any

from plugin.controller.nodes import (
    CONTROLLER,
    NO_EXECUTE_REMOVED,
    OWN_CORDON,
    OWN_LABEL,
    OWN_NO_EXECUTE,
    OWN_TAINT,
    Keys,
    NodeFacts,
)

NO_SCHEDULE = "NoSchedule"
NO_EXECUTE = "NoExecute"


def _has_taint(f: NodeFacts, key: str, effect: str) -> bool:
    return any(t.get("key") == key and t.get("effect") == effect for t in f.taints)


def split_label(label: str) -> tuple[str, str]:
    key, _, value = label.partition("=")
    return key, value


def quarantine(f: NodeFacts, keys: Keys, *, reason: str, message: str, now: str, cordon: bool,
               label: str, history: str | None = None) -> dict[str, Any]:
    """``history``: the node's quarantine times with this one (plugin/controller/repeat.py), written in the same
    patch as the taint so that no quarantine goes uncounted; None leaves the annotation as it is (the count off)."""
    owns: list[str] = []
    taints = [dict(t) for t in f.taints]
    if not _has_taint(f, keys.taint, NO_SCHEDULE):
        taints.append({"key": keys.taint, "value": reason, "effect": NO_SCHEDULE})
        owns.append(OWN_TAINT)
    spec: dict[str, Any] = {"taints": taints}
    if cordon and not f.unschedulable:
        spec["unschedulable"] = True
        owns.append(OWN_CORDON)
    meta: dict[str, Any] = {"resourceVersion": f.resource_version}
    annotations = {keys.by: CONTROLLER, keys.reason: reason, keys.message: message, keys.at: now}
    if label:
        key, value = split_label(label)
        if f.label(key) is None:  # an operator's label of that key stays theirs
            meta["labels"] = {key: value}
            owns.append(OWN_LABEL)
            annotations[keys.label] = label
    annotations[keys.owns] = ",".join(owns)
    if history is not None:
        annotations[keys.history] = history
    meta["annotations"] = annotations
    return {"metadata": meta, "spec": spec}


def no_execute(f: NodeFacts, keys: Keys, *, reason: str, now: str) -> dict[str, Any]:
    """The NoExecute taint added after the grace period: pods without a toleration for it are evicted by the
    taint manager."""
    assert f.quarantine is not None
    taints = [dict(t) for t in f.taints]
    owns = set(f.quarantine.owns)
    if not _has_taint(f, keys.taint, NO_EXECUTE):
        taints.append({"key": keys.taint, "value": reason, "effect": NO_EXECUTE, "timeAdded": now})
        owns.add(OWN_NO_EXECUTE)
    return {"metadata": {"resourceVersion": f.resource_version,
                         "annotations": {keys.owns: ",".join(sorted(owns))}},
            "spec": {"taints": taints}}


def drained(f: NodeFacts, keys: Keys, *, now: str) -> dict[str, Any]:
    return {"metadata": {"resourceVersion": f.resource_version, "annotations": {keys.drained: now}}}


def missing(f: NodeFacts, keys: Keys) -> frozenset[str]:
    """What the record says we added that the Node no longer has: someone (an operator) took it off. It is theirs
    from then on: should they put the same thing back, release must leave it."""
    q = f.quarantine
    if q is None:
        return frozenset()
    gone = set()
    if OWN_TAINT in q.owns and not _has_taint(f, keys.taint, NO_SCHEDULE):
        gone.add(OWN_TAINT)
    if OWN_NO_EXECUTE in q.owns and not _has_taint(f, keys.taint, NO_EXECUTE):
        gone.add(OWN_NO_EXECUTE)
    if OWN_CORDON in q.owns and not f.unschedulable:
        gone.add(OWN_CORDON)
    if OWN_LABEL in q.owns:
        key, value = split_label(q.label)
        if not q.label or f.label(key) != value:
            gone.add(OWN_LABEL)
    return frozenset(gone)


def disown(f: NodeFacts, keys: Keys, items: frozenset[str]) -> dict[str, Any]:
    """Strike from the record what an operator took off, so that no later release (by this leader or the next)
    takes back what they may put there again."""
    q = f.quarantine
    assert q is not None
    kept = q.owns - items
    if OWN_NO_EXECUTE in items:
        kept |= {NO_EXECUTE_REMOVED}  # the grace is over; putting it back would undo their removal
    annotations: dict[str, Any] = {keys.owns: ",".join(x for x in _ORDER if x in kept)}
    if OWN_LABEL in items:
        annotations[keys.label] = None
    return {"metadata": {"resourceVersion": f.resource_version, "annotations": annotations}}


_ORDER = (OWN_TAINT, OWN_CORDON, OWN_LABEL, OWN_NO_EXECUTE, NO_EXECUTE_REMOVED)


def release(f: NodeFacts, keys: Keys, disowned: frozenset[str] = frozenset(), reset: bool = False) -> dict[str, Any]:
    """Undo our quarantine: our taints, our cordon, our label, our annotations; nothing an operator set. What to
    take back is what the record says was added (less what an operator took off since, ``disowned``), never today's
    settings. The quarantine history stays, unless ``reset`` (an operator's release request, which goes too)."""
    q = f.quarantine
    assert q is not None
    owns = q.owns - disowned
    drop = set()
    if OWN_TAINT in owns:
        drop.add(NO_SCHEDULE)
    if OWN_NO_EXECUTE in owns:
        drop.add(NO_EXECUTE)
    taints = [dict(t) for t in f.taints if not (t.get("key") == keys.taint and t.get("effect") in drop)]
    spec: dict[str, Any] = {"taints": taints}
    if OWN_CORDON in owns and f.unschedulable:
        spec["unschedulable"] = False
    meta: dict[str, Any] = {"resourceVersion": f.resource_version,
                            "annotations": dict.fromkeys(keys.ours())}
    if reset:
        meta["annotations"].update(dict.fromkeys((keys.history, keys.release)))
    if OWN_LABEL in owns and q.label:
        key, value = split_label(q.label)
        if f.label(key) == value:  # a value an operator put there since is theirs
            meta["labels"] = {key: None}
    return {"metadata": meta, "spec": spec}


def reset_count(f: NodeFacts, keys: Keys) -> dict[str, Any]:
    """An operator's release request on a node we do not hold: its quarantine count starts over, and the request is
    used up (left there, it would release the node's next repeat-offender quarantine unasked)."""
    return {"metadata": {"resourceVersion": f.resource_version,
                         "annotations": dict.fromkeys((keys.history, keys.release))}}
