"""Unix sockets that exist at their final path only with their final mode, without touching the process umask."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

import grpc

# sockaddr_un.sun_path is 108 bytes on Linux, one of them the terminating NUL.
UNIX_PATH_MAX = 107


def bind_unix(server: grpc.Server, path: Path, mode: int) -> None:
    """Bind ``server`` (not yet started) to the unix socket ``path`` with permission bits ``mode``.

    The socket is bound inside a fresh 0700 directory next to ``path``, given ``mode`` there and renamed into place.
    Why not ``os.umask`` around the bind: the umask is process-wide, so changing it from one thread races with every
    other thread creating files, and two threads restoring it can leave the wrong one set for good. Why not chmod
    after binding in place: between bind and chmod the socket is connectable with the umask's bits. Inside the 0700
    directory nobody else can reach it, and the rename makes it appear at ``path`` already with ``mode`` (replacing
    a stale file of a dead instance atomically, so no unlink that could fail on its own). Clients that connect by
    path are unaffected by the rename; nobody is told the path before this returns.

    Raises OSError naming the path (length over the unix limit, a read-only or missing directory, a parent that is
    not a directory) or RuntimeError when gRPC itself cannot bind.
    """
    # The private name is ".XXXXXXXX/s" (11 bytes after the parent), no longer than most final names.
    size = len(os.fsencode(path.parent)) + max(len(os.fsencode(path.name)), 11) + 1
    if size > UNIX_PATH_MAX:
        raise OSError(errno.ENAMETOOLONG,
                      f"socket path needs {size} bytes, over the unix limit of {UNIX_PATH_MAX}", str(path))
    private = Path(tempfile.mkdtemp(prefix=".", dir=path.parent))  # mode 0700 whatever the umask
    try:
        tmp = private / "s"
        server.add_insecure_port(f"unix://{tmp}")
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(private, ignore_errors=True)
