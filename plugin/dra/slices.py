"""The node's ResourceSlice (resource.k8s.io/v1) in DRA mode, with device taints from health, as pure functions.

No I/O and no clock, like ``annotations.py``: the writer hands in the GPUs, the status of each and the settings,
and gets back the whole object it wants on the server, then asks whether the server's copy already says that
(``slice_changed``), which pool generation to write (``next_generation``) and the body of the write
(``update_body``). The same inputs give the same bytes, so an unchanged node is never written.

One slice per node, one pool per slice, one device per whole GPU. MIG devices are out of scope for now: every GPU
is published whole, as ``--mig-strategy none`` advertises it to the kubelet.

Attributes are written fully qualified under the driver's domain (``gpu.gpu-health.io/uuid``). A bare name would
mean the same to the scheduler (bare names are taken as the driver's domain), but a claim's ``matchAttribute`` and
``distinctAttribute`` must be fully qualified, so the slice shows exactly the names a user writes there.

Taints, at most one per device (a device has one state), keyed by the state: ``<prefix>/unhealthy``,
``<prefix>/unknown`` or ``<prefix>/degraded``, the value the top reason code. A key per state lets a claim tolerate
one state, say Unknown, without tolerating a known fault. The effect follows the device's kubelet health (the
``health.kubeletHealth`` mapping): a device the mapping keeps from pods gets an effect that keeps claims off
(``unhealthy_effect``, ``unknown_effect``, NoSchedule for Degraded); one it lets pods use gets effect ``None``,
which only informs. A Healthy device, or one without a status yet, has none.

Allocatable ⇔ preparable: ``device_plan`` is the one decision of what the slice says about a device (in it or not,
and its taint), and ``allocatable`` applies the scheduler's rule to that plan and a claim's tolerations. The slice
is built from the plan and NodePrepareResources prepares a device exactly when ``allocatable`` says the scheduler
may hand it to that claim, so a claim can never be allocated a device the driver then refuses. Without device
taints on the cluster (``SliceSettings.taints`` off) the only way to keep a claim off a device is to leave it out
of the slice, so a device the mapping keeps from pods is left out until it recovers.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plugin.devices.model import Gpu
from plugin.health.node_state import DeviceStatus
from plugin.health.reasons import KubeletHealth, State
from plugin.kube.events import rfc3339
from plugin.kube.names import COMPONENT, DEFAULT_PREFIX
from plugin.validation import FieldError, check_prefix, is_dns_subdomain

DRIVER = "gpu.gpu-health.io"
API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
MANAGED_BY = "app.kubernetes.io/managed-by"

# Limits of resource.k8s.io/v1 (k8s.io/api resource/v1 types.go and the API server's validation).
MAX_DEVICES = 64  # ResourceSliceMaxDevicesWithAdvancedFeatures: 128 unless any device has taints
MAX_ATTRIBUTES = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice, attributes and capacities together
STRING_MAX = 64  # DeviceAttributeMaxValueLength, in bytes
DRIVER_MAX = 63  # a CSI driver name; also the longest domain of a qualified attribute name
NAME_MAX = 253  # metadata.name (a DNS subdomain) and the pool name
LABEL_MAX = 63  # a DNS label (a device name) and a label value (a taint value)

EFFECT_NONE = "None"
# The effects that keep a claim off a device it does not tolerate; a setting chooses one of them. Any other effect
# (None, or one added to the API later) only informs: the API tells consumers to treat an unknown one like None.
TAINT_EFFECTS = ("NoSchedule", "NoExecute")
UNHEALTHY_KEY = "unhealthy"
UNKNOWN_KEY = "unknown"
DEGRADED_KEY = "degraded"

_INDEX_NAME_RE = re.compile(r"gpu-\d+")
_NOT_LABEL_VALUE_RE = re.compile(r"[^A-Za-z0-9._-]")
_EDGE = "-._"  # allowed inside a label value, not at either end


@dataclass(frozen=True)
class SliceSettings:
    """What shapes the slice besides the devices. Invalid values raise ``FieldError`` naming the field."""

    node_name: str
    driver: str = DRIVER
    pool: str = ""  # empty: the node name, as node-local drivers usually name their pool
    taint_prefix: str = DEFAULT_PREFIX
    unhealthy_effect: str = "NoSchedule"  # NoExecute evicts the pods already using the device
    # Not knowing is no evidence of a fault: NoExecute here would evict on an NVML hiccup, so it is a choice of
    # its own and not tied to unhealthy_effect.
    unknown_effect: str = "NoSchedule"
    degraded_taint: bool = True
    # False once the writer has seen the API server drop the taints it sent (the DRADeviceTaints gate off): the
    # slice must then stop asking for them, or every comparison with the stored copy would differ, and leaves out
    # the devices a taint would have kept claims off (``device_plan``).
    taints: bool = True
    node_uid: str = ""  # when known, the Node owns the slice, so deleting the node deletes it

    def __post_init__(self) -> None:
        if not self.node_name or not is_dns_subdomain(self.node_name):
            raise FieldError("node_name", f"expected a node name (a lower-case DNS subdomain), got {self.node_name!r}")
        if len(self.driver) > DRIVER_MAX or not is_dns_subdomain(self.driver):
            raise FieldError("driver", f"expected a lower-case DNS subdomain of at most {DRIVER_MAX} characters, "
                                       f"got {self.driver!r}")
        if len(self.pool_name) > NAME_MAX or not all(is_dns_subdomain(p) for p in self.pool_name.split("/")):
            raise FieldError("pool", f"expected DNS subdomains joined by '/', at most {NAME_MAX} characters, "
                                     f"got {self.pool!r}")
        try:
            check_prefix(self.taint_prefix)
        except ValueError as exc:
            raise FieldError("taint_prefix", str(exc)) from None
        for name in ("unhealthy_effect", "unknown_effect"):
            value = getattr(self, name)
            if value not in TAINT_EFFECTS:
                raise FieldError(name, f"expected one of {', '.join(TAINT_EFFECTS)}, got {value!r}")

    @property
    def pool_name(self) -> str:
        return self.pool or self.node_name


# Names --------------------------------------------------------------------------------------------------------

def device_name(gpu: Gpu) -> str:
    """``gpu-3``: the index, as nvidia-smi and the annotations number GPUs. Not the UUID: a device name must be a
    DNS label (lower case, at most 63), which ``GPU-5a1e...`` is not as written, and the name is what claim
    statuses and ``kubectl`` show, where ``gpu-3`` reads better. The UUID is an attribute."""
    return f"gpu-{gpu.index}"


def hashed_name(uuid: str) -> str:
    return "dev-" + hashlib.sha256(uuid.encode()).hexdigest()[:16]


def device_names(gpus: Iterable[Gpu]) -> dict[str, str]:
    """UUID -> device name. Where two GPUs would share an index name (a broken discovery) or the index is not a
    plain number, both fall back to a hash of the UUID: still a DNS label, still stable across restarts."""
    gs = list(gpus)
    wanted = {g.uuid: device_name(g) for g in gs}
    counts: dict[str, int] = {}
    for name in wanted.values():
        counts[name] = counts.get(name, 0) + 1
    return {uuid: name if counts[name] == 1 and _INDEX_NAME_RE.fullmatch(name) else hashed_name(uuid)
            for uuid, name in wanted.items()}


def slice_name(settings: SliceSettings) -> str:
    """``<node>-<driver>``: fixed, so the writer reads and replaces its slice by name instead of listing. A node
    name near the 253-character limit is cut and a hash of the whole name keeps it unique."""
    name = f"{settings.node_name}-{settings.driver}"
    if len(name) <= NAME_MAX:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return name[:NAME_MAX - len(digest) - 1].rstrip("-.") + "-" + digest


def taint_value(code: str) -> str:
    """A reason code as a label value: characters outside ``[A-Za-z0-9._-]`` become ``-``, the ends are
    alphanumeric, and a value over 63 characters keeps its start and ends in a hash of the whole code, so two long
    codes with one start stay apart. Reason codes already fit; this keeps the write valid if one ever does not."""
    v = _NOT_LABEL_VALUE_RE.sub("-", code).strip(_EDGE)
    if len(v) > LABEL_MAX:
        digest = hashlib.sha256(code.encode()).hexdigest()[:8]
        v = v[:LABEL_MAX - len(digest) - 1].rstrip(_EDGE) + "-" + digest
    return v


# Devices ------------------------------------------------------------------------------------------------------

def nvlink_islands(gpus: Iterable[Gpu]) -> dict[int, int]:
    """GPU index -> its NVLink island: the lowest index among the GPUs it reaches over NVLink, itself included. A
    link counts from either end, and a peer not on this node is ignored, so a GPU with no peers is its own island."""
    gs = list(gpus)
    parent = {g.index: g.index for g in gs}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for g in gs:
        for p in g.nvlink_peers:
            if p in parent:
                a, b = root(g.index), root(p)
                parent[max(a, b)] = min(a, b)
    return {i: root(i) for i in parent}


def _string(value: str) -> dict[str, str]:
    return {"string": value.encode()[:STRING_MAX].decode(errors="ignore")}


def memory_quantity(mib: int) -> str:
    """MiB as the API server writes the quantity back: the largest binary suffix that keeps it whole (81920 MiB is
    ``80Gi``). Writing it any other way would differ from the stored copy on every comparison."""
    suffixes = ("Mi", "Gi", "Ti", "Pi", "Ei")
    step = 0
    while mib % 1024 == 0 and step < len(suffixes) - 1:
        mib //= 1024
        step += 1
    return f"{mib}{suffixes[step]}"


def device_attributes(gpu: Gpu, island: int, domain: str) -> dict[str, dict[str, Any]]:
    attrs: dict[str, dict[str, Any]] = {f"{domain}/uuid": _string(gpu.uuid), f"{domain}/index": {"int": gpu.index}}
    if gpu.name:
        attrs[f"{domain}/productName"] = _string(gpu.name)
    if gpu.numa_node is not None:
        attrs[f"{domain}/numaNode"] = {"int": gpu.numa_node}
    attrs[f"{domain}/nvlinkIsland"] = {"int": island}
    if gpu.pcie_switch:
        attrs[f"{domain}/pcieSwitch"] = _string(gpu.pcie_switch)
    if gpu.pci_bus_id:
        attrs[f"{domain}/pciBusID"] = _string(gpu.pci_bus_id)
    return attrs


@dataclass(frozen=True)
class DevicePlan:
    """What the slice says about one device: whether it is in the slice, and its taint (None: none)."""

    listed: bool
    taint: dict[str, str] | None = None


_KEYS = {State.UNHEALTHY: UNHEALTHY_KEY, State.UNKNOWN: UNKNOWN_KEY, State.DEGRADED: DEGRADED_KEY}


def _blocking_effect(state: State, settings: SliceSettings) -> str:
    if state is State.UNHEALTHY:
        return settings.unhealthy_effect
    if state is State.UNKNOWN:
        return settings.unknown_effect
    # A Degraded device the mapping keeps from pods still works: keep new claims off, evict no one for it.
    return "NoSchedule"


def device_plan(status: DeviceStatus | None, settings: SliceSettings) -> DevicePlan:
    """The one decision both the slice and Prepare read (see the module's docstring). A device the kubelet health
    mapping lets pods use is listed with at most an informing taint; one it keeps from pods carries a taint that
    keeps untolerating claims off, or, with taints off on the cluster, is not listed at all."""
    if status is None or status.state is State.HEALTHY:
        return DevicePlan(listed=True)
    usable = status.kubelet_health is KubeletHealth.HEALTHY
    if not settings.taints:
        # Nothing but absence keeps a claim off a device the cluster will not let us taint.
        return DevicePlan(listed=usable)
    if usable:
        if status.state is State.DEGRADED and not settings.degraded_taint:
            return DevicePlan(listed=True)
        effect = EFFECT_NONE
    else:
        effect = _blocking_effect(status.state, settings)
    return DevicePlan(listed=True, taint=_taint(_KEYS[status.state], effect, status, settings))


def _taint(key: str, effect: str, status: DeviceStatus, settings: SliceSettings) -> dict[str, str]:
    """``timeAdded`` is when the device entered its state: the API server would stamp the current time on a
    taint without one, and then the stored copy never matches ours. A change of reason within one state keeps the
    time, as the API documents for a changed value."""
    taint = {"key": f"{settings.taint_prefix}/{key}"}
    top = status.reasons
    value = taint_value(top[0].code) if top else ""
    if value:
        taint["value"] = value
    taint["effect"] = effect
    taint["timeAdded"] = rfc3339(status.since)
    return taint


def device_taint(status: DeviceStatus | None, settings: SliceSettings) -> dict[str, str] | None:
    """The one taint a device's state asks for, or None."""
    return device_plan(status, settings).taint


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """The scheduler's rule (resource.k8s.io/v1 DeviceToleration): an empty key matches every key, an empty
    effect every effect; operator Exists matches any value, Equal (the default) only the taint's own."""
    key, effect = toleration.get("key") or "", toleration.get("effect") or ""
    if (key and key != taint.get("key")) or (effect and effect != taint.get("effect")):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return operator == "Equal" and (toleration.get("value") or "") == (taint.get("value") or "")


def allocatable(status: DeviceStatus | None, settings: SliceSettings,
                tolerations: Iterable[Mapping[str, Any]] = ()) -> bool:
    """Whether the scheduler may hand this device, as ``device_plan`` publishes it, to a request with these
    tolerations: listed, and untainted, informingly tainted, or tolerated. Prepare asks exactly this."""
    plan = device_plan(status, settings)
    if not plan.listed:
        return False
    taint = plan.taint
    return taint is None or taint["effect"] not in TAINT_EFFECTS or any(tolerates(t, taint) for t in tolerations)


def gpu_statuses(devices: Iterable[DeviceStatus]) -> dict[str, DeviceStatus]:
    """GPU UUID -> status of the whole GPU, from a snapshot's devices; MIG devices are left out with the rest of
    MIG here."""
    return {d.gpu.uuid: d for d in devices if d.mig is None}


def desired_slice(gpus: Sequence[Gpu], statuses: Mapping[str, DeviceStatus], settings: SliceSettings,
                  generation: int = 1) -> dict[str, Any]:
    """The whole ResourceSlice for ``gpus`` (``statuses`` by GPU UUID), at pool ``generation``: each device as
    ``device_plan`` says, those it leaves out left out. Devices are in index order whatever the discovery order, so
    the same node gives the same bytes."""
    if len(gpus) > MAX_DEVICES:
        raise ValueError(f"{len(gpus)} GPUs: a ResourceSlice with device taints holds at most {MAX_DEVICES}")
    names = device_names(gpus)
    islands = nvlink_islands(gpus)
    devices: list[dict[str, Any]] = []
    for g in sorted(gpus, key=lambda g: (g.index, g.uuid)):
        plan = device_plan(statuses.get(g.uuid), settings)
        if not plan.listed:
            continue  # named among all GPUs above all the same, so no other device's name moves meanwhile
        device: dict[str, Any] = {"name": names[g.uuid],
                                  "attributes": device_attributes(g, islands[g.index], settings.driver)}
        if g.memory_mib > 0:
            device["capacity"] = {f"{settings.driver}/memory": {"value": memory_quantity(g.memory_mib)}}
        if plan.taint is not None:
            device["taints"] = [plan.taint]
        devices.append(device)
    metadata: dict[str, Any] = {"name": slice_name(settings), "labels": {MANAGED_BY: COMPONENT}}
    if settings.node_uid:
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": settings.node_name,
                                        "uid": settings.node_uid, "controller": True}]
    spec: dict[str, Any] = {
        "driver": settings.driver,
        "nodeName": settings.node_name,
        "pool": {"name": settings.pool_name, "generation": generation, "resourceSliceCount": 1},
    }
    if devices:
        spec["devices"] = devices
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec}


