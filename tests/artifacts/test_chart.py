"""The Helm chart (charts/gpu-health-device-plugin) cannot drift from manifests/, and every rendering of it is valid.

Each kustomize rendering of manifests/ is paired with the chart values that mean the same deployment, and the two
renderings must hold the same objects, keyed by (apiVersion, kind, namespace, name), equal field by field once
these differences, and only these, are taken out (``ALLOWED``; each must still occur, or it is stale):

- helm-labels: Helm's own labels (helm.sh/chart, app.kubernetes.io/managed-by, /instance, /version) on each chart
  object's metadata.labels. Selectors and pod template labels are manifests/' own and must match exactly: a
  DaemonSet's selector cannot change, so a release must select what `kubectl apply -k` selects.
- namespace-object: the Namespace of manifests/base. Helm does not manage the namespace it installs into
  (`helm install --create-namespace`, or the namespace made beforehand).
- config-checksum: the chart's `checksum/config` pod template annotation, so that a changed config file rolls the
  pods on `helm upgrade` (the plugin and the controller read it once at start).
- config-file-parsed: a ConfigMap's config.yaml compared as parsed YAML: manifests/ write it by hand with comments,
  the chart renders it from values.
- cel-folding: kustomize writes the admission policy's folded CEL blocks back with a blank line before each
  more-indented line (an extra newline CEL ignores); those blank lines are taken out of the kustomize side.
- name-keyed-order: the order of env, volumes and volumeMounts entries, which a kustomize strategic-merge patch puts
  first and the chart's extra* values append; they are keyed by name (kept in order where an env value refers to
  another with $(VAR)).

Comments and key order vanish anyway, both renderings being compared as parsed YAML. Every chart rendering (and
one with every feature on) also validates strictly against the Kubernetes schemas; `helm lint` is clean; the
rendered config file is accepted by the plugin's own loader with the values it was given; every value in
values.yaml is documented; the chart is versioned with the package.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tomllib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugin.dra.podstatus import PodConditionSettings
from plugin.dra.slices import DRIVER
from plugin.health.reasons import KubeletHealth, State
from plugin.validation import FieldError
from scripts import helm as helm_build
from tests.artifacts.test_manifests import _plugin_config, find, policy_condition_type, render, strict_problems
from tests.artifacts.test_manifests_dra import GPU_SELECTOR
from tests.conformance.apiserver import _binaries as binaries
from tests.conformance.skips import build_or_skip

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "gpu-health-device-plugin"
MANIFESTS = REPO / "manifests"
LOCAL_VALUES = REPO / "scripts" / "localcluster" / "helm-values.yaml"
LOCAL_DRA_VALUES = REPO / "scripts" / "localcluster" / "helm-values-dra.yaml"
ALERTS = MANIFESTS / "alerts" / "prometheusrule.yaml"
RELEASE = "gpu-health-device-plugin"
NAMESPACE = "gpu-health-system"
NAME = "gpu-health-device-plugin"
# The oldest release the chart supports (its kubeVersion) and the release of the conformance API server.
KUBE_VERSIONS = ("1.30.0", "1.37.0")
# mode: dra's oldest release (resource.k8s.io/v1 GA) and the same newest.
DRA_KUBE_VERSIONS = ("1.34.0", "1.37.0")
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]

Obj = dict[str, Any]


# Rendering ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def helm() -> Path:
    """helm, built from charts/go/helm by scripts/helm.py; skipped without Go unless CI."""
    return build_or_skip(helm_build.MODULE, helm_build.PACKAGE, "helm", helm_build.ENV,
                         version=helm_build.HELM_VERSION, ldflags=helm_build.LDFLAGS)


@pytest.fixture(scope="module")
def kubectl() -> Path:
    """kubectl with kustomize, from the conformance build cache (as tests/artifacts/test_manifests.py)."""
    t = binaries.KUBECTL
    return build_or_skip(t.module, t.package, t.name, {"CGO_ENABLED": "0"}, version=t.version, ldflags=t.ldflags)


def helm_run(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def template_args(values_files: Iterable[Path | str] = (), sets: Iterable[str] = (),
                  kube_version: str = "1.37.0") -> list[str]:
    args = ["template", RELEASE, str(CHART.relative_to(REPO)), "-n", NAMESPACE, "--kube-version", kube_version]
    for f in values_files:
        args += ["-f", str(f)]
    for s in sets:
        args += ["--set", s]
    return args


def helm_template(helm: Path, values_files: Iterable[Path | str] = (), sets: Iterable[str] = (),
                  kube_version: str = "1.37.0") -> list[Obj]:
    out = helm_run(helm, *template_args(values_files, sets, kube_version))
    assert out.returncode == 0, f"helm template {list(values_files)} {list(sets)} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@dataclass(frozen=True)
class Pair:
    """A kustomize rendering (overlay directories, and plain YAML files of objects) and the chart values for it."""

    id: str
    kustomize: tuple[str, ...]
    values_files: tuple[Path, ...] = ()
    sets: tuple[str, ...] = ()


PAIRS = (
    Pair("base", ("base",)),
    Pair("annotations-off", ("overlays/annotations-off",), sets=("clusterReporting.enabled=false",)),
    Pair("node-condition", ("overlays/node-condition",), sets=("nodeCondition.enabled=true",)),
    Pair("cdi", ("overlays/cdi",), sets=("cdi.enabled=true",)),
    Pair("nvsentinel", ("overlays/nvsentinel",), sets=("nvsentinel.enabled=true",)),
    Pair("device-api", ("overlays/device-api",), sets=("deviceApi.provide=true,deviceApi.consume=true",)),
    Pair("kernel-log", ("overlays/kernel-log",), sets=("kernelLog.enabled=true",)),
    Pair("remediation", ("overlays/remediation",), sets=("remediation.enabled=true",)),
    Pair("surge-upgrade", ("overlays/surge-upgrade",),
         sets=("updateStrategy.rollingUpdate.maxSurge=10%,updateStrategy.rollingUpdate.maxUnavailable=0",)),
    Pair("metrics-network-policy", ("overlays/metrics-network-policy",), sets=("metricsNetworkPolicy.enabled=true",)),
    Pair("controller", ("overlays/controller",), sets=("controller.enabled=true",)),
    Pair("controller-drain", ("overlays/controller-drain",), sets=("controller.enabled=true,controller.drain=true",)),
    Pair("local-cluster-remediation", ("overlays/local-cluster-remediation",), (LOCAL_VALUES,),
         ("remediation.enabled=true",)),
    Pair("local-cluster-controller", ("overlays/local-cluster", "overlays/local-cluster-controller"), (LOCAL_VALUES,),
         ("controller.enabled=true",)),
    Pair("local-cluster", ("overlays/local-cluster",), (LOCAL_VALUES,)),
    Pair("prometheus-rule", ("base", "alerts/prometheusrule.yaml"), sets=("prometheusRule.enabled=true",)),
    Pair("dra", ("overlays/dra",), sets=("mode=dra",)),
    Pair("local-cluster-dra", ("overlays/local-cluster-dra",), (LOCAL_VALUES, LOCAL_DRA_VALUES)),
)
# The pairs in mode: dra, which renders only for Kubernetes >= 1.34.
DRA_PAIRS = {"dra", "local-cluster-dra"}
ALL_ON = ("controller.enabled=true,controller.drain=true,serviceMonitor.enabled=true,prometheusRule.enabled=true,"
          "remediation.enabled=true,nodeCondition.enabled=true,cdi.enabled=true,metricsNetworkPolicy.enabled=true,"
          "kernelLog.enabled=true",)
# Everything mode: dra takes (remediation, cdi and a surge rollout are device-plugin mode's).
DRA_ALL_ON = ("mode=dra,controller.enabled=true,controller.drain=true,serviceMonitor.enabled=true,"
              "prometheusRule.enabled=true,nodeCondition.enabled=true,metricsNetworkPolicy.enabled=true,"
              "plugin.draUnhealthyTaintEffect=NoExecute,plugin.draDegradedHealth=Unhealthy",)


def kustomize(kubectl: Path, sources: Sequence[str]) -> list[Obj]:
    objs: list[Obj] = []
    for s in sources:
        path = MANIFESTS / s
        objs += render(kubectl, path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    return objs


@pytest.fixture(scope="module")
def renders(helm: Path, kubectl: Path) -> dict[str, tuple[list[Obj], list[Obj]]]:
    """Pair id -> (kustomize rendering, chart rendering)."""
    return {p.id: (kustomize(kubectl, p.kustomize), helm_template(helm, p.values_files, p.sets)) for p in PAIRS}


# The allowed differences ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Allowed:
    """One difference between a kustomize and a chart rendering that is not drift. ``apply`` takes it out of both
    renderings (in place) and says how many times it occurred."""

    name: str
    reason: str
    apply: Callable[[list[Obj], list[Obj]], int]


HELM_LABELS = {
    "helm.sh/chart": f"{NAME}-{VERSION}",
    "app.kubernetes.io/managed-by": "Helm",
    "app.kubernetes.io/instance": RELEASE,
    "app.kubernetes.io/version": VERSION,
}


def _drop_helm_labels(_kustomize: list[Obj], chart: list[Obj]) -> int:
    n = 0
    for o in chart:
        labels = o["metadata"].get("labels", {})
        for k, v in HELM_LABELS.items():
            # Only with the value Helm gives it: a wrong one is a difference.
            if labels.get(k) == v:
                del labels[k]
                n += 1
    return n


def _drop_namespace(kustomize: list[Obj], _chart: list[Obj]) -> int:
    before = len(kustomize)
    kustomize[:] = [o for o in kustomize if not (o["kind"] == "Namespace" and o["metadata"]["name"] == NAMESPACE)]
    return before - len(kustomize)


def _drop_config_checksum(_kustomize: list[Obj], chart: list[Obj]) -> int:
    n = 0
    for o in chart:
        meta = o.get("spec", {}).get("template", {}).get("metadata", {})
        annotations = meta.get("annotations", {})
        if re.fullmatch(r"[0-9a-f]{64}", str(annotations.get("checksum/config", ""))):
            del annotations["checksum/config"]
            n += 1
            if not annotations:
                del meta["annotations"]
    return n


def _parse_config_files(kustomize: list[Obj], chart: list[Obj]) -> int:
    texts: dict[tuple[str, str], list[str]] = {}
    for side in (kustomize, chart):
        for o in side:
            if o["kind"] == "ConfigMap" and isinstance(o.get("data", {}).get("config.yaml"), str):
                texts.setdefault((o["metadata"].get("namespace", ""), o["metadata"]["name"]), []).append(
                    o["data"]["config.yaml"])
                o["data"]["config.yaml"] = yaml.safe_load(o["data"]["config.yaml"])
    # It occurs where the two texts differ; equal texts would have compared equal unparsed.
    return sum(1 for t in texts.values() if len(t) == 2 and t[0] != t[1])


def _cel_folding(kustomize: list[Obj], _chart: list[Obj]) -> int:
    n = 0

    def unfold(holder: dict[str, Any], key: str) -> None:
        nonlocal n
        text = holder.get(key)
        if isinstance(text, str) and "\n\n" in text:
            holder[key] = re.sub(r"\n\n+", "\n", text)
            n += 1

    for o in kustomize:
        if o["kind"] != "ValidatingAdmissionPolicy":
            continue
        spec = o["spec"]
        for item in spec.get("variables", []) + spec.get("matchConditions", []):
            unfold(item, "expression")
        for item in spec.get("validations", []):
            for key in ("expression", "messageExpression", "message"):
                unfold(item, key)
    return n


def _pod_specs(objs: list[Obj]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o["spec"]["template"]["spec"]
            for o in objs if isinstance(o.get("spec", {}).get("template", {}).get("spec"), dict)}


def _name_keyed_order(kustomize: list[Obj], chart: list[Obj]) -> int:
    n = 0

    def align(a: dict[str, Any], b: dict[str, Any], key: str) -> None:
        nonlocal n
        la, lb = a.get(key), b.get(key)
        if not (isinstance(la, list) and isinstance(lb, list)):
            return
        na, nb = _names(la), _names(lb)
        if na is None or nb is None or na == nb or sorted(na) != sorted(nb):
            return
        # Order matters to env entries that refer to others ($(VAR)): those keep it.
        if key == "env" and any("$(" in str(e.get("value", "")) for e in la):
            return
        by_name = {e["name"]: e for e in la}
        a[key] = [by_name[name] for name in nb]
        n += 1

    chart_specs = _pod_specs(chart)
    for where, spec in _pod_specs(kustomize).items():
        other = chart_specs.get(where)
        if other is None:
            continue
        align(spec, other, "volumes")
        containers = {c["name"]: c for c in other.get("containers", [])}
        for c in spec.get("containers", []):
            if c["name"] in containers:
                align(c, containers[c["name"]], "env")
                align(c, containers[c["name"]], "volumeMounts")
    return n


ALLOWED = (
    Allowed("helm-labels", "Helm's own labels: helm.sh/chart, app.kubernetes.io/managed-by, /instance, /version on "
            "every chart object's metadata.labels; the selectors and pod labels are manifests/' own",
            _drop_helm_labels),
    Allowed("namespace-object", "Helm does not manage the namespace it installs into (helm install "
            "--create-namespace, or made beforehand): the Namespace of manifests/base is not in the chart",
            _drop_namespace),
    Allowed("config-checksum", "the chart's pod templates carry checksum/config, so that a changed config file rolls "
            "the pods on helm upgrade", _drop_config_checksum),
    Allowed("config-file-parsed", "a ConfigMap's config.yaml is compared parsed: manifests/ carry comments, the "
            "chart renders it from values", _parse_config_files),
    Allowed("cel-folding", "kustomize writes the admission policy's folded (>-) CEL blocks back as literal blocks "
            "with a blank line before each more-indented line, so the API server gets an extra newline that CEL "
            "ignores; the chart keeps the file's folding", _cel_folding),
    Allowed("name-keyed-order", "a kustomize strategic-merge patch puts its env, volumes and volumeMounts entries "
            "first, the chart appends extraEnv/extraVolumes/extraVolumeMounts; entries are keyed by name and their "
            "order means nothing here (no $(VAR) reference)", _name_keyed_order),
)


# Comparing ------------------------------------------------------------------------------------------------------

def _key(o: Obj) -> tuple[str, str, str, str]:
    return (o["apiVersion"], o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])


def _short(v: Any, limit: int = 400) -> str:
    text = json.dumps(v, sort_keys=True, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


def _names(v: list[Any]) -> list[Any] | None:
    """The names of a list merged by name (containers, env, volumes, ports), or None for any other list."""
    names = [x.get("name") if isinstance(x, dict) else None for x in v]
    return names if v and None not in names and len(set(names)) == len(names) else None


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ, as ``path: a != b`` lines (kustomize's value first). Lists of named items are
    compared item by name (``env[NODE_NAME]``), their order apart."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(a.keys() | b.keys(), key=str):
            sub = f"{path}.{k}" if path else str(k)
            if k not in b:
                out.append(f"{sub}: {_short(a[k])} != (absent)")
            elif k not in a:
                out.append(f"{sub}: (absent) != {_short(b[k])}")
            else:
                out += diff(a[k], b[k], sub)
        return out
    if isinstance(a, list) and isinstance(b, list):
        na, nb = _names(a), _names(b)
        if na is not None and nb is not None:
            by_a, by_b = dict(zip(na, a, strict=True)), dict(zip(nb, b, strict=True))
            out = [f"{path}[{n}]: {_short(by_a[n])} != (absent)" for n in na if n not in by_b]
            out += [f"{path}[{n}]: (absent) != {_short(by_b[n])}" for n in nb if n not in by_a]
            for n in (n for n in na if n in by_b):
                out += diff(by_a[n], by_b[n], f"{path}[{n}]")
            common_a, common_b = [n for n in na if n in nb], [n for n in nb if n in na]
            if common_a != common_b:
                out.append(f"{path} (order): {_short(na)} != {_short(nb)}")
            return out
        if len(a) == len(b):
            return [line for i, (x, y) in enumerate(zip(a, b, strict=True)) for line in diff(x, y, f"{path}[{i}]")]
    if isinstance(a, str) and isinstance(b, str) and a != b and "\n" in a + b:
        # Multi-line text (CEL, scripts): the first line that differs.
        la, lb = a.split("\n"), b.split("\n")
        n = next((i for i, (x, y) in enumerate(zip(la, lb, strict=False)) if x != y), min(len(la), len(lb)))
        at_a, at_b = (_short(v[n]) if n < len(v) else "(end)" for v in (la, lb))
        return [f"{path}: line {n + 1}: {at_a} != {at_b}"]
    # Unlike types count as unequal: 10 and "10" are different manifests.
    if type(a) is not type(b) or a != b:
        return [f"{path}: {_short(a)} != {_short(b)}"]
    return []


def compare(kustomize_objs: list[Obj], chart_objs: list[Obj]) -> tuple[list[str], Counter[str]]:
    """The differences left once ``ALLOWED`` are taken out, and how often each allowed one occurred."""
    k, c = copy.deepcopy(kustomize_objs), copy.deepcopy(chart_objs)
    used: Counter[str] = Counter()
    for a in ALLOWED:
        used[a.name] += a.apply(k, c)
    problems = []
    by_key = []
    for side, objs in (("kustomize", k), ("chart", c)):
        keys = Counter(_key(o) for o in objs)
        problems += [f"{side} renders {'/'.join(key)} {n} times" for key, n in keys.items() if n > 1]
        by_key.append({_key(o): o for o in objs})
    k_objs, c_objs = by_key
    problems += [f"only in manifests/: {'/'.join(key)}" for key in sorted(k_objs.keys() - c_objs.keys())]
    problems += [f"only in the chart: {'/'.join(key)}" for key in sorted(c_objs.keys() - k_objs.keys())]
    for key in sorted(k_objs.keys() & c_objs.keys()):
        problems += [f"{key[1]}/{key[3]}: {line}" for line in diff(k_objs[key], c_objs[key])]
    return problems, used


# Drift ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pair", PAIRS, ids=[p.id for p in PAIRS])
def test_chart_renders_what_manifests_render(renders: dict[str, tuple[list[Obj], list[Obj]]], pair: Pair) -> None:
    problems, _ = compare(*renders[pair.id])
    where = f"{' + '.join(pair.kustomize)} vs chart {[str(f.relative_to(REPO)) for f in pair.values_files]} " \
            f"{list(pair.sets)}"
    assert not problems, f"{where} (manifests/ first):\n" + "\n".join(problems)


def test_every_allowed_difference_occurs(renders: dict[str, tuple[list[Obj], list[Obj]]]) -> None:
    used: Counter[str] = Counter()
    for k, c in renders.values():
        used += compare(k, c)[1]
    stale = [a.name for a in ALLOWED if not used[a.name]]
    assert not stale, f"allowed differences that never occur (stale, remove them): {stale}"


def test_comparison_catches_drift(helm: Path, renders: dict[str, tuple[list[Obj], list[Obj]]]) -> None:
    base, chart = renders["base"]
    # Only what the change adds counts here: drift of the defaults is the base case's to report.
    known = set(compare(base, chart)[0])

    def added(*sets: str) -> list[str]:
        return [p for p in compare(base, helm_template(helm, sets=sets))[0] if p not in known]

    assert added("minReadySeconds=11") == [f"DaemonSet/{NAME}: spec.minReadySeconds: 10 != 11"]
    # Helm's labels are allowed on the objects only: on the pods they are a difference.
    chart_label = HELM_LABELS["helm.sh/chart"]
    assert added(rf"podLabels.helm\.sh/chart={chart_label}") == [
        f'DaemonSet/{NAME}: spec.template.metadata.labels.helm.sh/chart: (absent) != "{chart_label}"']
    # A config file that parses differently is a difference too.
    assert added("plugin.pollInterval=6") == [f"ConfigMap/{NAME}-config: data.config.yaml.plugin.pollInterval: 5 != 6"]
    # And so is a named list item, by its name.
    assert added("extraEnv[0].name=X,extraEnv[0].value=y") == [
        f'DaemonSet/{NAME}: spec.template.spec.containers[plugin].env[X]: (absent) != {{"name": "X", "value": "y"}}']


# Validity -------------------------------------------------------------------------------------------------------

RENDERINGS = {p.id: (p.values_files, p.sets) for p in PAIRS if p.id not in DRA_PAIRS} | {"all-on": ((), ALL_ON)}
DRA_RENDERINGS = {p.id: (p.values_files, p.sets) for p in PAIRS if p.id in DRA_PAIRS} | {
    "dra-all-on": ((), DRA_ALL_ON)}
# The Prometheus Operator's kinds have no Kubernetes schema; test_prometheus_objects_fit_the_plugin checks them.
OPERATOR_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}


def _strictly_valid(helm: Path, renderings: dict[str, tuple[Any, Any]], version: str) -> tuple[list[tuple[str, Obj]],
                                                                                           list[tuple[str, Obj]]]:
    """Every object of ``renderings`` at Kubernetes ``version``, and those with a Kubernetes schema, all valid."""
    objects = [(rendering, obj) for rendering, (values_files, sets) in renderings.items()
               for obj in helm_template(helm, values_files, sets, kube_version=version)]
    checked = [(r, o) for r, o in objects if (o["apiVersion"], o["kind"]) not in OPERATOR_KINDS]
    problems, validated = strict_problems(checked, version)
    assert not problems, f"invalid against Kubernetes {version}:\n" + "\n".join(problems)
    assert validated == len(checked)
    return objects, checked


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_chart_object_validates_strictly(helm: Path, version: str) -> None:
    objects, checked = _strictly_valid(helm, RENDERINGS, version)
    # prometheus-rule's PrometheusRule, and all-on's ServiceMonitor and PrometheusRule.
    assert len(objects) - len(checked) == 3
    assert len(checked) >= 7 * len(RENDERINGS)


@pytest.mark.parametrize("version", DRA_KUBE_VERSIONS)
def test_every_dra_chart_object_validates_strictly(helm: Path, version: str) -> None:
    objects, checked = _strictly_valid(helm, DRA_RENDERINGS, version)
    # dra-all-on's ServiceMonitor and PrometheusRule.
    assert len(objects) - len(checked) == 2
    # Each rendering has the whole-GPU DeviceClass: the kind only mode: dra brings.
    assert sorted(r for r, o in checked if o["kind"] == "DeviceClass" and o["metadata"]["name"] == DRIVER) == sorted(
        DRA_RENDERINGS)


def test_prometheus_objects_fit_the_plugin(helm: Path) -> None:
    objs = helm_template(helm, sets=ALL_ON)
    ds = find(objs, "DaemonSet", NAME)
    svc = find(objs, "Service", f"{NAME}-metrics")
    monitor = find(objs, "ServiceMonitor", NAME)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [svc["metadata"]["namespace"]]}
    ports = {p["name"] for p in svc["spec"]["ports"]}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    # The port the plugin listens on, by number: on the host's network the chart declares no container port.
    container_ports = {p["containerPort"] for p in ds["spec"]["template"]["spec"]["containers"][0]["ports"]}
    for p in svc["spec"]["ports"]:
        assert p["targetPort"] == p["port"] and p["port"] in container_ports
    # Also the drift pair prometheus-rule, which compares the whole object.
    assert find(objs, "PrometheusRule", NAME)["spec"] == yaml.safe_load(ALERTS.read_text())["spec"]


# Modes ----------------------------------------------------------------------------------------------------------

def _refusal(helm: Path, sets: Iterable[str], kube_version: str = "1.37.0") -> str:
    """The one line `fail` stops a rendering with, after helm's "execution error at (template:line:col): "."""
    out = helm_run(helm, *template_args(sets=sets, kube_version=kube_version))
    assert out.returncode != 0, f"rendered with {list(sets)}"
    [line] = [ln for ln in out.stderr.splitlines() if ln.startswith("Error: execution error at (")]
    return line.split("): ", 1)[1]


