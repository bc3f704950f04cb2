"""Loading the configuration: reading the versioned file and merging the sources, flags > environment > file >
defaults, into one validated ``Config``. A bad value anywhere is a ``FieldError`` that names it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from plugin.config.migrate import nvidia_format_error
from plugin.config.options import OPTIONS, Config, ConfigError
from plugin.health.config import parse_health
from plugin.options.sources import File, read_file, resolve
from plugin.sharing.config import parse_sharing
from plugin.sharing.config import validate as validate_sharing

CONFIG_VERSION = "v1"
FILE_SECTIONS = ("health", "sharing")  # parsed beside their types; the plugin section is the option table's


def load(flags: Mapping[str, Any], env: Mapping[str, str], file: Path | None,
         file_label: str = "--config") -> Config:
    """Merge the three sources (flags > env > file > defaults) and validate every value."""
    path = Path(os.path.abspath(file)) if file is not None else None
    try:
        doc = read_file(path, file_label, OPTIONS, CONFIG_VERSION, FILE_SECTIONS) if path is not None else File()
        health = parse_health(doc.free.get("health"))
        sharing = parse_sharing(doc.free.get("sharing"))
    except ConfigError as exc:
        # NVIDIA's format fails on its first key of theirs ("flags: unknown key"); say what the file is instead.
        raise (nvidia_format_error(path, file_label) if path is not None else None) or exc from None
    r = resolve(OPTIONS, flags, env, doc.values)
    validate_sharing(sharing, r.values["resource_name"], r.values["mig_strategy"])
    cfg = Config(**r.values, health=health, sharing=sharing, source=r.source, set_by=r.set_by)
    if cfg.backend != "simulated" and cfg.simulated_node is not None:
        via = f", set by {r.set_by['backend']}" if "backend" in r.set_by else ""
        raise ConfigError(cfg.name_of("simulated_node"),
                          f"only valid with --backend simulated (the backend is {cfg.backend}{via})")
    if cfg.mode == "dra":
        check_dra(cfg)
    check_device_api(cfg)
    return cfg


def check_device_api(cfg: Config) -> None:
    """NVSentinel's device API, either way, needs its socket named: there is no safe place to guess."""
    wanted = [cfg.name_of(f) for f in ("device_api_provide", "device_api_consume") if getattr(cfg, f)]
    if wanted and cfg.device_api_socket is None:
        raise ConfigError(cfg.name_of("device_api_socket"),
                          f"{' and '.join(wanted)} need{'s' if len(wanted) == 1 else ''} the device API's socket "
                          "(NVSentinel's listens on /var/run/device-api/device.sock)")


def check_dra(cfg: Config) -> None:
    """What DRA mode cannot do yet, or cannot do without: refused at start, naming the option."""
    if not cfg.node_name:
        raise ConfigError(cfg.name_of("node_name"),
                          "--mode dra needs this node's name: its ResourceSlice and claims are looked up by it")
    if cfg.mig_strategy == "single":
        # single folds every instance into the one resource name; a DRA claim selects instances by attribute instead.
        raise ConfigError(cfg.name_of("mig_strategy"),
                          "single is device-plugin mode's; with --mode dra use mixed: every MIG instance is then a "
                          "device of its own, and a claim selects instances by its profile attribute")
    # DRA shares a device in place (plugin/dra/shares.py): the scheduler counts claims against it, so what only
    # makes sense for replicas advertised as devices of their own is refused rather than silently dropped.
    if cfg.sharing.resources and cfg.sharing.policy != "distributed":
        raise ConfigError("sharing.timeSlicing.allocationPolicy",
                          f"--mode dra: the scheduler places claims on shared GPUs; expected distributed (the "
                          f"default), got {cfg.sharing.policy!r}")
    for r in cfg.sharing.resources:
        if r.rename:
            raise ConfigError(f"{r.where}.rename", "--mode dra keeps a shared GPU's name and class: a claim asks for "
                                                   "a share of it (docs/dra.md, \"Shared GPUs\"); remove rename "
                                                   "(and renameByDefault)")
        if r.fail_requests_greater_than_one:
            raise ConfigError(f"{r.where}.failRequestsGreaterThanOne",
                              "--mode dra: a claim takes one share unless its request asks the shares capacity for "
                              "more, and never more than replicas; remove failRequestsGreaterThanOne")
