"""The sharing section and the MIG strategy: parsing, defaults, and every bad value named by its field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from plugin.config import ConfigError, load
from plugin.kubelet.sharing import build_resources
from plugin.sharing.config import SharingError, parse_sharing, validate
from plugin.sharing.model import Selection

FULL = """\
version: v1
plugin:
  migStrategy: mixed
sharing:
  timeSlicing:
    allocationPolicy: packed
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
      rename: nvidia.com/gpu.shared
      devices: 2
    - name: nvidia.com/mig-1g.10gb
      replicas: 2
      devices: [0, "GPU-abc", "3"]
      failRequestsGreaterThanOne: false
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(text)
    return p


def test_full_section_through_load(tmp_path: Path) -> None:
    cfg = load({}, {}, write(tmp_path, FULL))
    assert cfg.mig_strategy == "mixed"
    s = cfg.sharing
    assert s.policy == "packed"
    first, second = s.resources
    assert (first.name, first.replicas, first.rename, first.devices) == \
        ("nvidia.com/gpu", 4, "nvidia.com/gpu.shared", Selection(count=2))
    assert first.fail_requests_greater_than_one is True  # the timeSlicing-level default
    assert second.devices == Selection(ids=(0, "GPU-abc", 3))  # "3" is an index, as in NVIDIA's format
    assert second.fail_requests_greater_than_one is False  # the entry overrides the default
    assert second.where == "sharing.timeSlicing.resources[1]"
    eff = cfg.effective()["sharing"]
    assert eff["policy"] == "packed" and eff["timeSlicing"][0]["devices"] == 2


def test_defaults_and_rename_by_default() -> None:
    s = parse_sharing(None)
    assert s.resources == () and s.policy == "distributed"
    s = parse_sharing({"timeSlicing": {"renameByDefault": True, "resources": [{"name": "nvidia.com/gpu",
                                                                                "replicas": 2}]}})
    r = s.resources[0]
    assert r.rename == "nvidia.com/gpu.shared" and r.devices.is_all and not r.fail_requests_greater_than_one
    assert load({}, {}, None).mig_strategy == "none"


def test_mig_strategy_from_flag_and_env() -> None:
    assert load({"mig_strategy": "single"}, {}, None).mig_strategy == "single"
    assert load({}, {"GPU_HEALTH_MIG_STRATEGY": "mixed"}, None).mig_strategy == "mixed"
    with pytest.raises(ConfigError) as err:
        load({"mig_strategy": "all"}, {}, None)
    assert err.value.field == "--mig-strategy" and "'all'" in str(err.value)


R0 = "sharing.timeSlicing.resources[0]"


@pytest.mark.parametrize(("section", "field", "words"), [
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 0}]}}, f"{R0}.replicas", "got 0"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": "4"}]}}, f"{R0}.replicas", "'4'"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": True}]}}, f"{R0}.replicas", "True"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 5000}]}}, f"{R0}.replicas", "1024"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu"}]}}, f"{R0}.replicas", "missing"),
    ({"timeSlicing": {"resources": [{"replicas": 2}]}}, f"{R0}.name", "missing"),
    ({"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2}]}}, f"{R0}.name", "'gpu'"),
    ({"timeSlicing": {"resources": [{"name": "kubernetes.io/gpu", "replicas": 2}]}}, f"{R0}.name", "kubernetes.io"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "rename": "nvidia.com/gpu"}]}},
     f"{R0}.rename", "own name"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "rename": "bad name"}]}},
     f"{R0}.rename", "'bad name'"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": []}]}},
     f"{R0}.devices", "empty"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": 0}]}},
     f"{R0}.devices", "at least 1"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": "some"}]}},
     f"{R0}.devices", "'some'"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": [0, True]}]}},
     f"{R0}.devices[1]", "True"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": [-1]}]}},
     f"{R0}.devices[0]", "negative"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": ["0:1"]}]}},
     f"{R0}.devices[0]", "'0:1'"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": [1, "1"]}]}},
     f"{R0}.devices[1]", "twice"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "failRequestsGreaterThanOne": "y"}]}},
     f"{R0}.failRequestsGreaterThanOne", "'y'"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "sharing": 1}]}},
     f"{R0}.sharing", "unknown key"),
    ({"timeSlicing": {"resources": ["nvidia.com/gpu"]}}, R0, "mapping"),
    ({"timeSlicing": {"resources": {"name": "nvidia.com/gpu"}}}, "sharing.timeSlicing.resources", "list"),
    ({"timeSlicing": {"allocationPolicy": "spread"}}, "sharing.timeSlicing.allocationPolicy", "'spread'"),
    ({"timeSlicing": {"renameByDefault": 1}}, "sharing.timeSlicing.renameByDefault", "got 1"),
    ({"timeSlicing": []}, "sharing.timeSlicing", "mapping"),
    ({"mps": {}}, "sharing.mps", "unknown key"),
])
def test_bad_values_name_the_field(section: dict[str, object], field: str, words: str) -> None:
    with pytest.raises(SharingError) as err:
        parse_sharing(section)
    assert err.value.field == field
    assert words in str(err.value)