SURGE = "updateStrategy.rollingUpdate.maxSurge=10%,updateStrategy.rollingUpdate.maxUnavailable=0"
# (a value, the mode that refuses it, the whole line it is refused with). The other mode takes each.
MODE_REFUSALS = [
    ("migStrategy=single", "dra", "migStrategy: single is device-plugin mode's; in mode: dra use mixed: every MIG "
     "instance is then a device of its own, which the classes mig.gpu-health.io and mig-<profile>.gpu-health.io "
     "select"),
    ("sharing.timeSlicing.resources[0].name=nvidia.com/gpu,sharing.timeSlicing.resources[0].replicas=2,"
     "sharing.timeSlicing.resources[0].rename=nvidia.com/gpu.shared", "dra",
     "sharing.timeSlicing.resources[0].rename: mode: dra keeps a shared GPU's name and class, a claim asks for a "
     "share of it (docs/dra.md, \"Shared GPUs\"); remove it"),
    ("sharing.timeSlicing.resources[0].name=nvidia.com/gpu,sharing.timeSlicing.resources[0].replicas=2,"
     "sharing.timeSlicing.failRequestsGreaterThanOne=true", "dra",
     "sharing.timeSlicing.failRequestsGreaterThanOne: in mode: dra a claim takes one share unless it asks for more, "
     "never more than replicas; remove it"),
    ("sharing.timeSlicing.resources[0].name=nvidia.com/gpu,sharing.timeSlicing.resources[0].replicas=2,"
     "sharing.timeSlicing.allocationPolicy=packed", "dra",
     "sharing.timeSlicing.allocationPolicy: in mode: dra the scheduler places claims on shared GPUs; remove it or "
     "set distributed"),
    ("cdi.enabled=true", "dra", "cdi.enabled: CDI names from Allocate are device-plugin mode's; mode: dra always "
     "hands GPUs over through CDI specs (hostPaths.cdiSpecs)"),
    ("remediation.enabled=true", "dra", "remediation.enabled: evicting the pods of a failing GPU is device-plugin "
     "mode's (it finds them through PodResources); in mode: dra use plugin.draUnhealthyTaintEffect: NoExecute"),
    (SURGE, "dra", "updateStrategy.rollingUpdate.maxSurge: a surge rollout (--handover) is device-plugin mode's; in "
     "mode: dra two plugins on a node would both write its ResourceSlice and prepare claims: keep maxSurge 0"),
    ("plugin.resourceName=example.com/gpu", "dra", "plugin.resourceName is device-plugin mode's; in mode: dra the "
     "DeviceClass gpu.gpu-health.io names the extended resource (dra.extendedResourceName)"),
    ("plugin.correlateOn=Unhealthy", "dra", "plugin.correlateOn is device-plugin mode's; mode: dra has no pod "
     "correlation (the scheduler keeps pods off tainted devices, and a claim's pod status carries each device's "
     "health)"),
    ("plugin.draDegradedHealth=Unhealthy", "device-plugin", "plugin.draDegradedHealth is mode: dra's; this release "
     "is mode: device-plugin"),
    ("plugin.draDegradedTaint=false", "device-plugin", "plugin.draDegradedTaint is mode: dra's; this release is "
     "mode: device-plugin"),
    ("hostPaths.cdiSpecs=/etc/cdi", "device-plugin", "hostPaths.cdiSpecs is mode: dra's; this release is mode: "
     "device-plugin (leave it at /var/run/cdi)"),
]


