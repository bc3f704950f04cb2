"""The remediation recipes of docs/remediation.md: the Cluster API MachineHealthCheck validates strictly against
Cluster API's own CRD schema (vendored, tests/artifacts/schemas/cluster-api/README.md) and watches the condition
the plugin writes; the node-problem-detector recipe's premise holds for the conditions NPD's shipped configs set.
The EKS values are rendered through the chart in tests/artifacts/test_chart.py (it needs helm)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from plugin.config import load
from plugin.validation import KUBELET_CONDITIONS, check_condition_type

REPO = Path(__file__).resolve().parents[2]
MHC = REPO / "docs" / "recipes" / "machinehealthcheck.yaml"
MHC_CRD = REPO / "tests" / "artifacts" / "schemas" / "cluster-api" / "cluster.x-k8s.io_machinehealthchecks.yaml"
# ObjectMeta is validated by the API server itself, not by the CRD's schema; the recipe needs no more than this.
META_KEYS = {"name", "namespace", "labels", "annotations"}


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD's structural schema with unknown fields refused, as `kubectl apply --validate=strict` and the API
    server's strict field validation refuse them: every object that lists its properties and does not preserve
    unknown fields admits no others. metadata is left open (ObjectMeta is checked by the API server, above)."""
    out = copy.deepcopy(schema)

    def walk(s: Any) -> None:
        if isinstance(s, dict):
            if ("properties" in s and "additionalProperties" not in s
                    and not s.get("x-kubernetes-preserve-unknown-fields")):
                s["additionalProperties"] = False
            for v in s.values():
                walk(v)
        elif isinstance(s, list):
            for v in s:
                walk(v)

    walk(out)
    return out


def served_schema(crd: dict[str, Any], api_version: str) -> dict[str, Any]:
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group
    v = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    # The recipe uses a version the CRD serves and stores, not a deprecated one.
    assert v["served"] and v["storage"] and not v.get("deprecated"), v["name"]
    return strict(v["schema"]["openAPIV3Schema"])


def cel_rules_on(schema: dict[str, Any], doc: Any, path: str = "") -> list[str]:
    """The CEL rules (x-kubernetes-validations) on the schema nodes the document reaches: offline validation cannot
    run them, so the recipe must reach none."""
    found = [f"{path or '.'}: {r['rule']}" for r in schema.get("x-kubernetes-validations", [])]
    if isinstance(doc, dict):
        for k, v in doc.items():
            sub = schema.get("properties", {}).get(k)
            if sub is not None:
                found += cel_rules_on(sub, v, f"{path}.{k}")
    elif isinstance(doc, list) and "items" in schema:
        for i, v in enumerate(doc):
            found += cel_rules_on(schema["items"], v, f"{path}[{i}]")
    return found


@pytest.fixture(scope="module")
def mhc() -> dict[str, Any]:
    doc = yaml.safe_load(MHC.read_text())
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def schema(mhc: dict[str, Any]) -> dict[str, Any]:
    crd = yaml.safe_load(MHC_CRD.read_text())
    assert crd["spec"]["names"]["kind"] == mhc["kind"] == "MachineHealthCheck"
    return served_schema(crd, mhc["apiVersion"])


def test_machinehealthcheck_validates_strictly_against_capis_crd(mhc: dict[str, Any],
                                                                 schema: dict[str, Any]) -> None:
    jsonschema.validate(mhc, schema)
    assert set(mhc["metadata"]) <= META_KEYS
    assert cel_rules_on(schema, mhc) == []


@pytest.mark.parametrize(("where", "edit", "says"), [
    # The v1beta1 spelling of the same check: refused by the v1beta2 schema, not silently dropped.
    ("spec", lambda s: s.update(unhealthyConditions=[{"type": "GPUHealthy", "status": "False", "timeout": "10m"}]),
     "unhealthyConditions"),
    ("spec.checks.unhealthyNodeConditions.0", lambda c: c.update(timeout="600s"), "timeout"),
    ("spec.checks.unhealthyNodeConditions.0", lambda c: c.pop("timeoutSeconds"), "timeoutSeconds"),
    ("spec.checks.unhealthyNodeConditions.1", lambda c: c.update(timeoutSeconds="30m"), "'30m' is not of type"),
])
def test_strict_validation_refuses_what_capi_would(mhc: dict[str, Any], schema: dict[str, Any], where: str,
                                                   edit: Any, says: str) -> None:
    """Guards the test above: the schema as used refuses unknown and mistyped fields."""
    bad = copy.deepcopy(mhc)
    node: Any = bad
    for part in where.split("."):
        node = node[int(part)] if part.isdigit() else node[part]
    edit(node)
    with pytest.raises(jsonschema.ValidationError, match=says):
        jsonschema.validate(bad, schema)


def test_machinehealthcheck_watches_the_condition_the_plugin_writes(mhc: dict[str, Any]) -> None:
    conditions = mhc["spec"]["checks"]["unhealthyNodeConditions"]
    # Our condition is True when healthy: the check fires on False (a GPU Unhealthy) and on Unknown, each after a
    # timeout (measured from lastTransitionTime, which the plugin moves only when the status changes).
    assert {c["status"] for c in conditions} == {"False", "Unknown"}
    assert all(c["timeoutSeconds"] > 0 for c in conditions)
    defaults = load({}, {}, None)
    assert {c["type"] for c in conditions} == {defaults.node_condition_type}
    values = yaml.safe_load((REPO / "charts" / "gpu-health-device-plugin" / "values.yaml").read_text())
    assert values["nodeCondition"]["type"] == defaults.node_condition_type


# The condition types node-problem-detector's shipped monitor configs set (config/*.json of
# kubernetes/node-problem-detector, as of 2026-08): none is a GPU one, and none may be ours. Its problem conditions
# are True while the problem lasts, the opposite of ours (docs/remediation.md).
NPD_CONDITIONS = {
    "NTPProblem", "DiskBadBlock", "CorruptDockerOverlay2", "ContainerRuntimeUnhealthy", "KubeletUnhealthy",
    "FrequentUnregisterNetDevice", "KernelDeadlock", "XfsShutdown", "CperHardwareErrorFatal", "ReadonlyFilesystem",
    "FrequentKubeletRestart", "FrequentDockerRestart", "FrequentContainerdRestart", "KubeProxyUnhealthy",
}


def test_our_default_type_is_owned_by_neither_npd_nor_the_kubelet() -> None:
    ours = load({}, {}, None).node_condition_type
    assert ours not in NPD_CONDITIONS | set(KUBELET_CONDITIONS)
    for kubelets in KUBELET_CONDITIONS:
        with pytest.raises(ValueError, match="belongs to the kubelet"):
            check_condition_type(kubelets)
