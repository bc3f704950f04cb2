"""NVSentinel's device API both ways, as pure values (docs/nvsentinel.md, "The device API").

Out: a physical GPU's state and reasons (its MIG devices' included) -> the one condition we own on its Gpu object, and
the status to write back when the server's copy holds every other provider's conditions too (a status write
replaces the whole status). In: another provider's conditions on one of our GPUs -> reasons for our engine
(``external-<type>``), each malformed condition named by the kind of fault so the caller can log and count it.

NVSentinel's providers give health a positive polarity: one condition type per provider (``NVMLReady``,
``DCGMHealth``...), ``True`` when that provider finds the GPU usable, and the GPU counts as healthy only while every
condition is ``True``. We write ours the same way and read theirs by the table below.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from plugin.health.reasons import Action, Reason, Source, State, worst_first

# The condition we own. Domain-prefixed so it can never collide with a type NVSentinel or another provider picks.
CONDITION_TYPE = "gpu-health.io/GPUHealthy"
# The aggregate NVSentinel computes from every condition, ours included: read back, it would echo our own verdict.
AGGREGATE_TYPES = frozenset({"Ready"})
STATUSES = ("True", "False", "Unknown")

# Our state -> our condition's status.
STATUS_OF: Mapping[State, str] = {State.HEALTHY: "True", State.DEGRADED: "False", State.UNHEALTHY: "False",
                                  State.UNKNOWN: "Unknown"}
# Another provider's condition status -> the severity of the reason it becomes (True: none, the GPU is fine by it).
# Its conditions say only usable or not, never "usable but degraded", so False is the worst we know.
EXTERNAL_SEVERITY: Mapping[str, State] = {"False": State.UNHEALTHY, "Unknown": State.UNKNOWN}

CODE_PREFIX = "external-"
CODE_MAX = 48  # the bound of a reason code as a metrics label (outlets/metrics label_code)
MESSAGE_MAX = 256  # what we keep of a message: a reason's message is read in a table cell, an annotation, an Event
MESSAGE_REFUSED = 16384  # beyond this a message is not a message but a broken peer
OUR_MESSAGE_MAX = 1024


@dataclass(frozen=True)
class GpuCondition:
    """One condition of a Gpu as plain values; ``last_transition`` in unix seconds (0: unset)."""

    type: str
    status: str
    reason: str
    message: str
    last_transition: float = 0.0


@dataclass(frozen=True)
class Verdict:
    """What we want a GPU's condition and recommended action to say (time aside: it moves only with the status)."""

    status: str
    reason: str
    message: str
    action: str  # an Action's value, or "" when we ask for nothing

    def condition(self, last_transition: float) -> GpuCondition:
        return GpuCondition(CONDITION_TYPE, self.status, self.reason, self.message, last_transition)


def camel(code: str) -> str:
    """A reason code in UpperCamelCase, the style of a condition's reason: ``ecc-uncorrected`` -> ``EccUncorrected``,
    ``xid-79`` -> ``Xid79``."""
    return "".join(part[:1].upper() + part[1:] for part in code.split("-") if part)


def physical(devices: Iterable[tuple[str, State, tuple[Reason, ...]]]) -> dict[str, tuple[State, tuple[Reason, ...]]]:
    """(physical GPU UUID, state, reasons) of every device, MIG devices included -> each physical GPU's worst state
    and its reasons, worst first and each once: a fault on a MIG device is a fault of the GPU it lives on."""
    out: dict[str, tuple[State, tuple[Reason, ...]]] = {}
    for uuid, state, reasons in devices:
        before_state, before = out.get(uuid, (State.HEALTHY, ()))
        seen = {(r.code, r.message) for r in before}
        merged = before + tuple(r for r in reasons if (r.code, r.message) not in seen)
        out[uuid] = (State.worst(before_state, state), worst_first(merged))
    return out


def verdict(state: State, reasons: Sequence[Reason]) -> Verdict:
    """Our condition for a GPU in ``state`` with ``reasons`` (worst first)."""
    worst = reasons[0] if reasons else None
    if state is State.HEALTHY or worst is None:
        msg = f"{state.value}" if worst is None else f"{state.value}: {worst.code}: {worst.message}"
        return Verdict(STATUS_OF[state], state.value, msg, "")
    more = f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else ""
    msg = _cut(f"{state.value}: {worst.code}: {worst.message}{more}", OUR_MESSAGE_MAX)
    action = "" if worst.action is Action.NONE else worst.action.value
    return Verdict(STATUS_OF[state], camel(worst.code), msg, action)


