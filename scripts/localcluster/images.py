"""The local cluster's container images, built with no registry and no daemon, each written as an OCI archive that
`ctr -n k8s.io images import FILE` loads:

    plugin     localhost/gpu-health-device-plugin:<pyproject version>   the project's Dockerfile, on a Debian base
                                                                        bootstrapped here (mmdebstrap)
    pause      localhost/pause:3.10               pause/ (our own Go sandbox process) in an empty image
    workload   localhost/gpu-health-workload:1    Debian's static busybox in an empty image: a shell for test pods

buildah runs with a storage root of its own under the cache (vfs, chroot isolation), so the host's container
storage is never touched. Archives are cached beside the Go binaries of scripts/gobuild.py
(<cache>/images/<name>-<hash>/image.oci.tar), keyed by a hash of what goes into them, so a second run only checks
them. Needs Debian's buildah, mmdebstrap and busybox-static, and Go for the pause binary.

    python3 scripts/localcluster/images.py               # build or reuse all; JSON {name: {ref, archive, id}}
    python3 scripts/localcluster/images.py --check       # also run each image once (buildah run)
    python3 scripts/localcluster/images.py --rebuild-plugin 2   # a second plugin image, :2, another image ID
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PAUSE_DIR = HERE / "pause"

Log = Callable[[str], None]

PLUGIN_NAME = "localhost/gpu-health-device-plugin"
PAUSE_REF = "localhost/pause:3.10"
WORKLOAD_REF = "localhost/gpu-health-workload:1"

# The Dockerfile's default base. Committed into our own storage under the `localhost/` name, which is where a
# short name resolves first with --pull=never; the build still passes it explicitly (BASE_IMAGE) so no registry's
# search list is consulted at all.
BASE_SUITE = "trixie"
BASE_VARIANT = "minbase"
BASE_REF = f"localhost/debian:{BASE_SUITE}-slim"

# What makes Debian's own `-slim` images slim, for the base: no manuals, docs (copyright files stay) or
# translations, and no downloaded .debs left behind by apt-get. mmdebstrap keeps the dpkg options in the image's
# /etc/dpkg/dpkg.cfg.d, so the Dockerfile's apt-get steps follow them too. The apt option is written by a hook
# after the bootstrap, because mmdebstrap's own download step needs the .debs it keeps.
BASE_DPKG_OPTS = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
)
BASE_APT_CONF = 'APT::Keep-Downloaded-Packages "false";'

# Bumped when the recipe in this file changes in a way the hashed inputs do not show.
RECIPE = "2"
# Cache entries kept per image name; older ones are deleted.
KEEP = 2
ARCHIVE = "image.oci.tar"
META = "image.json"
TAIL_LINES = 25


class ImageBuildError(RuntimeError):
    """A tool is missing or a build step failed; the message carries the step's last output lines."""


@dataclass(frozen=True)
class Image:
    ref: str
    archive: Path
    # The config digest, which is what containerd and the kubelet report as the image ID.
    id: str


if str(REPO) not in sys.path:  # run as a script: python3 scripts/localcluster/images.py
    sys.path.insert(0, str(REPO))
from scripts import gobuild  # noqa: E402


def images_root() -> Path:
    return Path(gobuild.cache_root()) / "images"


def plugin_version() -> str:
    version: str = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    return version


def _quiet(_: str) -> None:
    pass


