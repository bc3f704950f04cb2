"""Durations as an operator writes them: seconds (``90``, ``1.5``) or Go-style (``90s``, ``10m``, ``1h30m``,
``250ms``), and back."""

from __future__ import annotations

import math
import re
from typing import Any

_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|h|m|s)")
_DURATION = re.compile(rf"-?(?:{DURATION_PART.pattern})+")
_DURATION_HINT = "a duration (seconds, or like 90s, 10m, 1h30m)"


def parse_duration(v: Any) -> float:
    """Seconds from a number (``90``, ``"1.5"``) or a Go-style string (``"90s"``, ``"10m"``, ``"1h30m"``,
    ``"250ms"``). The sign is kept so the caller's range check can say what is wrong with a negative one."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"expected {_DURATION_HINT}, got {v!r}")
    if isinstance(v, str):
        s = v.strip()
        try:
            seconds = float(s)
        except ValueError:
            if not _DURATION.fullmatch(s):
                raise ValueError(f"expected {_DURATION_HINT}, got {v!r}") from None
            seconds = sum(float(n) * _UNIT_S[u] for n, u in DURATION_PART.findall(s))
            seconds = -seconds if s.startswith("-") else seconds
    else:
        seconds = float(v)
    if not math.isfinite(seconds):
        raise ValueError(f"expected {_DURATION_HINT}, got {v!r}")
    return seconds


def number_text(x: float) -> str:
    """A number as a user writes it: ``5``, not ``5.0``."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def format_duration(seconds: float) -> str:
    """The way a config writes a duration back (``1h``, ``10m``, ``1m30s``, ``0s``, ``1.5s``)."""
    if seconds == 0:
        return "0s"
    sign, rest = ("-", -seconds) if seconds < 0 else ("", seconds)
    out = ""
    for unit, size in (("h", 3600), ("m", 60)):
        n = int(rest // size)
        if n:
            out += f"{n}{unit}"
            rest -= n * size
    rest = round(rest, 6)
    if rest or not out:
        out += f"{number_text(rest)}s"
    return sign + out


class Duration:
    """An option parser for a duration of 0 or more (``positive``: above 0)."""

    def __init__(self, *, positive: bool) -> None:
        self.positive = positive

    def __call__(self, v: Any) -> float:
        s = parse_duration(v)
        if self.positive and not s > 0:
            raise ValueError(f"must be a duration above 0, got {v!r}")
        if s < 0:
            raise ValueError(f"must be a duration of 0 or more, got {v!r}")
        return s
