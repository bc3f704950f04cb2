"""The Helm chart's values schema, charts/gpu-health-device-plugin/values.schema.json, built from the code and
values.yaml so that it cannot drift from either. scripts/gen_docs.py writes it with the generated docs:

    python scripts/gen_docs.py           # (re)write every generated file, this one included
    python scripts/gen_docs.py --check   # exit 1, naming the stale files

Where each part comes from:

    the chart's own keys     the table below, checked against values.yaml both ways: a key of values.yaml the
                             table lacks, or a key of the table values.yaml lacks, stops the generator with its path
    plugin                   plugin/config's OPTIONS: each option's field type, parser and help
    health, sharing          scripts/file_keys.py's HEALTH_KEYS and SHARING_KEYS (which gen_docs checks against the
                             parsers); each Key's type text maps to one schema below, and a type text without one
                             stops the generator with the key's path
    controller.config        plugin/controller/config.py's OPTIONS, the file keys of its sections

Helm 3 checks values against draft-07; every fixed set of keys is closed (additionalProperties: false), so a typo
fails `helm install` with the path of the bad value before anything reaches the cluster.
tests/docs/test_gen_docs.py runs --check; tests/artifacts/test_chart_schema.py tests the schema itself.
"""

from __future__ import annotations

import json
import sys
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from plugin.config import options as plugin_options  # noqa: E402
from plugin.controller import config as ctl  # noqa: E402
from plugin.health.reasons import KubeletHealth, State  # noqa: E402
from plugin.options import table as options_table  # noqa: E402
from plugin.options.durations import DURATION_PART, Duration  # noqa: E402
from plugin.options.table import Option  # noqa: E402
from plugin.sharing.config import MAX_REPLICAS, MIG_STRATEGIES, POLICIES  # noqa: E402
from plugin.validation import (  # noqa: E402
    KUBELET_CONDITIONS,
    QUALIFIED_NAME_PATTERN,
    REASON_CODE_RE,
    Choice,
    parse_bool,
)
from scripts import file_keys  # noqa: E402

CHART = REPO / "charts" / "gpu-health-device-plugin"
VALUES_YAML = CHART / "values.yaml"
SCHEMA_JSON = CHART / "values.schema.json"
DRAFT = "http://json-schema.org/draft-07/schema#"

Schema = dict[str, Any]


class SchemaError(file_keys.DocsError):
    pass


# Building blocks ---------------------------------------------------------------------------------------------------

def _typed(description: str, type_: str | list[str], **more: Any) -> Schema:
    return {"description": description, "type": type_, **more}


def _string(description: str, **more: Any) -> Schema:
    return _typed(description, "string", **more)


def _boolean(description: str) -> Schema:
    return _typed(description, "boolean")


def _integer(description: str, minimum: int = 0) -> Schema:
    return _typed(description, "integer", minimum=minimum)


def _enum(description: str, values: Iterable[str]) -> Schema:
    return _string(description, enum=list(values))


def _fixed(description: str, properties: Mapping[str, Schema], required: Iterable[str] = ()) -> Schema:
    """An object with a fixed set of keys: anything else is a typo."""
    out: Schema = {"description": description, "type": "object", "additionalProperties": False,
                   "properties": dict(properties)}
    if required:
        out["required"] = list(required)
    return out


def _free(description: str) -> Schema:
    """A Kubernetes object passed through as it is; the API server checks its inside."""
    return _typed(description, "object")


def _free_list(description: str) -> Schema:
    return _typed(description, "array", items={"type": "object"})


def _string_map(description: str) -> Schema:
    return _typed(description, "object", additionalProperties={"type": "string"})


def _switch(description: str) -> Schema:
    return _fixed(description, {"enabled": _boolean(description)})


# The plugin section: from plugin/config's option table ----------------------------------------------------------

