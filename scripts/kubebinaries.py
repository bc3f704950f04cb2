"""The Kubernetes binaries the tests and tools run, their version pins and how each is built (through
scripts/gobuild.py, cached under ~/.cache/gpu-health-device-plugin/<name>-<version>-<hash>/).

The API-server peer (tests/conformance/apiserver/, the local cluster, the fleet benchmark):

    etcd            go/etcd     etcd's own server entry point, go.etcd.io/etcd/server/v3 (ETCD_VERSION)
    kube-apiserver  go/kube     k8s.io/kubernetes/cmd/kube-apiserver (KUBERNETES_VERSION)
    kubectl         go/kube     k8s.io/kubernetes/cmd/kubectl, same release (kustomize built in)
    testpki         go/testpki  throw-away CA, serving certificate and service-account key pair

Their Go modules stay in tests/conformance/apiserver/go/: the module paths in their go.mod files name that place,
and the cache key covers those files, so moving or renaming them would rebuild every cached binary.

    python3 scripts/kubebinaries.py      # build or reuse the peer's binaries, print name<TAB>path
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a script (see above): make the repository's packages importable
    sys.path.insert(0, str(REPO))

from scripts import gobuild  # noqa: E402

KUBERNETES_VERSION = "v1.37.2"
ETCD_VERSION = "v3.7.3"

KUBE_LDFLAGS = (
    "-s -w"
    f" -X k8s.io/component-base/version.gitVersion={KUBERNETES_VERSION}"
    " -X k8s.io/component-base/version.gitMajor=1"
    " -X k8s.io/component-base/version.gitMinor=37"
    " -X k8s.io/component-base/version.gitTreeState=clean"
)


@dataclass(frozen=True)
class Target:
    name: str
    module: Path
    package: str
    version: str
    ldflags: str = "-s -w"
    cgo: bool = False  # static binaries, like the Kubernetes release build, unless a target links C
    tags: tuple[str, ...] = ()


PEER_GO = REPO / "tests" / "conformance" / "apiserver" / "go"
ETCD = Target("etcd", PEER_GO / "etcd", ".", ETCD_VERSION)
TESTPKI = Target("testpki", PEER_GO / "testpki", ".", "v1")
KUBE_APISERVER = Target(
    "kube-apiserver", PEER_GO / "kube", "k8s.io/kubernetes/cmd/kube-apiserver", KUBERNETES_VERSION, KUBE_LDFLAGS
)
KUBECTL = Target("kubectl", PEER_GO / "kube", "k8s.io/kubernetes/cmd/kubectl", KUBERNETES_VERSION, KUBE_LDFLAGS)

PEER_TARGETS = (TESTPKI, ETCD, KUBE_APISERVER, KUBECTL)

# Raised by build(): a missing toolchain, or a failed build (GoBuildError.looks_like_network tells
# "could not download modules" apart from "does not compile").
BuildErrors = (gobuild.GoToolchainMissing, gobuild.GoBuildError)


def build_env(target: Target) -> dict[str, str]:
    """The environment a target is built with; part of its cache key."""
    return {"CGO_ENABLED": "1" if target.cgo else "0"}


def build(target: Target) -> Path:
    path: Path = gobuild.build(target.module, target.package, target.name, build_env(target),
                               version=target.version, ldflags=target.ldflags, tags=target.tags)
    return path


def etcd_override() -> Path | None:
    """$GPU_HEALTH_ETCD names an etcd binary to use instead of building one (for example Debian's
    etcd-server 3.4.23, which kube-apiserver 1.37 accepts; see docs/conformance.md)."""
    value = os.environ.get("GPU_HEALTH_ETCD")
    if not value:
        return None
    if not (os.path.isfile(value) and os.access(value, os.X_OK)):
        raise FileNotFoundError(f"GPU_HEALTH_ETCD={value} is not an executable file")
    return Path(value)


def build_peer(target: Target) -> Path:
    """One of the peer's binaries: etcd may come from $GPU_HEALTH_ETCD instead."""
    return (etcd_override() if target is ETCD else None) or build(target)


def build_all() -> dict[str, Path]:
    """The API-server peer's binaries by name."""
    return {target.name: build_peer(target) for target in PEER_TARGETS}


def main() -> int:
    for t in PEER_TARGETS:
        print(f"{t.name}: building or reusing ...", file=sys.stderr, flush=True)
        try:
            path = build_peer(t)
        except BuildErrors as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"{t.name}\t{path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
