"""``gpu-health-plugin migrate-config FILE``: NVIDIA's config file becomes ours and its Helm values become our
chart's, through the real CLI; what cannot carry over is one line each on stderr and exit 3; the output is taken by
our loader and our chart's schema as it is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugin import cli
from plugin import config as config_mod

REPO = Path(__file__).resolve().parents[2]
PREFIX = "gpu-health-plugin migrate-config: "


def _migrate(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, Any, list[str]]:
    f = tmp_path / "theirs.yaml"
    f.write_text(text)
    rc = cli.main(["migrate-config", str(f)])
    out, err = capsys.readouterr()
    return rc, out, yaml.safe_load(out) if out else None, err.splitlines()


def test_their_config_file_becomes_ours_and_what_cannot_is_named(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, doc, err = _migrate(tmp_path, """
version: v1
flags:
  migStrategy: mixed
  failOnInitError: false
  nvidiaDriverRoot: /run/nvidia/driver
  plugin:
    passDeviceSpecs: true
    deviceListStrategy: [envvar, cdi-cri]
    deviceIDStrategy: index
  gfd:
    oneshot: false
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
  mps:
    resources: [{name: nvidia.com/gpu, replicas: 2}]
resources:
  gpus: [{pattern: "*A100*", name: a100}]
""", capsys)
    assert rc == 3
    assert out.startswith("# gpu-health-device-plugin: our config file (pass it with --config")
    assert doc == {"version": "v1", "plugin": {"migStrategy": "mixed", "failOnInitError": False, "cdi": True},
                   "sharing": {"timeSlicing": {"renameByDefault": True,
                                               "resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}}}
    assert [line.split(":")[0:2] for line in err] == [
        ["gpu-health-plugin migrate-config", " flags.nvidiaDriverRoot"],
        ["gpu-health-plugin migrate-config", " flags.plugin.passDeviceSpecs"],
        ["gpu-health-plugin migrate-config", " flags.gfd.oneshot"],
        ["gpu-health-plugin migrate-config", " not carried over"],
        ["gpu-health-plugin migrate-config", " not carried over"],
        ["gpu-health-plugin migrate-config", " not carried over"]]
    lost = [line.removeprefix(PREFIX + "not carried over: ") for line in err[3:]]
    assert lost[0].startswith("flags.plugin.deviceIDStrategy: ours names devices by GPU or MIG UUID only")
    assert lost[1].startswith("resources: NVIDIA's plugin ignores it too")
    assert lost[2] == "sharing.mps: ours shares GPUs by time-slicing only"


def test_a_file_that_carries_over_whole_exits_0_and_our_loader_takes_it(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _, err = _migrate(tmp_path, """
version: v1
flags:
  migStrategy: single
  nvidiaDevRoot: /
  plugin:
    deviceIDStrategy: uuid
    sharedDevicesAllocationPolicy: distributed
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 2
""", capsys)
    assert rc == 0
    assert [line.split(": ")[1] for line in err] == ["flags.plugin.deviceIDStrategy",
                                                     "flags.plugin.sharedDevicesAllocationPolicy"]
    ours = tmp_path / "ours.yaml"
    ours.write_text(out)
    cfg = config_mod.load({}, {}, ours)
    assert (cfg.mig_strategy, cfg.dev_root) == ("single", Path("/"))
    assert [(r.name, r.replicas) for r in cfg.sharing.resources] == [("nvidia.com/gpu", 2)]


def _schema_errors(values: Any) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((REPO / "charts" / "gpu-health-device-plugin" / "values.schema.json").read_text())
    return [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(values)]


def test_their_helm_values_become_ours(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, doc, err = _migrate(tmp_path, """
migStrategy: single
failOnInitError: false
compatWithCPUManager: true
deviceListStrategy: cdi-cri
image:
  repository: nvcr.io/nvidia/k8s-device-plugin
  tag: v0.20.0
  pullPolicy: Always
