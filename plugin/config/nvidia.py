"""NVIDIA's device plugin names, understood: every command-line flag and environment variable of NVIDIA's
k8s-device-plugin (the release in ``RELEASE``), what each becomes here, and the pass over ``run``'s arguments and
environment that applies it before our own parsing.

Each name gets one verdict, decided per value: it sets one of our options (an alias, said once as a warning naming
ours), it is not needed here (accepted, said once with why), or it has no equivalent (refused, exit 2, with what to do
instead). ``migrate-config`` applies the same verdicts to the keys of NVIDIA's config file and Helm values, so a
setting means the same thing whichever way it arrives. docs/deploy.md's table of these names is generated from
``FLAGS``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plugin.config.options import OPTIONS, option
from plugin.validation import FieldError

RELEASE = "v0.20.0"  # the release of NVIDIA's plugin whose flags this table follows (cmd/nvidia-device-plugin/main.go)

# Our --config is no Config field, but NVIDIA's --config-file is an alias of it.
CONFIG = "config"
CONFIG_FLAG, CONFIG_ENV = "--config", "GPU_HEALTH_CONFIG"


@dataclass(frozen=True)
class Sets:
    """The value sets our option ``name`` (a Config field, or ``CONFIG``) to ``text``, as a flag would."""
    name: str
    text: str


@dataclass(frozen=True)
class NotNeeded:
    """Accepted and ignored: what the value asks for, ours already does or has no need of."""
    why: str


@dataclass(frozen=True)
class Refused:
    """No equivalent here: ``hint`` says what to do instead."""
    hint: str


Verdict = Sets | NotNeeded | Refused


@dataclass(frozen=True)
class NvidiaFlag:
    flag: str  # NVIDIA's main name for it
    env: tuple[str, ...]  # NVIDIA's environment variables for it
    decide: Callable[[str], Verdict]  # the verdict on a value, written as a flag or a variable would write it
    ours: str  # our behaviour in a few words, for the docs' table
    aliases: tuple[str, ...] = ()  # NVIDIA's other flag names for it
    boolean: bool = False  # a flag of NVIDIA's that takes no separate value (``--gds-enabled`` means true)
    many: bool = False  # NVIDIA takes it several times (a list): the values are joined with commas
    file_key: str = ""  # its key in NVIDIA's config file (``flags.migStrategy``); "" when the file has none
    helm_key: str = ""  # its value in NVIDIA's Helm chart (``migStrategy``); "" when the chart has none

    @property
    def names(self) -> tuple[str, ...]:
        return (self.flag, *self.aliases)


def _bool_text(v: str) -> bool:
    s = v.strip().lower()
    if s in ("true", "1", "t", "yes", "on"):
        return True
    if s in ("false", "0", "f", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {v!r}")


def _choice(v: str, known: Sequence[str]) -> str:
    s = v.strip()
    if s not in known:
        raise ValueError(f"expected {' or '.join(known)}, got {v!r}")
    return s


def _items(v: str) -> list[str]:
    return [x.strip() for x in v.split(",") if x.strip()]


_CDI_SPECS = ("ours generates no CDI specs: they come from nvidia-ctk cdi generate or the GPU Operator, configured "
              "there")
_NO_EXTRAS = ("ours adds nothing to a container but its GPUs (NVIDIA_VISIBLE_DEVICES and device specs): set {env}"
              "=enabled in the pods that need it")
_NO_IMEX = "ours injects no IMEX channels: use NVIDIA's DRA driver for GPUs (ComputeDomains) where pods need them"


def _same(name: str) -> Callable[[str], Verdict]:
    return lambda v: Sets(name, v)


def _not_needed(why: str) -> Callable[[str], Verdict]:
    return lambda v: NotNeeded(why)


def _off_or_refused(hint: str) -> Callable[[str], Verdict]:
    """A switch of NVIDIA's that ours has no equivalent for: off changes nothing, on cannot be honoured."""
    return lambda v: Refused(hint) if _bool_text(v) else NotNeeded("it is off, which is all ours does")


