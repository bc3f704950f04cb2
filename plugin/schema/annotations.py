"""The node annotation schema (docs/annotations.md): its one codec, both directions, as pure functions.

Encoding: the agent's writer (``outlets/reporter.py``) hands in a snapshot and the last transition of each device and
gets back the annotations we want, then the merge patch that turns what the server has into that; no I/O and no
clock. Decoding: the fleet controller, ``kubectl gpu-health`` and the tests turn a Node's annotations back into typed
values with :func:`decode`. Nothing else reads these keys. Bump ``SCHEMA_VERSION`` on any incompatible change.

Keys (``<prefix>`` is ``gpu-health.io`` by default):

- ``<prefix>/schema``: the schema version.
- ``<prefix>/state``: the worst device state on the node (one word, for ``kubectl get -o custom-columns``).
- ``<prefix>/summary``: one readable line: counts per state and the worst devices with their top reason. For
  people: readers take counts from ``devices``, never from this line.
- ``<prefix>/devices``: how many devices and physical GPUs the node has, ``{"total":N,"gpus":G}``, whatever the size
  cap dropped. Added within v1: a node written by an older agent has no such key.
- ``<prefix>/gpu.<index>`` and ``<prefix>/gpu.<index>.mig.<gi>.<ci>``: one compact JSON value per device. Key names
  must fit 63 characters, which a GPU UUID after ``gpu.`` does not, so the key uses the index and the value carries
  the UUID. A device whose key would clash or not fit gets ``dev.<16 hex digits of sha256(id)>``.
- ``<prefix>/truncated``: present only when the size cap dropped device entries.
- ``<prefix>/node``: present only while the node itself has reasons (``gpu-missing``: a GPU on the PCI bus that NVML
  does not list), ``{"reasons":[{"code","severity","action","message","since"}]}``. Added within v1.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeGuard

from plugin.health.node_state import ABSENT, DeviceStatus, Snapshot, Transition
from plugin.health.reasons import Action, State
from plugin.kube.events import rfc3339
from plugin.kube.names import DEFAULT_PREFIX
from plugin.validation import is_qualified_name

SCHEMA_VERSION = "v1"
DEFAULT_MAX_BYTES = 65536
API_LIMIT_BYTES = 256 * 1024  # the API server's limit on all annotations of an object together

MESSAGE_MAX = 96  # characters of a reason message kept in a device value
# Bounds on one value a reader decodes. The agent's account may write any value under the prefix (its admission
# policy cannot look inside them), and json.loads recurses once per level: a thousand "[" raise RecursionError, which
# no reader expects. What the agent writes nests three deep and, with every reason of the table on one device, stays
# far below the size (tests/unit/test_annotations_codec.py holds both).
VALUE_MAX_BYTES = 32768
VALUE_MAX_DEPTH = 8
WHY_MAX = 300  # characters of a clearance's why: an operator's note (256) with the words around it
SUMMARY_WORST = 3  # devices named in the summary line

SCHEMA_KEY = "schema"
STATE_KEY = "state"
SUMMARY_KEY = "summary"
TRUNCATED_KEY = "truncated"
COUNT_KEY = "devices"
NODE_KEY = "node"
FIXED_KEYS = (SCHEMA_KEY, STATE_KEY, SUMMARY_KEY, COUNT_KEY, TRUNCATED_KEY, NODE_KEY)

_DEVICE_NAME_RE = re.compile(r"^(gpu\.\d+(\.mig\.\d+\.\d+)?|dev\.[0-9a-f]{16})$")


def device_name(d: DeviceStatus) -> str:
    """The readable part of a device's key: ``gpu.3`` or ``gpu.3.mig.1.0``."""
    if d.mig is not None:
        return f"gpu.{d.gpu.index}.mig.{d.mig.gpu_instance_id}.{d.mig.compute_instance_id}"
    return f"gpu.{d.gpu.index}"


def hashed_name(device_id: str) -> str:
    return "dev." + hashlib.sha256(device_id.encode()).hexdigest()[:16]


def device_names(devices: Iterable[DeviceStatus]) -> dict[str, str]:
    """Device id -> key name. Index-based names are stable across restarts and readable; where two devices
    would share one (a broken discovery, a negative index) both fall back to a hash of their id."""
    devs = list(devices)
    wanted = {d.id: device_name(d) for d in devs}
    counts: dict[str, int] = {}
    for name in wanted.values():
        counts[name] = counts.get(name, 0) + 1
    out: dict[str, str] = {}
    for dev_id, name in wanted.items():
        ok = counts[name] == 1 and is_qualified_name(name) and _DEVICE_NAME_RE.match(name)
        out[dev_id] = name if ok else hashed_name(dev_id)
    return out


