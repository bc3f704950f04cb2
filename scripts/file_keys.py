"""The keys of the plugin config file's health and sharing sections, described for the generated docs
(scripts/gen_docs.py, which checks them against the parsers) and the chart schema (scripts/gen_chart_schema.py).
Both read this table; neither imports the other for it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plugin.health.config import HealthConfig
from plugin.health.reasons import State


class DocsError(RuntimeError):
    pass


@dataclass(frozen=True)
class Key:
    path: str  # dotted key in the file, e.g. "health.xid.fatal"
    type: str
    description: str
    default: Callable[[HealthConfig], Any] | str | None = None  # from the default HealthConfig, or a literal


def _hold(state: State) -> Callable[[HealthConfig], Any]:
    return lambda h: h.latch_hold_s[state]


def _kubelet(state: State) -> Callable[[HealthConfig], Any]:
    return lambda h: h.kubelet_health[state]


HEALTH_KEYS: tuple[Key, ...] = (
    Key("health.xid.fatal", "list of XIDs", "XIDs that make a device Unhealthy; latched until the GPU is seen "
        "reset or the Unhealthy hold time passes.", lambda h: sorted(h.fatal_xids)),
    Key("health.xid.degraded", "list of XIDs", "XIDs that make a device Degraded (usable, reset when convenient); "
        "latched like fatal ones.", lambda h: sorted(h.degraded_xids)),
    Key("health.xid.application", "list of XIDs", "XIDs caused by the application, not the GPU: no change by "
        "themselves, Degraded when one repeats on a GPU beyond `appXidRepeat`.",
        lambda h: sorted(h.application_xids)),
    Key("health.xid.ignored", "list of XIDs", "XIDs dropped entirely.", lambda h: sorted(h.ignored_xids)),
    Key("health.unknownXidState", "state", "What an XID in none of the classes does.",
        lambda h: h.unknown_xid_state.value),
    Key("health.appXidRepeat.threshold", "integer >= 1", "Repeats of one application XID on one GPU within the "
        "window that make the GPU Degraded.", lambda h: h.app_xid_repeat_threshold),
    Key("health.appXidRepeat.windowSeconds", "seconds", "Window for `threshold`.", lambda h: h.app_xid_window_s),
    Key("health.thresholds.retiredPagesLimit", "integer >= 1", "Retired pages that make a GPU Unhealthy "
        "(`retired-pages-limit`).", lambda h: h.retired_pages_limit),
    Key("health.thresholds.eccCorrectedLimit", "integer or null", "Volatile corrected ECC count above which a GPU "
        "is Degraded (`ecc-corrected-high`); null turns the rule off.", lambda h: h.ecc_corrected_limit),
    Key("health.thresholds.eccCorrectedRatePerMinute", "number or null", "Corrected ECC errors per minute "
        "between two polls above which a GPU is Degraded (`ecc-corrected-rate`, held like every rate rule); null "
        "turns the rule off.", lambda h: h.ecc_corrected_rate_per_min),
    Key("health.thresholds.checkPcieGenWhenIdle", "boolean", "Also flag a PCIe generation below maximum while the "
        "GPU is idle (idle GPUs lower their link speed to save power).", lambda h: h.check_pcie_gen_when_idle),
    Key("health.clearAfterPolls", "integer >= 1", "Consecutive clean polls before a polled condition clears.",
        lambda h: h.clear_after_polls),
    Key("health.rateHoldSeconds", "seconds", "How long a rate condition (`pcie-replay-rate`, `nvlink-errors`, "
        "`ecc-corrected-rate`) stays after its counter stops growing, so a burst stays visible; kept across "
        "restarts.", lambda h: h.rate_hold_s),
    Key("health.nvmlErrorPolls", "integer >= 1", "Consecutive failed NVML polls of one GPU before it is Unknown.",
        lambda h: h.nvml_error_polls),
    Key("health.nvlinkExpectedLinks", "map of GPU model to integer", "Active NVLink links each GPU model (its "
        "NVML name, as `gpu-health-plugin inspect` prints it) must have, e.g. `{\"NVIDIA H100 80GB HBM3\": 18}`; "
        "fewer is `nvlink-down`, which catches a link that never trained. Without it a link slot never seen "
        "active is topology, not a fault.", lambda h: h.nvlink_expected_links),
    Key("health.latchHoldSeconds.Unhealthy", "seconds or null", "How long an event-latched Unhealthy condition "
        "holds with no new event; null: until the GPU is seen reset.", _hold(State.UNHEALTHY)),
    Key("health.latchHoldSeconds.Degraded", "seconds or null", "The same for Degraded.", _hold(State.DEGRADED)),
    Key("health.latchHoldSeconds.Unknown", "seconds or null", "The same for Unknown.", _hold(State.UNKNOWN)),
    Key("health.flap.max", "integer >= 1", "State changes within the window beyond which a device is flapping.",
        lambda h: h.flap_max),
    Key("health.flap.windowSeconds", "seconds", "Window for `max`.", lambda h: h.flap_window_s),
    Key("health.flap.backoffSeconds", "seconds", "How long a flapping device keeps its worst recent state.",
        lambda h: h.flap_backoff_s),
    Key("health.overrides", "map: reason code to state or `ignore`", "Change the state a reason asks for, or "
        "drop it (`xid-13: ignore`; a rule for `xid-13` also covers `xid-13-repeated`). Codes: "
        "[reasons.md](reasons.md).", lambda h: h.overrides),
    Key("health.kubeletHealth.Healthy", "`Healthy`", "What the kubelet is told for a Healthy device (always "
        "Healthy).", _kubelet(State.HEALTHY)),
    Key("health.kubeletHealth.Degraded", "`Healthy` or `Unhealthy`", "What the kubelet is told for a Degraded "
        "device: Unhealthy stops new pods from getting it.", _kubelet(State.DEGRADED)),
    Key("health.kubeletHealth.Unhealthy", "`Healthy` or `Unhealthy`", "What the kubelet is told for an "
        "Unhealthy device.", _kubelet(State.UNHEALTHY)),
    Key("health.kubeletHealth.Unknown", "`Healthy` or `Unhealthy`", "What the kubelet is told for a device the "
        "plugin cannot read.", _kubelet(State.UNKNOWN)),
)

SHARING_KEYS: tuple[Key, ...] = (
    Key("sharing.timeSlicing.allocationPolicy", "`distributed` or `packed`", "How GetPreferredAllocation picks "
        "replicas: spread over GPUs, or fill one GPU first.", "distributed"),
    Key("sharing.timeSlicing.failRequestsGreaterThanOne", "boolean", "Default for every entry: refuse Allocate of "
        "more than one replica.", False),
    Key("sharing.timeSlicing.renameByDefault", "boolean", "Entries without `rename` advertise "
        "`<name>.shared`.", False),
    Key("sharing.timeSlicing.resources", "list", "Resources advertised as replicas; each entry has the keys "
        "below.", []),
    Key("sharing.timeSlicing.resources[].name", "resource name", "A resource the MIG strategy produces "
        "(required).", None),
    Key("sharing.timeSlicing.resources[].replicas", "integer", "Replicas per device: IDs `<id>::0` .. "
        "`<id>::N-1` (required).", None),
    Key("sharing.timeSlicing.resources[].rename", "resource name", "Advertise the replicas under this name.", None),
    Key("sharing.timeSlicing.resources[].devices", "`all`, a count or a list", "Which devices are shared: all, "
        "the first N, or GPU indices / UUIDs.", "all"),
    Key("sharing.timeSlicing.resources[].failRequestsGreaterThanOne", "boolean", "Refuse Allocate of more than "
        "one replica of this resource.", "`timeSlicing.failRequestsGreaterThanOne`"),
)
