"""The test side of the NVML stand-in (tests/nvml_standin): build it, load it where pynvml will find it, drive it.

In process: ``load_in_process()`` once, before anything imports and initialises pynvml; then each test points
``GHDP_NVML_STANDIN_NODE`` at its own node file (``use_node``) around ``nvmlInit`` ... ``nvmlShutdown``. In a child
process: ``env_for_subprocess(node_file)`` gives the environment under which the child's pynvml loads the stand-in.

A missing gcc or go skips the test locally and fails it under CI=true (``library_dir_or_skip``).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from plugin.devices.simulated import builtin_node
from scripts.nvmlstandin import LIBRARY, StandinBuildError, StandinToolchainMissing, build

ENV_NODE = "GHDP_NVML_STANDIN_NODE"

_lib: ctypes.CDLL | None = None


def library_dir() -> Path:
    """The directory holding the built libnvidia-ml.so.1 (built and cached on first use)."""
    return build()


def library_dir_or_skip() -> Path:
    """library_dir(), skipping the test when gcc/go are missing or the module proxy is unreachable; under CI=true
    every such case fails instead (a CI that cannot build the stand-in has lost its NVML coverage)."""
    import pytest

    in_ci = os.environ.get("CI") == "true"
    try:
        return library_dir()
    except StandinToolchainMissing as exc:
        failure = f"{exc}; CI=true, so this is a failure" if in_ci else None
        skip = f"NVML stand-in not built: {exc}"
    except StandinBuildError as exc:
        failure = None if (exc.looks_like_network and not in_ci) else str(exc)
        skip = f"NVML stand-in not built: nvml.h could not be downloaded (offline?): {str(exc).splitlines()[0]}"
    if failure is not None:
        pytest.fail(failure, pytrace=False)
    pytest.skip(skip)


def _loaded_nvml() -> list[str]:
    """Paths of every libnvidia-ml mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps.splitlines() if "libnvidia-ml" in line.split()[-1]})


def load_in_process(lib_dir: Path | None = None) -> ctypes.CDLL:
    """Load the stand-in globally, so pynvml's later ``CDLL("libnvidia-ml.so.1")`` resolves to it by soname (the
    loader reads LD_LIBRARY_PATH once, at process start). Children get it through ``env_for_subprocess``, never by
    a changed environment here, so a test of a node without the driver stays one. Fails loudly if another
    libnvidia-ml (a real driver's) is already loaded: the tests would then drive real GPUs, or mix two libraries."""
    global _lib
    lib_dir = lib_dir or library_dir()
    path = lib_dir / LIBRARY
    if _lib is None:
        others = [p for p in _loaded_nvml() if Path(p).resolve() != path.resolve()]
        if others:
            raise RuntimeError(f"another libnvidia-ml is already loaded in this process: {others}; the NVML "
                               "stand-in must be loaded before pynvml initialises")
        _lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        _declare(_lib)
    import pynvml

    if pynvml.nvmlLib is not None and getattr(pynvml.nvmlLib, "_name", None) not in (str(path), LIBRARY):
        raise RuntimeError(f"pynvml already loaded {pynvml.nvmlLib._name}, not the NVML stand-in")
    return _lib


def _declare(lib: ctypes.CDLL) -> None:
    lib.ghdpStandinViolationCount.restype = ctypes.c_int
    lib.ghdpStandinViolation.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    lib.ghdpStandinViolation.restype = ctypes.c_int
    lib.ghdpStandinResetViolations.restype = None
    lib.ghdpStandinCallCount.argtypes = [ctypes.c_char_p]
    lib.ghdpStandinCallCount.restype = ctypes.c_ulonglong
    lib.ghdpStandinResetCallCounts.restype = None


def _library() -> ctypes.CDLL:
    if _lib is None:
        raise RuntimeError("the NVML stand-in is not loaded in this process: call load_in_process() first")
    return _lib


def violations() -> list[str]:
    """The violations kept by the library (the last 64), oldest first."""
    lib = _library()
    out = []
    buf = ctypes.create_string_buffer(512)
    for i in range(min(lib.ghdpStandinViolationCount(), 64)):
        if lib.ghdpStandinViolation(i, buf, len(buf)) == 0:
            out.append(buf.value.decode(errors="replace"))
    return out


def violation_count() -> int:
    return int(_library().ghdpStandinViolationCount())


def reset_violations() -> None:
    _library().ghdpStandinResetViolations()


def call_count(symbol: str) -> int:
    """Calls of one exported NVML symbol, by its exact name (``nvmlDeviceGetCount_v2``)."""
    return int(_library().ghdpStandinCallCount(symbol.encode()))


def reset_call_counts() -> None:
    _library().ghdpStandinResetCallCounts()


def env_for_subprocess(node_file: os.PathLike[str] | str, lib_dir: Path | None = None,
                       base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment in which a child's pynvml loads the stand-in, driven by ``node_file``."""
    env = dict(os.environ if base is None else base)
    lib_dir = lib_dir or library_dir()
    paths = [str(lib_dir), *[p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]]
    env["LD_LIBRARY_PATH"] = ":".join(dict.fromkeys(paths))
    env[ENV_NODE] = str(node_file)
    return env


@contextlib.contextmanager
def use_node(node_file: os.PathLike[str] | str) -> Iterator[None]:
    """Point this process's stand-in at ``node_file`` for the block (read at each nvmlInit)."""
    before = os.environ.get(ENV_NODE)
    os.environ[ENV_NODE] = str(node_file)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_NODE, None)
        else:
            os.environ[ENV_NODE] = before


