"""Command line: ``run`` (the default), ``demo``, ``status`` and ``watch``."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plugin import config as config_mod

SUBCOMMANDS = ("run", "demo", "status", "watch")
EXIT_CONFIG = 2


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, metavar="FILE", default=os.environ.get("GPU_HEALTH_CONFIG"),
                   help="versioned config file (YAML or JSON, version: v1); env GPU_HEALTH_CONFIG")
    for o in config_mod.OPTIONS:
        help_text = f"{o.help} (env {o.env}; default {o.default})"
        if o.is_bool:
            p.add_argument(o.flag, dest=o.name, nargs="?", const="true", default=None, metavar="BOOL",
                           help=help_text)
        else:
            p.add_argument(o.flag, dest=o.name, default=None, metavar=o.metavar or o.name.upper(), help=help_text)


def _health_socket_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--health-socket", type=Path, default=None,
                   help="health API socket (default: env GPU_HEALTH_HEALTH_SOCKET, else "
                        "/var/lib/gpu-health-device-plugin/health.sock)")
    p.add_argument("--output", "-o", choices=("table", "json"), default="table")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpu-health-plugin",
        description="Kubernetes device plugin for NVIDIA GPUs with fine-grained health. "
                    "Without a subcommand, 'run' is assumed.")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="serve the device plugin (the DaemonSet's job)")
    _add_run_flags(run)
    demo = sub.add_parser("demo", help="run on a simulated 8-GPU node against an embedded kubelet stand-in")
    demo.add_argument("--duration", type=float, default=20.0, help="seconds of scripted faults (default 20)")
    demo.add_argument("--plain", action="store_true", help="print updates line by line instead of redrawing")
    status = sub.add_parser("status", help="print every device's state and reasons from a running plugin")
    _health_socket_arg(status)
    watch = sub.add_parser("watch", help="stream transitions from a running plugin, one line each")
    _health_socket_arg(watch)
    watch.add_argument("--since", type=int, default=0, help="resume after this sequence number")
    watch.add_argument("--count", type=int, default=0, help="exit after this many transitions (0: never)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0] not in SUBCOMMANDS and args_list[0] not in ("-h", "--help")):
        args_list.insert(0, "run")
    args = build_parser().parse_args(args_list)
    if args.command == "run":
        return _run(args)
    if args.command == "demo":
        from plugin.demo import run_demo
        return run_demo(duration_s=args.duration, plain=args.plain or not sys.stdout.isatty())
    if args.command in ("status", "watch"):
        return _client(args)
    return 1


def _run(args: argparse.Namespace) -> int:
    from plugin import logs

    flags = {o.name: getattr(args, o.name) for o in config_mod.OPTIONS}
    try:
        cfg = config_mod.load(flags, os.environ, args.config)
    except config_mod.ConfigError as exc:
        print(f"gpu-health-plugin: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    logs.setup(cfg.log_level, cfg.log_format)
    from plugin.app import run
    from plugin.devices.backend import BackendError
    from plugin.devices.simulated import NodeFileError

    try:
        return run(cfg)
    except NodeFileError as exc:
        print(f"gpu-health-plugin: simulated node file rejected: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except BackendError as exc:
        print(f"gpu-health-plugin: cannot start the {cfg.backend} backend: {exc}\n"
              "  (set --fail-on-init-error=false to keep serving with no devices)", file=sys.stderr)
        return 1


def _socket_path(args: argparse.Namespace) -> Path:
    if args.health_socket:
        return Path(args.health_socket)
    env = os.environ.get("GPU_HEALTH_HEALTH_SOCKET")
    if env:
        return Path(env)
    state = os.environ.get("GPU_HEALTH_STATE_DIR", "/var/lib/gpu-health-device-plugin")
    return Path(state) / "health.sock"


def _ts(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if t else "-"


def _reasons(rs: Any) -> list[dict[str, str]]:
    return [{"code": r.code, "message": r.message, "action": r.action} for r in rs]


def _client(args: argparse.Namespace) -> int:
    import grpc

    from api.gpuhealth.v1alpha1 import health_pb2, health_pb2_grpc

    path = _socket_path(args)
    if not path.exists():
        print(f"gpu-health-plugin: no health socket at {path} (is the plugin running? see --health-socket)",
              file=sys.stderr)
        return 1
    with grpc.insecure_channel(f"unix://{path}") as ch:
        stub = health_pb2_grpc.DeviceHealthStub(ch)
        try:
            if args.command == "status":
                resp = stub.List(health_pb2.ListRequest(), timeout=10)
                _print_status(resp, args.output)
                return 0
            seen = 0
            for ev in stub.Watch(health_pb2.WatchRequest(since_seq=args.since)):
                if ev.WhichOneof("event") != "transition":
                    continue
                t = ev.transition
                if args.output == "json":
                    print(json.dumps({"seq": t.seq, "id": t.id, "from": t.from_state, "to": t.to_state,
                                      "reasons": _reasons(t.reasons), "time": _ts(t.time)}), flush=True)
                else:
                    why = "; ".join(f"{r.code}: {r.message}" for r in t.reasons) or "-"
                    print(f"#{t.seq} {_ts(t.time)} {t.id} {t.from_state} -> {t.to_state}  {why}", flush=True)
                seen += 1
                if args.count and seen >= args.count:
                    return 0
        except grpc.RpcError as exc:
            print(f"gpu-health-plugin: health API error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
    return 0


def _print_status(resp: Any, output: str) -> None:
    if output == "json":
        devices = [{"id": d.id, "state": d.state, "reasons": _reasons(d.reasons), "since": _ts(d.since)}
                   for d in resp.devices]
        print(json.dumps({"devices": devices}, indent=2))
        return
    rows = [("ID", "IDX", "STATE", "KUBELET", "SINCE", "REASONS")]
    for d in resp.devices:
        why = "; ".join(f"{r.code} ({r.action})" for r in d.reasons) or "-"
        rows.append((d.id, str(d.index), d.state, d.kubelet_health, _ts(d.since), why))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=False)) + "  " + r[5])
