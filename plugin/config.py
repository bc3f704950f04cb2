"""Versioned configuration: one schema, three sources (flags > environment > file), validated in one place.

Every field has a flag (``--poll-interval``), an environment variable (``GPU_HEALTH_POLL_INTERVAL``) and a key in the
``plugin`` section of the file (``pollInterval``). The ``health`` section tunes the policy. A bad value names the
field and the CLI exits 2. ``docs/config.md`` is generated from this schema.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from plugin.health.config import DEFAULT_KUBELET_HEALTH, HealthConfig
from plugin.health.reasons import State
from plugin.kubelet.sharing import MIG_STRATEGIES, SharingConfig, SharingError, parse_sharing
from plugin.kubelet.sharing import validate as validate_sharing
from plugin.validation import split_host_port

CONFIG_VERSION = "v1"
ENV_PREFIX = "GPU_HEALTH_"
_RESOURCE_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class ConfigError(ValueError):
    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("true", "1", "yes", "on"):
        return True
    if s in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {v!r}")


def _float_pos(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError(f"expected a number, got {v!r}")
    f = float(v)
    if not f > 0 or f != f or f == float("inf"):
        raise ValueError(f"must be a positive number, got {v!r}")
    return f


class _Choice:
    """A parser for one of a fixed set of words; the set is kept so --help can list it."""

    def __init__(self, *options: str) -> None:
        self.options = options

    def __call__(self, v: Any) -> str:
        if v not in self.options:
            raise ValueError(f"expected one of {', '.join(self.options)}, got {v!r}")
        return str(v)


def _choice(*options: str) -> _Choice:
    return _Choice(*options)


def _path(v: Any) -> Path:
    """An absolute path: a relative one is taken against the working directory now, at load time, so that what
    the start-up log shows is what every later open, bind and watch uses."""
    if not isinstance(v, (str, Path)) or not str(v):
        raise ValueError(f"expected a path, got {v!r}")
    return Path(os.path.abspath(v))


def _opt_path(v: Any) -> Path | None:
    return None if v in (None, "") else _path(v)


def _resource(v: Any) -> str:
    s = str(v)
    if not _RESOURCE_RE.match(s) or s.startswith("kubernetes.io/") or len(s) > 253:
        raise ValueError(f"expected an extended resource name like nvidia.com/gpu, got {v!r}")
    return s


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {v!r}")
    return v


def _listen_address(v: Any) -> str:
    s = str(v).strip()
    if s.lower() == "off":
        return "off"
    split_host_port(s)
    return s


CORRELATABLE_STATES = ("Degraded", "Unknown", "Unhealthy")


def _state_list(v: Any) -> tuple[str, ...]:
    """A comma-separated string or a list of states; ``none`` (or empty) for no states."""
    items = [str(x).strip() for x in v] if isinstance(v, list) else [x.strip() for x in str(v).split(",")]
    items = [x for x in items if x]
    if items in ([], ["none"]):
        return ()
    bad = [x for x in items if x not in CORRELATABLE_STATES]
    if bad:
        raise ValueError(f"expected states among {', '.join(CORRELATABLE_STATES)} (or none), got {bad[0]!r}")
    return tuple(sorted(set(items), key=CORRELATABLE_STATES.index))


def _node_name(v: Any) -> str:
    from plugin.outlets.annotations import check_node_name
    return check_node_name(str(v).strip())


def _annotation_prefix(v: Any) -> str:
    from plugin.outlets.annotations import check_prefix
    return check_prefix(str(v).strip())


def _condition_type(v: Any) -> str:
    from plugin.outlets.condition import check_condition_type
    return check_condition_type(str(v).strip())


def _int_pos(v: Any) -> int:
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"expected a positive integer, got {v!r}")
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ValueError(f"expected a positive integer, got {v!r}") from None
    if n <= 0:
        raise ValueError(f"expected a positive integer, got {v!r}")
    return n


@dataclass(frozen=True)
class Option:
    name: str  # python attribute
    parse: Callable[[Any], Any]
    default: Any
    help: str
    metavar: str = ""
    env_aliases: tuple[str, ...] = ()  # other variables read when ENV_PREFIX+NAME is unset (e.g. NODE_NAME)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def key(self) -> str:
        head, *tail = self.name.split("_")
        return head + "".join(t.capitalize() for t in tail)

    @property
    def is_bool(self) -> bool:
        return self.parse is _bool

    @property
    def choices(self) -> tuple[str, ...]:
        return self.parse.options if isinstance(self.parse, _Choice) else ()


def default_text(o: Option) -> str | None:
    """The default as a user would write it (``5``, ``false``, ``Unhealthy``); None when the default is "unset",
    whose meaning the option's help states (e.g. health.sock in the state dir)."""
    d = o.default
    if d is None or d == "":
        return None
    if isinstance(d, bool):
        return "true" if d else "false"
    if isinstance(d, float) and d.is_integer():
        return str(int(d))
    if isinstance(d, tuple):
        return ",".join(d) if d else "none"
    return str(d)


