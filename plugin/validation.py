"""The leaf every config section and outlet checks values with: Kubernetes names, listen addresses, and the one error
type for a bad value at a path.

Nothing here imports the rest of the plugin, so any layer can use it. The name rules are Kubernetes' own (apimachinery's
IsDNS1123Subdomain and IsQualifiedName, the kubelet's IsExtendedResourceName), so a value accepted here is one the
API server and the kubelet accept too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any


class FieldError(ValueError):
    """A bad value at a path: ``field`` is where (``health.xid.fatal``, ``--poll-interval``, ``NODE_NAME``),
    ``message`` what is wrong with it; ``str()`` is ``field: message``, the line the CLI prints."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def first_key(keys: Iterable[Any]) -> str:
    """The first offending key for a message, printable even when YAML made it empty, a number or null."""
    return sorted((k if isinstance(k, str) and k.isprintable() and k.strip() else repr(k)) for k in keys)[0]


def parse_bool(v: Any) -> bool:
    """A boolean as flags, environment variables and files write it: true/false, 1/0, yes/no, on/off."""
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("true", "1", "yes", "on"):
        return True
    if s in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {v!r}")


def split_host_port(s: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); an IPv6 host is bracketed (``[::]:9402``); an empty host means all."""
    host, sep, port = s.rpartition(":")
    if not sep:
        raise ValueError(f"expected HOST:PORT or off, got {s!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"put an IPv6 host in brackets ([::]:9402), got {s!r}")
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(f"port must be a number from 0 to 65535, got {port!r} in {s!r}")
    return host, int(port)


# Kubernetes names -------------------------------------------------------------------------------------------------

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_LABEL_RE = re.compile(_DNS_LABEL)
_DNS_SUBDOMAIN_RE = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_NAME_PART = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_NAME_PART_RE = re.compile(_NAME_PART)
# ``[prefix/]name`` as one pattern, for schemas (the chart's); is_qualified_name also checks the lengths.
QUALIFIED_NAME_PATTERN = rf"({_DNS_LABEL}(\.{_DNS_LABEL})*/)?{_NAME_PART}"
REASON_CODE_RE = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
RESERVED_DOMAINS = ("kubernetes.io", "k8s.io")
# Node conditions the kubelet and the node lifecycle controller write; a condition of ours under one of these types
# would be overwritten, or would overwrite theirs.
KUBELET_CONDITIONS = ("Ready", "MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable")


def is_dns_label(s: str) -> bool:
    """A lower-case DNS label of at most 63 characters (namespaces, ResourceSlice device names)."""
    return len(s) <= 63 and _DNS_LABEL_RE.fullmatch(s) is not None


def is_label_value(s: str) -> bool:
    """A label value: empty, or at most 63 alphanumerics with ``-``, ``_`` and ``.`` inside (taint values too)."""
    return s == "" or (len(s) <= 63 and _NAME_PART_RE.fullmatch(s) is not None)


def is_dns_subdomain(s: str) -> bool:
    return len(s) <= 253 and _DNS_SUBDOMAIN_RE.fullmatch(s) is not None


def is_qualified_name(s: str) -> bool:
    """``[prefix/]name``: a DNS-subdomain prefix and a name of at most 63 characters (label and annotation keys,
    condition types)."""
    prefix, sep, name = s.rpartition("/")
    if sep and not is_dns_subdomain(prefix):
        return False
    return len(name) <= 63 and _NAME_PART_RE.fullmatch(name) is not None


def is_extended_resource_name(s: str) -> bool:
    """The kubelet's rule at Register: ``domain/name``, outside every ``*kubernetes.io/`` domain (the native
    resources), not starting ``requests.``, and still a qualified name once quota prefixes it with ``requests.``."""
    if "/" not in s or "kubernetes.io/" in s or s.startswith("requests."):
        return False
    return is_qualified_name("requests." + s)


def is_reason_code(s: str) -> bool:
    """Reason codes are lower-case words joined by single hyphens (``xid-79``, ``ecc-uncorrected``)."""
    return REASON_CODE_RE.fullmatch(s) is not None


def check_prefix(prefix: str) -> str:
    """The annotation prefix must be a DNS subdomain the project owns: never a Kubernetes-reserved one."""
    if not is_dns_subdomain(prefix):
        raise ValueError(f"expected a DNS subdomain (lower-case, dot-separated, at most 253 chars), got {prefix!r}")
    for reserved in RESERVED_DOMAINS:
        if prefix == reserved or prefix.endswith("." + reserved):
            raise ValueError(f"{prefix!r} is reserved for Kubernetes itself; use a domain you own")
    return prefix


def check_node_name(name: str) -> str:
    """A node name is a DNS subdomain; the empty string means "unknown" (reporting off)."""
    if name and not is_dns_subdomain(name):
        raise ValueError(f"expected a node name (a lower-case DNS subdomain), got {name!r}")
    return name


def check_condition_type(v: str) -> str:
    """A node condition type of our own: a qualified name (at most 316 characters, as metav1.Condition allows)."""
    if not is_qualified_name(v) or len(v) > 316:
        raise ValueError(f"expected a condition type like GPUHealthy (a qualified name), got {v!r}")
    if v in KUBELET_CONDITIONS:
        raise ValueError(f"{v!r} belongs to the kubelet or the cloud provider; pick a type of our own")
    return v


class Choice:
    """A config value parser for one of a fixed set of words; the set is kept so ``--help`` can list it. Shared by
    the plugin's and the fleet controller's options."""

    def __init__(self, *options: str) -> None:
        self.options = options

    def __call__(self, v: Any) -> str:
        if v not in self.options:
            raise ValueError(f"expected one of {', '.join(self.options)}, got {v!r}")
        return str(v)
