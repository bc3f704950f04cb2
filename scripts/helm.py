"""helm, built from its Go module (charts/go/helm) once per version through scripts/gobuild.py and cached
beside the other Go binaries (~/.cache/gpu-health-device-plugin/helm-<version>-<hash>/helm).

The chart's tests (tests/artifacts/test_chart.py, tests/e2e) and anyone without a helm of their own use it:

    python3 scripts/helm.py          # build or reuse it, print its path
    "$(python3 scripts/helm.py)" template gpu-health-device-plugin charts/gpu-health-device-plugin
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a script (see above): make the repository's packages importable
    sys.path.insert(0, str(REPO))

from scripts import gobuild  # noqa: E402

HELM_VERSION = "v3.22.0"
MODULE = REPO / "charts" / "go" / "helm"
PACKAGE = "helm.sh/helm/v3/cmd/helm"
# As helm's own release build sets them: `helm version` reports the release, and the Kubernetes version that
# `helm template` and `helm lint` assume without a cluster is the one of the client-go it is built with (1.37 for
# client-go v0.37, charts/go/helm/go.mod), not the 1.20 compiled in as a fallback, which the chart's kubeVersion
# (>= 1.30) refuses.
_K8S_MAJOR, _K8S_MINOR = "1", "37"
LDFLAGS = (
    f"-s -w -X helm.sh/helm/v3/internal/version.version={HELM_VERSION}"
    + "".join(f" -X helm.sh/helm/v3/pkg/{pkg}.k8sVersionMajor={_K8S_MAJOR}"
              f" -X helm.sh/helm/v3/pkg/{pkg}.k8sVersionMinor={_K8S_MINOR}" for pkg in ("lint/rules", "chartutil"))
)
ENV = {"CGO_ENABLED": "0"}


def build() -> Path:
    path: Path = gobuild.build(MODULE, PACKAGE, "helm", ENV, version=HELM_VERSION, ldflags=LDFLAGS)
    return path


if __name__ == "__main__":
    try:
        print(build(), flush=True)
    except (gobuild.GoToolchainMissing, gobuild.GoBuildError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
