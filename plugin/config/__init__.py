"""Versioned configuration: one schema, three sources (flags > environment > file), validated in one place.

``options`` holds the ``Config`` fields and so the option table (plugin/options derives it); ``load`` reads the file
and merges the sources. The file's ``health`` section is parsed beside ``HealthConfig`` (plugin/health/config.py)
and its ``sharing`` section beside the sharing types (plugin/sharing/config.py). A bad value names the field and
the CLI exits 2. ``docs/config.md`` is generated from this schema.
"""

from plugin.config.load import CONFIG_VERSION, load
from plugin.config.options import ENV_PREFIX, OPTIONS, Config, ConfigError, option
from plugin.health.config import parse_health

__all__ = ["CONFIG_VERSION", "ENV_PREFIX", "OPTIONS", "Config", "ConfigError", "load", "option", "parse_health"]