OPTIONS: tuple[Option, ...] = (
    Option("backend", _choice("nvml", "simulated"), "nvml", "where device readings come from"),
    Option("simulated_node", _opt_path, None, "node description for the simulated backend (JSON); "
           "the built-in 8-GPU node when unset", "FILE"),
    Option("device_plugin_dir", _path, Path("/var/lib/kubelet/device-plugins"),
           "the kubelet's device-plugin directory (kubelet.sock lives here)", "DIR"),
    Option("state_dir", _path, Path("/var/lib/gpu-health-device-plugin"),
           "where durable health state (latched faults, transitions) is kept", "DIR"),
    Option("health_socket", _opt_path, None, "unix socket of the node-local health API "
           "(default: health.sock in the state dir)", "PATH"),
    Option("dev_root", _path, Path("/"), "root under which the host's /dev/nvidia* nodes are found", "DIR"),
    Option("resource_name", _resource, "nvidia.com/gpu", "extended resource advertised to the kubelet", "NAME"),
    Option("mig_strategy", _choice(*MIG_STRATEGIES), "none", "MIG devices: none (GPUs whole), single (MIG devices "
           "as the resource above) or mixed (one resource per profile, e.g. nvidia.com/mig-1g.10gb)"),
    Option("cdi", _bool, False, "also return CDI device names (nvidia.com/gpu=<uuid>) from Allocate"),
    Option("allow_unhealthy_allocation", _bool, False,
           "let Allocate hand out devices the plugin reports Unhealthy (otherwise Allocate fails with "
           "FAILED_PRECONDITION)"),
    Option("poll_interval", _float_pos, 5.0, "seconds between health polls", "SECONDS"),
    Option("fail_on_init_error", _bool, True,
           "exit non-zero when NVML cannot start; false keeps serving with no healthy devices"),
    Option("log_format", _choice("text", "json"), "text", "log line format"),
    Option("log_level", _choice("debug", "info", "warning", "error"), "info", "log verbosity"),
    Option("metrics_address", _listen_address, "0.0.0.0:9402",
           "HOST:PORT serving /metrics, /healthz and /readyz; off disables", "HOST:PORT"),
    Option("stall_threshold", _float_pos, 60.0, "seconds a health loop may fall behind (the poller: beyond "
           "its interval) before /healthz fails", "SECONDS"),
    Option("correlate_on", _state_list, ("Unhealthy",), "device states that make the plugin find the pods "
           "holding the device (PodResources) and post Events on them; comma-separated, or none", "STATES"),
    Option("pod_resources_socket", _path, Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
           "the kubelet's PodResources socket", "PATH"),
    Option("annotate_pods", _bool, False, "also annotate pods holding a failing device"),
    Option("remediate", _choice("none", "evict"), "none",
           "evict: evict pods holding a failing device through the eviction API (PodDisruptionBudgets apply)"),
    # Cluster reporting (plugin/outlets/kube.py, docs/annotations.md). Reporting is on when a node name is known.
    Option("node_name", _node_name, "", "this node's name in the API server (the DaemonSet sets NODE_NAME); "
           "empty turns cluster reporting off", "NAME", env_aliases=("NODE_NAME",)),
    Option("kubeconfig", _opt_path, None, "kubeconfig for running outside the cluster "
           "(default: the Pod's service account)", "FILE"),
    Option("annotations", _bool, True, "write per-device health annotations onto this node"),
    Option("annotation_prefix", _annotation_prefix, "gpu-health.io",
           "DNS subdomain our annotation keys live under (the admission policy allows gpu-health.io)", "DOMAIN"),
    Option("annotation_max_bytes", _int_pos, 65536, "cap on the size of our annotations; beyond it device "
           "entries are dropped, worst kept, and a truncation marker is written", "BYTES"),
    Option("events", _bool, True, "post Events on this node for transitions into and out of Degraded/Unhealthy"),
    Option("node_condition", _bool, False, "maintain a node condition (needs nodes/status patch: the "
           "node-condition overlay)"),
    Option("node_condition_type", _condition_type, "GPUHealthy", "type of that node condition", "TYPE"),
    Option("report_debounce", _float_pos, 1.0, "seconds a burst of changes is collected into one write", "SECONDS"),
    Option("report_min_interval", _float_pos, 10.0, "seconds between two writes to the node (token bucket)",
           "SECONDS"),
    Option("report_resync_interval", _float_pos, 600.0, "seconds between re-reads of the node that repair "
           "manual edits of our keys", "SECONDS"),
    Option("report_backoff_max", _float_pos, 300.0, "longest wait between retries while the API server is "
           "unreachable or refusing (exponential back-off with jitter up to this)", "SECONDS"),
)
BY_NAME = {o.name: o for o in OPTIONS}