def merged_status(existing: Sequence[GpuCondition], existing_action: str, ours: Verdict, now: float,
                  our_last_action: str | None) -> tuple[tuple[GpuCondition, ...], str]:
    """The whole status to write: every other provider's condition as the server holds it, ours replaced (its time
    moves only when its status does), and the recommended action.

    The action is one field for all providers. We write ours only where the field is empty or holds what we wrote
    last; another provider's stays. ``our_last_action`` is None when we do not know what we wrote (after our own
    restart): a value naming one of our actions is then taken for ours if our condition is on the GPU."""
    before = next((c for c in existing if c.type == CONDITION_TYPE), None)
    since = before.last_transition if before is not None and before.status == ours.status and \
        before.last_transition else now
    others = tuple(c for c in existing if c.type != CONDITION_TYPE)
    if our_last_action is None:
        ours_there = before is not None and existing_action in {a.value for a in Action}
        our_last_action = existing_action if ours_there else ""
    mine = existing_action == "" or existing_action == our_last_action
    action = ours.action if mine else existing_action
    return (*others, ours.condition(since)), action


def differs(existing: Sequence[GpuCondition], existing_action: str, ours: Verdict, our_last_action: str) -> bool:
    """Whether the server's copy of a GPU lacks what we want on it (a resync reads, and writes only when this holds).
    The action counts only while the field is ours to write."""
    before = next((c for c in existing if c.type == CONDITION_TYPE), None)
    if before is None or (before.status, before.reason, before.message) != (ours.status, ours.reason, ours.message):
        return True
    mine = existing_action == "" or existing_action == our_last_action
    return mine and existing_action != ours.action


# Consumer --------------------------------------------------------------------------------------------------------

_CAMEL_BREAK = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_NOT_CODE = re.compile(r"[^a-z0-9]+")


def external_code(condition_type: str) -> str:
    """``external-<type>``: the type's words in lower case joined by dashes (CamelCase split, a domain's dots and
    slash turned into dashes, so ``example.com/DiskOK`` reads ``external-example-com-disk-ok``), bounded to a
    reason code's length."""
    words = _NOT_CODE.sub("-", _CAMEL_BREAK.sub("-", condition_type).lower()).strip("-")
    return (CODE_PREFIX + words)[:CODE_MAX].rstrip("-")


@dataclass(frozen=True)
class Rejected:
    """A condition (or a GPU) we could not take: ``kind`` is a closed set (counted, and logged once per kind)."""

    kind: str  # one of REJECT_KINDS
    detail: str


REJECT_KINDS = ("empty-type", "bad-status", "bad-message", "no-uuid", "undecodable")


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _printable(text: str) -> str:
    return "".join(ch if ch.isprintable() else " " for ch in text)


def external_reasons(gpu_name: str, conditions: Sequence[GpuCondition], recommended_action: str,
                     first_seen: Mapping[str, float], now: float) -> tuple[tuple[Reason, ...], tuple[Rejected, ...]]:
    """Every condition of another provider that says the GPU is not fine -> a reason. ``first_seen`` holds when each
    code was first seen on this GPU (kept while it stays), ``now`` stands for the new ones. Our own condition and
    the aggregate are never read; a malformed condition is rejected alone."""
    try:
        action = Action(recommended_action)
    except ValueError:
        action = Action.CONTACT_SUPPORT
    if action is Action.NONE:
        action = Action.CONTACT_SUPPORT  # a provider that says "not fine" asks for something; we cannot say what
    reasons: dict[str, Reason] = {}
    rejected: list[Rejected] = []
    for c in conditions:
        if c.type == CONDITION_TYPE or c.type in AGGREGATE_TYPES:
            continue
        if not c.type.strip():
            rejected.append(Rejected("empty-type", f"GPU {gpu_name}: a condition with no type"))
            continue
        label = _cut(_printable(c.type), 64)
        if c.status not in STATUSES:
            rejected.append(Rejected("bad-status", f"GPU {gpu_name} condition {label}: status "
                                                   f"{_cut(_printable(c.status), 32)!r} is not True, False or Unknown"))
            continue
        if not _utf8(c.message) or not _utf8(c.reason) or len(c.message) > MESSAGE_REFUSED:
            rejected.append(Rejected("bad-message", f"GPU {gpu_name} condition {label}: message not UTF-8 or over "
                                                    f"{MESSAGE_REFUSED} characters"))
            continue
        severity = EXTERNAL_SEVERITY.get(c.status)
        if severity is None:
            continue
        code = external_code(c.type)
        said = f"{c.reason}: {c.message}" if c.reason and c.message else c.reason or c.message or c.status
        msg = _cut(_printable(f"{label} {c.status}: {said}"), MESSAGE_MAX)
        r = Reason(code, severity, msg, Source.EXTERNAL, action, first_seen.get(code, now))
        # Two types that read alike once sanitized are one reason: the worse of the two.
        if code not in reasons or severity.rank > reasons[code].severity.rank:
            reasons[code] = r
    return worst_first(reasons.values()), tuple(rejected)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: bytes that were never UTF-8, carried through a lenient decode
        return False
    return True
