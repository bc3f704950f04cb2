"""The chart's values.schema.json (built by scripts/gen_chart_schema.py, written and checked current by
scripts/gen_docs.py and tests/docs/test_gen_docs.py): it accepts
the shipped values.yaml and exactly its keys, agrees with the config parsers on good and bad values, and helm
refuses a bad value naming its path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugin.config import options as plugin_options
from plugin.controller import config as ctl
from plugin.health.config import HealthConfig, parse_health
from plugin.sharing.config import parse_sharing
from plugin.validation import FieldError
from scripts import file_keys, gen_chart_schema, gen_docs
from scripts import helm as helm_build
from tests.conformance.skips import build_or_skip

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "gpu-health-device-plugin"
SCHEMA_ERROR = "values don't meet the specifications of the schema"


def _schema() -> dict[str, Any]:
    return dict(json.loads((CHART / "values.schema.json").read_text()))


def _values() -> dict[str, Any]:
    return dict(yaml.safe_load((CHART / "values.yaml").read_text()))


# Generated and current ---------------------------------------------------------------------------------------------

def test_a_values_key_without_a_schema_stops_the_generator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    values = _values()
    values["hostPaths"]["kubeletRoot"] = "/var/lib/kubelet"
    del values["minReadySeconds"]
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    monkeypatch.setattr(gen_chart_schema, "VALUES_YAML", path)
    monkeypatch.setattr(gen_chart_schema, "SCHEMA_JSON", tmp_path / "values.schema.json")
    # Through the generator users run: one line naming each key, exit 2, nothing written.
    assert gen_docs.main([]) == 2
    err = capsys.readouterr().err
    assert "hostPaths.kubeletRoot: in values.yaml but not in" in err
    assert "minReadySeconds: in scripts/gen_chart_schema.py's table but not in values.yaml" in err
    assert not (tmp_path / "values.schema.json").exists()


def test_a_key_type_without_a_schema_stops_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    odd = file_keys.Key("health.flap.jitter", "percentage", "new", None)
    monkeypatch.setattr(file_keys, "HEALTH_KEYS", (*file_keys.HEALTH_KEYS, odd))
    with pytest.raises(gen_chart_schema.SchemaError, match=r"health\.flap\.jitter: no schema for the type"):
        gen_chart_schema.render()


# The schema against values.yaml and the documented keys -------------------------------------------------------------

def _validator(schema: dict[str, Any]) -> Any:
    # Installed with kubernetes-validate, a test dependency; helm below checks the same schema without it.
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _errors(schema: dict[str, Any], doc: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator(schema).iter_errors(doc)]


def test_values_yaml_as_shipped_validates() -> None:
    schema = _schema()
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert "scripts/gen_chart_schema.py" in schema["description"]
    assert _errors(schema, _values()) == []


def _free_form(s: dict[str, Any]) -> bool:
    return "properties" not in s and s.get("additionalProperties") is not False


def _schema_leaves(s: dict[str, Any], prefix: str) -> Iterator[str]:
    """Dotted paths of the leaves below a generated section (list entries as `[]`, as gen_docs writes them)."""
    for key, sub in s.get("properties", {}).items():
        path = f"{prefix}.{key}"
        if "properties" in sub:
            yield from _schema_leaves(sub, path)
        elif "properties" in sub.get("items", {}):
            yield path
            yield from _schema_leaves(sub["items"], path + "[]")
        else:
            yield path


def test_every_values_key_is_in_the_schema_and_every_schema_key_is_in_values_or_documented() -> None:
    schema, values = _schema(), _values()
    generated = {"plugin", "health", "sharing", "controller.config"}
    missing: list[str] = []
    unset: list[str] = []

    def walk(s: dict[str, Any], v: dict[str, Any], path: str) -> None:
        props = s.get("properties", {})
        for key, value in v.items():
            at = f"{path}.{key}".lstrip(".")
            if key not in props:
                missing.append(at)
            elif isinstance(value, dict) and not _free_form(props[key]):
                walk(props[key], value, at)
        if not any(path == g or path.startswith(g + ".") for g in generated):
            unset.extend(f"{path}.{k}".lstrip(".") for k in props if k not in v and not (path == "" and k == "global"))

    walk(schema, values, "")
    assert missing == [], "keys of values.yaml the schema does not have"
    assert unset == [], "keys of the schema that values.yaml does not set and no option table documents"
    props = schema["properties"]
    # The generated sections are exactly the documented keys, no more and no fewer.
    assert set(props["plugin"]["properties"]) == {o.leaf for o in plugin_options.OPTIONS} - gen_chart_schema.CHART_OWNED
    assert set(_schema_leaves(props["health"], "health")) == {k.path for k in gen_docs.HEALTH_KEYS}
    assert set(_schema_leaves(props["sharing"], "sharing")) == {k.path for k in gen_docs.SHARING_KEYS}
    config = props["controller"]["properties"]["config"]
    assert set(_schema_leaves(config, "")) == {"." + k for k in ctl.FILE_KEYS if "." in k}
    # Helm puts global into a dependency's values: the chart must take it.
    assert _free_form(props["global"])


def test_closed_objects_and_typed_switches() -> None:
    def walk(s: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
        yield path, s
        for key, sub in s.get("properties", {}).items():
            yield from walk(sub, f"{path}/{key}")
        if isinstance(s.get("items"), dict):
            yield from walk(s["items"], f"{path}/[]")

    nodes = dict(walk(_schema(), ""))
    enabled = [p for p in nodes if p.endswith("/enabled")]
    assert {"/cdi/enabled", "/controller/enabled", "/controller/config/drain/enabled"} <= set(enabled)
    for p in enabled:
        assert nodes[p]["type"] == "boolean", p
        parent = nodes[p.rsplit("/", 1)[0]]
        assert parent["additionalProperties"] is False, p
    for p, s in nodes.items():
        if p and p != "/global":
            # An array's description covers its items, unless they are entries with keys of their own.
            assert s.get("description") or (p.endswith("/[]") and "properties" not in s), p


def _health_defaults() -> dict[str, Any]:
    doc: dict[str, Any] = {}
    h = HealthConfig()
    for k in gen_docs.HEALTH_KEYS:
        *parents, leaf = k.path.split(".")[1:]
        node = doc
        for p in parents:
            node = node.setdefault(p, {})
        assert callable(k.default)
        node[leaf] = yaml.safe_load(gen_docs._fmt(k.default(h)))
    return doc


def test_the_documented_defaults_validate() -> None:
    props = _schema()["properties"]
    plugin_doc = {k: v for k, v in yaml.safe_load(gen_docs.example_file())["plugin"].items()
                  if k not in gen_chart_schema.CHART_OWNED}
    assert _errors(props["plugin"], plugin_doc) == []
    health_doc = _health_defaults()
    assert parse_health(health_doc) == parse_health(None)
    assert _errors(props["health"], health_doc) == []
    fleet = yaml.safe_load(gen_docs.fleet_example_file())
    config_doc = {s: fleet[s] for s in ctl.SECTIONS}
    assert _errors(props["controller"]["properties"]["config"], config_doc) == []


def _parse_controller(doc: dict[str, Any]) -> None:
    for section, keys in doc.items():
        for key, value in keys.items():
            ctl.FILE_KEYS[f"{section}.{key}"].parse(value)


def _parse_plugin(doc: dict[str, Any]) -> None:
    by_key = {o.leaf: o for o in plugin_options.OPTIONS}
    for key, value in doc.items():
        by_key[key].parse(value)


PARSERS: dict[str, Any] = {"health": parse_health, "sharing": parse_sharing, "plugin": _parse_plugin,
                           "controller": _parse_controller}
GOOD = [
    ("plugin", {"correlateOn": "Degraded, Unhealthy", "pollInterval": 0.5, "annotationMaxBytes": 1024}),
    ("plugin", {"correlateOn": ["Unknown"], "logLevel": "debug", "devRoot": "/host"}),
    ("plugin", {"correlateOn": "none"}),
    ("health", {"xid": {"ignored": [43]}, "overrides": {"thermal-slowdown": "ignore", "xid-13": "Degraded"},
                "latchHoldSeconds": {"Unhealthy": None, "Degraded": 60}, "kubeletHealth": {"Degraded": "Unhealthy"},
                "thresholds": {"eccCorrectedLimit": None, "eccCorrectedRatePerMinute": 2.5}}),
    ("sharing", {"timeSlicing": {"allocationPolicy": "packed", "resources": [
        {"name": "nvidia.com/gpu", "replicas": 4, "devices": [0, "GPU-1234"], "rename": "nvidia.com/gpu.shared",
         "failRequestsGreaterThanOne": True}]}}),
    ("sharing", {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": 3}]}}),
    ("controller", {"release": {"recoveryHold": "1h30m"}, "quarantine": {"noExecuteAfter": 0},
                    "leaderElection": {"leaseDuration": "1.5", "renewDeadline": 10, "retryPeriod": "250ms"},
                    "policy": {"unhealthyFraction": 0.5, "capacityGap": 0}, "breaker": {"maxQuarantinedFraction": 1}}),
]
BAD = [
    ("plugin", {"pollInterval": 0}),
    ("plugin", {"logLevel": "trace"}),
    ("plugin", {"correlateOn": "Healthy"}),
    ("plugin", {"correlateOn": "Degraded Unhealthy"}),
    ("plugin", {"annotationMaxBytes": 0}),
    ("plugin", {"backend": "dcgm"}),
    ("health", {"xid": {"fatal": ["79"]}}),
    ("health", {"clearAfterPolls": 0}),
    ("health", {"overrides": {"xid-13": "Broken"}}),
    ("health", {"overrides": {"XID_13": "ignore"}}),
    ("health", {"kubeletHealth": {"Healthy": "Unhealthy"}}),
    ("health", {"latchHoldSeconds": {"Degraded": -1}}),
    ("health", {"thresholds": {"eccCorrectedLimit": 1.5}}),
    ("health", {"flap": {"maxx": 3}}),
    ("sharing", {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu"}]}}),
    ("sharing", {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 0}]}}),
    ("sharing", {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2000}]}}),
    ("sharing", {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": []}]}}),
    ("sharing", {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": "some"}]}}),
    ("sharing", {"timeSlicing": {"allocationPolicy": "spread"}}),
    ("controller", {"policy": {"unhealthyFraction": 1.5}}),
    ("controller", {"policy": {"capacityGap": -1}}),
    ("controller", {"release": {"recoveryHold": "10 minutes"}}),
    ("controller", {"breaker": {"maxQuarantinedFraction": 0}}),
    ("controller", {"leaderElection": {"retryPeriod": -2}}),
]


def _section_schema(section: str) -> dict[str, Any]:
    props = _schema()["properties"]
    return dict(props["controller"]["properties"]["config"] if section == "controller" else props[section])


@pytest.mark.parametrize(("section", "doc"), GOOD, ids=[f"{s}-{i}" for i, (s, _) in enumerate(GOOD)])
def test_what_the_parsers_accept_the_schema_accepts(section: str, doc: dict[str, Any]) -> None:
    PARSERS[section](doc)
    assert _errors(_section_schema(section), doc) == []


@pytest.mark.parametrize(("section", "doc"), BAD, ids=[f"{s}-{i}" for i, (s, _) in enumerate(BAD)])
def test_what_the_parsers_refuse_the_schema_refuses(section: str, doc: dict[str, Any]) -> None:
    with pytest.raises((ValueError, FieldError)):
        PARSERS[section](doc)
    assert _errors(_section_schema(section), doc) != []


# Through helm ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    exe = build_or_skip(helm_build.MODULE, helm_build.PACKAGE, "helm", helm_build.ENV,
                        version=helm_build.HELM_VERSION, ldflags=helm_build.LDFLAGS)
    home = tmp_path_factory.mktemp("helm-home")
    # helm template of a local chart reads no repository; keep its config and cache out of the user's home anyway.
    env = {**os.environ, "HELM_CONFIG_HOME": str(home / "config"), "HELM_CACHE_HOME": str(home / "cache"),
           "HELM_DATA_HOME": str(home / "data")}
    yield exe, env


def _template(helm: tuple[Path, dict[str, str]], chart: Path, *args: str) -> subprocess.CompletedProcess[str]:
    exe, env = helm
    return subprocess.run([str(exe), "template", "x", str(chart), *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_helm_takes_the_shipped_values(helm: tuple[Path, dict[str, str]]) -> None:
    r = _template(helm, CHART)
    assert SCHEMA_ERROR not in r.stderr, r.stderr


@pytest.mark.parametrize(("section", "doc"), GOOD, ids=[f"{s}-{i}" for i, (s, _) in enumerate(GOOD)])
def test_helm_takes_what_the_parsers_accept(helm: tuple[Path, dict[str, str]], tmp_path: Path, section: str,
                                            doc: dict[str, Any]) -> None:
    # Helm checks with Go's regular expressions and its own JSON Schema library: the patterns and unions must work
    # there too, not only in Python.
    values = {"controller": {"config": doc}} if section == "controller" else {section: doc}
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    r = _template(helm, CHART, "--values", str(path))
    assert SCHEMA_ERROR not in r.stderr, r.stderr


def test_helm_takes_the_chart_as_a_dependency(helm: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    (parent / "charts").mkdir(parents=True)
    shutil.copytree(CHART, parent / "charts" / CHART.name)
    (parent / "Chart.yaml").write_text(
        f"apiVersion: v2\nname: parent\nversion: 0.1.0\ndependencies:\n  - name: {CHART.name}\n"
        f"    version: {yaml.safe_load((CHART / 'Chart.yaml').read_text())['version']}\n")
    (parent / "values.yaml").write_text("global:\n  imageRegistry: example\n")
    r = _template(helm, parent)
    assert SCHEMA_ERROR not in r.stderr, r.stderr


@pytest.mark.parametrize(("args", "path", "names"), [
    (["--set", "migStrategyy=none"], "", "migStrategyy"),
    (["--set-string", "hostNetwork=yes"], "/hostNetwork", "boolean"),
    (["--set", "plugin.pollIntervall=3"], "/plugin", "pollIntervall"),
    (["--set", "migStrategy=some"], "/migStrategy", "'none'"),
    (["--set-string", "health.clearAfterPolls=x"], "/health/clearAfterPolls", "integer"),
    (["--set", "controller.config.release.recoveryHoldd=5m"], "/controller/config/release", "recoveryHoldd"),
    (["--set", "controller.config.policy.unhealthyFraction=2"], "/controller/config/policy/unhealthyFraction",
     "maximum"),
    (["--set", "sharing.timeSlicing.resources[0].name=nvidia.com/gpu"], "/sharing/timeSlicing/resources/0",
     "replicas"),
    (["--set", "hostPaths.state=var/lib/x"], "/hostPaths/state", "^/"),
    (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy", "IfNotPresent"),
    # A mode the plugin does not have stops the install naming both it has, before any template runs.
    (["--set", "mode=dra-driver"], "/mode", "value must be one of 'device-plugin', 'dra'"),
    (["--set", "hostPaths.cdiSpecs=run/cdi"], "/hostPaths/cdiSpecs", "^/"),
    # The chart mounts the state dir itself (hostPaths.state): the plugin section may not move it.
    (["--set", "plugin.stateDir=/elsewhere"], "/plugin", "stateDir"),
    # The mode is the chart's value, which brings its mounts and grants: the plugin section may not switch it.
    (["--set", "plugin.mode=dra"], "/plugin", "'mode'"),
], ids=["unknown-top-level", "wrong-type", "unknown-plugin-key", "bad-enum", "health-type",
        "unknown-controller-key", "fraction-range", "missing-required", "relative-host-path", "pull-policy",
        "bad-mode", "relative-dra-path", "chart-owned-plugin-key", "chart-owned-mode"])
def test_helm_refuses_a_bad_value_naming_its_path(helm: tuple[Path, dict[str, str]], args: list[str], path: str,
                                                  names: str) -> None:
    r = _template(helm, CHART, *args)
    assert r.returncode != 0
    assert SCHEMA_ERROR in r.stderr, r.stderr
    # Helm lists each violation as "- at '<JSON pointer>': <what is wrong>".
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith(f"- at '{path}':")]
    assert lines, r.stderr
    assert any(names in ln for ln in lines), r.stderr
