"""What the controller keeps of a Node: the few facts its rules and its patches need, read from the Node's JSON.

A fleet of 50,000 Nodes is held in memory; each one's full JSON (status images, conditions, managed fields) is many
kilobytes, so only these facts are kept, and kept small (issue 27; docs/benchmarks.md, "Fleet controller memory per
Node"): the repeated strings (states, actions, codes, device and label keys, label values) are interned, so every
Node's "Healthy" is one object; a device keeps no time and no GPU id, only which of the node's GPUs it is on; and the
devices of a node, and its labels, are shared with every other node whose devices (all healthy, most of a fleet), or
whose labels but for its name, read the same. The annotations the node agent writes (docs/annotations.md) are
decoded here, by the schema's codec, once per change, never by the rules.
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from plugin.health.reasons import Action, State
from plugin.schema.annotations import STATE_KEY, SUMMARY_KEY, DeviceEntry, decode

GPU_RESOURCE = "nvidia.com/gpu"  # and every resource named after it: nvidia.com/gpu.shared, nvidia.com/mig-1g.10gb
MIG_RESOURCE = "nvidia.com/mig-"
CONTROLLER = "gpu-health-controller"  # our Event source, and the value of quarantined-by

# What the controller can have added to a Node, as listed in its quarantine-owns annotation. Release removes these
# and nothing else.
OWN_TAINT = "taint"
OWN_NO_EXECUTE = "noexecute"
OWN_CORDON = "cordon"
OWN_LABEL = "label"
# Not a thing to take back: someone took our NoExecute taint off, and it is not put back during this quarantine.
NO_EXECUTE_REMOVED = "noexecute-removed"

OWNER_SUBDOMAIN = "controller"


@dataclass(frozen=True)
class Keys:
    """The annotation, taint and label keys under one prefix.

    The node agent writes under ``<prefix>/``, and the admission policy lets its account change any annotation
    there; so the controller's own record of a quarantine (what it added, when, why) lives under
    ``controller.<prefix>/``, which that policy refuses the agent. Only that record is trusted: a
    ``<prefix>/quarantined-by`` an agent (or an older controller) wrote makes no node ours. The taint keeps its
    key, ``<prefix>/quarantine``: the agent cannot change a Node's spec at all.
    """

    prefix: str

    @property
    def owner(self) -> str:
        """The prefix of the controller's own record."""
        return f"{OWNER_SUBDOMAIN}.{self.prefix}"

    @property
    def state(self) -> str:
        return f"{self.prefix}/{STATE_KEY}"

    @property
    def summary(self) -> str:
        return f"{self.prefix}/{SUMMARY_KEY}"

    @property
    def taint(self) -> str:
        return f"{self.prefix}/quarantine"

    @property
    def by(self) -> str:
        return f"{self.owner}/quarantined-by"

    @property
    def reason(self) -> str:
        return f"{self.owner}/quarantine-reason"

    @property
    def message(self) -> str:
        return f"{self.owner}/quarantine-message"

    @property
    def at(self) -> str:
        return f"{self.owner}/quarantined-at"

    @property
    def owns(self) -> str:
        return f"{self.owner}/quarantine-owns"

    @property
    def drained(self) -> str:
        return f"{self.owner}/quarantine-drained"

    @property
    def label(self) -> str:
        """The label (key=value) the quarantine added, as it added it: release removes that one, whatever
        --quarantine-label says by then."""
        return f"{self.owner}/quarantine-label"

    @property
    def history(self) -> str:
        """The times of the node's recent quarantines (plugin/controller/repeat.py): kept through a release, unlike
        the rest of the record, so that a repeat offender can be told."""
        return f"{self.owner}/quarantine-history"

    @property
    def release(self) -> str:
        """An operator's request to release a repeat offender (any value; the controller removes it when it acts
        on it) and to reset the node's quarantine count."""
        return f"{self.owner}/release"

    @property
    def breaker(self) -> str:
        return f"{self.prefix}/breaker"

    @property
    def breaker_reset(self) -> str:
        return f"{self.prefix}/breaker-reset"

    @property
    def out_of_sight(self) -> str:
        """On the Lease: the Nodes we hold quarantined that the watch no longer shows, for the next leader."""
        return f"{self.prefix}/quarantined-out-of-sight"

    def ours(self) -> tuple[str, ...]:
        """The Node annotations a quarantine writes, and its release removes (all under :attr:`owner`). Not the
        history, which outlives the release, nor the operator's release request."""
        return (self.by, self.reason, self.message, self.at, self.owns, self.drained, self.label)


