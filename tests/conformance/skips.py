"""How a test meets a missing Go toolchain or a failed Go build: a skip, except with CI=true, where it fails."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import pytest

from scripts.gobuild import GoBuildError, GoToolchainMissing, build, find_go


def skip_or_fail(message: str) -> NoReturn:
    """A missing prerequisite: a skip, except with CI=true, where it fails."""
    if os.environ.get("CI") == "true":
        pytest.fail(message + "; CI=true, so this is a failure", pytrace=False)
    pytest.skip(message)


def require_go_or_skip(reason_prefix: str = "Go toolchain") -> str:
    """The `go` path; skips when missing, fails instead when CI=true."""
    go = find_go()
    if go is None:
        skip_or_fail(f"{reason_prefix} not found (install Go >= 1.24 or put `go` on PATH)")
    return go


def build_or_skip(
    module_dir: os.PathLike[str] | str,
    package: str,
    name: str,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Path:
    """build() that skips on missing Go or unreachable module proxy, except when CI=true."""
    in_ci = os.environ.get("CI") == "true"
    try:
        return build(module_dir, package, name, env, **kwargs)
    except GoToolchainMissing as exc:
        failure = f"{exc}; CI=true, so this is a failure" if in_ci else None
        skip = str(exc)
    except GoBuildError as exc:
        failure = None if (exc.looks_like_network and not in_ci) else str(exc)
        skip = f"could not download Go modules for {name} (offline?): {str(exc).splitlines()[-1]}"
    # Outside the except blocks, so pytest does not print the chained build exception.
    if failure is not None:
        pytest.fail(failure, pytrace=False)
    pytest.skip(skip)
