"""scripts/local-cluster's own life cycle, run before the stories (which share one cluster): an up killed half way
is undone by down, and down leaves no process, mount, interface or directory behind."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from scripts.localcluster import cluster as lc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent.parent


def test_an_up_killed_half_way_is_undone_by_down() -> None:
    if os.geteuid() != 0:
        pytest.fail("the local cluster needs root") if os.environ.get("CI") == "true" else pytest.skip("needs root")
    c = lc.Cluster()
    c.down()
    proc = subprocess.Popen([str(REPO / "scripts" / "local-cluster"), "up"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # kill it once the control plane runs and containerd is starting
        seen.append(line)
        if "starting containerd" in line:
            break
    else:
        pytest.fail(f"up ended before containerd started: {''.join(seen[-5:])}")
    os.killpg(proc.pid, signal.SIGKILL)  # no chance to clean up after itself
    proc.wait(30)
    left = lc.leftovers(c.layout)
    assert left.processes and left.interfaces and left.paths, left  # it had made things
    removed = subprocess.run([str(REPO / "scripts" / "local-cluster"), "down"], capture_output=True, text=True,
                             timeout=120)
    assert removed.returncode == 0, removed.stderr
    assert "nothing left behind" in removed.stderr
    assert lc.leftovers(c.layout).empty()
    # down on nothing is fine too.
    again = subprocess.run([str(REPO / "scripts" / "local-cluster"), "down"], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0 and lc.leftovers(c.layout).empty()
