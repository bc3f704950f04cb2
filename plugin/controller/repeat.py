"""Repeat offenders: the quarantine times the controller keeps on a Node, and when they make it one.

A node quarantined ``--repeat-limit`` times within ``--repeat-window`` (5 in 7 days, NVSentinel's defaults) is a
repeat offender: whatever clears its fault, it keeps failing, and releasing it again would put work back on it to be
lost again. Its quarantine then has reason ``repeat-offender`` and is not released when the node is fit, only once
an operator asks for it (``controller.<prefix>/release``).

The times live in the controller's own record, ``controller.<prefix>/quarantine-history`` (RFC 3339, oldest
first), where the node agent's account cannot write (docs/fleet.md, "Whose record"): a compromised agent can neither
forget its node's past nor forge another's. Unlike the rest of the record, a release leaves it, or the count could
never reach the limit; an operator's release request resets it. The list is written only with a quarantine (the
patch that adds the taint adds its time, so no write of its own), pruned then to the window and bounded by the limit,
so it never holds more than the decision needs.

Pure: times are the controller's clock, passed in. A time ahead of it (a replica whose clock ran ahead wrote it) is
kept and counts: clock skew between replicas moves the window by the skew, never forgets a quarantine early.
"""

from __future__ import annotations

from collections.abc import Iterable

from plugin.controller.nodes import parse_time
from plugin.kube.events import rfc3339

REPEAT_OFFENDER = "repeat-offender"  # the reason code on the taint and in the record


def parse_history(value: object) -> tuple[float, ...]:
    """The quarantine times of a ``quarantine-history`` value, sorted; what does not parse (an operator's edit) is
    left out rather than refusing the rest."""
    if not isinstance(value, str) or not value:
        return ()
    return tuple(sorted(t for part in value.split(",") if (t := parse_time(part.strip())) is not None))


def format_history(times: Iterable[float]) -> str:
    return ",".join(rfc3339(t) for t in times)


def in_window(history: Iterable[float], now: float, window_s: float) -> tuple[float, ...]:
    """The times that still count at ``now``: those less than ``window_s`` ago, and any ahead of ``now``."""
    return tuple(t for t in history if t > now - window_s)


def record(history: Iterable[float], now: float, window_s: float, limit: int) -> tuple[float, ...]:
    """The history to write with a quarantine at ``now``: the times in the window, this one added, at most the
    ``limit`` latest (more would change no decision)."""
    kept = sorted((*in_window(history, now, window_s), now))
    return tuple(kept[-limit:]) if limit > 0 else ()


def is_repeat(times: tuple[float, ...], limit: int) -> bool:
    """Whether the quarantine that wrote ``times`` (from :func:`record`) makes its node a repeat offender."""
    return limit > 0 and len(times) >= limit
