"""The controller's configuration: the ``ControllerConfig`` fields, each written once with its flag, file key, parser,
default and help, and the loading that merges flags > environment > file > defaults into one validated value.

Every option has a flag (``--recovery-hold``), an environment variable (``GPU_HEALTH_CONTROLLER_RECOVERY_HOLD``)
and, except ``--reset-breaker``, a key in the versioned file (``release.recoveryHold``); ``docs/fleet-config.md``
and ``--help`` are generated from the same table. A bad value is a ``FieldError`` naming the value where the user
wrote it (flag, variable or file key); ``parse_or_exit`` turns it into one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from plugin.configfile import read_document
from plugin.validation import (
    Choice,
    FieldError,
    check_prefix,
    first_key,
    is_dns_label,
    is_dns_subdomain,
    is_label_value,
    is_qualified_name,
    parse_bool,
    split_host_port,
)

__all__ = ["CONFIG_VERSION", "ENV_PREFIX", "EXIT_CONFIG", "OPTIONS", "PROG", "ControllerConfig", "FieldError",
           "Option", "Requirement", "build_parser", "format_duration", "load", "option", "options_table",
           "parse_duration", "parse_or_exit", "parse_selector", "read_file", "selector_matches"]

PROG = "gpu-health-controller"
ENV_PREFIX = "GPU_HEALTH_CONTROLLER_"
CONFIG_VERSION = "v1"
EXIT_CONFIG = 2


# Durations -----------------------------------------------------------------------------------------------------------

_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|h|m|s)")
_DURATION = re.compile(rf"-?(?:{_DURATION_PART.pattern})+")
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
            seconds = sum(float(n) * _UNIT_S[u] for n, u in _DURATION_PART.findall(s))
            seconds = -seconds if s.startswith("-") else seconds
    else:
        seconds = float(v)
    if not math.isfinite(seconds):
        raise ValueError(f"expected {_DURATION_HINT}, got {v!r}")
    return seconds


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def format_duration(seconds: float) -> str:
    """The way this config writes a duration back (``1h``, ``10m``, ``1m30s``, ``0s``, ``1.5s``)."""
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
        out += f"{_num(rest)}s"
    return sign + out


# Value parsers: each takes what a flag, a variable or the file gave and returns the field's value, or raises
# ValueError with the text the user sees after the option's name.

class _Duration:
    def __init__(self, *, positive: bool) -> None:
        self.positive = positive

    def __call__(self, v: Any) -> float:
        s = parse_duration(v)
        if self.positive and not s > 0:
            raise ValueError(f"must be a duration above 0, got {v!r}")
        if s < 0:
            raise ValueError(f"must be a duration of 0 or more, got {v!r}")
        return s


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"expected a number, got {v!r}")
    try:
        f = float(v)
    except ValueError:
        raise ValueError(f"expected a number, got {v!r}") from None
    if not math.isfinite(f):
        raise ValueError(f"expected a finite number, got {v!r}")
    return f


def _positive(v: Any) -> float:
    f = _number(v)
    if not f > 0:
        raise ValueError(f"must be above 0, got {v!r}")
    return f


def _fraction(v: Any) -> float:
    f = _number(v)
    if not 0 <= f <= 1:
        raise ValueError(f"must be in [0, 1], got {v!r}")
    return f


def _open_fraction(v: Any) -> float:
    f = _number(v)
    if not 0 < f <= 1:
        raise ValueError(f"must be in (0, 1], got {v!r}")
    return f


def _count(v: Any) -> int:
    """A whole number >= 0 (a count of GPUs; 0 turns the rule off)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"expected a whole number (0 or more), got {v!r}")
    try:
        n = int(v)
    except (ValueError, OverflowError):
        raise ValueError(f"expected a whole number (0 or more), got {v!r}") from None
    if n < 0:
        raise ValueError(f"must be 0 or more, got {v!r}")
    return n




def _string(check: Callable[[str], str]) -> Callable[[Any], str]:
    """A string option: a YAML number or list where a name belongs is a type error, not a name."""
    def parse(v: Any) -> str:
        if not isinstance(v, str):
            raise ValueError(f"expected a string, got {v!r}")
        return check(v.strip())
    return parse


