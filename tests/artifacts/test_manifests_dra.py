"""DRA mode's manifests (components/dra, overlays/dra, overlays/local-cluster-dra): valid against a release that has
resource.k8s.io/v1, accepted by the plugin in DRA mode, the kubelet's paths mounted where the plugin registers them,
and nothing else of the base changed. They run for real in tests/e2e/test_stories_dra.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from plugin.dra.podstatus import PodConditionSettings
from plugin.dra.slices import DRIVER
from scripts.localcluster import cluster as lc
from tests.artifacts.test_manifests import (
    MANIFESTS,
    NAME,
    NAMESPACE,
    NODE_CONDITION_ARGS,
    POD_STATUS_VAP,
    SLICE_VAP,
    VAP,
    _plugin_config,
    container,
    find,
    kinds,
    kubectl,
    render,
)

__all__ = ["kubectl"]

DRA_VERSION = "1.37.0"  # resource.k8s.io/v1 is GA from 1.34; the schemas checked are the conformance server's

# The DeviceClasses of components/dra and of the chart (tests/artifacts/test_dra_device_classes.py checks them all).
# The type attribute is read with a fallback: a device of a plugin older than it is a whole GPU, where a bare .type
# would be a CEL error that aborts the scheduling of the class's pods.
MIG_CLASS = "mig.gpu-health.io"
_TYPE = f'device.attributes["{DRIVER}"].?type.orValue("gpu")'
GPU_SELECTOR = f'device.driver == "{DRIVER}" && {_TYPE} == "gpu"'
MIG_SELECTOR = f'device.driver == "{DRIVER}" && {_TYPE} == "mig"'
# The chart's default profile list, which components/dra ships classes for too.
CHART_VALUES = Path(__file__).resolve().parents[2] / "charts" / "gpu-health-device-plugin" / "values.yaml"
DEFAULT_PROFILES: list[str] = yaml.safe_load(CHART_VALUES.read_text())["dra"]["migProfiles"]


def profile_selector(profile: str) -> str:
    return f'{MIG_SELECTOR} && device.attributes["{DRIVER}"].?profile.orValue("") == "{profile}"'


def profile_class(profile: str) -> str:
    """The documented mapping: a `+` (no name may hold one) becomes `.`, as NVIDIA's plugin names the resource."""
    return f"mig-{profile.replace('+', '.')}.gpu-health.io"


def profile_resource(profile: str, domain: str = "nvidia.com") -> str:
    return f"{domain}/mig-{profile.replace('+', '.')}"


@pytest.fixture(scope="module")
def rendered(kubectl: Path) -> dict[str, list[dict[str, Any]]]:
    return {o: render(kubectl, MANIFESTS / "overlays" / o) for o in ("dra", "local-cluster-dra")} | {
        "base": render(kubectl, MANIFESTS / "base"), "local-cluster": render(kubectl, MANIFESTS / "overlays" /
                                                                              "local-cluster")}


