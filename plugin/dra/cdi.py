"""CDI specs for prepared DRA claims: one spec file per claim, built as a pure function and written atomically.

The container runtime (containerd 2.x, CRI-O) resolves the CDI ids a NodePrepareResources answer names by reading
every spec in its CDI dirs, so a claim's spec must be in place before the answer and gone after unprepare. One file
per claim keeps that a single create and a single delete, and device names that start with the claim UID keep two
claims on the same GPU (never ours to hand out twice, but a stale file must not clash) apart.

Version 0.6.0: device names that start with a digit (a UID) and ``hostPath`` on device nodes need 0.5.0, and
every runtime that ships DRA support reads 0.6.0.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plugin.atomicfile import fsync_dir, write_atomic
from plugin.dra.slices import DRIVER
from plugin.kubelet.allocation import CONTROL_NODES, OPTIONAL_NODES

# A UID as the API server makes them (RFC 4122 text; hex of either case, as the RFC reads it). Nothing else may
# become part of a file name: a UID with "/" or ".." in it would name a file outside the spec dir.
_UID_RE = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")

CDI_VERSION = "0.6.0"
CLASS = "gpu"
KIND = f"{DRIVER}/{CLASS}"


@dataclass(frozen=True)
class CdiGpu:
    """What a spec needs of one allocated device: its name in the slice, the UUID NVIDIA_VISIBLE_DEVICES names
    (a MIG instance's own, which the NVIDIA runtime resolves to the instance) and its /dev minor (an instance's
    parent's: MIG instances have no /dev/nvidia<N> of their own, as device-plugin mode hands them out too)."""

    device: str
    uuid: str
    minor: int


def is_claim_uid(uid: str) -> bool:
    return _UID_RE.fullmatch(uid) is not None


def check_claim_uid(uid: str) -> str:
    """``uid`` if it is a UUID; ValueError otherwise. Every file name built from a claim UID goes through here."""
    if not is_claim_uid(uid):
        raise ValueError(f"claim UID {uid!r} is not a UUID")
    return uid


def kind(driver: str = DRIVER) -> str:
    return f"{driver}/{CLASS}"


def cdi_device_name(claim_uid: str, device: str) -> str:
    return f"{claim_uid}-{device}"


def cdi_id(claim_uid: str, device: str, driver: str = DRIVER) -> str:
    """The fully qualified id the runtime resolves: ``<kind>=<name>``."""
    return f"{kind(driver)}={cdi_device_name(claim_uid, device)}"


def spec_file_name(claim_uid: str, driver: str = DRIVER) -> str:
    return f"{driver}-{check_claim_uid(claim_uid)}.json"


def _node(dev_dir: str, name: str) -> dict[str, Any]:
    return {"path": f"/dev/{name}", "hostPath": f"{dev_dir}/{name}", "permissions": "rw"}


def build_spec(claim_uid: str, gpus: Sequence[CdiGpu], dev_dir: str, exists: Callable[[str], bool],
               driver: str = DRIVER) -> dict[str, Any]:
    """The spec of one claim. ``gpus`` in the claim's order, which is the order of NVIDIA_VISIBLE_DEVICES;
    ``exists`` says whether an optional host node (the UVM ones) is there, so a host without UVM still works."""
    check_claim_uid(claim_uid)
    if not gpus:
        raise ValueError(f"claim {claim_uid}: a CDI spec needs at least one device")
    devices = [{"name": cdi_device_name(claim_uid, g.device),
                "containerEdits": {"deviceNodes": [_node(dev_dir, f"nvidia{g.minor}")]}}
               for g in gpus]
    nodes = [_node(dev_dir, n) for n in CONTROL_NODES]
    nodes += [_node(dev_dir, n) for n in OPTIONAL_NODES if exists(f"{dev_dir}/{n}")]
    return {
        "cdiVersion": CDI_VERSION,
        "kind": kind(driver),
        "devices": devices,
        # Spec-level edits apply once whenever any device of the spec is injected: the env names every device of the
        # claim, so a container that takes the claim sees all of them whichever CDI id the runtime applies first.
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=" + ",".join(g.uuid for g in gpus)],
            "deviceNodes": nodes,
        },
    }


def write_spec(spec_dir: Path, claim_uid: str, spec: dict[str, Any], driver: str = DRIVER) -> Path:
    """Write the spec whole: a runtime scanning the dir must never read half a file, nor the old one vanish
    before the new one is in place."""
    path = spec_dir / spec_file_name(claim_uid, driver)
    spec_dir.mkdir(parents=True, exist_ok=True)
    data = json.dumps(spec, indent=2, sort_keys=True).encode() + b"\n"
    write_atomic(path, data, 0o644)  # mkstemp's 0600 would keep a runtime running as another user out
    return path


def remove_spec(spec_dir: Path, claim_uid: str, driver: str = DRIVER) -> bool:
    """Delete the claim's spec; True when there was one. A missing file is already the wanted end state."""
    try:
        (spec_dir / spec_file_name(claim_uid, driver)).unlink()
    except FileNotFoundError:
        return False
    fsync_dir(spec_dir)
    return True


def spec_exists(spec_dir: Path, claim_uid: str, driver: str = DRIVER) -> bool:
    return (spec_dir / spec_file_name(claim_uid, driver)).is_file()
