"""The quarantine rules: from one Node's facts, whether it should be out of service, why, and whether it is fit to
come back. Pure: no clock, no API; the reconciler supplies both (and times the recovery hold itself).

Rules, each naming its reason code (the taint's value):

- ``reboot-required``: some device's recommended action is ``reboot-node`` (checked first: the heaviest remedy);
- ``gpu-missing``: the agent says the node itself is short of a GPU (one on the PCI bus that NVML does not list,
  or fewer than expected); the reconciler applies it only once the node has said so for ``gpu_missing_grace_s`` on
  the controller's clock, since a GPU reset takes a GPU out of NVML for a moment;
- ``unhealthy-devices``: the count of GPUs with an Unhealthy device reaches ``unhealthy_devices``, or their share
  of the node's GPUs reaches ``unhealthy_fraction``;
- ``capacity-gap``: for a node without our annotations (the stock device plugin), capacity minus allocatable of
  the ``nvidia.com/gpu*`` resources reaches ``capacity_gap``, the gap the kubelet opens for devices reported
  unhealthy.

A node on which no GPU can be seen (no device entries and no GPU capacity) is never fit: releasing it would be a
guess. Nor is a node whose agent wrote a value no agent writes (past the codec's bounds): no rule fires for it
either, so such a value neither quarantines a node nor releases one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plugin.controller.nodes import HEALTHY_STATES, Device, NodeFacts
from plugin.health.reasons import Action, State

REBOOT_REQUIRED = "reboot-required"
GPU_MISSING = "gpu-missing"
UNHEALTHY_DEVICES = "unhealthy-devices"
CAPACITY_GAP = "capacity-gap"
REASON_CODES = (REBOOT_REQUIRED, GPU_MISSING, UNHEALTHY_DEVICES, CAPACITY_GAP)


@dataclass(frozen=True)
class Rules:
    unhealthy_devices: int = 1  # 0: off
    unhealthy_fraction: float = 0.0  # 0: off
    reboot_required: bool = True
    capacity_gap: int = 1  # 0: off
    gpu_missing: bool = True


@dataclass(frozen=True, slots=True)
class Assessment:
    reason: str | None  # the first rule that fires, None when none does
    message: str
    fit: bool  # fit to be released: no rule fires, no device is Unhealthy or Unknown, and GPUs can be seen


def assess(f: NodeFacts, rules: Rules) -> Assessment:
    if f.unreadable:
        return Assessment(None, f"annotations unreadable: {f.unreadable}", False)
    if f.annotated:
        return _annotated(f, rules)
    if f.gpu_capacity <= 0:
        # The device plugin went away (or the node was never a GPU node): a node whose GPUs nobody can see is not
        # known to be fit, so a quarantine of it holds.
        return Assessment(None, "no GPUs visible (no nvidia.com/gpu* capacity)", False)
    gap = max(0, f.gpu_capacity - f.gpu_allocatable)
    if rules.capacity_gap and gap >= rules.capacity_gap:
        return Assessment(CAPACITY_GAP, f"{gap} of {f.gpu_capacity} GPUs not allocatable (capacity minus "
                                        f"allocatable, threshold {rules.capacity_gap})", False)
    return Assessment(None, f"{f.gpu_allocatable} of {f.gpu_capacity} GPUs allocatable", True)


def _annotated(f: NodeFacts, rules: Rules) -> Assessment:
    if rules.reboot_required:
        asking = [d for d in f.devices if d.action == Action.REBOOT_NODE and d.state != State.HEALTHY]
        if asking:
            return Assessment(REBOOT_REQUIRED, "reboot-node asked for by " + _list(asking), False)
    if rules.gpu_missing and GPU_MISSING in f.node_codes:
        return Assessment(GPU_MISSING, "the node agent finds a GPU missing from NVML (reboot-node)", False)
    bad = [d for d in f.devices if d.state == State.UNHEALTHY]
    bad_gpus = len({d.gpu for d in bad})
    # An unknown total (an older agent's truncated entries) leaves the share rule out rather than guess it.
    total = None if f.device_total is None else max(f.device_total, bad_gpus)
    fired = (rules.unhealthy_devices and bad_gpus >= rules.unhealthy_devices) or (
        rules.unhealthy_fraction and total and bad_gpus / total >= rules.unhealthy_fraction)
    if bad_gpus and fired:
        of = "an unknown number of" if total is None else total
        return Assessment(UNHEALTHY_DEVICES, f"{bad_gpus} of {of} GPUs Unhealthy: " + _list(bad), False)
    # Fit needs GPUs to be seen at all: device entries, or a capacity (the agent may have withdrawn every entry).
    visible = bool(f.devices) or f.gpu_capacity > 0
    fit = (visible and f.node_state in HEALTHY_STATES and not bad and not f.node_codes
           and all(d.state in HEALTHY_STATES for d in f.devices))
    # No "fit since" from the devices' own `since`: that is the agent's word, and the agent's account can write
    # it; the recovery hold runs on the controller's clock from when it first saw the node fit.
    return Assessment(None, f"node state {f.node_state or 'unset'}, {len(bad)} Unhealthy devices", fit)


def _list(devices: Sequence[Device], limit: int = 3) -> str:
    shown = ", ".join(f"{d.key} {d.code or d.state}" for d in devices[:limit])
    return shown + (f" (+{len(devices) - limit} more)" if len(devices) > limit else "")
