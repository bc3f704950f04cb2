"""The layer contract of plugin/: imports point down, never sideways between kubelet and outlets, and never in a
cycle. docs/architecture.md draws the same layers; a module that fits none of them fails here until it is placed.
The scripts' contract is here too: no tests, no private names of plugin, no cycles among them.

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
    ("base", ("plugin", "plugin.atomicfile", "plugin.validation", "plugin.backoff",
              "plugin.sockets", "plugin.logs", "plugin.version", "plugin.stdout")),
    ("kube", ("plugin.kube",)),
    ("serve", ("plugin.serve",)),
    ("options", ("plugin.options",)),
    ("devices", ("plugin.devices",)),
    ("health", ("plugin.health",)),
    ("sharing", ("plugin.sharing",)),
    ("schema", ("plugin.schema",)),
    ("kubelet", ("plugin.kubelet",)),
    ("outlets", ("plugin.outlets",)),
    ("dra", ("plugin.dra",)),
    ("nvsentinel", ("plugin.nvsentinel",)),
    ("config", ("plugin.config",)),
    ("controller", ("plugin.controller",)),
    ("app", ("plugin.app", "plugin.startup", "plugin.devtools")),
    ("cli", ("plugin.cli", "plugin.kubectl_plugin", "plugin.__main__")),
)
# The infrastructure packages sit beside base, under every domain package: the Kubernetes client (kube) and the
# HTTP serving with its exposition (serve) know nothing of GPUs, health or either program; the option library
# (options) knows how options are set, not which options a program has.
_INFRA = frozenset({"base", "kube", "serve", "options"})
_BELOW_KUBELET = frozenset({"base", "devices", "health"})
# What each layer may import besides itself. kubelet and outlets are siblings: neither may import the other.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "base": frozenset(),
    "kube": frozenset({"base"}),
    "serve": frozenset({"base"}),
    "options": frozenset({"base"}),
    "devices": frozenset({"base"}),
    "health": frozenset({"base", "devices"}),
    # The sharing concept (the section, its pools and selections) knows devices, not the kubelet that serves it,
    # so the config can hold it without reaching into the kubelet side.
    "sharing": frozenset({"base", "devices"}),
    # The codecs of what the agent writes on the cluster (node annotations), shared by the agent's outlets that
    # encode and the readers that decode (the controller, kubectl gpu-health): the node state in, kube's RFC 3339
    # times and default prefix.
    "schema": _BELOW_KUBELET | {"kube"},
    "kubelet": _BELOW_KUBELET | {"sharing"},
    "outlets": _BELOW_KUBELET | _INFRA | {"schema"},
    # DRA mode serves the kubelet (a kubelet-side job) from what the outlets know of slices and claims.
    "dra": _BELOW_KUBELET | _INFRA | {"sharing", "schema", "kubelet", "outlets"},
    # NVSentinel interop: our transitions out (health events, device API status) on the outlets' worker thread, and
    # other providers' GPU conditions in, handed to the health engine through a Protocol app.py satisfies.
    "nvsentinel": _BELOW_KUBELET | _INFRA | {"schema", "outlets"},
    "config": _BELOW_KUBELET | {"sharing", "options"},
    # The fleet controller is a program of its own beside the node agent: the shared infrastructure, the reason
    # names of health and the annotation codec, nothing of the agent's kubelet side, outlets, DRA mode, config or app.
    "controller": _BELOW_KUBELET | _INFRA | {"schema"},
    "app": _BELOW_KUBELET | _INFRA | {"sharing", "schema", "kubelet", "outlets", "dra", "nvsentinel", "config"},
    "cli": _BELOW_KUBELET | _INFRA | {"sharing", "schema", "kubelet", "outlets", "dra", "nvsentinel", "config", "app",
                                      "controller"},
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
    # config reaching into the kubelet side for the sharing section (it once did: the section lives in sharing/)
    ({"plugin/config/load.py": "from plugin.kubelet.sharing import parse_sharing\n",
      "plugin/kubelet/sharing.py": "parse_sharing = 1\n"},
     "plugin.config.load:1 imports plugin.kubelet.sharing: config may not import kubelet"),
    # the sharing concept reaching up into the kubelet that serves it
    ({"plugin/sharing/model.py": "from plugin.kubelet.resources import DeviceResource\n",
      "plugin/kubelet/resources.py": "DeviceResource = 1\n"},
     "plugin.sharing.model:1 imports plugin.kubelet.resources: sharing may not import kubelet"),
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


# scripts/ (generators, builders, the local cluster) sit beside the packages they serve: they may use plugin's public
# names and each other, never the tests (tests may import scripts, so that would be a loop through the test tree)
# and never plugin's private names (a script leaning on one breaks when the module is tidied).
# Known cases, without line numbers (the files move on): the lead deletes them once the branch that fixes them is in.


def _private_prefix(dotted: str) -> str | None:
    """``dotted`` up to its first private part (``a._b.c`` -> ``a._b``); None when every part is public."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i + 1])
    return None