def _device_list_strategy(v: str) -> Verdict:
    known = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
    wanted = [_choice(x, known) for x in _items(v)] or ["envvar"]
    lacking = [x for x in wanted if x in ("volume-mounts", "cdi-annotations")]
    if lacking:
        return Refused(f"ours passes devices as NVIDIA_VISIBLE_DEVICES (envvar) and, with --cdi, as CDI names "
                       f"(cdi-cri) only; {' and '.join(lacking)} has no equivalent: use envvar or cdi-cri")
    if "cdi-cri" in wanted:
        return Sets("cdi", "true")
    return NotNeeded("ours always passes NVIDIA_VISIBLE_DEVICES, as envvar does")


def _device_id_strategy(v: str) -> Verdict:
    if _choice(v, ("uuid", "index")) == "uuid":
        return NotNeeded("ours names devices by UUID, as uuid does")
    return Refused("ours names devices by GPU or MIG UUID only: drain each node before the switch (docs/deploy.md), "
                   "then drop this")


def _allocation_policy(v: str) -> Verdict:
    if _choice(v, ("distributed", "packed")) == "distributed":
        return NotNeeded("ours spreads time-sliced replicas over the GPUs by default, as distributed does")
    return Refused("set sharing.timeSlicing.allocationPolicy: packed in the --config file")


def _discovery(v: str) -> Verdict:
    if _choice(v, ("auto", "nvml", "tegra")) == "tegra":
        return Refused("ours has no Tegra discovery (NVML only): keep NVIDIA's plugin on Tegra nodes")
    return NotNeeded("ours finds GPUs through NVML (--backend nvml, the default)")


def _imex_channels(v: str) -> Verdict:
    return Refused(_NO_IMEX) if _items(v) else NotNeeded("no channel is named")


def _kubelet_socket(v: str) -> Verdict:
    if not v.strip():
        return Refused("ours always registers with the kubelet: drop it")
    head, tail = os.path.split(v.strip())
    if tail != "kubelet.sock" or not head:
        return Refused("ours finds the kubelet's socket as kubelet.sock in --device-plugin-dir DIR: set that")
    return Sets("device_plugin_dir", head)


