"""The node files and commands the documentation shows work when copied: the example in docs/simulated-node.md and
the README's `simulated-node --write` + `run --simulated-node node.json` lines. The commands and the example are
read out of the documents themselves, so the documents and this test cannot drift apart; only ``/tmp/`` is moved
under the test's own directory, and ``gpu-health-plugin`` is this interpreter's ``-m plugin``."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from plugin.devices.simulated import builtin_node, load_node_file

REPO = Path(__file__).resolve().parents[2]
WAIT = 60.0  # generous: a loaded 2-core machine starts Python, gRPC and the plugin slowly


def blocks(doc: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", doc.read_text(), re.S)


def command(doc: Path, *must_contain: str) -> list[str]:
    """The one documented ``gpu-health-plugin`` command line holding every string in ``must_contain``."""
    found = [line for block in blocks(doc, "sh") for line in block.splitlines()
             if line.startswith("gpu-health-plugin ") and all(s in line for s in must_contain)]
    assert len(found) == 1, f"{doc.name}: expected one command with {must_contain}, found {found}"
    return shlex.split(found[0], comments=True)


def argv(words: list[str], tmp: Path) -> list[str]:
    assert words[0] == "gpu-health-plugin"
    moved = [str(tmp) + w[len("/tmp"):] if w.startswith("/tmp/") else w for w in words[1:]]
    return [sys.executable, "-m", "plugin", *moved]


def clean_env() -> dict[str, str]:
    # The user's shell as the documents assume it: none of the plugin's settings, no cluster. Metrics off only so
    # that parallel tests do not fight over the default port; the command line itself is as documented.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GPU_HEALTH_") and k not in ("NODE_NAME", "KUBECONFIG")}
    env["GPU_HEALTH_METRICS_ADDRESS"] = "off"
    env["PYTHONPATH"] = str(REPO)
    return env


def serve_and_check(run: list[str], status: list[str], tmp: Path, expect: list[str]) -> None:
    """Start ``run``, wait until ``status`` lists every uuid in ``expect`` as Healthy, then SIGTERM: exit 0."""
    env = clean_env()
    log = (tmp / "plugin.log").open("w")
    proc = subprocess.Popen(run, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + WAIT
        rows: dict[str, str] = {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the plugin exited {proc.returncode}: {(tmp / 'plugin.log').read_text()}"
            out = subprocess.run(status, cwd=tmp, env=env, capture_output=True, text=True, timeout=WAIT)
            if out.returncode == 0:
                rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:] if line.strip()}
                if sorted(rows) == sorted(expect):
                    break
            time.sleep(0.2)  # polling a subprocess for an observable condition; there is no event to await
        assert sorted(rows) == sorted(expect), (rows, (tmp / "plugin.log").read_text())
        assert all(" Healthy " in row for row in rows.values()), rows
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT) == 0, (tmp / "plugin.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert "Traceback" not in (tmp / "plugin.log").read_text()


def test_the_example_in_simulated_node_md_starts_the_plugin_as_written(short_socket_dir: Path) -> None:
    tmp = short_socket_dir  # the documented state dir holds a unix socket: a short path keeps it bindable
    doc = REPO / "docs" / "simulated-node.md"
    example = blocks(doc, "json")[0]
    (tmp / "node.json").write_text(example)
    gpus = load_node_file(tmp / "node.json")  # the backend's own validator accepts it
    run = command(doc, " run ", "--simulated-node node.json")
    status = command(doc, " status ")
    serve_and_check(argv(run, tmp), argv(status, tmp), tmp, [s.gpu.uuid for s in gpus])


def test_the_readme_writes_the_builtin_node_and_runs_on_it(short_socket_dir: Path) -> None:
    tmp = short_socket_dir  # the documented state dir holds a unix socket: a short path keeps it bindable
    readme = REPO / "README.md"
    write = command(readme, "simulated-node --write node.json")
    done = subprocess.run(argv(write, tmp), cwd=tmp, env=clean_env(), capture_output=True, text=True,
                          timeout=WAIT)
    assert done.returncode == 0, done.stderr
    written = tmp / "node.json"
    assert json.loads(written.read_text()) == builtin_node()  # the demo's node, exactly
    gpus = load_node_file(written)
    assert len(gpus) == 8 and all(not s.missing_peers for s in gpus)
    # Writing again would clobber edits: refused, with the flag named, unless --force.
    again = subprocess.run(argv(write, tmp), cwd=tmp, env=clean_env(), capture_output=True, text=True,
                           timeout=WAIT)
    assert again.returncode == 2 and "--write node.json: the file exists" in again.stderr
    assert "Traceback" not in again.stderr
    run = command(readme, " run ", "--simulated-node node.json")
    status = ["gpu-health-plugin", "status", "--health-socket", "/tmp/state/health.sock"]
    serve_and_check(argv(run, tmp), argv(status, tmp), tmp, [s.gpu.uuid for s in gpus])
