"""A stand-in for NVIDIA's device plugin, as the kubelet sees it: it serves ``nvidia.com/gpu`` on NVIDIA's socket
name (``nvidia-gpu.sock``) in the kubelet's device-plugin directory, registers, lists the GPUs it was given by UUID
(NVIDIA's default ``deviceIDStrategy: uuid``) and answers Allocate with ``NVIDIA_VISIBLE_DEVICES`` only (its default
``deviceListStrategy: envvar``: the NVIDIA runtime, not the plugin, puts the device nodes in).

The migration story (tests/e2e/test_stories_migrate.py) runs it as a DaemonSet from the plugin's own image, whose
venv holds grpc and the generated v1beta1 API, with this file mounted from a ConfigMap: so it must import nothing of
``plugin`` or ``tests``. Like NVIDIA's plugin it serves and registers again when a new kubelet appears, and removes
its socket when it stops.

    python nvidia_device_plugin.py --device GPU-... --device GPU-... [--ready-file /tmp/registered]
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc

from api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

RESOURCE = "nvidia.com/gpu"
SOCKET = "nvidia-gpu.sock"
log = logging.getLogger("nvidia-standin")


class StandinPlugin(api_pb2_grpc.DevicePluginServicer):
    def __init__(self, devices: list[str], stop: threading.Event) -> None:
        self.devices = devices
        self.stop = stop

    def GetDevicePluginOptions(self, request: api_pb2.Empty, context: grpc.ServicerContext) -> \
            api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions()

    def ListAndWatch(self, request: api_pb2.Empty, context: grpc.ServicerContext) -> \
            Iterator[api_pb2.ListAndWatchResponse]:
        yield api_pb2.ListAndWatchResponse(devices=[api_pb2.Device(ID=d, health="Healthy") for d in self.devices])
        # Nothing changes on a stand-in: hold the stream open until the kubelet leaves or the plugin stops.
        left = threading.Event()
        context.add_callback(left.set)
        while not left.is_set() and not self.stop.is_set():
            left.wait(1.0)

    def Allocate(self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext) -> api_pb2.AllocateResponse:
        out = api_pb2.AllocateResponse()
        for req in request.container_requests:
            unknown = [d for d in req.devices_ids if d not in self.devices]
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown device: {unknown[0]}")
            out.container_responses.append(
                api_pb2.ContainerAllocateResponse(envs={"NVIDIA_VISIBLE_DEVICES": ",".join(req.devices_ids)}))
        return out

    def GetPreferredAllocation(self, request: api_pb2.PreferredAllocationRequest, context: grpc.ServicerContext) -> \
            api_pb2.PreferredAllocationResponse:
        # Its options say it has none, so the kubelet never asks.
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "no preferred allocation")
        return api_pb2.PreferredAllocationResponse()

    def PreStartContainer(self, request: api_pb2.PreStartContainerRequest, context: grpc.ServicerContext) -> \
            api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def serve(plugin_dir: Path, devices: list[str], ready_file: Path | None, stop: threading.Event) -> None:
    """Serve and register, then again whenever the kubelet's socket is replaced (a kubelet restart, which also
    wipes ours) or ours is gone, until ``stop``."""
    ours = plugin_dir / SOCKET
    kubelet = plugin_dir / "kubelet.sock"
    while not stop.is_set():
        ours.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        api_pb2_grpc.add_DevicePluginServicer_to_server(StandinPlugin(devices, stop), server)
        server.add_insecure_port(f"unix://{ours}")
        server.start()
        registered_with = _inode(kubelet)
        try:
            with grpc.insecure_channel(f"unix://{kubelet}") as channel:
                api_pb2_grpc.RegistrationStub(channel).Register(
                    api_pb2.RegisterRequest(version="v1beta1", endpoint=SOCKET, resource_name=RESOURCE,
                                            options=api_pb2.DevicePluginOptions()), timeout=10)
            log.info("Registered device plugin for '%s' with Kubelet (%d devices)", RESOURCE, len(devices))
            if ready_file is not None:
                tmp = ready_file.with_name(ready_file.name + ".tmp")
                tmp.write_text("registered\n")
                tmp.rename(ready_file)  # whole or absent, whenever the probe looks
            while not stop.wait(1.0):
                if _inode(kubelet) != registered_with or _inode(ours) is None:
                    log.info("the kubelet restarted or our socket went: serving and registering again")
                    break
        except grpc.RpcError as exc:
            log.warning("registration failed: %s; trying again", exc.code())
            stop.wait(2.0)
        finally:
            if ready_file is not None:
                ready_file.unlink(missing_ok=True)
            server.stop(grace=1).wait()
            ours.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--device", action="append", required=True, help="a GPU UUID to advertise (repeat)")
    p.add_argument("--plugin-dir", type=Path, default=Path("/var/lib/kubelet/device-plugins"))
    p.add_argument("--ready-file", type=Path, help="written while registered, for a readiness probe")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve(args.plugin_dir, args.device, args.ready_file, stop)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
