"""The DRA driver's checkpoint: which claims this node has prepared, and with what, across plugin restarts.

The kubelet calls NodeUnprepareResources for a claim prepared by an earlier run of the plugin, and repeats
NodePrepareResources after its own restart; both must answer from what was prepared, not from what the API server
or the GPUs say now. One JSON file in the state dir, written whole (temp, fsync, rename) like the health store.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plugin.atomicfile import write_atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool: str
    device: str
    uuid: str
    minor: int  # /dev/nvidia<minor>: enough to rewrite the CDI spec without the GPU being discovered again
    cdi_ids: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"request_names": list(self.request_names), "pool": self.pool, "device": self.device,
                "uuid": self.uuid, "minor": self.minor, "cdi_ids": list(self.cdi_ids)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> PreparedDevice:
        return PreparedDevice(request_names=tuple(_strs(d, "request_names")), pool=_str(d, "pool"),
                              device=_str(d, "device"), uuid=_str(d, "uuid"), minor=_int(d, "minor"),
                              cdi_ids=tuple(_strs(d, "cdi_ids")))


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "name": self.name, "devices": [d.to_dict() for d in self.devices]}

    @staticmethod
    def from_dict(uid: str, d: dict[str, Any]) -> PreparedClaim:
        devs = d.get("devices")
        if not isinstance(devs, list) or not all(isinstance(x, dict) for x in devs):
            raise ValueError("devices: expected a list of objects")
        return PreparedClaim(uid=uid, namespace=_str(d, "namespace"), name=_str(d, "name"),
                             devices=tuple(PreparedDevice.from_dict(x) for x in devs))


def _str(d: dict[str, Any], key: str) -> str:
    v = d.get(key)
    if not isinstance(v, str):
        raise ValueError(f"{key}: expected a string, got {v!r}")
    return v


def _int(d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{key}: expected an integer, got {v!r}")
    return v


def _strs(d: dict[str, Any], key: str) -> list[str]:
    v = d.get(key)
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"{key}: expected a list of strings, got {v!r}")
    return v


class Checkpoint:
    FILE = "dra-checkpoint.json"
    VERSION = 1

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.path = state_dir / self.FILE

    def load(self) -> dict[str, PreparedClaim]:
        """The prepared claims by UID. A file that cannot be read as one is moved aside and counts as empty: a
        plugin that will not start protects no one, and the kubelet re-prepares what it still needs."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            return self._aside(str(exc))
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict):
                raise ValueError("expected a JSON object")
            if doc.get("version") != self.VERSION:
                raise ValueError(f"unknown version {doc.get('version')!r}")
            claims = doc.get("claims")
            if not isinstance(claims, dict):
                raise ValueError("claims: expected an object")
            out: dict[str, PreparedClaim] = {}
            for uid, entry in claims.items():
                if not isinstance(entry, dict):
                    raise ValueError(f"claims[{uid!r}]: expected an object")
                try:
                    out[uid] = PreparedClaim.from_dict(uid, entry)
                except ValueError as exc:
                    raise ValueError(f"claims[{uid!r}].{exc}") from None
            return out
        except ValueError as exc:
            return self._aside(str(exc))

    def _aside(self, why: str) -> dict[str, PreparedClaim]:
        aside = self.path.with_suffix(".corrupt")
        log.error("DRA checkpoint %s unreadable (%s); moved to %s, starting with no prepared claims",
                  self.path, why, aside.name)
        try:
            os.replace(self.path, aside)
        except OSError:
            pass
        return {}

    def save(self, claims: dict[str, PreparedClaim]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        doc = {"version": self.VERSION, "claims": {uid: c.to_dict() for uid, c in sorted(claims.items())}}
        data = json.dumps(doc, separators=(",", ":")).encode()
        write_atomic(self.path, data)