def is_our_key(key: str, prefix: str) -> bool:
    """Keys this outlet owns and may change or remove. Other keys under the prefix (set by hand or by another
    tool) are left alone, as is everything outside it."""
    if not key.startswith(prefix + "/"):
        return False
    name = key[len(prefix) + 1:]
    return name in FIXED_KEYS or bool(_DEVICE_NAME_RE.match(name))


def _short(message: str, limit: int = MESSAGE_MAX) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit - 3] + "..."


def recommended_action(d: DeviceStatus) -> str:
    """The action of the device's worst reason (its reasons are worst first: health/node_state.py)."""
    return d.reasons[0].action if d.reasons else Action.NONE.value


def last_transitions(history: Iterable[Transition]) -> dict[str, Transition]:
    """The latest real transition of each device. A device appearing (from Absent, e.g. at every plugin start)
    is not one: counting it would rewrite every key after each restart for no news. Nor is a clearance that left
    the state as it was (from == to): the value's ``cleared`` says that one."""
    out: dict[str, Transition] = {}
    for t in history:
        if t.from_state != ABSENT and t.to_state != ABSENT and t.from_state != t.to_state:
            out[t.id] = t
    return out


def device_value(d: DeviceStatus, last: Transition | None, minimal: bool = False) -> str:
    """Compact JSON for one device. ``minimal`` drops the reason messages (the first step of truncation)."""
    reasons = d.reasons
    doc: dict[str, object] = {"id": d.id, "state": d.state.value}
    if d.mig is not None:
        doc["parent"] = d.gpu.uuid
        doc["profile"] = d.mig.profile
    doc["action"] = recommended_action(d)
    doc["since"] = rfc3339(d.since)
    if last is not None:
        doc["lastTransition"] = rfc3339(last.time)
        doc["from"] = last.from_state
    if minimal:
        doc["reasons"] = [{"code": r.code} for r in reasons]
    else:
        doc["reasons"] = [{"code": r.code, "message": _short(r.message), "action": r.action} for r in reasons]
    c = d.cleared
    if c is not None:
        # The device's latest clearance while the node state keeps it: what was taken off, why, when. Its why is
        # text, so it goes with the messages when the size cap bites; the codes and the time stay.
        cleared: dict[str, object] = {"codes": list(c.codes)}
        if not minimal:
            cleared["why"] = _short(c.why, WHY_MAX)
        cleared["at"] = rfc3339(c.time)
        doc["cleared"] = cleared
    return json.dumps(doc, separators=(",", ":"), sort_keys=False)


def node_state(snapshot: Snapshot) -> State:
    """The worst of the devices' states and the node's own reasons (a GPU missing makes the node Unhealthy while
    every GPU there is Healthy)."""
    own = [r.severity for r in snapshot.node_reasons]
    if not snapshot.devices:
        return State.worst(State.UNKNOWN if snapshot.backend_error else State.HEALTHY, *own)
    return State.worst(*(d.state for d in snapshot.devices), *own)


def node_value(snapshot: Snapshot) -> str | None:
    """The ``node`` key's value: the node's own reasons, worst first; None (no key) when it has none."""
    if not snapshot.node_reasons:
        return None
    return json.dumps({"reasons": [{"code": r.code, "severity": r.severity.value, "action": r.action.value,
                                    "message": _short(r.message, 4 * MESSAGE_MAX), "since": rfc3339(r.first_seen)}
                                   for r in snapshot.node_reasons]}, separators=(",", ":"))


def _severity_order(d: DeviceStatus, name: str) -> tuple[int, str]:
    return (-d.state.rank, name)


def summary_line(snapshot: Snapshot, names: Mapping[str, str]) -> str:
    """``Unhealthy: 8 devices (6 Healthy, 1 Degraded, 1 Unhealthy); gpu.3 Unhealthy xid-79 (reboot-node), ...``"""
    counts: dict[State, int] = {}
    for d in snapshot.devices:
        counts[d.state] = counts.get(d.state, 0) + 1
    parts = ", ".join(f"{counts[s]} {s.value}" for s in sorted(counts, key=lambda s: s.rank))
    n = len(snapshot.devices)
    line = f"{node_state(snapshot).value}: {n} device{'' if n == 1 else 's'}"
    if parts:
        line += f" ({parts})"
    bad = sorted((d for d in snapshot.devices if d.state is not State.HEALTHY),
                 key=lambda d: _severity_order(d, names[d.id]))
    worst = []
    for d in bad[:SUMMARY_WORST]:
        top = d.reasons
        why = f" {top[0].code} ({top[0].action})" if top else ""
        worst.append(f"{names[d.id]} {d.state.value}{why}")
    if len(bad) > SUMMARY_WORST:
        worst.append(f"+{len(bad) - SUMMARY_WORST} more")
    # The node's own reasons come first: what they say (a GPU missing) is not in any device's entry.
    worst = [f"node {r.code} ({r.action})" for r in snapshot.node_reasons] + worst
    if worst:
        line += "; " + ", ".join(worst)
    if snapshot.backend_error:
        line += f"; backend error: {_short(snapshot.backend_error)}"
    return line


