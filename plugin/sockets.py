"""gRPC on unix sockets: a server whose socket exists at its final path only with its final mode (without touching
the process umask) and is removed when it stops, and the end of a streaming call as an event."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

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


class UnixGrpcServer:
    """One gRPC server on one unix socket that it owns: bound with its mode at start, removed at stop."""

    def __init__(self, path: Path, mode: int, add_servicers: Callable[[grpc.Server], None], max_workers: int,
                 thread_name_prefix: str) -> None:
        self.path = path
        self.mode = mode
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                              thread_name_prefix=thread_name_prefix))
        add_servicers(self._server)

    def start(self, confirm: Callable[[grpc.Channel], object] | None = None) -> None:
        """Bind and serve; then, with ``confirm``, call it on a channel to the socket to prove that it answers.

        Raises OSError or RuntimeError (bind, see bind_unix) and whatever ``confirm`` raises (grpc.RpcError).
        """
        bind_unix(self._server, self.path, self.mode)
        self._server.start()
        if confirm is not None:
            with grpc.insecure_channel(f"unix://{self.path}") as ch:
                confirm(ch)

    def stop(self, grace_s: float, remove: bool = True) -> None:
        """Stop serving, giving calls in flight ``grace_s``, and remove the socket (also after a failed start).
        ``remove`` False leaves the path alone: what is there now may be another server's socket."""
        self._server.stop(grace_s).wait(grace_s + 1.0)
        if not remove:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:  # a read-only dir: nothing more to do about it here
            log.debug("cannot remove %s: %s", self.path, exc)


def client_left(context: grpc.ServicerContext, wake: Callable[[], None]) -> threading.Event:
    """An event set when the call of ``context`` ends (the client cancelled or went away, the server stopped).

    ``wake`` is called right after, so a stream blocked waiting for something else re-checks the event.
    """
    left = threading.Event()

    def on_done() -> None:
        left.set()
        wake()

    context.add_callback(on_done)
    return left
