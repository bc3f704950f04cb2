"""The fleet controller's manifests (components/controller, components/controller-drain), rendered and checked offline.

Both overlays render with kustomize (the kubectl the conformance helper builds) and every object validates strictly
against Kubernetes 1.30 and 1.37; the overlays add exactly the controller's objects and leave the base's alone; the
RBAC is exactly the grants the controller needs, with no wildcard; the Deployment is hardened, spread, sized and does
not tolerate the quarantine taint it puts on nodes; the PodDisruptionBudget keeps one replica.
tests/conformance/apiserver/test_controller_manifests_server.py applies the same renders to a real API server.
"""

from __future__ import annotations

import copy
import shutil
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.artifacts.test_manifests import KUBE_VERSIONS, container, find, kinds, quantity, render
from tests.conformance.apiserver import _binaries as binaries
from tests.conformance.skips import build_or_skip

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
VARIANTS = {
    "base": MANIFESTS / "base",
    "controller": MANIFESTS / "overlays" / "controller",
    "controller-drain": MANIFESTS / "overlays" / "controller-drain",
}
NEW_DIRS = [MANIFESTS / "components" / "controller", MANIFESTS / "components" / "controller-drain",
            MANIFESTS / "overlays" / "controller", MANIFESTS / "overlays" / "controller-drain"]
NAMESPACE = "gpu-health-system"
NAME = "gpu-health-controller"
DRAIN = "gpu-health-controller-drain"
CONFIG_PATH = "/etc/gpu-health-controller/config.yaml"

CONTROLLER_OBJECTS = {
    ("ServiceAccount", NAME),
    ("ClusterRole", NAME),
    ("ClusterRoleBinding", NAME),
    ("Role", NAME),
    ("RoleBinding", NAME),
    ("ConfigMap", f"{NAME}-config"),
    ("Deployment", NAME),
    ("PodDisruptionBudget", NAME),
}
DRAIN_OBJECTS = {("ClusterRole", DRAIN), ("ClusterRoleBinding", DRAIN)}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                  "ValidatingAdmissionPolicyBinding"}

Grant = tuple[str, str, str, tuple[str, ...]]  # (apiGroup, resource, verb, resourceNames)


@pytest.fixture(scope="module")
def kubectl() -> Path:
    """kubectl v1.37.2 (kustomize built in), from the conformance build cache; skipped without Go unless CI."""
    t = binaries.KUBECTL
    return build_or_skip(t.module, t.package, t.name, {"CGO_ENABLED": "0"}, version=t.version, ldflags=t.ldflags)


@pytest.fixture(scope="module")
def rendered(kubectl: Path) -> dict[str, list[dict[str, Any]]]:
    return {variant: render(kubectl, path) for variant, path in VARIANTS.items()}


