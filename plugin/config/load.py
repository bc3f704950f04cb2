"""Loading the configuration: reading the versioned file and merging the sources, flags > environment > file >
defaults, into one validated ``Config``. A bad value anywhere is a ``FieldError`` that names it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from plugin.config.options import OPTIONS, Config, ConfigError
from plugin.configfile import read_document
from plugin.health.config import parse_health
from plugin.sharing.config import parse_sharing
from plugin.sharing.config import validate as validate_sharing
from plugin.validation import first_key

CONFIG_VERSION = "v1"
SECTIONS = ("version", "plugin", "health", "sharing")


def read_file(path: Path, label: str = "--config") -> dict[str, Any]:
    """The config file as a mapping; ``label`` names where its path came from (--config or GPU_HEALTH_CONFIG)."""
    doc = read_document(path, label)
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(label, f"{path}: expected a mapping at the top level")
    if doc.get("version") != CONFIG_VERSION:
        raise ConfigError("version", f"expected {CONFIG_VERSION!r}, got {doc.get('version')!r}")
    unknown = set(doc) - set(SECTIONS)
    if unknown:
        raise ConfigError(first_key(unknown), f"unknown section (known: {', '.join(sorted(SECTIONS))})")
    return doc


def load(flags: Mapping[str, Any], env: Mapping[str, str], file: Path | None,
         file_label: str = "--config") -> Config:
    """Merge the three sources (flags > env > file > defaults) and validate every value."""
    doc: dict[str, Any] = read_file(Path(os.path.abspath(file)), file_label) if file is not None else {}
    plugin = doc.get("plugin") or {}
    if not isinstance(plugin, dict):
        raise ConfigError("plugin", "expected a mapping")
    by_key = {o.key: o for o in OPTIONS}
    for k in plugin:
        if k not in by_key:
            raise ConfigError(f"plugin.{first_key({k})}", f"unknown key (known: {', '.join(sorted(by_key))})")
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    set_by: dict[str, str] = {}
    for o in OPTIONS:
        if flags.get(o.name) is not None:
            raw, src, label = flags[o.name], "flag", o.flag
        elif o.env in env or any(a in env for a in o.env_aliases):
            var = next(v for v in (o.env, *o.env_aliases) if v in env)
            raw, src, label = env[var], "env", var
        elif o.key in plugin:
            raw, src, label = plugin[o.key], "file", f"plugin.{o.key}"
        else:
            values[o.name] = o.default
            source[o.name] = "default"
            continue
        try:
            values[o.name] = o.parse(raw)
        except (ValueError, TypeError) as exc:
            raise ConfigError(label, str(exc)) from None
        source[o.name] = src
        set_by[o.name] = label
    health = parse_health(doc.get("health"))
    sharing = parse_sharing(doc.get("sharing"))
    validate_sharing(sharing, values["resource_name"], values["mig_strategy"])
    cfg = Config(**values, health=health, sharing=sharing, source=source, set_by=set_by)
    if cfg.backend != "simulated" and cfg.simulated_node is not None:
        via = f", set by {set_by['backend']}" if "backend" in set_by else ""
        raise ConfigError(cfg.name_of("simulated_node"),
                          f"only valid with --backend simulated (the backend is {cfg.backend}{via})")
    if cfg.mode == "dra":
        check_dra(cfg)
    return cfg


def check_dra(cfg: Config) -> None:
    """What DRA mode cannot do yet, or cannot do without: refused at start, naming the option."""
    if not cfg.node_name:
        raise ConfigError(cfg.name_of("node_name"),
                          "--mode dra needs this node's name: its ResourceSlice and claims are looked up by it")
    if cfg.mig_strategy != "none":
        raise ConfigError(cfg.name_of("mig_strategy"),
                          f"--mode dra publishes whole GPUs only; expected none, got {cfg.mig_strategy!r}")
    if cfg.sharing.resources:
        raise ConfigError("sharing.timeSlicing", "--mode dra does not share GPUs (time-slicing is a device-plugin "
                                                 "feature); remove the sharing section")