@dataclass(frozen=True, slots=True)
class Device:
    key: str  # the annotation key's name part: gpu.3, gpu.3.mig.1.0, dev.<hex>
    # The physical GPU it belongs to (its own id, or a MIG device's parent), as the node's own numbering of the ids
    # its devices name: the rules only count the distinct GPUs of Unhealthy devices, and a number is shared by
    # every node where a text id would be one more string per device.
    gpu: int
    state: str
    action: str
    code: str  # the top reason's code, "" when healthy
    # No `since`: no rule reads the agent's times (its account can write any; see policy.py), and a time of each
    # device would make every node's devices unlike every other's.


@dataclass(frozen=True, slots=True)
class Quarantine:
    """A quarantine this controller applied, as its annotations record it."""

    reason: str
    at: float | None
    owns: frozenset[str]
    drained: bool
    label: str = ""  # key=value of the label it added ("" when it added none)


class NameLabel:
    """In :attr:`NodeFacts.labels`: the value is the node's name. An object, not a text: no label value can be it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NAME"


NAME = NameLabel()


@dataclass(frozen=True, slots=True)
class NodeFacts:
    name: str
    uid: str
    resource_version: str
    gpu_capacity: int
    gpu_allocatable: int
    annotated: bool  # the node agent's state annotation is there
    node_state: str  # its value, "" when not annotated
    devices: tuple[Device, ...]
    # Physical GPUs: the agent's count, else those the entries show; None when neither can say (an older agent
    # whose entries the size cap cut: the ones left are the worst, and counting only them would inflate a share).
    device_total: int | None
    taints: tuple[Mapping[str, Any], ...]
    unschedulable: bool
    # Every label, as one flat tuple sorted by key: (key, value, key, value, ...), the strings interned and a value
    # equal to the node's name (the hostname label) as NAME, so that nodes whose labels differ only by their names
    # share one tuple. A dict per node would cost three times as much; the controller reads one or two keys
    # (:meth:`label`).
    labels: tuple[str | NameLabel, ...]
    quarantine: Quarantine | None  # ours, when our own-prefix quarantined-by names this controller
    foreign_taint: bool  # our taint key present without our annotations (an operator's, or a lost record)
    # The controller's quarantine-history annotation as written (parsed only when a quarantine needs it: most nodes
    # have none, and a text is smaller than the times), and an operator's release request (its value, maybe empty;
    # None: none). Both are under the controller's own prefix, where the agent cannot write.
    history: str = ""
    release_request: str | None = None
    # Why the agent's annotations cannot be read ("" when they can): a value past the codec's bounds, which only
    # a broken or hostile agent writes. The rules then neither quarantine nor release the node on a guess.
    unreadable: str = ""
    # The codes of the node's own reasons (the agent's ``node`` key: gpu-missing), interned; () for most nodes.
    node_codes: tuple[str, ...] = ()

    @property
    def is_gpu_node(self) -> bool:
        return self.gpu_capacity > 0 or self.annotated

    def label(self, key: str) -> str | None:
        """The value of label ``key``, None when the node has none."""
        labels = self.labels
        for i in range(0, len(labels), 2):
            if labels[i] == key:
                value = labels[i + 1]
                return self.name if isinstance(value, NameLabel) else value
        return None

    def decision_key(self) -> tuple[object, ...]:
        """Everything a decision depends on: a change of anything else (a heartbeat, an image list) needs none. Any
        label counts: an operator's relabelling may be what lets a refused write through (an admission policy)."""
        return (self.gpu_capacity, self.gpu_allocatable, self.annotated, self.node_state, self.devices,
                self.device_total, self.taints, self.unschedulable, self.labels, self.quarantine,
                self.foreign_taint, self.history, self.release_request, self.unreadable, self.node_codes)