def _opt_path(v: Any) -> Path | None:
    if v is None or v == "":
        return None
    if not isinstance(v, (str, Path)):
        raise ValueError(f"expected a path, got {v!r}")
    # Absolute now, so the start-up log shows the file every later read uses.
    return Path(os.path.abspath(v))


def _namespace(s: str) -> str:
    if not is_dns_label(s):
        raise ValueError(f"expected a namespace name (a lower-case DNS label, at most 63 chars), got {s!r}")
    return s


def _object_name(s: str) -> str:
    if not is_dns_subdomain(s):
        raise ValueError(f"expected an object name (a lower-case DNS subdomain), got {s!r}")
    return s


def _identity(s: str) -> str:
    # The Lease's holderIdentity: any text the API server keeps; whitespace would make logs and kubectl output
    # ambiguous, and empty would make every replica look like no holder.
    if not s:
        raise ValueError("must not be empty (leave it unset to use POD_NAME, else the host name)")
    if not s.isprintable() or any(c.isspace() for c in s):
        raise ValueError(f"expected a name without spaces, got {s!r}")
    return s


def _listen_address(s: str) -> str:
    if s.lower() == "off":
        return "off"
    split_host_port(s)
    return s


def _metrics_address(v: Any) -> str:
    # YAML 1.1 reads a bare `off` as false; that is what the user wrote.
    return "off" if v is False else _string(_listen_address)(v)


def _annotation_prefix(s: str) -> str:
    check_prefix(s)
    # The controller keeps its own record under controller.<prefix>/, where the node agent cannot write: that too
    # must be a DNS subdomain.
    own = f"controller.{s}"
    if not is_dns_subdomain(own):
        raise ValueError(f"too long: the controller's own prefix {own!r} must be at most 253 chars, got {s!r}")
    return s


def _label(s: str) -> str:
    if not s:
        return ""
    key, sep, value = s.partition("=")
    if not sep:
        raise ValueError(f"expected key=value (or empty for no label), got {s!r}")
    if not is_qualified_name(key):
        raise ValueError(f"expected a label key like gpu-health.io/quarantined before '=', got {key!r}")
    if not is_label_value(value):
        raise ValueError(f"expected a label value (at most 63 of A-Z a-z 0-9 - _ .) after '=', got {value!r}")
    return s


# Label selectors ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Requirement:
    """One term of a label selector: ``op`` is one of exists, !, =, !=, in, notin."""

    key: str
    op: str
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        have = labels.get(self.key)
        if self.op == "exists":
            return have is not None
        if self.op == "!":
            return have is None
        if self.op in ("=", "in"):
            return have is not None and have in self.values
        return have is None or have not in self.values  # != and notin, as Kubernetes: a missing label matches


_SELECTOR_TOKEN = re.compile(r"\s*(?:(!=|==|=|!|\(|\)|,)|([^\s!=(),]+))")


def _tokens(text: str) -> list[str]:
    out: list[str] = []
    pos = 0
    while pos < len(text):
        m = _SELECTOR_TOKEN.match(text, pos)
        if m is None:  # only trailing whitespace is left
            break
        out.append(m.group(1) or m.group(2))
        pos = m.end()
    return out


