"""Fixtures shared by the conformance tests (real peers built from their Go sources).

Fixture modules live next to the peer they drive and are loaded here by path, so every test under
tests/conformance/ can use them without imports and without package __init__ files.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# API-server peer: `apiserver` (session-scoped running kube-apiserver + etcd) and `apiserver_binaries`.
_apiserver_fixtures = _load("gpu_health_apiserver_fixtures", _HERE / "apiserver" / "fixtures.py")
apiserver = _apiserver_fixtures.apiserver
apiserver_binaries = _apiserver_fixtures.apiserver_binaries
