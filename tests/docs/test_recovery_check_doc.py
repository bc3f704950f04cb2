"""docs/recovery-check.md as an operator copies it: the options table is the option table's, the refusal it shows is
the plugin's, the Helm values pass the chart's schema and give the plugin the check it describes, and the wrapper
script maps a DCGM answer to the exit the check needs (run against a stand-in ``dcgmi``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from plugin import cli
from plugin.config import ConfigError, load, option
from plugin.config import options as config_mod

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "recovery-check.md"
SCHEMA = REPO / "charts" / "gpu-health-device-plugin" / "values.schema.json"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


def test_the_options_table_is_the_option_tables() -> None:
    rows = {m[0]: m[1:] for m in re.findall(r"^\| `(--recovery-check[^ `]*)[^|]*\| `([^`]+)` \| `([^`]+)` \| ([^|]+)\|",
                                             DOC.read_text(), re.M)}
    assert set(rows) == {"--recovery-check", "--recovery-check-timeout"}
    for flag, (env, key, default) in rows.items():
        o = option(flag.removeprefix("--").replace("-", "_"))
        assert (o.env, o.key) == (env, key)
        shown = o.default_text
        assert (shown is None and default.startswith("empty")) or default.startswith(f"`{shown}`"), (flag, default)


def test_the_refusal_shown_is_the_plugins() -> None:
    shown = next(b.strip() for b in blocks("") if b.startswith("--recovery-check:"))
    with pytest.raises(ConfigError) as err:
        load({"recovery_check": "dcgmi diag -i {gpu}"}, {}, None)
    assert str(err.value) == shown


def test_the_helm_values_pass_the_schema_and_set_the_check(tmp_path: Path) -> None:
    values = yaml.safe_load(next(b for b in blocks("yaml") if "extraArgs" in b))
    jsonschema.validate(values, json.loads(SCHEMA.read_text()))
    parsed, unknown = cli.build_parser().parse_known_args(["run", *values["extraArgs"]])
    assert not unknown
    cfg = load({o.name: getattr(parsed, o.name) for o in config_mod.OPTIONS}, {}, None)
    assert cfg.recovery_check == "/opt/dcgm-check/dcgm-check {index}" and cfg.recovery_check_timeout == 600.0
    mount = values["extraVolumeMounts"][0]["mountPath"]
    assert cfg.recovery_check.split()[0] == f"{mount}/dcgm-check"
    assert values["extraEnv"][0] == {"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}


@pytest.mark.parametrize(("output", "code", "expected"), [
    ("Deployment | Pass\nMemory | Pass", 0, 0),
    ("Deployment | Pass\nMemory | Fail - uncorrectable memory errors", 0, 1),  # whatever DCGM's exit code says
    ("Unable to connect to host engine at 10.0.0.7", 226, 226),
])
def test_the_wrapper_passes_the_output_and_fails_on_a_fail_line(tmp_path: Path, output: str, code: int,
                                                                expected: int) -> None:
    wrapper = tmp_path / "dcgm-check"
    wrapper.write_text(next(b for b in blocks("sh") if b.startswith("#!/bin/sh")))
    wrapper.chmod(0o555)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dcgmi").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/argv\nprintf %s {shlex.quote(output)}\n'
                                   f"exit {code}\n")
    (bin_dir / "dcgmi").chmod(0o555)
    env = {"PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}", "NODE_IP": "10.0.0.7"}
    r = subprocess.run([str(wrapper), "3"], capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == expected
    assert r.stdout.strip() == output
    assert (tmp_path / "argv").read_text().split() == ["diag", "--host", "10.0.0.7", "-r", "1", "-i", "3"]