def size_of(annotations: Mapping[str, str]) -> int:
    """Bytes as the API server counts them against its limit: keys plus values."""
    return sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())


@dataclass(frozen=True)
class Desired:
    annotations: dict[str, str]
    truncated: int  # device entries dropped by the size cap


def desired_annotations(snapshot: Snapshot, last: Mapping[str, Transition], prefix: str = DEFAULT_PREFIX,
                        max_bytes: int = DEFAULT_MAX_BYTES) -> Desired:
    """The annotations this node should carry under ``prefix``. Deterministic: the same snapshot and last
    transitions give the same strings, so "nothing changed" is a dict comparison and never a write.

    Over ``max_bytes`` the messages go first, then device entries, healthiest first; the fixed keys stay (the
    summary still counts every device) and ``<prefix>/truncated`` says how many entries were dropped."""
    names = device_names(snapshot.devices)
    fixed = {
        f"{prefix}/{SCHEMA_KEY}": SCHEMA_VERSION,
        f"{prefix}/{STATE_KEY}": node_state(snapshot).value,
        f"{prefix}/{SUMMARY_KEY}": summary_line(snapshot, names),
        f"{prefix}/{COUNT_KEY}": count_value(snapshot),
    }
    if (own := node_value(snapshot)) is not None:
        fixed[f"{prefix}/{NODE_KEY}"] = own
    devices = {f"{prefix}/{names[d.id]}": device_value(d, last.get(d.id)) for d in snapshot.devices}
    full = {**fixed, **devices}
    if size_of(full) <= max_bytes:
        return Desired(full, 0)
    devices = {f"{prefix}/{names[d.id]}": device_value(d, last.get(d.id), minimal=True) for d in snapshot.devices}
    full = {**fixed, **devices}
    if size_of(full) <= max_bytes:
        return Desired(full, 0)
    # Keep the worst devices; a marker with room for any count is reserved before choosing.
    marker_key = f"{prefix}/{TRUNCATED_KEY}"
    budget = max_bytes - size_of(fixed) - len(marker_key) - len(_marker(len(devices), max_bytes))
    kept: dict[str, str] = {}
    for d in sorted(snapshot.devices, key=lambda d: _severity_order(d, names[d.id])):
        key = f"{prefix}/{names[d.id]}"
        cost = len(key.encode()) + len(devices[key].encode())
        if cost <= budget:
            kept[key] = devices[key]
            budget -= cost
    dropped = len(devices) - len(kept)
    return Desired({**fixed, **dict(sorted(kept.items())), marker_key: _marker(dropped, max_bytes)}, dropped)


def count_value(snapshot: Snapshot) -> str:
    """``{"total":N,"gpus":G}``: every device (whole GPUs and MIG devices, as the summary counts them) and the
    physical GPUs among them. Written always, so a reader needs no device entry to know the node's size."""
    gpus = len({d.gpu.uuid for d in snapshot.devices})
    return json.dumps({"total": len(snapshot.devices), "gpus": gpus}, separators=(",", ":"))


def _marker(dropped: int, max_bytes: int) -> str:
    return f"{dropped} device entries omitted: over the {max_bytes}-byte cap (--annotation-max-bytes)"


def merge_patch(current: Mapping[str, str], desired: Mapping[str, str], prefix: str) -> dict[str, str | None]:
    """The ``metadata.annotations`` part of a JSON merge patch taking ``current`` (the node's annotations, all of
    them) to ``desired`` for our keys: changed or new keys with their value, our keys no longer wanted with null.
    Keys not ours are never in the patch, so nothing else on the node can be touched."""
    patch: dict[str, str | None] = {}
    for k, v in desired.items():
        if current.get(k) != v:
            patch[k] = v
    for k in current:
        if k not in desired and is_our_key(k, prefix):
            patch[k] = None
    return patch


