"""Command line: ``run`` (the default), ``demo``, ``status``, ``watch``, ``clear``, ``inspect``,
``simulated-node``, ``kernel-log-relay`` and ``migrate-config``."""

from __future__ import annotations

import argparse
import datetime as dt
import difflib
import json
import logging
import math
import os
import shutil
import signal
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from plugin import config as config_mod
from plugin.config import nvidia
from plugin.options.flags import add_arguments
from plugin.options.sources import config_path
from plugin.stdout import reader_gone
from plugin.version import VersionAction

SUBCOMMANDS = ("run", "demo", "status", "watch", "clear", "inspect", "simulated-node", "kernel-log-relay",
               "migrate-config")
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, metavar="FILE", default=None,
                   help="versioned config file (YAML or JSON, version: v1; env GPU_HEALTH_CONFIG; default: none)")
    add_arguments(p, config_mod.OPTIONS)


def _health_socket_arg(p: argparse.ArgumentParser, outputs: tuple[str, ...] = ("table", "json")) -> None:
    sock, state = config_mod.option("health_socket"), config_mod.option("state_dir")
    p.add_argument("--health-socket", type=Path, default=None, metavar="PATH",
                   help=f"the plugin's health API socket (env {sock.env}; default: health.sock in the state dir)")
    p.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                   help=f"the plugin's state dir, where health.sock lives unless --health-socket or {sock.env} "
                        f"says otherwise (env {state.env}; default {state.default})")
    p.add_argument("--output", "-o", choices=outputs, default="table",
                   help="output format: %(choices)s (default %(default)s)"
                        + ("; table fits the terminal's width, wide never cuts a line" if "wide" in outputs else ""))


def _note(v: str) -> str:
    """--note, checked as the server checks it, so a bad one is exit 2 before anything is dialled."""
    from plugin.outlets.health_api import BadClear, check_note

    try:
        return check_note(v)
    except BadClear as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _code(v: str) -> str:
    """--reason: a reason code as written; whether the device has it, the plugin says."""
    from plugin.outlets.health_api import BadClear, check_code

    try:
        return check_code(v)
    except BadClear as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(v: str) -> float:
    """argparse reports a failure here as one line naming the flag, with exit 2."""
    try:
        f = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {v!r}") from None
    if not (f > 0 and math.isfinite(f)):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {v!r}")
    return f


