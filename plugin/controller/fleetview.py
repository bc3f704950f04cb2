"""The fleet view of ``kubectl gpu-health fleet``: which nodes the controller quarantined, why and since when, and the
state of its circuit breaker, computed from a node list and the controller's Lease as the API server returns them.

Pure: the caller reads the objects (kubectl or saved files) and prints what these functions return.
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from plugin.controller.config import ControllerConfig
from plugin.controller.nodes import CONTROLLER, Keys, gpu_count
from plugin.controller.repeat import REPEAT_OFFENDER, format_history, parse_history
from plugin.health.reasons import State
from plugin.kube.names import DEFAULT_PREFIX

DEFAULT_NAMESPACE = ControllerConfig.namespace
DEFAULT_LEASE = ControllerConfig.lease_name

TAINT_ONLY_MESSAGE = "(taint without controller annotations)"


class Status(StrEnum):
    QUARANTINED = "quarantined"  # by the controller: its annotations say so
    TAINT_ONLY = "taint-only"  # our taint, none of the controller's annotations: set by hand, or a release cut short
    CANDIDATE = "candidate"  # not quarantined, but not healthy either (--all)


class BreakerState(StrEnum):
    OPEN = "open"
    CLOSED = "closed"
    UNKNOWN = "unknown"  # no Lease to read it from
    UNREADABLE = "unreadable"  # a Lease whose breaker annotation does not parse


@dataclass(frozen=True)
class Row:
    node: str
    status: Status
    reason: str
    since: str | None
    owns: tuple[str, ...] = ()
    message: str = ""
    taints: tuple[str, ...] = ()  # effects of our taint on the node
    # The quarantine times the controller recorded (its quarantine-history, pruned to its repeat window when it
    # last quarantined the node), and an operator's release request (its value; None: none).
    history: tuple[str, ...] = ()
    release_requested: str | None = None

    @property
    def repeat_offender(self) -> bool:
        return self.status is Status.QUARANTINED and self.reason == REPEAT_OFFENDER


@dataclass(frozen=True)
class Breaker:
    state: BreakerState
    since: str | None = None
    limit: int | None = None
    gpu_nodes: int | None = None
    quarantined: int | None = None
    blocked: int | None = None
    reason: str | None = None
    detail: str | None = None  # why the state is unknown or unreadable, or that none was recorded yet


@dataclass(frozen=True)
class Fleet:
    gpu_nodes: int
    quarantined: int
    rows: tuple[Row, ...]
    repeat_offenders: int
    breaker: Breaker
    namespace: str
    lease_name: str
    lease_found: bool
    holder: str | None
    renew_time: str | None
    reset_command: str


def _annotations(node: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = node.get("metadata")
    ann = meta.get("annotations") if isinstance(meta, Mapping) else None
    return ann if isinstance(ann, Mapping) else {}


def _name(node: Mapping[str, Any]) -> str:
    meta = node.get("metadata")
    return str(meta.get("name", "")) if isinstance(meta, Mapping) else ""


def _status_section(node: Mapping[str, Any], key: str) -> Any:
    status = node.get("status")
    return status.get(key) if isinstance(status, Mapping) else None


def is_gpu_node(node: Mapping[str, Any], prefix: str = DEFAULT_PREFIX) -> bool:
    """A node the controller counts: GPUs in its capacity, or our state annotation (the agent may have withdrawn
    every device, but the node is still ours to count)."""
    return Keys(prefix).state in _annotations(node) or gpu_count(_status_section(node, "capacity")) > 0


def counted(node: Mapping[str, Any], prefix: str = DEFAULT_PREFIX) -> bool:
    """In the breaker's denominator as the controller counts it: a GPU node, or a node it holds quarantined (that
    counts until released, whatever it looks like now)."""
    return is_gpu_node(node, prefix) or _annotations(node).get(Keys(prefix).by) == CONTROLLER


def capacity_gap(node: Mapping[str, Any]) -> int:
    """GPUs the kubelet reports in capacity but not in allocatable: what the stock device plugin's health shows."""
    return max(0, gpu_count(_status_section(node, "capacity")) - gpu_count(_status_section(node, "allocatable")))


