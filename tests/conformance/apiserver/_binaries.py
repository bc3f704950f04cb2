"""The Go binaries of the API-server peer: etcd, kube-apiserver, kubectl and testpki. Their table, version pins
and build live in scripts/kubebinaries.py (the local cluster and the benchmarks build the same ones); this module
names them for the tests.

Pre-build everything (for example in a CI cache step):

    python3 tests/conformance/apiserver/_binaries.py
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script (see above): make the repository's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from scripts.kubebinaries import (
    ETCD,
    ETCD_VERSION,
    KUBE_APISERVER,
    KUBECTL,
    KUBERNETES_VERSION,
    PEER_TARGETS,
    TESTPKI,
    BuildErrors,
    Target,
    build,
    build_all,
    etcd_override,
    main,
)

ALL_TARGETS = PEER_TARGETS

__all__ = ["ALL_TARGETS", "ETCD", "ETCD_VERSION", "KUBECTL", "KUBERNETES_VERSION", "KUBE_APISERVER", "TESTPKI",
           "BuildErrors", "Target", "build", "build_all", "etcd_override"]

if __name__ == "__main__":
    sys.exit(main())
