"""The node's ResourceSlice (resource.k8s.io/v1) in DRA mode, with device taints from health, as pure functions.

No I/O and no clock, like ``annotations.py``: the writer hands in the node's devices with the status of each and
the settings, and gets back the whole object it wants on the server, then asks whether the server's copy already
says that (``slice_changed``), which pool generation to write (``next_generation``) and the body of the write
(``update_body``). The same inputs give the same bytes, so an unchanged node is never written.

One slice per node, one pool per slice. What a device is comes from one place, ``published_devices`` (over
``slice_devices``): with ``--mig-strategy none`` every GPU is one device, whole, even one in MIG mode; with ``mixed``
a GPU that has MIG instances is published as one device per instance instead (named ``gpu-<index>-mig-<gi>-<ci>``),
the others whole. Each device's ``type`` attribute (``gpu`` or ``mig``) tells DeviceClasses which is which.
The slice, Prepare (plugin/dra/driver.py) and the health stream (plugin/dra/health.py) all name and judge devices
through it, so a name means the same device everywhere. An instance's status is its own DeviceStatus, which already
carries its parent GPU's faults, so the parent's taint reaches every instance. ``single`` has no DRA meaning (a
claim selects an instance by its ``profile`` attribute) and is refused.

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
from dataclasses import dataclass, field
from typing import Any

from plugin.devices.model import Gpu, MigDevice
from plugin.dra import shares
from plugin.health.node_state import DeviceStatus
from plugin.health.reasons import KubeletHealth, State
from plugin.kube.events import rfc3339
from plugin.kube.names import COMPONENT, DEFAULT_PREFIX
from plugin.sharing.config import SharingConfig
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

# The MIG strategies DRA mode publishes under; device-plugin mode's ``single`` merges instances into one resource,
# which a DRA claim has no need of: it selects instances by their attributes.
MIG_STRATEGIES = ("none", "mixed")
# The ``type`` attribute: what a DeviceClass selects on to hand out whole GPUs or MIG instances.
TYPE_GPU = "gpu"
TYPE_MIG = "mig"

_INDEX_NAME_RE = re.compile(r"gpu-\d+")
_MIG_NAME_RE = re.compile(r"gpu-\d+-mig-\d+-\d+")
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
    mig_strategy: str = "none"  # one of MIG_STRATEGIES: whether GPUs with MIG instances are published as those
    # The sharing section's time-slicing entries (plugin/dra/shares.py): devices they select take that many claims
    # at once. ``resource_name`` is what the entries call whole GPUs (their MIG instances: <domain>/mig-<profile>).
    sharing: SharingConfig = field(default_factory=SharingConfig)
    resource_name: str = "nvidia.com/gpu"
    # False once the writer has seen the API server drop allowMultipleAllocations (the DRAConsumableCapacity gate
    # off): as with taints, asking again would differ from the stored copy forever; devices are then published
    # plain, one claim each.
    consumable: bool = True

    def __post_init__(self) -> None:
        check_mig_strategy(self.mig_strategy)
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


def check_mig_strategy(value: str) -> None:
    """``FieldError`` naming ``mig_strategy`` unless DRA mode publishes under ``value``."""
    if value == "single":
        raise FieldError("mig_strategy", "single is device-plugin mode's; in DRA mode use mixed: every MIG instance "
                                         "is a device of its own and a claim selects instances by their profile "
                                         "attribute")
    if value not in MIG_STRATEGIES:
        raise FieldError("mig_strategy", f"expected one of {', '.join(MIG_STRATEGIES)}, got {value!r}")


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


def mig_device_name(gpu: Gpu, mig: MigDevice) -> str:
    """``gpu-3-mig-9-0``: the parent's index name, then the GPU instance and the compute instance, as nvidia-smi
    numbers them: a DNS label that says which GPU an instance is on, and stable while the layout stays."""
    return f"{device_name(gpu)}-mig-{mig.gpu_instance_id}-{mig.compute_instance_id}"


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


@dataclass(frozen=True)
class PublishedDevice:
    """One device of the node's slice: a whole GPU, or under ``mixed`` one MIG instance of a GPU. The unit the slice,
    Prepare and the health stream share (``published_devices``), so a name means the same device in all three."""

    name: str
    gpu: Gpu  # the physical GPU: an instance's parent
    mig: MigDevice | None = None  # set for a MIG instance
    # The device's own status (an instance's already carries its parent's faults); None: no verdict yet.
    status: DeviceStatus | None = None

    @property
    def is_mig(self) -> bool:
        return self.mig is not None

    @property
    def uuid(self) -> str:
        """What NVIDIA_VISIBLE_DEVICES names: an instance's MIG UUID, else the GPU's."""
        return self.mig.uuid if self.mig is not None else self.gpu.uuid

    @property
    def type(self) -> str:
        return TYPE_MIG if self.mig is not None else TYPE_GPU

    @property
    def memory_mib(self) -> int:
        return self.mig.memory_mib if self.mig is not None else self.gpu.memory_mib


def device_statuses(devices: Iterable[DeviceStatus]) -> dict[str, DeviceStatus]:
    """Device UUID (a GPU's, or a MIG instance's) -> its status, from a snapshot's devices."""
    return {d.mig.uuid if d.mig is not None else d.gpu.uuid: d for d in devices}


