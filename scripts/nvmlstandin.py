"""Build the NVML stand-in (tests/nvml_standin/*.c) as libnvidia-ml.so.1 once, and reuse it.

The library is compiled against NVIDIA's own nvml.h, force-included, so that every exported function is checked
against NVIDIA's prototype: a wrong signature is a compile error, not a silent ABI mismatch. The header comes from
the Go module github.com/NVIDIA/go-nvml (its ``pkg/nvml/nvml.h``), fetched through the Go module proxy into a
private GOPATH under the cache. The result is cached beside the Go peers (scripts/gobuild.py's ``cache_root()``):

    ~/.cache/gpu-health-device-plugin/nvml-standin-<go-nvml version>-<hash>/libnvidia-ml.so.1

keyed by the C sources, the header's version and content, and the gcc version. Standard library only.

    python scripts/nvmlstandin.py          # prints the directory holding libnvidia-ml.so.1
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `scripts.gobuild` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.gobuild import GoBuildError, cache_root, find_go

# The newest go-nvml whose nvml.h declares nvmlGpuFabricInfo_v3_t with healthSummary (what the backend reads).
GO_NVML_MODULE = "github.com/NVIDIA/go-nvml"
GO_NVML_VERSION = "v0.13.4-1"
REQUIRED_DECLARATIONS = ("nvmlGpuFabricInfo_v3_t", "healthSummary", "nvmlDeviceGetGpuFabricInfoV")
SOURCE_DIR = Path(__file__).resolve().parent.parent / "tests" / "nvml_standin"
LIBRARY = "libnvidia-ml.so.1"
CFLAGS = ("-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-Wmissing-prototypes", f"-Wl,-soname,{LIBRARY}")


class StandinToolchainMissing(RuntimeError):
    """gcc or go (needed for NVIDIA's nvml.h) is not installed."""


class StandinBuildError(GoBuildError):
    """Fetching nvml.h (through Go's module download) or compiling the stand-in failed; ``output`` holds the tool's
    output, and ``looks_like_network`` tells an unreachable module proxy from broken code, as for the Go peers."""


def find_gcc() -> str | None:
    return shutil.which(os.environ.get("CC", "gcc")) or shutil.which("gcc")


def _run(cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 600) -> str:
    try:
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise StandinBuildError(f"{cmd[0]} timed out after {timeout:.0f}s", str(exc.output or "")) from exc
    output = (proc.stdout or "") + (proc.stderr or "")
    if proc.returncode != 0:
        raise StandinBuildError(f"{' '.join(cmd[:3])} ... failed ({proc.returncode}):\n{output[-4000:]}", output)
    return proc.stdout


def _go_env(gopath: Path) -> dict[str, str]:
    env = dict(os.environ)
    # A private GOPATH: the module cache's files are read-only, and nothing of the user's Go setup is touched.
    env.update({"GOPATH": str(gopath), "GOMODCACHE": str(gopath / "pkg" / "mod"), "GOFLAGS": "-mod=mod",
                "GO111MODULE": "on", "GOWORK": "off"})
    return env


def nvml_header(go: str | None = None) -> Path:
    """NVIDIA's nvml.h from the pinned go-nvml, downloaded once into the cache."""
    go = go or find_go()
    if go is None:
        raise StandinToolchainMissing("no Go toolchain found: it fetches NVIDIA's nvml.h (github.com/NVIDIA/go-nvml)")
    root = cache_root()
    gopath = root / "nvml-standin-gopath"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nvml-standin-mod-") as tmp:
        # `go mod download` of an explicit version needs a module to run in, not its content.
        Path(tmp, "go.mod").write_text("module nvmlstandin\n\ngo 1.22\n")
        out = _run([go, "mod", "download", "-json", f"{GO_NVML_MODULE}@{GO_NVML_VERSION}"],
                   env=_go_env(gopath), cwd=Path(tmp))
    info = json.loads(out)
    if info.get("Error"):
        raise StandinBuildError(f"go mod download {GO_NVML_MODULE}@{GO_NVML_VERSION}: {info['Error']}", info["Error"])
    header = Path(info["Dir"]) / "pkg" / "nvml" / "nvml.h"
    text = header.read_text(errors="replace")
    missing = [name for name in REQUIRED_DECLARATIONS if name not in text]
    if missing:
        raise StandinBuildError(f"{header} lacks {', '.join(missing)}: pin a newer {GO_NVML_MODULE}")
    return header


def gcc_version(gcc: str) -> str:
    return _run([gcc, "--version"]).splitlines()[0].strip()


def _sources() -> list[Path]:
    return sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".c", ".h"))


def build_key(header: Path, gcc: str) -> str:
    h = hashlib.sha256()
    for item in (GO_NVML_VERSION, gcc_version(gcc), " ".join(CFLAGS)):
        h.update(item.encode() + b"\0")
    h.update(header.read_bytes() + b"\0")
    for path in _sources():
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def build() -> Path:
    """The directory holding libnvidia-ml.so.1, built if not cached. Raises StandinToolchainMissing or
    StandinBuildError."""
    gcc = find_gcc()
    if gcc is None:
        raise StandinToolchainMissing("no C compiler found (gcc): it builds the NVML stand-in library")
    header = nvml_header()
    root = cache_root()
    target = root / f"nvml-standin-{GO_NVML_VERSION}-{build_key(header, gcc)}"
    if (target / LIBRARY).is_file():
        return target
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be building the same key
        if (target / LIBRARY).is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        try:
            sources = [str(p) for p in _sources() if p.suffix == ".c"]
            _run([gcc, *CFLAGS, "-include", str(header), "-o", str(tmp / LIBRARY), *sources, "-lpthread"])
            (tmp / "build.json").write_text(json.dumps({
                "go_nvml": GO_NVML_VERSION, "gcc": gcc_version(gcc), "sources": [Path(s).name for s in sources],
            }, indent=2) + "\n")
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    _prune(root, "nvml-standin-v", keep=3)
    return target


def _prune(root: Path, prefix: str, keep: int) -> None:
    entries = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(prefix)]
    entries.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def main() -> int:
    try:
        print(build())
    except (StandinToolchainMissing, StandinBuildError) as exc:
        print(f"nvmlstandin: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
