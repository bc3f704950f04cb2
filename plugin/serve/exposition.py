"""The Prometheus exposition formats: the metric families collectors yield, and their encodings as the text format
(0.0.4, and 1.0.0 with a name escaping scheme) and OpenMetrics 1.0.0, the one a scraper gets chosen from its
``Accept`` header.

The bytes are the ones prometheus_client writes for the same families and the same header, down to float formatting
and the escaping schemes of the 1.0 formats (tests/unit/test_exposition.py holds this module to it). We do not import
prometheus_client for it: it loads http.server, wsgiref and urllib.request with it, some 3 MiB of the plugin's RSS.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol

TYPES = ("counter", "gauge", "summary", "histogram", "gaugehistogram", "unknown", "info", "stateset")

CONTENT_TYPE_TEXT_0_0_4 = "text/plain; version=0.0.4; charset=utf-8"
CONTENT_TYPE_TEXT_1_0_0 = "text/plain; version=1.0.0; charset=utf-8"
CONTENT_TYPE_OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"

# Name escaping schemes a scraper may ask for (``escaping=`` in Accept); names we export are valid legacy names,
# which only "dots" and, in OpenMetrics sample lines, "values" rewrite.
ALLOW_UTF8 = "allow-utf-8"
UNDERSCORES = "underscores"
DOTS = "dots"
VALUES = "values"
_SCHEMES = (ALLOW_UTF8, UNDERSCORES, DOTS, VALUES)

# ``$`` (not ``\Z``) as prometheus_client has it: a name with one trailing newline counts as a legacy name.
_LEGACY_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LEGACY_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_RESERVED_LABEL_NAME = re.compile(r"^__.*$")
_LABEL_RUNES = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_METRIC_RUNES = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class Sample(NamedTuple):
    """One line of a family: a series name (the family's, or it with a suffix), its labels and its value."""

    name: str
    labels: dict[str, str]
    value: float
    timestamp: float | None = None  # unix seconds


class Family:
    """One metric family: its name, help text, type, optional unit, and its samples in the order added."""

    __slots__ = ("documentation", "name", "samples", "type", "unit")

    def __init__(self, name: str, documentation: str, typ: str, unit: str = "") -> None:
        if unit and not name.endswith("_" + unit):
            name += "_" + unit
        if not name:
            raise ValueError("metric name cannot be empty")
        if not name.isascii():
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate: it could never be written out
                raise ValueError(f"invalid metric name {name!r}") from None
        if typ == "untyped":
            typ = "unknown"
        if typ not in TYPES:
            raise ValueError("Invalid metric type: " + typ)
        self.name = name
        self.documentation = documentation
        self.type = typ
        self.unit = unit
        self.samples: list[Sample] = []

    def add_sample(self, name: str, labels: dict[str, str], value: float, timestamp: float | None = None) -> None:
        self.samples.append(Sample(name, labels, value, timestamp))

    def __repr__(self) -> str:
        return f"Family({self.name!r}, {self.type!r}, {len(self.samples)} samples)"


class GaugeFamily(Family):
    """A gauge: one unlabelled ``value``, or one sample per :meth:`add_metric` for the label names given."""

    __slots__ = ("_labelnames",)

    def __init__(self, name: str, documentation: str, value: float | None = None,
                 labels: Sequence[str] | None = None, unit: str = "") -> None:
        super().__init__(name, documentation, "gauge", unit)
        if labels is not None and value is not None:
            raise ValueError("Can only specify at most one of value and labels.")
        self._labelnames = tuple(labels or ())
        if value is not None:
            self.add_metric([], value)

    def add_metric(self, labels: Sequence[str], value: float, timestamp: float | None = None) -> None:
        self.samples.append(Sample(self.name, dict(zip(self._labelnames, labels, strict=False)), value, timestamp))


class CounterFamily(Family):
    """A counter. The family is named without ``_total`` (given or not), its samples with it, as OpenMetrics
    wants; ``created`` adds the ``_created`` sample."""

    __slots__ = ("_labelnames",)

    def __init__(self, name: str, documentation: str, value: float | None = None,
                 labels: Sequence[str] | None = None, created: float | None = None, unit: str = "") -> None:
        if name.endswith("_total"):
            name = name[:-6]
        super().__init__(name, documentation, "counter", unit)
        if labels is not None and value is not None:
            raise ValueError("Can only specify at most one of value and labels.")
        self._labelnames = tuple(labels or ())
        if value is not None:
            self.add_metric([], value, created)

    def add_metric(self, labels: Sequence[str], value: float, created: float | None = None,
                   timestamp: float | None = None) -> None:
        named = dict(zip(self._labelnames, labels, strict=False))
        self.samples.append(Sample(self.name + "_total", named, value, timestamp))
        if created is not None:
            self.samples.append(Sample(self.name + "_created", dict(named), created, timestamp))


class Collector(Protocol):
    """Anything that yields families when scraped: one of our collectors, or a registry of them."""

    def collect(self) -> Iterable[Family]: ...


class Registry:
    """The collectors one endpoint serves, collected in the order registered. Registering reads nothing."""

    def __init__(self) -> None:
        self._collectors: list[Collector] = []

    def register(self, collector: Collector) -> None:
        self._collectors.append(collector)

    def collect(self) -> Iterable[Family]:
        for collector in list(self._collectors):
            yield from collector.collect()


def go_float(value: float) -> str:
    """A value as Go's Prometheus libraries print it: ``+Inf``, ``-Inf``, ``NaN``, and an exponent from 1e+06 up
    where Python's repr would still write the digits out."""
    d = float(value)
    if d == _INF:
        return "+Inf"
    if d == -_INF:
        return "-Inf"
    if d != d:
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


_INF = float("inf")


def _quote(value: str) -> str:
    """A label value (or an OpenMetrics help text, or a quoted name) in the formats' backslash escaping."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _is_label_rune(ch: str, i: int) -> bool:
    return "a" <= ch <= "z" or "A" <= ch <= "Z" or ch == "_" or ("0" <= ch <= "9" and i > 0)


def _is_metric_rune(ch: str, i: int) -> bool:
    return _is_label_rune(ch, i) or ch == ":"


def _rewrite(s: str, escaping: str, valid: Callable[[str, int], bool]) -> str:
    """A name in one escaping scheme: allow-utf-8 backslash-escapes, the others rewrite what is not a legacy rune."""
    if escaping == ALLOW_UTF8:
        return _quote(s)
    if escaping == UNDERSCORES:
        return "".join(ch if valid(ch, i) else "_" for i, ch in enumerate(s))
    if escaping == DOTS:
        out = []
        for i, ch in enumerate(s):
            out.append("__" if ch == "_" else "_dot_" if ch == "." else ch if valid(ch, i) else "__")
        return "".join(out)
    if escaping == VALUES:
        out = ["U__"]
        for i, ch in enumerate(s):
            if ch == "_":
                out.append("__")
            elif valid(ch, i):
                out.append(ch)
            elif 0xD800 <= ord(ch) <= 0xDFFF:  # a lone surrogate is no character
                out.append("_FFFD_")
            else:
                out.append(f"_{ord(ch):x}_")
        return "".join(out)
    return s


@functools.lru_cache(maxsize=4096)
def _sample_name(s: str, escaping: str) -> str:
    """An OpenMetrics sample's name: every character is held to the label-name runes (so ``:`` too)."""
    if escaping == UNDERSCORES and _LABEL_RUNES.fullmatch(s):
        return s
    return _rewrite(s, escaping, _is_label_rune)


@functools.lru_cache(maxsize=4096)
def _metric_name(s: str, escaping: str) -> str:
    """A family or series name in HELP, TYPE and UNIT lines and in the text format's sample lines."""
    if not s:
        return s
    legacy = _LEGACY_METRIC_NAME.match(s) is not None
    if escaping == ALLOW_UTF8:
        return _quote(s) if legacy else '"' + _quote(s) + '"'
    if escaping in (UNDERSCORES, VALUES):
        if legacy:
            return s
        return _rewrite(s, escaping, _is_metric_rune)
    if escaping == DOTS:
        if _METRIC_RUNES.fullmatch(s) and "_" not in s:
            return s
        return _rewrite(s, escaping, _is_metric_rune)
    return s


@functools.lru_cache(maxsize=4096)
def _label_name(s: str, escaping: str) -> str:
    if not s:
        return s
    legacy = _LEGACY_LABEL_NAME.match(s) is not None and _RESERVED_LABEL_NAME.match(s) is None
    if escaping == ALLOW_UTF8:
        return _quote(s) if legacy else '"' + _quote(s) + '"'
    if escaping in (UNDERSCORES, VALUES):
        return s if legacy else _rewrite(s, escaping, _is_label_rune)
    if escaping == DOTS:
        return _rewrite(s, escaping, _is_label_rune)
    return s


def _labels(labels: dict[str, str], escaping: str) -> str:
    return ",".join(f'{_label_name(k, escaping)}="{_quote(v)}"' for k, v in sorted(labels.items()))


# The text format has no such types: each is written as the nearest one it has.
_TEXT_TYPES = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}
# OpenMetrics-only series the text format moves into a gauge family of their own, after the family's samples.
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")