def parse_selector(text: str) -> tuple[Requirement, ...]:
    """The requirements of a label selector in Kubernetes' syntax (``key``, ``!key``, ``key=value``,
    ``key==value``, ``key!=value``, ``key in (a,b)``, ``key notin (a,b)``, joined by commas); empty selects all.
    Raises ValueError saying what is wrong where."""
    toks = _tokens(text)
    reqs: list[Requirement] = []
    i = 0

    def fail(why: str) -> ValueError:
        return ValueError(f"not a label selector ({why}), got {text!r}")

    def key_at(j: int) -> str:
        if j >= len(toks) or toks[j] in ("!=", "==", "=", "!", "(", ")", ","):
            raise fail("expected a label key" + (f" before {toks[j]!r}" if j < len(toks) else " at the end"))
        if not is_qualified_name(toks[j]):
            raise fail(f"{toks[j]!r} is not a label key")
        return toks[j]

    def value(tok: str) -> str:
        if not is_label_value(tok):
            raise fail(f"{tok!r} is not a label value")
        return tok

    while i < len(toks):
        if toks[i] == "!":
            reqs.append(Requirement(key_at(i + 1), "!"))
            i += 2
        else:
            key = key_at(i)
            i += 1
            op = toks[i] if i < len(toks) else ","
            if op == ",":
                reqs.append(Requirement(key, "exists"))
            elif op in ("=", "==", "!="):
                i += 1
                v = toks[i] if i < len(toks) and toks[i] != "," else ""
                i += 1 if v else 0
                reqs.append(Requirement(key, "!=" if op == "!=" else "=", (value(v),)))
            elif op in ("in", "notin"):
                i += 1
                if i >= len(toks) or toks[i] != "(":
                    raise fail(f"expected '(' after {op}")
                i += 1
                vals: list[str] = []
                # A value may be empty, as in Kubernetes: "in (a,)" is a and "".
                expect_value = True
                while i < len(toks) and toks[i] != ")":
                    if toks[i] == ",":
                        if expect_value:
                            vals.append("")
                        expect_value = True
                    elif expect_value:
                        vals.append(value(toks[i]))
                        expect_value = False
                    else:
                        raise fail(f"expected ',' or ')' before {toks[i]!r}")
                    i += 1
                if i >= len(toks):
                    raise fail(f"missing ')' after {op} (")
                if vals and expect_value:
                    vals.append("")
                if not vals:
                    raise fail(f"'{op}' needs at least one value")
                i += 1
                reqs.append(Requirement(key, op, tuple(vals)))
            else:
                raise fail(f"expected an operator (=, ==, !=, in, notin) or ',' after {key!r}, got {op!r}")
        if i < len(toks):
            if toks[i] != ",":
                raise fail(f"expected ',' before {toks[i]!r}")
            i += 1
            if i >= len(toks):
                raise fail("a ',' with nothing after it")
    return tuple(reqs)


def selector_matches(requirements: Sequence[Requirement], labels: Mapping[str, str]) -> bool:
    """Whether a node's labels satisfy every requirement (an empty selector matches every node)."""
    return all(r.matches(labels) for r in requirements)


def _selector(s: str) -> str:
    parse_selector(s)
    return s


# The table ------------------------------------------------------------------------------------------------------

_SPEC = "controller-option"


@dataclass(frozen=True)
class _Spec:
    flag: str
    key: str  # dotted key in the file; "" for an option that is flag and environment only
    parse: Callable[[Any], Any]
    help: str
    metavar: str
    fallback_env: str  # read below the file, before the default (the Downward API's POD_NAMESPACE, POD_NAME)
    shown_default: str | None


def _opt(flag: str, key: str, parse: Callable[[Any], Any], help: str, metavar: str = "", *,
         fallback_env: str = "", shown_default: str | None = None) -> dict[str, _Spec]:
    return {_SPEC: _Spec(flag, key, parse, help, metavar, fallback_env, shown_default)}


_NEVER = 0.0  # a readable name for the "off" defaults below


