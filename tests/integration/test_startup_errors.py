"""Bad paths at start, through the real CLI: one line naming the option as the user set it, the path and the OS
error; exit 1 for a path the environment makes unusable, 2 for a configuration (or node file) that is wrong; never
a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import NodeFile

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Case:
    flags: dict[str, str | None] = field(default_factory=dict)  # None: leave the flag out
    env: dict[str, str] = field(default_factory=dict)
    config: str | None = None  # text of a config file passed with --config
    rc: int = 1
    says: tuple[str, ...] = ()  # what the error line must contain; {root} is the test's directory


def _setup(root: Path) -> None:
    NodeFile(root / "node.json")
    (root / "afile").write_text("not a directory\n")
    (root / "empty").write_text("")
    (root / "adir").mkdir()
    (root / "bad.yaml").write_text("version: v1\nplugin: [\n")
    # A kubeconfig whose user authenticates through an exec plugin, which our client refuses.
    (root / "exec.kubeconfig").write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {exec: {command: foo, apiVersion: client.authentication.k8s.io/v1}}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n")


LONG = "x" * 120

CASES: dict[str, Case] = {
    "state dir under a regular file": Case(
        {"--state-dir": "{root}/afile/state"}, says=("--state-dir {root}/afile/state", "Not a directory")),
    "state dir is a regular file": Case(
        {"--state-dir": "{root}/afile"}, says=("--state-dir {root}/afile", "not a directory")),
    "state dir where no file can be created": Case(
        {"--state-dir": "/proc/self"}, says=("--state-dir /proc/self", "cannot create files in it")),
    "state dir from the environment": Case(
        {"--state-dir": None}, env={"GPU_HEALTH_STATE_DIR": "{root}/afile/state"},
        says=("GPU_HEALTH_STATE_DIR {root}/afile/state", "Not a directory")),
    "state dir from the config file": Case(
        {"--state-dir": None}, config="version: v1\nplugin:\n  stateDir: {root}/afile/state\n",
        says=("plugin.stateDir {root}/afile/state", "Not a directory")),
    "plugin dir under a regular file": Case(
        {"--device-plugin-dir": "{root}/afile/dp"}, says=("--device-plugin-dir {root}/afile/dp", "Not a directory")),
    "plugin dir where no file can be created": Case(
        {"--device-plugin-dir": "/proc/self"}, says=("--device-plugin-dir /proc/self", "cannot create files in it")),
    "health socket under a regular file": Case(
        {"--health-socket": "{root}/afile/health.sock"},
        says=("--health-socket {root}/afile/health.sock", "{root}/afile", "not a directory")),
    "health socket is a directory": Case(
        {"--health-socket": "{root}/adir"}, says=("--health-socket", "{root}/adir is a directory")),
    "health socket path too long": Case(
        {"--health-socket": "{root}/" + LONG}, says=("--health-socket", LONG, "at most 107")),
    "dev root missing": Case({"--dev-root": "{root}/nodev"}, says=("--dev-root {root}/nodev", "does not exist")),
    "dev root is a regular file": Case({"--dev-root": "{root}/afile"}, says=("--dev-root {root}/afile",)),
    "boot id file missing": Case(
        {"--boot-id-file": "{root}/boot_id"}, says=("--boot-id-file {root}/boot_id", "cannot read the boot id")),
    "boot id file empty": Case(
        {"--boot-id-file": "{root}/empty"}, says=("--boot-id-file {root}/empty", "holds no boot id")),
    "kubeconfig missing": Case(
        {"--kubeconfig": "{root}/kubeconfig"}, says=("--kubeconfig {root}/kubeconfig", "No such file")),
    # DRA mode (docs/dra.md): its own dirs, and the API access it cannot work without, checked before serving.
    "dra registry dir under a regular file": Case(
        {"--mode": "dra", "--node-name": "n1", "--dra-plugin-dir": "{root}/pl", "--cdi-spec-dir": "{root}/cdi",
         "--dra-registry-dir": "{root}/afile/reg"}, says=("--dra-registry-dir {root}/afile/reg", "Not a directory")),
    "dra socket path too long": Case(
        {"--mode": "dra", "--node-name": "n1", "--dra-plugin-dir": "{root}/" + LONG, "--cdi-spec-dir": "{root}/cdi",
         "--dra-registry-dir": "{root}/reg"}, says=("--dra-plugin-dir", "dra.sock", "at most 107")),
    "dra mode with a kubeconfig no client can use": Case(
        {"--mode": "dra", "--node-name": "n1", "--dra-plugin-dir": "{root}/pl", "--cdi-spec-dir": "{root}/cdi",
         "--dra-registry-dir": "{root}/reg", "--kubeconfig": "{root}/exec.kubeconfig"},
        says=("--kubeconfig", "{root}/exec.kubeconfig", "exec credential plugins are not supported")),
    "simulated node file missing": Case(
        {"--simulated-node": "{root}/missing.json"}, rc=2,
        says=("--simulated-node", "{root}/missing.json", "No such file")),
    "simulated node file is a directory": Case(
        {"--simulated-node": "{root}/adir"}, rc=2, says=("--simulated-node", "{root}/adir", "Is a directory")),
    "simulated node file with the nvml backend": Case(
        {"--backend": "nvml"}, rc=2, says=("--simulated-node", "only valid with --backend simulated")),
    "config file missing": Case(
        {"--config": "{root}/missing.yaml"}, rc=2, says=("--config", "{root}/missing.yaml", "No such file")),
    "config file is a directory": Case(
        {"--config": "{root}/adir"}, rc=2, says=("--config", "{root}/adir", "Is a directory")),
    "config file is bad YAML": Case(
        {"--config": "{root}/bad.yaml"}, rc=2, says=("--config", "{root}/bad.yaml", "not valid YAML")),
    "config file from the environment missing": Case(
        env={"GPU_HEALTH_CONFIG": "{root}/missing.yaml"}, rc=2, says=("GPU_HEALTH_CONFIG", "{root}/missing.yaml")),
}


def run_plugin(root: Path, case: Case) -> subprocess.CompletedProcess[str]:
    fill: Callable[[str], str] = lambda s: s.replace("{root}", str(root))  # noqa: E731
    flags: dict[str, str | None] = {
        "--backend": "simulated", "--simulated-node": "{root}/node.json", "--state-dir": "{root}/state",
        "--device-plugin-dir": "{root}/dp", "--dev-root": "{root}", "--metrics-address": "off", **case.flags}
    if case.config is not None:
        (root / "config.yaml").write_text(fill(case.config))
        flags["--config"] = "{root}/config.yaml"
    args = [a for k, v in flags.items() if v is not None for a in (k, fill(v))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_HEALTH_")}
    env.update({k: fill(v) for k, v in case.env.items()})
    # A plugin that starts despite the bad path would serve until killed: the timeout turns that into a failure.
    return subprocess.run([sys.executable, "-m", "plugin", "run", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=30)


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_path_is_one_line_naming_the_option(short_socket_dir: Path, name: str) -> None:
    case = CASES[name]
    _setup(short_socket_dir)
    r = run_plugin(short_socket_dir, case)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("gpu-health-plugin:")]
    assert len(errors) == 1, r.stderr
    for text in case.says:
        assert text.replace("{root}", str(short_socket_dir)) in errors[0], errors[0]
    assert r.returncode == case.rc, r.stderr
    # Nothing was served: a socket left behind would mislead the next client.
    assert not (short_socket_dir / "state" / "health.sock").exists()