def _text_sample(s: Sample, escaping: str) -> str:
    labels = _labels(s.labels, escaping) if s.labels else ""
    stamp = f" {int(float(s.timestamp) * 1000):d}" if s.timestamp is not None else ""
    if escaping != ALLOW_UTF8 or _LEGACY_METRIC_NAME.match(s.name):
        braced = "{" + labels + "}" if labels else ""
        return f"{_metric_name(s.name, escaping)}{braced} {go_float(s.value)}{stamp}\n"
    comma = "," if labels else ""
    return f"{{{_metric_name(s.name, escaping)}{comma}{labels}}} {go_float(s.value)}{stamp}\n"


def encode_text(registry: Collector, escaping: str = UNDERSCORES) -> bytes:
    """The Prometheus text format: counters named with ``_total`` in HELP and TYPE, help texts with backslashes
    and newlines escaped."""
    out: list[str] = []
    for fam in registry.collect():
        name, typ = fam.name, fam.type
        if typ == "counter":
            name += "_total"
        elif typ == "info":
            name += "_info"
        typ = _TEXT_TYPES.get(typ, typ)
        doc = fam.documentation.replace("\\", r"\\").replace("\n", r"\n")
        shown = _metric_name(name, escaping)
        out.append(f"# HELP {shown} {doc}\n")
        out.append(f"# TYPE {shown} {typ}\n")
        moved: dict[str, list[str]] = {}
        for s in fam.samples:
            for suffix in _OM_SUFFIXES:
                if s.name == fam.name + suffix:
                    moved.setdefault(suffix, []).append(_text_sample(s, escaping))
                    break
            else:
                out.append(_text_sample(s, escaping))
        for suffix, lines in sorted(moved.items()):
            shown = _metric_name(fam.name + suffix, escaping)
            out.append(f"# HELP {shown} {doc}\n")
            out.append(f"# TYPE {shown} gauge\n")
            out.extend(lines)
    return "".join(out).encode("utf-8")


