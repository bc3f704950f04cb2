"""Every rendering of the plugin's DaemonSet tolerates the fleet controller's quarantine taint (issue 34).

The controller taints a node it takes out of service ``<prefix>/quarantine=<reason>`` with effect NoSchedule, and
later NoExecute (``--no-execute-after``). A plugin pod that does not tolerate it is never put back on that node once
it is replaced (a rollout of a new version, a pod deleted, an eviction), and with the NoExecute taint the taint
manager evicts it: the node's GPUs vanish from allocatable, its annotations go stale, and it is never released. So
every kustomize overlay that holds the DaemonSet (found on disk, so that a new overlay is checked too) and the chart
in each mode and feature set must tolerate both effects, for good (no ``tolerationSeconds``), whatever the taint's
value (the reason) is.

The key has one source: the controller's default prefix (``ControllerConfig.annotation_prefix``, through
``Keys.taint``, the function the controller taints with). The manifests tolerate that key, and the chart derives its
toleration, its admission policy's prefix and the controller's prefix from one value (``plugin.annotationPrefix``),
so a release with another prefix tolerates the taint its own controller writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugin.config.options import Config as PluginConfig
from plugin.controller.config import ControllerConfig
from plugin.controller.nodes import Keys
from plugin.controller.patches import NO_EXECUTE, NO_SCHEDULE
from tests.artifacts.test_chart import DRA_RENDERINGS, RENDERINGS, helm, helm_run, helm_template, template_args
from tests.artifacts.test_manifests import kubectl, render

__all__ = ["helm", "kubectl"]  # the fixtures, imported for this module's tests

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
PLUGIN = "gpu-health-device-plugin"
EFFECTS = (NO_SCHEDULE, NO_EXECUTE)
# The key the controller taints with, from its own default config: the one place it comes from.
TAINT_KEY = Keys(ControllerConfig().annotation_prefix).taint
# The reasons the taint's value takes; a toleration of one value (operator Equal) would cover only that reason.
TAINT_VALUES = ("reboot-required", "unhealthy-devices", "capacity-gap")

Obj = dict[str, Any]


def _covers(t: Mapping[str, Any], key: str, value: str, effect: str) -> bool:
    """Whether toleration ``t`` keeps a pod on (and lets it onto) a node tainted ``key=value:effect`` for good, by
    the scheduler's and the taint manager's rules (an empty key with Exists tolerates every taint; an empty effect
    every effect; a NoExecute toleration with tolerationSeconds evicts the pod once they run out)."""
    operator = t.get("operator") or "Equal"
    if t.get("key") not in (None, "", key) or (not t.get("key") and operator != "Exists"):
        return False
    if t.get("effect") not in (None, "", effect):
        return False
    if operator == "Equal" and t.get("value", "") != value:
        return False
    if operator not in ("Equal", "Exists"):
        return False
    return not (effect == NO_EXECUTE and t.get("tolerationSeconds") is not None)


def missing_effects(tolerations: Iterable[Mapping[str, Any]] | None, key: str = TAINT_KEY) -> list[str]:
    """The effects of the quarantine taint (under any reason) that ``tolerations`` do not tolerate for good."""
    ts = list(tolerations or [])
    return [e for e in EFFECTS if not all(any(_covers(t, key, v, e) for t in ts) for v in TAINT_VALUES)]


def plugin_daemonsets(objs: Iterable[Obj]) -> list[Obj]:
    return [o for o in objs if o.get("kind") == "DaemonSet" and o["metadata"]["name"] == PLUGIN]


def _tolerations(ds: Obj) -> list[Mapping[str, Any]]:
    return list(ds["spec"]["template"]["spec"].get("tolerations") or [])


# The checker itself ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("tolerations", "missing"), [
    ([{"key": TAINT_KEY, "operator": "Exists"}], []),
    ([{"operator": "Exists"}], []),  # tolerates everything
    ([{"key": TAINT_KEY, "operator": "Exists", "effect": NO_SCHEDULE},
      {"key": TAINT_KEY, "operator": "Exists", "effect": NO_EXECUTE}], []),
    ([], [NO_SCHEDULE, NO_EXECUTE]),
    ([{"key": "nvidia.com/gpu", "operator": "Exists"}], [NO_SCHEDULE, NO_EXECUTE]),
    ([{"key": TAINT_KEY, "operator": "Exists", "effect": NO_SCHEDULE}], [NO_EXECUTE]),
    ([{"key": TAINT_KEY, "operator": "Exists", "tolerationSeconds": 300}], [NO_EXECUTE]),
    # One reason only: a node quarantined for another is not tolerated.
    ([{"key": TAINT_KEY, "operator": "Equal", "value": "reboot-required"}], [NO_SCHEDULE, NO_EXECUTE]),
    ([{"key": "", "operator": "Equal"}], [NO_SCHEDULE, NO_EXECUTE]),
    ([{"key": "other.io/quarantine", "operator": "Exists"}], [NO_SCHEDULE, NO_EXECUTE]),
])
def test_the_check_tells_a_toleration_that_covers_both_effects(tolerations: list[Obj], missing: list[str]) -> None:
    assert missing_effects(tolerations) == missing


# One source for the key -----------------------------------------------------------------------------------------

def test_the_taint_key_is_the_one_the_controller_and_the_plugin_default_to() -> None:
    assert TAINT_KEY == "gpu-health.io/quarantine"
    assert PluginConfig().annotation_prefix == ControllerConfig().annotation_prefix


def test_the_controller_component_keeps_the_default_prefix(kubectl: Path) -> None:
    """The kustomize manifests cannot follow a changed prefix: the controller they deploy must taint with the key
    the DaemonSet tolerates, so its config file leaves the prefix at its default."""
    objs = render(kubectl, MANIFESTS / "overlays" / "controller")
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "gpu-health-controller-config")
    doc = yaml.safe_load(cm["data"]["config.yaml"])
    assert doc.get("annotationPrefix", ControllerConfig().annotation_prefix) == ControllerConfig().annotation_prefix
    args = [a for o in objs if o["kind"] == "Deployment" for c in o["spec"]["template"]["spec"]["containers"]
            for a in [*c.get("args", []), *c.get("command", [])]]
    assert not [a for a in args if a.startswith("--annotation-prefix")]


# Kustomize ------------------------------------------------------------------------------------------------------

def _kustomizations() -> list[Path]:
    """manifests/base and every overlay on disk (a new one is checked without being listed here)."""
    overlays = sorted(p for p in (MANIFESTS / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
    return [MANIFESTS / "base", *overlays]


@pytest.fixture(scope="module")
def kustomize_renders(kubectl: Path) -> dict[str, list[Obj]]:
    return {str(p.relative_to(MANIFESTS)): render(kubectl, p) for p in _kustomizations()}


def test_every_kustomize_rendering_of_the_daemonset_tolerates_the_quarantine(
        kustomize_renders: dict[str, list[Obj]]) -> None:
    lacking: list[str] = []
    checked = 0
    for where, objs in kustomize_renders.items():
        for ds in plugin_daemonsets(objs):
            checked += 1
            if missing := missing_effects(_tolerations(ds)):
                lacking.append(f"{where}: no toleration of {TAINT_KEY} for {', '.join(missing)} "
                               f"(tolerations: {_tolerations(ds)})")
    # base and nearly every overlay hold the DaemonSet; an overlay without it is not a plugin rendering.
    assert checked >= len(kustomize_renders) - 2, f"only {checked} of {len(kustomize_renders)} renderings hold it"
    assert not lacking, "\n".join(lacking)


# The chart ------------------------------------------------------------------------------------------------------

CHART_RENDERINGS: dict[str, tuple[Any, Any, str]] = {
    **{k: (files, sets, "1.37.0") for k, (files, sets) in RENDERINGS.items()},
    **{k: (files, sets, "1.37.0") for k, (files, sets) in DRA_RENDERINGS.items()},
    # The user's own tolerations replace the list in values.yaml; the quarantine's is not theirs to lose.
    "own-tolerations": ((), ("tolerations[0].key=example.com/dedicated,tolerations[0].operator=Exists",), "1.37.0"),
    "no-tolerations": ((), ("tolerations=null",), "1.37.0"),
    "dra-no-tolerations": ((), ("mode=dra,tolerations=null",), "1.37.0"),
    "oldest-kubernetes": ((), (), "1.30.0"),
}


@pytest.mark.parametrize("rendering", sorted(CHART_RENDERINGS))
def test_every_chart_rendering_of_the_daemonset_tolerates_the_quarantine(helm: Path, rendering: str) -> None:
    files, sets, version = CHART_RENDERINGS[rendering]
    [ds] = plugin_daemonsets(helm_template(helm, files, sets, kube_version=version))
    assert not missing_effects(_tolerations(ds)), _tolerations(ds)


def test_the_chart_keeps_the_users_tolerations_beside_the_quarantines(helm: Path) -> None:
    [ds] = plugin_daemonsets(helm_template(
        helm, sets=("tolerations[0].key=example.com/dedicated,tolerations[0].operator=Exists",)))
    assert {"key": "example.com/dedicated", "operator": "Exists"} in _tolerations(ds)


def _controller_prefix(objs: list[Obj]) -> str:
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "gpu-health-controller-config")
    return str(yaml.safe_load(cm["data"]["config.yaml"]).get("annotationPrefix",
                                                              ControllerConfig().annotation_prefix))


def test_a_chart_with_another_prefix_tolerates_the_taint_its_controller_writes(helm: Path) -> None:
    objs = helm_template(helm, sets=("plugin.annotationPrefix=example.com,controller.enabled=true",))
    [ds] = plugin_daemonsets(objs)
    key = Keys(_controller_prefix(objs)).taint
    assert key == "example.com/quarantine"
    assert not missing_effects(_tolerations(ds), key), _tolerations(ds)
    # The admission policy lets the plugin write under the same prefix (and still not under the controller's).
    vap = next(o for o in objs if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"].endswith(
        "-own-node-only"))
    prefix = next(v["expression"] for v in vap["spec"]["variables"] if v["name"] == "prefix")
    assert prefix == "'example.com/'"


def test_the_charts_default_prefix_is_the_controllers(helm: Path) -> None:
    objs = helm_template(helm, sets=("controller.enabled=true",))
    assert _controller_prefix(objs) == ControllerConfig().annotation_prefix
    [ds] = plugin_daemonsets(objs)
    assert not missing_effects(_tolerations(ds), Keys(_controller_prefix(objs)).taint)


@pytest.mark.parametrize(("values", "names"), [
    ("extraArgs[0]=--annotation-prefix=example.com", "extraArgs: --annotation-prefix"),
    ("controller.enabled=true,controller.extraArgs[0]=--annotation-prefix=example.com",
     "controller.extraArgs: --annotation-prefix"),
])
def test_the_prefix_cannot_be_moved_around_the_one_value(helm: Path, values: str, names: str) -> None:
    """A prefix given as a flag would split the plugin's, the controller's and the toleration's keys."""
    out = helm_run(helm, *template_args(sets=(values,)))
    assert out.returncode != 0
    assert names in out.stderr and "plugin.annotationPrefix" in out.stderr, out.stderr