# Comparing with the server's copy -----------------------------------------------------------------------------

def _pool_content(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The spec without the pool generation: what a consumer allocates from."""
    spec = copy.deepcopy(dict(obj.get("spec") or {}))
    pool = dict(spec.get("pool") or {})
    pool.pop("generation", None)
    spec["pool"] = pool
    spec.setdefault("devices", [])
    return spec


def _ours(obj: Mapping[str, Any], desired: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """The metadata ``desired`` sets: its labels as ``obj`` has them, and the owner when desired names one."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    wanted = desired.get("metadata") or {}
    keys = wanted.get("labels") or {}
    owners = meta.get("ownerReferences") if "ownerReferences" in wanted else None
    return {k: labels.get(k) for k in keys}, owners


def next_generation(current: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> int:
    """The pool generation to write. The API's rule (ResourcePool.Generation): whenever a driver changes anything
    about a resource in the pool it must change the generation. A device's taints are part of the device, so a
    taint change bumps it too; only our labels or owner changing does not. No current slice: desired's own."""
    if current is None:
        return int(desired["spec"]["pool"]["generation"])
    generation = int((current.get("spec") or {}).get("pool", {}).get("generation", 0))
    return generation if _pool_content(current) == _pool_content(desired) else generation + 1


def slice_changed(current: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    """Whether the server's copy differs from ``desired`` in what we write: the spec (the generation aside: that
    follows from the rest) and our labels and owner. Server fields (resourceVersion, uid, managedFields,
    creationTimestamp, metadata.generation) and other writers' labels are not looked at."""
    if current is None:
        return True
    return (_pool_content(current) != _pool_content(desired)
            or _ours(current, desired) != _ours(desired, desired))


def must_recreate(current: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """The driver, node and pool name of a slice are immutable: an update changing one is refused, so the writer
    deletes the slice and creates it anew."""
    cur, want = current.get("spec") or {}, desired["spec"]
    return (cur.get("driver"), cur.get("nodeName"), (cur.get("pool") or {}).get("name")) != \
        (want["driver"], want["nodeName"], want["pool"]["name"])


def update_body(current: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> dict[str, Any] | None:
    """What to send: None when the server already has it; ``desired`` to create when there is no slice; else a
    replacement at the next generation, carrying the current resourceVersion (a 409 means re-read) and keeping
    the labels and annotations other writers put on the slice."""
    if not slice_changed(current, desired):
        return None
    body = copy.deepcopy(dict(desired))
    if current is None:
        return body
    body["spec"]["pool"]["generation"] = next_generation(current, desired)
    meta = current.get("metadata") or {}
    labels = {**(meta.get("labels") or {}), **(body["metadata"].get("labels") or {})}
    if labels:
        body["metadata"]["labels"] = labels
    if meta.get("annotations"):
        body["metadata"]["annotations"] = dict(meta["annotations"])
    if "ownerReferences" not in body["metadata"] and meta.get("ownerReferences"):
        body["metadata"]["ownerReferences"] = list(meta["ownerReferences"])
    if meta.get("resourceVersion"):
        body["metadata"]["resourceVersion"] = meta["resourceVersion"]
    return body


def taints_dropped(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    """Whether the API server dropped every taint we sent: it does so while the DRADeviceTaints gate is off. The
    writer then logs it once and turns ``SliceSettings.taints`` off, which leaves out of the slice the devices the
    taints kept claims off; the health stream carries the reasons."""
    def count(obj: Mapping[str, Any]) -> int:
        return sum(len(d.get("taints") or ()) for d in (obj.get("spec") or {}).get("devices") or ())
    return count(sent) > 0 and count(stored) == 0
