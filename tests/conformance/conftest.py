"""Fixtures shared by the conformance tests (real peers built from their Go sources).

Fixture modules live next to the peer they drive; importing their fixtures here makes them available to every test
under tests/conformance/.
"""

from __future__ import annotations

# API-server peer: `apiserver` (session-scoped running kube-apiserver + etcd) and `apiserver_binaries`.
from tests.conformance.apiserver.fixtures import apiserver, apiserver_binaries

# NVSentinel stand-in: `nvsentinel_peer_exe` (session-scoped build) and `nvsentinel_peer` (a running peer).
from tests.conformance.nvsentinel.fixtures import nvsentinel_peer, nvsentinel_peer_exe

__all__ = ["apiserver", "apiserver_binaries", "nvsentinel_peer", "nvsentinel_peer_exe"]