def slice_devices(gpus: Iterable[Gpu], statuses: Mapping[str, DeviceStatus],
                  mig_strategy: str = "none") -> list[PublishedDevice]:
    """Every device ``gpus`` are published as, in slice order (GPU index, then GPU and compute instance), whether
    the slice lists it now or not (``device_plan`` decides that): each GPU whole, or under ``mixed`` a GPU with MIG
    instances as those instances instead. ``statuses`` by device UUID; an instance without a status of its own
    takes its parent's, so a fault of the GPU never goes missing with an entry.

    Names are computed over all of them, so a device leaving the slice moves no other's name. An instance name that
    would clash (two instances with the same ids: a broken discovery) or does not rest on its parent's index name
    falls back to a hash of its MIG UUID, as ``device_names`` does for GPUs."""
    check_mig_strategy(mig_strategy)
    gs = sorted(gpus, key=lambda g: (g.index, g.uuid))
    names = device_names(gs)
    wanted: list[tuple[Gpu, MigDevice | None, str]] = []
    for g in gs:
        if mig_strategy == "mixed" and g.mig_devices:
            # A parent named by a hash (its index clashes) would give its instances ambiguous names: hash them too.
            by_index = _INDEX_NAME_RE.fullmatch(names[g.uuid]) is not None
            for m in sorted(g.mig_devices, key=lambda m: (m.gpu_instance_id, m.compute_instance_id, m.uuid)):
                wanted.append((g, m, mig_device_name(g, m) if by_index else ""))
        else:
            wanted.append((g, None, names[g.uuid]))
    counts: dict[str, int] = {}
    for _, mig, name in wanted:
        if mig is not None:
            counts[name] = counts.get(name, 0) + 1
    out: list[PublishedDevice] = []
    for g, mig, name in wanted:
        if mig is None:
            out.append(PublishedDevice(name, g, None, statuses.get(g.uuid)))
            continue
        if counts[name] != 1 or not _MIG_NAME_RE.fullmatch(name) or len(name) > LABEL_MAX:
            name = hashed_name(mig.uuid)
        own = statuses.get(mig.uuid)
        out.append(PublishedDevice(name, g, mig, own if own is not None else statuses.get(g.uuid)))
    return out


def published_devices(devices: Iterable[DeviceStatus], mig_strategy: str = "none") -> list[PublishedDevice]:
    """The node's published devices from a snapshot's devices (``slice_devices`` of its whole GPUs, with every
    status): what the slice writer publishes, Prepare looks a claim's device up in, and the health stream reports."""
    ds = list(devices)
    return slice_devices([d.gpu for d in ds if d.mig is None], device_statuses(ds), mig_strategy)


def device_attributes(device: PublishedDevice, island: int, domain: str) -> dict[str, dict[str, Any]]:
    """An instance carries its parent's index (an index selector picks a GPU's instances), its own ids and profile,
    and the parent's product and topology: it is where the parent is."""
    g, m = device.gpu, device.mig
    attrs: dict[str, dict[str, Any]] = {f"{domain}/uuid": _string(device.uuid),
                                        f"{domain}/type": _string(device.type),
                                        f"{domain}/index": {"int": g.index}}
    if m is not None:
        attrs[f"{domain}/parentUUID"] = _string(g.uuid)
        if m.profile:
            attrs[f"{domain}/profile"] = _string(m.profile)
        attrs[f"{domain}/gpuInstance"] = {"int": m.gpu_instance_id}
        attrs[f"{domain}/computeInstance"] = {"int": m.compute_instance_id}
    if g.name:
        attrs[f"{domain}/productName"] = _string(g.name)
    if g.numa_node is not None:
        attrs[f"{domain}/numaNode"] = {"int": g.numa_node}
    attrs[f"{domain}/nvlinkIsland"] = {"int": island}
    if g.pcie_switch:
        attrs[f"{domain}/pcieSwitch"] = _string(g.pcie_switch)
    if g.pci_bus_id:
        attrs[f"{domain}/pciBusID"] = _string(g.pci_bus_id)
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


