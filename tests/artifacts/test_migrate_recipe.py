"""The recipes of docs/migrate.md (switching one node pool from NVIDIA's device plugin to ours and back): the chart
rendered with docs/recipes/canary-pool-values.yaml puts our DaemonSet on exactly the GPU nodes labelled for the
move, and docs/recipes/nvidia-device-plugin-values.yaml keeps NVIDIA's chart on every GPU node its defaults pick
except those labelled to leave. Which nodes a DaemonSet's pod lands on is judged the way the scheduler judges it
(nodeSelector, then the required node affinity's terms, ORed, each of ANDed expressions)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from scripts import helm as helm_build
from tests.artifacts.test_chart import KUBE_VERSIONS, NAME, helm_template
from tests.artifacts.test_manifests import find, strict_problems
from tests.conformance.skips import build_or_skip

REPO = Path(__file__).resolve().parents[2]
CANARY = REPO / "docs" / "recipes" / "canary-pool-values.yaml"
THEIRS = REPO / "docs" / "recipes" / "nvidia-device-plugin-values.yaml"
LOCAL_VALUES = REPO / "scripts" / "localcluster" / "helm-values.yaml"
DOC = REPO / "docs" / "migrate.md"
OURS_LABEL = ("gpu-health.io/device-plugin", "true")
# The GPU Operator's device plugin DaemonSet selects nodes with this label "true"; the operator sets it on GPU nodes
# where it is missing or empty and keeps any other value (NVIDIA/gpu-operator, controllers/state_manager.go).
THEIRS_OFF = ("nvidia.com/gpu.deploy.device-plugin", "false")
GFD = {"nvidia.com/gpu.present": "true"}
NFD = {"feature.node.kubernetes.io/pci-10de.present": "true"}
TEGRA = {"feature.node.kubernetes.io/cpu-model.vendor_id": "NVIDIA"}

Labels = dict[str, str]


def _expression(expr: dict[str, Any], labels: Labels) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values", [])
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    raise AssertionError(f"operator {op} not judged here")


def lands_on(spec: dict[str, Any], labels: Labels) -> bool:
    """Whether the scheduler may put a pod of this spec on a node with these labels (taints aside)."""
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}) \
        .get("requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return True
    return any(all(_expression(e, labels) for e in term.get("matchExpressions", []))
               for term in required["nodeSelectorTerms"])


def test_the_judge_reads_node_affinity_as_the_scheduler_does() -> None:
    """Guards the helper: NotIn admits a node without the key, terms are ORed, expressions ANDed."""
    terms = [{"matchExpressions": [{"key": "x", "operator": "In", "values": ["1"]},
                                   {"key": "y", "operator": "NotIn", "values": ["no"]}]},
             {"matchExpressions": [{"key": "z", "operator": "Exists"}]}]
    required = {"nodeSelectorTerms": terms}
    spec = {"nodeSelector": {"pool": "a"},
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}}
    assert lands_on(spec, {"pool": "a", "x": "1"})
    assert not lands_on(spec, {"pool": "a", "x": "1", "y": "no"})
    assert lands_on(spec, {"pool": "a", "z": ""})
    assert not lands_on(spec, {"pool": "b", "x": "1"})
    assert not lands_on(spec, {"pool": "a"})


@pytest.fixture(scope="module")
def helm() -> Path:
    return build_or_skip(helm_build.MODULE, helm_build.PACKAGE, "helm", helm_build.ENV,
                         version=helm_build.HELM_VERSION, ldflags=helm_build.LDFLAGS)


def _daemonset_spec(helm: Path, *values: Path) -> dict[str, Any]:
    spec: dict[str, Any] = find(helm_template(helm, values), "DaemonSet", NAME)["spec"]["template"]["spec"]
    return spec


@pytest.mark.parametrize("values", [(CANARY,), (LOCAL_VALUES, CANARY)], ids=["recipe", "local-cluster"])
def test_the_canary_values_put_our_plugin_on_exactly_the_labelled_gpu_nodes(helm: Path, values: tuple[Path, ...]) \
        -> None:
    spec = _daemonset_spec(helm, *values)
    assert spec["nodeSelector"] == dict([OURS_LABEL])
    # The chart's own affinity is kept: a label on a node without a GPU does not bring the plugin there.
    assert spec["affinity"] == _daemonset_spec(helm)["affinity"]
    ours = dict([OURS_LABEL])
    for gpu in (GFD, NFD):
        assert lands_on(spec, {**gpu, **ours})
        assert lands_on(spec, {**gpu, **ours, THEIRS_OFF[0]: THEIRS_OFF[1]})
        assert not lands_on(spec, gpu)
        assert not lands_on(spec, {**gpu, THEIRS_OFF[0]: THEIRS_OFF[1]})  # NVIDIA's gone is not ours here
        assert not lands_on(spec, {**gpu, OURS_LABEL[0]: "false"})
    assert not lands_on(spec, ours)
    assert not lands_on(spec, {**TEGRA, **ours})


def test_the_canary_rendering_validates_strictly(helm: Path) -> None:
    for version in KUBE_VERSIONS:
        problems, _ = strict_problems((("canary", o) for o in helm_template(helm, [CANARY], kube_version=version)),
                                      version)
        assert not problems, problems


# NVIDIA's chart's default affinity (deployments/helm/nvidia-device-plugin/values.yaml of NVIDIA/k8s-device-plugin,
# as of 2026-08): three ORed terms, one label each.
NVIDIA_DEFAULT_TERMS = [NFD, TEGRA, GFD]


def test_nvidias_values_keep_their_nodes_but_the_ones_labelled_to_leave() -> None:
    spec = yaml.safe_load(THEIRS.read_text())
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(terms) == len(NVIDIA_DEFAULT_TERMS)
    for gpu in NVIDIA_DEFAULT_TERMS:
        assert lands_on(spec, gpu)
        assert lands_on(spec, {**gpu, THEIRS_OFF[0]: "true"})  # what the operator would set
        assert not lands_on(spec, {**gpu, THEIRS_OFF[0]: THEIRS_OFF[1]})
        assert lands_on(spec, {**gpu, **dict([OURS_LABEL])})  # both, for the overlap
    assert not lands_on(spec, {})
    # The change itself rolls none of their pods (each roll is a gap on its node); the DaemonSet controller still
    # removes a pod from a node that stops matching, whatever the strategy.
    assert spec["updateStrategy"] == {"type": "OnDelete"}


def test_the_doc_uses_the_recipes_labels_and_names_only_files_that_exist() -> None:
    text = DOC.read_text()
    for path in re.findall(r"`(docs/recipes/[^`]+)`", text):
        assert (REPO / path).is_file(), path
    assert "docs/recipes/canary-pool-values.yaml" in text and "docs/recipes/nvidia-device-plugin-values.yaml" in text
    assert f"{OURS_LABEL[0]}={OURS_LABEL[1]}" in text
    assert f"{THEIRS_OFF[0]}={THEIRS_OFF[1]}" in text
    # Every label written in a kubectl label command is one of the two the recipes select on.
    for key in re.findall(r"kubectl label (?:node|nodes)[^\n`]*?\s([a-z0-9.-]+/[a-z0-9.-]+)[=-]", text):
        assert key in {OURS_LABEL[0], THEIRS_OFF[0]}, key