# ----------------------------------------------------------------------------------------------------------------
# Running tools


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _require(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise ImageBuildError(f"{tool} not found on PATH (Debian: apt-get install {package})")
    return path


def _run(cmd: Sequence[str], *, timeout: float, log_file: Path | None = None, cwd: Path | None = None,
         env: dict[str, str] | None = None) -> str:
    """Run a command, return its stdout; on failure raise ImageBuildError with the last lines of its output."""
    try:
        proc = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise ImageBuildError(f"{_show(cmd)} timed out after {timeout:.0f}s:\n{_tail(out + err)}") from None
    except OSError as exc:
        raise ImageBuildError(f"{_show(cmd)} could not start: {exc}") from None
    if log_file is not None:
        with log_file.open("a") as f:
            f.write(f"$ {_show(cmd)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        where = f" (full log: {log_file})" if log_file is not None else ""
        raise ImageBuildError(f"{_show(cmd)} failed with exit code {proc.returncode}{where}:\n"
                              f"{_tail(proc.stdout + proc.stderr)}")
    return proc.stdout


def _show(cmd: Sequence[str]) -> str:
    words = [str(c) for c in cmd]
    # buildah's storage flags are the same on every call and only hide the subcommand.
    if len(words) > 7 and words[1] == "--root":
        words = [words[0], *words[7:]]
    return " ".join(words)


class Buildah:
    """buildah on our own storage: vfs (works on any file system, needs no fuse or overlay mounts)."""

    def __init__(self, root: Path, log_file: Path | None = None) -> None:
        self.exe = _require("buildah", "buildah")
        self.root = root
        self.log_file = log_file

    @functools.cached_property
    def version(self) -> str:
        return _run([self.exe, "--version"], timeout=60).strip()

    def with_log(self, log_file: Path) -> Buildah:
        return Buildah(self.root, log_file)

    def __call__(self, *args: str, timeout: float = 600.0) -> str:
        cmd = [self.exe, "--root", str(self.root / "storage"), "--runroot", str(self.root / "run"),
               "--storage-driver", "vfs", *args]
        return _run(cmd, timeout=timeout, log_file=self.log_file)

    def inspect(self, name: str, kind: str = "image") -> dict[str, Any]:
        # Whole JSON: buildah 1.28's --format templates have no json function.
        data: dict[str, Any] = json.loads(self("inspect", "--type", kind, name, timeout=120))
        return data

    def label(self, ref: str, key: str) -> str | None:
        try:
            labels = self.inspect(ref)["OCIv1"]["config"].get("Labels") or {}
        except (ImageBuildError, KeyError, ValueError):
            return None
        value = labels.get(key)
        return value if isinstance(value, str) else None

    def push_archive(self, ref: str, archive: Path) -> None:
        # The OCI annotation org.opencontainers.image.ref.name carries the full name; `ctr images import` keeps a
        # full reference as it is.
        self("push", "--quiet", ref, f"oci-archive:{archive}:{ref}", timeout=1800)

    def remove_image(self, ref: str) -> None:
        with contextlib.suppress(ImageBuildError):
            self("rmi", "--force", ref, timeout=300)


# ----------------------------------------------------------------------------------------------------------------
# Cache entries and locking

_lock_depth = 0
_thread_lock = threading.RLock()


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One build at a time per cache, across processes: builds share one buildah storage (and two cores)."""
    global _lock_depth
    with _thread_lock:
        if _lock_depth:
            _lock_depth += 1
            try:
                yield
            finally:
                _lock_depth -= 1
            return
        root.mkdir(parents=True, exist_ok=True)
        with open(root / ".build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _lock_depth = 1
            try:
                yield
            finally:
                _lock_depth = 0


def _hash(parts: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "big") + part)
    return h.hexdigest()[:16]


def _tree_parts(root: Path) -> Iterator[bytes]:
    """Relative path, mode and content of every file under root, in a fixed order; symlinks as their target."""
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = Path(dirpath) / name
            yield str(path.relative_to(root)).encode()
            if path.is_symlink():
                yield b"-> " + os.readlink(path).encode()
            else:
                yield oct(path.stat().st_mode & 0o777).encode()
                yield path.read_bytes()


def _entry_dir(name: str, key: str) -> Path:
    return images_root() / f"{name}-{key}"


def _cached(name: str, key: str) -> Image | None:
    entry = _entry_dir(name, key)
    meta, archive = entry / META, entry / ARCHIVE
    if not (meta.is_file() and archive.is_file()):
        return None
    data = json.loads(meta.read_text())
    return Image(ref=data["ref"], archive=archive, id=data["id"])


@contextlib.contextmanager
def _staged(entry: Path) -> Iterator[Path]:
    """A scratch directory beside ``entry`` that becomes ``entry`` when the block succeeds, and vanishes if not."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    tmp.chmod(0o755)
    try:
        yield tmp
        if entry.exists():
            shutil.rmtree(entry)
        os.replace(tmp, entry)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _publish(name: str, key: str, ref: str, produce: Callable[[Path, Path], None], extra: dict[str, object]) -> Image:
    """Run produce(archive, log_file) in a scratch directory, then move the finished entry into place."""
    entry = _entry_dir(name, key)
    with _staged(entry) as tmp:
        started = time.monotonic()
        produce(tmp / ARCHIVE, _fresh_log(name))
        image_id = archive_image_id(tmp / ARCHIVE)
        (tmp / META).write_text(json.dumps({
            "ref": ref, "id": image_id, "key": key,
            "build_seconds": round(time.monotonic() - started, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **extra,
        }, indent=2) + "\n")
    _prune(images_root(), name)
    return Image(ref=ref, archive=entry / ARCHIVE, id=image_id)


def _build_once(name: str, key: str, ref: str, prepare: Callable[[], Callable[[Path, Path], None]],
                extra: dict[str, object]) -> Image:
    """The cached image for ``key``, or one built now: ``prepare`` runs under the build lock (only when building)
    and returns the produce(archive, log_file) step for _publish."""
    found = _cached(name, key)
    if found:
        return found
    with _locked(images_root()):
        found = _cached(name, key)
        if found:
            return found
        return _publish(name, key, ref, prepare(), extra)


def _fresh_log(name: str) -> Path:
    """The log of the latest build of `name`, beside (not inside) the entry, so a failed build's log stays."""
    path = images_root() / f"{name}.build.log"
    path.write_text("")
    return path


def _prune(root: Path, name: str) -> None:
    pattern = re.compile(re.escape(name) + r"-[0-9a-f]{16}")
    entries = [p for p in root.iterdir() if p.is_dir() and pattern.fullmatch(p.name)]
    entries.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)


def archive_image_id(archive: Path) -> str:
    """The config digest of the single image in an OCI archive; also checks the archive's OCI layout."""
    try:
        with tarfile.open(archive) as tar:
            names = set(tar.getnames())
            if "oci-layout" not in names or "index.json" not in names:
                raise ImageBuildError(f"{archive} is not an OCI layout (no oci-layout or index.json)")

            def blob(digest: str) -> dict[str, object]:
                f = tar.extractfile("blobs/" + digest.replace(":", "/", 1))
                assert f is not None
                data: dict[str, object] = json.load(f)
                return data

            index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
            manifests = index.get("manifests") or []
            if len(manifests) != 1:
                raise ImageBuildError(f"{archive} holds {len(manifests)} manifests, expected one")
            manifest = blob(manifests[0]["digest"])
            config = manifest["config"]
            assert isinstance(config, dict)
            return str(config["digest"])
    except (tarfile.TarError, KeyError, OSError, ValueError) as exc:
        raise ImageBuildError(f"{archive} is not a readable OCI archive: {exc}") from None


# ----------------------------------------------------------------------------------------------------------------
# The base: debian:trixie-slim from Debian packages


def _mmdebstrap_version(exe: str) -> str:
    return _run([exe, "--version"], timeout=60).strip()


def _base_key(mmdebstrap: str) -> str:
    return _hash(s.encode() for s in (RECIPE, BASE_SUITE, BASE_VARIANT, _mmdebstrap_version(mmdebstrap),
                                      *BASE_DPKG_OPTS, BASE_APT_CONF))


def _base_tarball(log: Log) -> tuple[Path, str]:
    """The bootstrapped root file system as a tarball, cached; (path, key)."""
    mmdebstrap = _require("mmdebstrap", "mmdebstrap")
    key = _base_key(mmdebstrap)
    name = f"debian-{BASE_SUITE}-{BASE_VARIANT}"
    entry = _entry_dir(name, key)
    tarball = entry / "rootfs.tar"
    if tarball.is_file():
        return tarball, key
    root = images_root()
    with _locked(root):
        if tarball.is_file():
            return tarball, key
        log(f"base: mmdebstrap --variant={BASE_VARIANT} {BASE_SUITE} (Debian's default mirror)")
        with _staged(entry) as tmp:
            cmd = [mmdebstrap, f"--variant={BASE_VARIANT}", "--format=tar"]
            cmd += [f"--dpkgopt={opt}" for opt in BASE_DPKG_OPTS]
            cmd.append(f"--customize-hook=printf '%s\\n' '{BASE_APT_CONF}' > \"$1/etc/apt/apt.conf.d/90slim\"")
            # mmdebstrap copies in the host's resolver config and hostname; the runtime provides both per container.
            cmd.append('--customize-hook=rm -f "$1/etc/resolv.conf" "$1/etc/hostname"')
            cmd += [BASE_SUITE, str(tmp / "bootstrap.tar")]
            _run(cmd, timeout=1800, log_file=_fresh_log(name))
            _without_dev_nodes(tmp / "bootstrap.tar", tmp / "rootfs.tar")
            (tmp / "bootstrap.tar").unlink()
        _prune(root, name)
    return tarball, key


def _without_dev_nodes(src: Path, dest: Path) -> None:
    """Copy a tarball without what is under ./dev: mmdebstrap populates it, but images leave /dev to the runtime
    (which mounts its own there), as Debian's images do."""
    with tarfile.open(src) as tin, tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tout:
        for member in tin:
            if member.name.removeprefix("./").startswith("dev/"):
                continue
            tout.addfile(member, tin.extractfile(member) if member.isreg() else None)


BASE_KEY_LABEL = "io.github.gpu-health-device-plugin.base-key"


def _ensure_base(buildah: Buildah, log: Log) -> str:
    """BASE_REF in our storage, made from the current tarball; returns the base key."""
    tarball, key = _base_tarball(log)
    with _locked(images_root()):
        if buildah.label(BASE_REF, BASE_KEY_LABEL) == key:
            return key
        log(f"base: committing {BASE_REF}")
        ctr = buildah("from", "--pull=never", "scratch", timeout=120).strip()
        try:
            buildah("add", ctr, str(tarball), "/", timeout=1200)
            # What Debian's own images set: a shell as the command and the standard PATH.
            buildah("config", "--cmd", '["bash"]',
                    "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "--label", f"{BASE_KEY_LABEL}={key}", ctr, timeout=120)
            buildah("commit", "--quiet", "--rm", ctr, BASE_REF, timeout=1200)
        except BaseException:
            with contextlib.suppress(ImageBuildError):
                buildah("rm", ctr, timeout=120)
            raise
        with contextlib.suppress(ImageBuildError):
            buildah("rmi", "--prune", timeout=300)  # the previous base, now untagged
    return key


# ----------------------------------------------------------------------------------------------------------------
# The plugin image


def _context_paths() -> list[str]:
    """What .dockerignore lets into the build context (an allow-list): the files a `docker build .` would send."""
    paths = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line.startswith("!"):
            paths.append(line[1:].rstrip("/"))
    return paths


def _stage_context(dest: Path) -> None:
    """A copy of the build context holding only the allow-listed paths: the hash covers exactly what is built, and
    buildah does not walk the repository's virtual environments and caches."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")
    for rel in _context_paths():
        src = REPO / rel
        if src.is_dir():
            shutil.copytree(src, dest / rel, ignore=skip, symlinks=True)
        elif src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    shutil.copy2(REPO / ".dockerignore", dest / ".dockerignore")


HOST_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
HOST_PIP_CONF = Path("/etc/pip.conf")


def _trust_mounts(stage: Path) -> list[str]:
    """Bind mounts that give the build's RUN steps the host's trust, chosen from what the host has.

    Behind a TLS-inspecting proxy, pip inside the build reaches the package index only if it trusts the proxy's CA,
    which only the host's bundle holds. Handing the build that trust at build time, rather than in the Dockerfile,
    keeps the Dockerfile and image the ones everyone else builds. The bundle goes where Debian takes local CAs
    from: the image's own ca-certificates (installed for pip) folds it into the bundle it generates, which pip
    uses. The host's /etc/ssl/certs itself cannot be lent: that package rewrites the directory on install. The
    host's pip.conf comes along where there is one, as a site-wide config pip also reads, because it may be what
    points pip at that bundle (or at a mirror).

    Directories are mounted, not files: buildah leaves an empty mount point behind in the image, and an empty
    directory there is harmless where an empty .crt or pip.conf would not be. The copies in `stage` keep the
    host's directories themselves out of reach; all mounts are read-only.
    """
    mounts: list[str] = []
    if HOST_BUNDLE.is_file():
        (stage / "ca").mkdir(parents=True)
        shutil.copyfile(HOST_BUNDLE, stage / "ca" / "host-trust.crt")
        mounts += ["--volume", f"{stage / 'ca'}:/usr/local/share/ca-certificates:ro"]
    if HOST_PIP_CONF.is_file():
        (stage / "pip").mkdir(parents=True)
        shutil.copyfile(HOST_PIP_CONF, stage / "pip" / "pip.conf")
        mounts += ["--volume", f"{stage / 'pip'}:/etc/xdg/pip:ro"]
    return mounts


def _plugin_key(context: Path, base_key: str, version: str, buildah: Buildah) -> str:
    dockerfile = (REPO / "Dockerfile").read_bytes()
    return _hash([RECIPE.encode(), buildah.version.encode(), base_key.encode(), version.encode(), dockerfile,
                  *_tree_parts(context)])


def build_plugin(log: Log | None = None, *, buildah: Buildah | None = None) -> Image:
    """localhost/gpu-health-device-plugin:<version> from the project's Dockerfile."""
    log = log or _quiet
    buildah = buildah or Buildah(images_root())
    version = plugin_version()
    ref = f"{PLUGIN_NAME}:{version}"
    # Known from mmdebstrap's version alone, so a cached plugin image is found without touching the base.
    base_key = _base_key(_require("mmdebstrap", "mmdebstrap"))
    with tempfile.TemporaryDirectory(prefix="plugin-context.") as tmp:
        context = Path(tmp)
        _stage_context(context)
        key = _plugin_key(context, base_key, version, buildah)

        def produce(archive: Path, log_file: Path) -> None:
            b = buildah.with_log(log_file)
            created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            try:
                b("bud", "--pull=never", "--isolation", "chroot", "--layers=false",
                  "--file", str(REPO / "Dockerfile"), "--tag", ref,
                  "--build-arg", f"BASE_IMAGE={BASE_REF}",
                  "--build-arg", f"VERSION={version}",
                  # Content-derived, so the label names the inputs without defeating the cache.
                  "--build-arg", f"REVISION=local-{key}",
                  "--build-arg", f"CREATED={created}",
                  *_trust_mounts(archive.parent / "trust"), str(context), timeout=3600)
                b.push_archive(ref, archive)
            finally:
                b.remove_image(ref)
                shutil.rmtree(archive.parent / "trust", ignore_errors=True)

        def prepare() -> Callable[[Path, Path], None]:
            if _ensure_base(buildah, log) != base_key:
                raise ImageBuildError("mmdebstrap changed during the build; run again")
            log(f"plugin: buildah bud -f Dockerfile -t {ref} (pip downloads the wheels' dependencies)")
            return produce

        return _build_once("plugin", key, ref, prepare, {"version": version})


REVISION_LABEL = "org.opencontainers.image.revision"


def rebuild_plugin(tag: str, log: Log | None = None) -> Image:
    """Another plugin image, localhost/gpu-health-device-plugin:<tag>: the built one with the revision label
    changed, so its content is the same and its image ID is not (what a DaemonSet rolling update needs)."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", tag):
        raise ImageBuildError(f"not a valid image tag: {tag!r}")
    log = log or _quiet
    buildah = Buildah(images_root())
    original = build_plugin(log, buildah=buildah)
    ref = f"{PLUGIN_NAME}:{tag}"
    name = f"plugin-tag-{tag}"
    key = _hash([RECIPE.encode(), original.id.encode(), tag.encode()])

    def produce(archive: Path, log_file: Path) -> None:
        b = buildah.with_log(log_file)
        ctr = b("from", "--pull=always", f"oci-archive:{original.archive}", timeout=1200).strip()
        info = b.inspect(ctr, "container")
        source_id = str(info["FromImageID"])
        try:
            revision = (info["OCIv1"]["config"].get("Labels") or {}).get(REVISION_LABEL, "unknown")
            b("config", "--label", f"{REVISION_LABEL}={revision}+{tag}", ctr, timeout=120)
            b("commit", "--quiet", "--rm", ctr, ref, timeout=1200)
            b.push_archive(ref, archive)
        finally:
            with contextlib.suppress(ImageBuildError):
                b("rm", ctr, timeout=120)
            b.remove_image(ref)
            b.remove_image(source_id)

    def prepare() -> Callable[[Path, Path], None]:
        log(f"plugin: {ref} from {original.ref} with a new revision label")
        return produce

    return _build_once(name, key, ref, prepare, {"from": original.ref, "from_id": original.id})


# ----------------------------------------------------------------------------------------------------------------
# The pause and workload images: a file tree in an empty image


def _scratch_image(buildah: Buildah, layer: Path, ref: str, archive: Path, config: Sequence[str]) -> None:
    ctr = buildah("from", "--pull=never", "scratch", timeout=120).strip()
    try:
        buildah("add", ctr, str(layer), "/", timeout=600)
        buildah("config", *config, ctr, timeout=120)
        buildah("commit", "--quiet", "--rm", ctr, ref, timeout=600)
        buildah.push_archive(ref, archive)
    except BaseException:
        with contextlib.suppress(ImageBuildError):
            buildah("rm", ctr, timeout=120)
        raise
    finally:
        buildah.remove_image(ref)


def _layer_tar(path: Path, entries: Iterable[tuple[str, Path | str | None, int]]) -> None:
    """A root-owned layer tarball with fixed times: (name, source file | symlink target | None for a dir, mode)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, source, mode in entries:
            info = tarfile.TarInfo(name)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            info.mode = mode
            if source is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif isinstance(source, str):
                info.type = tarfile.SYMTYPE
                info.linkname = source
                tar.addfile(info)
            else:
                info.size = source.stat().st_size
                with source.open("rb") as f:
                    tar.addfile(info, f)


def _pause_binary() -> Path:
    try:
        exe: Path = gobuild.build(PAUSE_DIR, ".", "pause", {"CGO_ENABLED": "0"}, version="3.10",
                                  ldflags="-s -w")
    except (gobuild.GoToolchainMissing, gobuild.GoBuildError) as exc:
        raise ImageBuildError(f"pause: {_tail(str(exc))}") from None
    return Path(exe)


def build_pause(log: Log | None = None, *, buildah: Buildah | None = None) -> Image:
    """localhost/pause:3.10: our static Go sandbox process as /pause in an empty image."""
    log = log or _quiet
    buildah = buildah or Buildah(images_root())
    exe = _pause_binary()
    key = _hash([RECIPE.encode(), buildah.version.encode(), PAUSE_REF.encode(), exe.read_bytes()])

    def produce(archive: Path, log_file: Path) -> None:
        layer = archive.with_name("layer.tar")
        _layer_tar(layer, [("pause", exe, 0o755)])
        _scratch_image(buildah.with_log(log_file), layer, PAUSE_REF, archive,
                       ["--entrypoint", '["/pause"]', "--cmd", "", "--os", "linux"])
        layer.unlink()

    def prepare() -> Callable[[Path, Path], None]:
        log(f"pause: {PAUSE_REF}")
        return produce

    return _build_once("pause", key, PAUSE_REF, prepare, {})


def _busybox() -> tuple[Path, str]:
    """Debian's static busybox and its package version."""
    candidates = [Path("/bin/busybox"), Path("/usr/bin/busybox")]
    exe = next((p for p in candidates if p.is_file()), None)
    try:
        version = _run(["dpkg-query", "-W", "-f", "${Version}", "busybox-static"], timeout=60).strip()
    except ImageBuildError:
        version = ""
    if exe is None or not version:
        raise ImageBuildError("busybox-static is not installed (Debian: apt-get install busybox-static); "
                              "the workload image needs a statically linked busybox")
    return exe, version


def build_workload(log: Log | None = None, *, buildah: Buildah | None = None) -> Image:
    """localhost/gpu-health-workload:1: busybox with its applets linked at their usual paths, for test pods."""
    log = log or _quiet
    buildah = buildah or Buildah(images_root())
    exe, version = _busybox()
    key = _hash([RECIPE.encode(), buildah.version.encode(), WORKLOAD_REF.encode(), version.encode(),
                 exe.read_bytes()])

    def prepare() -> Callable[[Path, Path], None]:
        log(f"workload: {WORKLOAD_REF} (busybox-static {version})")
        applets = _run([str(exe), "--list-full"], timeout=60).split()

        def produce(archive: Path, log_file: Path) -> None:
            entries: list[tuple[str, Path | str | None, int]] = [
                (d, None, 0o755) for d in ("bin", "sbin", "usr", "usr/bin", "usr/sbin", "etc")]
            entries += [("tmp", None, 0o1777), ("bin/busybox", exe, 0o755)]
            for applet in sorted(set(applets)):
                if applet == "bin/busybox" or "/" not in applet:
                    continue
                depth = applet.count("/")
                entries.append((applet, "../" * depth + "bin/busybox", 0o777))
            layer = archive.with_name("layer.tar")
            _layer_tar(layer, entries)
            _scratch_image(buildah.with_log(log_file), layer, WORKLOAD_REF, archive,
                           ["--cmd", '["/bin/sh"]', "--env", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "--os", "linux"])
            layer.unlink()

        return produce

    return _build_once("workload", key, WORKLOAD_REF, prepare, {"busybox": version})


# ----------------------------------------------------------------------------------------------------------------


def build_images(log: Log | None = None) -> dict[str, Image]:
    """Build or reuse the cluster's images: {"plugin", "pause", "workload"} -> Image."""
    log = log or _quiet
    buildah = Buildah(images_root())
    _require("mmdebstrap", "mmdebstrap")
    result: dict[str, Image] = {}
    for name, build in (("pause", build_pause), ("workload", build_workload), ("plugin", build_plugin)):
        started = time.monotonic()
        result[name] = build(log, buildah=buildah)
        log(f"{name}: {result[name].ref} ready in {time.monotonic() - started:.1f}s")
    return result


def check_images(images: dict[str, Image], log: Log | None = None) -> None:
    """Run each image once from its archive (buildah run, chroot isolation): the plugin's CLI on Debian's python3,
    a shell in the workload image, and the pause binary's presence (it would block forever if run)."""
    log = log or _quiet
    buildah = Buildah(images_root())
    checks: dict[str, list[str]] = {
        "plugin": ["gpu-health-plugin", "--help"],
        "workload": ["sh", "-c", 'echo "$0 ok"; env | grep -q PATH && sleep 0 && cat /dev/null && ls /bin/sh'],
    }
    with _locked(images_root()):
        for name, image in images.items():
            ctr = buildah("from", "--pull=always", f"oci-archive:{image.archive}", timeout=1200).strip()
            image_id = str(buildah.inspect(ctr, "container")["FromImageID"])
            try:
                if name == "pause":
                    mount = buildah("mount", ctr, timeout=120).strip()
                    if not os.access(os.path.join(mount, "pause"), os.X_OK):
                        raise ImageBuildError(f"{image.ref}: /pause missing or not executable")
                    buildah("umount", ctr, timeout=120)
                    out = "/pause present"
                else:
                    out = buildah("run", "--isolation", "chroot", ctr, "--", *checks[name.partition(":")[0]],
                                  timeout=300)
                log(f"check {image.ref}: {' / '.join(out.split(chr(10))[:2])}")
            finally:
                with contextlib.suppress(ImageBuildError):
                    buildah("rm", ctr, timeout=120)
                buildah.remove_image(image_id)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rebuild-plugin", metavar="TAG", help="also make localhost/gpu-health-device-plugin:TAG")
    parser.add_argument("--check", action="store_true", help="run each image once after building")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        images = build_images(_stderr)
        if args.rebuild_plugin:
            images[f"plugin:{args.rebuild_plugin}"] = rebuild_plugin(args.rebuild_plugin, _stderr)
        if args.check:
            check_images(images, _stderr)
    except ImageBuildError as exc:
        print("error: " + " | ".join(line.strip() for line in str(exc).splitlines() if line.strip()),
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    _stderr(f"images: {time.monotonic() - started:.1f}s in all")
    out = {name: {k: str(v) for k, v in asdict(image).items()} for name, image in images.items()}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
