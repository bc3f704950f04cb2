"""Every third-party module the product imports is a declared dependency: walk plugin/ and api/ (the packages the
wheel ships), collect every import (function-level ones included), and map each top-level module to the
distribution that provides it in this environment."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"plugin", "api"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    out = set()
    for req in doc["project"]["dependencies"]:
        m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
        assert m, req
        out.add(_norm(m.group(0)))
    return out


def imported_top_levels() -> dict[str, list[str]]:
    """Top-level module -> where it is imported (file:line)."""
    found: dict[str, list[str]] = {}
    for pkg in sorted(FIRST_PARTY):
        for path in sorted((REPO / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    found.setdefault(name.split(".")[0], []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_every_third_party_import_is_a_declared_dependency() -> None:
    providers = importlib.metadata.packages_distributions()
    deps = declared()
    third_party = {m: where for m, where in imported_top_levels().items()
                   if m not in FIRST_PARTY and m not in sys.stdlib_module_names and m != "__future__"}
    assert {"grpc", "pynvml", "yaml"} <= set(third_party)  # the walk sees the product's imports at all
    problems = []
    for module, where in sorted(third_party.items()):
        dists = {_norm(d) for d in providers.get(module, [])}
        if not dists:
            problems.append(f"{module} (imported at {where[0]}) is not installed: no distribution provides it")
        elif not dists & deps:
            problems.append(f"{module} (imported at {where[0]}) comes from {', '.join(sorted(dists))}, "
                            "which pyproject.toml does not declare")
    assert problems == []
