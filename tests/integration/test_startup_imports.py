"""Start-up imports only what the config switches on: an outlet that is off costs no memory (issue 14, item 8).

Each case builds and starts the real App in a fresh interpreter (simulated backend, no kubelet: registration just
retries) and reads ``sys.modules`` after start, so a module-level import anywhere on the way shows up here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

REPORTING = {"plugin.outlets.reporter", "plugin.schema.annotations", "plugin.outlets.events",
             "plugin.outlets.condition"}
METRICS = {"plugin.outlets.metrics"}
# What the metrics outlet does without: prometheus_client and the HTTP stack it loads cost ~3 MiB of RSS.
METRICS_NEVER = {"prometheus_client", "http.server", "http.client", "email", "wsgiref", "urllib.request"}
CORRELATION = {"plugin.outlets.correlation", "api.podresources.v1.api_pb2"}
NVML = {"pynvml", "plugin.devices.nvml"}
NVSENTINEL_EVENTS = {"plugin.nvsentinel.sender", "plugin.nvsentinel.healthevents",
                     "api.nvsentinel.platformconnector.health_event_pb2"}
DEVICE_API = {"plugin.nvsentinel.deviceapi", "plugin.nvsentinel.gpuconditions",
              "api.nvsentinel.deviceapi.v1alpha1.gpu_pb2"}

PROBE = textwrap.dedent("""
    import json, sys
    from plugin import config
    from plugin.app import App
    flags = {o.name: None for o in config.OPTIONS}
    flags.update(json.loads(sys.argv[1]))
    cfg = config.load(flags, {}, None)
    app = App(cfg)
    app.start()
    try:
        print(json.dumps(sorted(sys.modules)))
    finally:
        app.stop.set()
        app.shutdown(timeout_s=2.0)
""")


def modules_after_start(tmp_path: Path, **flags: str) -> set[str]:
    base = {"backend": "simulated", "device_plugin_dir": str(tmp_path / "dp"), "state_dir": str(tmp_path / "state"),
            "metrics_address": "127.0.0.1:0", "log_level": "error"}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps({**base, **flags})], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def _kubeconfig(tmp_path: Path) -> Path:
    # Never dialled within the probe's lifetime as far as the assertion is concerned: only imports are checked.
    path = tmp_path / "kubeconfig"
    path.write_text(textwrap.dedent("""\
        apiVersion: v1
        kind: Config
        clusters: [{name: c, cluster: {server: "http://127.0.0.1:9"}}]
        users: [{name: u, user: {token: t}}]
        contexts: [{name: x, context: {cluster: c, user: u}}]
        current-context: x
    """))
    return path


def test_defaults_import_no_reporting_no_yaml_no_nvml(tmp_path: Path) -> None:
    mods = modules_after_start(tmp_path)
    assert not mods & REPORTING, "cluster reporting is off without a node name"
    assert "yaml" not in mods, "no config file was given"
    assert not mods & NVML
    assert not mods & NVSENTINEL_EVENTS, "NVSentinel interop is off without a socket"
    assert not mods & DEVICE_API, "NVSentinel's device API is off unless asked for"
    assert METRICS.issubset(mods) and CORRELATION.issubset(mods), "both are on by default"
    assert not mods & METRICS_NEVER, "the metrics outlet writes its formats and serves HTTP on its own"


@pytest.mark.parametrize(("flags", "absent"), [
    ({"metrics_address": "off"}, METRICS),
    ({"correlate_on": "none"}, CORRELATION),
])
def test_an_outlet_that_is_off_is_not_imported(tmp_path: Path, flags: dict[str, str], absent: set[str]) -> None:
    assert not modules_after_start(tmp_path, **flags) & absent


def test_reporting_on_imports_its_modules(tmp_path: Path) -> None:
    mods = modules_after_start(tmp_path, node_name="n1", kubeconfig=str(_kubeconfig(tmp_path)))
    assert REPORTING.issubset(mods)


def test_nvsentinel_events_on_imports_the_sender(tmp_path: Path) -> None:
    # No connector listens: the sender only notes the missing socket, which is enough to show what it loaded.
    assert NVSENTINEL_EVENTS.issubset(modules_after_start(tmp_path, nvsentinel_socket=str(tmp_path / "nv.sock")))


def test_the_device_api_on_imports_its_modules(tmp_path: Path) -> None:
    # No server listens there: the consumer only retries, which is enough to have loaded what it runs on.
    mods = modules_after_start(tmp_path, device_api_socket=str(tmp_path / "device.sock"), device_api_consume="true")
    assert DEVICE_API.issubset(mods)
