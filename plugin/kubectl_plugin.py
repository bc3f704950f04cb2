"""``kubectl gpu-health``: nodes x devices x states x reasons, read from the node annotations.

Installed as the executable ``kubectl-gpu_health``; kubectl runs it for ``kubectl gpu-health``. It asks ``kubectl``
itself for the nodes (``kubectl get nodes -o json``), so every kubeconfig, context and credential plugin works as it
does for kubectl. ``--from-file`` reads a saved node list instead (``kubectl get nodes -o json > nodes.json``).

``kubectl gpu-health fleet`` (``fleet`` as the first word) is the fleet controller's view instead: the nodes it
quarantined and its circuit breaker, from the nodes and its Lease (plugin/controller/fleetview.py).
``kubectl gpu-health fleet release NODE --note TEXT`` asks the controller to release a repeat offender (the
``controller.<prefix>/release`` annotation, docs/fleet.md "Repeat offenders").
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

from plugin.controller import fleetview
from plugin.controller.nodes import CONTROLLER, Keys
from plugin.health.reasons import State
from plugin.kube.names import DEFAULT_PREFIX
from plugin.schema.annotations import DeviceEntry, decode
from plugin.stdout import reader_gone
from plugin.validation import check_prefix, is_dns_subdomain
from plugin.version import VersionAction

STATES = tuple(s.value for s in State)


def _prefix_arg(p: argparse.ArgumentParser, whose: str) -> None:
    p.add_argument("--prefix", default=os.environ.get("GPU_HEALTH_ANNOTATION_PREFIX", DEFAULT_PREFIX),
                   help=f"annotation prefix {whose} (default {DEFAULT_PREFIX})")


def _kubectl_args(p: argparse.ArgumentParser) -> None:
    """How kubectl is run: the same three flags on every subcommand."""
    p.add_argument("--kubeconfig", default=None, help="passed to kubectl")
    p.add_argument("--context", default=None, help="passed to kubectl")
    p.add_argument("--kubectl", default=os.environ.get("KUBECTL", "kubectl"), help="kubectl to run (env KUBECTL)")


def build_parser() -> argparse.ArgumentParser:
    # No abbreviated flags, as kubectl has none: --all must stay an error here (it is fleet's), not --all-nodes.
    p = argparse.ArgumentParser(prog="kubectl gpu-health", allow_abbrev=False,
                                description="GPU device health of every node, from the plugin's node annotations.",
                                epilog="kubectl gpu-health fleet: the nodes the fleet controller quarantined and its "
                                       "circuit breaker (see kubectl gpu-health fleet --help).")
    p.add_argument("--node", action="append", default=[], metavar="NAME",
                   help="only nodes matching this name or glob (repeatable); one that matches no node is an error")
    # -n is kubectl's --namespace everywhere; nodes have none, so it is taken and ignored as `kubectl get nodes`
    # does, and said, since -n once meant --node here.
    p.add_argument("--namespace", "-n", default=None, metavar="NS",
                   help="accepted for kubectl's sake and ignored: nodes are not namespaced (--node picks nodes)")
    p.add_argument("--all-nodes", action="store_true",
                   help="also name the nodes with neither our annotations nor GPU capacity (left out by default)")
    p.add_argument("--state", "-s", action="append", default=[], metavar="STATE",
                   help=f"only devices in these states (repeatable or comma-separated: {', '.join(STATES)})")
    p.add_argument("--output", "-o", choices=("table", "json"), default="table")
    _prefix_arg(p, "the plugin writes under")
    p.add_argument("--selector", "-l", default="", help="label selector passed to kubectl get nodes")
    _kubectl_args(p)
    p.add_argument("--from-file", type=Path, default=None, metavar="FILE",
                   help="read a node list (kubectl get nodes -o json) from FILE ('-' for stdin) instead")
    p.add_argument("--version", action=VersionAction)
    return p


def build_fleet_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubectl gpu-health fleet",
                                description="Nodes the fleet controller quarantined, why and since when, and its "
                                            "circuit breaker, from the nodes and the controller's Lease.",
                                epilog="kubectl gpu-health fleet release NODE --note TEXT: release a repeat "
                                       "offender (see kubectl gpu-health fleet release --help).")
    p.add_argument("--namespace", "-n", default=fleetview.DEFAULT_NAMESPACE,
                   help=f"namespace of the controller's Lease (default {fleetview.DEFAULT_NAMESPACE})")
    p.add_argument("--lease", default=fleetview.DEFAULT_LEASE,
                   help=f"name of the controller's Lease (default {fleetview.DEFAULT_LEASE})")
    p.add_argument("--output", "-o", choices=("table", "json"), default="table")
    p.add_argument("--all", action="store_true",
                   help="also list GPU nodes not quarantined but not Healthy (or with a capacity gap) as candidates")
    _prefix_arg(p, "of the plugin and the controller")
    _kubectl_args(p)
    p.add_argument("--from-file", type=Path, default=None, metavar="FILE",
                   help="read the node list (kubectl get nodes -o json) from FILE ('-' for stdin) instead")
    p.add_argument("--lease-file", type=Path, default=None, metavar="FILE",
                   help="read the Lease (kubectl get lease -n NS NAME -o json) from FILE ('-' for stdin) instead; "
                        "an empty file is a missing Lease")
    return p


def build_release_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubectl gpu-health fleet release",
                                description="Ask the fleet controller to release a node it holds as a repeat "
                                            "offender, and to reset the node's quarantine count: it annotates the "
                                            "node (controller.<prefix>/release=NOTE); the controller releases it "
                                            "once it has been fit for the recovery hold and removes the annotation. "
                                            "On a node it does not hold, the count is reset at once.")
    p.add_argument("node", metavar="NODE", help="the node's name")
    p.add_argument("--note", required=True, metavar="TEXT",
                   help="why (one line, kept in the annotation, the controller's log and its Event)")
    _prefix_arg(p, "of the plugin and the controller")
    _kubectl_args(p)
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


class BadInput(RuntimeError):
    """An input that is not what it should be (unreadable, not JSON, not the right kind of object)."""


def _read_file(path: Path, flag: str) -> tuple[str, str]:
    """The text of a saved input, and how to name it in an error."""
    source = f"{flag} -: stdin" if str(path) == "-" else f"{flag} {path}"
    try:
        return (sys.stdin.read() if str(path) == "-" else path.read_text()), source
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{source}: cannot read: {exc}") from None


def _kubectl(args: argparse.Namespace, words: list[str], what: str) -> str:
    cmd = [args.kubectl, *words]
    if args.kubeconfig:
        cmd += ["--kubeconfig", args.kubeconfig]
    if args.context:
        cmd += ["--context", args.context]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"cannot run {args.kubectl}: {exc}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl {what} failed: {proc.stderr.strip()}")
    return proc.stdout


def _json(text: str, source: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        # Which input, and where in it: a node list saved by hand is often truncated or not JSON at all.
        raise BadInput(f"{source}: not a JSON {what}: {exc.msg} at line {exc.lineno} column {exc.colno}") from None


def _nodes(args: argparse.Namespace, selector: str = "") -> list[dict[str, Any]]:
    if args.from_file is not None:
        text, source = _read_file(args.from_file, "--from-file")
    else:
        words = ["get", "nodes", "-o", "json"]
        if selector:
            words += ["-l", selector]
        text = _kubectl(args, words, "get nodes")
        source = f"{args.kubectl} get nodes -o json"
    doc = _json(text, source, "node list")
    items = doc.get("items", [doc]) if isinstance(doc, dict) else []
    if not isinstance(items, list):
        raise BadInput(f"{source}: not a node list: 'items' is not a list")
    return [n for n in items if isinstance(n, dict) and n.get("kind", "Node") == "Node"]


UNNAMED = "<no name>"  # a saved node list may hold a Node without metadata.name: never an empty column


def has_gpu_capacity(node: dict[str, Any]) -> bool:
    """Whether the node advertises any NVIDIA resource (nvidia.com/gpu, a MIG or shared resource) above zero."""
    status = node.get("status")
    capacity = status.get("capacity") if isinstance(status, dict) else None
    if not isinstance(capacity, dict):
        return False
    return any(str(k).startswith("nvidia.com/") and str(v).strip() not in ("", "0") for k, v in capacity.items())


def collect(nodes: list[dict[str, Any]], prefix: str, node_globs: Sequence[str], states: set[str],
            unreadable: list[str] | None = None, all_nodes: bool = False,
            unmatched: list[str] | None = None) -> tuple[list[DeviceEntry], list[str]]:
    """Matching device entries, and the matching nodes that carry no annotations of ours: only those with GPU
    capacity (a GPU node whose agent is not reporting) unless ``all_nodes``. ``unreadable`` gets one line per value
    past the codec's bounds (left out of the entries), ``unmatched`` each of ``node_globs`` that matched no node."""
    entries: list[DeviceEntry] = []
    silent: list[str] = []
    matched: set[str] = set()
    for n in sorted(nodes, key=lambda n: str(n.get("metadata", {}).get("name", ""))):
        meta = n.get("metadata", {})
        name = str(meta.get("name") or "") or UNNAMED
        hits = {g for g in node_globs if fnmatch.fnmatchcase(name, g)}
        if node_globs and not hits:
            continue
        matched |= hits
        agent = decode(meta.get("annotations") or {}, prefix, name)
        if unreadable is not None:
            unreadable += [f"{name}: {prefix}/{u.key}: {u.why}" for u in agent.unreadable]
        if not agent.annotated:
            if all_nodes or has_gpu_capacity(n):
                silent.append(name)
            continue
        entries += [e for e in agent.devices if e.state and (not states or e.state in states)]
    if unmatched is not None:
        unmatched += [g for g in node_globs if g not in matched]
    return entries, silent


