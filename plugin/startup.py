"""What the plugin needs before anything serves: usable paths and this state dir to itself.

Every problem is a :class:`StartupError` whose message is one line naming the option as the user set it, the path
and the OS error; the CLI prints it and exits 1, never a traceback.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path

from plugin.config import Config
from plugin.sockets import UNIX_PATH_MAX


class StartupError(Exception):
    """Something the plugin needs at start cannot be had (a path, the state dir's lock); the message is one line
    naming the option as the user set it, the path and the OS error."""


LOCK_FILE = "plugin.lock"


def _problem(label: str, path: Path | str, doing: str, exc: OSError) -> StartupError:
    return StartupError(f"{label} {path}: {doing}: {exc.strerror or exc}")


def _usable_dir(path: Path, label: str, file: Path | None = None) -> None:
    """Create the directory if needed and prove that files can be created in it (a read-only mount, a path
    under a regular file or a pseudo filesystem fail here, at start, not in a worker thread later). ``file``:
    the option names a file in that directory rather than the directory itself."""
    where = f"{label} {file}: its directory {path}" if file is not None else f"{label} {path}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise StartupError(f"{where}: exists and is not a directory") from None
    except OSError as exc:
        raise StartupError(f"{where}: cannot create the directory: {exc.strerror or exc}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".gpu-health-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise StartupError(f"{where}: cannot create files in it: {exc.strerror or exc}") from None


class InstanceLock:
    """One plugin per state dir: an exclusive ``flock`` on ``plugin.lock`` there, holding the owner's pid. The
    kernel drops it when the holder dies, however it dies, so a stale file never blocks a restart.

    With ``wait`` (``--handover``) a held lock is not an error: the lock comes back not ``held``, and ``try_take``
    takes it once the holder is gone, which is how a surge rollout's new plugin succeeds the old one."""

    def __init__(self, fd: int, path: Path, held: bool = True, holder: str = "") -> None:
        self._fd: int | None = fd
        self.path = path
        self.held = held
        self.holder = holder

    @classmethod
    def acquire(cls, state_dir: Path, label: str, wait: bool = False) -> InstanceLock:
        path = state_dir / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise _problem(label, state_dir, f"cannot open {LOCK_FILE}", exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            if wait:
                return cls(fd, path, held=False, holder=holder)
            os.close(fd)
            raise StartupError(f"{label} {state_dir} is in use by another gpu-health-plugin ({holder}); stop it "
                               f"or give this one its own {label}") from None
        except OSError as exc:
            os.close(fd)
            raise _problem(label, state_dir, f"cannot lock {LOCK_FILE}", exc) from None
        lock = cls(fd, path)
        lock._claim()
        return lock

    def try_take(self) -> bool:
        """Take a lock that was held by another instance, if it is free now; True once held."""
        if self.held:
            return True
        if self._fd is None:
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self._claim()
        self.held = True
        return True

    def _claim(self) -> None:
        # Host name too: in a pod it is the pod's name, and the pid alone is ambiguous across pid namespaces.
        assert self._fd is not None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if self.held:
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass
        self.held = False
        os.close(fd)  # drops the lock; the file stays, so no one can lock a file that is about to be unlinked


def _holder(fd: int) -> str:
    try:
        words = os.pread(fd, 256, 0).decode(errors="replace").split()
    except OSError:
        words = []
    if not words:
        return "pid unknown: it is still starting"
    return f"pid {words[0]}" + (f" on {words[1]}" if len(words) > 1 else "")


def _socket_fits(path: Path, label: str, what: str) -> None:
    size = len(os.fsencode(path))
    if size > UNIX_PATH_MAX:
        raise StartupError(f"{label}: the {what} path {path} is {size} bytes; a unix socket path has at most "
                           f"{UNIX_PATH_MAX}")


def check_paths(cfg: Config) -> None:
    """Every path option, checked before anything serves, so a bad one is one line at start (exit 1)."""
    if cfg.mode == "dra":
        from plugin.dra.server import DRA_SOCKET, registration_socket_name
        from plugin.dra.slices import DRIVER

        # The kubelet's device-plugin directory is not ours to use in DRA mode; these three are.
        for name in ("dra_plugin_dir", "dra_registry_dir", "cdi_spec_dir"):
            _usable_dir(getattr(cfg, name), cfg.name_of(name))
        _socket_fits(cfg.dra_plugin_dir / DRA_SOCKET, cfg.name_of("dra_plugin_dir"), "DRA socket")
        _socket_fits(cfg.dra_registry_dir / registration_socket_name(DRIVER), cfg.name_of("dra_registry_dir"),
                     "registration socket")
    else:
        _usable_dir(cfg.device_plugin_dir, cfg.name_of("device_plugin_dir"))
    sock = cfg.health_socket_path
    label = cfg.name_of("health_socket") if cfg.health_socket is not None else cfg.name_of("state_dir")
    _socket_fits(sock, label, "health socket")
    if cfg.health_socket is not None:
        _usable_dir(sock.parent, label, file=sock)
    if sock.is_dir():
        raise StartupError(f"{label}: the health socket path {sock} is a directory")
    if not cfg.dev_root.is_dir():
        why = "does not exist" if not cfg.dev_root.exists() else "is not a directory"
        raise StartupError(f"{cfg.name_of('dev_root')} {cfg.dev_root}: {why}")
    if cfg.kubeconfig is not None:
        try:
            with cfg.kubeconfig.open("rb"):
                pass
        except OSError as exc:
            raise _problem(cfg.name_of("kubeconfig"), cfg.kubeconfig, "cannot read it", exc) from None


def read_boot_id(path: Path, label: str) -> str:
    """The node's boot id: latches are recorded under it, and one from another boot is what a reboot clears. A file
    that cannot be read or is empty is a start-up error: without it a reboot could not be told from a restart."""
    try:
        boot_id = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError as exc:
        raise _problem(label, path, "cannot read the boot id", exc) from None
    if not boot_id or len(boot_id) > 128 or not boot_id.isprintable():
        raise StartupError(f"{label} {path}: holds no boot id (expected one line such as the kernel's "
                           "/proc/sys/kernel/random/boot_id)")
    return boot_id


def claim_state_dir(cfg: Config) -> InstanceLock:
    """Make the state dir usable and take its lock: first, before anything reads state.json or binds a socket.
    With ``--handover`` a lock held by another instance comes back not held (the caller waits for it)."""
    label = cfg.name_of("state_dir")
    _usable_dir(cfg.state_dir, label)
    return InstanceLock.acquire(cfg.state_dir, label, wait=cfg.handover)
