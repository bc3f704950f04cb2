"""The option library (plugin/options): one env-name rule for both programs, the precedence walk, errors named the
way the user set the value, the file reader, durations and label selectors."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from plugin.config import OPTIONS as AGENT
from plugin.controller.config import OPTIONS as CONTROLLER
from plugin.options.durations import Duration, format_duration, parse_duration
from plugin.options.selectors import Requirement, parse_selector
from plugin.options.sources import read_file, resolve
from plugin.options.table import spec, table
from plugin.validation import FieldError, parse_bool

# Both programs' variables as they were before the library: the rule must reproduce every one.
AGENT_ENV = [f"GPU_HEALTH_{n}" for n in (
    "MODE", "BACKEND", "SIMULATED_NODE", "DEVICE_PLUGIN_DIR", "STATE_DIR", "BOOT_ID_FILE", "KERNEL_LOG",
    "EXPECTED_GPUS", "SYSFS_ROOT", "BUSY_GRACE", "BUSY_IGNORE", "HANDOVER",
    "HEALTH_SOCKET", "DEV_ROOT",
    "RESOURCE_NAME", "MIG_STRATEGY", "CDI", "ALLOW_UNHEALTHY_ALLOCATION", "POLL_INTERVAL", "FAIL_ON_INIT_ERROR",
    "LOG_FORMAT", "LOG_LEVEL", "METRICS_ADDRESS", "STALL_THRESHOLD", "RECOVERY_CHECK", "RECOVERY_CHECK_TIMEOUT",
    "CORRELATE_ON", "POD_RESOURCES_SOCKET",
    "ANNOTATE_PODS", "REMEDIATE", "NODE_NAME", "KUBECONFIG", "ANNOTATIONS", "ANNOTATION_PREFIX",
    "ANNOTATION_MAX_BYTES", "EVENTS", "NODE_CONDITION", "NODE_CONDITION_TYPE", "NODE_CONDITION_REASONS",
    "REPORT_DEBOUNCE", "REPORT_MIN_INTERVAL", "REPORT_RESYNC_INTERVAL", "REPORT_BACKOFF_MAX", "DRA_PLUGIN_DIR",
    "DRA_REGISTRY_DIR",
    "CDI_SPEC_DIR", "DRA_DEGRADED_HEALTH", "DRA_UNHEALTHY_TAINT_EFFECT", "DRA_DEGRADED_TAINT",
    "NVSENTINEL_SOCKET", "NVSENTINEL_STORE_ONLY", "DEVICE_API_SOCKET", "DEVICE_API_PROVIDE", "DEVICE_API_CONSUME")]
CONTROLLER_ENV = [f"GPU_HEALTH_CONTROLLER_{n}" for n in (
    "KUBECONFIG", "NAMESPACE", "IDENTITY", "LEASE_NAME", "ANNOTATION_PREFIX", "NODE_SELECTOR", "METRICS_ADDRESS",
    "LOG_FORMAT", "LOG_LEVEL", "DRY_RUN", "RESET_BREAKER", "RESYNC_INTERVAL", "UNHEALTHY_DEVICES",
    "UNHEALTHY_FRACTION", "REBOOT_REQUIRED", "GPU_MISSING", "GPU_MISSING_GRACE", "CAPACITY_GAP", "NO_EXECUTE_AFTER",
    "CORDON", "QUARANTINE_LABEL", "WRITE_CONCURRENCY",
    "DRAIN", "DRAIN_RATE", "RECOVERY_HOLD", "REPEAT_LIMIT", "REPEAT_WINDOW",
    "MAX_QUARANTINED_FRACTION", "MAX_QUARANTINED_NODES", "LEASE_DURATION",
    "RENEW_DEADLINE", "RETRY_PERIOD", "WRITE_TIMEOUT", "CONFIG")]


def test_one_env_rule_keeps_every_variable_of_both_programs() -> None:
    assert [o.env for o in AGENT] == AGENT_ENV
    assert [o.env for o in CONTROLLER] == CONTROLLER_ENV
    assert [o.env_aliases for o in AGENT if o.env_aliases] == [("NODE_NAME",)]
    assert {o.fallback_env for o in CONTROLLER if o.fallback_env} == {"POD_NAMESPACE", "POD_NAME"}


@dataclass(frozen=True)
class Sample:
    wait_s: float = field(default=5.0, metadata=spec(Duration(positive=True), "wait", flag="--wait"))
    fast: bool = field(default=False, metadata=spec(parse_bool, "fast", key="speed.fast"))
    name: str = field(default="x", metadata=spec(str, "name", env_aliases=("NAME",), fallback_env="POD_NAME"))


OPTS = table(Sample, "APP_", "main")


def test_the_table_derives_flag_env_and_key() -> None:
    assert [(o.flag, o.env, o.key) for o in OPTS] == [
        ("--wait", "APP_WAIT", "main.wait"), ("--fast", "APP_FAST", "speed.fast"), ("--name", "APP_NAME", "main.name")]
    assert [o.default_text for o in OPTS] == ["5s", "false", "x"]


@pytest.mark.parametrize(("flags", "env", "file", "want", "set_by"), [
    ({"wait_s": "1m"}, {"APP_WAIT": "2m"}, {"main.wait": "3m"}, 60.0, "--wait"),
    ({}, {"APP_WAIT": "2m"}, {"main.wait": "3m"}, 120.0, "APP_WAIT"),
    ({}, {}, {"main.wait": "3m"}, 180.0, "main.wait"),
    ({}, {}, {}, 5.0, None),
])
def test_flags_beat_env_beat_file_beat_defaults(flags: dict[str, str], env: dict[str, str], file: dict[str, str],
                                                want: float, set_by: str | None) -> None:
    r = resolve(OPTS, flags, env, file)
    assert r.values["wait_s"] == want
    assert r.set_by.get("wait_s") == set_by
    assert r.source["wait_s"] == {"--wait": "flag", "APP_WAIT": "env", "main.wait": "file", None: "default"}[set_by]


def test_aliases_come_before_the_file_and_fallbacks_after_it() -> None:
    assert resolve(OPTS, {}, {"NAME": "a"}, {"main.name": "b"}).set_by["name"] == "NAME"
    assert resolve(OPTS, {}, {"POD_NAME": "a"}, {"main.name": "b"}).set_by["name"] == "main.name"
    assert resolve(OPTS, {}, {"POD_NAME": "a"}, {}).values["name"] == "a"
    assert resolve(OPTS, {}, {"POD_NAME": ""}, {}).values["name"] == "x"


@pytest.mark.parametrize(("flags", "env", "file", "named"), [
    ({"wait_s": "soon"}, {}, {}, "--wait"), ({}, {"APP_WAIT": "0"}, {}, "APP_WAIT"),
    ({}, {}, {"main.wait": "-1s"}, "main.wait"), ({}, {}, {"speed.fast": "maybe"}, "speed.fast")])
def test_a_bad_value_is_named_the_way_it_was_set(flags: dict[str, str], env: dict[str, str], file: dict[str, str],
                                                 named: str) -> None:
    with pytest.raises(FieldError) as e:
        resolve(OPTS, flags, env, file)
    assert e.value.field == named and "\n" not in str(e.value)


def test_the_file_reader_flattens_sections_and_passes_free_ones_through(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("version: v1\nmain:\n  wait: 2s\nspeed:\n  fast: true\nextra: {a: 1}\n")
    doc = read_file(f, "--config", OPTS, "v1", ("extra",))
    assert doc.values == {"main.wait": "2s", "speed.fast": True} and doc.free == {"extra": {"a": 1}}
    f.write_text("version: v1\nspeed:\n  wait: 2s\n")
    with pytest.raises(FieldError, match=r"^speed\.wait: unknown key .*belongs at main\.wait"):
        read_file(f, "--config", OPTS, "v1")


@pytest.mark.parametrize(("text", "seconds"), [("90", 90.0), ("1h30m", 5400.0), ("250ms", 0.25), (1.5, 1.5)])
def test_durations(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == seconds
    assert parse_duration(format_duration(seconds)) == seconds
    with pytest.raises(ValueError, match="above 0"):
        Duration(positive=True)("0s")


def test_selectors() -> None:
    assert parse_selector("a=b,!c,d in (x,y)") == (
        Requirement("a", "=", ("b",)), Requirement("c", "!"), Requirement("d", "in", ("x", "y")))
    with pytest.raises(ValueError, match="not a label selector"):
        parse_selector("a in x")
