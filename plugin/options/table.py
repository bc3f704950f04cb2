"""The option table: a program's options are the fields of its config dataclass that carry ``spec(...)``; each
gets a flag, an environment variable and a file key by one rule, and the few exceptions are written on the field.

The rules: the flag is the field name in dashes (``poll_interval`` -> ``--poll-interval``) unless the field says
otherwise; the environment variable is the program's prefix and the flag in capitals (``--drain-rate`` ->
``GPU_HEALTH_CONTROLLER_DRAIN_RATE``); the file key is the flag in camel case (``pollInterval``), under the
table's section when it has one (``plugin.pollInterval``), unless the field names another (``drain.enabled``) or
none (``""``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from plugin.options.durations import Duration, format_duration, number_text
from plugin.validation import Choice, parse_bool, split_host_port

_META = "option"


@dataclass(frozen=True)
class Option:
    name: str  # the config dataclass's field
    flag: str
    env: str
    key: str  # dotted key in the file; "" for an option of flags and the environment only
    parse: Callable[[Any], Any]
    default: Any
    help: str
    metavar: str = ""
    env_aliases: tuple[str, ...] = ()  # read when ``env`` is unset, before the file (the DaemonSet's NODE_NAME)
    fallback_env: str = ""  # read below the file when set and not empty (the Downward API's POD_NAME)
    shown_default: str | None = None  # for a default computed at start ("$POD_NAME, else the host name")

    @property
    def leaf(self) -> str:
        """The key inside its section (``pollInterval`` of ``plugin.pollInterval``)."""
        return self.key.rpartition(".")[2]

    @property
    def is_bool(self) -> bool:
        return self.parse is parse_bool

    @property
    def is_duration(self) -> bool:
        return isinstance(self.parse, Duration)

    @property
    def choices(self) -> tuple[str, ...]:
        return self.parse.options if isinstance(self.parse, Choice) else ()

    @property
    def default_text(self) -> str | None:
        """The default as a user would write it (``5``, ``10m``, ``false``, ``Unhealthy``); None when the default
        is "unset", whose meaning the option's help states."""
        d = self.default
        if self.shown_default is not None:
            return self.shown_default
        if d is None or d == "":
            return None
        if isinstance(d, bool):
            return "true" if d else "false"
        if self.is_duration:
            return format_duration(d)
        if isinstance(d, float):
            return number_text(d)
        if isinstance(d, tuple):
            return ",".join(d) if d else "none"
        return str(d)


@dataclass(frozen=True)
class _Spec:
    parse: Callable[[Any], Any]
    help: str
    metavar: str
    flag: str
    key: str | None
    env_aliases: tuple[str, ...]
    fallback_env: str
    shown_default: str | None


def spec(parse: Callable[[Any], Any], help: str, metavar: str = "", *, flag: str = "", key: str | None = None,
         env_aliases: tuple[str, ...] = (), fallback_env: str = "",
         shown_default: str | None = None) -> dict[str, Any]:
    """The field metadata that makes a config field an option; its type and default stay the field's own."""
    return {_META: _Spec(parse, help, metavar, flag, key, env_aliases, fallback_env, shown_default)}


def env_name(prefix: str, flag: str) -> str:
    """The one rule for environment variables: the prefix and the flag in capitals."""
    return prefix + flag.removeprefix("--").replace("-", "_").upper()


def _camel(flag: str) -> str:
    head, *tail = flag.removeprefix("--").split("-")
    return head + "".join(t.capitalize() for t in tail)


def table(cls: type, env_prefix: str, section: str = "") -> tuple[Option, ...]:
    """The options of a config dataclass, in field order."""
    out: list[Option] = []
    for f in fields(cls):
        s: _Spec | None = f.metadata.get(_META)
        if s is None:
            continue
        flag = s.flag or "--" + f.name.replace("_", "-")
        key = s.key if s.key is not None else f"{section}.{_camel(flag)}" if section else _camel(flag)
        default = None if f.default is MISSING else f.default
        out.append(Option(f.name, flag, env_name(env_prefix, flag), key, s.parse, default, s.help, s.metavar,
                          s.env_aliases, s.fallback_env, s.shown_default))
    return tuple(out)


def sections(options: Iterable[Option]) -> tuple[str, ...]:
    """The file's sections, in the table's order."""
    return tuple(dict.fromkeys(o.key.split(".")[0] for o in options if "." in o.key))


# Value parsers both programs use: each takes what a flag, a variable or the file gave and returns the value, or
# raises ValueError with the text the user sees after the option's name.

def path(v: Any) -> Path:
    """An absolute path: a relative one is taken against the working directory now, at load time, so that what
    the start-up log shows is what every later open, bind and watch uses."""
    if not isinstance(v, (str, Path)) or not str(v):
        raise ValueError(f"expected a path, got {v!r}")
    return Path(os.path.abspath(v))


def optional_path(v: Any) -> Path | None:
    return None if v is None or v == "" else path(v)


def listen_address(s: str) -> str:
    """``HOST:PORT``, or ``off``."""
    if s.lower() == "off":
        return "off"
    split_host_port(s)
    return s
