"""Files written whole: a temp file in the same directory, fsynced, renamed over the target, the directory fsynced.
A reader (the plugin after a crash, a container runtime scanning a dir) sees the old file or the new one, never
half of one. The state file, the DRA checkpoint and the CDI specs are written this way."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Make a rename or an unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int | None = None) -> None:
    """Replace ``path`` with ``data``. ``mode`` None keeps mkstemp's 0600. The temp name starts with a dot and ends
    in ``.tmp``, so a loader of ``*.json`` files in that dir (the CDI cache) never picks it up."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)
