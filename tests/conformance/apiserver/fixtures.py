"""pytest fixtures for the API-server peer; registered for all of tests/conformance/ by its conftest.py.

    def test_something(apiserver):            # session-scoped, started once
        apiserver.url, apiserver.ca_file, apiserver.kubeconfig     # admin access
        apiserver.kubectl("get", "nodes")                          # CompletedProcess; raises on failure
        apiserver.create_node("gpu-node-1")
        token = apiserver.token_for_pod("ns", "sa", "pod")         # Pod-bound: carries the pod's node
        kubeconfig = apiserver.kubeconfig_for_token(token, "plugin")
        apiserver.request("PATCH", "/api/v1/nodes/x", body, token=token,
                          content_type="application/merge-patch+json")

Objects persist for the whole session: use unique names per test.

Where the Go toolchain is missing or a build fails the tests that use these fixtures are skipped
with the reason, except when CI=true, where that is a failure.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conformance.apiserver import _binaries as binaries
from tests.conformance.apiserver.apiserver_peer import ApiServerPeer


def _unavailable(message: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message}\n(CI=true: a missing Go toolchain or a failed build is a failure)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def apiserver_binaries() -> dict[str, Path]:
    """Paths of etcd, kube-apiserver, kubectl and testpki (built once, then taken from the cache)."""
    try:
        return binaries.build_all()
    except binaries.BuildErrors as exc:
        _unavailable(f"API-server peer unavailable: {exc}")
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def apiserver(apiserver_binaries, tmp_path_factory):
    """A running kube-apiserver + etcd on loopback (see apiserver_peer.py), stopped at session end."""
    peer = ApiServerPeer.start_retrying(apiserver_binaries, lambda: tmp_path_factory.mktemp("apiserver"))
    try:
        yield peer
    finally:
        peer.stop()
