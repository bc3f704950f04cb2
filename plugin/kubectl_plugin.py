"""``kubectl gpu-health``: nodes x devices x states x reasons, read from the node annotations.

Installed as the executable ``kubectl-gpu_health``; kubectl runs it for ``kubectl gpu-health``. It asks ``kubectl``
itself for the nodes (``kubectl get nodes -o json``), so every kubeconfig, context and credential plugin works as it
does for kubectl. ``--from-file`` reads a saved node list instead (``kubectl get nodes -o json > nodes.json``).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plugin.health.reasons import State
from plugin.outlets.annotations import STATE_KEY, DeviceEntry, parse_node
from plugin.outlets.kubecommon import DEFAULT_PREFIX
from plugin.validation import check_prefix

STATES = tuple(s.value for s in State)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubectl gpu-health",
                                description="GPU device health of every node, from the plugin's node annotations.")
    p.add_argument("--node", "-n", action="append", default=[], metavar="NAME",
                   help="only nodes matching this name or glob (repeatable)")
    p.add_argument("--state", "-s", action="append", default=[], metavar="STATE",
                   help=f"only devices in these states (repeatable or comma-separated: {', '.join(STATES)})")
    p.add_argument("--output", "-o", choices=("table", "json"), default="table")
    p.add_argument("--prefix", default=os.environ.get("GPU_HEALTH_ANNOTATION_PREFIX", DEFAULT_PREFIX),
                   help=f"annotation prefix the plugin writes under (default {DEFAULT_PREFIX})")
    p.add_argument("--selector", "-l", default="", help="label selector passed to kubectl get nodes")
    p.add_argument("--kubeconfig", default=None, help="passed to kubectl")
    p.add_argument("--context", default=None, help="passed to kubectl")
    p.add_argument("--kubectl", default=os.environ.get("KUBECTL", "kubectl"), help="kubectl to run (env KUBECTL)")
    p.add_argument("--from-file", type=Path, default=None, metavar="FILE",
                   help="read a node list (kubectl get nodes -o json) from FILE ('-' for stdin) instead")
    return p


def _states(values: list[str]) -> set[str]:
    out: set[str] = set()
    by_lower = {s.lower(): s for s in STATES}
    for v in values:
        for item in (x.strip() for x in v.split(",")):
            if not item:
                continue
            if item.lower() not in by_lower:
                raise ValueError(f"--state: expected one of {', '.join(STATES)}, got {item!r}")
            out.add(by_lower[item.lower()])
    return out


def _nodes(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.from_file is not None:
        source = "--from-file -: stdin" if str(args.from_file) == "-" else f"--from-file {args.from_file}"
        try:
            text = sys.stdin.read() if str(args.from_file) == "-" else args.from_file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise RuntimeError(f"{source}: cannot read: {exc}") from None
    else:
        cmd = [args.kubectl, "get", "nodes", "-o", "json"]
        if args.selector:
            cmd += ["-l", args.selector]
        if args.kubeconfig:
            cmd += ["--kubeconfig", args.kubeconfig]
        if args.context:
            cmd += ["--context", args.context]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"cannot run {args.kubectl}: {exc}") from None
        if proc.returncode != 0:
            raise RuntimeError(f"kubectl get nodes failed: {proc.stderr.strip()}")
        text = proc.stdout
        source = f"{args.kubectl} get nodes -o json"
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        # Which input, and where in it: a node list saved by hand is often truncated or not JSON at all.
        raise RuntimeError(f"{source}: not a JSON node list: {exc.msg} at line {exc.lineno} column {exc.colno}"
                           ) from None
    items = doc.get("items", [doc]) if isinstance(doc, dict) else []
    if not isinstance(items, list):
        raise RuntimeError(f"{source}: not a node list: 'items' is not a list")
    return [n for n in items if isinstance(n, dict) and n.get("kind", "Node") == "Node"]


def collect(nodes: list[dict[str, Any]], prefix: str, node_globs: Sequence[str],
            states: set[str]) -> tuple[list[DeviceEntry], list[str]]:
    """Matching device entries, and the matching nodes that carry no annotations of ours."""
    entries: list[DeviceEntry] = []
    silent: list[str] = []
    for n in sorted(nodes, key=lambda n: str(n.get("metadata", {}).get("name", ""))):
        meta = n.get("metadata", {})
        name = str(meta.get("name", ""))
        if node_globs and not any(fnmatch.fnmatchcase(name, g) for g in node_globs):
            continue
        annotations = meta.get("annotations") or {}
        if f"{prefix}/{STATE_KEY}" not in annotations:
            silent.append(name)
            continue
        entries += [e for e in parse_node(name, annotations, prefix) if not states or e.state in states]
    return entries, silent


def _reasons(e: DeviceEntry) -> str:
    if not e.reasons:
        return "-"
    return "; ".join(f"{r.get('code', '?')}: {r['message']}" if r.get("message") else r.get("code", "?")
                     for r in e.reasons)


def render_table(entries: list[DeviceEntry]) -> str:
    header = ("NODE", "DEVICE", "ID", "STATE", "ACTION", "SINCE", "REASONS")
    rows = [header] + [(e.node, e.key, e.id, e.state, e.action or "-", e.since or "-", _reasons(e))
                       for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "   " + r[-1]
                     for r in rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        prefix = check_prefix(args.prefix)
        states = _states(args.state)
        entries, silent = collect(_nodes(args), prefix, args.node, states)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"kubectl gpu-health: {exc}", file=sys.stderr)
        return 1
    if args.output == "json":
        print(json.dumps({"devices": [{"node": e.node, "device": e.key, "id": e.id, "state": e.state,
                                       "action": e.action, "since": e.since, "lastTransition": e.last_transition,
                                       "reasons": list(e.reasons)} for e in entries],
                          "nodesWithoutData": silent}, indent=2))
        return 0
    if entries:
        print(render_table(entries))
    else:
        print("No matching GPU devices." if not silent else "No matching GPU devices with health annotations.")
    if silent and not states:
        print(f"\n{len(silent)} node(s) without {prefix} annotations: {', '.join(silent[:10])}"
              f"{' ...' if len(silent) > 10 else ''}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