_STATES = plugin_options.CORRELATABLE_STATES
_STATE_WORD = "(?:" + "|".join(_STATES) + ")"
# What _state_list accepts as a string: none, or states separated by commas (blanks and empty items allowed).
_STATE_LIST_PATTERN = rf"^[\s,]*(?:none|{_STATE_WORD}(?:\s*,[\s,]*{_STATE_WORD})*)?[\s,]*$"


def _plugin_option(o: Option, hint: Any) -> Schema:
    where = o.key
    if isinstance(o.parse, Choice):
        return _enum(o.help, o.choices)
    if o.parse is parse_bool:
        return _boolean(o.help)
    if o.parse is plugin_options.state_list:
        # The loader takes a comma-separated string or a list, as a flag and a YAML file write them.
        return {"description": o.help, "anyOf": [
            {"type": "string", "pattern": _STATE_LIST_PATTERN},
            {"type": "array", "items": {"type": "string", "enum": [*_STATES, "none"]}}]}
    if o.parse is plugin_options.process_names:
        # A comma-separated string or a list of names, no paths or blanks in a name.
        return {"description": o.help, "anyOf": [
            {"type": "string", "pattern": r"^[^/\s]*(?:\s*,\s*[^/\s,]*)*$"},
            {"type": "array", "items": {"type": "string", "pattern": r"^[^/\s]+$", "maxLength": 255}}]}
    if hint is int:
        if o.parse is plugin_options.gpu_count:
            return {**_typed(o.help, "integer"), "minimum": 0, "maximum": 1024}
        return _integer(o.help, 1) if o.parse is plugin_options.positive_int else _typed(o.help, "integer")
    if hint is float:
        s = _typed(o.help, "number")
        if o.parse is plugin_options.positive_float:
            s["exclusiveMinimum"] = 0
        if o.parse is plugin_options.non_negative_float:
            s["minimum"] = 0
        return s
    if hint in (str, Path, Path | None):
        return _string(o.help, minLength=1) if o.parse is options_table.path else _string(o.help)
    raise SchemaError(f"{where}: no schema for a {hint} option parsed by {o.parse!r}; add one to "
                      "scripts/gen_chart_schema.py")


# Options the chart sets itself, left out of the plugin section so that a value there cannot fight the chart: the
# paths the DaemonSet mounts (hostPaths), the node name (the Downward API), the metrics address (the container port
# the probes use), and the options with a chart value of their own (migStrategy, failOnInitError, cdi,
# nodeCondition with its type and reasons, clusterReporting, remediation, updateStrategy).
CHART_OWNED = frozenset({
    "devicePluginDir", "stateDir", "healthSocket", "podResourcesSocket", "nodeName", "kubeconfig", "metricsAddress",
    "migStrategy", "failOnInitError", "cdi", "nodeCondition", "nodeConditionType", "nodeConditionReasons",
    "annotations", "events", "remediate",
    "annotatePods", "handover",
    # The chart's mode value (with its mounts and grants) and hostPaths' DRA directories, mounted at the same path.
    "mode", "draPluginDir", "draRegistryDir", "cdiSpecDir",
    # NVSentinel's sockets need their host directories mounted: the nvsentinel and deviceApi values.
    "nvsentinelSocket", "nvsentinelStoreOnly", "deviceApiSocket", "deviceApiProvide", "deviceApiConsume",
    # The kernel log is read through the relay container's FIFO: the kernelLog value.
    "kernelLog",
})


def plugin_schema(description: str) -> Schema:
    hints = typing.get_type_hints(plugin_options.Config)
    keys = {o.leaf for o in plugin_options.OPTIONS}
    if stale := sorted(CHART_OWNED - keys):
        raise SchemaError(f"plugin.{stale[0]}: listed as set by the chart but not an option of the plugin")
    return _fixed(description, {o.leaf: _plugin_option(o, hints[o.name]) for o in plugin_options.OPTIONS
                                if o.leaf not in CHART_OWNED})


# The health and sharing sections: from scripts/file_keys.py's Key tables -------------------------------------------