FLAGS: tuple[NvidiaFlag, ...] = (
    NvidiaFlag("--mig-strategy", ("MIG_STRATEGY",), _same("mig_strategy"), "ours, same name and values",
               file_key="flags.migStrategy", helm_key="migStrategy"),
    NvidiaFlag("--fail-on-init-error", ("FAIL_ON_INIT_ERROR",), _same("fail_on_init_error"),
               "ours, same name; false serves no healthy device rather than blocking", boolean=True,
               file_key="flags.failOnInitError", helm_key="failOnInitError"),
    NvidiaFlag("--driver-root", ("NVIDIA_DRIVER_ROOT",), _not_needed(
        "ours mounts nothing of the driver: NVML comes in through the NVIDIA runtime of runtimeClassName, which "
        "knows where the driver is"), "not needed", aliases=("--nvidia-driver-root",),
               file_key="flags.nvidiaDriverRoot", helm_key="nvidiaDriverRoot"),
    NvidiaFlag("--dev-root", ("NVIDIA_DEV_ROOT",), _same("dev_root"),
               "ours, same name: the root of the device nodes' host paths (ours defaults to /, not the driver root)",
               aliases=("--nvidia-dev-root",), file_key="flags.nvidiaDevRoot"),
    NvidiaFlag("--pass-device-specs", ("PASS_DEVICE_SPECS",), _not_needed(
        "ours always returns the allocated GPUs' device specs"), "not needed", boolean=True,
               file_key="flags.plugin.passDeviceSpecs", helm_key="compatWithCPUManager"),
    NvidiaFlag("--device-list-strategy", ("DEVICE_LIST_STRATEGY",), _device_list_strategy,
               "envvar: not needed (ours always sets NVIDIA_VISIBLE_DEVICES); cdi-cri: --cdi=true; volume-mounts, "
               "cdi-annotations: refused (use envvar or cdi-cri)", many=True,
               file_key="flags.plugin.deviceListStrategy", helm_key="deviceListStrategy"),
    NvidiaFlag("--device-id-strategy", ("DEVICE_ID_STRATEGY",), _device_id_strategy,
               "uuid: not needed (ours names devices by UUID); index: refused: drain each node before the "
               "switch, then drop it", file_key="flags.plugin.deviceIDStrategy",
               helm_key="deviceIDStrategy"),
    NvidiaFlag("--gdrcopy-enabled", ("GDRCOPY_ENABLED",), _off_or_refused(_NO_EXTRAS.format(env="NVIDIA_GDRCOPY")),
               "false: not needed; true: refused: set NVIDIA_GDRCOPY=enabled in the pods that need it", boolean=True,
               file_key="flags.gdrcopyEnabled",
               helm_key="gdrcopyEnabled"),
    NvidiaFlag("--gds-enabled", ("GDS_ENABLED",), _off_or_refused(_NO_EXTRAS.format(env="NVIDIA_GDS")),
               "false: not needed; true: refused: set NVIDIA_GDS=enabled in the pods that need it", boolean=True,
               file_key="flags.gdsEnabled", helm_key="gdsEnabled"),
    NvidiaFlag("--mofed-enabled", ("MOFED_ENABLED",), _off_or_refused(_NO_EXTRAS.format(env="NVIDIA_MOFED")),
               "false: not needed; true: refused: set NVIDIA_MOFED=enabled in the pods that need it", boolean=True,
               file_key="flags.mofedEnabled",
               helm_key="mofedEnabled"),
    NvidiaFlag("--cdi-annotation-prefix", ("CDI_ANNOTATION_PREFIX",), _not_needed(
        "ours sets no CDI annotations (only the cdi-annotations strategy used them)"), "not needed",
               file_key="flags.plugin.cdiAnnotationPrefix"),
    NvidiaFlag("--nvidia-cdi-hook-path", ("NVIDIA_CDI_HOOK_PATH", "NVIDIA_CTK_PATH"), _not_needed(_CDI_SPECS),
               "not needed", aliases=("--nvidia-ctk-path",), file_key="flags.plugin.nvidiaCTKPath",
               helm_key="cdi.nvidiaHookPath"),
    NvidiaFlag("--driver-root-ctr-path", ("DRIVER_ROOT_CTR_PATH", "CONTAINER_DRIVER_ROOT"), _not_needed(_CDI_SPECS),
               "not needed", aliases=("--container-driver-root",), file_key="flags.plugin.containerDriverRoot"),
    NvidiaFlag("--mps-root", ("MPS_ROOT",), _not_needed(
        "only MPS sharing uses it, which ours lacks (migrate-config names an mps: section as not carried over)"),
               "not needed", file_key="flags.mpsRoot", helm_key="mps.root"),
    NvidiaFlag("--shared-devices-allocation-policy", ("SHARED_DEVICES_ALLOCATION_POLICY",), _allocation_policy,
               "distributed: not needed (our default); packed: refused: set "
               "sharing.timeSlicing.allocationPolicy: packed in the config file",
               file_key="flags.plugin.sharedDevicesAllocationPolicy"),
    NvidiaFlag("--device-discovery-strategy", ("DEVICE_DISCOVERY_STRATEGY",), _discovery,
               "auto, nvml: not needed (ours uses NVML); tegra: refused: keep NVIDIA's plugin on Tegra nodes",
               file_key="flags.deviceDiscoveryStrategy",
               helm_key="deviceDiscoveryStrategy"),
    NvidiaFlag("--imex-channel-ids", ("IMEX_CHANNEL_IDS",), _imex_channels,
               "none: not needed; any: refused: ours injects no IMEX channels (NVIDIA's DRA driver for GPUs does, "
               "with ComputeDomains)",
               many=True, file_key="imex.channelIDs"),
    NvidiaFlag("--imex-required", ("IMEX_REQUIRED",), _off_or_refused(_NO_IMEX),
               "false: not needed; true: refused, as --imex-channel-ids",
               boolean=True, file_key="imex.required"),
    NvidiaFlag("--kubelet-socket", ("KUBELET_SOCKET",), _kubelet_socket,
               "DIR/kubelet.sock: --device-plugin-dir DIR; another file name, or empty (no kubelet): refused"),
    NvidiaFlag("--config-file", ("CONFIG_FILE",), _same(CONFIG),
               "--config (our format: convert theirs with gpu-health-plugin migrate-config)"),
    NvidiaFlag("--cdi-feature-flags", ("CDI_FEATURE_FLAGS",), _not_needed(_CDI_SPECS), "not needed", many=True,
               helm_key="cdi.featureFlags"),
    NvidiaFlag("--cdi-disable-hooks", ("CDI_DISABLE_HOOKS",), _not_needed(_CDI_SPECS), "not needed", many=True),
)