@dataclass(frozen=True)
class ControllerConfig:
    kubeconfig: Path | None = field(default=None, metadata=_opt(
        "--kubeconfig", "kubeconfig", _opt_path, "kubeconfig file for running outside the cluster; unset: the "
        "Pod's service account", "FILE", shown_default="in-cluster"))
    namespace: str = field(default="gpu-health-system", metadata=_opt(
        "--namespace", "namespace", _string(_namespace), "namespace of the leader-election Lease", "NAME",
        fallback_env="POD_NAMESPACE", shown_default="$POD_NAMESPACE, else gpu-health-system"))
    identity: str = field(default="", metadata=_opt(
        "--identity", "identity", _string(_identity), "this replica's name as the Lease's holder", "NAME",
        fallback_env="POD_NAME", shown_default="$POD_NAME, else the host name"))
    lease_name: str = field(default="gpu-health-controller", metadata=_opt(
        "--lease-name", "leaseName", _string(_object_name), "name of the leader-election Lease (it also keeps the "
        "breaker's state)", "NAME"))
    annotation_prefix: str = field(default="gpu-health.io", metadata=_opt(
        "--annotation-prefix", "annotationPrefix", _string(_annotation_prefix), "DNS subdomain of the node agent's "
        "annotations and of the controller's taint; the controller's own record of a quarantine is under "
        "controller.<prefix>/", "DOMAIN"))
    node_selector: str = field(default="", metadata=_opt(
        "--node-selector", "nodeSelector", _string(_selector), "label selector of the nodes to manage (key=value, "
        "key!=value, key, !key, key in (a,b), key notin (a,b), comma-separated); empty: every node with a "
        "nvidia.com/gpu* capacity or our state annotation", "SELECTOR", shown_default="every GPU node"))
    metrics_address: str = field(default="0.0.0.0:9403", metadata=_opt(
        "--metrics-address", "metricsAddress", _metrics_address, "HOST:PORT serving /metrics, /healthz "
        "and /readyz; off disables", "HOST:PORT"))
    log_format: str = field(default="text", metadata=_opt(
        "--log-format", "logFormat", Choice("text", "json"), "log line format"))
    log_level: str = field(default="info", metadata=_opt(
        "--log-level", "logLevel", Choice("debug", "info", "warning", "error"), "log verbosity"))
    dry_run: bool = field(default=False, metadata=_opt(
        "--dry-run", "dryRun", parse_bool, "decide, log and post Events saying what would be done; change no node"))
    reset_breaker: bool = field(default=False, metadata=_opt(
        "--reset-breaker", "", parse_bool, "close the circuit breaker once, when this process first leads (like "
        "the Lease's breaker-reset annotation); not again on a later leadership"))
    resync_interval_s: float = field(default=3600.0, metadata=_opt(
        "--resync-interval", "resyncInterval", _Duration(positive=True), "time between full re-lists of the "
        "nodes; between them only the watch is read", "DURATION"))
    unhealthy_devices: int = field(default=1, metadata=_opt(
        "--unhealthy-devices", "policy.unhealthyDevices", _count, "quarantine a node when this many of its GPUs "
        "are Unhealthy; 0 turns the count rule off", "N"))
    unhealthy_fraction: float = field(default=0.0, metadata=_opt(
        "--unhealthy-fraction", "policy.unhealthyFraction", _fraction, "quarantine a node when this share of its "
        "GPUs (0 to 1) is Unhealthy; 0 turns the share rule off", "FRACTION"))
    reboot_required: bool = field(default=True, metadata=_opt(
        "--reboot-required", "policy.rebootRequired", parse_bool, "quarantine a node when any device's action is "
        "reboot-node"))
    capacity_gap: int = field(default=1, metadata=_opt(
        "--capacity-gap", "policy.capacityGap", _count, "for nodes without our annotations: quarantine when "
        "capacity minus allocatable of nvidia.com/gpu* reaches this; 0 turns the rule off", "N"))
    no_execute_after_s: float = field(default=_NEVER, metadata=_opt(
        "--no-execute-after", "quarantine.noExecuteAfter", _Duration(positive=False), "add the NoExecute taint "
        "(evicting pods that do not tolerate it) this long after the NoSchedule one; 0 never adds it",
        "DURATION"))
    cordon: bool = field(default=False, metadata=_opt(
        "--cordon", "quarantine.cordon", parse_bool, "also cordon a quarantined node"))
    quarantine_label: str = field(default="", metadata=_opt(
        "--quarantine-label", "quarantine.label", _string(_label), "key=value label put on a quarantined node for "
        "external automation; empty: none", "KEY=VALUE", shown_default="none"))
    drain: bool = field(default=False, metadata=_opt(
        "--drain", "drain.enabled", parse_bool, "evict the pods of a quarantined node through the Eviction API "
        "(PodDisruptionBudgets apply)"))
    drain_per_minute: float = field(default=10.0, metadata=_opt(
        "--drain-rate", "drain.evictionsPerMinute", _positive, "most evictions per minute, over all nodes",
        "PER_MINUTE"))
    recovery_hold_s: float = field(default=600.0, metadata=_opt(
        "--recovery-hold", "release.recoveryHold", _Duration(positive=False), "how long a quarantined node must "
        "be healthy before the controller releases it", "DURATION"))
    max_quarantined_fraction: float = field(default=0.1, metadata=_opt(
        "--max-quarantined-fraction", "breaker.maxQuarantinedFraction", _open_fraction, "most of the GPU nodes "
        "(above 0, at most 1) the controller keeps quarantined; at least one node when there is one; a quarantine "
        "beyond it opens the circuit breaker", "FRACTION"))
    max_quarantined_nodes: int = field(default=0, metadata=_opt(
        "--max-quarantined-nodes", "breaker.maxQuarantinedNodes", _count, "most GPU nodes the controller keeps "
        "quarantined, whatever the fleet's size; the smaller of this and the fraction's limit wins; 0: no "
        "absolute cap", "N"))
    lease_duration_s: float = field(default=15.0, metadata=_opt(
        "--lease-duration", "leaderElection.leaseDuration", _Duration(positive=True), "how long standbys wait "
        "after the last renewal before taking the Lease over", "DURATION"))
    renew_deadline_s: float = field(default=10.0, metadata=_opt(
        "--renew-deadline", "leaderElection.renewDeadline", _Duration(positive=True), "how long the leader keeps "
        "trying to renew before it stops acting; less than the lease duration", "DURATION"))
    retry_period_s: float = field(default=2.0, metadata=_opt(
        "--retry-period", "leaderElection.retryPeriod", _Duration(positive=True), "time between tries to "
        "acquire or renew the Lease; less than the renew deadline", "DURATION"))
    config_file: Path | None = field(default=None, metadata=_opt(
        "--config", "", _opt_path, "versioned YAML config file (version: v1)", "FILE", shown_default="none"))

    @property
    def quarantine_label_pair(self) -> tuple[str, str] | None:
        """The quarantine label as (key, value), None when there is none."""
        if not self.quarantine_label:
            return None
        key, _, value = self.quarantine_label.partition("=")
        return key, value

    @cached_property
    def selector(self) -> tuple[Requirement, ...]:
        """The node selector parsed (once: the reconciler asks for every node it sees)."""
        return parse_selector(self.node_selector)

    def effective(self) -> dict[str, Any]:
        """What is in force, for the start-up log (JSON-safe)."""
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), Path) else v) for f in fields(self)}


