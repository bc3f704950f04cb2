"""The options as argparse flags. Values stay strings here and are checked with the other sources, so a bad one
is one line naming the flag; the choices and each option's variable and default are still shown by ``--help``."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Sequence
from typing import Any

from plugin.options.table import Option
from plugin.validation import FieldError


def add_arguments(p: argparse.ArgumentParser, options: Iterable[Option], *, show_file: bool = False) -> None:
    for o in options:
        where = [f"env {o.env}"] + ([f"file {o.key}"] if show_file and o.key else [])
        if (default := o.default_text) is not None:
            where.append(f"default: {default}")
        help_text = f"{o.help} ({'; '.join(where)})".replace("%", "%%")
        if o.is_bool:
            p.add_argument(o.flag, dest=o.name, nargs="?", const="true", default=None, metavar="BOOL",
                           help=help_text)
        else:
            metavar = "{" + ",".join(o.choices) + "}" if o.choices else o.metavar or o.name.upper()
            p.add_argument(o.flag, dest=o.name, default=None, metavar=metavar, help=help_text)


class _ArgumentError(Exception):
    pass


class OneLineParser(argparse.ArgumentParser):
    """argparse would print the usage and exit; here a bad command line is one FieldError naming the flag."""

    def error(self, message: str) -> Any:
        raise _ArgumentError(message)


_ARG_MESSAGE = re.compile(r"argument (\S+): (.*)")


def parse_flags(parser: argparse.ArgumentParser, argv: Sequence[str], options: Iterable[Option],
                who: str) -> dict[str, str | None]:
    """The flags given, by field name (None where absent); ``parser`` is a OneLineParser, ``who`` names the program
    in the message about a stray argument."""
    prog = parser.prog
    try:
        ns, extra = parser.parse_known_args(list(argv))
    except _ArgumentError as exc:
        m = _ARG_MESSAGE.match(str(exc))
        if m and m.group(2) == "expected one argument":
            # Also what argparse says of "--recovery-hold -5m": it takes a value with a leading '-' for a flag.
            raise FieldError(m.group(1), f"expected a value (one that starts with '-' is written "
                                         f"{m.group(1)}=VALUE)") from None
        if m:
            raise FieldError(m.group(1), m.group(2)) from None
        raise FieldError(prog, str(exc)) from None
    if extra:
        bad = extra[0]
        if bad.startswith("-"):
            raise FieldError(bad.split("=", 1)[0], f"unknown flag (see {prog} --help)")
        raise FieldError(bad, f"unexpected argument: {who} takes flags only")
    return {o.name: getattr(ns, o.name) for o in options}
