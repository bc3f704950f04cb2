"""The ``health:`` keys of the rate rules: parsed, validated with the key's name, and documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugin.config import ConfigError, load, parse_health
from plugin.health.config import HealthConfig

ROOT = Path(__file__).resolve().parents[2]


def test_rate_hold_defaults_to_ten_minutes_and_is_settable() -> None:
    assert HealthConfig().rate_hold_s == 600.0
    assert parse_health({"rateHoldSeconds": 30}).rate_hold_s == 30.0
    cfg = parse_health({"thresholds": {"eccCorrectedRatePerMinute": 12.5}})
    assert cfg.ecc_corrected_rate_per_min == 12.5
    assert parse_health({"thresholds": {"eccCorrectedRatePerMinute": None}}).ecc_corrected_rate_per_min is None


@pytest.mark.parametrize(("doc", "field"), [
    ({"rateHoldSeconds": -1}, "health.rateHoldSeconds"),
    ({"rateHoldSeconds": "10m"}, "health.rateHoldSeconds"),
    ({"thresholds": {"eccCorrectedRatePerMinute": True}}, "health.thresholds.eccCorrectedRatePerMinute"),
])
def test_bad_rate_values_name_the_key(doc: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_health(doc)
    assert field in str(err.value)


def test_the_health_docs_describe_the_hold() -> None:
    config_doc = (ROOT / "docs" / "config.md").read_text()
    assert "health.rateHoldSeconds" in config_doc and "health.thresholds.eccCorrectedRatePerMinute" in config_doc
    assert "rateHoldSeconds" in (ROOT / "docs" / "health.md").read_text()


def test_the_effective_config_log_shows_the_rate_settings() -> None:
    cfg = load({}, {}, None)
    effective = cfg.effective()["health"]
    assert effective["rate_hold_s"] == 600.0 and effective["ecc_corrected_rate_per_min"] is None