@dataclass(frozen=True)
class Option:
    """One option as the table shows it; ``name`` is the ControllerConfig field."""

    name: str
    flag: str
    key: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    metavar: str
    fallback_env: str
    shown_default: str | None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag[2:].replace("-", "_").upper()

    @property
    def is_bool(self) -> bool:
        return self.parse is parse_bool

    @property
    def is_duration(self) -> bool:
        return isinstance(self.parse, _Duration)

    @property
    def choices(self) -> tuple[str, ...]:
        return self.parse.options if isinstance(self.parse, Choice) else ()

    @property
    def default_text(self) -> str:
        """The default as a user would write it (``10m``, ``true``, ``0.1``)."""
        if self.shown_default is not None:
            return self.shown_default
        d = self.default
        if isinstance(d, bool):
            return "true" if d else "false"
        if self.is_duration:
            return format_duration(d)
        if isinstance(d, float):
            return _num(d)
        return "none" if d in (None, "") else str(d)


OPTIONS: tuple[Option, ...] = tuple(
    Option(f.name, s.flag, s.key, s.parse, f.default, s.help, s.metavar, s.fallback_env, s.shown_default)
    for f in fields(ControllerConfig) if (s := f.metadata.get(_SPEC)) is not None)
_BY_NAME = {o.name: o for o in OPTIONS}
CONFIG_OPTION = _BY_NAME["config_file"]
FILE_KEYS: dict[str, Option] = {o.key: o for o in OPTIONS if o.key}
SECTIONS: tuple[str, ...] = tuple(dict.fromkeys(k.split(".")[0] for k in FILE_KEYS if "." in k))
TOP_LEVEL_KEYS: tuple[str, ...] = ("version", *(k for k in FILE_KEYS if "." not in k), *SECTIONS)


