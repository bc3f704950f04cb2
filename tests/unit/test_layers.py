"""The layer contract of plugin/: imports point down, never sideways between kubelet and outlets, and never in a
cycle. docs/architecture.md draws the same layers; a module that fits none of them fails here until it is placed.

Imports inside functions count like any other: a lazy import may keep an optional dependency off the start-up path,
but it may not point up, which is what an import written inside a function to dodge a cycle would do.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Lowest first; docs/architecture.md has the same table.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("plugin", "plugin.atomicfile", "plugin.validation", "plugin.configfile", "plugin.backoff",
              "plugin.sockets", "plugin.logs")),
    ("kube", ("plugin.kube",)),
    ("serve", ("plugin.serve",)),
    ("devices", ("plugin.devices",)),
    ("health", ("plugin.health",)),
    ("schema", ("plugin.schema",)),
    ("kubelet", ("plugin.kubelet",)),
    ("outlets", ("plugin.outlets",)),
    ("dra", ("plugin.dra",)),
    ("config", ("plugin.config",)),
    ("controller", ("plugin.controller",)),
    ("app", ("plugin.app", "plugin.startup", "plugin.devtools")),
    ("cli", ("plugin.cli", "plugin.kubectl_plugin", "plugin.__main__")),
)
# The infrastructure packages sit beside base, under every domain package: the Kubernetes client (kube) and the
# HTTP serving with its exposition (serve) know nothing of GPUs, health or either program.
_INFRA = frozenset({"base", "kube", "serve"})
_BELOW_KUBELET = frozenset({"base", "devices", "health"})
# What each layer may import besides itself. kubelet and outlets are siblings: neither may import the other.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "base": frozenset(),
    "kube": frozenset({"base"}),
    "serve": frozenset({"base"}),
    "devices": frozenset({"base"}),
    "health": frozenset({"base", "devices"}),
    # The codecs of what the agent writes on the cluster (node annotations), shared by the agent's outlets that
    # encode and the readers that decode (the controller, kubectl gpu-health): the node state in, kube's RFC 3339
    # times and default prefix.
    "schema": _BELOW_KUBELET | {"kube"},
    "kubelet": _BELOW_KUBELET,
    "outlets": _BELOW_KUBELET | _INFRA | {"schema"},
    # DRA mode serves the kubelet (a kubelet-side job) from what the outlets know of slices and claims.
    "dra": _BELOW_KUBELET | _INFRA | {"schema", "kubelet", "outlets"},
    "config": _BELOW_KUBELET | {"kubelet"},
    # The fleet controller is a program of its own beside the node agent: the shared infrastructure, the reason
    # names of health and the annotation codec, nothing of the agent's kubelet side, outlets, DRA mode, config or app.
    "controller": _BELOW_KUBELET | _INFRA | {"schema"},
    "app": _BELOW_KUBELET | _INFRA | {"schema", "kubelet", "outlets", "dra", "config"},
    "cli": _BELOW_KUBELET | _INFRA | {"schema", "kubelet", "outlets", "dra", "config", "app", "controller"},
}


def layer_of(module: str) -> str | None:
    """The layer of a dotted module name: the longest matching prefix wins (plugin.sockets is base, plugin.health
    is health)."""
    best: tuple[int, str] | None = None
    for layer, prefixes in LAYERS:
        for p in prefixes:
            # The package itself ("plugin") is a module of the base layer, not a prefix of every other.
            covers = module == p or (p != "plugin" and module.startswith(p + "."))
            if covers and (best is None or len(p) > best[0]):
                best = (len(p), layer)
    return best[1] if best else None


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(root: Path, path: Path, package: str) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import of ``package`` in a file, at any depth, relative ones resolved.
    ``from a.b import c`` yields a.b.c when that is a module of ours, else a.b."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(root, path)
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package or alias.name.startswith(package + "."):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".") if is_pkg else here.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == package or target.startswith(package + ".")):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield (sub if _is_module(root, sub) else target), node.lineno


def _is_module(root: Path, dotted: str) -> bool:
    p = root.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for path in sorted((root / package).rglob("*.py")):
        deps = out.setdefault(module_name(root, path), {})
        for target, line in imports_of(root, path, package):
            deps.setdefault(target, line)
    return out


def violations(root: Path, package: str = "plugin") -> list[str]:
    g = graph(root, package)
    problems: list[str] = []
    for mod, deps in sorted(g.items()):
        src = layer_of(mod)
        if src is None:
            problems.append(f"{mod}: in no layer (add it to LAYERS here and to docs/architecture.md)")
            continue
        for target, line in sorted(deps.items()):
            dst = layer_of(target)
            if dst is None or target == mod:
                continue
            if dst != src and dst not in MAY_IMPORT[src]:
                problems.append(f"{mod}:{line} imports {target}: {src} may not import {dst}")
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(g)]
    return problems


def cycles(g: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each closed into a loop for the message.
    A package importing its own submodules (``__init__`` re-exports) is not a cycle unless a submodule imports it
    back."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, {}):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp: list[str] = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append([*sorted(comp), min(comp)])

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_plugin_imports_point_down_and_never_cycle() -> None:
    problems = violations(REPO)
    assert not problems, "layer contract broken:\n" + "\n".join(problems)


def test_the_table_only_lets_layers_import_downwards() -> None:
    order = [layer for layer, _ in LAYERS]
    for layer, allowed in MAY_IMPORT.items():
        assert all(order.index(a) < order.index(layer) for a in allowed), layer


def test_every_layer_is_populated() -> None:
    """A layer whose prefix matches nothing is a stale entry: the contract would pass over a renamed package."""
    mods = set(graph(REPO, "plugin"))
    for layer, prefixes in LAYERS:
        for p in prefixes:
            assert any(layer_of(m) == layer and (m == p or m.startswith(p + ".")) for m in mods), \
                f"{layer}: {p} matches no module"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for d in {p.parent for p in tmp_path.rglob("*.py")}:
        (d / "__init__.py").touch()
    return tmp_path


@pytest.mark.parametrize(("files", "expected"), [
    # health reaching up into the outlets, inside a function: the cycle-dodging pattern
    ({"plugin/health/a.py": "def f():\n    from plugin.outlets import b\n", "plugin/outlets/b.py": ""},
     "plugin.health.a:2 imports plugin.outlets.b: health may not import outlets"),
    # siblings
    ({"plugin/outlets/m.py": "from plugin.kubelet.s import X\n", "plugin/kubelet/s.py": "X = 1\n"},
     "plugin.outlets.m:1 imports plugin.kubelet.s: outlets may not import kubelet"),
    # a relative import is resolved before it is judged
    ({"plugin/devices/d.py": "from ..health import h\n", "plugin/health/h.py": ""},
     "plugin.devices.d:1 imports plugin.health.h: devices may not import health"),
    # a cycle inside one layer
    ({"plugin/health/x.py": "import plugin.health.y\n", "plugin/health/y.py": "from plugin.health import x\n"},
     "import cycle: plugin.health.x -> plugin.health.y -> plugin.health.x"),
    # config reaching into an outlet (it once did, for name checks: they live in validation.py now)
    ({"plugin/config/options.py": "from plugin.outlets.annotations import check\n",
      "plugin/outlets/annotations.py": "check = 1\n"},
     "plugin.config.options:1 imports plugin.outlets.annotations: config may not import outlets"),
    # a module outside every layer
    ({"plugin/stray.py": ""}, "plugin.stray: in no layer"),
])
def test_the_checker_catches(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    root = _tree(tmp_path, files)
    assert any(p.startswith(expected) for p in violations(root)), violations(root)


def test_the_checker_allows_downward_and_lazy_imports(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "plugin/app.py": "from plugin.health import h\n\ndef f():\n    from plugin.outlets import o\n",
        "plugin/health/h.py": "from plugin.devices import d\nfrom plugin import backoff\n",
        "plugin/devices/d.py": "", "plugin/outlets/o.py": "from plugin.health.h import *\n", "plugin/backoff.py": "",
    })
    assert violations(root) == []
