"""scripts/local-cluster up | down | status: a throw-away Kubernetes cluster on this machine (docs/local-cluster.md).

up      build or reuse the binaries and images, start every component, wait for the node to be Ready, and print
        one JSON object (kubeconfig, node_name, node_file, nvml_node_file, plugin_image, workload_image, logs, ...)
status  the same JSON while the cluster runs (exit 1 when none is up)
down    stop everything and remove every process, mount, interface and directory up made
deploy  apply the plugin (kubectl apply -k manifests/overlays/local-cluster) and wait until the Node shows its GPUs;
        --overlay local-cluster-nvml runs it on the NVML backend over the NVML stand-in instead
reboot  "reboot" the node: stop the kubelet, the containers and containerd, write a new boot id, clear what a reboot
        clears from the node files, start containerd and the kubelet again (overlays/local-cluster-reboot)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from scripts.localcluster import cluster  # noqa: E402


def _images() -> dict[str, Any]:
    from scripts.localcluster import images

    try:
        built = images.build_images(log=cluster.log)
    except images.ImageBuildError as exc:
        raise cluster.ClusterError(f"building the images failed: {exc}") from exc
    return {name: {"ref": img.ref, "archive": str(img.archive)} for name, img in built.items()}


def _binaries() -> dict[str, Path]:
    from scripts.localcluster import binaries

    try:
        return binaries.build_all(log=True)
    except binaries.BuildErrors as exc:
        raise cluster.ClusterError(f"building the cluster's binaries failed: {str(exc).splitlines()[0]}") from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="local-cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("up", "down", "status", "deploy", "reboot"))
    parser.add_argument("--timeout", type=float, default=240, help="seconds to wait for each component (up)")
    parser.add_argument("--overlay", default="local-cluster", metavar="NAME",
                        help="the overlay of manifests/overlays that deploy applies (default %(default)s)")
    args = parser.parse_args(argv)
    c = cluster.Cluster()
    try:
        if args.command == "up":
            info = c.up(_images, _binaries, ready_timeout=args.timeout)
            print(json.dumps(info, indent=2))
        elif args.command == "status":
            status = c.status()
            if status is None:
                print("local-cluster: no cluster is up", file=sys.stderr)
                return 1
            print(json.dumps(status, indent=2))
            return 0 if status["running"] else 1
        elif args.command == "deploy":
            print(json.dumps(c.deploy(args.overlay), indent=2))
        elif args.command == "reboot":
            if c.status() is None:
                raise cluster.ClusterError("no cluster is up: `scripts/local-cluster up` first")
            print(json.dumps(c.reboot(timeout=args.timeout), indent=2))
        else:
            removed = c.down()
            left = cluster.leftovers()
            for what in removed:
                cluster.log(f"removed {what}")
            if not left.empty():
                print(f"local-cluster: down left things behind: {left}", file=sys.stderr)
                return 1
            cluster.log("nothing left behind")
    except cluster.ClusterError as exc:
        print(f"local-cluster: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("local-cluster: interrupted (run `scripts/local-cluster down` to remove what was made)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