def option(name: str) -> Option:
    """The option behind a ControllerConfig field."""
    return _BY_NAME[name]


def options_table() -> list[tuple[str, str, str, str, str]]:
    """(flag, environment variable, file key, default, help) of every option, in the file's order; the file key is
    empty for the flag-and-environment-only ones."""
    return [(o.flag, o.env, o.key, o.default_text, o.help) for o in OPTIONS]


# The file --------------------------------------------------------------------------------------------------------

def _misplaced_hint(key: str, where: str) -> str:
    """Where a key that is unknown here does belong, when it belongs somewhere (a leaf put at the wrong level)."""
    for path in FILE_KEYS:
        if path.rsplit(".", 1)[-1] == key and path != f"{where}{key}":
            return f"; {key} belongs at {path}"
    return ""


def read_file(path: Path, label: str = "--config") -> dict[str, Any]:
    """The file's values by dotted key (``release.recoveryHold``), its shape checked; ``label`` is how the file was
    named (--config or GPU_HEALTH_CONTROLLER_CONFIG)."""
    doc = read_document(path, label)
    if not isinstance(doc, dict):
        raise FieldError(label, f"{path}: expected a mapping with version: {CONFIG_VERSION}, got "
                                f"{'an empty file' if doc is None else repr(doc)}")
    if "version" not in doc:
        raise FieldError("version", f"missing: the file must start with version: {CONFIG_VERSION}")
    if doc["version"] != CONFIG_VERSION:
        raise FieldError("version", f"expected {CONFIG_VERSION!r}, got {doc['version']!r}")
    unknown = [k for k in doc if k not in TOP_LEVEL_KEYS]
    if unknown:
        bad = first_key(unknown)
        raise FieldError(bad, f"unknown key (known: {', '.join(TOP_LEVEL_KEYS)}){_misplaced_hint(bad, '')}")
    out: dict[str, Any] = {}
    for k, v in doc.items():
        if k == "version":
            continue
        if k not in SECTIONS:
            out[k] = v
            continue
        if v is None:  # "drain:" with nothing under it
            continue
        known = [p.split(".", 1)[1] for p in FILE_KEYS if p.startswith(k + ".")]
        if not isinstance(v, dict):
            raise FieldError(k, f"expected a mapping (keys: {', '.join(known)}), got {v!r}")
        unknown = [sub for sub in v if sub not in known]
        if unknown:
            bad = first_key(unknown)
            raise FieldError(f"{k}.{bad}", f"unknown key (known: {', '.join(known)}){_misplaced_hint(bad, k + '.')}")
        out.update({f"{k}.{sub}": x for sub, x in v.items()})
    return out


# Loading ---------------------------------------------------------------------------------------------------------

class _ArgumentError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    # argparse would print the usage and exit; the controller's rule is one line naming the flag.
    def error(self, message: str) -> Any:
        raise _ArgumentError(message)


def build_parser() -> argparse.ArgumentParser:
    """The flags; their values stay strings here so that load() checks them like the other sources."""
    p = _Parser(prog=PROG, allow_abbrev=False,
                description="Quarantines failing GPU nodes (taint, optional cordon and drain) from the node agent's "
                            "annotations, behind a circuit breaker. Every option also has an environment variable "
                            "and a key in the config file; flags > environment > file > defaults.")
    for o in OPTIONS:
        where = f"env {o.env}" + (f"; file {o.key}" if o.key else "")
        help_text = f"{o.help} ({where}; default: {o.default_text})".replace("%", "%%")
        if o.is_bool:
            p.add_argument(o.flag, dest=o.name, nargs="?", const="true", default=None, metavar="BOOL",
                           help=help_text)
        else:
            metavar = "{" + ",".join(o.choices) + "}" if o.choices else o.metavar or o.name.upper()
            p.add_argument(o.flag, dest=o.name, default=None, metavar=metavar, help=help_text)
    return p


