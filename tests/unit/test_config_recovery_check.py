"""The recovery check's options and the boot id file: defaults, every source, and a template that could never run
refused at load with one line naming the option (docs/recovery-check.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from plugin.config import ConfigError, load, option

REPO = Path(__file__).resolve().parents[2]


def test_defaults_no_check_ten_minutes_and_the_kernels_boot_id() -> None:
    cfg = load({}, {}, None)
    assert cfg.recovery_check == "" and cfg.recovery_check_timeout == 600.0
    assert cfg.boot_id_file == Path("/proc/sys/kernel/random/boot_id")
    assert option("recovery_check").flag == "--recovery-check"
    assert option("recovery_check_timeout").key == "plugin.recoveryCheckTimeout"


def test_every_source_sets_them(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("version: v1\nplugin:\n  recoveryCheck: dcgmi diag -r 1 -i {index}\n  recoveryCheckTimeout: 300\n"
                 "  bootIdFile: boot_id\n")
    cfg = load({}, {}, f)
    assert cfg.recovery_check == "dcgmi diag -r 1 -i {index}" and cfg.recovery_check_timeout == 300.0
    assert cfg.boot_id_file == Path.cwd() / "boot_id"
    cfg = load({"recovery_check": "  /host/check {uuid}  "}, {"GPU_HEALTH_RECOVERY_CHECK_TIMEOUT": "90"}, f)
    assert cfg.recovery_check == "/host/check {uuid}" and cfg.source["recovery_check"] == "flag"
    assert cfg.recovery_check_timeout == 90.0 and cfg.source["recovery_check_timeout"] == "env"
    assert load({"recovery_check": "  "}, {}, None).recovery_check == "", "blank is off"


@pytest.mark.parametrize(("flags", "env", "text", "message"), [
    ({"recovery_check": "dcgmi diag -i {gpu}"}, {}, None,
     "--recovery-check: unknown placeholder {gpu} (known: {index}, {uuid}, {pci}; {{ and }} are literal braces)"),
    ({}, {"GPU_HEALTH_RECOVERY_CHECK": "dcgmi diag 'unclosed"}, None,
     "GPU_HEALTH_RECOVERY_CHECK: cannot split the command like a shell would: no closing quotation"),
    ({}, {}, "version: v1\nplugin:\n  recoveryCheck: [dcgmi, diag]\n",
     "plugin.recoveryCheck: expected a command (a string), got ['dcgmi', 'diag']"),
    ({"recovery_check_timeout": "0"}, {}, None, "--recovery-check-timeout: must be a positive number, got '0'"),
    ({"boot_id_file": ""}, {}, None, "--boot-id-file: expected a path, got ''"),
])
def test_bad_values_name_the_option(tmp_path: Path, flags: dict[str, object], env: dict[str, str], text: str | None,
                                    message: str) -> None:
    f = None
    if text is not None:
        f = tmp_path / "c.yaml"
        f.write_text(text)
    with pytest.raises(ConfigError) as err:
        load(flags, env, f)
    assert str(err.value) == message


def test_the_cli_refuses_a_bad_template_in_one_line_with_exit_2(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "plugin", "run", "--backend", "simulated", "--state-dir",
                        str(tmp_path / "s"), "--recovery-check", "dcgmi diag -r 1 -i {gpu_index}"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].endswith("--recovery-check: unknown placeholder {gpu_index} (known: {index}, {uuid}, {pci}; "
                             "{{ and }} are literal braces)"), lines
