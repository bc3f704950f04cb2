"""The Go binaries of the API-server peer, built (or reused from the cache) through scripts/gobuild.py.

    etcd            go/etcd     etcd's own server entry point, go.etcd.io/etcd/server/v3 (ETCD_VERSION)
    kube-apiserver  go/kube     k8s.io/kubernetes/cmd/kube-apiserver (KUBERNETES_VERSION)
    kubectl         go/kube     k8s.io/kubernetes/cmd/kubectl, same release (kustomize built in)
    testpki         go/testpki  throw-away CA, serving certificate and service-account key pair

Pre-build everything (for example in a CI cache step):

    python3 tests/conformance/apiserver/_binaries.py
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
if not __package__:  # run as a script (see above): make the repository's packages importable
    sys.path.insert(0, str(HERE.parents[2]))

from scripts import gobuild  # noqa: E402

KUBERNETES_VERSION = "v1.37.2"
ETCD_VERSION = "v3.7.3"

_KUBE_LDFLAGS = (
    "-s -w"
    f" -X k8s.io/component-base/version.gitVersion={KUBERNETES_VERSION}"
    " -X k8s.io/component-base/version.gitMajor=1"
    " -X k8s.io/component-base/version.gitMinor=37"
    " -X k8s.io/component-base/version.gitTreeState=clean"
)
# Static binaries, like the Kubernetes release build.
_BUILD_ENV = {"CGO_ENABLED": "0"}


@dataclass(frozen=True)
class Target:
    name: str
    module: Path
    package: str
    version: str
    ldflags: str = "-s -w"


ETCD = Target("etcd", HERE / "go" / "etcd", ".", ETCD_VERSION)
TESTPKI = Target("testpki", HERE / "go" / "testpki", ".", "v1")
KUBE_APISERVER = Target(
    "kube-apiserver", HERE / "go" / "kube", "k8s.io/kubernetes/cmd/kube-apiserver", KUBERNETES_VERSION, _KUBE_LDFLAGS
)
KUBECTL = Target("kubectl", HERE / "go" / "kube", "k8s.io/kubernetes/cmd/kubectl", KUBERNETES_VERSION, _KUBE_LDFLAGS)

ALL_TARGETS = (TESTPKI, ETCD, KUBE_APISERVER, KUBECTL)

# Raised by build(): a missing toolchain, or a failed build (GoBuildError.looks_like_network tells
# "could not download modules" apart from "does not compile").
BuildErrors = (gobuild.GoToolchainMissing, gobuild.GoBuildError)


def build(target: Target) -> Path:
    return gobuild.build(
        target.module, target.package, target.name, _BUILD_ENV, version=target.version, ldflags=target.ldflags
    )


def etcd_override() -> Path | None:
    """$GPU_HEALTH_ETCD names an etcd binary to use instead of building one (for example Debian's
    etcd-server 3.4.23, which kube-apiserver 1.37 accepts; see docs/conformance.md)."""
    value = os.environ.get("GPU_HEALTH_ETCD")
    if not value:
        return None
    if not (os.path.isfile(value) and os.access(value, os.X_OK)):
        raise FileNotFoundError(f"GPU_HEALTH_ETCD={value} is not an executable file")
    return Path(value)


def build_all() -> dict[str, Path]:
    paths = {}
    for target in ALL_TARGETS:
        override = etcd_override() if target is ETCD else None
        paths[target.name] = override if override else build(target)
    return paths


if __name__ == "__main__":
    for t in ALL_TARGETS:
        print(f"{t.name}: building or reusing ...", file=sys.stderr, flush=True)
        try:
            path = (etcd_override() if t is ETCD else None) or build(t)
        except BuildErrors as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(1)
        print(f"{t.name}\t{path}", flush=True)