_ARG_MESSAGE = re.compile(r"argument (\S+): (.*)")


def _parse_flags(argv: Sequence[str]) -> dict[str, str | None]:
    parser = build_parser()
    try:
        ns, extra = parser.parse_known_args(list(argv))
    except _ArgumentError as exc:
        m = _ARG_MESSAGE.match(str(exc))
        if m and m.group(2) == "expected one argument":
            # Also what argparse says of "--recovery-hold -5m": it takes a value with a leading '-' for a flag.
            raise FieldError(m.group(1), f"expected a value (one that starts with '-' is written "
                                         f"{m.group(1)}=VALUE)") from None
        if m:
            raise FieldError(m.group(1), m.group(2)) from None
        raise FieldError(PROG, str(exc)) from None
    if extra:
        bad = extra[0]
        if bad.startswith("-"):
            raise FieldError(bad.split("=", 1)[0], f"unknown flag (see {PROG} --help)")
        raise FieldError(bad, "unexpected argument: the controller takes flags only")
    return {o.name: getattr(ns, o.name) for o in OPTIONS}


def _check_less(values: dict[str, Any], labels: dict[str, str], small: str, big: str) -> None:
    """A cross-field rule (retry < renew deadline < lease duration), named by the side the user set."""
    if values[small] < values[big]:
        return

    def named(name: str) -> str:
        value = format_duration(values[name])
        if name in labels:
            return f"{labels[name]} ({value})"
        return f"the {name.removesuffix('_s').replace('_', ' ')} ({value}, the default)"

    if small in labels:
        raise FieldError(labels[small], f"must be less than {named(big)}, got {format_duration(values[small])}")
    raise FieldError(labels.get(big, option(big).flag),
                     f"must be more than {named(small)}, got {format_duration(values[big])}")


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ControllerConfig:
    """Parse the flags, read the file they or the environment name, merge flags > environment > file > defaults and
    check every value; a bad one raises FieldError naming it where it was written. ``--help`` prints the options
    and raises SystemExit(0), as argparse does."""
    env = os.environ if environ is None else environ
    flags = _parse_flags(sys.argv[1:] if argv is None else argv)
    raw_file, file_label = flags["config_file"], CONFIG_OPTION.flag
    if raw_file is None and env.get(CONFIG_OPTION.env):
        raw_file, file_label = env[CONFIG_OPTION.env], CONFIG_OPTION.env
    try:
        config_file = _opt_path(raw_file)
    except ValueError as exc:
        raise FieldError(file_label, str(exc)) from None
    doc = read_file(config_file, file_label) if config_file is not None else {}
    values: dict[str, Any] = {}
    labels: dict[str, str] = {}  # field -> where the user set it (--recovery-hold, the variable, the file key)
    for o in OPTIONS:
        if o is CONFIG_OPTION:
            continue
        if flags[o.name] is not None:
            raw, label = flags[o.name], o.flag
        elif o.env in env:
            raw, label = env[o.env], o.env
        elif o.key and o.key in doc:
            raw, label = doc[o.key], o.key
        elif o.fallback_env and env.get(o.fallback_env):
            raw, label = env[o.fallback_env], o.fallback_env
        else:
            values[o.name] = o.default
            continue
        try:
            values[o.name] = o.parse(raw)
        except (ValueError, TypeError) as exc:
            raise FieldError(label, str(exc)) from None
        labels[o.name] = label
    if not values["identity"]:
        values["identity"] = socket.gethostname() or PROG
    _check_less(values, labels, "renew_deadline_s", "lease_duration_s")
    _check_less(values, labels, "retry_period_s", "renew_deadline_s")
    return ControllerConfig(**values, config_file=config_file)


def parse_or_exit(argv: Sequence[str] | None = None) -> ControllerConfig:
    """load() from the process's flags and environment; a bad value is one line on stderr and exit status 2."""
    try:
        return load(argv, os.environ)
    except FieldError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