@contextlib.contextmanager
def initialised(node_file: os.PathLike[str] | str) -> Iterator[Any]:
    """``use_node`` plus nvmlInit/nvmlShutdown around the block; yields the pynvml module."""
    import pynvml

    with use_node(node_file):
        pynvml.nvmlInit()
        try:
            yield pynvml
        finally:
            pynvml.nvmlShutdown()


# What NVML calls each of the stand-in's profiles (tests/nvml_standin/standin.c's PROFILES).
MODEL_NAMES = {"a100-sxm": "NVIDIA A100-SXM4-80GB", "h100-sxm": "NVIDIA H100 80GB HBM3",
               "h100-pcie": "NVIDIA H100 PCIe", "l40s": "NVIDIA L40S", "t4": "Tesla T4", "gb200": "NVIDIA GB200"}


class StandinNode:
    """A node file for the stand-in, rewritten atomically the way tests/conftest.py's NodeFile does: ``set`` changes
    a GPU's signals, ``nvml`` its stand-in-only keys (profile behaviour, forced failures, hangs, crashes)."""

    def __init__(self, path: Path, doc: dict[str, Any] | None = None, *, profile: str | None = None,
                 driver_version: str | None = None) -> None:
        self.path = path
        self.doc = copy.deepcopy(doc or builtin_node())
        top = self.doc.setdefault("nvml", {})
        if profile is not None:
            top["profile"] = profile
        if driver_version is not None:
            top["driver_version"] = driver_version
        self.write()

    @classmethod
    def of_profile(cls, path: Path, profile: str) -> StandinNode:
        """The built-in 8-GPU node as GPUs of ``profile``, each named as NVML names that model: the name is what
        per-model settings (nvlinkExpectedLinks) and the crashed-call memory key on."""
        doc = builtin_node()
        for gpu in doc["gpus"]:
            gpu["name"] = MODEL_NAMES[profile]
        return cls(path, doc, profile=profile)

    @property
    def uuids(self) -> list[str]:
        return [g["uuid"] for g in self.doc["gpus"]]

    def gpu(self, index: int) -> dict[str, Any]:
        """The entry at position ``index`` of the file's ``gpus`` list (mutate it, then ``write``)."""
        gpu: dict[str, Any] = self.doc["gpus"][index]
        return gpu

    def write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.doc))
        os.replace(tmp, self.path)

    def set(self, index: int, **signals: Any) -> None:
        """Set (None: remove) signals of GPU ``index`` and rewrite the file."""
        sig = self.doc["gpus"][index].setdefault("signals", {})
        for k, v in signals.items():
            if v is None:
                sig.pop(k, None)
            else:
                sig[k] = v
        self.write()

    def nvml(self, index: int | None, **overrides: Any) -> None:
        """Set (None: remove) keys of GPU ``index``'s ``nvml`` object, or of the top-level one when index is None,
        and rewrite the file."""
        target = self.doc if index is None else self.doc["gpus"][index]
        nv = target.setdefault("nvml", {})
        for k, v in overrides.items():
            if v is None:
                nv.pop(k, None)
            else:
                nv[k] = v
        self.write()

    def append_xid(self, index: int, xid: int) -> None:
        sig = self.doc["gpus"][index].setdefault("signals", {})
        sig["xid_events"] = [*sig.get("xid_events", []), xid]
        self.write()

    def remove_gpu(self, index: int) -> dict[str, Any]:
        gpu: dict[str, Any] = self.doc["gpus"].pop(index)
        self.write()
        return gpu


def open_backend(directory: Path, uuid_prefix: str | None = None, **node: Any) -> tuple[Any, StandinNode]:
    """The real NvmlBackend over the real pynvml on the stand-in, with the built-in 8-GPU node written in
    ``directory`` (``uuid_prefix``: GPUs named ``<prefix><index>``, as fixtures that predate the stand-in expect).
    Loads the library first (skip locally, fail under CI=true where it cannot be built). The caller closes it."""
    from plugin.devices.nvml import NvmlBackend

    load_in_process(library_dir_or_skip())
    doc = builtin_node()
    if uuid_prefix is not None:
        for g in doc["gpus"]:
            g["uuid"] = f"{uuid_prefix}{g['index']}"
    directory.mkdir(parents=True, exist_ok=True)
    n = StandinNode(directory / "nvml-node.json", doc, **node)
    with use_node(n.path):
        return NvmlBackend(), n


def next_events(backend: Any, count: int, timeout_s: float = 5.0) -> list[Any]:
    """Events as they come: each wait returns as soon as the stand-in queues one (a node-file rewrite wakes it)."""
    import time

    deadline = time.monotonic() + timeout_s
    got: list[Any] = []
    while len(got) < count and time.monotonic() < deadline:
        got.extend(backend.wait_events(1.0))
    return got


def wait_state(state: Any, predicate: Any, timeout_s: float = 10.0) -> Any:
    """The first snapshot of a NodeState that satisfies ``predicate``, woken by each publish; the last one seen at
    the deadline."""
    import time

    deadline = time.monotonic() + timeout_s
    snap = state.snapshot()
    while not predicate(snap) and time.monotonic() < deadline:
        snap = state.wait_for_change(snap.version, max(0.0, deadline - time.monotonic()))
    return snap
