"""Which claims hold a GPU in DRA mode, from the driver's checkpoint of prepared claims (of the GPU itself or of one
of its MIG instances): the recovery check's "busy" answer there (plugin/health/recovery.py). The driver writes the
checkpoint before it answers a prepare and keeps a claim in it until it is unprepared, so a prepared claim is a pod
on the GPU, or about to be.

The file is read, never repaired: moving a damaged one aside is the driver's call (plugin/dra/checkpoint.py). A file
that cannot be read or understood counts as holding every GPU, and the answer says why.
"""

from __future__ import annotations

import json
from pathlib import Path

from plugin.devices.model import Gpu
from plugin.dra.checkpoint import Checkpoint, PreparedClaim


def prepared_claims(data: bytes) -> list[PreparedClaim]:
    """The claims of a checkpoint file's content; ValueError (one line) when it is not one this plugin reads."""
    doc = json.loads(data)  # a JSONDecodeError is a ValueError
    if not isinstance(doc, dict):
        raise ValueError("expected a JSON object")
    version = doc.get("version")
    if version != Checkpoint.VERSION or isinstance(version, bool):
        raise ValueError(f"version {version!r}, this plugin reads version {Checkpoint.VERSION}")
    claims = doc.get("claims")
    if not isinstance(claims, dict):
        raise ValueError("claims: expected an object")
    out = []
    for uid, entry in claims.items():
        if not isinstance(entry, dict):
            raise ValueError(f"claims[{uid!r}]: expected an object")
        out.append(PreparedClaim.from_dict(uid, entry))
    return out


class PreparedClaimHolders:
    """``busy(gpu)`` for the recovery check in DRA mode: "" when no prepared claim has the GPU, else "held by claim
    ns/name"."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / Checkpoint.FILE

    def __call__(self, gpu: Gpu) -> str:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return ""  # nothing was ever prepared here
        except OSError as exc:
            return f"cannot tell which claims hold it: cannot read the DRA checkpoint {self.path}: " \
                   f"{exc.strerror or exc}"
        try:
            claims = prepared_claims(data)
        except ValueError as exc:
            return f"cannot tell which claims hold it: the DRA checkpoint {self.path}: {exc}"
        # A claim on one of its MIG instances holds the GPU too: by the parent its entry names, which outlives the
        # instance, or by an instance's UUID the GPU lists.
        uuid = gpu.uuid.lower()
        ids = {uuid, *(m.uuid.lower() for m in gpu.mig_devices)}
        names = sorted({f"{c.namespace}/{c.name}" for c in claims
                        if any(d.uuid.lower() in ids or d.parent_uuid.lower() == uuid for d in c.devices)})
        if not names:
            return ""
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        return f"held by claim {names[0]}{more}"
