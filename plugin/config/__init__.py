"""Versioned configuration: one schema, three sources (flags > environment > file), validated in one place.

``options`` holds the ``Config`` fields and the option table derived from them; ``load`` reads the file and merges
the sources. The file's ``health`` section is parsed beside ``HealthConfig`` (plugin/health/config.py) and its
``sharing`` section beside the sharing types (plugin/sharing/config.py). A bad value names the field and the CLI
exits 2. ``docs/config.md`` is generated from this schema.
"""

from plugin.config.load import CONFIG_VERSION, load, read_file
from plugin.config.options import ENV_PREFIX, OPTIONS, Config, ConfigError, Option, default_text, option
from plugin.health.config import parse_health

__all__ = ["CONFIG_VERSION", "ENV_PREFIX", "OPTIONS", "Config", "ConfigError", "Option", "default_text", "load",
           "option", "parse_health", "read_file"]
