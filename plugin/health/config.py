"""What the health policy can be told: XID classes, thresholds, hold times, overrides and the kubelet mapping.

The defaults follow NVIDIA's XID classes and DCGM's health-watch thresholds (docs/health.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plugin.health.reasons import State

FATAL_XIDS = frozenset({46, 48, 62, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 143, 155, 158})
DEGRADED_XIDS = frozenset({63, 92, 94, 156})
APPLICATION_XIDS = frozenset({8, 13, 31, 32, 43, 45, 68, 69, 137})

DEFAULT_KUBELET_HEALTH = {
    State.HEALTHY: "Healthy",
    State.DEGRADED: "Healthy",
    State.UNHEALTHY: "Unhealthy",
    State.UNKNOWN: "Unhealthy",
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
    # Hold time of an event-latched condition, by the state it asks for; None: until the GPU is seen reset.
    latch_hold_s: dict[State, float | None] = field(default_factory=lambda: {
        State.UNHEALTHY: None, State.DEGRADED: 24 * 3600.0, State.UNKNOWN: None})
    flap_max: int = 4
    flap_window_s: float = 600.0
    flap_backoff_s: float = 600.0
    # Per-code override of the state a reason asks for; "ignore" drops it.
    overrides: dict[str, str] = field(default_factory=dict)
    kubelet_health: dict[State, str] = field(default_factory=lambda: dict(DEFAULT_KUBELET_HEALTH))