# Decoding (the fleet controller, kubectl gpu-health, tests) --------------------------------------------------------

@dataclass(frozen=True)
class ClearedEntry:
    """A device value's ``cleared``: the reason codes taken off it, why ("" once the size cap dropped it, or for a
    value edited by hand), and when (RFC 3339, "" when absent)."""

    codes: tuple[str, ...]
    why: str
    at: str

    @property
    def text(self) -> str:
        """``cleared xid-79: node rebooted``, as the node state and the health stream say it."""
        return f"cleared {', '.join(self.codes) or '?'}" + (f": {self.why}" if self.why else "")


@dataclass(frozen=True)
class DeviceEntry:
    """One device value as read back. Every field is text, "" when the value lacks it: a value may have been
    edited by hand (the next resync repairs it), and each reader decides what a gap means to it."""

    node: str
    key: str  # the name after the prefix, e.g. gpu.3
    id: str
    state: str  # "" when the value has no state (or not a string): no device state can be read from it
    action: str
    since: str
    last_transition: str
    reasons: tuple[dict[str, str], ...]  # worst first, as written
    profile: str = ""
    parent: str = ""  # a MIG device's GPU
    from_state: str = ""
    cleared: ClearedEntry | None = None  # the latest clearance while the agent keeps it, added within v1

    @property
    def gpu(self) -> str:
        """The physical GPU the device belongs to: a MIG device's parent, else the device itself."""
        return self.parent or self.id or self.key

    @property
    def code(self) -> str:
        """The code of the worst reason, "" when there is none."""
        return self.reasons[0].get("code", "") if self.reasons else ""


@dataclass(frozen=True)
class Unreadable:
    """A value of ours no agent writes and no reader may decode: past :data:`VALUE_MAX_BYTES` or
    :data:`VALUE_MAX_DEPTH`. Not a hand edit (those are skipped quietly): someone wrote it to be decoded."""

    key: str  # the name after the prefix: gpu.3, devices
    why: str  # one line


@dataclass(frozen=True)
class NodeAnnotations:
    schema: str  # "" when absent
    state: str  # "" when absent
    annotated: bool  # the state key is there: an agent writes (or wrote) this node
    summary: str
    truncated: bool  # the size cap dropped device entries
    devices: tuple[DeviceEntry, ...]  # gpu.2 before gpu.10
    # Devices (whole GPUs and MIG devices) and physical GPUs on the node, never fewer than the entries show. None
    # when unknown: an older agent writes no count, and once it truncated, the entries left are only the worst.
    device_count: int | None
    gpu_count: int | None
    unreadable: tuple[Unreadable, ...] = ()
    # The node's own reasons (the ``node`` key), worst first, each with the fields as written ("" when absent).
    node_reasons: tuple[dict[str, str], ...] = ()

    @property
    def node_codes(self) -> tuple[str, ...]:
        return tuple(r["code"] for r in self.node_reasons if r.get("code"))


def decode(annotations: Mapping[str, str], prefix: str = DEFAULT_PREFIX, node: str = "") -> NodeAnnotations:
    """A node's annotations of ours, typed. Device values that are not our JSON are skipped, not fatal: an operator
    may have edited one by hand, and the next resync repairs it. Keys outside the prefix, and keys under it that are
    not ours, are never read."""
    devices: list[DeviceEntry] = []
    unreadable: list[Unreadable] = []
    for k, v in annotations.items():
        name = _our_name(k, prefix)
        if name is None or name in FIXED_KEYS:
            continue
        doc = _load(v)
        if isinstance(doc, Unreadable):
            unreadable.append(Unreadable(name, doc.why))
            continue
        entry = _device_entry(node, name, doc)
        if entry is not None:
            devices.append(entry)
    devices.sort(key=lambda e: _natural(e.key))
    truncated = bool(annotations.get(f"{prefix}/{TRUNCATED_KEY}"))
    count = _load(annotations.get(f"{prefix}/{COUNT_KEY}") or "")
    if isinstance(count, Unreadable):
        unreadable.append(Unreadable(COUNT_KEY, count.why))
        count = None
    own = _load(annotations.get(f"{prefix}/{NODE_KEY}") or "")
    if isinstance(own, Unreadable):
        unreadable.append(Unreadable(NODE_KEY, own.why))
        own = None
    node_reasons = _node_reasons(own)
    total, gpus = _count(count)
    seen_gpus = len({e.gpu for e in devices})
    if total is None or gpus is None:
        total, gpus = (None, None) if truncated else (len(devices), seen_gpus)
    else:
        total, gpus = max(total, len(devices)), max(gpus, seen_gpus)
    state_key = f"{prefix}/{STATE_KEY}"
    return NodeAnnotations(schema=annotations.get(f"{prefix}/{SCHEMA_KEY}", ""),
                           state=annotations.get(state_key, ""), annotated=state_key in annotations,
                           summary=annotations.get(f"{prefix}/{SUMMARY_KEY}", ""), truncated=truncated,
                           devices=tuple(devices), device_count=total, gpu_count=gpus,
                           unreadable=tuple(sorted(unreadable, key=lambda u: _natural(u.key))),
                           node_reasons=node_reasons)