@pytest.mark.parametrize(("value", "mode", "line"), MODE_REFUSALS, ids=[f"{m}-{v.split('=')[0]}"
                                                                        for v, m, _ in MODE_REFUSALS])
def test_a_value_of_the_other_mode_stops_the_rendering_naming_it(helm: Path, value: str, mode: str,
                                                                 line: str) -> None:
    assert _refusal(helm, (f"mode={mode}", value)) == line
    other = "device-plugin" if mode == "dra" else "dra"
    assert helm_template(helm, sets=(f"mode={other}", value)), f"mode: {other} refused {value}"


def test_dra_mode_needs_api_access_and_kubernetes_1_34(helm: Path) -> None:
    assert _refusal(helm, ("mode=dra", "clusterReporting.enabled=false")) == (
        "clusterReporting.enabled: false takes the plugin's API access away, which mode: dra needs (it publishes a "
        "ResourceSlice and reads the claims it prepares)")
    assert _refusal(helm, ("mode=dra",), kube_version="1.33.0") == (
        'mode: dra needs Kubernetes >= 1.34 (resource.k8s.io/v1), this cluster is v1.33.0 (docs/dra.md, "Gates per '
        'Kubernetes version")')
    # device-plugin mode keeps the chart's own floor.
    assert helm_template(helm, kube_version="1.30.0")


