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
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from plugin.options.durations import Duration, format_duration
from plugin.options.flags import OneLineParser, add_arguments, parse_flags
from plugin.options.selectors import Requirement, parse_selector
from plugin.options.sources import config_path, read_file, resolve
from plugin.options.table import Option, listen_address, optional_path, sections, spec, table
from plugin.validation import (
    Choice,
    FieldError,
    check_prefix,
    is_dns_label,
    is_dns_subdomain,
    is_label_value,
    is_qualified_name,
    parse_bool,
)
from plugin.version import VersionAction

__all__ = ["CONFIG_VERSION", "ENV_PREFIX", "EXIT_CONFIG", "OPTIONS", "PROG", "ControllerConfig", "FieldError",
           "build_parser", "load", "option", "options_table", "parse_or_exit"]

PROG = "gpu-health-controller"
ENV_PREFIX = "GPU_HEALTH_CONTROLLER_"
CONFIG_VERSION = "v1"
EXIT_CONFIG = 2


# Value parsers: each takes what a flag, a variable or the file gave and returns the field's value, or raises
# ValueError with the text the user sees after the option's name.

def number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"expected a number, got {v!r}")
    try:
        f = float(v)
    except ValueError:
        raise ValueError(f"expected a number, got {v!r}") from None
    if not math.isfinite(f):
        raise ValueError(f"expected a finite number, got {v!r}")
    return f


def positive(v: Any) -> float:
    f = number(v)
    if not f > 0:
        raise ValueError(f"must be above 0, got {v!r}")
    return f


def fraction(v: Any) -> float:
    f = number(v)
    if not 0 <= f <= 1:
        raise ValueError(f"must be in [0, 1], got {v!r}")
    return f


def open_fraction(v: Any) -> float:
    f = number(v)
    if not 0 < f <= 1:
        raise ValueError(f"must be in (0, 1], got {v!r}")
    return f


def count(v: Any) -> int:
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


def concurrency(v: Any) -> int:
    """A number of writers: a whole number from 1 to 32."""
    try:
        n = count(v)
    except ValueError:
        raise ValueError(f"expected a whole number from 1 to 32, got {v!r}") from None
    if not 1 <= n <= 32:
        raise ValueError(f"must be from 1 to 32, got {v!r}")
    return n


def _string(check: Callable[[str], str]) -> Callable[[Any], str]:
    """A string option: a YAML number or list where a name belongs is a type error, not a name."""
    def parse(v: Any) -> str:
        if not isinstance(v, str):
            raise ValueError(f"expected a string, got {v!r}")
        return check(v.strip())
    return parse


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


def _metrics_address(v: Any) -> str:
    # YAML 1.1 reads a bare `off` as false; that is what the user wrote.
    return "off" if v is False else _string(listen_address)(v)


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


def _selector(s: str) -> str:
    parse_selector(s)
    return s


# The table ------------------------------------------------------------------------------------------------------

_NEVER = 0.0  # a readable name for the "off" defaults below


