"""The leaf every config section and outlet checks values with: Kubernetes names and listen addresses.

Nothing here imports the rest of the plugin, so any layer can use it.
"""

from __future__ import annotations


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
