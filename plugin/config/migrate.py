"""``gpu-health-plugin migrate-config FILE``: NVIDIA's device plugin configuration turned into ours.

NVIDIA's config file (``version: v1`` with ``flags:``, ``sharing:``, ``resources:``, ``imex:``) becomes our config
file; NVIDIA's Helm values (``config:``, ``migStrategy:``, ``deviceListStrategy:``, ...) become our chart's values.
Their flags' keys get the verdicts of plugin/config/nvidia.py, so a setting means here what it means on ``run``'s
command line; the rest follows docs/deploy.md's translation of their chart. Every setting that does not carry over
is named, one line each: the caller exits ``EXIT_PARTIAL`` then, so a migration that lost something cannot pass
for a complete one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plugin.config.nvidia import CONFIG, FLAGS, RELEASE, NotNeeded, NvidiaFlag, Refused, decide, value_text
from plugin.config.options import option
from plugin.options.document import read_document
from plugin.sharing.config import parse_sharing
from plugin.validation import FieldError

EXIT_PARTIAL = 3  # printed, but something could not be carried over (named on stderr)

_BY_FILE_KEY = {r.file_key: r for r in FLAGS if r.file_key}
_BY_HELM_KEY = {r.helm_key: r for r in FLAGS if r.helm_key}
_FILE_TOP = ("version", "flags", "sharing", "resources", "imex")
_GFD = "GPU feature discovery's setting, not the plugin's: keep it in GFD's own configuration"

# Our chart gives these options values of their own; the rest go under its plugin: value (docs/deploy.md).
_HELM_OF = {"mig_strategy": "migStrategy", "fail_on_init_error": "failOnInitError", "cdi": "cdi.enabled",
            "device_plugin_dir": "hostPaths.devicePlugins"}

# NVIDIA's chart values (of RELEASE) that ours has under the same name and meaning.
_HELM_SAME = ("nameOverride", "fullnameOverride", "namespaceOverride", "imagePullSecrets", "image.pullPolicy",
              "updateStrategy", "podAnnotations", "podSecurityContext", "securityContext", "resources",
              "nodeSelector", "affinity", "tolerations", "priorityClassName", "runtimeClassName")
_HELM_RENAMED = {"devicePlugin.enableHostNetwork": "hostNetwork"}
_HELM_NOT_NEEDED = {
    "allowDefaultNamespace": "ours does not check its namespace",
    "config.fallbackStrategies": "ours has one config for every node, nothing to fall back from",
}
_HELM_LOST = {
    "image.repository": "ours runs its own image",
    "image.tag": "ours runs its own image (the chart's appVersion when empty)",
    "selectorLabelsOverride": "our selector is fixed (app.kubernetes.io/name), as in manifests/",
    "componentSelectorLabels": "our selector is fixed (app.kubernetes.io/name), as in manifests/",
    "gfd": "ours discovers no features: keep GPU feature discovery (their chart with devicePlugin.enabled=false, or "
           "the GPU Operator)",
    "nfd": "no subchart here: install node feature discovery on its own",
    "mps": "ours shares GPUs by time-slicing only",
    "config.name": "an existing ConfigMap cannot be read from here: run migrate-config on its config file",
    "devicePlugin": "no counterpart (docs/deploy.md)",
}
# NVIDIA's chart defaults (of RELEASE) that set something, leaf by leaf (a list is one leaf): a copy of their whole
# values file carries these, and they are no choice of the operator's to report.
_HELM_DEFAULTS: dict[str, Any] = {
    "config.fallbackStrategies": ["named", "single"], "image.repository": "nvcr.io/nvidia/k8s-device-plugin",
    "image.pullPolicy": "IfNotPresent", "updateStrategy.type": "RollingUpdate", "allowDefaultNamespace": False,
    "priorityClassName": "system-node-critical", "devicePlugin.enabled": True, "gfd.enabled": False,
    "gfd.nameOverride": "gpu-feature-discovery", "gfd.securityContext.privileged": True,
    "mps.root": "/run/nvidia/mps", "mps.enableHostPID": True,
    "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"},
                    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms": [
        {"matchExpressions": [{"key": k, "operator": "In", "values": [v]}]}
        for k, v in (("feature.node.kubernetes.io/pci-10de.present", "true"),
                     ("feature.node.kubernetes.io/cpu-model.vendor_id", "NVIDIA"), ("nvidia.com/gpu.present", "true"))],
    "nfd.nameOverride": "node-feature-discovery", "nfd.master.serviceAccount.name": "node-feature-discovery",
    "nfd.master.serviceAccount.create": True, "nfd.master.config.extraLabelNs": ["nvidia.com"],
    "nfd.worker.tolerations": [
        {"key": "node-role.kubernetes.io/master", "operator": "Equal", "value": "", "effect": "NoSchedule"},
        {"key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoSchedule"}],
    "nfd.worker.config.sources.pci.deviceClassWhitelist": ["02", "03"],
    "nfd.worker.config.sources.pci.deviceLabelFields": ["vendor"],
}
_NO_DEFAULT = object()


@dataclass
class Migration:
    kind: str  # "config" (our config file) or "values" (our chart's values)
    doc: dict[str, Any] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)  # "where: why" of each setting not carried over
    dropped: list[str] = field(default_factory=list)  # "where: why" of each one not needed here

    @property
    def header(self) -> str:
        what = ("our config file (pass it with --config or GPU_HEALTH_CONFIG)" if self.kind == "config"
                else "values for our Helm chart (helm install -f)")
        return f"# gpu-health-device-plugin: {what}, from NVIDIA's device plugin {RELEASE} settings"


def nvidia_kind(doc: Any) -> str | None:
    """Which of NVIDIA's formats the document is: "config" (its config file), "values" (its Helm values) or None
    (neither; ours among them)."""
    if not isinstance(doc, dict):
        return None
    if "version" in doc:
        theirs = {"flags", "resources", "imex"} & set(doc)
        sharing = doc.get("sharing")
        return "config" if theirs or (isinstance(sharing, dict) and "mps" in sharing) else None
    helm = {*(r.helm_key.split(".")[0] for r in FLAGS if r.helm_key), "config", "compatWithCPUManager", "gfd", "nfd",
            "devicePlugin"}
    return "values" if helm & set(doc) else None


def nvidia_format_error(path: Path, label: str) -> FieldError | None:
    """For a file our --config refused: the one line to print instead when it is NVIDIA's format."""
    try:
        kind = nvidia_kind(read_document(path, label))
    except FieldError:
        return None
    if kind is None:
        return None
    what = "config file" if kind == "config" else "Helm values"
    return FieldError(label, f"{path} is NVIDIA's device plugin {what}, not ours: run gpu-health-plugin "
                             f"migrate-config {path} and use what it prints")


