"""bench/bench_dra_mig.py measures the node shapes docs/benchmarks.md names (issue 38): if a shape quietly lost its
instances, its sharing or its taints, the figures would stand for a smaller slice than the table says. The timings
are the bench's to print; nothing here looks at them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import bench_dra_mig as b
from plugin.dra import slices as rs

REPO = Path(__file__).resolve().parents[2]

# devices, tainted, shared
EXPECTED = {"gpu8": (8, 0, 0), "mig56": (56, 0, 0), "mig56-shared": (56, 0, 56), "mig56-tainted": (56, 56, 0),
            "mig56-shared-tainted": (56, 56, 56)}


@pytest.mark.parametrize("shape", b.SHAPES, ids=lambda s: s.name)
def test_each_shape_is_the_slice_the_table_names(shape: b.Shape) -> None:
    got = b.in_process(shape, repeats=1)
    assert (got["devices"], got["tainted_devices"], got["shared_devices"]) == EXPECTED[shape.name]
    assert got["devices"] <= rs.MAX_DEVICES


def test_a_fault_on_gpu_3_taints_its_instances_and_no_other_device() -> None:
    shape = next(s for s in b.SHAPES if s.name == "mig56")
    settings = b.settings_of(shape, "n1")
    faulted = b.build(b.statuses(b.gpus_of(shape), b.bad_gpus(shape, True), b.SINCE), settings)
    names = [d["name"] for d in faulted["spec"]["devices"] if d.get("taints")]
    assert names == [f"gpu-3-mig-{gi}-0" for gi in b.GI_1G]
    assert b.tainted(faulted, 3) and b.untainted(faulted, 2)


def test_without_the_api_server_it_prints_every_shape_as_json() -> None:
    r = subprocess.run([sys.executable, "bench/bench_dra_mig.py", "--no-apiserver", "--repeats", "1", "--json"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert list(out["shapes"]) == list(EXPECTED) and "machine" in out