def _non_negative(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {v!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {v!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpu-health-plugin",
        description="Kubernetes device plugin for NVIDIA GPUs with fine-grained health. "
                    "Without a subcommand, 'run' is assumed.")
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="serve the device plugin (the DaemonSet's job)")
    _add_run_flags(run)
    demo = sub.add_parser("demo", help="run on a simulated 8-GPU node against an embedded kubelet stand-in")
    demo.add_argument("--duration", type=_seconds, default=20.0, metavar="SECONDS",
                      help="seconds of scripted faults, a positive number (default 20)")
    demo.add_argument("--plain", action="store_true", help="print updates line by line instead of redrawing")
    status = sub.add_parser("status", help="print every device's state and reasons from a running plugin")
    _health_socket_arg(status, ("table", "wide", "json"))
    watch = sub.add_parser("watch", help="stream transitions from a running plugin, one line each")
    _health_socket_arg(watch)
    watch.add_argument("--since", type=_non_negative, default=0, metavar="SEQ",
                       help="resume after this sequence number (default 0: from now)")
    watch.add_argument("--count", type=_non_negative, default=0, metavar="N",
                       help="exit after this many transitions (default 0: never)")
    clear = sub.add_parser("clear", help="take a fixed fault off a device (or every device) of a running plugin",
                           description="Clear latched or held faults once the cause is fixed. Refused, with the "
                                       "reason, while the condition is still present (a polled fault still seen, a "
                                       "lost GPU still lost). The note goes into the history and the Event.")
    clear.add_argument("device", nargs="?", default=None, metavar="DEVICE",
                       help="a GPU UUID, a MIG device UUID or a GPU index (as `status` shows them)")
    clear.add_argument("--all", action="store_true", help="every device instead of one")
    clear.add_argument("--reason", type=_code, default=None, metavar="CODE",
                       help="clear only this reason code, e.g. xid-79 (default: every clearable reason)")
    clear.add_argument("--note", type=_note, required=True, metavar="TEXT",
                       help="why it is cleared (what was fixed, a ticket): one line, at most 256 characters")
    _health_socket_arg(clear)
    clear.set_defaults(clear_parser=clear)  # for the one check argparse cannot make: DEVICE or --all
    inspect = sub.add_parser("inspect", help="print what NVML reports for each GPU and which health checks are on, "
                                              "off or unavailable, and why")
    state = config_mod.option("state_dir")
    inspect.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                         help=f"the plugin's state dir, for the NVLink links seen before and the NVML calls that "
                              f"crashed it (env {state.env}; default {state.default}; read, never written)")
    inspect.add_argument("--output", "-o", choices=("table", "json"), default="table",
                         help="output format: %(choices)s (default %(default)s)")
    relay = sub.add_parser("kernel-log-relay", help="copy the kernel log to a FIFO the plugin reads with --kernel-log "
                                                    "(a privileged container of its own; docs/kernel-log.md)")
    relay.add_argument("--from", dest="source", type=Path, default=Path("/dev/kmsg"), metavar="PATH",
                       help="the kernel log (default %(default)s)")
    relay.add_argument("--to", dest="fifo", type=Path, required=True, metavar="FIFO",
                       help="the FIFO to write, made (mode 0600) if it does not exist")
    node = sub.add_parser("simulated-node", help="write the built-in simulated 8-GPU node (the demo's) as a node "
                                                 "file for --backend simulated --simulated-node")
    node.add_argument("--write", type=Path, required=True, metavar="FILE", help="where to write it")
    node.add_argument("--force", action="store_true", help="replace FILE if it exists")
    migrate = sub.add_parser("migrate-config", help="print NVIDIA's device plugin config file as ours, or its Helm "
                                                    "values as our chart's; what cannot carry over is named on "
                                                    "stderr and the exit is 3 (docs/deploy.md)")
    migrate.add_argument("file", type=Path, metavar="FILE", help="NVIDIA's config file or Helm values file")
    for each in sub.choices.values():
        # An unknown flag is answered with the usage of the subcommand it was given to, not the top level's.
        each.set_defaults(command_parser=each)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and not args_list[0].startswith("-") and args_list[0] not in SUBCOMMANDS:
        # Only a flag means the default "run": a bare word is a subcommand, and a mistyped one is said as such
        # rather than refused as an argument of run.
        print(f"gpu-health-plugin: {_unknown_subcommand(args_list[0])}", file=sys.stderr)
        return EXIT_CONFIG
    # The top-level flags stay the top parser's: "run --version" would be an unknown flag of run.
    if not args_list or (args_list[0] not in SUBCOMMANDS and args_list[0] not in ("-h", "--help", "--version")):
        args_list.insert(0, "run")
    env: Mapping[str, str] = os.environ
    if args_list[0] == "run":
        # NVIDIA's flags and variables become ours (or are refused) before argparse sees them: it knows only ours.
        try:
            adopted = nvidia.adopt(args_list[1:], os.environ)
        except config_mod.ConfigError as exc:
            print(f"gpu-health-plugin: invalid configuration: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        for note in adopted.notes:
            print(f"gpu-health-plugin: warning: {note}", file=sys.stderr)
        args_list, env = ["run", *adopted.argv], adopted.env
    args, extra = build_parser().parse_known_args(args_list)
    if extra:
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "clear" and (not args.device) == (not args.all):
        args.clear_parser.error("name one DEVICE or --all" if not args.device
                                else "DEVICE and --all: name one, not both")
    if args.command in ("run", "demo"):
        try:
            return _run(args, env) if args.command == "run" else _demo(args)
        except KeyboardInterrupt:
            # Ctrl-C before the signal handlers were in place (while starting): one line, not a traceback.
            print(f"gpu-health-plugin {args.command}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
    if args.command == "migrate-config":
        return _migrate_config(args.file)
    if args.command in ("status", "watch", "clear"):
        try:
            rc = _client(args)
            sys.stdout.flush()  # a reader gone away is seen here, not in the interpreter's final flush
            return rc
        except BrokenPipeError:
            # `status | head -1`: as a `--count` watch that reached its count, exit 0 and print nothing.
            return reader_gone()
        except KeyboardInterrupt:  # Ctrl-C before the stream started (watch stops on it with 0 by design)
            return EXIT_INTERRUPTED
    if args.command == "simulated-node":
        return _write_simulated_node(args.write, args.force)
    if args.command == "kernel-log-relay":
        return _relay(args.source, args.fifo)
    if args.command == "inspect":
        return _inspect(args)
    return 1


def _unknown_subcommand(word: str) -> str:
    close = difflib.get_close_matches(word, SUBCOMMANDS, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f" (one of: {', '.join(SUBCOMMANDS)})"
    return f"unknown subcommand '{word}'{hint}"


def _demo(args: argparse.Namespace) -> int:
    from plugin.devtools.demo import run_demo
    return run_demo(duration_s=args.duration, plain=args.plain or not sys.stdout.isatty())


def _relay(source: Path, fifo: Path) -> int:
    from plugin.devices.kmsgrelay import Relay

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    relay = Relay(source, fifo)
    try:
        relay.prepare()
    except OSError as exc:
        print(f"gpu-health-plugin kernel-log-relay: --to {fifo}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_CONFIG
    signal.signal(signal.SIGTERM, lambda *_: relay.wake())
    signal.signal(signal.SIGINT, lambda *_: relay.wake())
    logging.getLogger(__name__).info("kernel-log-relay: copying %s to %s for each reader", source, fifo)
    relay.run()
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from plugin.devices.backend import BackendError
    from plugin.devices.nvml import NvmlBackend

    state = config_mod.option("state_dir")
    state_dir = args.state_dir or Path(os.environ.get(state.env) or str(state.default))
    if (args.state_dir or os.environ.get(state.env)) and not state_dir.is_dir():
        # Named on purpose: a typo would silently hide the calls that crashed the plugin there.
        named = "--state-dir" if args.state_dir else state.env
        print(f"gpu-health-plugin inspect: {named} {state_dir}: not a directory", file=sys.stderr)
        return EXIT_CONFIG
    try:
        # The default dir missing means no plugin has run on this node: nothing to learn from it.
        backend = NvmlBackend(state_dir=state_dir if state_dir.is_dir() else None, read_only=True)
    except BackendError as exc:
        print(f"gpu-health-plugin inspect: {exc}", file=sys.stderr)
        return 1
    try:
        for gpu in backend.discover().gpus:
            backend.read(gpu)  # one read of every signal: what is on, off or unavailable shows only then
        report = backend.describe()
    finally:
        backend.close()
    if args.output == "json":
        print(json.dumps({"driver": backend.driver, "gpus": report}, indent=2))
        return 0
    print(format_inspect(backend.driver, report))
    return 0


def format_inspect(driver: str, report: Sequence[Mapping[str, Any]]) -> str:
    if not report:
        return f"driver {driver or '?'}: NVML reports no GPU"
    lines = []
    for g in report:
        lines.append(f"GPU {g['index']}  {g['uuid']}  {g['name']}  ({g['architecture']}, driver {g['driver']})")
        ecc = {True: "on", False: "off", None: "n/a"}[g["ecc_mode"]]
        mig = {True: "on", False: "off", None: "n/a"}[g["mig_mode"]]
        links = f"{g['links_active']} active of {g['link_slots']} slots" if g["link_slots"] else "none"
        lines.append(f"  NVLink {links}   ECC {ecc}   MIG {mig}   fabric {g['fabric_state'] or 'n/a'}   "
                     f"events 0x{g['events']:x}")
        width = max(len(k) for k in g["checks"])
        for check, how in g["checks"].items():
            lines.append(f"  {check:<{width}}  {how}")
    return "\n".join(lines)


def _write_simulated_node(path: Path, force: bool) -> int:
    from plugin.devices.simulated import write_node_file

    if path.exists() and not force:
        print(f"gpu-health-plugin: --write {path}: the file exists (add --force to replace it)", file=sys.stderr)
        return EXIT_CONFIG
    try:
        write_node_file(path)
    except OSError as exc:
        print(f"gpu-health-plugin: --write {path}: cannot write it: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"wrote the built-in 8-GPU node to {path}; its format: docs/simulated-node.md", file=sys.stderr)
    return 0


def _migrate_config(path: Path) -> int:
    from plugin.config.migrate import EXIT_PARTIAL, migrate, render

    try:
        m = migrate(path, "migrate-config")
    except config_mod.ConfigError as exc:
        print(f"gpu-health-plugin: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    sys.stdout.write(render(m))
    for line in m.dropped:
        print(f"gpu-health-plugin migrate-config: {line}", file=sys.stderr)
    for line in m.lost:
        print(f"gpu-health-plugin migrate-config: not carried over: {line}", file=sys.stderr)
    return EXIT_PARTIAL if m.lost else 0


def _run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from plugin import logs

    flags = {o.name: getattr(args, o.name) for o in config_mod.OPTIONS}
    try:
        config_file, config_label = config_path(args.config, env, "--config", "GPU_HEALTH_CONFIG")
        cfg = config_mod.load(flags, env, config_file, config_label)
    except config_mod.ConfigError as exc:
        print(f"gpu-health-plugin: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    logs.setup(cfg.log_level, cfg.log_format)
    from plugin.app import run
    from plugin.devices.backend import BackendError
    from plugin.devices.simulated import NodeFileError
    from plugin.dra.checkpoint import CheckpointTooNew
    from plugin.startup import StartupError

    # Exit 2: the configuration or the node file is wrong. Exit 1: the environment is (a path that cannot be
    # used, another instance on the state dir, NVML missing).
    try:
        return run(cfg)
    except NodeFileError as exc:
        print(f"gpu-health-plugin: {cfg.name_of('simulated_node')}: simulated node file rejected: {exc}",
              file=sys.stderr)
        return EXIT_CONFIG
    except CheckpointTooNew as exc:
        # A downgrade: the node's prepared claims are in a file this version cannot read. Like a wrong config,
        # the operator has to choose (exit 2), and the file stays for the version that wrote it.
        print(f"gpu-health-plugin: cannot start: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except StartupError as exc:
        print(f"gpu-health-plugin: cannot start: {exc}", file=sys.stderr)
        return 1
    except BackendError as exc:
        print(f"gpu-health-plugin: cannot start the {cfg.backend} backend: {exc}\n"
              "  (set --fail-on-init-error=false to keep serving with no devices)", file=sys.stderr)
        return 1
    except OSError as exc:
        # A path problem the start-up checks did not foresee: still one line, not a traceback.
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"gpu-health-plugin: cannot start: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1


def _socket_path(args: argparse.Namespace, env: Mapping[str, str]) -> Path:
    """The socket the plugin serves its health API on, found the way the plugin picks it: --health-socket, then
    GPU_HEALTH_HEALTH_SOCKET, then health.sock in the state dir (--state-dir, GPU_HEALTH_STATE_DIR, the default)."""
    sock, state = config_mod.option("health_socket"), config_mod.option("state_dir")
    if args.health_socket is not None:
        path = Path(args.health_socket)
    elif env.get(sock.env):
        path = Path(env[sock.env])
    else:
        state_dir = args.state_dir or (Path(env[state.env]) if env.get(state.env) else Path(state.default))
        path = Path(state_dir) / "health.sock"
    # gRPC reads unix://a/b as host a, path /b: a relative path has to be made absolute to mean what it says.
    return path.absolute()


def _ts(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if t else "-"


def _reasons(rs: Any) -> list[dict[str, str]]:
    return [{"code": r.code, "message": r.message, "action": r.action, "source": r.source,
             "severity": r.severity} for r in rs]


def _why(rs: Any) -> str:
    """Each reason with its message and the action it asks for, spelt out: a bare "(none)" read as missing data."""
    return "; ".join(f"{r.code}: {r.message or '-'} (action: {r.action or '-'})" for r in rs) or "-"


def _transition_json(t: Any) -> dict[str, Any]:
    doc = {"seq": t.seq, "id": t.id, "from": t.from_state, "to": t.to_state, "reasons": _reasons(t.reasons),
           "time": _ts(t.time)}
    if t.note:  # only a clearance's transition has one, as in the state file's history
        doc["note"] = t.note
    return doc


def _transition_line(t: Any) -> str:
    why = _why(t.reasons)
    line = f"#{t.seq} {_ts(t.time)} {t.id} {t.from_state} -> {t.to_state}  {why}"
    return f"{line}  [{t.note}]" if t.note else line


def _client(args: argparse.Namespace) -> int:
    import grpc

    from api.gpuhealth.v1alpha1 import health_pb2, health_pb2_grpc

    path = _socket_path(args, os.environ)
    where = "set --health-socket PATH or --state-dir DIR (env GPU_HEALTH_HEALTH_SOCKET, GPU_HEALTH_STATE_DIR)"
    if not path.exists():
        print(f"gpu-health-plugin: no health socket at {path} (is the plugin running? {where})", file=sys.stderr)
        return 1
    if not path.is_socket():
        print(f"gpu-health-plugin: {path} is not a socket ({where})", file=sys.stderr)
        return 1
    with grpc.insecure_channel(f"unix://{path}") as ch:
        stub = health_pb2_grpc.DeviceHealthStub(ch)
        if args.command == "clear":
            return _clear(stub, args, path)
        try:
            # List first, for both commands: it answers at once, so "nothing listens on the socket" (a plugin that
            # died without removing it) is an error now rather than a watch that waits forever.
            resp = stub.List(health_pb2.ListRequest(), timeout=10)
        except grpc.RpcError as exc:
            print(f"gpu-health-plugin: cannot reach the plugin at {path}: {exc.code().name}: {exc.details()} "
                  "(is it running?)", file=sys.stderr)
            return 1
        if args.command == "status":
            print(format_status(resp, args.output, _status_width(args.output)))
            if args.output != "json":
                # On stderr, as watch's greeting is: stdout stays the table a script reads row by row. After the
                # table is out, so `status | head -1` stays quiet.
                sys.stdout.flush()
                print("\n".join(status_notes(resp)), file=sys.stderr)
            return 0
        # On stderr, so stdout carries only transitions in either output format.
        print(f"gpu-health-plugin: connected to the plugin at {path} ({len(resp.devices)} devices, last transition "
              f"#{resp.seq}); waiting for transitions (Ctrl-C to stop)", file=sys.stderr, flush=True)
        seen = 0
        try:
            # Without --since, resume from what List saw: a transition between the two calls is still shown.
            for ev in stub.Watch(health_pb2.WatchRequest(since_seq=args.since or resp.seq)):
                if ev.WhichOneof("event") != "transition":
                    continue
                t = ev.transition
                if args.output == "json":
                    print(json.dumps(_transition_json(t)), flush=True)
                else:
                    print(_transition_line(t), flush=True)
                seen += 1
                if args.count and seen >= args.count:
                    return 0
        except grpc.RpcError as exc:
            print(f"gpu-health-plugin: lost the plugin at {path}: {exc.code().name}: {exc.details()}",
                  file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
    # The server ends a Watch only when it shuts down: the plugin stopped or is restarting.
    print(f"gpu-health-plugin: the plugin at {path} closed the stream (it stopped or is restarting)",
          file=sys.stderr)
    return 1


def _clear(stub: Any, args: argparse.Namespace, path: Path) -> int:
    import grpc

    from api.gpuhealth.v1alpha1 import health_pb2

    req = health_pb2.ClearRequest(device=args.device or "", all=args.all, reason=args.reason or "", note=args.note)
    try:
        resp = stub.Clear(req, timeout=30)
    except grpc.RpcError as exc:
        code = exc.code()
        if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.INVALID_ARGUMENT):
            # The plugin's own one line: refused while the condition is present, or a device or reason it lacks.
            print(f"gpu-health-plugin clear: {exc.details()}", file=sys.stderr)
        elif code is grpc.StatusCode.UNIMPLEMENTED:
            print(f"gpu-health-plugin clear: the plugin at {path} does not serve clear ({exc.details()})",
                  file=sys.stderr)
        else:
            print(f"gpu-health-plugin: cannot reach the plugin at {path}: {code.name}: {exc.details()} "
                  "(is it running?)", file=sys.stderr)
        return 1
    if args.output == "json":
        print(json.dumps({"cleared": [{"id": c.id, "code": c.code} for c in resp.cleared]}))
        return 0
    for c in resp.cleared:
        print(f"cleared {c.code} on {c.id}")
    if not resp.cleared:
        # Not an error: what the operator wanted gone is gone (a second clear, or a fault that expired meanwhile).
        print(f"gpu-health-plugin clear: nothing to clear on {'any device' if args.all else args.device}",
              file=sys.stderr)
    return 0


def _cleared_json(d: Any) -> dict[str, str]:
    return {"text": d.cleared, "at": _ts(d.cleared_at)}


def _status_width(output: str) -> int | None:
    """The width a table is wrapped to: the terminal's ($COLUMNS first, as shutil has it) for ``table``; none for
    ``wide``, nor when stdout is a pipe or a file, where a script reads whole lines."""
    if output != "table" or not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size().columns


REASONS_MIN = 30  # columns the reasons need beside a row to stay readable; with fewer they go under it


def _wrapped(prefix: str, reasons: list[str], width: int | None) -> list[str]:
    """A row: its columns, then its reasons joined, or within ``width`` each reason wrapped on lines of its own,
    beside the row where there is room, else indented under it. Every line after the first starts with a space, so
    a script that reads rows by their first column skips them."""
    reasons = reasons or ["-"]
    if width is None or len(prefix) + len("; ".join(reasons)) <= width:
        return [prefix + "; ".join(reasons)]
    room = width - len(prefix)
    beside = room >= REASONS_MIN
    parts = [p for r in reasons
             for p in textwrap.wrap(r, room if beside else max(width - 4, REASONS_MIN), break_on_hyphens=False)]
    if beside:
        return [prefix + parts[0], *(" " * len(prefix) + p for p in parts[1:])]
    return [prefix.rstrip(), *("    " + p for p in parts)]


def _kubelet_line(resp: Any) -> str:
    if not resp.HasField("kubelet"):
        return "kubelet: registration not reported (the plugin predates it)"
    k = resp.kubelet
    if k.registered:
        return (f"kubelet: registered ({k.mode}, {k.registrations} registration{'' if k.registrations == 1 else 's'}, "
                f"last at {_ts(k.last_registered_at)})")
    return f"kubelet: NOT registered ({k.mode}): {k.last_error or 'not yet'}"


def _kubelet_json(resp: Any) -> dict[str, Any] | None:
    if not resp.HasField("kubelet"):
        return None
    k = resp.kubelet
    return {"mode": k.mode, "registered": k.registered, "registrations": k.registrations,
            "last_registered_at": _ts(k.last_registered_at), "last_error": k.last_error}


def _action(d: Any) -> str:
    # The worst reason's, as the annotations say it: the plugin sends reasons worst first.
    return str(d.reasons[0].action) if d.reasons else "none"


def format_status(resp: Any, output: str, width: int | None = None) -> str:
    """``status`` on stdout: a JSON document, or the table (one row per device, its clearance indented under it),
    the reasons wrapped to ``width`` when one is given; ``wide`` adds each reason's action. The table's notes are
    ``status_notes``."""
    if output == "json":
        devices = []
        for d in resp.devices:
            doc = {"id": d.id, "index": d.index, "name": d.name, "state": d.state, "kubelet_health": d.kubelet_health,
                   "action": _action(d), "reasons": _reasons(d.reasons), "since": _ts(d.since)}
            if d.cleared:  # the latest clearance, while it is recent
                doc["cleared"] = _cleared_json(d)
            devices.append(doc)
        return json.dumps({"devices": devices, "kubelet": _kubelet_json(resp),
                           "outlet_errors": dict(sorted(resp.outlet_errors.items()))}, indent=2)
    header = ("ID", "IDX", "STATE", "KUBELET", "SINCE", "ACTION")
    rows: list[tuple[tuple[str, ...], list[str], Any]] = [(header, ["REASONS"], None)]
    for d in resp.devices:
        # Wide adds each reason's own action: a second reason may ask for less than the device's ACTION.
        why = [_why([r]) if output == "wide" else f"{r.code}: {r.message or '-'}" for r in d.reasons]
        rows.append(((d.id, str(d.index), d.state, d.kubelet_health, _ts(d.since), _action(d)), why, d))
    widths = [max(len(cols[i]) for cols, _, _ in rows) for i in range(len(header))]
    lines: list[str] = []
    for cols, why, d in rows:
        prefix = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)) + "  "
        lines += _wrapped(prefix, why, width if d is not None else None)
        if d is not None and d.cleared:
            # Under its device, indented: the columns stay what a script cuts, the clearance stays readable.
            lines += _wrapped("    ", [f"{d.cleared} at {_ts(d.cleared_at)}"], width)
    return "\n".join(lines)


def status_notes(resp: Any) -> list[str]:
    """What the table's rows do not say: the kubelet registration, then each outlet that is failing now."""
    return [_kubelet_line(resp), *(f"outlet {name} failing: {err}" for name, err in sorted(resp.outlet_errors.items()))]