@dataclass(frozen=True)
class Config:
    backend: str = "nvml"
    simulated_node: Path | None = None
    device_plugin_dir: Path = Path("/var/lib/kubelet/device-plugins")
    state_dir: Path = Path("/var/lib/gpu-health-device-plugin")
    health_socket: Path | None = None
    dev_root: Path = Path("/")
    resource_name: str = "nvidia.com/gpu"
    mig_strategy: str = "none"
    cdi: bool = False
    allow_unhealthy_allocation: bool = False
    poll_interval: float = 5.0
    fail_on_init_error: bool = True
    log_format: str = "text"
    log_level: str = "info"
    metrics_address: str = "0.0.0.0:9402"
    stall_threshold: float = 60.0
    correlate_on: tuple[str, ...] = ("Unhealthy",)
    pod_resources_socket: Path = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    annotate_pods: bool = False
    remediate: str = "none"
    node_name: str = ""
    kubeconfig: Path | None = None
    annotations: bool = True
    annotation_prefix: str = "gpu-health.io"
    annotation_max_bytes: int = 65536
    events: bool = True
    node_condition: bool = False
    node_condition_type: str = "GPUHealthy"
    report_debounce: float = 1.0
    report_min_interval: float = 10.0
    report_resync_interval: float = 600.0
    report_backoff_max: float = 300.0
    health: HealthConfig = field(default_factory=HealthConfig)
    sharing: SharingConfig = field(default_factory=SharingConfig)
    source: dict[str, str] = field(default_factory=dict, compare=False)  # field -> flag/env/file/default
    # field -> the name the user set it under (--state-dir, GPU_HEALTH_STATE_DIR, plugin.stateDir), for messages
    set_by: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def health_socket_path(self) -> Path:
        return self.health_socket or self.state_dir / "health.sock"

    def name_of(self, option: str) -> str:
        """How to name an option in a message: as the user set it, else by its flag."""
        return self.set_by.get(option) or BY_NAME[option].flag

    def effective(self) -> dict[str, Any]:
        """What is in force, for the start-up log (JSON-safe)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in ("health", "source", "set_by", "sharing"):
                continue
            v = getattr(self, f.name)
            out[f.name] = str(v) if isinstance(v, Path) else v
        out["health_socket"] = str(self.health_socket_path)
        out["sharing"] = self.sharing.effective()
        h = self.health
        out["health"] = {
            "fatal_xids": sorted(h.fatal_xids), "degraded_xids": sorted(h.degraded_xids),
            "application_xids": sorted(h.application_xids), "ignored_xids": sorted(h.ignored_xids),
            "clear_after_polls": h.clear_after_polls, "rate_hold_s": h.rate_hold_s,
            "ecc_corrected_limit": h.ecc_corrected_limit, "ecc_corrected_rate_per_min": h.ecc_corrected_rate_per_min,
            "overrides": h.overrides,
            "kubelet_health": {k.value: v for k, v in h.kubelet_health.items()},
        }
        return out


def _first(keys: set[Any]) -> str:
    """The first offending key, printable even when YAML made it empty, a number or null."""
    names = sorted((k if isinstance(k, str) and k.isprintable() and k.strip() else repr(k)) for k in keys)
    return names[0]


# The health section --------------------------------------------------------------------------------------------

def _xid_list(v: Any, where: str) -> frozenset[int]:
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
        raise ConfigError(where, f"expected a list of XID numbers, got {v!r}")
    return frozenset(v)


def _num(v: Any, where: str, integer: bool = False, allow_none: bool = False, minimum: float = 0) -> Any:
    if v is None and allow_none:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or v < minimum:
        kind = "an integer" if integer else "a number"
        raise ConfigError(where, f"expected {kind} >= {minimum:g}{' or null' if allow_none else ''}, got {v!r}")
    return v


def _state(v: Any, where: str) -> State:
    try:
        return State(v)
    except ValueError:
        raise ConfigError(where, f"expected one of {', '.join(s.value for s in State)}, got {v!r}") from None


def _section(doc: Mapping[str, Any], key: str, where: str, known: set[str]) -> dict[str, Any]:
    v = doc.get(key, {})
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(where, f"expected a mapping, got {v!r}")
    unknown = set(v) - known
    if unknown:
        raise ConfigError(f"{where}.{_first(unknown)}", f"unknown key (known: {', '.join(sorted(known))})")
    return v


def parse_health(doc: Any) -> HealthConfig:
    if doc is None:
        return HealthConfig()
    if not isinstance(doc, dict):
        raise ConfigError("health", f"expected a mapping, got {doc!r}")
    top = {"xid", "unknownXidState", "appXidRepeat", "thresholds", "clearAfterPolls", "nvmlErrorPolls",
           "rateHoldSeconds", "latchHoldSeconds", "flap", "overrides", "kubeletHealth"}
    unknown = set(doc) - top
    if unknown:
        raise ConfigError(f"health.{_first(unknown)}", f"unknown key (known: {', '.join(sorted(top))})")
    h = HealthConfig()
    changes: dict[str, Any] = {}
    xid = _section(doc, "xid", "health.xid", {"fatal", "degraded", "application", "ignored"})
    for cls in ("fatal", "degraded", "application", "ignored"):
        if cls in xid:
            changes[f"{cls}_xids"] = _xid_list(xid[cls], f"health.xid.{cls}")
    classes = {c: changes.get(f"{c}_xids", getattr(h, f"{c}_xids")) for c in ("fatal", "degraded", "application")}
    for a, b in (("fatal", "degraded"), ("fatal", "application"), ("degraded", "application")):
        both = classes[a] & classes[b]
        if both:
            raise ConfigError(f"health.xid.{a}", f"XID {min(both)} is also in health.xid.{b}")
    if "unknownXidState" in doc:
        changes["unknown_xid_state"] = _state(doc["unknownXidState"], "health.unknownXidState")
    rep = _section(doc, "appXidRepeat", "health.appXidRepeat", {"threshold", "windowSeconds"})
    if "threshold" in rep:
        changes["app_xid_repeat_threshold"] = _num(rep["threshold"], "health.appXidRepeat.threshold", True,
                                                   minimum=1)
    if "windowSeconds" in rep:
        changes["app_xid_window_s"] = float(_num(rep["windowSeconds"], "health.appXidRepeat.windowSeconds"))
    th = _section(doc, "thresholds", "health.thresholds",
                  {"retiredPagesLimit", "eccCorrectedLimit", "eccCorrectedRatePerMinute", "checkPcieGenWhenIdle"})
    if "retiredPagesLimit" in th:
        changes["retired_pages_limit"] = _num(th["retiredPagesLimit"], "health.thresholds.retiredPagesLimit", True,
                                              minimum=1)
    if "eccCorrectedLimit" in th:
        changes["ecc_corrected_limit"] = _num(th["eccCorrectedLimit"], "health.thresholds.eccCorrectedLimit", True,
                                              allow_none=True)
    if "eccCorrectedRatePerMinute" in th:
        rate = _num(th["eccCorrectedRatePerMinute"], "health.thresholds.eccCorrectedRatePerMinute", allow_none=True)
        changes["ecc_corrected_rate_per_min"] = None if rate is None else float(rate)
    if "rateHoldSeconds" in doc:
        changes["rate_hold_s"] = float(_num(doc["rateHoldSeconds"], "health.rateHoldSeconds"))
    if "checkPcieGenWhenIdle" in th:
        try:
            changes["check_pcie_gen_when_idle"] = _bool(th["checkPcieGenWhenIdle"])
        except ValueError as exc:
            raise ConfigError("health.thresholds.checkPcieGenWhenIdle", str(exc)) from None
    for key, attr in (("clearAfterPolls", "clear_after_polls"), ("nvmlErrorPolls", "nvml_error_polls")):
        if key in doc:
            changes[attr] = _num(doc[key], f"health.{key}", True, minimum=1)
    hold = _section(doc, "latchHoldSeconds", "health.latchHoldSeconds", {"Unhealthy", "Degraded", "Unknown"})
    if hold:
        merged = dict(h.latch_hold_s)
        for k, v in hold.items():
            merged[State(k)] = _num(v, f"health.latchHoldSeconds.{k}", allow_none=True)
        changes["latch_hold_s"] = merged
    flap = _section(doc, "flap", "health.flap", {"max", "windowSeconds", "backoffSeconds"})
    if "max" in flap:
        changes["flap_max"] = _num(flap["max"], "health.flap.max", True, minimum=1)
        if changes["flap_max"] > 10_000:
            raise ConfigError("health.flap.max", f"at most 10000 (set windowSeconds: 0 to turn damping off), "
                                                 f"got {changes['flap_max']}")
    if "windowSeconds" in flap:
        changes["flap_window_s"] = float(_num(flap["windowSeconds"], "health.flap.windowSeconds"))
    if "backoffSeconds" in flap:
        changes["flap_backoff_s"] = float(_num(flap["backoffSeconds"], "health.flap.backoffSeconds"))
    overrides = doc.get("overrides", {}) or {}
    if not isinstance(overrides, dict):
        raise ConfigError("health.overrides", f"expected a mapping of reason code to state, got {overrides!r}")
    for code, target in overrides.items():
        if not isinstance(code, str) or not re.match(r"^[a-z0-9]+(-[a-z0-9]+)*$", code):
            raise ConfigError(f"health.overrides.{code}", "reason codes are lower-case and hyphenated")
        if target != "ignore":
            _state(target, f"health.overrides.{code}")
    if overrides:
        changes["overrides"] = {str(k): str(v) for k, v in overrides.items()}
    kh = _section(doc, "kubeletHealth", "health.kubeletHealth", {s.value for s in State})
    if kh:
        mapping = dict(DEFAULT_KUBELET_HEALTH)
        for k, v in kh.items():
            if v not in ("Healthy", "Unhealthy"):
                raise ConfigError(f"health.kubeletHealth.{k}", f"expected Healthy or Unhealthy, got {v!r}")
            mapping[State(k)] = v
        if mapping[State.HEALTHY] != "Healthy":
            raise ConfigError("health.kubeletHealth.Healthy", "a Healthy device must be reported Healthy")
        changes["kubelet_health"] = mapping
    return replace(h, **changes)


# Loading ----------------------------------------------------------------------------------------------------------

def read_file(path: Path, label: str = "--config") -> dict[str, Any]:
    """The config file as a mapping; ``label`` names where its path came from (--config or GPU_HEALTH_CONFIG)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(label, f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(label, f"{path} is not a text file") from None
    try:
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(label, f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                          f"{str(exc).splitlines()[0]}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(label, f"{path}: expected a mapping at the top level")
    if doc.get("version") != CONFIG_VERSION:
        raise ConfigError("version", f"expected {CONFIG_VERSION!r}, got {doc.get('version')!r}")
    known = {"version", "plugin", "health", "sharing"}
    unknown = set(doc) - known
    if unknown:
        raise ConfigError(_first(unknown), f"unknown section (known: {', '.join(sorted(known))})")
    return doc


def load(flags: Mapping[str, Any], env: Mapping[str, str], file: Path | None,
         file_label: str = "--config") -> Config:
    """Merge the three sources (flags > env > file > defaults) and validate every value."""
    doc: dict[str, Any] = read_file(Path(os.path.abspath(file)), file_label) if file is not None else {}
    plugin = doc.get("plugin") or {}
    if not isinstance(plugin, dict):
        raise ConfigError("plugin", "expected a mapping")
    by_key = {o.key: o for o in OPTIONS}
    for k in plugin:
        if k not in by_key:
            raise ConfigError(f"plugin.{_first({k})}", f"unknown key (known: {', '.join(sorted(by_key))})")
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    set_by: dict[str, str] = {}
    for o in OPTIONS:
        if flags.get(o.name) is not None:
            raw, src, label = flags[o.name], "flag", o.flag
        elif o.env in env or any(a in env for a in o.env_aliases):
            var = next(v for v in (o.env, *o.env_aliases) if v in env)
            raw, src, label = env[var], "env", var
        elif o.key in plugin:
            raw, src, label = plugin[o.key], "file", f"plugin.{o.key}"
        else:
            values[o.name] = o.default
            source[o.name] = "default"
            continue
        try:
            values[o.name] = o.parse(raw)
        except (ValueError, TypeError) as exc:
            raise ConfigError(label, str(exc)) from None
        source[o.name] = src
        set_by[o.name] = label
    health = parse_health(doc.get("health"))
    try:
        sharing = parse_sharing(doc.get("sharing"))
        validate_sharing(sharing, values["resource_name"], values["mig_strategy"])
    except SharingError as exc:
        raise ConfigError(exc.field, exc.message) from None
    cfg = Config(**values, health=health, sharing=sharing, source=source, set_by=set_by)
    if cfg.backend != "simulated" and cfg.simulated_node is not None:
        via = f", set by {set_by['backend']}" if "backend" in set_by else ""
        raise ConfigError(cfg.name_of("simulated_node"),
                          f"only valid with --backend simulated (the backend is {cfg.backend}{via})")
    return cfg