@pytest.mark.parametrize("mode", ["device-plugin", "dra"])
@pytest.mark.parametrize("arg", ["--mode=dra", "--mode", "--dra-plugin-dir=/x", "--cdi-spec-dir=/x",
                                 "--nvsentinel-socket=/x/s.sock", "--device-api-socket=/x/d.sock",
                                 "--kernel-log=/dev/kmsg"])
def test_extra_args_cannot_move_what_the_chart_mounts_and_grants(helm: Path, mode: str, arg: str) -> None:
    flag = arg.split("=")[0]
    assert _refusal(helm, (f"mode={mode}", f"extraArgs[0]={arg}")) == (
        f"extraArgs: {flag} is set by the chart (mode, hostPaths, nvsentinel, deviceApi, kernelLog), not by "
        "extraArgs")


@pytest.mark.parametrize("pair", sorted(DRA_PAIRS))
def test_dra_rendering_runs_the_plugin_in_dra_mode_on_the_mounted_paths(
        renders: dict[str, tuple[list[Obj], list[Obj]]], pair: str, tmp_path: Path) -> None:
    chart = renders[pair][1]
    cfg, _ = _plugin_config(chart, tmp_path)
    assert cfg.mode == "dra"
    values = yaml.safe_load((LOCAL_DRA_VALUES if pair == "local-cluster-dra" else CHART / "values.yaml").read_text())
    ds = find(chart, "DaemonSet", NAME)
    host = {v["name"]: v["hostPath"]["path"] for v in ds["spec"]["template"]["spec"]["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in ds["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    # The plugin registers, serves and writes where the kubelet and the runtime look: the host's path, mounted at
    # the same path. With values.yaml's paths no flag is passed, so they must be the plugin's own defaults.
    for volume, key, path in (("dra-plugin", "draPlugin", cfg.dra_plugin_dir),
                              ("plugins-registry", "pluginsRegistry", cfg.dra_registry_dir),
                              ("cdi", "cdiSpecs", cfg.cdi_spec_dir)):
        assert mounts[volume] == host[volume] == str(path) == values["hostPaths"][key], volume
    # The DeviceClass selects the whole GPUs of the driver the plugin publishes its slice for.
    assert find(chart, "DeviceClass", DRIVER)["spec"]["selectors"] == [{"cel": {"expression": GPU_SELECTOR}}]


def test_dra_mode_takes_mig_strategy_mixed_and_the_plugin_loads_it(helm: Path, tmp_path: Path) -> None:
    # mixed publishes each MIG instance as a device of its own, which the mig classes select.
    cfg, _ = _plugin_config(helm_template(helm, sets=("mode=dra", "migStrategy=mixed")), tmp_path)
    assert (cfg.mode, cfg.mig_strategy) == ("dra", "mixed")


@pytest.mark.parametrize("prefix", [None, "example.com"], ids=["default-prefix", "own-prefix"])
def test_dra_pod_status_grant_and_policy_follow_the_plugins_prefix(helm: Path, prefix: str | None,
                                                                   tmp_path: Path) -> None:
    # The pods/status grant ships with the policy confining it to the one condition type the plugin writes, whose
    # prefix is the plugin's --annotation-prefix: both come from plugin.annotationPrefix.
    sets = "mode=dra" + (f",plugin.annotationPrefix={prefix}" if prefix else "")
    objs = helm_template(helm, sets=(sets,))
    cfg, _ = _plugin_config(objs, tmp_path)
    assert cfg.annotation_prefix == (prefix or "gpu-health.io")
    assert {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]} in \
        find(objs, "ClusterRole", f"{NAME}-dra")["rules"]
    policy = find(objs, "ValidatingAdmissionPolicy", f"{RELEASE}-own-node-pod-status")["spec"]
    condition_type = {v["name"]: v["expression"] for v in policy["variables"]}["conditionType"]
    assert condition_type == f"'{PodConditionSettings(taint_prefix=cfg.annotation_prefix).condition_type}'"
    binding = find(objs, "ValidatingAdmissionPolicyBinding", f"{RELEASE}-own-node-pod-status")["spec"]
    assert binding["policyName"] == f"{RELEASE}-own-node-pod-status"


# helm lint ------------------------------------------------------------------------------------------------------

def _lint_clean(out: subprocess.CompletedProcess[str]) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "0 chart(s) failed" in text, text
    noisy = [line for line in text.splitlines() if "[WARNING]" in line or "[ERROR]" in line]
    assert not noisy, "\n".join(noisy)


def test_helm_lint_is_clean(helm: Path) -> None:
    _lint_clean(helm_run(helm, "lint", str(CHART.relative_to(REPO))))


@pytest.mark.parametrize("everything", [ALL_ON[0], DRA_ALL_ON[0]], ids=["device-plugin", "dra"])
def test_helm_lint_strict_with_everything_on(helm: Path, everything: str) -> None:
    _lint_clean(helm_run(helm, "lint", "--strict", str(CHART.relative_to(REPO)), "--set", everything))


# The config file ------------------------------------------------------------------------------------------------

def test_default_config_file_loads_as_the_plugins_defaults(helm: Path, tmp_path: Path) -> None:
    cfg, _ = _plugin_config(helm_template(helm), tmp_path)
    assert cfg.mig_strategy == "none"
    assert cfg.fail_on_init_error is True
    assert (cfg.backend, cfg.log_format, cfg.log_level, cfg.poll_interval) == ("nvml", "json", "info", 5.0)
    assert cfg.sharing.resources == ()
    assert cfg.health == type(cfg.health)()


def test_health_and_sharing_values_reach_the_plugin(helm: Path, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "migStrategy": "mixed",
        "failOnInitError": False,
        "health": {"xid": {"ignored": [43]}, "kubeletHealth": {"Degraded": "Unhealthy"}},
        "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}},
    }))
    cfg, _ = _plugin_config(helm_template(helm, [values]), tmp_path)
    assert cfg.mig_strategy == "mixed"
    assert cfg.fail_on_init_error is False
    assert 43 in cfg.health.ignored_xids
    assert cfg.health.kubelet_health[State.DEGRADED] == KubeletHealth.UNHEALTHY
    assert [(r.name, r.replicas) for r in cfg.sharing.resources] == [("nvidia.com/gpu", 4)]