@pytest.mark.parametrize(("strategy", "entries", "field", "words"), [
    ("none", [{"name": "nvidia.com/mig-1g.10gb", "replicas": 2}], f"{R0}.name", "MIG strategy none"),
    ("none", [{"name": "example.com/gpu", "replicas": 2}], f"{R0}.name", "not a resource"),
    ("mixed", [{"name": "nvidia.com/gpu", "replicas": 2, "rename": "nvidia.com/mig-fake"}], f"{R0}.rename",
     "MIG profiles"),
    ("none", [{"name": "nvidia.com/gpu", "replicas": 2}, {"name": "nvidia.com/gpu", "replicas": 3}],
     "sharing.timeSlicing.resources[1].name", "already shared by sharing.timeSlicing.resources[0]"),
    ("mixed", [{"name": "nvidia.com/mig-1g.10gb", "replicas": 2, "rename": "nvidia.com/gpu"}], f"{R0}.rename",
     "plugin.resourceName"),
    ("mixed", [{"name": "nvidia.com/gpu", "replicas": 2, "rename": "nvidia.com/shared"},
               {"name": "nvidia.com/mig-1g.10gb", "replicas": 2, "rename": "nvidia.com/shared"}],
     "sharing.timeSlicing.resources[1].rename", "resources[0].rename"),
])
def test_cross_checks_name_the_field(strategy: str, entries: list[object], field: str, words: str) -> None:
    s = parse_sharing({"timeSlicing": {"resources": entries}})
    with pytest.raises(SharingError) as err:
        validate(s, "nvidia.com/gpu", strategy)
    assert err.value.field == field
    assert words in str(err.value)


def test_load_turns_sharing_errors_into_config_errors(tmp_path: Path) -> None:
    f = write(tmp_path, "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                        "    - name: nvidia.com/gpu\n      replicas: -2\n")
    with pytest.raises(ConfigError) as err:
        load({}, {}, f)
    assert err.value.field == f"{R0}.replicas"


def test_cli_exits_2_naming_the_sharing_field(tmp_path: Path) -> None:
    f = write(tmp_path, "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                        "    - name: nvidia.com/gpu\n      replicas: many\n")
    proc = subprocess.run([sys.executable, "-m", "plugin", "run", "--backend", "simulated", "--config", str(f)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert f"{R0}.replicas" in proc.stderr and "'many'" in proc.stderr


def test_build_resources_per_strategy() -> None:
    share = parse_sharing({"timeSlicing": {"resources": [
        {"name": "nvidia.com/gpu", "replicas": 4, "rename": "nvidia.com/gpu.shared", "devices": [0]}]}})
    names = {s: [r.name for r in build_resources("nvidia.com/gpu", s, share, ["1g.10gb", "3g.40gb", "1g.10gb"])]
             for s in ("none", "single", "mixed")}
    assert names["none"] == ["nvidia.com/gpu", "nvidia.com/gpu.shared"]
    assert names["single"] == ["nvidia.com/gpu", "nvidia.com/gpu.shared"]
    assert names["mixed"] == ["nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-1g.10gb",
                              "nvidia.com/mig-3g.40gb"]
    # devices: all with a rename moves everything: the original name is not advertised at all.
    everything = parse_sharing({"timeSlicing": {"resources": [
        {"name": "nvidia.com/gpu", "replicas": 2, "rename": "nvidia.com/gpu.shared"}]}})
    assert [r.name for r in build_resources("nvidia.com/gpu", "none", everything)] == ["nvidia.com/gpu.shared"]
    # Without a rename the replicas keep the name; a custom domain carries over to MIG profile resources.
    same = parse_sharing({"timeSlicing": {"resources": [{"name": "example.com/gpu", "replicas": 2}]}})
    rs = build_resources("example.com/gpu", "mixed", same, ["2g.20gb"])
    assert [r.name for r in rs] == ["example.com/gpu", "example.com/mig-2g.20gb"]
    assert rs[0].shares and not rs[1].shares