def _reasons(e: DeviceEntry) -> str:
    text = "; ".join(f"{r.get('code', '?')}: {r['message']}" if r.get("message") else r.get("code", "?")
                     for r in e.reasons) or "-"
    if e.cleared is not None:
        # Last in the row: the columns a script cuts stay where they were, and a Healthy device says why it is.
        text += f" [{e.cleared.text}{f' at {e.cleared.at}' if e.cleared.at else ''}]"
    return text


def _entry_json(e: DeviceEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {"node": e.node, "device": e.key, "id": e.id, "state": e.state, "action": e.action,
                           "since": e.since, "lastTransition": e.last_transition, "reasons": list(e.reasons)}
    if e.cleared is not None:
        doc["cleared"] = {"codes": list(e.cleared.codes), "why": e.cleared.why, "at": e.cleared.at}
    return doc


def render_table(entries: list[DeviceEntry]) -> str:
    header = ("NODE", "DEVICE", "ID", "STATE", "ACTION", "SINCE", "REASONS")
    rows = [header] + [(e.node, e.key, e.id, e.state, e.action or "-", e.since or "-", _reasons(e))
                       for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "   " + r[-1]
                     for r in rows)


def _lease(args: argparse.Namespace) -> tuple[dict[str, Any] | None, str | None]:
    """The controller's Lease, or None and why it was not read (None as well: it does not exist)."""
    where = f"{args.namespace}/{args.lease}"
    if args.lease_file is not None:
        text, source = _read_file(args.lease_file, "--lease-file")
    elif args.from_file is not None:
        # Saved nodes with a live Lease would mix two moments; offline means offline.
        return None, f"lease {where} not read: nodes from --from-file, no --lease-file"
    else:
        words = ["get", "lease", "-n", args.namespace, args.lease, "-o", "json", "--ignore-not-found"]
        try:
            text = _kubectl(args, words, "get lease")
        except RuntimeError as exc:
            # The node table is still worth showing to someone who may not read Leases.
            return None, " ".join(str(exc).split())
        source = f"{args.kubectl} get lease -n {args.namespace} {args.lease} -o json"
    if not text.strip():  # what --ignore-not-found prints for a missing Lease
        return None, None
    doc = _json(text, source, "Lease")
    if isinstance(doc, dict) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
        items = doc["items"]
        if not items:
            return None, None
        doc = items[0]
    if not isinstance(doc, dict) or doc.get("kind", "Lease") != "Lease":
        kind = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
        raise BadInput(f"{source}: not a Lease: kind {kind!r}")
    return doc, None


def fleet_release_main(argv: Sequence[str]) -> int:
    args = build_release_parser().parse_args(argv)
    try:
        try:
            prefix = check_prefix(args.prefix)
        except ValueError as exc:
            raise ValueError(f"--prefix: {exc}") from None
        if not is_dns_subdomain(args.node):
            raise ValueError(f"NODE: expected a node name (a lower-case DNS subdomain), got {args.node!r}")
        note = " ".join(args.note.split())
        if not note:
            raise ValueError("--note: must not be empty: say why the node may come back")
        key = Keys(prefix).release
        # --overwrite: a request already there (not yet acted on) is replaced, not refused.
        out = _kubectl(args, ["annotate", "node", args.node, f"{key}={note}", "--overwrite"], "annotate node")
    except ValueError as exc:
        print(f"kubectl gpu-health fleet release: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as exc:
        print(f"kubectl gpu-health fleet release: {exc}", file=sys.stderr)
        return 1
    print(out.strip())
    print(f"release requested: {CONTROLLER} releases {args.node} once it has been fit for its recovery hold (at "
          f"once if it is not quarantined) and resets its quarantine count; see kubectl gpu-health fleet")
    return 0


def fleet_main(argv: Sequence[str]) -> int:
    if list(argv[:1]) == ["release"]:
        return fleet_release_main(argv[1:])
    args = build_fleet_parser().parse_args(argv)
    try:
        prefix = check_prefix(args.prefix)
        if not is_dns_subdomain(args.namespace) or "." in args.namespace or len(args.namespace) > 63:
            raise ValueError(f"--namespace: expected a namespace name (a lower-case DNS label), got {args.namespace!r}")
        if not is_dns_subdomain(args.lease):
            raise ValueError(f"--lease: expected a Lease name (a lower-case DNS subdomain), got {args.lease!r}")
        if str(args.from_file) == "-" and str(args.lease_file) == "-":
            raise ValueError("--lease-file -: stdin is already read by --from-file -")
        nodes = _nodes(args)
        lease, unavailable = _lease(args)
    except (ValueError, BadInput) as exc:
        print(f"kubectl gpu-health fleet: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as exc:
        print(f"kubectl gpu-health fleet: {exc}", file=sys.stderr)
        return 1
    flags = [*(["--kubeconfig", args.kubeconfig] if args.kubeconfig else []),
             *(["--context", args.context] if args.context else [])]
    view = fleetview.fleet(nodes, lease, namespace=args.namespace, lease_name=args.lease, prefix=prefix,
                           include_candidates=args.all, lease_unavailable=unavailable, kubectl_flags=flags)
    if args.output == "json":
        print(json.dumps(fleetview.to_json(view), indent=2))
        return 0
    print(fleetview.header(view))
    if (why := fleetview.breaker_reason(view)) is not None:
        print(f"breaker reason: {why}")
    print()
    if view.rows:
        print(fleetview.render_table(view.rows))
        if view.repeat_offenders:
            print(f"\n{view.repeat_offenders} repeat offender{'' if view.repeat_offenders == 1 else 's'}, held until "
                  f"an operator releases {'it' if view.repeat_offenders == 1 else 'them'}: kubectl gpu-health fleet "
                  f"release NODE --note TEXT (or {fleetview.release_command('NODE', prefix, flags)})")
    else:
        print(f"No nodes quarantined by {CONTROLLER}{' and no candidates' if args.all else ''}.")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        rc = _main(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a reader gone away is seen here, not in the interpreter's final flush
        return rc
    except BrokenPipeError:  # `kubectl gpu-health | head -1`
        return reader_gone()


def _main(words: list[str]) -> int:
    if words[:1] == ["fleet"]:
        return fleet_main(words[1:])
    args = build_parser().parse_args(words)
    if args.namespace is not None:
        print(f"kubectl gpu-health: -n/--namespace {args.namespace} ignored: nodes are not namespaced "
              "(--node NAME picks nodes)", file=sys.stderr)
    try:
        prefix = check_prefix(args.prefix)
        states = _states(args.state)
        unreadable: list[str] = []
        unmatched: list[str] = []
        entries, silent = collect(_nodes(args, args.selector), prefix, args.node, states, unreadable,
                                  all_nodes=args.all_nodes, unmatched=unmatched)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"kubectl gpu-health: {exc}", file=sys.stderr)
        return 1
    if unmatched:
        # A mistyped node name is not "no faults": say so, and fail, before anything reads like an answer.
        print(f"kubectl gpu-health: no node matches --node {', '.join(unmatched)}"
              f"{' (and -l ' + args.selector + ')' if args.selector else ''}", file=sys.stderr)
        return 1
    for line in unreadable:
        print(f"kubectl gpu-health: left out, not what an agent writes: {line}", file=sys.stderr)
    if args.output == "json":
        print(json.dumps({"devices": [_entry_json(e) for e in entries], "nodesWithoutData": silent}, indent=2))
        return 0
    if entries:
        print(render_table(entries))
    else:
        print("No matching GPU devices." if not silent else "No matching GPU devices with health annotations.")
    if silent and not states:
        gpu = "" if args.all_nodes else " but with GPU capacity (is the agent running there?)"
        print(f"\n{len(silent)} node(s) without {prefix} annotations{gpu}: {', '.join(silent[:10])}"
              f"{' ...' if len(silent) > 10 else ''}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
