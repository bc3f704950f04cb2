"""``--version`` of gpu-health-plugin, gpu-health-controller and kubectl gpu-health: "PROG VERSION" on stdout, exit
0, the version read from the installed distribution (pyproject.toml's), "unknown" when the package is not installed,
and nothing looked up unless the flag is given."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

import pytest

from plugin import cli, kubectl_plugin
from plugin.controller import main as controller_main
from plugin.version import DISTRIBUTION, version

REPO = Path(__file__).resolve().parents[2]
PROGRAMS: list[tuple[str, Callable[[Sequence[str] | None], int]]] = [
    ("gpu-health-plugin", cli.main),
    ("gpu-health-controller", controller_main.main),
    ("kubectl gpu-health", kubectl_plugin.main),
]


def _version_of(main: Callable[[Sequence[str] | None], int], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code in (0, None)
    out = capsys.readouterr()
    assert out.err == ""
    return out.out


def test_the_installed_version_is_pyprojects() -> None:
    wanted = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert metadata.version(DISTRIBUTION) == wanted, "reinstall the package (pip install -e .) after a version bump"
    assert version() == wanted


@pytest.mark.parametrize(("prog", "main"), PROGRAMS, ids=[p for p, _ in PROGRAMS])
def test_version_prints_the_program_and_its_version(prog: str, main: Callable[[Sequence[str] | None], int],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # For the agent this is also the check that --version is not taken for a flag of the default "run", which
    # would refuse it with exit 2.
    assert _version_of(main, capsys) == f"{prog} {metadata.version(DISTRIBUTION)}\n"


@pytest.mark.parametrize(("prog", "main"), PROGRAMS, ids=[p for p, _ in PROGRAMS])
def test_not_installed_the_version_is_unknown(prog: str, main: Callable[[Sequence[str] | None], int],
                                              capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert _version_of(main, capsys) == f"{prog} unknown\n"


def test_the_agent_still_defaults_to_run_for_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default subcommand must survive the new top-level flag: a run flag first still means "run".
    seen: list[object] = []
    monkeypatch.setattr(cli, "_run", lambda args, *_: seen.append(args.command) or 0)
    assert cli.main(["--backend", "simulated"]) == 0
    assert cli.main([]) == 0
    assert seen == ["run", "run"]


def test_only_the_flag_pays_for_the_lookup() -> None:
    # importlib.metadata costs start-up time and memory on every node; building the parsers must not import it.
    code = ("import sys; from plugin import cli, kubectl_plugin; from plugin.controller import config; "
            "cli.build_parser(); kubectl_plugin.build_parser(); config.build_parser(); "
            "print('importlib.metadata' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.strip() == "False"