nodeSelector: {pool: gpu}
priorityClassName: system-node-critical
devicePlugin:
  enableHostNetwork: true
  containers:
    main:
      env:
      - {name: NVIDIA_DEV_ROOT, value: /}
      - {name: HTTP_PROXY, value: http://proxy:3128}
config:
  default: small
  map:
    small: |-
      version: v1
      sharing:
        timeSlicing:
          resources:
          - name: nvidia.com/gpu
            replicas: 2
    large: |-
      version: v1
      sharing:
        timeSlicing:
          resources:
          - name: nvidia.com/gpu
            replicas: 8
gfd:
  enabled: true
""", capsys)
    assert rc == 3
    assert out.startswith("# gpu-health-device-plugin: values for our Helm chart")
    assert doc == {
        "migStrategy": "single", "failOnInitError": False, "cdi": {"enabled": True},
        "image": {"pullPolicy": "Always"}, "nodeSelector": {"pool": "gpu"}, "hostNetwork": True,
        "plugin": {"devRoot": "/"}, "extraEnv": [{"name": "HTTP_PROXY", "value": "http://proxy:3128"}],
        "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}}
    assert _schema_errors(doc) == []
    lost = [line.removeprefix(PREFIX + "not carried over: ").split(":")[0] for line in err if "not carried" in line]
    assert lost == ["image.tag", "gfd.enabled", "config.map.large"]
    assert [line.removeprefix(PREFIX).split(":")[0] for line in err if "not carried" not in line] == [
        "compatWithCPUManager"]


def test_a_copy_of_their_default_values_carries_nothing_and_loses_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # NVIDIA's chart values of v0.20.0 as they ship (comments left out).
    rc, _, doc, err = _migrate(tmp_path, """
config: {name: "", map: {}, default: "", fallbackStrategies: ["named", "single"]}
compatWithCPUManager: null
migStrategy: null
failOnInitError: null
deviceListStrategy: null
deviceIDStrategy: null
nvidiaDriverRoot: null
nameOverride: ""
allowDefaultNamespace: false
imagePullSecrets: []
image: {repository: nvcr.io/nvidia/k8s-device-plugin, pullPolicy: IfNotPresent, tag: ""}
updateStrategy: {type: RollingUpdate}
podAnnotations: {}
resources: {}
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
      - matchExpressions: [{key: feature.node.kubernetes.io/pci-10de.present, operator: In, values: ["true"]}]
      - matchExpressions: [{key: feature.node.kubernetes.io/cpu-model.vendor_id, operator: In, values: ["NVIDIA"]}]
      - matchExpressions: [{key: "nvidia.com/gpu.present", operator: In, values: ["true"]}]
tolerations:
  - {key: CriticalAddonsOnly, operator: Exists}
  - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
priorityClassName: "system-node-critical"
runtimeClassName: null
devicePlugin: {enabled: true}
gfd: {enabled: false, nameOverride: gpu-feature-discovery, noTimestamp: null, securityContext: {privileged: true}}
nfd:
  nameOverride: node-feature-discovery
  master:
    serviceAccount: {name: node-feature-discovery, create: true}
    config: {extraLabelNs: ["nvidia.com"]}
  worker:
    tolerations:
    - {key: "node-role.kubernetes.io/master", operator: "Equal", value: "", effect: "NoSchedule"}
    - {key: "nvidia.com/gpu", operator: "Equal", value: "present", effect: "NoSchedule"}
    config: {sources: {pci: {deviceClassWhitelist: ["02", "03"], deviceLabelFields: [vendor]}}}
mps: {root: "/run/nvidia/mps", enableHostPID: true}
cdi: {nvidiaHookPath: null, featureFlags: null}
""", capsys)
    assert (rc, doc, err) == (0, {}, [])


@pytest.mark.parametrize(("text", "says"), [
    (None, "cannot read"),
    ("version: v1\nflags: [\n", "is not valid YAML"),
    ("version: v1\nplugin:\n  pollInterval: 2\n", "is neither NVIDIA's device plugin config file"),
    ("- a\n- b\n", "is neither NVIDIA's device plugin config file"),
])
def test_a_file_it_cannot_read_or_recognise_is_one_line_and_exit_2(
        tmp_path: Path, text: str | None, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "theirs.yaml"
    if text is not None:
        f.write_text(text)
    assert cli.main(["migrate-config", str(f)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith("gpu-health-plugin: migrate-config: ")
    assert says in err


def test_their_config_of_another_version_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _, err = _migrate(tmp_path, "version: v2\nflags: {migStrategy: single}\n", capsys)
    assert (rc, out) == (2, "")
    assert err == ["gpu-health-plugin: version: expected NVIDIA's v1, got 'v2'"]
