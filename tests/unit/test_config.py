"""Config: precedence flags > env > file > defaults; every bad value names its field; the CLI exits 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from plugin.config import ConfigError, load
from plugin.health.states import State

NO_FLAGS: dict[str, object] = {}


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults() -> None:
    cfg = load(NO_FLAGS, {}, None)
    assert cfg.backend == "nvml" and cfg.poll_interval == 5.0 and cfg.resource_name == "nvidia.com/gpu"
    assert cfg.health_socket_path == Path("/var/lib/gpu-health-device-plugin/health.sock")
    assert cfg.health.kubelet_health[State.DEGRADED] == "Healthy"


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    f = write(tmp_path, "version: v1\nplugin:\n  pollInterval: 7\n  logFormat: json\n  cdi: true\n")
    env = {"GPU_HEALTH_POLL_INTERVAL": "3", "GPU_HEALTH_LOG_FORMAT": "text"}
    cfg = load({"poll_interval": "1.5"}, env, f)
    assert cfg.poll_interval == 1.5 and cfg.source["poll_interval"] == "flag"
    assert cfg.log_format == "text" and cfg.source["log_format"] == "env"
    assert cfg.cdi is True and cfg.source["cdi"] == "file"
    assert cfg.source["backend"] == "default"


def test_json_file_and_health_section(tmp_path: Path) -> None:
    f = write(tmp_path, '{"version": "v1", "health": {"xid": {"fatal": [13, 79], "application": [31]},'
                        ' "clearAfterPolls": 5, "overrides": {"pcie-link-degraded": "ignore"},'
                        ' "kubeletHealth": {"Degraded": "Unhealthy"}, "latchHoldSeconds": {"Degraded": 60},'
                        ' "flap": {"max": 2}}}', "c.json")
    h = load(NO_FLAGS, {}, f).health
    assert h.fatal_xids == frozenset({13, 79}) and h.application_xids == frozenset({31})
    assert h.clear_after_polls == 5 and h.overrides == {"pcie-link-degraded": "ignore"}
    assert h.kubelet_health[State.DEGRADED] == "Unhealthy" and h.latch_hold_s[State.DEGRADED] == 60
    assert h.flap_max == 2


@pytest.mark.parametrize(("flags", "env", "text", "field"), [
    ({"poll_interval": "0"}, {}, None, "--poll-interval"),
    ({"poll_interval": "fast"}, {}, None, "--poll-interval"),
    ({}, {"GPU_HEALTH_BACKEND": "cuda"}, None, "GPU_HEALTH_BACKEND"),
    ({"cdi": "maybe"}, {}, None, "--cdi"),
    ({"resource_name": "kubernetes.io/gpu"}, {}, None, "--resource-name"),
    ({}, {}, "version: v2\n", "version"),
    ({}, {}, "version: v1\nplugin:\n  pollIntervall: 3\n", "plugin.pollIntervall"),
    ({}, {}, "version: v1\nplugin:\n  pollInterval: -1\n", "plugin.pollInterval"),
    ({}, {}, "version: v1\nhealth:\n  xid:\n    fatal: [79, x]\n", "health.xid.fatal"),
    ({}, {}, "version: v1\nhealth:\n  xid:\n    fatal: [13]\n", "health.xid.fatal"),  # 13 is also application
    ({}, {}, "version: v1\nhealth:\n  clearAfterPolls: 0\n", "health.clearAfterPolls"),
    ({}, {}, "version: v1\nhealth:\n  overrides:\n    nvlink-down: Broken\n", "health.overrides.nvlink-down"),
    ({}, {}, "version: v1\nhealth:\n  kubeletHealth:\n    Degraded: Maybe\n", "health.kubeletHealth.Degraded"),
    ({}, {}, "version: v1\nhealth:\n  flap:\n    often: 3\n", "health.flap.often"),
    ({}, {}, "version: v1\nnonsense: {}\n", "nonsense"),
    ({}, {}, "version: v1\nplugin: [\n", "config"),
])
def test_invalid_values_name_the_field(tmp_path: Path, flags: dict[str, object], env: dict[str, str],
                                       text: str | None, field: str) -> None:
    f = write(tmp_path, text) if text is not None else None
    with pytest.raises(ConfigError) as err:
        load(flags, env, f)
    assert err.value.field == field, str(err.value)


def test_simulated_node_needs_simulated_backend(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="simulated_node"):
        load({"simulated_node": str(tmp_path / "n.json")}, {}, None)


def test_cli_exits_2_naming_the_field(tmp_path: Path) -> None:
    f = write(tmp_path, "version: v1\nplugin:\n  pollInterval: soon\n")
    r = subprocess.run([sys.executable, "-m", "plugin", "--config", str(f)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert "plugin.pollInterval" in r.stderr and "soon" in r.stderr


def test_cli_exits_2_on_bad_node_file(tmp_path: Path) -> None:
    node = write(tmp_path, '{"gpus": [{"uuid": "GPU-1"}]}', "node.json")
    r = subprocess.run([sys.executable, "-m", "plugin", "run", "--backend", "simulated", "--simulated-node",
                        str(node), "--state-dir", str(tmp_path / "s")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "gpus[0] (GPU-1).index: missing" in r.stderr