def _our_taints(node: Mapping[str, Any], prefix: str) -> list[Mapping[str, Any]]:
    spec = node.get("spec")
    taints = spec.get("taints") if isinstance(spec, Mapping) else None
    if not isinstance(taints, list):
        return []
    return [t for t in taints if isinstance(t, Mapping) and t.get("key") == Keys(prefix).taint]


def _one_line(v: Any) -> str:
    return " ".join(str(v).split()) if v is not None else ""


def _owns(v: Any) -> tuple[str, ...]:
    return tuple(x.strip() for x in str(v).split(",") if x.strip()) if v is not None else ()


def _history(ann: Mapping[str, Any], prefix: str) -> tuple[str, ...]:
    times = parse_history(ann.get(Keys(prefix).history))
    return tuple(format_history(times).split(",")) if times else ()


def _release_requested(ann: Mapping[str, Any], prefix: str) -> str | None:
    key = Keys(prefix).release
    return _one_line(ann[key]) if key in ann else None


def _row(node: Mapping[str, Any], prefix: str, include_candidates: bool) -> Row | None:
    ann = _annotations(node)
    name = _name(node)
    taints = _our_taints(node, prefix)
    effects = tuple(str(t.get("effect", "")) for t in taints)
    if ann.get(Keys(prefix).by) == CONTROLLER:
        reason = ann.get(Keys(prefix).reason) or next((t.get("value") for t in taints if t.get("value")), "")
        return Row(name, Status.QUARANTINED, _one_line(reason), _one_line(ann.get(Keys(prefix).at)) or None,
                   _owns(ann.get(Keys(prefix).owns)), _one_line(ann.get(Keys(prefix).message)), effects,
                   _history(ann, prefix), _release_requested(ann, prefix))
    if taints:
        reason = next((t.get("value") for t in taints if t.get("value")), "")
        # Only a NoExecute taint carries timeAdded; it is the best "since" such a node has.
        added = next((t.get("timeAdded") for t in taints if t.get("timeAdded")), None)
        return Row(name, Status.TAINT_ONLY, _one_line(reason), _one_line(added) or None, (),
                   TAINT_ONLY_MESSAGE, effects, _history(ann, prefix), _release_requested(ann, prefix))
    if not include_candidates or not is_gpu_node(node, prefix):
        return None
    state = ann.get(Keys(prefix).state)
    if state is not None:
        if state == State.HEALTHY.value:
            return None
        return Row(name, Status.CANDIDATE, _one_line(state), None,
                   message=_one_line(ann.get(Keys(prefix).summary)), history=_history(ann, prefix))
    # Without our annotations the stock plugin's signal is all there is, as for the controller's capacity-gap rule.
    gap = capacity_gap(node)
    if gap > 0:
        total = gpu_count(_status_section(node, "capacity"))
        return Row(name, Status.CANDIDATE, "capacity-gap", None,
                   message=f"{gap} of {total} GPUs not allocatable (capacity minus allocatable)",
                   history=_history(ann, prefix))
    return None


def _since_key(row: Row) -> tuple[int, float, str, str]:
    if row.since is None:
        return (2, 0.0, "", row.node)
    try:
        t = dt.datetime.fromisoformat(row.since)
        if t.tzinfo is None:
            t = t.replace(tzinfo=dt.UTC)
        return (0, t.timestamp(), "", row.node)
    except ValueError:
        return (1, 0.0, row.since, row.node)


def rows(nodes: Iterable[Mapping[str, Any]], prefix: str = DEFAULT_PREFIX,
         include_candidates: bool = False) -> list[Row]:
    """Quarantined and taint-only nodes (and candidates, when asked), oldest quarantine first, then by name; rows
    without a time come last."""
    out = [r for n in nodes if (r := _row(n, prefix, include_candidates)) is not None]
    return sorted(out, key=_since_key)


_INT_FIELDS = (("limit", "limit"), ("gpuNodes", "gpu_nodes"), ("quarantined", "quarantined"), ("blocked", "blocked"))