def plugin_names_used(root: Path, path: Path) -> Iterator[tuple[str, int]]:
    """(dotted name, line) for every name of plugin a file imports or reaches through an imported plugin module
    (``from plugin.a import b``, ``import plugin.a as m`` then ``m.c``, ``plugin.a.d``)."""
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}  # local name -> the plugin module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "plugin" or alias.name.startswith("plugin."):
                    yield alias.name, node.lineno
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound["plugin"] = "plugin"
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and (node.module == "plugin" or node.module.startswith("plugin.")):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                yield full, node.lineno
                if _is_module(root, full):
                    bound[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain: list[str] = []
            value: ast.expr = node
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                yield ".".join([bound[value.id], *reversed(chain)]), node.lineno


def script_violations(root: Path) -> list[str]:
    problems: list[str] = []
    for path in sorted((root / "scripts").rglob("*.py")):
        mod = module_name(root, path)
        for target, line in imports_of(root, path, "tests"):
            problems.append(f"{mod}:{line} imports {target}: scripts may not import tests")
        private = {(n, line) for name, line in plugin_names_used(root, path) if (n := _private_prefix(name))}
        problems += [f"{mod}:{line} uses {name}: a private name of plugin" for name, line in
                     sorted(private, key=lambda nl: (nl[1], nl[0]))]
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph(root, "scripts"))]
    return problems


def test_scripts_import_no_tests_no_private_plugin_names_and_never_cycle() -> None:
    problems = script_violations(REPO)
    assert not problems, "scripts/ import contract broken:\n" + "\n".join(problems)


@pytest.mark.parametrize(("files", "expected"), [
    # a script borrowing a table from the tests (scripts/localcluster/binaries.py once did)
    ({"scripts/b.py": "from tests.conformance.apiserver import _binaries as peer\n",
      "tests/conformance/apiserver/_binaries.py": ""},
     "scripts.b:1 imports tests.conformance.apiserver._binaries: scripts may not import tests"),
    ({"scripts/b.py": "def f():\n    import tests.fakes\n", "tests/fakes.py": ""},
     "scripts.b:2 imports tests.fakes: scripts may not import tests"),
    # plugin's private names: imported, a private module, or reached through an imported module
    ({"scripts/g.py": "from plugin.validation import _RE, Choice\n", "plugin/validation.py": ""},
     "scripts.g:1 uses plugin.validation._RE: a private name of plugin"),
    ({"scripts/g.py": "from plugin.outlets._x import y\n", "plugin/outlets/_x.py": ""},
     "scripts.g:1 uses plugin.outlets._x: a private name of plugin"),
    ({"scripts/g.py": "from plugin import validation as v\n\nprint(v._RE.pattern)\n", "plugin/validation.py": ""},
     "scripts.g:3 uses plugin.validation._RE: a private name of plugin"),
    ({"scripts/g.py": "import plugin.validation\n\nprint(plugin.validation._RE)\n", "plugin/validation.py": ""},
     "scripts.g:3 uses plugin.validation._RE: a private name of plugin"),
    # two scripts importing each other (gen_docs and gen_chart_schema once did)
    ({"scripts/a.py": "from scripts import b\n", "scripts/b.py": "def f():\n    from scripts.a import X\n"},
     "import cycle: scripts.a -> scripts.b -> scripts.a"),
])
def test_the_script_checker_catches(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    root = _tree(tmp_path, files)
    assert expected in script_violations(root), script_violations(root)


def test_the_script_checker_allows_public_names_and_scripts_importing_scripts(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "scripts/a.py": "import plugin.validation\nfrom plugin.config import OPTIONS\nfrom scripts import b\n"
                        "print(plugin.validation.Choice, b.__doc__)\n",
        "scripts/b.py": "from plugin import validation as v\n\nprint(v.Choice.__name__)\n",
        "plugin/validation.py": "", "plugin/config/options.py": "",
    })
    assert script_violations(root) == []


# The pure cores of both programs: decisions and encodings that take the clock and the facts as arguments, so tests
# drive them on plain values and the I/O stays in the modules around them. docs/architecture.md names them.
PURE = (
    "plugin.health.reasons", "plugin.health.policy", "plugin.health.tracker",
    "plugin.schema.annotations", "plugin.outlets.condition", "plugin.outlets.condition_reasons",
    "plugin.outlets.events",
    "plugin.controller.nodes", "plugin.controller.policy", "plugin.controller.breaker", "plugin.controller.patches",
    "plugin.dra.slices", "plugin.kube.ratelimit", "plugin.kube.events", "plugin.kube.views",
    "plugin.options.durations", "plugin.options.selectors", "plugin.sharing.model", "plugin.sharing.config",
    "plugin.nvsentinel.healthevents",
    "plugin.nvsentinel.gpuconditions",
)
# What a pure core may not import: the clock, threads, processes, files and the network, and our own modules that
# do I/O (the API client's transport, sockets, the file writer).
IMPURE = ("time", "threading", "subprocess", "socket", "ssl", "http", "urllib", "selectors", "signal", "fcntl", "os",
          "grpc", "pynvml", "watchdog", "plugin.kube.client", "plugin.kube.transport", "plugin.kube.config",
          "plugin.sockets", "plugin.atomicfile")


def impure_imports(root: Path, module: str) -> list[str]:
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        found += [f"{module}:{node.lineno} imports {n}" for n in names
                  if any(n == bad or n.startswith(bad + ".") for bad in IMPURE)]
    return found


def test_the_pure_cores_do_no_io() -> None:
    problems = [p for m in PURE for p in impure_imports(REPO, m)]
    assert not problems, "a pure core imports I/O:\n" + "\n".join(problems)


def test_the_purity_checker_catches(tmp_path: Path) -> None:
    (tmp_path / "plugin" / "controller").mkdir(parents=True)
    (tmp_path / "plugin" / "controller" / "policy.py").write_text(
        "import time\nfrom plugin.kube.client import KubeClient\nfrom os import path\n")
    assert impure_imports(tmp_path, "plugin.controller.policy") == [
        "plugin.controller.policy:1 imports time", "plugin.controller.policy:2 imports plugin.kube.client",
        "plugin.controller.policy:3 imports os"]
