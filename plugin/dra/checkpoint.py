"""The DRA driver's checkpoint: which claims this node has prepared, and with what, across plugin restarts.

The kubelet calls NodeUnprepareResources for a claim prepared by an earlier run of the plugin, and repeats
NodePrepareResources after its own restart; both must answer from what was prepared, not from what the API server
or the GPUs say now. One JSON file in the state dir, written whole (temp, fsync, rename) like the health store.

Three ways a load can go wrong, and they are not alike:
- the file is damaged (not JSON, a field of the wrong type, a key that is no claim UID): moved aside, and the
  plugin starts with no prepared claims; a plugin that will not start protects no one;
- the file cannot be read (EACCES, EIO, a directory in its place): ``CheckpointUnreadable``; the file says nothing
  about its content, so it is kept, never overwritten, and the driver answers UNAVAILABLE until it reads;
- a newer plugin wrote it: ``CheckpointTooNew``; its claims may still be prepared, and this plugin cannot know
  them, so the start is refused rather than the file moved aside and overwritten.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plugin.atomicfile import write_atomic
from plugin.dra.cdi import check_claim_uid, is_claim_uid

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool: str
    device: str
    uuid: str  # what NVIDIA_VISIBLE_DEVICES names: the GPU's UUID, or a MIG instance's
    minor: int  # /dev/nvidia<minor> (an instance's parent's): enough to rewrite the CDI spec without discovery
    cdi_ids: tuple[str, ...]
    # A MIG instance's parent GPU, so the GPU counts as held (plugin/dra/holders.py) even once the instance is gone
    # from discovery. Written only when set: a whole GPU's entry reads as before, and an older plugin ignores it.
    parent_uuid: str = ""
    # The allocation's shareID when the device is shared by several claims (consumable capacity): the kubelet keys
    # the prepared device by it. Written only when set, as parent_uuid.
    share_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"request_names": list(self.request_names), "pool": self.pool, "device": self.device,
                             "uuid": self.uuid, "minor": self.minor, "cdi_ids": list(self.cdi_ids)}
        if self.parent_uuid:
            d["parent_uuid"] = self.parent_uuid
        if self.share_id:
            d["share_id"] = self.share_id
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> PreparedDevice:
        return PreparedDevice(request_names=tuple(_strs(d, "request_names")), pool=_str(d, "pool"),
                              device=_str(d, "device"), uuid=_str(d, "uuid"), minor=_int(d, "minor"),
                              cdi_ids=tuple(_strs(d, "cdi_ids")),
                              parent_uuid=_str(d, "parent_uuid") if "parent_uuid" in d else "",
                              share_id=_str(d, "share_id") if "share_id" in d else "")


@dataclass(frozen=True)
class PodRef:
    """A pod by name and UID: a pod of that name made again is another pod."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]
    # The pod the scheduler made the claim for, when it is a pod's extended-resource claim (KEP-5004): the kubelet
    # shows no device health for such a pod, so the pod-condition writer (plugin/dra/podstatus.py) does. Written only
    # when set, as a device's parent_uuid.
    pod: PodRef | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"namespace": self.namespace, "name": self.name,
                             "devices": [x.to_dict() for x in self.devices]}
        if self.pod is not None:
            d["pod"] = {"name": self.pod.name, "uid": self.pod.uid}
        return d

    @staticmethod
    def from_dict(uid: str, d: dict[str, Any]) -> PreparedClaim:
        devs = d.get("devices")
        if not isinstance(devs, list) or not all(isinstance(x, dict) for x in devs):
            raise ValueError("devices: expected a list of objects")
        pod = d.get("pod")
        if pod is not None and not isinstance(pod, dict):
            raise ValueError("pod: expected an object")
        namespace = _str(d, "namespace")
        return PreparedClaim(uid=uid, namespace=namespace, name=_str(d, "name"),
                             devices=tuple(PreparedDevice.from_dict(x) for x in devs),
                             pod=None if pod is None else PodRef(namespace, _str(pod, "name"), _str(pod, "uid")))


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


class CheckpointError(Exception):
    """The checkpoint cannot be used now; the message is one line naming the file."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(message)
        self.path = path


class CheckpointUnreadable(CheckpointError):
    """Reading the file failed (not: its content is bad). It is kept; try again later."""


class CheckpointTooNew(CheckpointError):
    """A newer plugin wrote the file: its claims cannot be known here."""

    def __init__(self, path: Path, version: int, known: int) -> None:
        super().__init__(path, f"DRA checkpoint {path} is version {version}; this plugin reads version {known}: a "
                               f"newer plugin wrote it (run that one, or remove the file once no claim is prepared "
                               f"on this node)")
        self.version = version


class Checkpoint:
    FILE = "dra-checkpoint.json"
    VERSION = 1

    def __init__(self, state_dir: Path, read: Callable[[Path], bytes] = Path.read_bytes) -> None:
        self.dir = state_dir
        self.path = state_dir / self.FILE
        self._read = read  # a parameter so tests can make the disk fail (EIO) where root ignores mode bits

    def load(self) -> dict[str, PreparedClaim]:
        """The prepared claims by UID; none when there is no file. A damaged file is moved aside and counts as
        empty, and the kubelet re-prepares what it still needs. Raises ``CheckpointUnreadable`` when the file
        cannot be read and ``CheckpointTooNew`` for a newer version, both leaving the file as it is."""
        try:
            data = self._read(self.path)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise CheckpointUnreadable(self.path, f"cannot read the DRA checkpoint {self.path}: "
                                                  f"{exc.strerror or exc}") from None
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict):
                raise ValueError("expected a JSON object")
            version = doc.get("version")
            if isinstance(version, int) and not isinstance(version, bool) and version > self.VERSION:
                raise CheckpointTooNew(self.path, version, self.VERSION)
            if version != self.VERSION or isinstance(version, bool):
                raise ValueError(f"unknown version {version!r}")
            claims = doc.get("claims")
            if not isinstance(claims, dict):
                raise ValueError("claims: expected an object")
            out: dict[str, PreparedClaim] = {}
            for uid, entry in claims.items():
                if not is_claim_uid(uid):
                    raise ValueError(f"claims[{uid!r}]: the key is not a claim UID")
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
        log.error("DRA checkpoint %s damaged (%s); moved to %s, starting with no prepared claims",
                  self.path, why, aside.name)
        try:
            os.replace(self.path, aside)
        except OSError:
            pass
        return {}

    def save(self, claims: dict[str, PreparedClaim]) -> None:
        for uid in claims:
            check_claim_uid(uid)
        self.dir.mkdir(parents=True, exist_ok=True)
        doc = {"version": self.VERSION, "claims": {uid: c.to_dict() for uid, c in sorted(claims.items())}}
        data = json.dumps(doc, separators=(",", ":")).encode()
        write_atomic(self.path, data)
