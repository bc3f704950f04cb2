#!/usr/bin/env python3
"""Regenerate the Python code and type stubs for every .proto under api/.

Run from anywhere: `python scripts/gen_protos.py`. `--check` regenerates into a temporary tree and exits 1 when
the committed files differ (the test suite calls it that way), so stale generated code cannot land.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def protos() -> list[Path]:
    return sorted(p.relative_to(ROOT) for p in (ROOT / "api").rglob("*.proto"))


def generate(out: Path) -> None:
    from grpc_tools import protoc  # imported late: only this script needs grpcio-tools

    plugin = shutil.which("protoc-gen-mypy")
    plugin_grpc = shutil.which("protoc-gen-mypy_grpc")
    if plugin is None or plugin_grpc is None:
        sys.exit("mypy-protobuf is not installed (protoc-gen-mypy not on PATH)")
    include = str(Path(protoc.__file__).parent / "_proto")
    for proto in protos():
        args = [
            "protoc",
            f"-I{ROOT}",
            f"-I{include}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--plugin=protoc-gen-mypy={plugin}",
            f"--plugin=protoc-gen-mypy_grpc={plugin_grpc}",
            f"--mypy_out={out}",
            f"--mypy_grpc_out={out}",
            str(ROOT / proto),
        ]
        if protoc.main(args) != 0:
            sys.exit(f"protoc failed for {proto}")


def generated_files(base: Path) -> set[Path]:
    return {
        p.relative_to(base)
        for p in (base / "api").rglob("*")
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail when committed code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generate(out)
        fresh = generated_files(out)
        if args.check:
            current = generated_files(ROOT)
            stale = sorted(
                str(p) for p in fresh | current
                if p not in fresh or p not in current or not filecmp.cmp(out / p, ROOT / p, shallow=False)
            )
            if stale:
                print("generated code is stale; run scripts/gen_protos.py:", *stale, sep="\n  ")
                return 1
            return 0
        for rel in fresh:
            (ROOT / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(out / rel, ROOT / rel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