@dataclass(frozen=True)
class ControllerConfig:
    kubeconfig: Path | None = field(default=None, metadata=spec(
        optional_path, "kubeconfig file for running outside the cluster; unset: the Pod's service account", "FILE",
        shown_default="in-cluster"))
    namespace: str = field(default="gpu-health-system", metadata=spec(
        _string(_namespace), "namespace of the leader-election Lease", "NAME", fallback_env="POD_NAMESPACE",
        shown_default="$POD_NAMESPACE, else gpu-health-system"))
    identity: str = field(default="", metadata=spec(
        _string(_identity), "this replica's name as the Lease's holder", "NAME", fallback_env="POD_NAME",
        shown_default="$POD_NAME, else the host name"))
    lease_name: str = field(default="gpu-health-controller", metadata=spec(
        _string(_object_name), "name of the leader-election Lease (it also keeps the breaker's state)", "NAME"))
    annotation_prefix: str = field(default="gpu-health.io", metadata=spec(
        _string(_annotation_prefix), "DNS subdomain of the node agent's annotations and of the controller's taint; "
        "the controller's own record of a quarantine is under controller.<prefix>/", "DOMAIN"))
    node_selector: str = field(default="", metadata=spec(
        _string(_selector), "label selector of the nodes to manage (key=value, key!=value, key, !key, key in (a,b), "
        "key notin (a,b), comma-separated); empty: every node with a nvidia.com/gpu* capacity or our state "
        "annotation", "SELECTOR", shown_default="every GPU node"))
    metrics_address: str = field(default="0.0.0.0:9403", metadata=spec(
        _metrics_address, "HOST:PORT serving /metrics, /healthz and /readyz; off disables", "HOST:PORT"))
    log_format: str = field(default="text", metadata=spec(Choice("text", "json"), "log line format"))
    log_level: str = field(default="info", metadata=spec(
        Choice("debug", "info", "warning", "error"), "log verbosity"))
    dry_run: bool = field(default=False, metadata=spec(
        parse_bool, "decide, log and post Events saying what would be done; change no node"))
    reset_breaker: bool = field(default=False, metadata=spec(
        parse_bool, "close the circuit breaker once, when this process first leads (like the Lease's breaker-reset "
        "annotation); not again on a later leadership", key=""))
    resync_interval_s: float = field(default=3600.0, metadata=spec(
        Duration(positive=True), "time between full re-lists of the nodes; between them only the watch is read",
        "DURATION", flag="--resync-interval"))
    unhealthy_devices: int = field(default=1, metadata=spec(
        count, "quarantine a node when this many of its GPUs are Unhealthy; 0 turns the count rule off", "N",
        key="policy.unhealthyDevices"))
    unhealthy_fraction: float = field(default=0.0, metadata=spec(
        fraction, "quarantine a node when this share of its GPUs (0 to 1) is Unhealthy; 0 turns the share rule "
        "off", "FRACTION", key="policy.unhealthyFraction"))
    reboot_required: bool = field(default=True, metadata=spec(
        parse_bool, "quarantine a node when any device's action is reboot-node", key="policy.rebootRequired"))
    gpu_missing: bool = field(default=True, metadata=spec(
        parse_bool, "quarantine a node whose agent finds a GPU missing from NVML (on the PCI bus but not listed, or "
        "fewer than expected: the node reason gpu-missing, action reboot-node) once it has said so for the "
        "gpu-missing grace", key="policy.gpuMissing"))
    gpu_missing_grace_s: float = field(default=600.0, metadata=spec(
        Duration(positive=False), "how long a node must report gpu-missing, on this controller's clock, before the "
        "gpu-missing rule quarantines it (a GPU reset or driver reload takes a GPU out of NVML for a while)",
        "DURATION", flag="--gpu-missing-grace", key="policy.gpuMissingGrace"))
    capacity_gap: int = field(default=1, metadata=spec(
        count, "for nodes without our annotations: quarantine when capacity minus allocatable of nvidia.com/gpu* "
        "reaches this; 0 turns the rule off", "N", key="policy.capacityGap"))
    no_execute_after_s: float = field(default=_NEVER, metadata=spec(
        Duration(positive=False), "add the NoExecute taint (evicting pods that do not tolerate it) this long after "
        "the NoSchedule one; 0 never adds it", "DURATION", flag="--no-execute-after",
        key="quarantine.noExecuteAfter"))
    cordon: bool = field(default=False, metadata=spec(
        parse_bool, "also cordon a quarantined node", key="quarantine.cordon"))
    quarantine_label: str = field(default="", metadata=spec(
        _string(_label), "key=value label put on a quarantined node for external automation; empty: none",
        "KEY=VALUE", key="quarantine.label", shown_default="none"))
    write_concurrency: int = field(default=4, metadata=spec(
        concurrency, "quarantine writes in flight at once (1 to 32), each writer on a connection of its "
        "own, so that a storm's quarantines land together; 1 writes them one at a time", "N",
        key="quarantine.writeConcurrency"))
    drain: bool = field(default=False, metadata=spec(
        parse_bool, "evict the pods of a quarantined node through the Eviction API (PodDisruptionBudgets apply)",
        key="drain.enabled"))
    drain_per_minute: float = field(default=10.0, metadata=spec(
        positive, "most evictions per minute, over all nodes", "PER_MINUTE", flag="--drain-rate",
        key="drain.evictionsPerMinute"))
    recovery_hold_s: float = field(default=600.0, metadata=spec(
        Duration(positive=False), "how long a quarantined node must be healthy before the controller releases it",
        "DURATION", flag="--recovery-hold", key="release.recoveryHold"))
    repeat_limit: int = field(default=5, metadata=spec(
        count, "a node quarantined this many times within the repeat window stays quarantined (reason "
        "repeat-offender) until an operator releases it; 0 turns the count off", "N", key="release.repeatLimit"))
    repeat_window_s: float = field(default=7 * 86400.0, metadata=spec(
        Duration(positive=True), "how far back a node's quarantines count towards the repeat limit (168h: a week)",
        "DURATION", flag="--repeat-window", key="release.repeatWindow"))
    max_quarantined_fraction: float = field(default=0.1, metadata=spec(
        open_fraction, "most of the GPU nodes (above 0, at most 1) the controller keeps quarantined; at least one "
        "node when there is one; a quarantine beyond it opens the circuit breaker", "FRACTION",
        key="breaker.maxQuarantinedFraction"))
    max_quarantined_nodes: int = field(default=0, metadata=spec(
        count, "most GPU nodes the controller keeps quarantined, whatever the fleet's size; the smaller of this "
        "and the fraction's limit wins; 0: no absolute cap", "N", key="breaker.maxQuarantinedNodes"))
    lease_duration_s: float = field(default=15.0, metadata=spec(
        Duration(positive=True), "how long standbys wait after the last renewal before taking the Lease over",
        "DURATION", flag="--lease-duration", key="leaderElection.leaseDuration"))
    renew_deadline_s: float = field(default=10.0, metadata=spec(
        Duration(positive=True), "how long the leader keeps trying to renew before it stops acting; less than the "
        "lease duration", "DURATION", flag="--renew-deadline", key="leaderElection.renewDeadline"))
    retry_period_s: float = field(default=2.0, metadata=spec(
        Duration(positive=True), "time between tries to acquire or renew the Lease; less than the renew deadline",
        "DURATION", flag="--retry-period", key="leaderElection.retryPeriod"))
    write_timeout_s: float = field(default=4.0, metadata=spec(
        Duration(positive=True), "longest one API call of the controller may take, from connect to the answer, and "
        "the server-side timeout sent with each write; less than the lease duration minus the renew deadline, so "
        "that no write lands after a standby may have taken the Lease over", "DURATION", flag="--write-timeout",
        key="leaderElection.writeTimeout"))
    config_file: Path | None = field(default=None, metadata=spec(
        optional_path, "versioned YAML config file (version: v1)", "FILE", flag="--config", key="",
        shown_default="none"))

    @cached_property
    def selector(self) -> tuple[Requirement, ...]:
        """The node selector parsed (once: the reconciler asks for every node it sees)."""
        return parse_selector(self.node_selector)

    def effective(self) -> dict[str, Any]:
        """What is in force, for the start-up log (JSON-safe)."""
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), Path) else v) for f in fields(self)}


