"""The deployment manifests, rendered by kustomize (the kubectl the conformance helper builds), checked offline.

Every object of the base and of each overlay validates strictly against the Kubernetes schemas of the oldest
supported release (1.30) and of the release the conformance API server runs (1.37); the DaemonSet has the
hardening, scheduling and sizing docs/deploy.md promises; its arguments, environment and config file are accepted
by the plugin's own CLI and config loader and point at what is mounted; each overlay changes exactly what it says.
tests/conformance/apiserver/test_manifests_server.py applies the same renders to a real API server.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from plugin import cli
from plugin import config as config_mod
from tests.conformance.apiserver import _binaries as binaries
from tests.conformance.skips import build_or_skip

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
VARIANTS = {
    "base": MANIFESTS / "base",
    "annotations-off": MANIFESTS / "overlays" / "annotations-off",
    "node-condition": MANIFESTS / "overlays" / "node-condition",
    "cdi": MANIFESTS / "overlays" / "cdi",
    "remediation": MANIFESTS / "overlays" / "remediation",
    "surge-upgrade": MANIFESTS / "overlays" / "surge-upgrade",
    "metrics-network-policy": MANIFESTS / "overlays" / "metrics-network-policy",
    "nvsentinel": MANIFESTS / "overlays" / "nvsentinel",
    "device-api": MANIFESTS / "overlays" / "device-api",
}
# The oldest release the manifests support (ValidatingAdmissionPolicy v1, node name in Pod-bound tokens) and the
# release of the conformance API server.
KUBE_VERSIONS = ("1.30.0", "1.37.0")
NAMESPACE = "gpu-health-system"
NAME = "gpu-health-device-plugin"
VAP = "gpu-health-device-plugin-own-node-only"
SLICE_VAP = "gpu-health-device-plugin-own-node-slices"  # confines a ResourceSlice grant (DRA mode's) to the own node
# Confines a pods/status grant (DRA mode's) to the plugin's own condition on the pods of its own node.
POD_STATUS_VAP = "gpu-health-device-plugin-own-node-pod-status"

ANNOTATIONS_OFF_ARGS = ["--annotations=false", "--events=false", "--correlate-on=none"]


@pytest.fixture(scope="module")
def kubectl() -> Path:
    """kubectl v1.37.2 (kustomize built in), from the conformance build cache; skipped without Go unless CI."""
    t = binaries.KUBECTL
    return build_or_skip(t.module, t.package, t.name, {"CGO_ENABLED": "0"}, version=t.version, ldflags=t.ldflags)


def render(kubectl: Path, directory: Path) -> list[dict[str, Any]]:
    out = subprocess.run([str(kubectl), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered(kubectl: Path) -> dict[str, list[dict[str, Any]]]:
    return {variant: render(kubectl, path) for variant, path in VARIANTS.items()}


def find(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def kinds(objs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objs}


def container(ds: dict[str, Any]) -> dict[str, Any]:
    containers = ds["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    c: dict[str, Any] = containers[0]
    return c


_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m|Ki|Mi|Gi)?$")


def quantity(q: str | int) -> float:
    """A Kubernetes quantity as a number (bytes for memory, cores for CPU); only the suffixes the manifests use."""
    m = _QUANTITY.match(str(q))
    assert m, f"unexpected quantity {q!r}"
    scale = {None: 1, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}[m.group(2)]
    return float(m.group(1)) * scale


BASE_OBJECTS = {
    ("Namespace", NAMESPACE),
    ("ServiceAccount", NAME),
    ("ClusterRole", NAME),
    ("ClusterRoleBinding", NAME),
    ("ValidatingAdmissionPolicy", VAP),
    ("ValidatingAdmissionPolicyBinding", VAP),
    ("ValidatingAdmissionPolicy", SLICE_VAP),
    ("ValidatingAdmissionPolicyBinding", SLICE_VAP),
    ("ValidatingAdmissionPolicy", POD_STATUS_VAP),
    ("ValidatingAdmissionPolicyBinding", POD_STATUS_VAP),
    ("ConfigMap", "gpu-health-device-plugin-config"),
    ("DaemonSet", NAME),
}


# Every object, every variant, strict schemas --------------------------------------------------------------------

def test_base_holds_every_object(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert kinds(rendered["base"]) == BASE_OBJECTS


def _objects(rendered: dict[str, list[dict[str, Any]]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for variant, objs in rendered.items():
        for o in objs:
            yield variant, o


def strict_problems(objects: Iterable[tuple[str, dict[str, Any]]], version: str) -> tuple[list[str], int]:
    """What strict validation against Kubernetes ``version`` finds in each (where, object), and how many passed."""
    problems = []
    count = 0
    for label, obj in objects:
        where = f"{label}: {obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, version, strict=True)
            count += 1
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            # A kind without a schema would pass unvalidated: that is a failure too.
            problems.append(f"{where}: {exc.message}")
    return problems, count


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_object_validates_strictly(rendered: dict[str, list[dict[str, Any]]], version: str) -> None:
    problems, count = strict_problems(_objects(rendered), version)
    assert not problems, f"invalid against Kubernetes {version}:\n" + "\n".join(problems)
    assert count == sum(len(v) for v in rendered.values())


def test_strict_validation_rejects_a_misspelt_field(rendered: dict[str, list[dict[str, Any]]]) -> None:
    # Guards the test above: strict mode must reject unknown fields, not ignore them.
    ds = copy.deepcopy(find(rendered["base"], "DaemonSet"))
    ds["spec"]["template"]["spec"]["hostNetwrok"] = False
    with pytest.raises(kubernetes_validate.ValidationError, match="hostNetwrok"):
        kubernetes_validate.validate(ds, KUBE_VERSIONS[-1], strict=True)
    container(ds)["securityContext"]["readOnlyRootFilesystem"] = "yes"
    del ds["spec"]["template"]["spec"]["hostNetwrok"]
    with pytest.raises(kubernetes_validate.ValidationError, match="'yes' is not of type 'boolean'"):
        kubernetes_validate.validate(ds, KUBE_VERSIONS[-1], strict=True)


def test_references_between_objects_resolve(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for variant, objs in rendered.items():
        names = kinds(objs)
        ds = find(objs, "DaemonSet", NAME)
        pod = ds["spec"]["template"]["spec"]
        assert ("ServiceAccount", pod["serviceAccountName"]) in names, variant
        for vol in pod["volumes"]:
            if "configMap" in vol:
                assert ("ConfigMap", vol["configMap"]["name"]) in names, variant
        for o in objs:
            if o["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                                 "ValidatingAdmissionPolicyBinding"):
                assert o["metadata"]["namespace"] == NAMESPACE, f"{variant}: {o['kind']}"
        if ("ClusterRoleBinding", NAME) in names:
            crb = find(objs, "ClusterRoleBinding", NAME)
            assert ("ClusterRole", crb["roleRef"]["name"]) in names
            assert crb["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                        "namespace": NAMESPACE}]
        for binding in (o for o in objs if o["kind"] == "ValidatingAdmissionPolicyBinding"):
            assert binding["spec"]["policyName"] == binding["metadata"]["name"], variant
            assert ("ValidatingAdmissionPolicy", binding["spec"]["policyName"]) in names, variant
        selector = ds["spec"]["selector"]["matchLabels"]
        labels = ds["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), variant


# The DaemonSet ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ds(rendered: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return find(rendered["base"], "DaemonSet", NAME)


def test_daemonset_scheduling(ds: dict[str, Any]) -> None:
    pod = ds["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    # Terms are ORed; each must select GPU nodes only, and the GPU-feature-discovery label must be one of them.
    selected = [{(e["key"], e["operator"], tuple(e["values"])) for e in t["matchExpressions"]} for t in terms]
    assert {("nvidia.com/gpu.present", "In", ("true",))} in selected
    assert all(len(s) == 1 and next(iter(s))[2] == ("true",) for s in selected)
    tolerations = {(t["key"], t["operator"], t.get("effect", "")) for t in pod["tolerations"]}
    # And the fleet controller's quarantine, both effects (tests/artifacts/test_quarantine_toleration.py).
    assert tolerations == {("nvidia.com/gpu", "Exists", ""), ("CriticalAddonsOnly", "Exists", ""),
                           ("gpu-health.io/quarantine", "Exists", "")}
    assert pod["runtimeClassName"] == "nvidia"


def test_daemonset_rolls_one_plugin_per_node(ds: dict[str, Any]) -> None:
    strategy = ds["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    # A surge pod would register the same resource next to the old plugin on the same node.
    assert strategy["rollingUpdate"]["maxSurge"] == 0
    assert strategy["rollingUpdate"]["maxUnavailable"] not in (0, "0%")
    assert ds["spec"]["minReadySeconds"] > 0


def test_daemonset_is_hardened(ds: dict[str, Any]) -> None:
    pod = ds["spec"]["template"]["spec"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for host_ns in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(host_ns, False), host_ns
    sc = container(ds)["securityContext"]
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert "add" not in sc["capabilities"]
    # Root is a documented necessity (docs/deploy.md): said explicitly rather than inherited from the image.
    assert sc["runAsUser"] == 0 and sc["runAsNonRoot"] is False


def test_daemonset_mounts_only_what_it_needs(ds: dict[str, Any]) -> None:
    pod = ds["spec"]["template"]["spec"]
    host_paths = {v["name"]: (v["hostPath"]["path"], v["hostPath"]["type"]) for v in pod["volumes"]
                  if "hostPath" in v}
    assert host_paths == {
        "device-plugins": ("/var/lib/kubelet/device-plugins", "Directory"),
        "pod-resources": ("/var/lib/kubelet/pod-resources", "Directory"),
        "state": ("/var/lib/gpu-health-device-plugin", "DirectoryOrCreate"),
    }
    other = {v["name"]: next(k for k in v if k != "name") for v in pod["volumes"] if "hostPath" not in v}
    assert other == {"config": "configMap", "tmp": "emptyDir"}
    mounts = {m["name"]: m for m in container(ds)["volumeMounts"]}
    assert mounts.keys() == host_paths.keys() | other.keys()
    assert mounts["pod-resources"]["readOnly"] is True
    assert mounts["config"]["readOnly"] is True
    for name in ("device-plugins", "state"):
        assert not mounts[name].get("readOnly", False), name
    # Host paths are mounted at the same path, so paths in logs and in `kubectl exec` match the node's.
    for name, (path, _) in host_paths.items():
        assert mounts[name]["mountPath"] == path


def test_daemonset_node_name_from_downward_api(ds: dict[str, Any]) -> None:
    env = {e["name"]: e for e in container(ds)["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_daemonset_probes_and_port(ds: dict[str, Any]) -> None:
    c = container(ds)
    assert c["ports"] == [{"name": "metrics", "containerPort": 9402, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}


def test_daemonset_resources_sized(ds: dict[str, Any]) -> None:
    res = container(ds)["resources"]
    # docs/benchmarks.md (bench/bench_deploy_rss.py): 48 MiB RSS on 8 GPUs, 59 MiB with cluster reporting on.
    request, limit = quantity(res["requests"]["memory"]), quantity(res["limits"]["memory"])
    assert 60 * 2**20 <= request <= limit
    assert limit >= 2 * request, "headroom over the steady RSS for bursts (MIG, many transitions)"
    assert 0 < quantity(res["requests"]["cpu"]) <= 0.1
    assert "cpu" not in res["limits"], "a CPU limit throttles Allocate answers"


def test_image_tag_is_the_package_version(ds: dict[str, Any]) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert container(ds)["image"] == f"gpu-health-device-plugin:{version}"


# The plugin accepts what the manifests give it ---------------------------------------------------------------

def _plugin_config(objs: list[dict[str, Any]], tmp_path: Path) -> tuple[config_mod.Config, list[str]]:
    """Load the config the container would: its args through the plugin's CLI parser, its env, its config file."""
    ds = find(objs, "DaemonSet", NAME)
    c = container(ds)
    args = list(c.get("command", [])[1:]) + list(c["args"])
    assert args[0] == "run"
    parsed, unknown = cli.build_parser().parse_known_args(args)
    assert not unknown, f"the DaemonSet passes {unknown}, which `gpu-health-plugin run` does not know"
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    env["NODE_NAME"] = "gpu-node-1"  # what the downward API gives
    config_path = Path(env.pop("GPU_HEALTH_CONFIG"))
    # The file the ConfigMap mounts at that path, written where this test can read it.
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    vol = next(v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    cm = find(objs, "ConfigMap", vol["configMap"]["name"])
    assert str(config_path.parent) == mounts["config"]
    local = tmp_path / config_path.name
    local.write_text(cm["data"][config_path.name])
    flags = {o.name: getattr(parsed, o.name) for o in config_mod.OPTIONS}
    return config_mod.load(flags, env, local), list(mounts.values())


def _host_dir(objs: list[dict[str, Any]], mount_path: Path) -> str:
    """The host directory the DaemonSet mounts at ``mount_path``."""
    ds = find(objs, "DaemonSet", NAME)
    name = next(m["name"] for m in container(ds)["volumeMounts"] if m["mountPath"] == str(mount_path))
    vol = next(v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == name)
    return str(vol["hostPath"]["path"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_plugin_accepts_the_daemonsets_args_env_and_config(rendered: dict[str, list[dict[str, Any]]],
                                                           variant: str, tmp_path: Path) -> None:
    cfg, mounts = _plugin_config(rendered[variant], tmp_path)
    assert cfg.backend == "nvml"
    assert str(cfg.device_plugin_dir) in mounts
    assert str(cfg.state_dir) in mounts
    assert cfg.health_socket_path.parent == cfg.state_dir
    # Device specs name host paths; "/" makes them /dev/nvidia*, which the NVIDIA runtime also shows the container.
    assert cfg.dev_root == Path("/")
    assert cfg.log_format == "json"
    assert cfg.cdi is (variant == "cdi")
    assert cfg.node_name == "gpu-node-1"
    api_access = variant != "annotations-off"
    assert cfg.annotations is api_access
    assert cfg.events is api_access
    assert bool(cfg.correlate_on) is api_access
    assert cfg.node_condition is (variant == "node-condition")
    assert (cfg.remediate, cfg.annotate_pods) == (("evict", True) if variant == "remediation" else ("none", False))
    assert cfg.handover is (variant == "surge-upgrade")
    # The probes and the Prometheus port are the port the plugin listens on; the pod network, not the host's.
    port = container(find(rendered[variant], "DaemonSet"))["ports"][0]["containerPort"]
    assert cfg.metrics_address == f"0.0.0.0:{port}"
    assert str(cfg.pod_resources_socket.parent) in mounts
    # NVSentinel's sockets: the directory is mounted, so a restarted peer's new socket file is seen.
    if variant == "nvsentinel":
        assert cfg.nvsentinel_socket == Path("/var/run/nvsentinel/nvsentinel.sock")
        assert _host_dir(rendered[variant], cfg.nvsentinel_socket.parent) == "/var/run/nvsentinel"
    else:
        assert cfg.nvsentinel_socket is None
    if variant == "device-api":
        assert cfg.device_api_socket == Path("/var/run/device-api/device.sock")
        assert (cfg.device_api_provide, cfg.device_api_consume) == (True, True)
        assert _host_dir(rendered[variant], cfg.device_api_socket.parent) == "/var/run/device-api"
    else:
        assert (cfg.device_api_socket, cfg.device_api_provide, cfg.device_api_consume) == (None, False, False)


def test_configmap_health_section_is_the_default_policy(rendered: dict[str, list[dict[str, Any]]]) -> None:
    doc = yaml.safe_load(find(rendered["base"], "ConfigMap")["data"]["config.yaml"])
    assert config_mod.parse_health(doc["health"]) == config_mod.parse_health(None)


# Overlays change exactly what they say -----------------------------------------------------------------------

def _without(objs: list[dict[str, Any]], drop: set[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs if (o["kind"], o["metadata"]["name"]) not in drop}


def test_annotations_off_has_no_api_access(rendered: dict[str, list[dict[str, Any]]]) -> None:
    base, over = rendered["base"], rendered["annotations-off"]
    gone = {("ClusterRole", NAME), ("ClusterRoleBinding", NAME), ("ValidatingAdmissionPolicy", VAP),
            ("ValidatingAdmissionPolicyBinding", VAP), ("ValidatingAdmissionPolicy", SLICE_VAP),
            ("ValidatingAdmissionPolicyBinding", SLICE_VAP), ("ValidatingAdmissionPolicy", POD_STATUS_VAP),
            ("ValidatingAdmissionPolicyBinding", POD_STATUS_VAP)}
    assert kinds(over) == BASE_OBJECTS - gone
    ds = find(over, "DaemonSet")
    assert ds["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert container(ds)["args"] == ["run", *ANNOTATIONS_OFF_ARGS]
    expected = _without(base, gone)
    ds_expected = expected[("DaemonSet", NAME)] = copy.deepcopy(expected[("DaemonSet", NAME)])
    ds_expected["spec"]["template"]["spec"]["automountServiceAccountToken"] = False
    container(ds_expected)["args"].extend(ANNOTATIONS_OFF_ARGS)
    assert _without(over, set()) == expected


NODE_CONDITION_ARGS = ["--node-condition=true", "--node-condition-type=GPUHealthy", "--node-condition-reasons=ours"]


def policy_condition_type(objs: list[dict[str, Any]]) -> str:
    """The one condition type the admission policy lets the plugin write (its ``conditionType`` variable)."""
    variables = {v["name"]: v["expression"] for v in find(objs, "ValidatingAdmissionPolicy", VAP)["spec"]["variables"]}
    expression = variables["conditionType"]
    assert re.fullmatch(r"'[^'\\]+'", expression), expression  # a plain CEL string literal
    return str(expression[1:-1])


def test_node_condition_adds_only_the_status_grant(rendered: dict[str, list[dict[str, Any]]],
                                                   tmp_path: Path) -> None:
    base, over = rendered["base"], rendered["node-condition"]
    status_rule = {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]}
    base_rules = find(base, "ClusterRole")["rules"]
    assert not any("nodes/status" in r["resources"] for r in base_rules)
    assert find(over, "ClusterRole")["rules"] == [*base_rules, status_rule]
    assert container(find(over, "DaemonSet"))["args"] == ["run", *NODE_CONDITION_ARGS]
    expected = copy.deepcopy(_without(base, set()))
    expected[("ClusterRole", NAME)]["rules"].append(status_rule)
    container(expected[("DaemonSet", NAME)])["args"].extend(NODE_CONDITION_ARGS)
    assert _without(over, set()) == expected
    # The component sets the type in two places: the policy allows exactly the type the plugin writes.
    cfg, _ = _plugin_config(over, tmp_path)
    assert policy_condition_type(over) == policy_condition_type(base) == cfg.node_condition_type == "GPUHealthy"
    assert cfg.node_condition_reasons == "ours"


KERNEL_LOG_FIFO = "/run/gpu-health-kernel-log/kmsg"


def test_kernel_log_adds_a_privileged_relay_and_leaves_the_plugin_unprivileged(kubectl: Path, tmp_path: Path) -> None:
    base = render(kubectl, MANIFESTS / "base")
    over = render(kubectl, MANIFESTS / "overlays" / "kernel-log")
    ds = copy.deepcopy(find(over, "DaemonSet"))
    spec = ds["spec"]["template"]["spec"]
    plugin, relay = spec["containers"]
    # The relay: the same image, only the kernel log and the shared directory, and the one thing it is for.
    assert relay["name"] == "kernel-log-relay" and relay["image"] == plugin["image"]
    parsed = cli.build_parser().parse_args(relay["args"])
    assert (parsed.command, str(parsed.source), str(parsed.fifo)) == ("kernel-log-relay", "/dev/kmsg", KERNEL_LOG_FIFO)
    assert relay["securityContext"]["privileged"] is True and relay["securityContext"]["readOnlyRootFilesystem"]
    assert {m["name"]: m["mountPath"] for m in relay["volumeMounts"]} == {
        "kmsg": "/dev/kmsg", "kernel-log": str(Path(KERNEL_LOG_FIFO).parent)}
    assert "env" not in relay and "ports" not in relay  # no NVIDIA devices asked for, nothing served
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["kmsg"]["hostPath"] == {"path": "/dev/kmsg", "type": "CharDevice"}
    assert "emptyDir" in volumes["kernel-log"]
    # The plugin: what it had, plus the flag and the FIFO's directory read-only. Nothing of its security changes.
    expected = copy.deepcopy(find(base, "DaemonSet"))
    c = container(expected)
    c["args"].append(f"--kernel-log={KERNEL_LOG_FIFO}")
    c["volumeMounts"].append({"name": "kernel-log", "mountPath": str(Path(KERNEL_LOG_FIFO).parent), "readOnly": True})
    expected["spec"]["template"]["spec"]["volumes"] += [volumes["kmsg"], volumes["kernel-log"]]
    spec["containers"] = [plugin]
    assert ds == expected
    assert {k: v for k, v in _without(over, set()).items() if k[0] != "DaemonSet"} == \
        {k: v for k, v in _without(base, set()).items() if k[0] != "DaemonSet"}
    cfg, _ = _plugin_config([*[o for o in over if o["kind"] != "DaemonSet"], ds], tmp_path)
    assert cfg.kernel_log == Path(KERNEL_LOG_FIFO)


def test_cdi_only_turns_on_cdi(rendered: dict[str, list[dict[str, Any]]]) -> None:
    over = rendered["cdi"]
    expected = copy.deepcopy(_without(rendered["base"], set()))
    container(expected[("DaemonSet", NAME)])["args"].append("--cdi=true")
    assert _without(over, set()) == expected


def test_surge_upgrade_starts_the_new_pod_first_and_hands_over(rendered: dict[str, list[dict[str, Any]]]) -> None:
    over = rendered["surge-upgrade"]
    expected = copy.deepcopy(_without(rendered["base"], set()))
    ds = expected[("DaemonSet", NAME)]
    ds["spec"]["updateStrategy"]["rollingUpdate"] = {"maxSurge": "10%", "maxUnavailable": 0}
    container(ds)["args"].append("--handover=true")
    assert _without(over, set()) == expected


def _own_overlay(tmp_path: Path, kustomization: dict[str, Any]) -> Path:
    """An operator's overlay next to a copy of manifests/ (kustomize only loads files below the overlay's root)."""
    shutil.copytree(MANIFESTS, tmp_path / "manifests")
    overlay = tmp_path / "mine"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return tmp_path


def test_remediation_adds_only_its_pod_grants(rendered: dict[str, list[dict[str, Any]]]) -> None:
    base, over = rendered["base"], rendered["remediation"]
    added = kinds(over) - kinds(base)
    assert added == {("ClusterRole", f"{NAME}-remediation"), ("ClusterRoleBinding", f"{NAME}-remediation")}
    rules = find(over, "ClusterRole", f"{NAME}-remediation")["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert granted == {("", "pods", v) for v in ("get", "list", "watch", "patch")} | {("", "pods/eviction", "create")}
    crb = find(over, "ClusterRoleBinding", f"{NAME}-remediation")
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]
    expected = copy.deepcopy(_without(base, set()))
    container(expected[("DaemonSet", NAME)])["args"] += ["--remediate=evict", "--annotate-pods=true"]
    assert _without(over, added) == expected


def test_components_compose(kubectl: Path, tmp_path: Path) -> None:
    # Overlays are thin wrappers over components so that an operator can combine them in one overlay.
    root = _own_overlay(tmp_path, {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["../manifests/base"],
        "components": ["../manifests/components/node-condition", "../manifests/components/cdi"],
    })
    objs = render(kubectl, root / "mine")
    assert container(find(objs, "DaemonSet"))["args"] == ["run", *NODE_CONDITION_ARGS, "--cdi=true"]
    assert any("nodes/status" in r["resources"] for r in find(objs, "ClusterRole")["rules"])


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector's meaning (matchLabels, and the In / NotIn / Exists / DoesNotExist expressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        if not {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[op]:
            return False
    return True


def _admits(policies: list[dict[str, Any]], pod: dict[str, str], namespace: dict[str, str], port: int) -> bool:
    """Whether a pod in another namespace (labelled ``namespace``) may connect to ``port`` of a pod labelled ``pod``,
    under NetworkPolicy's rules: a pod no Ingress policy selects admits everything, one that some select admits what
    any of their rules admits."""
    selecting = [p for p in policies if "Ingress" in p["spec"]["policyTypes"] and _selects(p["spec"]["podSelector"],
                                                                                           pod)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            from_ok = not peers or any("namespaceSelector" in peer and "podSelector" not in peer
                                       and _selects(peer["namespaceSelector"], namespace) for peer in peers)
            ports = rule.get("ports")
            port_ok = not ports or any(p.get("protocol", "TCP") == "TCP" and p.get("port") == port for p in ports)
            if from_ok and port_ok:
                return True
    return False


def test_metrics_network_policy_admits_scrapers_only_from_labelled_namespaces(
        kubectl: Path, tmp_path: Path, rendered: dict[str, list[dict[str, Any]]]) -> None:
    base, over = rendered["base"], rendered["metrics-network-policy"]
    policy = (NAME + "-metrics")
    # The overlay adds the policy and changes nothing else.
    assert kinds(over) == BASE_OBJECTS | {("NetworkPolicy", policy)}
    assert _without(over, {("NetworkPolicy", policy)}) == _without(base, set())
    # With the controller too, as docs/observability.md tells an operator to combine them.
    objs = render(kubectl, _own_overlay(tmp_path, {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": ["../manifests/base"],
        "components": ["../manifests/components/controller", "../manifests/components/metrics-network-policy"],
    }) / "mine")
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert [p["metadata"]["name"] for p in policies] == [policy]
    assert policies[0]["spec"]["policyTypes"] == ["Ingress"]  # egress to the API server untouched
    scraper = {"kubernetes.io/metadata.name": "monitoring", "gpu-health.io/metrics-scraper": "true"}
    other = {"kubernetes.io/metadata.name": "default"}
    for workload in (find(objs, "DaemonSet", NAME), find(objs, "Deployment", "gpu-health-controller")):
        pod = workload["spec"]["template"]["metadata"]["labels"]
        ports = [p["containerPort"] for c in workload["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])]
        assert len(ports) == 1, workload["metadata"]["name"]
        assert _admits(policies, pod, scraper, ports[0]), f"{workload['metadata']['name']}: scrape refused"
        assert not _admits(policies, pod, other, ports[0]), f"{workload['metadata']['name']}: any namespace admitted"
        assert not _admits(policies, pod, scraper, 8080), f"{workload['metadata']['name']}: another port admitted"
        # Without the component, anyone: what the policy changes.
        assert _admits([], pod, other, ports[0])


def test_runtime_class_can_be_dropped_as_documented(kubectl: Path, tmp_path: Path) -> None:
    # docs/deploy.md gives this patch for clusters whose default runtime is NVIDIA's.
    doc = (REPO / "docs" / "deploy.md").read_text()
    snippet = re.search(r"<!-- runtime-class-patch -->\n```yaml\n(.*?)```", doc, re.S)
    assert snippet, "docs/deploy.md lost its runtimeClassName patch"
    kustomization = yaml.safe_load(snippet.group(1))
    kustomization["resources"] = ["../manifests/base"]
    objs = render(kubectl, _own_overlay(tmp_path, kustomization) / "mine")
    assert "runtimeClassName" not in find(objs, "DaemonSet")["spec"]["template"]["spec"]
    kubernetes_validate.validate(find(objs, "DaemonSet"), KUBE_VERSIONS[-1], strict=True)
