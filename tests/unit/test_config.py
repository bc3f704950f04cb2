"""Config: precedence flags > env > file > defaults; every bad value names its field; the CLI exits 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from plugin.config import ConfigError, load
from plugin.health.reasons import State

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
    ({}, {}, "version: v1\nhealth:\n  nvlinkExpectedLinks: [18]\n", "health.nvlinkExpectedLinks"),
    ({}, {}, "version: v1\nhealth:\n  nvlinkExpectedLinks:\n    NVIDIA H100 80GB HBM3: -1\n",
     "health.nvlinkExpectedLinks.NVIDIA H100 80GB HBM3"),
    ({}, {}, "version: v1\nnonsense: {}\n", "nonsense"),
    ({}, {}, "version: v1\nplugin: [\n", "--config"),
])
def test_invalid_values_name_the_field(tmp_path: Path, flags: dict[str, object], env: dict[str, str],
                                       text: str | None, field: str) -> None:
    f = write(tmp_path, text) if text is not None else None
    with pytest.raises(ConfigError) as err:
        load(flags, env, f)
    assert err.value.field == field, str(err.value)


@pytest.mark.parametrize(("flags", "env", "text", "named"), [
    ({"simulated_node": "n.json"}, {}, None, "--simulated-node"),
    ({}, {"GPU_HEALTH_SIMULATED_NODE": "n.json"}, None, "GPU_HEALTH_SIMULATED_NODE"),
    ({}, {}, "version: v1\nplugin:\n  simulatedNode: n.json\n", "plugin.simulatedNode"),
])
def test_simulated_node_needs_simulated_backend_named_as_the_user_set_it(
        tmp_path: Path, flags: dict[str, object], env: dict[str, str], text: str | None, named: str) -> None:
    f = write(tmp_path, text) if text is not None else None
    with pytest.raises(ConfigError) as err:
        load(flags, env, f)
    assert err.value.field == named
    assert str(err.value).startswith(f"{named}: only valid with --backend simulated (the backend is nvml)")
    assert "simulated_node" not in str(err.value)


def test_the_backend_that_conflicts_is_named_where_it_was_set() -> None:
    with pytest.raises(ConfigError) as err:
        load({"simulated_node": "n.json"}, {"GPU_HEALTH_BACKEND": "nvml"}, None)
    assert "set by GPU_HEALTH_BACKEND" in str(err.value)


PATH_OPTIONS = ("simulated_node", "device_plugin_dir", "state_dir", "health_socket", "dev_root",
                "pod_resources_socket", "kubeconfig")


@pytest.mark.parametrize("source", ["flag", "env", "file"])
@pytest.mark.parametrize("name", PATH_OPTIONS)
def test_relative_paths_are_taken_against_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, name: str) -> None:
    from plugin.config import option

    o = option(name)
    monkeypatch.chdir(tmp_path)
    flags: dict[str, object] = {"backend": "simulated"}
    env: dict[str, str] = {}
    file = None
    if source == "flag":
        flags[name] = "rel/../sub/x"
    elif source == "env":
        env[o.env] = "rel/../sub/x"
    else:
        file = write(tmp_path, f"version: v1\nplugin:\n  {o.leaf}: rel/../sub/x\n")
    cfg = load(flags, env, file)
    monkeypatch.chdir("/")  # a later change of directory must not move the path
    assert getattr(cfg, name) == tmp_path / "sub" / "x"
    assert cfg.effective()[name] == str(tmp_path / "sub" / "x")


def test_a_relative_config_file_is_read_from_the_working_directory(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "version: v1\nplugin:\n  pollInterval: 7\n")
    monkeypatch.chdir(tmp_path)
    assert load(NO_FLAGS, {}, Path("config.yaml")).poll_interval == 7


def test_health_socket_default_follows_a_relative_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load({"state_dir": "state"}, {}, None)
    assert cfg.health_socket_path == tmp_path / "state" / "health.sock"


def test_run_help_shows_the_real_defaults_and_the_choices(capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from plugin import cli

    monkeypatch.setenv("COLUMNS", "2000")  # one line per option: no wrapping to match across
    with pytest.raises(SystemExit) as done:
        cli.main(["run", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "None" not in out and "Path(" not in out and "()" not in out
    assert "{nvml,simulated}" in out and "{text,json}" in out

    from plugin.config import OPTIONS
    # One entry per option: its first line starts with the flag, the help may follow on the next line.
    entries = {e.split()[0]: " ".join(e.split()) for e in ("\n" + out).split("\n  -")[1:]}
    entries = {"-" + k: v for k, v in entries.items()}
    defaults = load(NO_FLAGS, {}, None)
    for o in OPTIONS:
        line = entries[o.flag]
        if o.choices:
            assert "{" + ",".join(o.choices) + "}" in line, line
        shown = o.default_text
        if shown is None:
            continue  # unset by default; the option's help says what that means
        assert f"(env {o.env}; default: {shown})" in line, line
        # What --help shows as the default, fed back in, is what the program uses when the option is unset.
        assert o.parse(shown) == getattr(defaults, o.name), o.flag
    assert "health.sock in the state dir" in entries["--health-socket"]


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


@pytest.mark.parametrize(("name", "text", "yaml_loaded"), [
    (None, "", False),
    ("config.json", '{"version": "v1", "plugin": {"pollInterval": 7}}', False),
    ("config.yaml", "version: v1\nplugin:\n  pollInterval: 7\n", True),
])
def test_the_yaml_parser_is_imported_only_to_read_a_yaml_file(tmp_path: Path, name: str | None, text: str,
                                                              yaml_loaded: bool) -> None:
    file = [str(write(tmp_path, text, name))] if name else []
    probe = ("import sys; from pathlib import Path; from plugin.config import load; "
             "load({}, {}, Path(sys.argv[1]) if sys.argv[1:] else None); print('yaml' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe, *file], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(yaml_loaded)


# DRA mode (docs/dra.md): what it cannot do is refused at load, naming the option as the user set it. ------------

def test_dra_mode_defaults_and_paths() -> None:
    cfg = load({"mode": "dra"}, {"NODE_NAME": "gpu-1"}, None)
    assert cfg.mode == "dra" and cfg.dra_degraded_health == "Healthy" and cfg.dra_degraded_taint is True
    assert cfg.dra_plugin_dir == Path("/var/lib/kubelet/plugins/gpu.gpu-health.io")
    assert cfg.dra_registry_dir == Path("/var/lib/kubelet/plugins_registry")
    assert cfg.cdi_spec_dir == Path("/var/run/cdi")
    assert load(NO_FLAGS, {}, None).mode == "device-plugin"


@pytest.mark.parametrize(("flags", "env", "text", "named", "says"), [
    ({"mode": "dra"}, {}, None, "--node-name", "needs this node's name"),
    ({}, {"GPU_HEALTH_MODE": "dra", "NODE_NAME": "n"}, "version: v1\nplugin:\n  migStrategy: single\n",
     "plugin.migStrategy", "single is device-plugin mode's; with --mode dra use mixed"),
    ({"mode": "dra", "node_name": "n", "mig_strategy": "single"}, {}, None, "--mig-strategy",
     "a claim selects instances by its profile attribute"),
    ({"mode": "dra", "node_name": "n"}, {}, "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
     "      - name: nvidia.com/gpu\n        replicas: 4\n        rename: nvidia.com/gpu.shared\n",
     "sharing.timeSlicing.resources[0].rename", "keeps a shared GPU's name"),
    ({"mode": "dra", "node_name": "n"}, {}, "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n"
     "    resources:\n      - name: nvidia.com/gpu\n        replicas: 4\n",
     "sharing.timeSlicing.resources[0].rename", "remove rename (and renameByDefault)"),
    ({"mode": "dra", "node_name": "n"}, {}, "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
     "      - name: nvidia.com/gpu\n        replicas: 4\n        failRequestsGreaterThanOne: true\n",
     "sharing.timeSlicing.resources[0].failRequestsGreaterThanOne", "never more than replicas"),
    ({"mode": "dra", "node_name": "n"}, {}, "version: v1\nsharing:\n  timeSlicing:\n    allocationPolicy: packed\n"
     "    resources:\n      - name: nvidia.com/gpu\n        replicas: 4\n",
     "sharing.timeSlicing.allocationPolicy", "the scheduler places claims"),
    ({"mode": "dra", "node_name": "n", "dra_unhealthy_taint_effect": "NoExcute"}, {}, None,
     "--dra-unhealthy-taint-effect", "NoSchedule, NoExecute"),
])
def test_dra_mode_refuses_what_it_cannot_do(tmp_path: Path, flags: dict[str, object], env: dict[str, str],
                                            text: str | None, named: str, says: str) -> None:
    f = write(tmp_path, text) if text is not None else None
    with pytest.raises(ConfigError) as err:
        load(flags, env, f)
    assert err.value.field == named, str(err.value)
    assert says in str(err.value)


def test_dra_mode_takes_a_sharing_section_of_replicas_for_gpus_and_mig_profiles(tmp_path: Path) -> None:
    f = write(tmp_path, "version: v1\nplugin:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
                        "      - name: nvidia.com/gpu\n        replicas: 4\n        devices: [0, 1]\n"
                        "      - name: nvidia.com/mig-1g.10gb\n        replicas: 2\n")
    cfg = load({"mode": "dra", "node_name": "n"}, {}, f)
    assert [(r.name, r.replicas) for r in cfg.sharing.resources] == [("nvidia.com/gpu", 4),
                                                                      ("nvidia.com/mig-1g.10gb", 2)]


def test_dra_mode_takes_mig_strategies_none_and_mixed() -> None:
    """none publishes every GPU whole (the default), mixed publishes MIG instances as devices of their own."""
    for strategy in ("none", "mixed"):
        assert load({"mode": "dra", "mig_strategy": strategy}, {"NODE_NAME": "gpu-1"}, None).mig_strategy == strategy


def test_cli_exits_2_on_dra_mode_without_a_node_name() -> None:
    r = subprocess.run([sys.executable, "-m", "plugin", "run", "--mode", "dra"], capture_output=True, text=True,
                       timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().endswith("--node-name: --mode dra needs this node's name: its ResourceSlice and claims "
                                     "are looked up by it")


@pytest.mark.parametrize(("flags", "message"), [
    ({"poll_interval": "fast"}, "--poll-interval: expected a number, got 'fast'"),
    ({"poll_interval": "inf"}, "--poll-interval: must be a positive number, got 'inf'"),
    ({"report_debounce": [1]}, "--report-debounce: expected a number, got [1]"),
])
def test_a_value_that_is_no_number_says_so_in_the_users_words(flags: dict[str, object], message: str) -> None:
    # Not Python's "could not convert string to float": the line names the option and what it wanted.
    with pytest.raises(ConfigError) as err:
        load(flags, {}, None)
    assert str(err.value) == message