OPTIONS = table(ControllerConfig, ENV_PREFIX)
_BY_NAME = {o.name: o for o in OPTIONS}
CONFIG_OPTION = _BY_NAME["config_file"]
SECTIONS = sections(OPTIONS)
FILE_KEYS = {o.key: o for o in OPTIONS if o.key}


def option(name: str) -> Option:
    """The option behind a ControllerConfig field."""
    return _BY_NAME[name]


def options_table() -> list[tuple[str, str, str, str, str]]:
    """(flag, environment variable, file key, default, help) of every option, in the file's order; the file key is
    empty for the flag-and-environment-only ones."""
    return [(o.flag, o.env, o.key, o.default_text or "none", o.help) for o in OPTIONS]


def build_parser() -> argparse.ArgumentParser:
    """The flags; their values stay strings here so that load() checks them like the other sources."""
    p = OneLineParser(prog=PROG, allow_abbrev=False,
                      description="Quarantines failing GPU nodes (taint, optional cordon and drain) from the node "
                                  "agent's annotations, behind a circuit breaker. Every option also has an "
                                  "environment variable and a key in the config file; flags > environment > file > "
                                  "defaults.")
    add_arguments(p, OPTIONS, show_file=True)
    p.add_argument("--version", action=VersionAction)
    return p


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


def _check_fenced(values: dict[str, Any], labels: dict[str, str]) -> None:
    """The fencing rule: a write the leader sends at the last instant of its term either lands or is given up before
    a standby may take over (term: renew deadline after its last renewal was sent; takeover: lease duration after a
    standby saw that renewal). So every call's timeout is less than the gap between the two."""
    gap = values["lease_duration_s"] - values["renew_deadline_s"]
    if values["write_timeout_s"] < gap:
        return
    rule = (f"must be less than the lease duration minus the renew deadline "
            f"({format_duration(values['lease_duration_s'])} - {format_duration(values['renew_deadline_s'])} = "
            f"{format_duration(gap)}), so that no write lands after a standby may have taken over")
    if "write_timeout_s" in labels or not ({"lease_duration_s", "renew_deadline_s"} & labels.keys()):
        raise FieldError(labels.get("write_timeout_s", option("write_timeout_s").flag),
                         f"{rule}, got {format_duration(values['write_timeout_s'])}")
    name = "renew_deadline_s" if "renew_deadline_s" in labels else "lease_duration_s"
    wt = format_duration(values["write_timeout_s"]) + ("" if "write_timeout_s" in labels else ", the default")
    raise FieldError(labels[name], f"leaves {format_duration(gap)} between the renew deadline and the lease duration: "
                     f"the write timeout ({wt}) must be less, so that no write lands after a standby may have taken "
                     f"over")


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ControllerConfig:
    """Parse the flags, read the file they or the environment name, merge flags > environment > file > defaults and
    check every value; a bad one raises FieldError naming it where it was written. ``--help`` prints the options
    and raises SystemExit(0), as argparse does."""
    env = os.environ if environ is None else environ
    flags = parse_flags(build_parser(), sys.argv[1:] if argv is None else argv, OPTIONS, "the controller")
    config_file, file_label = config_path(flags["config_file"], env, CONFIG_OPTION.flag, CONFIG_OPTION.env)
    doc = read_file(config_file, file_label, OPTIONS, CONFIG_VERSION).values if config_file is not None else {}
    r = resolve((o for o in OPTIONS if o is not CONFIG_OPTION), flags, env, doc)
    values, labels = r.values, r.set_by
    if not values["identity"]:
        values["identity"] = socket.gethostname() or PROG
    _check_less(values, labels, "renew_deadline_s", "lease_duration_s")
    _check_less(values, labels, "retry_period_s", "renew_deadline_s")
    _check_fenced(values, labels)
    return ControllerConfig(**values, config_file=config_file)


def parse_or_exit(argv: Sequence[str] | None = None) -> ControllerConfig:
    """load() from the process's flags and environment; a bad value is one line on stderr and exit status 2."""
    try:
        return load(argv, os.environ)
    except FieldError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