def _key_types() -> dict[str, Schema]:
    """The schema of each type text the Key tables use."""
    states = [s.value for s in State]
    number_or_null = {"type": ["number", "null"], "minimum": 0}
    return {
        "list of XIDs": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "map of GPU model to integer": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
        "state": {"type": "string", "enum": states},
        "integer": {"type": "integer"},
        "integer >= 1": {"type": "integer", "minimum": 1},
        "integer or null": {"type": ["integer", "null"], "minimum": 0},
        "number or null": number_or_null,
        "seconds": {"type": "number", "minimum": 0},
        "seconds or null": number_or_null,
        "boolean": {"type": "boolean"},
        "map: reason code to state or `ignore`": {
            "type": "object", "propertyNames": {"pattern": f"^{REASON_CODE_RE.pattern}$"},
            "additionalProperties": {"type": "string", "enum": [*states, "ignore"]}},
        "`Healthy`": {"type": "string", "enum": [KubeletHealth.HEALTHY.value]},
        "`Healthy` or `Unhealthy`": {"type": "string", "enum": [k.value for k in KubeletHealth]},
        "`distributed` or `packed`": {"type": "string", "enum": list(POLICIES)},
        "list": {"type": "array"},
        "resource name": {"type": "string", "minLength": 1},
        "`all`, a count or a list": {"anyOf": [
            {"type": "string", "enum": ["all"]},
            {"type": "integer", "minimum": 1},
            {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "integer", "minimum": 0}, {"type": "string", "minLength": 1}]}}]},
    }


# Bounds a type text does not carry.
_KEY_BOUNDS: dict[str, Schema] = {
    "sharing.timeSlicing.resources[].replicas": {"minimum": 1, "maximum": MAX_REPLICAS},
}


def _section_from_keys(root: str, keys: Iterable[file_keys.Key], description: str) -> Schema:
    types = _key_types()
    keys = tuple(keys)
    paths = {k.path for k in keys}
    for path in _KEY_BOUNDS:
        if path.startswith(root + ".") and path not in paths:
            raise SchemaError(f"{path}: bounded in scripts/gen_chart_schema.py but not a key of "
                              "scripts/file_keys.py's table")
    top = _fixed(description, {})
    for k in keys:
        if k.type not in types:
            raise SchemaError(f"{k.path}: no schema for the type {k.type!r}; add one to scripts/gen_chart_schema.py")
        head, *parts = k.path.split(".")
        if head != root:
            raise SchemaError(f"{k.path}: not in the {root} section")
        node = top
        walked = [root]
        for part in parts[:-1]:
            name = part.removesuffix("[]")
            walked.append(name)
            child = node["properties"].setdefault(
                name, _fixed(f"The `{'.'.join(walked)}` keys (docs/config.md).", {}))
            if part.endswith("[]"):
                child = child.setdefault("items", _fixed(f"One entry of `{'.'.join(walked)}`.", {}))
            node = child
        leaf = {"description": k.description, **types[k.type], **_KEY_BOUNDS.get(k.path, {})}
        # A key that also holds children (a list of entries) keeps them.
        node["properties"][parts[-1]] = {**node["properties"].get(parts[-1], {}), **leaf}
        if "(required)" in k.description:
            node.setdefault("required", []).append(parts[-1])
    return top


# The controller's config file: from plugin/controller/config.py ---------------------------------------------------

_DURATION_NUMBER = r"\d+(?:\.\d*)?|\.\d+"
# What parse_duration accepts as a string, less the minus sign its range check refuses anyway.
_DURATION_PATTERN = rf"^\s*(?:{_DURATION_NUMBER}|(?:{DURATION_PART.pattern})+)\s*$"