def parse_time(value: object) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def gpu_count(resources: object) -> int:
    """The GPUs in a capacity or allocatable map: every ``nvidia.com/gpu*`` and ``nvidia.com/mig-*`` resource. Only
    plain integers count ("1k" and friends are not GPU counts anyone writes); anything else (a saved file a person
    edited) counts as none."""
    if not isinstance(resources, Mapping):
        return 0
    total = 0
    for name, qty in resources.items():
        if not isinstance(name, str) or not name.startswith((GPU_RESOURCE, MIG_RESOURCE)) or isinstance(qty, bool):
            continue
        try:
            total += int(str(qty).strip())
        except ValueError:
            continue
    return total


_T = TypeVar("_T")
# Values equal across nodes are kept once: the devices of a node (all healthy: the same tuple on most of a fleet), each
# device, and (the reconciler's) each assessment. Bounded, so that values seen once (a device of an odd key, a rare
# reason) cannot grow it without end; the common ones arrive first, with the first LIST.
_SHARED_MAX = 4096
_shared: dict[object, object] = {}


def shared(value: _T) -> _T:
    """``value``, or an equal one kept before: one object for what many Nodes hold alike."""
    kept = _shared.get(value)
    if kept is not None:
        return kept  # type: ignore[return-value]  # equal, hence of the same type
    if len(_shared) < _SHARED_MAX:
        _shared[value] = value
    return value


def _text(value: str) -> str:
    return sys.intern(value)


def _devices(entries: tuple[DeviceEntry, ...]) -> tuple[Device, ...]:
    gpus: dict[str, int] = {}  # the node's GPU ids, numbered in the order of its sorted device keys
    # Sorted by key as text: the order the rules list devices in their messages.
    return shared(tuple(
        shared(Device(key=_text(e.key), gpu=gpus.setdefault(e.gpu, len(gpus)), state=_text(e.state),
                      action=_text(e.action or Action.NONE), code=_text(e.code)))
        for e in sorted(entries, key=lambda e: e.key)))


def _labels(labels: object, name: str) -> tuple[str | NameLabel, ...]:
    if not isinstance(labels, Mapping):
        return ()
    out: list[str | NameLabel] = []
    for key in sorted(k for k in labels if isinstance(k, str)):
        value = labels[key]
        if not isinstance(value, str):
            continue  # not a label the API server would serve; a hand-made file may hold one
        out += (_text(key), NAME if value == name else _text(value))
    return shared(tuple(out))


def facts_of(node: Mapping[str, Any], keys: Keys) -> NodeFacts:
    meta = node.get("metadata") or {}
    spec = node.get("spec") or {}
    status = node.get("status") or {}
    annotations: Mapping[str, str] = meta.get("annotations") or {}
    agent = decode(annotations, keys.prefix)
    taints = tuple(t for t in (spec.get("taints") or []) if isinstance(t, dict))
    quarantine = None
    if annotations.get(keys.by) == CONTROLLER:
        owns = frozenset(_text(x.strip()) for x in annotations.get(keys.owns, "").split(",") if x.strip())
        quarantine = Quarantine(reason=_text(annotations.get(keys.reason, "")),
                                at=parse_time(annotations.get(keys.at)), owns=owns,
                                drained=bool(annotations.get(keys.drained)),
                                label=_text(annotations.get(keys.label, "")))
    has_taint = any(t.get("key") == keys.taint for t in taints)
    name = str(meta.get("name") or "")
    unreadable = ""
    if agent.unreadable:
        first = agent.unreadable[0]
        more = len(agent.unreadable) - 1
        unreadable = f"{keys.prefix}/{first.key}: {first.why}" + (f" (+{more} more)" if more else "")
    return NodeFacts(
        name=name, uid=str(meta.get("uid") or ""),
        resource_version=str(meta.get("resourceVersion") or ""),
        gpu_capacity=gpu_count(status.get("capacity")),
        gpu_allocatable=gpu_count(status.get("allocatable")),
        annotated=agent.annotated, node_state=_text(agent.state),
        devices=_devices(agent.devices), device_total=agent.gpu_count, taints=taints,
        unschedulable=bool(spec.get("unschedulable")),
        labels=_labels(meta.get("labels"), name), quarantine=quarantine,
        foreign_taint=has_taint and quarantine is None,
        history=str(annotations.get(keys.history) or ""),
        release_request=None if keys.release not in annotations else str(annotations[keys.release]),
        unreadable=unreadable,
        node_codes=tuple(_text(c) for c in agent.node_codes),
    )


HEALTHY_STATES = (State.HEALTHY, State.DEGRADED)
