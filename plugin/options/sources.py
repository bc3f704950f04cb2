"""The sources of an option's value, flags > environment > file > defaults: finding and reading the versioned file,
and the walk that picks each option's value and checks it, a bad one a ``FieldError`` named the way the user set
it (``--poll-interval``, ``GPU_HEALTH_POLL_INTERVAL`` or ``plugin.pollInterval``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plugin.options.document import read_document
from plugin.options.table import Option, optional_path, sections
from plugin.validation import FieldError, first_key


def config_path(flag_value: Any, env: Mapping[str, str], flag: str, env_var: str) -> tuple[Path | None, str]:
    """The config file (absolute) named by its flag, else by its environment variable when that is set and not
    empty, with how the user named it for messages."""
    raw, label = flag_value, flag
    if raw is None and env.get(env_var):
        raw, label = env[env_var], env_var
    try:
        return optional_path(raw), label
    except ValueError as exc:
        raise FieldError(label, str(exc)) from None


@dataclass(frozen=True)
class File:
    values: dict[str, Any] = field(default_factory=dict)  # by dotted key (``release.recoveryHold``)
    free: dict[str, Any] = field(default_factory=dict)  # the sections the program parses itself, as written


def _misplaced_hint(keys: Sequence[str], key: str, where: str) -> str:
    """Where a key that is unknown here does belong, when it belongs somewhere (a leaf put at the wrong level)."""
    for p in keys:
        if p.rsplit(".", 1)[-1] == key and p != f"{where}{key}":
            return f"; {key} belongs at {p}"
    return ""


def read_file(path: Path, label: str, options: Iterable[Option], version: str, free: Sequence[str] = ()) -> File:
    """The file's option values by dotted key, its shape checked; ``free`` names the sections the program checks
    itself (the agent's health and sharing), returned as written; ``label`` is how the file was named."""
    doc = read_document(path, label)
    if not isinstance(doc, dict):
        raise FieldError(label, f"{path}: expected a mapping with version: {version}, got "
                                f"{'an empty file' if doc is None else repr(doc)}")
    if "version" not in doc:
        raise FieldError("version", f"missing: the file must start with version: {version}")
    if doc["version"] != version:
        raise FieldError("version", f"expected {version!r}, got {doc['version']!r}")
    keys = [o.key for o in options if o.key]
    nested = sections(o for o in options if o.key)
    top = ("version", *(k for k in keys if "." not in k), *nested, *free)
    unknown = [k for k in doc if k not in top]
    if unknown:
        bad = first_key(unknown)
        raise FieldError(bad, f"unknown key (known: {', '.join(top)}){_misplaced_hint(keys, bad, '')}")
    out = File(free={k: doc.get(k) for k in free})
    for k, v in doc.items():
        if k == "version" or k in free:
            continue
        if k not in nested:
            out.values[k] = v
            continue
        if v is None:  # "drain:" with nothing under it
            continue
        known = [p.split(".", 1)[1] for p in keys if p.startswith(k + ".")]
        if not isinstance(v, dict):
            raise FieldError(k, f"expected a mapping (keys: {', '.join(known)}), got {v!r}")
        unknown = [sub for sub in v if sub not in known]
        if unknown:
            bad = first_key(unknown)
            raise FieldError(f"{k}.{bad}", f"unknown key (known: {', '.join(known)})"
                                           f"{_misplaced_hint(keys, bad, k + '.')}")
        out.values.update({f"{k}.{sub}": x for sub, x in v.items()})
    return out


@dataclass(frozen=True)
class Resolved:
    values: dict[str, Any]  # field -> checked value
    source: dict[str, str]  # field -> flag, env, file or default
    set_by: dict[str, str]  # field -> how the user set it (--state-dir, GPU_HEALTH_STATE_DIR, plugin.stateDir)


def resolve(options: Iterable[Option], flags: Mapping[str, Any], env: Mapping[str, str],
            file: Mapping[str, Any]) -> Resolved:
    """Each option's value from the first source that has it, flags > environment > file > defaults, checked."""
    out = Resolved({}, {}, {})
    for o in options:
        var = next((v for v in (o.env, *o.env_aliases) if v in env), None)
        if flags.get(o.name) is not None:
            raw, src, label = flags[o.name], "flag", o.flag
        elif var is not None:
            raw, src, label = env[var], "env", var
        elif o.key and o.key in file:
            raw, src, label = file[o.key], "file", o.key
        elif o.fallback_env and env.get(o.fallback_env):
            raw, src, label = env[o.fallback_env], "env", o.fallback_env
        else:
            out.values[o.name] = o.default
            out.source[o.name] = "default"
            continue
        try:
            out.values[o.name] = o.parse(raw)
        except (ValueError, TypeError) as exc:
            raise FieldError(label, str(exc)) from None
        out.source[o.name] = src
        out.set_by[o.name] = label
    return out