_CONTROLLER_NUMBERS: dict[Callable[[Any], Any], Schema] = {
    ctl.count: {"type": "integer", "minimum": 0},
    ctl.concurrency: {"type": "integer", "minimum": 1, "maximum": 32},
    ctl.fraction: {"type": "number", "minimum": 0, "maximum": 1},
    ctl.open_fraction: {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    ctl.positive: {"type": "number", "exclusiveMinimum": 0},
    ctl.number: {"type": "number"},
}


def _controller_option(o: Option, hint: Any) -> Schema:
    if isinstance(o.parse, Choice):
        return _enum(o.help, o.choices)
    if o.parse is parse_bool:
        return _boolean(o.help)
    if isinstance(o.parse, Duration):
        bound = {"exclusiveMinimum": 0} if o.parse.positive else {"minimum": 0}
        return {"description": o.help + " (seconds, or a duration like 90s, 10m, 1h30m)", "anyOf": [
            {"type": "number", **bound}, {"type": "string", "pattern": _DURATION_PATTERN}]}
    if o.parse in _CONTROLLER_NUMBERS:
        return {"description": o.help, **_CONTROLLER_NUMBERS[o.parse]}
    if hint in (str, Path, Path | None):
        return _string(o.help)
    raise SchemaError(f"controller.config.{o.key}: no schema for a {hint} option parsed by {o.parse!r}; add one to "
                      "scripts/gen_chart_schema.py")


def controller_config_schema(description: str) -> Schema:
    hints = typing.get_type_hints(ctl.ControllerConfig)
    sections: dict[str, Schema] = {
        s: _fixed(f"The `{s}` section of the controller's config file (docs/fleet-config.md).", {})
        for s in ctl.SECTIONS}
    for o in ctl.OPTIONS:
        section, dot, leaf = o.key.partition(".")
        if dot:
            sections[section]["properties"][leaf] = _controller_option(o, hints[o.name])
    return _fixed(description, sections)


# The chart's own keys --------------------------------------------------------------------------------------------

# dra.extendedResourceName: empty, or domain/name as a pod's extended resource is written (the name part at most 63).
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_EXTENDED_RESOURCE_PATTERN = rf"^({_DNS_LABEL}(\.{_DNS_LABEL})*/[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?)?$"
# dra.migProfiles: with `+` read as `.`, the profile must make a DNS subdomain (the class mig-<profile>.gpu-health.io)
# and an extended resource name part (mig-<profile>, at most 63 characters, hence 59 for the profile).
_MIG_PROFILE_PATTERN = rf"^{_DNS_LABEL}([.+]{_DNS_LABEL})*$"
_MIG_PROFILE_MAX = 59

# Below these the keys come from the code, not from values.yaml, which sets only a few of them.
GENERATED = ("plugin", "health", "sharing", "controller.config")


def chart_schema() -> Schema:
    props: dict[str, Schema] = {
        "nameOverride": _string("Replaces the chart name in the app.kubernetes.io/name label of the plugin's "
                                "objects."),
        "fullnameOverride": _string("Replaces the name of the plugin's objects; the default is the chart name, "
                                    "whatever the release is called."),
        "namespaceOverride": _string("Installs into this namespace instead of the release's."),
        "image": _fixed("The image of the plugin; the fleet controller runs the same image.", {
            "repository": _string("The plugin's image, built from the project's Dockerfile.", minLength=1),
            "tag": _string("The image tag; empty means the chart's appVersion."),
            "pullPolicy": _enum("When the kubelet pulls the image.", ("Always", "IfNotPresent", "Never")),
        }),
        "imagePullSecrets": _typed("Secrets for pulling the image from a private registry.", "array", items={
            "description": "A Secret in the release's namespace.", "type": "object", "required": ["name"],
            "properties": {"name": _string("The Secret's name.", minLength=1)}}),
        "mode": _enum("How GPUs reach pods (docs/dra.md): device-plugin (the nvidia.com/gpu extended resource) or dra "
                      "(Dynamic Resource Allocation: ResourceSlices, the DeviceClass gpu.gpu-health.io; Kubernetes "
                      ">= 1.34). One mode per node.", plugin_options.option("mode").choices),
        "dra": _fixed("mode: dra's DeviceClasses (docs/dra.md): gpu.gpu-health.io, mig.gpu-health.io and one per "
                      "MIG profile; read only in mode: dra.", {
            "extendedResourceName": {
                **_string("The extended resource the class gpu.gpu-health.io serves (KEP-5004), e.g. nvidia.com/gpu; "
                          "its domain names the profile classes' resources (<domain>/mig-<profile>). Empty: none.",
                          pattern=_EXTENDED_RESOURCE_PATTERN),
                # The API server's rule: never in a *kubernetes.io domain (the native resources), never requests.*.
                "not": {"pattern": r"kubernetes\.io/|^requests\."}},
            "migProfiles": _typed("MIG profiles that get a class mig-<profile>.gpu-health.io with the extended "
                                  "resource <domain>/mig-<profile>; a `+` becomes `.` in both names.", "array",
                                  uniqueItems=True,
                                  items={"type": "string", "pattern": _MIG_PROFILE_PATTERN,
                                         "maxLength": _MIG_PROFILE_MAX}),
        }),
        "migStrategy": _enum("MIG devices: none (GPUs whole), single (MIG devices as nvidia.com/gpu) or mixed (one "
                             "resource per profile, for example nvidia.com/mig-1g.10gb).", MIG_STRATEGIES),
        "failOnInitError": _boolean("Exit when NVML cannot start, so the failure is a visible crash loop; false "
                                    "keeps serving with no healthy device."),
        "plugin": plugin_schema("Further keys of the config file's plugin section (docs/config.md); migStrategy, "
                                "failOnInitError and the feature switches win over the same keys here."),
        "health": _section_from_keys("health", file_keys.HEALTH_KEYS, "The config file's health section "
                                     "(docs/config.md); empty keeps the defaults."),
        "sharing": _section_from_keys("sharing", file_keys.SHARING_KEYS, "The config file's sharing section: "
                                      "time-slicing replicas (docs/sharing.md); empty shares nothing."),
        "cdi": _switch("Allocate also returns CDI device names; the runtime needs CDI enabled and CDI specs for the "
                       "GPUs."),
        "nodeCondition": _fixed("A node condition, with patch on nodes/status for it.", {
            "enabled": _boolean("Maintain a node condition, with patch on nodes/status for it."),
            "type": {**_string("Its type (the plugin's nodeConditionType); the admission policy allows only this "
                               "one. Never one of the kubelet's own.", pattern=f"^{QUALIFIED_NAME_PATTERN}$"),
                     "not": {"enum": list(KUBELET_CONDITIONS)}},
            "reasons": _enum("Its reason style (the plugin's nodeConditionReasons).",
                             plugin_options.option("node_condition_reasons").choices)}),
        "nvsentinel": _fixed("Every device transition also goes to NVSentinel's platform connector as a health "
                             "event (docs/nvsentinel.md); the host directory of its socket is mounted.", {
            "enabled": _boolean("Send health events to NVSentinel."),
            "hostDir": _string("The host directory holding NVSentinel's socket (its pods mount it as their "
                               "/var/run).", pattern="^/"),
            "socket": _string("The socket's file name in that directory.", pattern="^[^/]+$"),
            "storeOnly": _boolean("Mark the events STORE_ONLY: NVSentinel keeps them but never acts on them.")}),
        "kernelLog": _fixed("Driver events from the kernel log too (docs/kernel-log.md), through a privileged "
                            "relay container that only copies /dev/kmsg into a FIFO the plugin reads.", {
            "enabled": _boolean("Read the kernel log (adds the kernel-log-relay container)."),
            "hostPath": _string("The host's kernel log.", pattern="^/"),
            "resources": _free("The relay container's resource requests and limits.")}),
        "deviceApi": _fixed("NVSentinel's node-local device API (docs/nvsentinel.md); the host directory of its "
                            "socket is mounted when either way is on.", {
            "provide": _boolean("Publish every GPU and its health to the device API."),
            "consume": _boolean("Take the conditions other providers set on our GPUs there as reasons."),
            "hostDir": _string("The host directory holding the device API's socket.", pattern="^/"),
            "socket": _string("The socket's file name in that directory.", pattern="^[^/]+$")}),
        "clusterReporting": _switch("Node annotations and Events; false: no API access at all (no token, no "
                                    "ClusterRole, binding or admission policy)."),
        "remediation": _switch("Annotate and evict the pods holding a GPU that turned Unhealthy, with a ClusterRole "
                               "of its own for pods and pods/eviction."),
        "updateStrategy": {**_free("The DaemonSet's update strategy."), "properties": {
            "type": _enum("How pods are replaced.", ("RollingUpdate", "OnDelete")),
            "rollingUpdate": _free("maxUnavailable and maxSurge of a rolling update.")}},
        "minReadySeconds": _integer("Seconds a new pod must have been ready before the rollout moves on."),
        "terminationGracePeriodSeconds": _integer("Seconds the plugin gets to stop after SIGTERM."),
        "nodeSelector": _string_map("Extra node labels a node needs to get the plugin, on top of the affinity."),
        "affinity": _free("Where the plugin runs: by default the nodes labelled as having an NVIDIA GPU."),
        "tolerations": _free_list("Taints the plugin tolerates."),
        "priorityClassName": _string("The plugin's priority class; empty: none."),
        "runtimeClassName": _string("The RuntimeClass that brings NVML and the device nodes into the container; "
                                    "empty leaves it out."),
        "hostNetwork": _boolean("Run on the host's network namespace."),
        "podAnnotations": _string_map("Extra annotations on the plugin's pods."),
        "podLabels": _string_map("Extra labels on the plugin's pods."),
        "podSecurityContext": _free("The pod's security context."),
        "securityContext": _free("The container's security context."),
        "resources": _free("The container's resource requests and limits."),
        "hostPaths": _fixed("Host directories the plugin mounts (absolute paths).", {
            "devicePlugins": _string("The kubelet's device-plugin directory.", pattern="^/"),
            "podResources": _string("The kubelet's PodResources API socket directory.", pattern="^/"),
            "state": _string("The plugin's state directory: latched faults, transitions, the health API socket.",
                             pattern="^/"),
            "draPlugin": _string("DRA mode: the directory of the plugin's DRA socket, where the kubelet connects.",
                                 pattern="^/"),
            "pluginsRegistry": _string("DRA mode: the kubelet's plugin registration directory.", pattern="^/"),
            "cdiSpecs": _string("DRA mode: where the CDI spec of each prepared claim is written, a directory the "
                                "container runtime reads CDI specs from.", pattern="^/"),
        }),
        "extraArgs": _typed("Extra arguments after `run` (flags of docs/config.md).", "array",
                            items={"type": "string"}),
        "extraEnv": _free_list("Extra environment variables of the plugin's container."),
        "extraVolumes": _free_list("Extra volumes of the plugin's pod."),
        "extraVolumeMounts": _free_list("Where the plugin's container mounts the extra volumes."),
        "serviceMonitor": _fixed("A headless Service over the plugin's pods and a Prometheus Operator "
                                 "ServiceMonitor for it.", {
            "enabled": _boolean("Render the Service and the ServiceMonitor."),
            # The Prometheus Operator's Duration pattern.
            "interval": _string("How often Prometheus scrapes.",
                                pattern="^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                        "(([0-9]+)s)?(([0-9]+)ms)?)$"),
            "labels": _string_map("Labels your Prometheus selects ServiceMonitors by."),
        }),
        "prometheusRule": _fixed("The project's alerts as a Prometheus Operator PrometheusRule.", {
            "enabled": _boolean("Render the PrometheusRule."),
            "labels": _string_map("Labels your Prometheus selects rules by."),
        }),
        "metricsNetworkPolicy": _fixed("A NetworkPolicy admitting ingress to the plugin's and the controller's "
                                       "pods only on their metrics ports, from the namespaces selected.", {
            "enabled": _boolean("Render the NetworkPolicy."),
            "namespaceSelector": _free("The namespaces whose pods may scrape, as a label selector "
                                       "(matchLabels, matchExpressions)."),
        }),
        "controller": _fixed("The fleet controller: a Deployment that quarantines failing GPU nodes behind a "
                             "circuit breaker (docs/fleet.md).", {
            "enabled": _boolean("Deploy the fleet controller."),
            "fullnameOverride": _string("Replaces the name of the controller's objects."),
            "replicas": _integer("Replicas: one leads through its Lease, the others stand by."),
            "drain": _boolean("Also evict the pods of a node it quarantines, with a ClusterRole of its own."),
            "config": controller_config_schema("The controller's config file beyond version "
                                               "(docs/fleet-config.md); keys here replace the defaults key by key."),
            "extraArgs": _typed("Extra arguments (flags of docs/fleet-config.md).", "array",
                                items={"type": "string"}),
            "extraEnv": _free_list("Extra environment variables of the controller's container."),
            "hostNetwork": _boolean("Run on the host's network namespace."),
            "nodeSelector": _string_map("Extra node labels the controller's nodes need."),
            "affinity": _free("Where the controller's replicas run."),
            "tolerations": _free_list("Taints the controller tolerates."),
            "priorityClassName": _string("The controller's priority class; empty: none."),
            "podAnnotations": _string_map("Extra annotations on the controller's pods."),
            "podLabels": _string_map("Extra labels on the controller's pods."),
            "resources": _free("The controller's resource requests and limits."),
        }),
        # Not in values.yaml: without it the chart could not be a dependency of another chart.
        "global": _free("Helm's global values, which a parent chart passes to its dependencies; not used here."),
    }
    return {"$schema": DRAFT, "title": "gpu-health-device-plugin chart values",
            "description": "Values of the gpu-health-device-plugin chart. Generated by scripts/gen_chart_schema.py "
                           "from values.yaml and the plugin's and the controller's option tables; do not edit by "
                           "hand (regenerate: python scripts/gen_docs.py).",
            "type": "object", "additionalProperties": False, "properties": props}


# values.yaml against the table -------------------------------------------------------------------------------------

_HELM_OWN = {"global"}  # keys Helm itself puts into the values


def _is_closed(s: Schema) -> bool:
    return "properties" in s and s.get("additionalProperties") is False


def check_values(schema: Schema, values: Mapping[str, Any]) -> list[str]:
    """The paths where the table and values.yaml disagree, each with what is wrong."""
    problems: list[str] = []

    def walk(s: Schema, v: Mapping[str, Any], path: str) -> None:
        props: dict[str, Schema] = s.get("properties", {})
        for key, value in v.items():
            at = f"{path}.{key}" if path else str(key)
            if key not in props:
                if _is_closed(s):
                    problems.append(f"{at}: in values.yaml but not in scripts/gen_chart_schema.py's table")
                continue
            if isinstance(value, dict) and "properties" in props[key]:
                walk(props[key], value, at)
        if not _is_closed(s) or any(path == g or path.startswith(g + ".") for g in GENERATED):
            return
        for key in props:
            at = f"{path}.{key}" if path else key
            if key not in v and not (at in _HELM_OWN or at in GENERATED):
                problems.append(f"{at}: in scripts/gen_chart_schema.py's table but not in values.yaml")

    walk(schema, values, "")
    return problems


def render() -> str:
    schema = chart_schema()
    values = yaml.safe_load(VALUES_YAML.read_text()) or {}
    problems = check_values(schema, values)
    if problems:
        raise SchemaError("; ".join(problems))
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"