def our_flag(name: str) -> str:
    return CONFIG_FLAG if name == CONFIG else option(name).flag


def our_env(name: str) -> str:
    return CONFIG_ENV if name == CONFIG else option(name).env


def decide(row: NvidiaFlag, label: str, value: str) -> Verdict:
    """The verdict on one value, checked as our option would check it: a bad value is a FieldError naming NVIDIA's
    name the way the user wrote it."""
    try:
        verdict = row.decide(value)
        if isinstance(verdict, Sets) and verdict.name != CONFIG:
            option(verdict.name).parse(verdict.text)
    except (ValueError, TypeError) as exc:
        raise FieldError(label, str(exc)) from None
    return verdict


@dataclass(frozen=True)
class Adopted:
    argv: list[str]  # the arguments with NVIDIA's flags replaced by ours or dropped
    env: dict[str, str]  # the environment with ours set from NVIDIA's variables
    notes: list[str] = field(default_factory=list)  # one warning line per NVIDIA name used


def _note(label: str, what: str, verdict: Sets | NotNeeded, as_env: bool) -> str:
    if isinstance(verdict, NotNeeded):
        return f"{label}: NVIDIA's {what}, ignored: not needed: {verdict.why}"
    ours = our_env(verdict.name) if as_env else our_flag(verdict.name)
    return f"{label}: NVIDIA's {what}, taken as {ours}={verdict.text}; use that"


_OUR_FLAGS = {o.flag: o for o in OPTIONS}
_TAKES_VALUE = {f for f, o in _OUR_FLAGS.items() if not o.is_bool} | {CONFIG_FLAG}
_BY_FLAG = {n: row for row in FLAGS for n in row.names if n not in _OUR_FLAGS}  # a same name is ours already


def adopt(argv: Sequence[str], env: Mapping[str, str]) -> Adopted:
    """``run``'s arguments and environment with NVIDIA's names applied (FieldError for one refused here)."""
    given: dict[str, tuple[NvidiaFlag, list[str]]] = {}  # NVIDIA's flag as written -> its row and values
    ours_given: set[str] = set()
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, value = tok.partition("=")
        if tok == "--":
            out.extend(argv[i:])
            break
        row = _BY_FLAG.get(name)
        if row is None:
            ours_given.add(name)
            # A value of ours is kept whole even when it looks like one of NVIDIA's flags.
            step = 2 if name in _TAKES_VALUE and not eq else 1
            out.extend(argv[i:i + step])
            i += step
            continue
        if not eq:
            if row.boolean:
                value = "true"
            elif i + 1 < len(argv):
                i += 1
                value = argv[i]
            else:
                raise FieldError(name, "expected a value")
        i += 1
        values = given.setdefault(name, (row, []))[1]
        if row.many:
            values.append(value)
        else:
            values[:] = [value]
    notes: list[str] = []
    for name, (row, values) in given.items():
        value = ",".join(values)
        verdict = decide(row, name, value)
        if isinstance(verdict, Refused):
            raise FieldError(name, f"NVIDIA's flag, no equivalent here for {value!r}: {verdict.hint}")
        if isinstance(verdict, Sets):
            if our_flag(verdict.name) in ours_given:
                raise FieldError(name, f"NVIDIA's name for {our_flag(verdict.name)}, which is given too: drop one")
            out.append(f"{our_flag(verdict.name)}={verdict.text}")
        notes.append(_note(name, "flag", verdict, as_env=False))
    new_env = dict(env)
    for row in FLAGS:
        for var in row.env:
            if var not in env:
                continue
            verdict = decide(row, var, env[var])
            if isinstance(verdict, Refused):
                raise FieldError(var, f"NVIDIA's env name, no equivalent here for {env[var]!r}: {verdict.hint}")
            if isinstance(verdict, Sets):
                ours = our_env(verdict.name)
                if ours in env:
                    raise FieldError(var, f"NVIDIA's env name for {ours}, which is set too: drop one")
                new_env[ours] = verdict.text
            notes.append(_note(var, "env name", verdict, as_env=True))
    return Adopted(out, new_env, notes)


def value_text(v: Any) -> str:
    """A value from NVIDIA's YAML as their flag would have been written (lists joined, booleans spelt)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return ",".join(value_text(x) for x in v)
    return "" if v is None else str(v)