def test_sharing_and_mixed_mig_in_dra_mode_reach_the_plugin_which_takes_them(helm: Path, tmp_path: Path) -> None:
    """mode: dra shares GPUs in place (docs/dra.md, "Shared GPUs"): the chart passes the section on and the
    plugin, loading the rendered config as the container does, accepts it in DRA mode."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "mode": "dra", "migStrategy": "mixed",
        "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4, "devices": [0, 1]},
                                                  {"name": "nvidia.com/mig-1g.10gb", "replicas": 2}]}},
    }))
    cfg, _ = _plugin_config(helm_template(helm, [values]), tmp_path)
    assert (cfg.mode, cfg.mig_strategy) == ("dra", "mixed")
    assert [(r.name, r.replicas) for r in cfg.sharing.resources] == [("nvidia.com/gpu", 4),
                                                                      ("nvidia.com/mig-1g.10gb", 2)]


def test_bad_health_value_is_refused(helm: Path, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"health": {"clearAfterPolls": 0}}))
    if (CHART / "values.schema.json").exists():
        # The schema stops it before anything is applied, naming the value.
        out = helm_run(helm, *template_args([values]))
        assert out.returncode != 0
        assert re.search(r"health\W+clearAfterPolls", out.stderr), out.stderr
        out = helm_run(helm, *template_args([values]), "--skip-schema-validation")
        assert out.returncode == 0, out.stderr
        objs = [d for d in yaml.safe_load_all(out.stdout) if d]
    else:
        objs = helm_template(helm, [values])
    # Past the schema (or without one), the plugin's loader refuses the rendered file, naming the field.
    with pytest.raises(FieldError) as exc:
        _plugin_config(objs, tmp_path)
    assert exc.value.field == "health.clearAfterPolls"


# The node condition: EKS node repair (docs/remediation.md) --------------------------------------------------------

EKS_VALUES = REPO / "docs" / "recipes" / "eks-node-repair-values.yaml"


def test_eks_node_repair_values_reach_the_plugin_and_the_policy(helm: Path, tmp_path: Path) -> None:
    objs = helm_template(helm, [EKS_VALUES])
    cfg, _ = _plugin_config(objs, tmp_path)
    assert (cfg.node_condition, cfg.node_condition_type, cfg.node_condition_reasons) == \
        (True, "AcceleratedHardwareReady", "eks")
    # The admission policy lets the plugin write that condition, and only it.
    assert policy_condition_type(objs) == "AcceleratedHardwareReady"
    assert any(r["resources"] == ["nodes/status"] for r in find(objs, "ClusterRole", NAME)["rules"])
    problems, _ = strict_problems((("eks", o) for o in objs), KUBE_VERSIONS[-1])
    assert not problems, problems


@pytest.mark.parametrize(("value", "says"), [
    ("nodeCondition.type=Ready", "/nodeCondition/type"),
    ("nodeCondition.type=has space", "/nodeCondition/type"),
    ("nodeCondition.reasons=aws", "/nodeCondition/reasons"),
])
def test_bad_node_condition_values_are_refused_by_the_schema(helm: Path, value: str, says: str) -> None:
    out = helm_run(helm, *template_args(sets=("nodeCondition.enabled=true", value)))
    assert out.returncode != 0 and says in out.stderr, out.stderr


# values.yaml documents every value ------------------------------------------------------------------------------

# Kubernetes objects, documented as a whole by the comment above their key.
WHOLE = {"affinity", "tolerations", "securityContext", "podSecurityContext", "resources", "updateStrategy",
         "controller.affinity", "controller.tolerations", "controller.resources"}
# Keys that share the comment above the sibling on the line before them.
SHARED_COMMENT = {
    "podLabels": "podAnnotations",
    "extraVolumeMounts": "extraVolumes",
    "controller.podLabels": "controller.podAnnotations",
    "controller.config.leaderElection.renewDeadline": "controller.config.leaderElection.leaseDuration",
    "controller.config.leaderElection.retryPeriod": "controller.config.leaderElection.renewDeadline",
}
_KEY = re.compile(r"^( *)([A-Za-z0-9_.-]+):(.*)$")


def _in_scope(path: tuple[str, ...]) -> bool:
    if any(".".join(path[:i]) in WHOLE for i in range(1, len(path))):
        return False
    # Top-level keys, the keys under them, and controller.config's sections and their keys.
    return len(path) <= 2 or (path[:2] == ("controller", "config") and len(path) <= 4)


def _comment_at(line: str, indent: int) -> bool:
    return line.startswith(" " * indent + "#")


def undocumented_values(text: str) -> list[str]:
    """The keys in scope without a `#` line at their indent directly above them (or above the sibling whose comment
    they share, SHARED_COMMENT). A mapping whose own keys are in scope may instead open with that comment: its
    keys' comments say what the mapping is (cdi: / # Allocate also returns CDI ... / enabled: false)."""
    lines = text.splitlines()
    stack: list[tuple[int, str]] = []
    paths: dict[int, str] = {}
    missing = []
    for i, line in enumerate(lines):
        m = _KEY.match(line)
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        path = tuple(n for _, n in stack)
        paths[i] = ".".join(path)
        if not _in_scope(path):
            continue
        above = lines[i - 1] if i else ""
        if _comment_at(above, indent) and not _comment_at(above, indent + 1):
            continue
        shares = SHARED_COMMENT.get(paths[i])
        if shares is not None and paths.get(i - 1) == shares:
            continue
        below = lines[i + 1] if i + 1 < len(lines) else ""
        opens = not m.group(3).strip() and re.match(r" +#", below) and len(below) - len(below.lstrip()) > indent
        if opens and _in_scope((*path, "")):
            continue
        missing.append(f"values.yaml:{i + 1}: {paths[i]}")
    return missing


