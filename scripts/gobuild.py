"""Build Go binaries once and reuse them: the conformance peers, the kubelet bench's harness, the local cluster.

Binaries are cached outside the repository, keyed by name, version and a hash of everything that
goes into the build (go.mod/go.sum or the alternate ``-modfile`` pair, every ``.go`` file of the
module, the Go version, build tags and extra environment), so a second run on the same machine
does not rebuild:

    ~/.cache/gpu-health-device-plugin/<name>-<version>-<hash>/<name>

``$GPU_HEALTH_CACHE_DIR`` replaces the cache root; otherwise ``$XDG_CACHE_HOME`` is honoured.
The conformance tests, the benchmarks and the local cluster share this cache. Only the standard library is
used, so the bench and the local cluster run without the test dependencies; the tests' skip-or-fail wrapper
is tests/conformance/skips.py.

    from scripts.gobuild import build, find_go
    exe = build(module_dir, "./cmd/peer", "peer", version="v1.37.2")
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

CACHE_NAME = "gpu-health-device-plugin"

# Substrings of `go build` output that mean "could not fetch modules", not "code is broken".
NETWORK_ERROR_MARKERS = (
    "dial tcp",
    "no such host",
    "connection refused",
    "i/o timeout",
    "TLS handshake timeout",
    "proxyconnect",
    "network is unreachable",
    "GOPROXY=off",
)


class GoToolchainMissing(RuntimeError):
    """No usable `go` binary."""


class GoBuildError(RuntimeError):
    """`go build` failed; ``output`` holds its combined output."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output

    @property
    def looks_like_network(self) -> bool:
        return any(marker in self.output for marker in NETWORK_ERROR_MARKERS)


def cache_root() -> Path:
    explicit = os.environ.get("GPU_HEALTH_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / CACHE_NAME


def find_go() -> str | None:
    """Path of a `go` binary: $PATH, then $GOROOT/bin, then the default tarball location."""
    found = shutil.which("go")
    candidates = [found] if found else []
    if os.environ.get("GOROOT"):
        candidates.append(os.path.join(os.environ["GOROOT"], "bin", "go"))
    candidates.append("/usr/local/go/bin/go")
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def go_version(go: str) -> str:
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, check=True).stdout
    return out.strip()


def _module_files(module_dir: Path, modfile: str) -> Iterable[Path]:
    """Files whose content decides the build: the mod/sum pair and every .go file of the module."""
    mod = module_dir / modfile
    yield mod
    sum_file = mod.with_suffix(".sum")
    if sum_file.exists():
        yield sum_file
    for root, dirs, files in os.walk(module_dir):
        root_path = Path(root)
        # Skip nested modules, test data and hidden directories.
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith((".", "_")) and d != "testdata" and not (root_path / d / "go.mod").exists()
        )
        for name in sorted(files):
            if name.endswith(".go"):
                yield root_path / name


def build_key(
    module_dir: Path,
    package: str,
    name: str,
    *,
    go: str,
    modfile: str = "go.mod",
    tags: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
    ldflags: str = "",
) -> str:
    h = hashlib.sha256()
    for item in (package, name, modfile, ",".join(sorted(tags)), ldflags, go_version(go)):
        h.update(item.encode() + b"\0")
    for key, value in sorted((env or {}).items()):
        h.update(f"{key}={value}".encode() + b"\0")
    for path in _module_files(module_dir, modfile):
        h.update(str(path.relative_to(module_dir)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def build(
    module_dir: os.PathLike[str] | str,
    package: str,
    name: str,
    env: Mapping[str, str] | None = None,
    *,
    version: str = "dev",
    modfile: str = "go.mod",
    tags: Iterable[str] = (),
    ldflags: str = "",
    timeout: float = 3600.0,
    go: str | None = None,
) -> Path:
    """Build ``package`` (a path relative to ``module_dir``, e.g. ``"."`` or ``"./cmd/x"``) once.

    Returns the path of the cached binary. ``modfile`` selects an alternate go.mod (its ``.sum``
    sibling is used with it), so one source tree can be built against several pinned module sets.
    ``env`` is added to the build environment and is part of the cache key.
    Raises GoToolchainMissing or GoBuildError.
    """
    module_dir = Path(module_dir).resolve()
    tags = tuple(tags)
    go = go or find_go()
    if go is None:
        raise GoToolchainMissing("no Go toolchain found (looked on PATH, in $GOROOT/bin and /usr/local/go/bin)")
    key = build_key(module_dir, package, name, go=go, modfile=modfile, tags=tags, env=env, ldflags=ldflags)
    root = cache_root()
    target_dir = root / f"{_safe(name)}-{_safe(version)}-{key}"
    exe = target_dir / name
    if exe.is_file():
        return exe

    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if exe.is_file():
            return exe
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{target_dir.name}.", dir=root))
        try:
            cmd = [go, "build", "-trimpath", "-buildvcs=false", "-o", str(tmp_dir / name)]
            if modfile != "go.mod":
                cmd.append(f"-modfile={modfile}")
            if tags:
                cmd.append("-tags=" + ",".join(tags))
            if ldflags:
                cmd.append("-ldflags=" + ldflags)
            cmd.append(package)
            build_env = dict(os.environ)
            build_env.update(env or {})
            started = time.monotonic()
            try:
                proc = subprocess.run(
                    cmd, cwd=module_dir, env=build_env, capture_output=True, text=True, timeout=timeout
                )
            except subprocess.TimeoutExpired as exc:
                raise GoBuildError(f"go build of {name} timed out after {timeout:.0f}s", str(exc.output or "")) from exc
            elapsed = time.monotonic() - started
            output = (proc.stdout or "") + (proc.stderr or "")
            if proc.returncode != 0:
                raise GoBuildError(
                    f"go build of {name} ({version}) failed with exit code {proc.returncode}:\n{output[-4000:]}",
                    output,
                )
            # Largest single descendant (compiler/linker) seen so far by this process; an upper bound
            # for this build only when nothing bigger ran before it.
            peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            (tmp_dir / "build.json").write_text(
                json.dumps(
                    {
                        "name": name,
                        "version": version,
                        "package": package,
                        "modfile": modfile,
                        "tags": list(tags),
                        "go": go_version(go),
                        "build_seconds": round(elapsed, 1),
                        "max_child_rss_kib": peak_kib,
                        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    },
                    indent=2,
                )
                + "\n"
            )
            if target_dir.exists():
                shutil.rmtree(target_dir)
            os.replace(tmp_dir, target_dir)
        finally:
            if tmp_dir.exists():
                shutil.rmtree(tmp_dir, ignore_errors=True)
    _prune(root, f"{_safe(name)}-{_safe(version)}-", keep=KEEP_PER_VERSION)
    return exe


# Builds of one name and version kept in the cache (older source states are deleted).
KEEP_PER_VERSION = 3


def _prune(root: Path, prefix: str, keep: int) -> None:
    """Delete all but the `keep` most recently built entries starting with `prefix`."""
    entries = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(prefix)]
    entries.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[keep:]:
        shutil.rmtree(old, ignore_errors=True)
