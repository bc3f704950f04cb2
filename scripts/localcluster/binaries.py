"""The local cluster's Go binaries, built once per version through scripts/gobuild.py and cached beside
the conformance peers (~/.cache/gpu-health-device-plugin/<name>-<version>-<hash>/).

    kube-apiserver, kubectl, etcd,  the API-server peer's targets (scripts/kubebinaries.py)
      testpki
    kubelet, kube-scheduler,        go/kube: k8s.io/kubernetes/cmd/..., the same release
      kube-controller-manager
    containerd, ctr,                go/containerd: containerd 2.x
      containerd-shim-runc-v2
    runc                            go/runc: cgo, seccomp (libseccomp-dev, pkg-config)

    python3 scripts/localcluster/binaries.py      # build or reuse all, print name<TAB>path
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if not __package__:  # run as a script (see above): make the repository's packages importable
    sys.path.insert(0, str(REPO))

# The API-server peer's targets and builder, so the cluster and the conformance tests share one cache entry per
# binary.
from scripts import kubebinaries as peer  # noqa: E402
from scripts.kubebinaries import KUBE_LDFLAGS, KUBERNETES_VERSION, BuildErrors, Target, build  # noqa: E402

CONTAINERD_VERSION = "v2.4.2"
RUNC_VERSION = "v1.2.6"

_KUBE = HERE / "go" / "kube"
_CTRD = HERE / "go" / "containerd"
_CTRD_LDFLAGS = f"-s -w -X github.com/containerd/containerd/v2/version.Version={CONTAINERD_VERSION}"

TARGETS = (
    Target("kubelet", _KUBE, "k8s.io/kubernetes/cmd/kubelet", KUBERNETES_VERSION, KUBE_LDFLAGS),
    Target("kube-scheduler", _KUBE, "k8s.io/kubernetes/cmd/kube-scheduler", KUBERNETES_VERSION, KUBE_LDFLAGS),
    Target("kube-controller-manager", _KUBE, "k8s.io/kubernetes/cmd/kube-controller-manager", KUBERNETES_VERSION,
           KUBE_LDFLAGS),
    Target("containerd", _CTRD, "github.com/containerd/containerd/v2/cmd/containerd", CONTAINERD_VERSION,
           _CTRD_LDFLAGS),
    Target("containerd-shim-runc-v2", _CTRD, "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
           CONTAINERD_VERSION, _CTRD_LDFLAGS),
    Target("ctr", _CTRD, "github.com/containerd/containerd/v2/cmd/ctr", CONTAINERD_VERSION, _CTRD_LDFLAGS),
    # runc links libseccomp, so it is the one cgo build here.
    Target("runc", HERE / "go" / "runc", "github.com/opencontainers/runc", RUNC_VERSION,
           f"-s -w -X main.version={RUNC_VERSION.lstrip('v')}", cgo=True, tags=("seccomp",)),
)

__all__ = ["KUBERNETES_VERSION", "TARGETS", "BuildErrors", "Target", "build", "build_all"]


def build_all(log: bool = False) -> dict[str, Path]:
    """Every binary the cluster runs, by name: the peer's, then ours."""
    paths: dict[str, Path] = {}
    for name, path in peer.build_all().items():
        paths[name] = path
    for target in TARGETS:
        if log:
            print(f"{target.name} {target.version}: building or reusing ...", file=sys.stderr, flush=True)
        paths[target.name] = build(target)
    return paths


if __name__ == "__main__":
    try:
        for name, path in build_all(log=True).items():
            print(f"{name}\t{path}", flush=True)
    except BuildErrors as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