def test_every_value_is_documented() -> None:
    missing = undocumented_values((CHART / "values.yaml").read_text())
    assert not missing, "values without a comment line directly above:\n" + "\n".join(missing)


def test_documentation_check_finds_an_undocumented_value() -> None:
    text = (CHART / "values.yaml").read_text().replace("# Seconds the plugin gets to stop after SIGTERM.\n", "")
    line = text.splitlines().index("terminationGracePeriodSeconds: 15") + 1
    assert undocumented_values(text) == [f"values.yaml:{line}: terminationGracePeriodSeconds"]
    # A mapping documented by the comment that opens it loses that with the comment.
    lines = (CHART / "values.yaml").read_text().splitlines()
    cdi = lines.index("cdi:")
    assert lines[cdi + 1].startswith("  # ")
    opening = cdi + 1
    while lines[opening].startswith("  # "):
        opening += 1
    text = "\n".join(lines[:cdi + 1] + lines[opening:])
    assert undocumented_values(text) == [f"values.yaml:{cdi + 1}: cdi", f"values.yaml:{cdi + 2}: cdi.enabled"]


# Versions -------------------------------------------------------------------------------------------------------

def test_chart_is_versioned_with_the_package() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == VERSION
    assert chart["appVersion"] == VERSION
    base = yaml.safe_load((MANIFESTS / "base" / "kustomization.yaml").read_text())
    assert [i["newTag"] for i in base["images"] if i["name"] == NAME] == [VERSION]
