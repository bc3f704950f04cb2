"""The controller's config: every option settable by flag, variable and file key with flags > env > file > default,
every bad value one FieldError naming it where it was written, durations, label selectors, --help, exit 2, and
docs/fleet-config.md generated from the same table."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugin.controller import config as ctl
from plugin.controller.config import ControllerConfig, FieldError, load, options_table
from plugin.controller.patches import split_label
from plugin.options.durations import format_duration, parse_duration
from plugin.options.selectors import Requirement, parse_selector
from scripts import gen_docs
from tests.fakes.controller_api import selector_matches

REPO = Path(__file__).resolve().parents[2]

# Two values for every option: A differs from the default, B from A (so each precedence step is visible).
SAMPLES: dict[str, tuple[str, Any, str, Any]] = {
    "kubeconfig": ("/etc/gpu-health/a.kubeconfig", Path("/etc/gpu-health/a.kubeconfig"),
                   "/etc/gpu-health/b.kubeconfig", Path("/etc/gpu-health/b.kubeconfig")),
    "namespace": ("team-a", "team-a", "team-b", "team-b"),
    "identity": ("replica-a", "replica-a", "replica-b", "replica-b"),
    "lease_name": ("lease-a", "lease-a", "lease.b", "lease.b"),
    "annotation_prefix": ("example.com", "example.com", "gpu.example.org", "gpu.example.org"),
    "node_selector": ("gpu=true", "gpu=true", "pool in (a,b),!spot", "pool in (a,b),!spot"),
    "metrics_address": ("127.0.0.1:9500", "127.0.0.1:9500", "off", "off"),
    "log_format": ("json", "json", "text", "text"),
    "log_level": ("debug", "debug", "warning", "warning"),
    "dry_run": ("true", True, "false", False),
    "reset_breaker": ("true", True, "false", False),
    "resync_interval_s": ("30m", 1800.0, "120", 120.0),
    "unhealthy_devices": ("2", 2, "0", 0),
    "unhealthy_fraction": ("0.5", 0.5, "0.25", 0.25),
    "reboot_required": ("false", False, "true", True),
    "gpu_missing": ("false", False, "true", True),
    "gpu_missing_grace_s": ("90s", 90.0, "0", 0.0),
    "capacity_gap": ("3", 3, "0", 0),
    "no_execute_after_s": ("5m", 300.0, "1h30m", 5400.0),
    "cordon": ("true", True, "false", False),
    "quarantine_label": ("gpu-health.io/quarantined=true", "gpu-health.io/quarantined=true",
                         "example.com/out=", "example.com/out="),
    "write_concurrency": ("8", 8, "1", 1),
    "drain": ("true", True, "false", False),
    "drain_per_minute": ("2.5", 2.5, "60", 60.0),
    "recovery_hold_s": ("90s", 90.0, "0", 0.0),
    "repeat_limit": ("3", 3, "0", 0),
    "repeat_window_s": ("24h", 86400.0, "30m", 1800.0),
    "max_quarantined_fraction": ("0.25", 0.25, "1", 1.0),
    "max_quarantined_nodes": ("5", 5, "20", 20),
    "lease_duration_s": ("30s", 30.0, "20", 20.0),
    "renew_deadline_s": ("5s", 5.0, "8", 8.0),
    "retry_period_s": ("1s", 1.0, "500ms", 0.5),
    "write_timeout_s": ("3s", 3.0, "2.5", 2.5),
}
SETTABLE = [o for o in ctl.OPTIONS if o is not ctl.CONFIG_OPTION]
IN_FILE = [o for o in SETTABLE if o.key]


def nest(values: dict[str, Any]) -> dict[str, Any]:
    """{"release.recoveryHold": x} -> {"release": {"recoveryHold": x}}, with the version."""
    doc: dict[str, Any] = {"version": "v1"}
    for key, v in values.items():
        head, _, leaf = key.rpartition(".")
        (doc.setdefault(head, {}) if head else doc)[leaf] = v
    return doc


def file_value(o: ctl.Option, raw: str) -> Any:
    """What a person would write in YAML: a string for a name, a number or a boolean where one is meant."""
    return raw if isinstance(o.default, str) or o.default is None else yaml.safe_load(raw)


def write(tmp_path: Path, doc: Any, name: str = "controller.yaml") -> Path:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return p


def error(argv: list[str], env: dict[str, str] | None = None) -> FieldError:
    with pytest.raises(FieldError) as err:
        load(argv, env or {})
    return err.value


# Defaults and the table ------------------------------------------------------------------------------------------

def test_defaults_are_the_documented_ones() -> None:
    cfg = load([], {})
    assert cfg == ControllerConfig(identity=socket.gethostname())
    assert (cfg.namespace, cfg.lease_name, cfg.annotation_prefix) == (
        "gpu-health-system", "gpu-health-controller", "gpu-health.io")
    assert cfg.metrics_address == "0.0.0.0:9403" and cfg.recovery_hold_s == 600.0
    assert (cfg.lease_duration_s, cfg.renew_deadline_s, cfg.retry_period_s) == (15.0, 10.0, 2.0)
    assert cfg.max_quarantined_fraction == 0.1 and cfg.drain_per_minute == 10.0
    assert cfg.max_quarantined_nodes == 0  # no absolute cap unless asked
    assert cfg.quarantine_label == "" and cfg.selector == ()
    assert json.loads(json.dumps(cfg.effective()))["identity"] == socket.gethostname()


def test_every_option_has_samples_and_unique_names() -> None:
    assert set(SAMPLES) == {o.name for o in SETTABLE}
    rows = options_table()
    assert [r[0] for r in rows] == [o.flag for o in ctl.OPTIONS]
    for column in (0, 1):
        assert len({r[column] for r in rows}) == len(rows)
    assert all(r[1] == "GPU_HEALTH_CONTROLLER_" + r[0][2:].replace("-", "_").upper() for r in rows)
    hold = next(r for r in rows if r[0] == "--recovery-hold")
    assert hold[1:4] == ("GPU_HEALTH_CONTROLLER_RECOVERY_HOLD", "release.recoveryHold", "10m")


def test_the_file_schema_is_the_agreed_one() -> None:
    # Manifests and docs write these keys; a rename here must be a deliberate change there too.
    assert set(ctl.FILE_KEYS) == {
        "kubeconfig", "namespace", "identity", "leaseName", "annotationPrefix", "nodeSelector", "metricsAddress",
        "logFormat", "logLevel", "dryRun", "resyncInterval",
        "policy.unhealthyDevices", "policy.unhealthyFraction", "policy.rebootRequired", "policy.capacityGap",
        "policy.gpuMissing", "policy.gpuMissingGrace",
        "quarantine.noExecuteAfter", "quarantine.cordon", "quarantine.label",
        "quarantine.writeConcurrency",
        "drain.enabled", "drain.evictionsPerMinute", "release.recoveryHold", "release.repeatLimit",
        "release.repeatWindow", "breaker.maxQuarantinedFraction",
        "breaker.maxQuarantinedNodes",
        "leaderElection.leaseDuration", "leaderElection.renewDeadline", "leaderElection.retryPeriod",
        "leaderElection.writeTimeout"}
    assert ctl.option("reset_breaker").key == "" and ctl.CONFIG_OPTION.key == ""


# Every option from every source, and precedence ------------------------------------------------------------------

@pytest.mark.parametrize("o", SETTABLE, ids=lambda o: o.flag)
def test_every_option_by_flag_env_and_file_with_precedence(o: ctl.Option, tmp_path: Path) -> None:
    raw_a, want_a, raw_b, want_b = SAMPLES[o.name]
    assert want_a != o.default and want_a != want_b
    assert getattr(load([o.flag, raw_a], {}), o.name) == want_a
    assert getattr(load([f"{o.flag}={raw_b}"], {}), o.name) == want_b
    assert getattr(load([], {o.env: raw_a}), o.name) == want_a
    if not o.key:
        f = write(tmp_path, {"version": "v1"})
        assert getattr(load(["--config", str(f)], {o.env: raw_b}), o.name) == want_b
        return
    f = write(tmp_path, nest({o.key: file_value(o, raw_a)}))
    assert getattr(load(["--config", str(f)], {}), o.name) == want_a, "file"
    assert getattr(load(["--config", str(f)], {o.env: raw_b}), o.name) == want_b, "env over file"
    assert getattr(load(["--config", str(f), o.flag, raw_a], {o.env: raw_b}), o.name) == want_a, "flag over env"


def test_boolean_flags_alone_mean_true_and_take_a_value() -> None:
    assert load(["--drain", "--cordon", "--dry-run", "--reset-breaker"], {}).drain is True
    cfg = load(["--reboot-required", "false", "--cordon=no", "--drain", "off"], {})
    assert (cfg.reboot_required, cfg.cordon, cfg.drain) == (False, False, False)


def test_downward_api_variables_come_after_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pod = {"POD_NAMESPACE": "from-pod", "POD_NAME": "controller-7d9f-x2"}
    cfg = load([], pod)
    assert (cfg.namespace, cfg.identity) == ("from-pod", "controller-7d9f-x2")
    f = write(tmp_path, nest({"namespace": "from-file", "identity": "file-id"}))
    cfg = load(["--config", str(f)], pod)
    assert (cfg.namespace, cfg.identity) == ("from-file", "file-id")
    ours = {**pod, "GPU_HEALTH_CONTROLLER_NAMESPACE": "ours", "GPU_HEALTH_CONTROLLER_IDENTITY": "ours-id"}
    assert (load(["--config", str(f)], ours).namespace, load([], ours).identity) == ("ours", "ours-id")
    # Set but empty (a Downward API field that is not there): the built-in fallback, never an empty identity.
    monkeypatch.setattr(socket, "gethostname", lambda: "node-host")
    cfg = load([], {"POD_NAMESPACE": "", "POD_NAME": ""})
    assert (cfg.namespace, cfg.identity) == ("gpu-health-system", "node-host")


def test_a_bad_downward_api_value_is_named() -> None:
    assert error([], {"POD_NAMESPACE": "Not_A_Namespace"}).field == "POD_NAMESPACE"


def test_the_config_file_from_the_environment_and_the_flag_over_it(tmp_path: Path) -> None:
    by_env = write(tmp_path, nest({"release.recoveryHold": "1m"}), "env.yaml")
    by_flag = write(tmp_path, nest({"release.recoveryHold": "2m"}), "flag.yaml")
    env = {"GPU_HEALTH_CONTROLLER_CONFIG": str(by_env)}
    cfg = load([], env)
    assert cfg.recovery_hold_s == 60.0 and cfg.config_file == by_env
    cfg = load(["--config", str(by_flag)], env)
    assert cfg.recovery_hold_s == 120.0 and cfg.config_file == by_flag
    missing = {"GPU_HEALTH_CONTROLLER_CONFIG": str(tmp_path / "absent.yaml")}
    err = error([], missing)
    assert err.field == "GPU_HEALTH_CONTROLLER_CONFIG" and "absent.yaml" in err.message


def test_relative_paths_are_taken_against_the_working_directory(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, {"version": "v1", "kubeconfig": "kube/config"})
    monkeypatch.chdir(tmp_path)
    cfg = load(["--config", "controller.yaml"], {})
    assert cfg.config_file == tmp_path / "controller.yaml" and cfg.kubeconfig == tmp_path / "kube" / "config"


def test_empty_sections_and_the_smallest_file(tmp_path: Path) -> None:
    f = write(tmp_path, "version: v1\npolicy:\ndrain: {}\n")
    assert load(["--config", str(f)], {}) == ControllerConfig(identity=socket.gethostname(), config_file=f)


def test_a_bare_off_in_yaml_turns_metrics_off(tmp_path: Path) -> None:
    f = write(tmp_path, "version: v1\nmetricsAddress: off\n")  # YAML reads it as false
    assert load(["--config", str(f)], {}).metrics_address == "off"
    f = write(tmp_path, "version: v1\nmetricsAddress: true\n")
    assert error(["--config", str(f)]).field == "metricsAddress"


def test_quarantine_label_and_selector_helpers() -> None:
    cfg = load(["--quarantine-label", "gpu-health.io/quarantined=true", "--node-selector", "gpu, zone in (a)"], {})
    assert split_label(cfg.quarantine_label) == ("gpu-health.io/quarantined", "true")
    assert cfg.selector == (Requirement("gpu", "exists"), Requirement("zone", "in", ("a",)))


# Rejections: each names the value where it was written -------------------------------------------------------------

FLAG_REJECTIONS: list[tuple[list[str], str, str]] = [
    # 245 characters is a DNS subdomain, but controller.<it> (the controller's own record) is not.
    (["--annotation-prefix", ".".join(["a" * 60] * 4) + ".io"], "--annotation-prefix", "controller.aaaa"),
    (["--max-quarantined-nodes", "-3"], "--max-quarantined-nodes", "must be 0 or more"),
    (["--write-concurrency", "0"], "--write-concurrency", "must be from 1 to 32, got '0'"),
    (["--write-concurrency", "33"], "--write-concurrency", "must be from 1 to 32, got '33'"),
    (["--namespace", "Team_A"], "--namespace", "DNS label"),
    (["--namespace", "x" * 64], "--namespace", "at most 63"),
    (["--identity", "two words"], "--identity", "without spaces"),
    (["--identity", ""], "--identity", "must not be empty"),
    (["--lease-name", "Lease!"], "--lease-name", "DNS subdomain"),
    (["--annotation-prefix", "kubernetes.io"], "--annotation-prefix", "reserved"),
    (["--annotation-prefix", "Not A Domain"], "--annotation-prefix", "DNS subdomain"),
    (["--node-selector", "a in ()"], "--node-selector", "at least one value"),
    (["--metrics-address", "9403"], "--metrics-address", "HOST:PORT"),
    (["--metrics-address", "0.0.0.0:99999"], "--metrics-address", "port"),
    (["--log-format", "xml"], "--log-format", "text, json"),
    (["--log-level", "verbose"], "--log-level", "debug, info, warning, error"),
    (["--dry-run=maybe"], "--dry-run", "true or false"),
    (["--reset-breaker=2"], "--reset-breaker", "true or false"),
    (["--resync-interval", "0"], "--resync-interval", "above 0"),
    (["--resync-interval", "soon"], "--resync-interval", "duration"),
    (["--unhealthy-devices", "-1"], "--unhealthy-devices", "0 or more"),
    (["--unhealthy-devices", "1.5"], "--unhealthy-devices", "whole number"),
    (["--unhealthy-fraction", "1.5"], "--unhealthy-fraction", "[0, 1]"),
    (["--unhealthy-fraction", "half"], "--unhealthy-fraction", "number"),
    (["--reboot-required", "perhaps"], "--reboot-required", "true or false"),
    (["--gpu-missing", "maybe"], "--gpu-missing", "true or false"),
    (["--gpu-missing-grace", "a while"], "--gpu-missing-grace", "duration"),
    (["--gpu-missing-grace=-1m"], "--gpu-missing-grace", "0 or more"),
    (["--capacity-gap", "x"], "--capacity-gap", "whole number"),
    (["--no-execute-after=-1s"], "--no-execute-after", "0 or more"),
    (["--no-execute-after", "-1s"], "--no-execute-after", "written --no-execute-after=VALUE"),
    (["--cordon=sometimes"], "--cordon", "true or false"),
    (["--quarantine-label", "quarantined"], "--quarantine-label", "key=value"),
    (["--quarantine-label", "bad key!=true"], "--quarantine-label", "label key"),
    (["--quarantine-label", "gpu-health.io/q=not ok"], "--quarantine-label", "label value"),
    (["--drain=2"], "--drain", "true or false"),
    (["--drain-rate", "0"], "--drain-rate", "above 0"),
    (["--drain-rate", "nan"], "--drain-rate", "finite"),
    (["--recovery-hold", "1h30"], "--recovery-hold", "duration"),
    (["--recovery-hold=-5m"], "--recovery-hold", "0 or more"),
    (["--repeat-limit", "-1"], "--repeat-limit", "must be 0 or more"),
    (["--repeat-limit", "2.5"], "--repeat-limit", "whole number"),
    (["--repeat-window", "0"], "--repeat-window", "above 0"),
    (["--repeat-window", "7d"], "--repeat-window", "duration"),
    (["--max-quarantined-fraction", "0"], "--max-quarantined-fraction", "(0, 1]"),
    (["--max-quarantined-fraction", "2"], "--max-quarantined-fraction", "(0, 1]"),
    (["--lease-duration", "0s"], "--lease-duration", "above 0"),
    (["--renew-deadline", "inf"], "--renew-deadline", "duration"),
    (["--retry-period", "0"], "--retry-period", "above 0"),
    # Cross-field: named by the side the user set, with the other side's value.
    (["--renew-deadline", "20s"], "--renew-deadline", "less than the lease duration (15s, the default), got 20s"),
    (["--lease-duration", "5"], "--lease-duration", "more than the renew deadline (10s, the default), got 5s"),
    (["--retry-period", "10s"], "--retry-period", "less than the renew deadline (10s, the default)"),
    (["--renew-deadline", "4s", "--retry-period", "4s"], "--retry-period",
     "less than --renew-deadline (4s), got 4s"),
    # Fencing (issue 35, 4): every call ends before a standby may take over.
    (["--write-timeout", "0"], "--write-timeout", "above 0"),
    (["--write-timeout", "5s"], "--write-timeout",
     "less than the lease duration minus the renew deadline (15s - 10s = 5s), so that no write lands after a "
     "standby may have taken over, got 5s"),
    (["--renew-deadline", "12s"], "--renew-deadline",
     "leaves 3s between the renew deadline and the lease duration: the write timeout (4s, the default) must be less"),
    (["--lease-duration", "13s"], "--lease-duration", "leaves 3s between"),
    (["--lease-duration", "30s", "--renew-deadline", "20s", "--write-timeout", "10s"], "--write-timeout",
     "(30s - 20s = 10s)"),
    (["--lease-duration", "12s", "--write-timeout", "3s"], "--write-timeout", "(12s - 10s = 2s)"),
    # The command line itself.
    (["--recovery"], "--recovery", "unknown flag"),
    (["--drain-rate=5", "--bogus=1"], "--bogus", "unknown flag"),
    (["extra"], "extra", "flags only"),
    (["--namespace"], "--namespace", "expected a value"),
]


@pytest.mark.parametrize(("argv", "field", "fragment"), FLAG_REJECTIONS, ids=lambda x: str(x))
def test_bad_flags_name_the_flag(argv: list[str], field: str, fragment: str) -> None:
    err = error(argv)
    assert err.field == field, str(err)
    assert fragment in err.message, str(err)
    assert str(err) == f"{field}: {err.message}" and "\n" not in str(err)


def test_the_write_timeout_fits_the_lease_or_is_refused() -> None:
    assert load([], {}).write_timeout_s == 4.0  # under the defaults' bound: 15 s - 10 s
    wide = load(["--lease-duration", "30s", "--renew-deadline", "20s", "--write-timeout", "9.5s"], {})
    assert wide.write_timeout_s == 9.5
    assert load([], {"GPU_HEALTH_CONTROLLER_WRITE_TIMEOUT": "2s", "GPU_HEALTH_CONTROLLER_LEASE_DURATION": "13s"}
                ).write_timeout_s == 2.0
    err = error([], {"GPU_HEALTH_CONTROLLER_LEASE_DURATION": "13s"})
    assert err.field == "GPU_HEALTH_CONTROLLER_LEASE_DURATION" and "write timeout (4s, the default)" in err.message


def test_an_empty_kubeconfig_means_in_cluster() -> None:
    assert load(["--kubeconfig", ""], {}).kubeconfig is None


@pytest.mark.parametrize(("env", "field"), [
    ({"GPU_HEALTH_CONTROLLER_RECOVERY_HOLD": "ten minutes"}, "GPU_HEALTH_CONTROLLER_RECOVERY_HOLD"),
    ({"GPU_HEALTH_CONTROLLER_DRAIN": ""}, "GPU_HEALTH_CONTROLLER_DRAIN"),
    ({"GPU_HEALTH_CONTROLLER_NODE_SELECTOR": "a=b=c"}, "GPU_HEALTH_CONTROLLER_NODE_SELECTOR"),
    ({"GPU_HEALTH_CONTROLLER_RETRY_PERIOD": "12s"}, "GPU_HEALTH_CONTROLLER_RETRY_PERIOD"),
])
def test_bad_variables_name_the_variable(env: dict[str, str], field: str) -> None:
    assert error([], env).field == field


FILE_REJECTIONS: list[tuple[str, str, str]] = [
    ("version: v1\nbreaker:\n  maxQuarantinedNodes: -1\n", "breaker.maxQuarantinedNodes",
     "breaker.maxQuarantinedNodes: must be 0 or more, got -1"),
    ("version: v1\nbreaker:\n  maxQuarantinedNodes: 2.5\n", "breaker.maxQuarantinedNodes", "whole number"),
    ("version: v1\nquarantine:\n  writeConcurrency: 64\n", "quarantine.writeConcurrency",
     "quarantine.writeConcurrency: must be from 1 to 32, got 64"),
    ("version: v1\nbreaker:\n  maxQuarantinedFraction: 2\n", "breaker.maxQuarantinedFraction",
     "breaker.maxQuarantinedFraction: must be in (0, 1], got 2"),
    ("version: v1\nrelease:\n  recoveryHold: 10 minutes\n", "release.recoveryHold", "got '10 minutes'"),
    ("version: v1\nrelease:\n  recoveryHold: true\n", "release.recoveryHold", "duration"),
    ("version: v1\nrelease:\n  repeatLimit: -5\n", "release.repeatLimit", "must be 0 or more, got -5"),
    ("version: v1\nrelease:\n  repeatWindow: 0\n", "release.repeatWindow", "above 0"),
    ("version: v1\nrelease:\n  repeatWindow: 7 days\n", "release.repeatWindow", "duration"),
    ("version: v1\nnamespace: 123\n", "namespace", "expected a string, got 123"),
    ("version: v1\nkubeconfig: [a]\n", "kubeconfig", "expected a path"),
    ("version: v1\ndryRun: [1]\n", "dryRun", "true or false"),
    ("version: v1\npolicy:\n  unhealthyDevices: {count: 1}\n", "policy.unhealthyDevices", "whole number"),
    ("version: v1\npolicy:\n  capacityGap: 2.5\n", "policy.capacityGap", "whole number"),
    ("version: v1\nquarantine:\n  label: true\n", "quarantine.label", "expected a string"),
    ("version: v1\nleaderElection:\n  renewDeadline: 15s\n", "leaderElection.renewDeadline",
     "less than the lease duration (15s, the default), got 15s"),
    ("version: v1\nleaderElection:\n  leaseDuration: 10s\n  renewDeadline: 12s\n", "leaderElection.renewDeadline",
     "less than leaderElection.leaseDuration (10s), got 12s"),
    ("version: v1\nleaderElection:\n  writeTimeout: 6s\n", "leaderElection.writeTimeout", "(15s - 10s = 5s)"),
    ("version: v1\nleaderElection:\n  leaseDuration: 20s\n  renewDeadline: 18s\n", "leaderElection.renewDeadline",
     "leaves 2s between"),
    ("version: v1\npolicy:\n  unhealthyDevice: 1\n", "policy.unhealthyDevice", "unknown key (known: "),
    ("version: v1\nrecoveryHold: 5m\n", "recoveryHold", "belongs at release.recoveryHold"),
    ("version: v1\npolicy:\n  recoveryHold: 5m\n", "policy.recoveryHold", "belongs at release.recoveryHold"),
    ("version: v1\nplugin: {}\n", "plugin", "unknown key"),
    ("version: v1\nresetBreaker: true\n", "resetBreaker", "unknown key"),
    ("version: v1\nrelease: 10m\n", "release",
     "expected a mapping (keys: recoveryHold, repeatLimit, repeatWindow), got '10m'"),
    ("version: v1\n3: x\n", "3", "unknown key"),
    ("version: v2\n", "version", "expected 'v1', got 'v2'"),
    ("policy: {}\n", "version", "missing"),
    ("version: 1\n", "version", "got 1"),
]


def test_every_option_has_a_rejection() -> None:
    by_flag = {argv[0].split("=")[0] for argv, _, _ in FLAG_REJECTIONS}
    by_file = {field for _, field, _ in FILE_REJECTIONS}
    assert all(o.flag in by_flag or o.key in by_file for o in SETTABLE)


@pytest.mark.parametrize(("text", "field", "fragment"), FILE_REJECTIONS, ids=lambda x: str(x)[:40])
def test_bad_file_values_name_the_key(tmp_path: Path, text: str, field: str, fragment: str) -> None:
    err = error(["--config", str(write(tmp_path, text))])
    assert err.field == field, str(err)
    assert fragment in str(err), str(err)


@pytest.mark.parametrize(("content", "fragment"), [
    ("version: v1\npolicy: [\n", "is not valid YAML"),
    ("version: v1\n  bad: indent\n", "is not valid YAML"),
    ("", "an empty file"),
    ("- version: v1\n", "expected a mapping"),
    (b"\xff\xfe\x00", "not a text file"),
    (None, "cannot read"),  # a directory
])
def test_an_unreadable_or_malformed_file_names_config_and_the_file(tmp_path: Path, content: str | bytes | None,
                                                                   fragment: str) -> None:
    p = tmp_path / "c.yaml"
    if content is None:
        p.mkdir()
    elif isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content)
    err = error(["--config", str(p)])
    assert err.field == "--config" and str(p) in err.message and fragment in err.message, str(err)
    assert "\n" not in str(err)


def test_the_value_is_named_where_it_was_set_not_where_it_was_overridden(tmp_path: Path) -> None:
    f = write(tmp_path, nest({"leaderElection.leaseDuration": "8s"}))
    assert error(["--config", str(f)]).field == "leaderElection.leaseDuration"
    assert error(["--config", str(f)], {"GPU_HEALTH_CONTROLLER_LEASE_DURATION": "9s"}).field == \
        "GPU_HEALTH_CONTROLLER_LEASE_DURATION"
    assert error(["--config", str(f), "--lease-duration", "3s"]).field == "--lease-duration"
    # A file value overridden by a good flag is not read at all.
    f = write(tmp_path, nest({"drain.evictionsPerMinute": 0}))
    assert load(["--config", str(f), "--drain-rate", "5"], {}).drain_per_minute == 5.0


# Durations and selectors --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("given", "seconds"), [
    (90, 90.0), (1.5, 1.5), ("90", 90.0), ("0.25", 0.25), ("90s", 90.0), ("10m", 600.0), ("1h", 3600.0),
    ("1h30m", 5400.0), ("1.5h", 5400.0), ("2m30s", 150.0), ("250ms", 0.25), (" 5s ", 5.0), ("0s", 0.0),
    ("-5s", -5.0), ("1h0m0s", 3600.0),
])
def test_durations(given: Any, seconds: float) -> None:
    assert parse_duration(given) == seconds


@pytest.mark.parametrize("given", ["", "s", "1h30", "10 m", "1d", "m5", "5s5", "nan", "inf", "1e999", True, None,
                                   [1], float("nan")])
def test_bad_durations(given: Any) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(given)


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (90, "1m30s"), (600, "10m"), (3600, "1h"), (5400, "1h30m"), (1.5, "1.5s"), (0.25, "0.25s"),
])
def test_durations_written_back(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(("text", "want"), [
    ("", ()),
    ("  ", ()),
    ("gpu", (Requirement("gpu", "exists"),)),
    ("!spot", (Requirement("spot", "!"),)),
    ("a=b", (Requirement("a", "=", ("b",)),)),
    ("a==b", (Requirement("a", "=", ("b",)),)),
    ("a!=b", (Requirement("a", "!=", ("b",)),)),
    ("a=", (Requirement("a", "=", ("",)),)),
    ("nvidia.com/gpu.present=true, node-role.kubernetes.io/worker",
     (Requirement("nvidia.com/gpu.present", "=", ("true",)), Requirement("node-role.kubernetes.io/worker", "exists"))),
    ("zone in (a, b),tier notin (x)", (Requirement("zone", "in", ("a", "b")), Requirement("tier", "notin", ("x",)))),
    ("k in (a,)", (Requirement("k", "in", ("a", "")),)),
])
def test_selector_syntax(text: str, want: tuple[Requirement, ...]) -> None:
    assert parse_selector(text) == want
    assert load(["--node-selector", text], {}).node_selector == text.strip()


@pytest.mark.parametrize(("text", "why"), [
    ("a,,b", "label key"), (",a", "label key"), ("a,", "nothing after"), ("a=b c", "expected ','"),
    ("a in ()", "at least one value"), ("a in (b", "missing ')'"), ("a in b", "expected '('"),
    ("a in (b c)", "expected ',' or ')'"), ("a > 3", "operator"), ("!", "at the end"), ("!a=b", "expected ','"),
    ("Bad_Key_=x", "label key"), ("a=not ok", "expected ','"), ("a=" + "v" * 64, "label value"),
    ("-a=b", "label key"), ("a in (b,=)", "label value"), ("a=b=c", "expected ','"),
])
def test_bad_selectors(text: str, why: str) -> None:
    with pytest.raises(ValueError, match="not a label selector") as err:
        parse_selector(text)
    assert why in str(err.value) and repr(text) in str(err.value)
    assert error(["--node-selector", text]).field == "--node-selector"


@pytest.mark.parametrize(("selector", "labels", "matches"), [
    ("", {}, True),
    ("gpu", {"gpu": ""}, True), ("gpu", {}, False),
    ("!spot", {}, True), ("!spot", {"spot": "true"}, False),
    ("a=b", {"a": "b"}, True), ("a=b", {"a": "c"}, False), ("a=b", {}, False),
    ("a!=b", {}, True), ("a!=b", {"a": "c"}, True), ("a!=b", {"a": "b"}, False),
    ("z in (x,y)", {"z": "y"}, True), ("z in (x,y)", {"z": "w"}, False), ("z in (x,y)", {}, False),
    ("z notin (x)", {}, True), ("z notin (x)", {"z": "x"}, False),
    ("gpu,z in (x)", {"gpu": "1", "z": "x"}, True), ("gpu,z in (x)", {"z": "x"}, False),
])
def test_selector_matching_is_kubernetes(selector: str, labels: dict[str, str], matches: bool) -> None:
    assert selector_matches(parse_selector(selector), labels) is matches


# --help and the command line -------------------------------------------------------------------------------------

def test_help_lists_every_option_with_its_variable_and_default(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # no wrapping, which would break hyphenated words
    with pytest.raises(SystemExit) as exit_:
        ctl.parse_or_exit(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gpu-health-controller")
    # One entry per option: its flag line and, for a long flag, the help on the next.
    entries = " ".join(out.split("\noptions:\n", 1)[1].split()).split(" --")
    for flag, env, key, default, help_text in options_table():
        line = next((e for e in entries if f"--{e}".startswith(flag + " ")), None)
        assert line is not None, flag
        assert help_text in line and f"env {env}" in line and f"default: {default})" in line, line
        assert (f"; file {key};" in line) if key else ("; file " not in line), line
    assert "{text,json}" in out and "{debug,info,warning,error}" in out


def _run(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(ctl.ENV_PREFIX)} | (env_extra or {})
    probe = "import sys; from plugin.controller.config import parse_or_exit; parse_or_exit(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env=env)


@pytest.mark.parametrize(("args", "line"), [
    (["--recovery-hold", "soon"], "gpu-health-controller: error: --recovery-hold: expected a duration"),
    (["--no-such-flag"], "gpu-health-controller: error: --no-such-flag: unknown flag"),
])
def test_a_bad_flag_exits_2_with_one_line(args: list[str], line: str) -> None:
    r = _run(*args)
    assert r.returncode == 2, r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(line), r.stderr


def test_a_bad_file_exits_2_with_one_line(tmp_path: Path) -> None:
    f = write(tmp_path, "version: v1\nbreaker:\n  maxQuarantinedFraction: 2\n")
    r = _run(env_extra={"GPU_HEALTH_CONTROLLER_CONFIG": str(f)})
    assert r.returncode == 2
    assert r.stderr == "gpu-health-controller: error: breaker.maxQuarantinedFraction: must be in (0, 1], got 2\n"


@pytest.mark.parametrize(("with_file", "yaml_loaded"), [(False, False), (True, True)])
def test_yaml_is_imported_only_to_read_a_file(tmp_path: Path, with_file: bool, yaml_loaded: bool) -> None:
    args = ["--config", str(write(tmp_path, {"version": "v1"}))] if with_file else []
    probe = ("import sys; from plugin.controller.config import load; load(sys.argv[1:], {}); "
             "print('yaml' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(yaml_loaded)


# docs/fleet-config.md -------------------------------------------------------------------------------------------

def test_the_committed_doc_is_what_the_table_renders() -> None:
    doc = (REPO / "docs" / "fleet-config.md").read_text()
    assert doc == gen_docs.render_fleet_config(), "the controller's options changed: run python scripts/gen_docs.py"
    for flag, env, key, default, _ in options_table():
        row = next((ln for ln in doc.splitlines() if ln.startswith(f"| `{flag}` |")), None)
        assert row is not None, flag
        assert f"`{env}`" in row and (f"`{key}`" if key else "(none)") in row and default in row


def test_the_docs_example_file_loads_to_the_defaults(tmp_path: Path) -> None:
    f = write(tmp_path, gen_docs.fleet_example_file())
    assert load(["--config", str(f)], {}) == ControllerConfig(identity=socket.gethostname(), config_file=f)
    text = f.read_text()
    for key in ctl.FILE_KEYS:
        assert f" {key.rpartition('.')[2]}:" in text or text.count(f"\n{key}:") == 1, key