def _put(doc: dict[str, Any], dotted: str, value: Any) -> None:
    *heads, leaf = dotted.split(".")
    for h in heads:
        doc = doc.setdefault(h, {})
    doc[leaf] = value


def _leaves(v: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(v, dict) and v:
        for k, sub in v.items():
            yield from _leaves(sub, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, v


def _unset(v: Any) -> bool:
    return v is None or v == "" or v == {} or v == []


def _apply(m: Migration, row: NvidiaFlag, where: str, value: Any, place: Mapping[str, str]) -> None:
    """One of NVIDIA's flag settings: into our document at the key ``place`` gives our option, else named."""
    try:
        verdict = decide(row, where, value_text(value))
    except FieldError as exc:
        m.lost.append(f"{exc}")
        return
    if isinstance(verdict, Refused):
        m.lost.append(f"{where}: {verdict.hint}")
    elif isinstance(verdict, NotNeeded):
        m.dropped.append(f"{where}: not needed: {verdict.why}")
    elif verdict.name == CONFIG:
        m.lost.append(f"{where}: ours takes no config file by name here: run migrate-config on that file")
    else:
        opt = option(verdict.name)
        parsed = opt.parse(verdict.text)
        _put(m.doc, place.get(verdict.name, opt.key), str(parsed) if isinstance(parsed, Path) else parsed)


def _sharing(m: Migration, sharing: Any, where: str, into: str) -> None:
    if _unset(sharing):
        return
    if not isinstance(sharing, dict):
        m.lost.append(f"{where}: expected a mapping, got {sharing!r}")
        return
    for k, v in sharing.items():
        if k == "mps":
            if not _unset(v):
                m.lost.append(f"{where}.mps: ours shares GPUs by time-slicing only")
        elif k != "timeSlicing":
            m.lost.append(f"{where}.{k}: not a key of NVIDIA's sharing section")
        elif not _unset(v):
            try:  # theirs and ours mean the same here; what ours cannot take is said, not written
                parse_sharing({"timeSlicing": v})
            except FieldError as exc:
                m.lost.append(f"{where}.timeSlicing: {exc.message} (at {exc.field})")
                continue
            _put(m.doc, f"{into}.timeSlicing", v)


def from_config(doc: Mapping[str, Any], prefix: str = "", place: Mapping[str, str] | None = None) -> Migration:
    """NVIDIA's config file as our config file (or, with ``place``, into our chart's values)."""
    m = Migration("config" if place is None else "values")
    if doc.get("version") != "v1":
        raise FieldError(f"{prefix}version", f"expected NVIDIA's v1, got {doc.get('version')!r}")
    for key in doc:
        if key not in _FILE_TOP:
            m.lost.append(f"{prefix}{key}: not a key of NVIDIA's config file v1")
    for key, v in _leaves({k: doc[k] for k in ("flags", "imex") if k in doc}):
        where = prefix + key
        if _unset(v):
            continue
        row = _BY_FILE_KEY.get(key)
        if row is not None:
            _apply(m, row, where, v, place or {})
        elif key.startswith("flags.gfd.") or key == "flags.useNodeFeatureAPI":
            m.dropped.append(f"{where}: not needed: {_GFD}")
        else:
            m.lost.append(f"{where}: not a key of NVIDIA's config file {RELEASE}")
    if not _unset(doc.get("resources")):
        m.lost.append(f"{prefix}resources: NVIDIA's plugin ignores it too; ours names its resource with "
                      "--resource-name, time-slicing renames with sharing.timeSlicing.resources[].rename")
    _sharing(m, doc.get("sharing"), f"{prefix}sharing", "sharing")
    if place is None:
        m.doc = {"version": "v1", **m.doc}
    return m


def _env_item(m: Migration, item: Any, where: str) -> Any:
    """An entry of their container's env: NVIDIA's variables get run's verdicts, a setting going to our value for it
    (our chart sets our variables from its values); other variables pass as they are."""
    if not isinstance(item, dict):
        return item
    row = next((r for r in FLAGS if item.get("name") in r.env), None)
    if row is None:
        return item
    where = f"{where}[{item['name']}]"
    if "value" in item:
        _apply(m, row, where, item["value"], _HELM_OF)
    else:
        m.lost.append(f"{where}: a value from elsewhere (valueFrom) cannot be judged here: set ours by hand")
    return None


def _from_config_map(m: Migration, config: Any) -> None:
    if not isinstance(config, dict):
        return
    entries = config.get("map") or {}
    if not isinstance(entries, dict) or not entries:
        return
    chosen = config.get("default") or (next(iter(entries)) if len(entries) == 1 else "")
    for name in entries:
        if name != chosen:
            why = ("no config.default picks one" if not chosen else f"config.default picks {chosen}")
            m.lost.append(f"config.map.{name}: ours has one config for every node ({why}): migrate that one on its "
                          "own if it is the one to keep")
    if chosen not in entries:
        if chosen:
            m.lost.append(f"config.default: {chosen!r} is not in config.map")
        return
    import yaml

    text = entries[chosen]
    try:
        doc = yaml.safe_load(text) if isinstance(text, str) else text
    except yaml.YAMLError as exc:
        m.lost.append(f"config.map.{chosen}: not valid YAML: {str(exc).splitlines()[0]}")
        return
    if not isinstance(doc, dict):
        m.lost.append(f"config.map.{chosen}: expected NVIDIA's config file, got {doc!r}")
        return
    try:
        inner = from_config(doc, f"config.map.{chosen}.", _HELM_OF)
    except FieldError as exc:
        m.lost.append(str(exc))
        return
    m.lost += inner.lost
    m.dropped += inner.dropped
    for key, v in _leaves(inner.doc):
        _put(m.doc, key, v)


def _helm_rule(key: str, table: Mapping[str, Any] | tuple[str, ...]) -> str | None:
    return next((p for p in table if key == p or key.startswith(p + ".")), None)


def from_values(doc: Mapping[str, Any]) -> Migration:
    """NVIDIA's Helm values as values for our chart."""
    m = Migration("values")
    for key, v in _leaves(dict(doc)):
        if _unset(v) or _HELM_DEFAULTS.get(key, _NO_DEFAULT) == v or key == "config.default" or \
                key.startswith("config.map."):
            continue  # unset, their default, or the config map's (below)
        row = _BY_HELM_KEY.get(key)
        if row is not None:
            _apply(m, row, key, v, _HELM_OF)
        elif _helm_rule(key, _HELM_SAME) is not None:
            _put(m.doc, key, v)
        elif key in _HELM_RENAMED:
            _put(m.doc, _HELM_RENAMED[key], v)
        elif key == "devicePlugin.containers.main.env":
            items = [x for x in (_env_item(m, i, key) for i in (v if isinstance(v, list) else [v])) if x is not None]
            if items:
                _put(m.doc, "extraEnv", items)
        elif (rule := _helm_rule(key, _HELM_NOT_NEEDED)) is not None:
            m.dropped.append(f"{key}: not needed: {_HELM_NOT_NEEDED[rule]}")
        elif key == "devicePlugin.enabled" and v is False:
            m.lost.append(f"{key}: the chart is the device plugin; keep their chart with this for GPU feature "
                          "discovery alone")
        elif (rule := _helm_rule(key, _HELM_LOST)) is not None:
            m.lost.append(f"{key}: {_HELM_LOST[rule]}")
        else:
            m.lost.append(f"{key}: not a value of NVIDIA's chart {RELEASE}")
    _from_config_map(m, doc.get("config"))
    return m


def migrate(path: Path, label: str) -> Migration:
    """The file read and converted; FieldError when it cannot be read or is no NVIDIA format."""
    doc = read_document(path, label)
    kind = nvidia_kind(doc)
    if kind is None:
        raise FieldError(label, f"{path} is neither NVIDIA's device plugin config file (version: v1 with flags:, "
                                f"sharing:, resources:) nor its Helm values (config:, migStrategy:, ...)")
    assert isinstance(doc, dict)
    return from_config(doc) if kind == "config" else from_values(doc)


def render(m: Migration) -> str:
    import yaml

    body = yaml.safe_dump(m.doc, sort_keys=False, default_flow_style=False) if m.doc else "{}\n"
    return f"{m.header}\n{body}"