@pytest.mark.parametrize("overlay", ["dra", "local-cluster-dra"])
def test_valid_and_accepted_by_the_plugin_in_dra_mode(rendered: dict[str, list[dict[str, Any]]], overlay: str,
                                                      tmp_path: Path) -> None:
    for obj in rendered[overlay]:
        kubernetes_validate.validate(obj, DRA_VERSION, strict=True)
    cfg, _ = _plugin_config(rendered[overlay], tmp_path)
    assert cfg.mode == "dra"
    # The kubelet connects to the endpoint we register and containerd reads the CDI dir: the paths inside the pod
    # must be the host's.
    spec = find(rendered[overlay], "DaemonSet", NAME)["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in container(find(rendered[overlay], "DaemonSet", NAME))["volumeMounts"]}
    for volume, path in (("dra-plugin", cfg.dra_plugin_dir), ("plugins-registry", cfg.dra_registry_dir),
                         ("cdi", cfg.cdi_spec_dir)):
        assert mounts[volume] == host[volume] == str(path), volume
    if overlay == "local-cluster-dra":
        layout = lc.Layout()
        assert cfg.dra_plugin_dir == layout.kubelet_root / "plugins" / DRIVER
        assert cfg.dra_registry_dir == layout.kubelet_root / "plugins_registry"
        assert cfg.cdi_spec_dir == layout.cdi_dir
    else:
        assert str(cfg.dra_registry_dir) == "/var/lib/kubelet/plugins_registry"
        assert str(cfg.cdi_spec_dir) == "/var/run/cdi"


# RBAC verb -> the admission operation a request with it is judged as.
_OPERATION = {"create": "CREATE", "update": "UPDATE", "patch": "UPDATE", "delete": "DELETE",
              "deletecollection": "DELETE"}


def test_the_device_class_selects_the_driver_and_the_grants_are_narrow(
        rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    objs = rendered["dra"]
    # Whole GPUs of the driver; every class in detail: tests/artifacts/test_dra_device_classes.py.
    dc = find(objs, "DeviceClass", DRIVER)
    assert dc["spec"]["selectors"] == [{"cel": {"expression": GPU_SELECTOR}}]
    rules = find(objs, "ClusterRole", f"{NAME}-dra")["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert granted == {("resource.k8s.io", "resourceslices", v) for v in ("get", "create", "update", "delete")} | {
        ("resource.k8s.io", "resourceclaims", "get"), ("", "pods/status", "patch")}
    crb = find(objs, "ClusterRoleBinding", f"{NAME}-dra")
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]

    # RBAC cannot say "my node's slice": the grant is cluster-wide, so it ships only with the admission policy that
    # confines every write it allows to the slice of the plugin's own node and driver (what the policy lets through
    # and refuses: tests/conformance/apiserver/test_resourceslice_policy.py, on the real API server).
    policy = find(objs, "ValidatingAdmissionPolicy", SLICE_VAP)["spec"]
    binding = find(objs, "ValidatingAdmissionPolicyBinding", SLICE_VAP)["spec"]
    assert binding == {"policyName": SLICE_VAP, "validationActions": ["Deny"]}
    assert policy["failurePolicy"] == "Fail"
    constraints = policy["matchConstraints"]
    assert constraints["matchPolicy"] == "Equivalent"  # a write through v1beta1/v1beta2 is judged as v1
    covered = {(g, r, op) for rule in constraints["resourceRules"] if "v1" in rule["apiVersions"]
               for g in rule["apiGroups"] for r in rule["resources"] for op in rule["operations"]}
    slice_writes = {(g, r, _OPERATION[v]) for g, r, v in granted if v in _OPERATION and r == "resourceslices"}
    assert slice_writes == {("resource.k8s.io", "resourceslices", op) for op in ("CREATE", "UPDATE", "DELETE")}
    assert slice_writes <= covered
    # The same account as the Node policy's (any service account named like the plugin's), and our driver.
    node_policy = find(objs, "ValidatingAdmissionPolicy", VAP)["spec"]
    assert policy["matchConditions"] == node_policy["matchConditions"]
    assert {v["name"]: v["expression"] for v in policy["variables"]}["driver"] == f"'{DRIVER}'"

    # Nor "the pods of my node": the pods/status grant is cluster-wide too, and ships with the policy that confines it
    # to the plugin's own condition on the pods of its own node (tests/conformance/apiserver/test_pod_status_policy.py
    # on the real API server).
    policy = find(objs, "ValidatingAdmissionPolicy", POD_STATUS_VAP)["spec"]
    binding = find(objs, "ValidatingAdmissionPolicyBinding", POD_STATUS_VAP)["spec"]
    assert binding == {"policyName": POD_STATUS_VAP, "validationActions": ["Deny"]}
    assert policy["failurePolicy"] == "Fail"
    covered = {(g, r, op) for rule in policy["matchConstraints"]["resourceRules"] if "v1" in rule["apiVersions"]
               for g in rule["apiGroups"] for r in rule["resources"] for op in rule["operations"]}
    pod_writes = {(g, r, _OPERATION[v]) for g, r, v in granted if v in _OPERATION and g == ""}
    assert pod_writes == {("", "pods/status", "UPDATE")}  # a PATCH is judged as the UPDATE it results in
    assert pod_writes <= covered
    assert policy["matchConditions"] == node_policy["matchConditions"]
    # The one condition type it lets through is the one the plugin writes with the manifests' (default) prefix.
    cfg, _ = _plugin_config(objs, tmp_path)
    expected_type = PodConditionSettings(taint_prefix=cfg.annotation_prefix).condition_type
    assert {v["name"]: v["expression"] for v in policy["variables"]}["conditionType"] == f"'{expected_type}'"
    # Nothing else the overlay grants writes anything but slices and pod status.
    assert {r for _, r, v in granted if v in _OPERATION} == {"resourceslices", "pods/status"}


def _names(v: list[dict[str, Any]], key: str = "name") -> list[str]:
    return [x[key] for x in v]


@pytest.mark.parametrize(("overlay", "against"), [("dra", "base"), ("local-cluster-dra", "local-cluster")])
def test_only_the_mode_mounts_and_grants_are_added(rendered: dict[str, list[dict[str, Any]]], overlay: str,
                                                   against: str) -> None:
    over, base = rendered[overlay], rendered[against]
    added = kinds(over) - kinds(base)
    device_classes = {("DeviceClass", name) for name in [DRIVER, MIG_CLASS, *map(profile_class, DEFAULT_PROFILES)]}
    assert added == device_classes | {("ClusterRole", f"{NAME}-dra"), ("ClusterRoleBinding", f"{NAME}-dra")}
    # local-cluster carries the node condition; DRA mode's overlay does not, which is its only other difference.
    ds = copy.deepcopy(find(over, "DaemonSet", NAME))
    want = copy.deepcopy(find(base, "DaemonSet", NAME))
    c, w = container(ds), container(want)
    extra = [a for a in c["args"] if a not in w["args"]]
    assert extra[0] == "--mode=dra" and all(a.startswith(("--dra-", "--cdi-spec-dir=")) for a in extra[1:])
    assert [a for a in w["args"] if a not in c["args"]] in ([], NODE_CONDITION_ARGS)
    assert sorted(set(_names(c["volumeMounts"])) - set(_names(w["volumeMounts"]))) == ["cdi", "dra-plugin",
                                                                                       "plugins-registry"]
    assert set(_names(w["volumeMounts"])) <= set(_names(c["volumeMounts"]))