def parse_breaker(value: str) -> Breaker:
    """The controller's persisted breaker (``<prefix>/breaker`` on its Lease). Missing keys are left unknown, so an
    older or newer controller's value still reads; a value that is not JSON, or a key of the wrong type, is
    unreadable, naming what is wrong."""
    try:
        doc = json.loads(value)
    except json.JSONDecodeError as exc:
        return Breaker(BreakerState.UNREADABLE, detail=f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")
    if not isinstance(doc, dict):
        return Breaker(BreakerState.UNREADABLE, detail=f"expected a JSON object, got {type(doc).__name__}")
    state = doc.get("state")
    if state is None:
        parsed_state = BreakerState.UNKNOWN
    elif state in (BreakerState.OPEN.value, BreakerState.CLOSED.value):
        parsed_state = BreakerState(state)
    else:
        return Breaker(BreakerState.UNREADABLE, detail=f"state: expected 'open' or 'closed', got {state!r}")
    fields: dict[str, Any] = {}
    for key, attr in _INT_FIELDS:
        v = doc.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            return Breaker(BreakerState.UNREADABLE, detail=f"{key}: expected a count, got {v!r}")
        fields[attr] = v
    for key in ("since", "reason"):
        v = doc.get(key)
        if v is not None and not isinstance(v, str):
            return Breaker(BreakerState.UNREADABLE, detail=f"{key}: expected a string, got {v!r}")
        fields[key] = v
    detail = "no state in the breaker annotation" if parsed_state is BreakerState.UNKNOWN else None
    return Breaker(parsed_state, detail=detail, **fields)


def breaker_of(lease: Mapping[str, Any] | None, namespace: str, name: str, prefix: str = DEFAULT_PREFIX,
               unavailable: str | None = None) -> Breaker:
    """The breaker as the Lease records it. ``lease`` None: not found, or not read at all (``unavailable`` says
    why, in place of the usual "no lease")."""
    where = f"{namespace}/{name}"
    if lease is None:
        return Breaker(BreakerState.UNKNOWN, detail=unavailable or f"no lease {where}: controller not deployed?")
    value = _annotations(lease).get(Keys(prefix).breaker)
    if value is None:
        # The controller writes the annotation the first time the breaker opens; until then it is closed.
        return Breaker(BreakerState.CLOSED, detail=f"never opened: no {Keys(prefix).breaker} on lease {where}")
    b = parse_breaker(str(value))
    if b.state is BreakerState.UNREADABLE:
        return Breaker(BreakerState.UNREADABLE, detail=f"{Keys(prefix).breaker} on lease {where}: {b.detail}")
    return b


def reset_command(namespace: str, name: str, prefix: str = DEFAULT_PREFIX,
                  kubectl_flags: Sequence[str] = ()) -> str:
    """What an operator runs to reset the breaker: any new value of the reset annotation does it."""
    flags = "".join(" " + shlex.quote(f) for f in kubectl_flags)
    return (f"kubectl annotate lease -n {shlex.quote(namespace)} {shlex.quote(name)} "
            f'{Keys(prefix).breaker_reset}="$(date +%s)" --overwrite{flags}')


def release_command(node: str, prefix: str = DEFAULT_PREFIX, kubectl_flags: Sequence[str] = ()) -> str:
    """What an operator runs to release a repeat offender (and reset its count): the request annotation, which the
    controller removes when it acts on it. ``kubectl gpu-health fleet release NODE --note TEXT`` writes the same."""
    flags = "".join(" " + shlex.quote(f) for f in kubectl_flags)
    return f"kubectl annotate node {shlex.quote(node)} {Keys(prefix).release}=\"<why>\" --overwrite{flags}"


def _lease_spec(lease: Mapping[str, Any] | None, key: str) -> str | None:
    spec = lease.get("spec") if lease is not None else None
    v = spec.get(key) if isinstance(spec, Mapping) else None
    return str(v) if v else None


def fleet(nodes: Sequence[Mapping[str, Any]], lease: Mapping[str, Any] | None, *, namespace: str = DEFAULT_NAMESPACE,
          lease_name: str = DEFAULT_LEASE, prefix: str = DEFAULT_PREFIX, include_candidates: bool = False,
          lease_unavailable: str | None = None, kubectl_flags: Sequence[str] = ()) -> Fleet:
    """Everything the view shows, from the items of ``kubectl get nodes -o json`` and the Lease object (or None)."""
    all_rows = rows(nodes, prefix, include_candidates)
    return Fleet(
        gpu_nodes=sum(1 for n in nodes if counted(n, prefix)),
        quarantined=sum(1 for r in all_rows if r.status is Status.QUARANTINED),
        rows=tuple(all_rows),
        repeat_offenders=sum(1 for r in all_rows if r.repeat_offender),
        breaker=breaker_of(lease, namespace, lease_name, prefix, lease_unavailable),
        namespace=namespace, lease_name=lease_name, lease_found=lease is not None,
        holder=_lease_spec(lease, "holderIdentity"), renew_time=_lease_spec(lease, "renewTime"),
        reset_command=reset_command(namespace, lease_name, prefix, kubectl_flags),
    )


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%"


def _breaker_text(f: Fleet) -> str:
    b = f.breaker
    if b.state is BreakerState.OPEN:
        blocked = [] if b.blocked is None else [f"blocked {b.blocked} candidate{'' if b.blocked == 1 else 's'}"]
        return f"open{f' since {b.since}' if b.since else ''} ({'; '.join([*blocked, f'reset: {f.reset_command}'])})"
    if b.state is BreakerState.CLOSED:
        return f"closed{f' since {b.since}' if b.since else ''}{f' ({b.detail})' if b.detail else ''}"
    return f"{b.state.value} ({b.detail})"


def header(f: Fleet) -> str:
    """One line: the counts against the breaker's limit, the breaker, and who leads."""
    b = f.breaker
    share: list[str] = []
    if f.gpu_nodes:
        share.append(_percent(f.quarantined, f.gpu_nodes))
    # A limit of 0 of 0 GPU nodes is what a breaker that never counted a fleet records: no limit worth showing.
    if b.limit is not None and (b.limit or b.gpu_nodes):
        # The limit is a share of the fleet the controller counted, which its selector may make differ from ours.
        of = b.gpu_nodes if b.gpu_nodes else f.gpu_nodes
        share.append(f"limit {_percent(b.limit, of)} = {b.limit}" if of else f"limit {b.limit}")
    shares = f" ({', '.join(share)})" if share else ""
    line = f"GPU nodes: {f.gpu_nodes}, quarantined by {CONTROLLER}: {f.quarantined}{shares}, "
    if f.repeat_offenders:
        line += f"repeat offenders: {f.repeat_offenders}, "
    line += f"breaker: {_breaker_text(f)}"
    if f.lease_found:
        line += f", leader: {f.holder or 'none'}"
    return line


def breaker_reason(f: Fleet) -> str | None:
    """The breaker's own words on its last change, for a line under the header."""
    return f.breaker.reason or None


def _message(r: Row) -> str:
    if r.release_requested is None:
        return r.message or "-"
    # The request comes first: it is what the operator did, and what the controller will act on once it is fit.
    return f"release requested ({r.release_requested or 'no note'}); {r.message or '-'}"


def render_table(table_rows: Sequence[Row]) -> str:
    """COUNT: the quarantines the controller recorded within its repeat window (``-``: none recorded)."""
    head = ("NODE", "REASON", "SINCE", "COUNT", "OWNS", "MESSAGE")
    cells = [head] + [(r.node, f"candidate: {r.reason}" if r.status is Status.CANDIDATE else r.reason or "-",
                       r.since or "-", str(len(r.history)) if r.history else "-", ",".join(r.owns) or "-",
                       _message(r)) for r in table_rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head) - 1)]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "   " + row[-1]
                     for row in cells)


def to_json(f: Fleet) -> dict[str, Any]:
    b = f.breaker
    return {
        "controller": CONTROLLER,
        "gpuNodes": f.gpu_nodes,
        "quarantined": f.quarantined,
        "lease": {"namespace": f.namespace, "name": f.lease_name, "found": f.lease_found, "holder": f.holder,
                  "renewTime": f.renew_time},
        "breaker": {"state": b.state.value, "since": b.since, "limit": b.limit, "gpuNodes": b.gpu_nodes,
                    "quarantined": b.quarantined, "blocked": b.blocked, "reason": b.reason, "detail": b.detail},
        "reset": f.reset_command,
        "repeatOffenders": f.repeat_offenders,
        "nodes": [{"node": r.node, "status": r.status.value, "reason": r.reason, "since": r.since,
                   "owns": list(r.owns), "message": r.message, "taints": list(r.taints),
                   "quarantines": len(r.history), "quarantineHistory": list(r.history),
                   "repeatOffender": r.repeat_offender, "releaseRequested": r.release_requested} for r in f.rows],
    }
