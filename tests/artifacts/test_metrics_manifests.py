"""The Grafana dashboard and the PrometheusRule in manifests/ only name metrics the plugin really exports: each name
they use is checked against a scrape of the real collector with every source switched on."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from plugin.devices.model import GpuEvent
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.kubelet.allocation import AllocationConfig
from plugin.kubelet.resources import WholeGpus
from plugin.kubelet.supervisor import Supervisor
from plugin.outlets.correlation import CorrelationStats
from plugin.outlets.metrics import Sources, build_registry
from plugin.outlets.reporter import ReporterStatus
from tests.fakes import nvml_standin
from tests.unit.test_metrics_dra import idle_dra_mode

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "manifests" / "alerts" / "prometheusrule.yaml"
DASHBOARD = REPO / "manifests" / "dashboards" / "gpu-health-device-plugin.json"
METRIC = re.compile(r"\b((?:gpu_health|process)_[a-z0-9_]+)\b")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    tmp = tmp_path_factory.mktemp("m")
    backend, _ = nvml_standin.open_backend(tmp / "nvml", uuid_prefix="GPU-fake-")
    state = NodeState()
    monitor = Monitor(backend, state, HealthConfig(), 5.0, threading.Event())
    sup = Supervisor(tmp / "dp", [WholeGpus()], state, AllocationConfig(dev_root=tmp), threading.Event())
    dra = idle_dra_mode(state, tmp)  # DRA mode's series too: the App runs one mode, the manifests serve both
    registry = build_registry(Sources(state, monitor, backend, sup, annotations=lambda: ReporterStatus(node="n"),
                                      correlation=CorrelationStats, slice_writer=dra.slice_writer.status,
                                      pod_conditions=dra.pod_conditions.status if dra.pod_conditions else None,
                                      claims=dra.driver, health_streams=dra.server))
    # Labelled counters have no series until something happened: make a transition and an XID happen.
    monitor.poll_once()
    monitor.handle_events([GpuEvent("GPU-fake-0", "xid", 79, 0.0)])
    names = set()
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        names.update(s.name for s in fam.samples)
    backend.close()
    return names


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    assert doc["kind"] == "PrometheusRule" and doc["apiVersion"] == "monitoring.coreos.com/v1"
    return [r for g in doc["spec"]["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]] + [
        v["definition"] for v in dash["templating"]["list"] if "definition" in v]


def test_the_required_alerts_exist_and_are_complete() -> None:
    by_name = {r["alert"]: r for r in rules()}
    for required in ("GPUHealthDeviceUnhealthy", "GPUHealthPluginNotRegistered", "GPUHealthAnnotationWritesFailing"):
        assert required in by_name
    for r in by_name.values():
        assert r["labels"]["severity"] in ("critical", "warning", "info"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_metric_named_is_exported(exported: set[str], source: str) -> None:
    exprs = [r["expr"] for r in rules()] if source == "alerts" else dashboard_exprs()
    used = {m for e in exprs for m in METRIC.findall(e)}
    assert used, "no metric names found: the pattern is broken"
    missing = sorted(used - exported)
    assert not missing, f"{source} name metrics the plugin does not export: {missing}"


def test_dashboard_is_importable() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    ids = [p["id"] for p in dash["panels"]]
    assert ids and len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all(t["refId"] for t in p["targets"])


# Runbooks and labels -------------------------------------------------------------------------------------------

TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"
CHART_RULES = REPO / "charts" / "gpu-health-device-plugin" / "files" / "prometheusrule-spec.yaml"
CHART_METRICS = REPO / "charts" / "gpu-health-device-plugin" / "templates" / "metrics.yaml"
RUNBOOK = "docs/troubleshooting.md#"


def heading_anchors(markdown: str) -> set[str]:
    """The anchors a Markdown renderer gives the headings: lower case, punctuation dropped, spaces as hyphens."""
    anchors = set()
    for line in markdown.splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def test_heading_anchors_follow_the_renderers_rule() -> None:
    assert heading_anchors("# Title\n## The plugin does not register with the kubelet\n### `code`, and: more\n") == {
        "title", "the-plugin-does-not-register-with-the-kubelet", "code-and-more"}


def chart_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(CHART_RULES.read_text())["groups"] for r in g["rules"]]


@pytest.mark.parametrize("source", ["manifests", "chart"])
def test_every_alert_links_its_runbook_section(source: str) -> None:
    anchors = heading_anchors(TROUBLESHOOTING.read_text())
    alerts = rules() if source == "manifests" else chart_rules()
    assert len(alerts) >= 3
    for r in alerts:
        url = r["annotations"].get("runbook_url", "")
        assert url == RUNBOOK + r["alert"].lower(), f"{r['alert']}: runbook_url {url!r}"
        assert url.removeprefix(RUNBOOK) in anchors, f"{r['alert']}: no section {url} in docs/troubleshooting.md"


def test_the_chart_renders_the_same_alerts() -> None:
    # The helm-rendered comparison in test_chart.py needs a helm binary; this one holds the two files equal anywhere.
    assert yaml.safe_load(CHART_RULES.read_text()) == yaml.safe_load(RULES.read_text())["spec"]


def test_alerts_name_the_node_by_the_label_the_service_monitor_sets() -> None:
    # The scrape target's instance is a pod address, which tells an operator nothing about where to look.
    template = CHART_METRICS.read_text()
    assert re.search(r"sourceLabels: \[__meta_kubernetes_pod_node_name\]\s*\n\s*targetLabel: node\b", template)
    for r in rules():
        for key in ("summary", "description"):
            assert "instance" not in r["annotations"][key], f"{r['alert']} {key} names the instance"
    node_scoped = [r for r in rules() if "{{ $labels.node }}" in r["annotations"]["summary"]]
    assert len(node_scoped) == len(rules()), "every summary says which node"


def test_troubleshooting_links_to_its_own_sections_resolve() -> None:
    text = TROUBLESHOOTING.read_text()
    anchors = heading_anchors(text)
    local = re.findall(r"\]\(#([^)]+)\)", text)
    assert local, "the runbook links between its sections"
    assert sorted(set(local) - anchors) == []
    for doc, anchor in re.findall(r"\]\(([a-z0-9-]+\.md)#([^)]+)\)", text):
        assert anchor in heading_anchors((REPO / "docs" / doc).read_text()), f"{doc}#{anchor}"
    for doc in set(re.findall(r"\]\(([a-z0-9-]+\.md)[#)]", text)):
        assert (REPO / "docs" / doc).is_file(), doc