def _node_reasons(doc: object) -> tuple[dict[str, str], ...]:
    """The ``node`` key's reasons; entries that are not objects with a string code are skipped (a hand edit)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("reasons"), list):
        return ()
    out = []
    for r in doc["reasons"]:
        if isinstance(r, dict) and isinstance(r.get("code"), str) and r["code"]:
            out.append({k: v for k, v in r.items() if isinstance(k, str) and isinstance(v, str)})
    return tuple(out)


def parse_node(node_name: str, annotations: Mapping[str, str], prefix: str = DEFAULT_PREFIX) -> list[DeviceEntry]:
    """The device entries that carry a state, for a reader listing devices (``kubectl gpu-health``, tests)."""
    return [e for e in decode(annotations, prefix, node_name).devices if e.state]


def _our_name(key: str, prefix: str) -> str | None:
    return key[len(prefix) + 1:] if is_our_key(key, prefix) else None


def _text(doc: Mapping[str, object], field: str) -> str:
    v = doc.get(field)
    return "" if v is None else str(v)


# A JSON string (escapes included), or one bracket: what nesting is counted on, strings skipped whole.
_NESTING = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_NOT_JSON = object()


def _load(raw: str) -> object:
    """``raw`` decoded; :class:`Unreadable` past the bounds; ``_NOT_JSON`` when it is not JSON (a hand edit)."""
    if not isinstance(raw, str):
        return _NOT_JSON
    if len(raw) > VALUE_MAX_BYTES:
        return Unreadable("", f"{len(raw)} characters, more than the {VALUE_MAX_BYTES} an agent writes")
    # Counting the brackets is cheap and settles almost every value: nesting cannot exceed their number.
    if raw.count("[") + raw.count("{") > VALUE_MAX_DEPTH:
        depth = deepest = 0
        for m in _NESTING.finditer(raw):
            c = m.group()
            if c in "[{":
                depth += 1
                deepest = max(deepest, depth)
            elif c in "]}":
                depth -= 1
        if deepest > VALUE_MAX_DEPTH:
            return Unreadable("", f"nested deeper than {VALUE_MAX_DEPTH} levels")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return _NOT_JSON


def _device_entry(node: str, name: str, doc: object) -> DeviceEntry | None:
    if not isinstance(doc, dict):
        return None
    state = doc.get("state")
    listed = doc.get("reasons")
    reasons = tuple({str(a): str(b) for a, b in r.items()} for r in (listed if isinstance(listed, list) else [])
                    if isinstance(r, dict))
    return DeviceEntry(node=node, key=name, id=_text(doc, "id"), state=state if isinstance(state, str) else "",
                       action=_text(doc, "action"), since=_text(doc, "since"),
                       last_transition=_text(doc, "lastTransition"), reasons=reasons,
                       profile=_text(doc, "profile"), parent=_text(doc, "parent"), from_state=_text(doc, "from"),
                       cleared=_cleared(doc.get("cleared")))


def _cleared(raw: object) -> ClearedEntry | None:
    """None when absent or not an object; what is there otherwise, as text (a hand edit may have broken a field)."""
    if not isinstance(raw, dict):
        return None
    codes = raw.get("codes")
    return ClearedEntry(codes=tuple(str(c) for c in codes) if isinstance(codes, list) else (),
                        why=_text(raw, "why"), at=_text(raw, "at"))


def _count(doc: object) -> tuple[int | None, int | None]:
    """The two counts of the count key's value; (None, None) when it is absent or not what we write."""
    if not isinstance(doc, dict):
        return None, None
    total, gpus = doc.get("total"), doc.get("gpus")
    if _is_count(total) and _is_count(gpus):
        return total, gpus
    return None, None


def _is_count(n: object) -> TypeGuard[int]:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _natural(key: str) -> tuple[tuple[int, int, str], ...]:
    """gpu.2 before gpu.10."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split("."))