@pytest.fixture(scope="module")
def deploy(rendered: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return find(rendered["controller"], "Deployment", NAME)


def by_key(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def grants(role: dict[str, Any]) -> set[Grant]:
    """Every (group, resource, verb, names) a role grants, one rule field expanded at a time."""
    out = set()
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs", "resourceNames"}, rule
        names = tuple(sorted(rule.get("resourceNames", [])))
        for g in rule["apiGroups"]:
            for r in rule["resources"]:
                for v in rule["verbs"]:
                    out.add((g, r, v, names))
    return out


def tolerates(tolerations: list[dict[str, Any]], key: str, value: str, effect: str) -> bool:
    """Whether any toleration matches the taint, by the scheduler's rules (v1 Toleration.ToleratesTaint)."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != effect:
            continue
        if t.get("operator", "Equal") == "Exists":
            if not t.get("key") or t["key"] == key:
                return True
        elif t.get("key") == key and t.get("value", "") == value:
            return True
    return False


# Files, rendering, strict schemas ---------------------------------------------------------------------------

def test_every_manifest_starts_with_a_comment_saying_why() -> None:
    files = sorted(p for d in NEW_DIRS for p in d.iterdir())
    assert {p.name for p in files} >= {"kustomization.yaml", "deployment.yaml", "rbac.yaml"}
    for p in files:
        assert p.suffix == ".yaml", p
        first = p.read_text().splitlines()[0]
        assert first.startswith("# ") and len(first) > 20, f"{p.relative_to(REPO)} has no header comment"


def test_components_are_components_and_overlays_use_them() -> None:
    for d in NEW_DIRS:
        doc = yaml.safe_load((d / "kustomization.yaml").read_text())
        if d.parent.name == "components":
            assert doc["kind"] == "Component" and doc["apiVersion"] == "kustomize.config.k8s.io/v1alpha1", d
        else:
            assert doc["kind"] == "Kustomization" and doc["resources"] == ["../../base"], d
    drain = yaml.safe_load((VARIANTS["controller-drain"] / "kustomization.yaml").read_text())
    assert drain["components"] == ["../../components/controller", "../../components/controller-drain"]


def test_overlays_add_exactly_the_controllers_objects(rendered: dict[str, list[dict[str, Any]]]) -> None:
    base = kinds(rendered["base"])
    assert kinds(rendered["controller"]) == base | CONTROLLER_OBJECTS
    assert kinds(rendered["controller-drain"]) == base | CONTROLLER_OBJECTS | DRAIN_OBJECTS
    assert not base & (CONTROLLER_OBJECTS | DRAIN_OBJECTS)


def test_the_base_objects_are_left_as_they_were(rendered: dict[str, list[dict[str, Any]]]) -> None:
    base = by_key(rendered["base"])
    for variant in ("controller", "controller-drain"):
        over = by_key(rendered[variant])
        assert {k: over[k] for k in base} == base, variant


def test_drain_adds_only_its_grants_and_the_flag(rendered: dict[str, list[dict[str, Any]]]) -> None:
    plain, drain = by_key(rendered["controller"]), by_key(rendered["controller-drain"])
    expected = copy.deepcopy(plain)
    container(expected[("Deployment", NAME)])["args"].append("--drain")
    assert {k: v for k, v in drain.items() if k not in DRAIN_OBJECTS} == expected
    assert container(drain[("Deployment", NAME)])["args"] == [f"--config={CONFIG_PATH}", "--drain"]


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_object_validates_strictly(rendered: dict[str, list[dict[str, Any]]], version: str) -> None:
    problems = []
    for variant in ("controller", "controller-drain"):
        for obj in rendered[variant]:
            where = f"{variant}: {obj['kind']}/{obj['metadata']['name']}"
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                problems.append(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                problems.append(f"{where}: {exc.message}")
    assert not problems, f"invalid against Kubernetes {version}:\n" + "\n".join(problems)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_strict_validation_covers_the_new_kinds(rendered: dict[str, list[dict[str, Any]]], version: str) -> None:
    # Guards the test above for the kinds the base does not have: a misspelt field is an error, not ignored.
    pdb = copy.deepcopy(find(rendered["controller"], "PodDisruptionBudget", NAME))
    pdb["spec"]["minAvailible"] = 1
    with pytest.raises(kubernetes_validate.ValidationError, match="minAvailible"):
        kubernetes_validate.validate(pdb, version, strict=True)
    role = copy.deepcopy(find(rendered["controller"], "Role", NAME))
    role["rules"][0]["resourceName"] = ["x"]
    with pytest.raises(kubernetes_validate.ValidationError, match="resourceName"):
        kubernetes_validate.validate(role, version, strict=True)
    dep = copy.deepcopy(find(rendered["controller"], "Deployment", NAME))
    dep["spec"]["template"]["spec"]["topologySpreadConstraint"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="topologySpreadConstraint"):
        kubernetes_validate.validate(dep, version, strict=True)


def test_namespaced_objects_are_in_the_namespace_and_references_resolve(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    for variant in ("controller", "controller-drain"):
        objs = rendered[variant]
        names = kinds(objs)
        for o in objs:
            if o["kind"] not in CLUSTER_SCOPED:
                assert o["metadata"]["namespace"] == NAMESPACE, f"{variant}: {o['kind']}/{o['metadata']['name']}"
        subject = [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]
        for kind in ("ClusterRoleBinding", "RoleBinding"):
            for b in (o for o in objs if o["kind"] == kind and o["metadata"]["name"].startswith(NAME)):
                assert b["subjects"] == subject, b["metadata"]["name"]
                assert b["roleRef"]["apiGroup"] == "rbac.authorization.k8s.io"
                assert (b["roleRef"]["kind"], b["roleRef"]["name"]) in names
                # Bound to the role of the same name: each grant is removed with its binding.
                assert b["roleRef"]["name"] == b["metadata"]["name"]
        assert find(objs, "RoleBinding", NAME)["roleRef"]["kind"] == "Role"
        pod = find(objs, "Deployment", NAME)["spec"]["template"]["spec"]
        assert ("ServiceAccount", pod["serviceAccountName"]) in names
        assert pod["serviceAccountName"] == NAME
        for vol in pod["volumes"]:
            if "configMap" in vol:
                assert ("ConfigMap", vol["configMap"]["name"]) in names


def test_every_object_is_labelled_as_part_of_the_project(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for key, o in by_key(rendered["controller-drain"]).items():
        if key in CONTROLLER_OBJECTS | DRAIN_OBJECTS:
            labels = o["metadata"]["labels"]
            assert labels["app.kubernetes.io/name"] == NAME, key
            assert labels["app.kubernetes.io/part-of"] == "gpu-health-device-plugin", key


# RBAC: exactly what the controller needs ------------------------------------------------------------------------

def test_cluster_role_is_nodes_and_events_only(rendered: dict[str, list[dict[str, Any]]]) -> None:
    role = find(rendered["controller"], "ClusterRole", NAME)
    assert grants(role) == (
        {("", "nodes", v, ()) for v in ("get", "list", "watch", "patch")}
        | {("", "events", v, ()) for v in ("create", "patch")}
    )


def test_lease_role_is_its_own_lease_where_rbac_can_say_so(rendered: dict[str, list[dict[str, Any]]]) -> None:
    role = find(rendered["controller"], "Role", NAME)
    assert role["metadata"]["namespace"] == NAMESPACE
    lease = ("coordination.k8s.io", "leases")
    assert grants(role) == {
        (*lease, "get", (NAME,)),
        (*lease, "update", (NAME,)),
        # RBAC cannot restrict create by name (role.yaml says why): the only grant without resourceNames.
        (*lease, "create", ()),
    }


def test_drain_role_is_pods_read_and_evictions(rendered: dict[str, list[dict[str, Any]]]) -> None:
    role = find(rendered["controller-drain"], "ClusterRole", DRAIN)
    assert grants(role) == {("", "pods", "get", ()), ("", "pods", "list", ()), ("", "pods/eviction", "create", ())}


def test_no_wildcard_and_nothing_else_anywhere(rendered: dict[str, list[dict[str, Any]]]) -> None:
    allowed_verbs = {"get", "list", "watch", "patch", "create", "update"}
    roles = [o for o in rendered["controller-drain"] if o["kind"] in ("ClusterRole", "Role")
             and o["metadata"]["name"].startswith(NAME)]
    assert len(roles) == 3
    for role in roles:
        assert "aggregationRule" not in role
        for group, resource, verb, _ in grants(role):
            assert "*" not in (group, resource, verb), role["metadata"]["name"]
            assert verb in allowed_verbs, (role["metadata"]["name"], resource, verb)
            assert resource not in ("secrets", "configmaps", "nodes/status", "pods/exec"), resource
    # Nowhere may the controller delete, update or create a Node: quarantine is a patch, release too.
    node_verbs = {v for r in roles for g, res, v, _ in grants(r) if res == "nodes"}
    assert node_verbs == {"get", "list", "watch", "patch"}


# The Deployment ------------------------------------------------------------------------------------------------

def test_deployment_identity_and_replicas(deploy: dict[str, Any], rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert deploy["metadata"]["namespace"] == NAMESPACE
    assert deploy["spec"]["replicas"] == 2
    selector = deploy["spec"]["selector"]["matchLabels"]
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    # The DaemonSet's selector must not adopt the controller's pods, nor the other way round.
    ds = find(rendered["controller"], "DaemonSet")
    assert not ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert not selector.items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    # A rollout never takes the standby away before its replacement is up.
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_deployment_runs_the_controller_from_the_plugins_image(deploy: dict[str, Any],
                                                               rendered: dict[str, list[dict[str, Any]]]) -> None:
    c = container(deploy)
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert c["image"] == f"gpu-health-device-plugin:{version}"
    assert c["image"] == container(find(rendered["controller"], "DaemonSet"))["image"]
    assert c["command"] == ["gpu-health-controller"]
    assert c["args"] == [f"--config={CONFIG_PATH}"]


def test_deployment_identity_from_the_downward_api(deploy: dict[str, Any]) -> None:
    env = {e["name"]: e for e in container(deploy)["env"]}
    assert env.keys() == {"POD_NAME", "POD_NAMESPACE"}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_deployment_is_hardened(deploy: dict[str, Any]) -> None:
    pod = deploy["spec"]["template"]["spec"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["automountServiceAccountToken"] is True
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(host, False), host
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    sc = container(deploy)["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 65532
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    # Many clusters refuse system-cluster-critical outside kube-system.
    assert "priorityClassName" not in pod


def test_deployment_mounts_its_config_where_its_argument_points(deploy: dict[str, Any],
                                                                rendered: dict[str, list[dict[str, Any]]]) -> None:
    pod = deploy["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in container(deploy)["volumeMounts"]}
    assert mounts.keys() == {"config", "tmp"}
    assert mounts["config"]["readOnly"] is True
    config_dir, config_file = CONFIG_PATH.rsplit("/", 1)
    assert mounts["config"]["mountPath"] == config_dir
    vol = next(v for v in pod["volumes"] if v["name"] == "config")
    cm = find(rendered["controller"], "ConfigMap", vol["configMap"]["name"])
    assert config_file in cm["data"]
    assert next(v for v in pod["volumes"] if v["name"] == "tmp")["emptyDir"]["sizeLimit"]


def test_deployment_probes_port_and_resources(deploy: dict[str, Any]) -> None:
    c = container(deploy)
    assert c["ports"] == [{"name": "metrics", "containerPort": 9403, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    res = c["resources"]
    assert quantity(res["requests"]["cpu"]) == pytest.approx(0.05)
    assert quantity(res["requests"]["memory"]) == 128 * 2**20
    assert res["limits"] == {"memory": "256Mi"}, "memory only: a CPU limit delays quarantines in a burst"


def test_replicas_spread_across_nodes(deploy: dict[str, Any]) -> None:
    pod = deploy["spec"]["template"]["spec"]
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    terms = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert any(t["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
               and t["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items() for t in terms)
    # Preferred, not required: a one-node cluster still runs both replicas.
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in pod["affinity"]["podAntiAffinity"]


@pytest.mark.parametrize("effect", ["NoSchedule", "NoExecute"])
@pytest.mark.parametrize("reason", ["unhealthy-devices", "reboot-required", "capacity-gap"])
def test_deployment_does_not_tolerate_the_quarantine_taint(deploy: dict[str, Any], reason: str, effect: str) -> None:
    tolerations = deploy["spec"]["template"]["spec"].get("tolerations", [])
    assert not tolerates(tolerations, "gpu-health.io/quarantine", reason, effect)
    # GPU nodes are usually tainted nvidia.com/gpu; the controller needs no GPU and stays off them.
    assert not tolerates(tolerations, "nvidia.com/gpu", "present", "NoSchedule")


def test_toleration_matching_is_the_schedulers() -> None:
    # Guards the test above: the helper must see the ways a toleration can match.
    taint = ("gpu-health.io/quarantine", "capacity-gap", "NoSchedule")
    assert tolerates([{"operator": "Exists"}], *taint)
    assert tolerates([{"key": "gpu-health.io/quarantine", "operator": "Exists"}], *taint)
    assert tolerates([{"key": "gpu-health.io/quarantine", "value": "capacity-gap", "effect": "NoSchedule"}], *taint)
    assert not tolerates([{"key": "gpu-health.io/quarantine", "value": "capacity-gap", "effect": "NoExecute"}],
                         *taint)
    assert not tolerates([{"key": "gpu-health.io/quarantine", "value": "reboot-required"}], *taint)
    assert not tolerates([{"key": "CriticalAddonsOnly", "operator": "Exists"}], *taint)


# The PodDisruptionBudget and the config file -------------------------------------------------------------------

def test_pdb_keeps_one_replica(rendered: dict[str, list[dict[str, Any]]], deploy: dict[str, Any]) -> None:
    pdb = find(rendered["controller"], "PodDisruptionBudget", NAME)
    assert pdb["spec"]["minAvailable"] == 1
    assert "maxUnavailable" not in pdb["spec"]
    assert pdb["spec"]["selector"] == {"matchLabels": deploy["spec"]["selector"]["matchLabels"]}
    assert pdb["spec"]["selector"]["matchLabels"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    # With two replicas and one required, one may be evicted at a time: a node drain is never blocked for good.
    assert deploy["spec"]["replicas"] > pdb["spec"]["minAvailable"]


def test_config_file_is_v1_with_the_documented_defaults(rendered: dict[str, list[dict[str, Any]]]) -> None:
    doc = yaml.safe_load(find(rendered["controller"], "ConfigMap", f"{NAME}-config")["data"]["config.yaml"])
    assert doc == {
        "version": "v1",
        "policy": {"unhealthyDevices": 1, "unhealthyFraction": 0, "rebootRequired": True, "gpuMissing": True,
                   "gpuMissingGrace": "10m", "capacityGap": 1},
        "quarantine": {"noExecuteAfter": 0, "cordon": False, "label": "", "writeConcurrency": 4},
        "drain": {"enabled": False, "evictionsPerMinute": 10},
        "release": {"recoveryHold": "10m", "repeatLimit": 5, "repeatWindow": "168h"},
        "breaker": {"maxQuarantinedFraction": 0.1, "maxQuarantinedNodes": 0},
        "leaderElection": {"leaseDuration": "15s", "renewDeadline": "10s", "retryPeriod": "2s",
                           "writeTimeout": "4s"},
    }


def test_the_controller_loads_the_shipped_config_and_args_to_its_defaults(
        rendered: dict[str, list[dict[str, Any]]], deploy: dict[str, Any], tmp_path: Path) -> None:
    """The ConfigMap and the Deployment's args go through the controller's own loader: a key it does not know, or
    a flag it does not take, would stop the Deployment at start."""
    from plugin.controller.config import ControllerConfig, load

    path = tmp_path / "config.yaml"
    path.write_text(find(rendered["controller"], "ConfigMap", f"{NAME}-config")["data"]["config.yaml"])
    args = [a.replace("/etc/gpu-health-controller/config.yaml", str(path))
            for a in deploy["spec"]["template"]["spec"]["containers"][0]["args"]]
    cfg = load(args, environ={"POD_NAME": "p", "POD_NAMESPACE": "gpu-health-system"})
    defaults = ControllerConfig()
    for name in ("unhealthy_devices", "unhealthy_fraction", "reboot_required", "capacity_gap", "no_execute_after_s",
                 "cordon", "quarantine_label", "drain", "drain_per_minute", "recovery_hold_s", "repeat_limit",
                 "repeat_window_s", "max_quarantined_fraction", "lease_duration_s", "renew_deadline_s",
                 "retry_period_s", "write_timeout_s"):
        assert getattr(cfg, name) == getattr(defaults, name), name
    assert cfg.identity == "p"
    drain_deploy = find(rendered["controller-drain"], "Deployment", NAME)
    assert load([a.replace("/etc/gpu-health-controller/config.yaml", str(path))
                 for a in drain_deploy["spec"]["template"]["spec"]["containers"][0]["args"]], environ={}).drain


# Operators' own overlays ---------------------------------------------------------------------------------------

def _own_overlay(tmp_path: Path, kustomization: dict[str, Any]) -> Path:
    """An operator's overlay next to a copy of manifests/ (kustomize only loads files below the overlay's root)."""
    shutil.copytree(MANIFESTS, tmp_path / "manifests")
    overlay = tmp_path / "mine"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return overlay


def test_a_namespace_override_moves_the_lease_grant_with_the_controller(kubectl: Path, tmp_path: Path) -> None:
    # POD_NAMESPACE follows the pod, so the Role, its binding and every subject must follow the namespace too.
    objs = render(kubectl, _own_overlay(tmp_path, {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": "gpu-fleet", "resources": ["../manifests/overlays/controller-drain"],
    }))
    for kind in ("Role", "RoleBinding", "Deployment", "PodDisruptionBudget", "ServiceAccount", "ConfigMap"):
        assert find(objs, kind, NAME if kind != "ConfigMap" else f"{NAME}-config")["metadata"]["namespace"] == \
            "gpu-fleet", kind
    for b in ("ClusterRoleBinding", NAME), ("ClusterRoleBinding", DRAIN), ("RoleBinding", NAME):
        assert find(objs, *b)["subjects"] == [{"kind": "ServiceAccount", "name": NAME, "namespace": "gpu-fleet"}]


def test_setting_the_image_moves_the_daemonset_and_the_controller_together(kubectl: Path, tmp_path: Path) -> None:
    objs = render(kubectl, _own_overlay(tmp_path, {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["../manifests/overlays/controller"],
        "images": [{"name": "gpu-health-device-plugin", "newName": "registry.example/gpu-health-device-plugin",
                    "newTag": "9.9.9"}],
    }))
    wanted = "registry.example/gpu-health-device-plugin:9.9.9"
    assert container(find(objs, "Deployment", NAME))["image"] == wanted
    assert container(find(objs, "DaemonSet"))["image"] == wanted
