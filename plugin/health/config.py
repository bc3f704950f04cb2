"""What the health policy can be told: XID classes, thresholds, hold times, overrides and the kubelet mapping.

The defaults follow NVIDIA's XID classes and DCGM's health-watch thresholds (docs/health.md). ``parse_health`` reads
the config file's ``health`` section into a ``HealthConfig``; a bad value is a ``FieldError`` naming its key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from plugin.health.reasons import KubeletHealth, State
from plugin.validation import FieldError, first_key, is_reason_code, parse_bool

FATAL_XIDS = frozenset({46, 48, 62, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 143, 155, 158})
DEGRADED_XIDS = frozenset({63, 92, 94, 156})
APPLICATION_XIDS = frozenset({8, 13, 31, 32, 43, 45, 68, 69, 137})

DEFAULT_KUBELET_HEALTH = {
    State.HEALTHY: KubeletHealth.HEALTHY,
    State.DEGRADED: KubeletHealth.HEALTHY,
    State.UNHEALTHY: KubeletHealth.UNHEALTHY,
    State.UNKNOWN: KubeletHealth.UNHEALTHY,
}


@dataclass(frozen=True)
class HealthConfig:
    fatal_xids: frozenset[int] = FATAL_XIDS
    degraded_xids: frozenset[int] = DEGRADED_XIDS
    application_xids: frozenset[int] = APPLICATION_XIDS
    ignored_xids: frozenset[int] = frozenset()
    unknown_xid_state: State = State.DEGRADED
    app_xid_repeat_threshold: int = 3
    app_xid_window_s: float = 3 * 3600.0
    retired_pages_limit: int = 63
    ecc_corrected_limit: int | None = None
    # Corrected ECC errors per minute between two polls above which a device is Degraded; None: off.
    ecc_corrected_rate_per_min: float | None = None
    check_pcie_gen_when_idle: bool = False
    clear_after_polls: int = 3
    rate_hold_s: float = 600.0
    nvml_error_polls: int = 3
    # Active NVLink links a GPU model must have (by its NVML name); fewer is nvlink-down, which catches a link that
    # never trained. Empty: a link slot never seen active is topology, not a fault.
    nvlink_expected_links: dict[str, int] = field(default_factory=dict)
    # Hold time of an event-latched condition, by the state it asks for; None: until the GPU is seen reset.
    latch_hold_s: dict[State, float | None] = field(default_factory=lambda: {
        State.UNHEALTHY: None, State.DEGRADED: 24 * 3600.0, State.UNKNOWN: None})
    flap_max: int = 4
    flap_window_s: float = 600.0
    flap_backoff_s: float = 600.0
    # Per-code override of the state a reason asks for; "ignore" drops it.
    overrides: dict[str, str] = field(default_factory=dict)
    kubelet_health: dict[State, KubeletHealth] = field(default_factory=lambda: dict(DEFAULT_KUBELET_HEALTH))


# The config file's health section -------------------------------------------------------------------------------

def _xid_list(v: Any, where: str) -> frozenset[int]:
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
        raise FieldError(where, f"expected a list of XID numbers, got {v!r}")
    return frozenset(v)


def _num(v: Any, where: str, integer: bool = False, allow_none: bool = False, minimum: float = 0) -> Any:
    if v is None and allow_none:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or v < minimum:
        kind = "an integer" if integer else "a number"
        raise FieldError(where, f"expected {kind} >= {minimum:g}{' or null' if allow_none else ''}, got {v!r}")
    return v


def _state(v: Any, where: str) -> State:
    try:
        return State(v)
    except ValueError:
        raise FieldError(where, f"expected one of {', '.join(s.value for s in State)}, got {v!r}") from None


def _section(doc: Mapping[str, Any], key: str, where: str, known: set[str]) -> dict[str, Any]:
    v = doc.get(key, {})
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise FieldError(where, f"expected a mapping, got {v!r}")
    unknown = set(v) - known
    if unknown:
        raise FieldError(f"{where}.{first_key(unknown)}", f"unknown key (known: {', '.join(sorted(known))})")
    return v


def parse_health(doc: Any) -> HealthConfig:
    if doc is None:
        return HealthConfig()
    if not isinstance(doc, dict):
        raise FieldError("health", f"expected a mapping, got {doc!r}")
    top = {"xid", "unknownXidState", "appXidRepeat", "thresholds", "clearAfterPolls", "nvmlErrorPolls",
           "rateHoldSeconds", "latchHoldSeconds", "flap", "overrides", "kubeletHealth", "nvlinkExpectedLinks"}
    unknown = set(doc) - top
    if unknown:
        raise FieldError(f"health.{first_key(unknown)}", f"unknown key (known: {', '.join(sorted(top))})")
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
            raise FieldError(f"health.xid.{a}", f"XID {min(both)} is also in health.xid.{b}")
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
            changes["check_pcie_gen_when_idle"] = parse_bool(th["checkPcieGenWhenIdle"])
        except ValueError as exc:
            raise FieldError("health.thresholds.checkPcieGenWhenIdle", str(exc)) from None
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
            raise FieldError("health.flap.max", f"at most 10000 (set windowSeconds: 0 to turn damping off), "
                                                f"got {changes['flap_max']}")
    if "windowSeconds" in flap:
        changes["flap_window_s"] = float(_num(flap["windowSeconds"], "health.flap.windowSeconds"))
    if "backoffSeconds" in flap:
        changes["flap_backoff_s"] = float(_num(flap["backoffSeconds"], "health.flap.backoffSeconds"))
    links = doc.get("nvlinkExpectedLinks", {}) or {}
    if not isinstance(links, dict):
        raise FieldError("health.nvlinkExpectedLinks",
                         f"expected a mapping of GPU model name to a link count, got {links!r}")
    for model, count in links.items():
        _num(count, f"health.nvlinkExpectedLinks.{model}", True, minimum=0)
    if links:
        changes["nvlink_expected_links"] = {str(k): int(v) for k, v in links.items()}
    overrides = doc.get("overrides", {}) or {}
    if not isinstance(overrides, dict):
        raise FieldError("health.overrides", f"expected a mapping of reason code to state, got {overrides!r}")
    for code, target in overrides.items():
        if not isinstance(code, str) or not is_reason_code(code):
            raise FieldError(f"health.overrides.{code}", "reason codes are lower-case and hyphenated")
        if target != "ignore":
            _state(target, f"health.overrides.{code}")
    if overrides:
        changes["overrides"] = {str(k): str(v) for k, v in overrides.items()}
    kh = _section(doc, "kubeletHealth", "health.kubeletHealth", {s.value for s in State})
    if kh:
        mapping = dict(DEFAULT_KUBELET_HEALTH)
        for k, v in kh.items():
            if v not in {h.value for h in KubeletHealth}:
                raise FieldError(f"health.kubeletHealth.{k}", f"expected Healthy or Unhealthy, got {v!r}")
            mapping[State(k)] = KubeletHealth(v)
        if mapping[State.HEALTHY] != "Healthy":
            raise FieldError("health.kubeletHealth.Healthy", "a Healthy device must be reported Healthy")
        changes["kubelet_health"] = mapping
    return replace(h, **changes)