def encode_openmetrics(registry: Collector, escaping: str = UNDERSCORES) -> bytes:
    """OpenMetrics 1.0.0: families under their own names (a counter without ``_total``), help texts quoted like
    label values, a UNIT line where a family has one, and ``# EOF`` last."""
    out: list[str] = []
    for fam in registry.collect():
        shown = _metric_name(fam.name, escaping)
        out.append(f"# HELP {shown} {_quote(fam.documentation)}\n")
        out.append(f"# TYPE {shown} {fam.type}\n")
        if fam.unit:
            out.append(f"# UNIT {shown} {fam.unit}\n")
        for s in fam.samples:
            quoted_name = escaping == ALLOW_UTF8 and not _LEGACY_METRIC_NAME.match(s.name)
            labels = _metric_name(s.name, escaping) + ("," if s.labels else "") if quoted_name else ""
            if s.labels:
                labels += _labels(s.labels, escaping)
            braced = "{" + labels + "}" if labels else ""
            value = go_float(s.value) if s.value is not None else ""
            stamp = f" {s.timestamp}" if s.timestamp is not None else ""
            if quoted_name:
                out.append(f"{braced} {value}{stamp}\n")
            else:
                out.append(f"{_sample_name(s.name, escaping)}{braced} {value}{stamp}\n")
    out.append("# EOF\n")
    return "".join(out).encode("utf-8")


Encoder = Callable[[Collector], bytes]


def _parameter(tokens: Sequence[str], key: str) -> str | None:
    for tok in tokens:
        if "=" in tok:
            k, value = tok.strip().split("=", 1)
            if k == key:
                return value
    return None


def _version_at_least_1(version: str) -> bool:
    """Whether a media type's version parameter is 1.0.0 or later, compared as prometheus_client compares it.
    One it cannot compare (``version=x``) counts as older: prometheus_client fails the request there instead."""
    parts: list[int | str] = []
    for part in version.split("."):
        try:
            parts.append(int(part))
        except ValueError:
            parts.append(part)
    try:
        return tuple(parts) >= (1, 0, 0)
    except TypeError:
        return False


def choose_encoder(accept: str) -> tuple[Encoder, str]:
    """The encoder and the Content-Type for a scrape's Accept header: the first OpenMetrics or text/plain 1.0+
    entry wins, in the order the header lists them (q-values are not weighed); anything else gets text 0.0.4."""
    for accepted in (accept or "").split(","):
        tokens = accepted.split(";")
        media = tokens[0].strip()
        if media not in ("application/openmetrics-text", "text/plain"):
            continue
        version = _parameter(tokens, "version") or ""
        escaping = _parameter(tokens, "escaping")
        escaping = escaping if escaping in _SCHEMES else UNDERSCORES
        if media == "application/openmetrics-text":
            if not version:
                return encode_openmetrics, CONTENT_TYPE_OPENMETRICS
            if _version_at_least_1(version):
                return (functools.partial(encode_openmetrics, escaping=escaping),
                        f"application/openmetrics-text; version={version}; charset=utf-8; escaping={escaping}")
        elif version and _version_at_least_1(version):
            return functools.partial(encode_text, escaping=escaping), f"{CONTENT_TYPE_TEXT_1_0_0}; escaping={escaping}"
    return encode_text, CONTENT_TYPE_TEXT_0_0_4
