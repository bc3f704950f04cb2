"""NVIDIA's device plugin names on our command line: every flag and environment variable of NVIDIA's
k8s-device-plugin v0.20.0 (cmd/nvidia-device-plugin/main.go), each through the real CLI (``plugin.cli.main``, the
``run`` subcommand and the default one), its exit code and its one line asserted; and ``--config`` given NVIDIA's
file."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from plugin import cli
from plugin.config import Config
from plugin.config.nvidia import FLAGS, RELEASE

# NVIDIA's v0.20.0 flags as main.go declares them: name, its aliases, its environment variables. Written here from
# their source, not derived from our table, so a flag our table drops or renames fails the first test.
NVIDIA_V0_20 = [
    ("--mig-strategy", (), ("MIG_STRATEGY",)),
    ("--fail-on-init-error", (), ("FAIL_ON_INIT_ERROR",)),
    ("--driver-root", ("--nvidia-driver-root",), ("NVIDIA_DRIVER_ROOT",)),
    ("--dev-root", ("--nvidia-dev-root",), ("NVIDIA_DEV_ROOT",)),
    ("--pass-device-specs", (), ("PASS_DEVICE_SPECS",)),
    ("--device-list-strategy", (), ("DEVICE_LIST_STRATEGY",)),
    ("--device-id-strategy", (), ("DEVICE_ID_STRATEGY",)),
    ("--gdrcopy-enabled", (), ("GDRCOPY_ENABLED",)),
    ("--gds-enabled", (), ("GDS_ENABLED",)),
    ("--mofed-enabled", (), ("MOFED_ENABLED",)),
    ("--cdi-annotation-prefix", (), ("CDI_ANNOTATION_PREFIX",)),
    ("--nvidia-cdi-hook-path", ("--nvidia-ctk-path",), ("NVIDIA_CDI_HOOK_PATH", "NVIDIA_CTK_PATH")),
    ("--driver-root-ctr-path", ("--container-driver-root",), ("DRIVER_ROOT_CTR_PATH", "CONTAINER_DRIVER_ROOT")),
    ("--mps-root", (), ("MPS_ROOT",)),
    ("--shared-devices-allocation-policy", (), ("SHARED_DEVICES_ALLOCATION_POLICY",)),
    ("--device-discovery-strategy", (), ("DEVICE_DISCOVERY_STRATEGY",)),
    ("--imex-channel-ids", (), ("IMEX_CHANNEL_IDS",)),
    ("--imex-required", (), ("IMEX_REQUIRED",)),
    ("--kubelet-socket", (), ("KUBELET_SOCKET",)),
    ("--config-file", (), ("CONFIG_FILE",)),
    ("--cdi-feature-flags", (), ("CDI_FEATURE_FLAGS",)),
    ("--cdi-disable-hooks", (), ("CDI_DISABLE_HOOKS",)),
]
BOOLEAN = {"--fail-on-init-error", "--pass-device-specs", "--gdrcopy-enabled", "--gds-enabled", "--mofed-enabled",
           "--imex-required"}
OURS_ALREADY = {"--mig-strategy", "--fail-on-init-error", "--dev-root"}  # the same flag: ours, nothing said


@dataclass(frozen=True)
class Row:
    """One value of one NVIDIA flag and what we do with it: ``alias`` sets ``ours`` (our flag, our variable, the
    Config field and its value), ``ignored`` and ``refused`` say ``why`` (a piece of the line)."""
    flag: str
    value: str
    outcome: str  # alias, ignored, refused
    why: str = ""
    ours: tuple[str, str, str, Any] | None = None


def _alias(flag: str, value: str, our_flag: str, our_env: str, field: str, want: Any) -> Row:
    return Row(flag, value, "alias", ours=(our_flag, our_env, field, want))


ROWS = [
    _alias("--mig-strategy", "mixed", "--mig-strategy", "GPU_HEALTH_MIG_STRATEGY", "mig_strategy", "mixed"),
    _alias("--fail-on-init-error", "false", "--fail-on-init-error", "GPU_HEALTH_FAIL_ON_INIT_ERROR",
           "fail_on_init_error", False),
    Row("--driver-root", "/run/nvidia/driver", "ignored", "NVIDIA runtime of runtimeClassName"),
    _alias("--dev-root", "/", "--dev-root", "GPU_HEALTH_DEV_ROOT", "dev_root", Path("/")),
    Row("--pass-device-specs", "true", "ignored", "always returns the allocated GPUs' device specs"),
    Row("--device-list-strategy", "envvar", "ignored", "always passes NVIDIA_VISIBLE_DEVICES"),
    _alias("--device-list-strategy", "cdi-cri", "--cdi", "GPU_HEALTH_CDI", "cdi", True),
    Row("--device-list-strategy", "volume-mounts", "refused", "use envvar or cdi-cri"),
    Row("--device-list-strategy", "cdi-annotations", "refused", "use envvar or cdi-cri"),
    Row("--device-id-strategy", "uuid", "ignored", "names devices by UUID"),
    Row("--device-id-strategy", "index", "refused", "drain each node before the switch"),
    Row("--gdrcopy-enabled", "false", "ignored", "it is off"),
    Row("--gdrcopy-enabled", "true", "refused", "set NVIDIA_GDRCOPY=enabled in the pods"),
    Row("--gds-enabled", "false", "ignored", "it is off"),
    Row("--gds-enabled", "true", "refused", "set NVIDIA_GDS=enabled in the pods"),
    Row("--mofed-enabled", "false", "ignored", "it is off"),
    Row("--mofed-enabled", "true", "refused", "set NVIDIA_MOFED=enabled in the pods"),
    Row("--cdi-annotation-prefix", "cdi.k8s.io/", "ignored", "sets no CDI annotations"),
    Row("--nvidia-cdi-hook-path", "/usr/bin/nvidia-cdi-hook", "ignored", "generates no CDI specs"),
    Row("--driver-root-ctr-path", "/driver-root", "ignored", "generates no CDI specs"),
    Row("--mps-root", "/run/nvidia/mps", "ignored", "only MPS sharing uses it"),
    Row("--shared-devices-allocation-policy", "distributed", "ignored", "by default, as distributed does"),
    Row("--shared-devices-allocation-policy", "packed", "refused", "sharing.timeSlicing.allocationPolicy: packed"),
    Row("--device-discovery-strategy", "auto", "ignored", "finds GPUs through NVML"),
    Row("--device-discovery-strategy", "nvml", "ignored", "finds GPUs through NVML"),
    Row("--device-discovery-strategy", "tegra", "refused", "no Tegra discovery"),
    Row("--imex-channel-ids", "0", "refused", "injects no IMEX channels"),
    Row("--imex-required", "false", "ignored", "it is off"),
    Row("--imex-required", "true", "refused", "injects no IMEX channels"),
    _alias("--kubelet-socket", "/var/lib/kubelet/device-plugins/kubelet.sock", "--device-plugin-dir",
           "GPU_HEALTH_DEVICE_PLUGIN_DIR", "device_plugin_dir", Path("/var/lib/kubelet/device-plugins")),
    Row("--kubelet-socket", "/var/lib/kubelet/device-plugins/other.sock", "refused", "as kubelet.sock in "
        "--device-plugin-dir"),
    Row("--kubelet-socket", "", "refused", "always registers with the kubelet"),
    _alias("--config-file", "{ours}", "--config", "GPU_HEALTH_CONFIG", "poll_interval", 7.0),
    Row("--cdi-feature-flags", "disable-multiple-csv-devices", "ignored", "generates no CDI specs"),
    Row("--cdi-disable-hooks", "all", "ignored", "generates no CDI specs"),
]
_BY_FLAG = {flag: (aliases, env) for flag, aliases, env in NVIDIA_V0_20}


def test_the_table_holds_every_flag_of_nvidias_release_and_only_those() -> None:
    assert RELEASE == "v0.20.0"
    assert [(r.flag, r.aliases, r.env) for r in FLAGS] == NVIDIA_V0_20
    assert {r.flag for r in FLAGS if r.boolean} == BOOLEAN
    assert {r.flag for r in ROWS} == set(_BY_FLAG), "a flag of NVIDIA's without a row here"


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[Config]]:
    """The CLI as it is, up to the App: the Config it would start with is kept instead of started."""
    for var in list(os.environ):
        if var.startswith("GPU_HEALTH_") or any(var in env for _, _, env in NVIDIA_V0_20):
            monkeypatch.delenv(var)
    seen: list[Config] = []

    def run(cfg: Config) -> int:
        seen.append(cfg)
        return 0

    monkeypatch.setattr("plugin.app.run", run)
    (tmp_path / "ours.yaml").write_text("version: v1\nplugin:\n  pollInterval: 7\n")
    monkeypatch.chdir(tmp_path)
    yield seen


def _value(row: Row, tmp: Path) -> str:
    return row.value.replace("{ours}", str(tmp / "ours.yaml"))


def _check(row: Row, name: str, what: str, value: str, rc: int, err: str, seen: list[Config]) -> None:
    lines = err.splitlines()
    if row.outcome == "refused":
        assert rc == 2 and not seen
        assert len(lines) == 1, err
        assert lines[0].startswith(f"gpu-health-plugin: invalid configuration: {name}: NVIDIA's {what}, no "
                                   f"equivalent here for {value!r}: "), lines[0]
        assert row.why in lines[0]
        return
    assert rc == 0 and len(seen) == 1
    if row.outcome == "ignored":
        assert len(lines) == 1, err
        assert lines[0].startswith(f"gpu-health-plugin: warning: {name}: NVIDIA's {what}, ignored: not needed: ")
        assert row.why in lines[0]
        assert set(seen[0].source.values()) == {"default"}  # nothing of ours moved
        return
    assert row.ours is not None
    our_flag, our_env, field, want = row.ours
    assert getattr(seen[0], field) == want
    if name == our_flag:
        assert lines == []  # NVIDIA's name is ours: nothing to say
        return
    ours = our_env if what == "env name" else our_flag
    text = "true" if our_flag == "--cdi" else value
    if our_flag == "--device-plugin-dir":
        text = os.path.dirname(value)
    assert lines == [f"gpu-health-plugin: warning: {name}: NVIDIA's {what}, taken as {ours}={text}; use that"]


FLAG_CASES = [(row, name) for row in ROWS for name in (row.flag, *_BY_FLAG[row.flag][0])]
ENV_CASES = [(row, var) for row in ROWS for var in _BY_FLAG[row.flag][1]]


@pytest.mark.parametrize("subcommand", [["run"], []], ids=["run", "default"])
@pytest.mark.parametrize(("row", "name"), FLAG_CASES, ids=[f"{n}={r.value}" for r, n in FLAG_CASES])
def test_each_nvidia_flag(row: Row, name: str, subcommand: list[str], started: list[Config], tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    value = _value(row, tmp_path)
    argv = [f"{name}={value}"] if name in BOOLEAN or not value else [name, value]
    rc = cli.main([*subcommand, *argv])
    _check(row, name, "flag", value, rc, capsys.readouterr().err, started)


@pytest.mark.parametrize(("row", "var"), ENV_CASES, ids=[f"{v}={r.value}" for r, v in ENV_CASES])
def test_each_nvidia_env_name(row: Row, var: str, started: list[Config], tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    value = _value(row, tmp_path)
    monkeypatch.setenv(var, value)
    rc = cli.main([])
    _check(row, var, "env name", value, rc, capsys.readouterr().err, started)


def test_a_bare_nvidia_bool_flag_means_true(started: list[Config], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--gds-enabled"]) == 2
    assert "no equivalent here for 'true'" in capsys.readouterr().err


def test_a_list_flag_given_twice_is_judged_whole(started: list[Config], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--device-list-strategy", "envvar", "--device-list-strategy", "cdi-cri"]) == 0
    assert started[0].cdi is True
    assert capsys.readouterr().err.splitlines() == [
        "gpu-health-plugin: warning: --device-list-strategy: NVIDIA's flag, taken as --cdi=true; use that"]


@pytest.mark.parametrize(("argv", "env", "line"), [
    (["--kubelet-socket", "/k/kubelet.sock", "--device-plugin-dir", "/k"], {},
     "--kubelet-socket: NVIDIA's name for --device-plugin-dir, which is given too: drop one"),
    ([], {"MIG_STRATEGY": "single", "GPU_HEALTH_MIG_STRATEGY": "mixed"},
     "MIG_STRATEGY: NVIDIA's env name for GPU_HEALTH_MIG_STRATEGY, which is set too: drop one"),
    ([], {"MIG_STRATEGY": "halves"}, "MIG_STRATEGY: expected one of none, single, mixed, got 'halves'"),
    (["--nvidia-dev-root"], {}, "--nvidia-dev-root: expected a value"),
])
def test_both_names_or_a_bad_value_are_one_line_naming_nvidias(
        argv: list[str], env: dict[str, str], line: str, started: list[Config], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(argv) == 2 and not started
    assert capsys.readouterr().err.splitlines() == [f"gpu-health-plugin: invalid configuration: {line}"]


def test_nvidia_env_under_our_flag_follows_flags_over_env(started: list[Config], monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MIG_STRATEGY", "mixed")
    assert cli.main(["--mig-strategy", "single"]) == 0
    assert started[0].mig_strategy == "single" and started[0].set_by["mig_strategy"] == "--mig-strategy"
    assert len(capsys.readouterr().err.splitlines()) == 1  # still said: the variable is NVIDIA's


@pytest.mark.parametrize(("text", "what"), [
    ("version: v1\nflags:\n  migStrategy: single\n", "config file"),
    ("version: v1\nsharing:\n  mps:\n    resources: [{name: nvidia.com/gpu, replicas: 2}]\n", "config file"),
    ("migStrategy: single\nconfig:\n  name: theirs\n", "Helm values"),
])
def test_config_given_nvidias_format_says_to_migrate(text: str, what: str, started: list[Config], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "theirs.yaml"
    f.write_text(text)
    assert cli.main(["run", "--config", str(f)]) == 2 and not started
    assert capsys.readouterr().err.splitlines() == [
        f"gpu-health-plugin: invalid configuration: --config: {f} is NVIDIA's device plugin {what}, not ours: run "
        f"gpu-health-plugin migrate-config {f} and use what it prints"]


def test_config_file_env_naming_nvidias_file_says_both(started: list[Config], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "theirs.yaml"
    f.write_text("version: v1\nflags:\n  failOnInitError: true\n")
    monkeypatch.setenv("CONFIG_FILE", str(f))
    assert cli.main([]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"gpu-health-plugin: warning: CONFIG_FILE: NVIDIA's env name, taken as GPU_HEALTH_CONFIG={f}; use that",
        f"gpu-health-plugin: invalid configuration: GPU_HEALTH_CONFIG: {f} is NVIDIA's device plugin config file, "
        f"not ours: run gpu-health-plugin migrate-config {f} and use what it prints"]


def test_our_own_file_with_an_unknown_key_keeps_its_error(started: list[Config], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "ours.yaml"
    f.write_text("version: v1\nplugins:\n  pollInterval: 2\n")
    assert cli.main(["--config", str(f)]) == 2
    assert capsys.readouterr().err.startswith("gpu-health-plugin: invalid configuration: plugins: unknown key")
