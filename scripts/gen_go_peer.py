#!/usr/bin/env python3
"""Regenerate the Go code of the NVSentinel conformance peer (tests/conformance/nvsentinel/gen) from api/nvsentinel.

protoc is grpcio-tools' own; protoc-gen-go and protoc-gen-go-grpc are built from the versions pinned in
tests/conformance/nvsentinel/tools/go.mod (cached by scripts/gobuild.py). Our protos carry no go_package, so the
Go import paths are given as M options here instead of editing the contract files.

    python scripts/gen_go_peer.py           # rewrite gen/
    python scripts/gen_go_peer.py --check   # exit 1 when the committed gen/ is stale
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make `scripts.gobuild` importable
    sys.path.insert(0, str(ROOT))

from scripts.gobuild import build  # noqa: E402

PEER = ROOT / "tests" / "conformance" / "nvsentinel"
MODULE = "gpu-health-device-plugin/tests/conformance/nvsentinel"
# proto file (relative to the repository root) -> Go package directory under the peer module
PROTOS = {
    "api/nvsentinel/platformconnector/health_event.proto": "gen/platformconnector",
    "api/nvsentinel/deviceapi/v1alpha1/gpu.proto": "gen/deviceapi/v1alpha1",
}


def plugins() -> dict[str, Path]:
    tools = PEER / "tools"
    return {
        name: build(tools, pkg, name, version="tools")
        for name, pkg in (
            ("protoc-gen-go", "google.golang.org/protobuf/cmd/protoc-gen-go"),
            ("protoc-gen-go-grpc", "google.golang.org/grpc/cmd/protoc-gen-go-grpc"),
        )
    }


def generate(out: Path) -> None:
    """Write the generated tree (gen/...) under ``out``."""
    from grpc_tools import protoc  # imported late: only generation needs grpcio-tools

    exe = plugins()
    include = str(Path(protoc.__file__).parent / "_proto")
    mapping = [f"M{proto}={MODULE}/{pkg}" for proto, pkg in PROTOS.items()]
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--plugin=protoc-gen-go={exe['protoc-gen-go']}",
        f"--plugin=protoc-gen-go-grpc={exe['protoc-gen-go-grpc']}",
        f"--go_out={out}",
        f"--go-grpc_out={out}",
        f"--go_opt=module={MODULE}",
        f"--go-grpc_opt=module={MODULE}",
        *(f"--go_opt={m}" for m in mapping),
        *(f"--go-grpc_opt={m}" for m in mapping),
        *(str(ROOT / proto) for proto in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed for " + ", ".join(PROTOS))


def generated_files(base: Path) -> set[Path]:
    gen = base / "gen"
    return {p.relative_to(base) for p in gen.rglob("*.go")} if gen.is_dir() else set()


def stale_files() -> list[str]:
    """Paths under the peer whose committed content differs from a fresh generation (empty: up to date)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generate(out)
        fresh, current = generated_files(out), generated_files(PEER)
        return sorted(
            str(p) for p in fresh | current
            if p not in fresh or p not in current or not filecmp.cmp(out / p, PEER / p, shallow=False)
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail when the committed generated code is stale")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print("generated Go code is stale; run scripts/gen_go_peer.py:", *stale, sep="\n  ")
            return 1
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generate(out)
        shutil.rmtree(PEER / "gen", ignore_errors=True)
        for rel in generated_files(out):
            (PEER / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(out / rel, PEER / rel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
