"""The ``sharing`` section of the config file: parsing and validation (pure, no I/O). ``docs/sharing.md`` is the
reference; plugin/kubelet/resources.py turns the result into the resources the supervisor serves.

    sharing:
      timeSlicing:
        allocationPolicy: distributed      # or packed: how GetPreferredAllocation picks replicas
        failRequestsGreaterThanOne: false  # default for every entry
        renameByDefault: false             # true: entries without rename advertise <name>.shared
        resources:
        - name: nvidia.com/gpu             # a resource the MIG strategy produces
          replicas: 4                      # each selected device is advertised as <id>::0 .. <id>::3
          rename: nvidia.com/gpu.shared    # optional: advertise the replicas under this name instead
          devices: all                     # all | a count (the first N) | a list of GPU indices / UUIDs
          failRequestsGreaterThanOne: true # optional: Allocate of more than one replica is refused
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plugin.sharing.model import Selection, mig_prefix
from plugin.validation import FieldError, is_extended_resource_name

MIG_STRATEGIES = ("none", "single", "mixed")
POLICIES = ("distributed", "packed")
MAX_REPLICAS = 1024  # per device; beyond this a ListAndWatch message on a large node nears gRPC's 4 MiB default

# A bad value in the sharing section, its ``field`` the path (``sharing.timeSlicing.resources[0].replicas``): the
# one error type of every config section, so the loader passes it on as it is.
SharingError = FieldError


@dataclass(frozen=True)
class TimeSlicedResource:
    name: str
    replicas: int
    rename: str | None = None
    devices: Selection = field(default_factory=Selection)
    fail_requests_greater_than_one: bool = False
    where: str = ""  # the entry's path in the file, for messages at run time

    @property
    def advertised_as(self) -> str:
        return self.rename or self.name


@dataclass(frozen=True)
class SharingConfig:
    resources: tuple[TimeSlicedResource, ...] = ()
    policy: str = "distributed"

    def effective(self) -> dict[str, Any]:
        return {"policy": self.policy, "timeSlicing": [
            {"name": r.name, "replicas": r.replicas, "rename": r.rename, "devices": r.devices.describe(),
             "failRequestsGreaterThanOne": r.fail_requests_greater_than_one} for r in self.resources]}


def _mapping(v: Any, where: str, known: set[str]) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise SharingError(where, f"expected a mapping, got {v!r}")
    unknown = sorted(str(k) for k in set(v) - known)
    if unknown:
        raise SharingError(f"{where}.{unknown[0]}", f"unknown key (known: {', '.join(sorted(known))})")
    return v


def _flag(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise SharingError(where, f"expected true or false, got {v!r}")
    return v


def _resource_name(v: Any, where: str) -> str:
    if not isinstance(v, str) or not is_extended_resource_name(v):
        raise SharingError(where, f"expected an extended resource name like nvidia.com/gpu.shared, got {v!r}")
    return v


def _devices(v: Any, where: str) -> Selection:
    if v == "all":
        return Selection()
    if isinstance(v, int) and not isinstance(v, bool):
        if v < 1:
            raise SharingError(where, f"a count of devices must be at least 1, got {v}")
        return Selection(count=v)
    if isinstance(v, list):
        if not v:
            raise SharingError(where, "an empty list shares nothing; use all, a count, or GPU indices / UUIDs")
        ids: list[int | str] = []
        for i, item in enumerate(v):
            at = f"{where}[{i}]"
            if isinstance(item, bool) or not isinstance(item, (int, str)) or item in ("", None):
                raise SharingError(at, f"expected a GPU index or a GPU/MIG UUID, got {item!r}")
            if isinstance(item, str) and item.isdigit():
                item = int(item)  # "0" in a YAML list means the index, as in the NVIDIA plugin's format
            if isinstance(item, int) and item < 0:
                raise SharingError(at, f"a GPU index cannot be negative, got {item}")
            if isinstance(item, str) and ":" in item:
                raise SharingError(at, f"MIG devices are selected by UUID here, not by {item!r}")
            if item in ids:
                raise SharingError(at, f"{item!r} is listed twice")
            ids.append(item)
        return Selection(ids=tuple(ids))
    raise SharingError(where, f"expected all, a count, or a list of GPU indices / UUIDs, got {v!r}")


def parse_sharing(doc: Any) -> SharingConfig:
    """Parse the ``sharing`` section on its own (names are checked against the node in ``validate``)."""
    top = _mapping(doc, "sharing", {"timeSlicing"})
    ts = _mapping(top.get("timeSlicing"), "sharing.timeSlicing",
                  {"resources", "allocationPolicy", "failRequestsGreaterThanOne", "renameByDefault"})
    where_ts = "sharing.timeSlicing"
    policy = ts.get("allocationPolicy", "distributed")
    if policy not in POLICIES:
        raise SharingError(f"{where_ts}.allocationPolicy", f"expected one of {', '.join(POLICIES)}, got {policy!r}")
    fail_default = _flag(ts.get("failRequestsGreaterThanOne", False), f"{where_ts}.failRequestsGreaterThanOne")
    rename_default = _flag(ts.get("renameByDefault", False), f"{where_ts}.renameByDefault")
    entries = ts.get("resources", [])
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise SharingError(f"{where_ts}.resources", f"expected a list of resources, got {entries!r}")
    out: list[TimeSlicedResource] = []
    for i, entry in enumerate(entries):
        where = f"{where_ts}.resources[{i}]"
        e = _mapping(entry, where, {"name", "replicas", "rename", "devices", "failRequestsGreaterThanOne"})
        if not isinstance(entry, dict):
            raise SharingError(where, "expected a mapping with name and replicas")
        for required in ("name", "replicas"):
            if required not in e:
                raise SharingError(f"{where}.{required}", "missing")
        name = _resource_name(e["name"], f"{where}.name")
        replicas = e["replicas"]
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= MAX_REPLICAS:
            raise SharingError(f"{where}.replicas", f"expected an integer from 1 to {MAX_REPLICAS}, got {replicas!r}")
        rename: str | None = None
        if e.get("rename") is not None:
            rename = _resource_name(e["rename"], f"{where}.rename")
            if rename == name:
                raise SharingError(f"{where}.rename", f"{rename!r} is the resource's own name")
        elif rename_default:
            rename = f"{name}.shared"
        out.append(TimeSlicedResource(
            name=name, replicas=replicas, rename=rename, devices=_devices(e.get("devices", "all"), f"{where}.devices"),
            fail_requests_greater_than_one=_flag(e.get("failRequestsGreaterThanOne", fail_default),
                                                 f"{where}.failRequestsGreaterThanOne"),
            where=where))
    return SharingConfig(resources=tuple(out), policy=policy)


def validate(sharing: SharingConfig, resource_name: str, mig_strategy: str) -> None:
    """Cross-checks that need the rest of the config: every entry names a resource this node can advertise, at
    most one entry per resource, and no advertised name is used twice."""
    prefix = mig_prefix(resource_name)
    taken: dict[str, str] = {resource_name: "plugin.resourceName"}
    for r in sharing.resources:
        is_mig = mig_strategy == "mixed" and r.name.startswith(prefix) and len(r.name) > len(prefix)
        if r.name != resource_name and not is_mig:
            known = resource_name + (f" or {prefix}<profile> (MIG strategy mixed)" if mig_strategy == "mixed" else "")
            raise SharingError(f"{r.where}.name", f"{r.name!r} is not a resource this plugin advertises "
                                                  f"(with MIG strategy {mig_strategy}: {known})")
        for other in sharing.resources:
            if other is r:
                break
            if other.name == r.name:
                raise SharingError(f"{r.where}.name", f"{r.name!r} is already shared by {other.where}")
        if r.rename is not None:
            if mig_strategy == "mixed" and r.rename.startswith(prefix):
                raise SharingError(f"{r.where}.rename", f"{r.rename!r}: names {prefix}* are kept for MIG profiles")
            if r.rename in taken:
                raise SharingError(f"{r.where}.rename", f"{r.rename!r} is already advertised ({taken[r.rename]})")
            taken[r.rename] = f"{r.where}.rename"
