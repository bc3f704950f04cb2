"""``--version`` for every program of the package: the installed distribution's version, looked up when asked."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

DISTRIBUTION = "gpu-health-device-plugin"


def version() -> str:
    """The version pyproject.toml gave the installed distribution, or "unknown" when it is not installed: no copy of
    the number is kept here to fall back on, since a second copy is one that can drift."""
    # Imported here: importlib.metadata is heavy, and only --version needs it, never a running agent.
    from importlib import metadata
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


class VersionAction(argparse.Action):
    """Prints "PROG VERSION" and exits 0, like argparse's own version action, but looks the version up only when the
    flag is given: building the parser, which every start does, stays free of the lookup."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS, help: str = "print the program's name and version, then exit"
                 ) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> NoReturn:
        print(f"{parser.prog} {version()}")
        parser.exit()