def slice_device(device: PublishedDevice, island: int, plan: DevicePlan, domain: str) -> dict[str, Any]:
    """One device of the slice as the API takes it, from what ``device_plan`` says of it. Whatever else a device
    comes to carry belongs here, so every device gets it the same way."""
    entry: dict[str, Any] = {"name": device.name, "attributes": device_attributes(device, island, domain)}
    if device.memory_mib > 0:  # no reading: no capacity rather than a zero one
        entry["capacity"] = {f"{domain}/memory": {"value": memory_quantity(device.memory_mib)}}
    if plan.taint is not None:
        entry["taints"] = [plan.taint]
    return entry


def _shareable(device: PublishedDevice, resource_name: str) -> shares.Shareable:
    m = device.mig
    return shares.Shareable(device.name, shares.resource_of(resource_name, m.profile if m is not None else None),
                            device.gpu.index, (device.gpu.uuid,) if m is None else (device.gpu.uuid, m.uuid))


def resource_slice(devices: Sequence[PublishedDevice], settings: SliceSettings,
                   generation: int = 1) -> dict[str, Any]:
    """The whole ResourceSlice of ``devices`` (as ``published_devices`` gives them), at pool ``generation``: each
    device as ``device_plan`` says, those it leaves out left out, in the order given."""
    if len(devices) > MAX_DEVICES:
        migs = sum(1 for d in devices if d.is_mig)
        raise ValueError(f"{len(devices)} devices ({len(devices) - migs} whole GPUs, {migs} MIG instances): a "
                         f"ResourceSlice with device taints holds at most {MAX_DEVICES}")
    parents = {d.gpu.uuid: d.gpu for d in devices}
    islands = nvlink_islands(parents.values())
    # Selected among all devices, listed now or not, so a device leaving the slice moves no other's share.
    shared = shares.replicas([_shareable(d, settings.resource_name) for d in devices], settings.sharing) \
        if settings.consumable else {}
    out: list[dict[str, Any]] = []
    for d in devices:
        plan = device_plan(d.status, settings)
        if not plan.listed:
            continue  # named among all devices all the same, so no other device's name moves meanwhile
        entry = slice_device(d, islands[d.gpu.index], plan, settings.driver)
        if d.name in shared:
            shares.share(entry, shared[d.name], settings.driver)
        out.append(entry)
    metadata: dict[str, Any] = {"name": slice_name(settings), "labels": {MANAGED_BY: COMPONENT}}
    if settings.node_uid:
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": settings.node_name,
                                        "uid": settings.node_uid, "controller": True}]
    spec: dict[str, Any] = {
        "driver": settings.driver,
        "nodeName": settings.node_name,
        "pool": {"name": settings.pool_name, "generation": generation, "resourceSliceCount": 1},
    }
    if out:
        spec["devices"] = out
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec}


def desired_slice(gpus: Sequence[Gpu], statuses: Mapping[str, DeviceStatus], settings: SliceSettings,
                  generation: int = 1) -> dict[str, Any]:
    """The whole ResourceSlice for ``gpus`` (``statuses`` by device UUID, a GPU's or a MIG instance's) under
    ``settings.mig_strategy``. Devices are in index order whatever the discovery order, so the same node gives the
    same bytes."""
    return resource_slice(slice_devices(gpus, statuses, settings.mig_strategy), settings, generation)


# Comparing with the server's copy -----------------------------------------------------------------------------

def _pool_content(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The spec without the pool generation: what a consumer allocates from. A shallow copy: it is only compared,
    and a deep one of a 56-device slice cost more than building the slice (bench/bench_dra_mig.py)."""
    spec = dict(obj.get("spec") or {})
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
