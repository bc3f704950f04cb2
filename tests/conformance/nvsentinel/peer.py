"""Drive the NVSentinel stand-in (the Go peer in this directory) from the conformance tests.

    exe = build_peer()                                   # cached by scripts/gobuild.py; skip or fail via skips.py
    peer = NvsentinelPeer(exe, short_dir).start()        # both sockets: peer.connector_socket, peer.device_socket
    peer.wait_events(lambda e: not e["isHealthy"])       # HealthEvent dicts (protojson names), polled with a deadline
    peer.device_writes()                                 # every device-API write: operation, name, resource_version
    peer.restart(); peer.stop()

``DeviceApiClient`` is another device-API provider (or a consumer) talking to any GpuService socket.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from api.nvsentinel.deviceapi.v1alpha1 import gpu_pb2, gpu_pb2_grpc
from tests.conformance.skips import build_or_skip

HERE = Path(__file__).resolve().parent
Event = dict[str, Any]


def grpc_version() -> str:
    found = re.search(r"google\.golang\.org/grpc (v\S+)", (HERE / "go.mod").read_text())
    assert found, "go.mod names no google.golang.org/grpc version"
    return found.group(1)


def build_peer() -> Path:
    """The nvsentinel-peer binary (built once per source state; skips without Go, fails instead with CI=true)."""
    return build_or_skip(HERE, ".", "nvsentinel-peer", version=f"grpc-{grpc_version()}")


def poll(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """The first truthy result of ``check``; AssertionError naming ``what`` once ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _json_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _accepts(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


class NvsentinelPeer:
    """One nvsentinel-peer process serving the platform connector and the device API under ``root``."""

    def __init__(self, exe: Path, root: Path, *, fail_first: int = 0, fail_code: str = "UNAVAILABLE",
                 strict: bool = True) -> None:
        self.exe = exe
        self.connector_socket = root / "nvsentinel.sock"
        self.device_socket = root / "device.sock"
        self.events_file = root / "nvsentinel-events.jsonl"
        self.device_log = root / "device-writes.jsonl"
        self.fail_first, self.fail_code, self.strict = fail_first, fail_code, strict
        self.proc: subprocess.Popen[str] | None = None
        self.output = ""  # stdout and stderr of the last stopped process

    def args(self) -> list[str]:
        return [str(self.exe), "--platform-connector", str(self.connector_socket), "--events", str(self.events_file),
                "--device-api", str(self.device_socket), "--device-log", str(self.device_log),
                "--fail-first", str(self.fail_first), "--fail-code", self.fail_code,
                f"--strict={'true' if self.strict else 'false'}"]

    def start(self, timeout: float = 30.0) -> NvsentinelPeer:
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        proc = self.proc

        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"nvsentinel-peer exited with {proc.returncode}: {proc.communicate()[0]}")
            return _accepts(self.connector_socket) and _accepts(self.device_socket)

        poll(up, timeout, "nvsentinel-peer's sockets")
        return self

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; the exit code (the peer removes its sockets on the way out)."""
        if self.proc is None:
            return 0
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.terminate()
        try:
            self.output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            self.output, _ = proc.communicate()
        return proc.returncode

    def restart(self, **changes: Any) -> NvsentinelPeer:
        """Stop and start again on the same paths (the events file and write log go on; the device API's
        in-memory GPUs are lost, as NVSentinel's are). ``changes`` set fail_first, fail_code or strict."""
        self.stop()
        for key, value in changes.items():
            if key not in ("fail_first", "fail_code", "strict"):
                raise TypeError(f"restart() got an unexpected option {key!r}")
            setattr(self, key, value)
        return self.start()

    def batches(self) -> list[dict[str, Any]]:
        """Every accepted HealthEventOccurredV1 call: call, received, batch (as recorded), rawProcessingStrategy."""
        return _json_lines(self.events_file)

    def events(self) -> list[Event]:
        """Every recorded HealthEvent in arrival order, processingStrategy normalised as NVSentinel does; the
        sender's own value is under ``rawProcessingStrategy``."""
        out: list[Event] = []
        for record in self.batches():
            for event, raw in zip(record["batch"]["events"], record["rawProcessingStrategy"], strict=True):
                out.append({**event, "rawProcessingStrategy": raw})
        return out

    def wait_events(self, pred: Callable[[Event], bool], timeout: float = 30.0, *, after: int = 0) -> list[Event]:
        """The recorded events (from index ``after`` on) matching ``pred``, once there is at least one."""
        found: list[Event] = poll(lambda: [e for e in self.events()[after:] if pred(e)], timeout,
                                  "a matching health event")
        return found

    def device_writes(self) -> list[dict[str, Any]]:
        """Every device-API write: operation (create, update, update_status, delete), name, resource_version, status."""
        return _json_lines(self.device_log)


class DeviceApiClient:
    """A plain GpuService client: a second provider setting conditions, or a consumer reading them."""

    def __init__(self, path: Path) -> None:
        self.channel = grpc.insecure_channel(f"unix://{path}")
        self.stub = gpu_pb2_grpc.GpuServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> DeviceApiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self, uuid: str, name: str | None = None) -> gpu_pb2.CreateGpuResponse:
        gpu = gpu_pb2.Gpu(metadata=gpu_pb2.ObjectMeta(name=name if name is not None else uuid.lower()),
                          spec=gpu_pb2.GpuSpec(uuid=uuid))
        return self.stub.CreateGpu(gpu_pb2.CreateGpuRequest(gpu=gpu), timeout=10)

    def get(self, name: str) -> gpu_pb2.Gpu:
        return self.stub.GetGpu(gpu_pb2.GetGpuRequest(name=name), timeout=10).gpu

    def list(self) -> list[gpu_pb2.Gpu]:
        return list(self.stub.ListGpus(gpu_pb2.ListGpusRequest(), timeout=10).gpu_list.items)

    def set_status(self, name: str, status: gpu_pb2.GpuStatus, resource_version: int = 0) -> gpu_pb2.Gpu:
        req = gpu_pb2.UpdateGpuStatusRequest(name=name, status=status, resource_version=resource_version)
        return self.stub.UpdateGpuStatus(req, timeout=10).gpu

    def _edit_conditions(self, name: str, edit: Callable[[list[gpu_pb2.Condition]], list[gpu_pb2.Condition]],
                         attempts: int = 10) -> gpu_pb2.Gpu:
        """Read, change our conditions, write with the version read; again on ABORTED (another provider wrote
        in between). Others' conditions are kept: a status write replaces the whole status."""
        for _ in range(attempts):
            gpu = self.get(name)
            status = gpu_pb2.GpuStatus(conditions=edit(list(gpu.status.conditions)),
                                       recommended_action=gpu.status.recommended_action)
            try:
                return self.set_status(name, status, gpu.resource_version)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.ABORTED:
                    raise
        raise AssertionError(f"{name}: UpdateGpuStatus aborted {attempts} times in a row")

    def set_condition(self, name: str, type_: str, status: str = "True", reason: str = "", message: str = "",
                      ) -> gpu_pb2.Gpu:
        cond = gpu_pb2.Condition(type=type_, status=status, reason=reason, message=message)
        cond.last_transition_time.GetCurrentTime()
        return self._edit_conditions(name, lambda cs: [c for c in cs if c.type != type_] + [cond])

    def clear_condition(self, name: str, type_: str) -> gpu_pb2.Gpu:
        return self._edit_conditions(name, lambda cs: [c for c in cs if c.type != type_])

    def watch(self, timeout: float = 30.0) -> Iterator[gpu_pb2.WatchGpusResponse]:
        """The watch stream; cancelled when ``timeout`` passes, so a test never hangs on it."""
        yield from self.stub.WatchGpus(gpu_pb2.WatchGpusRequest(), timeout=timeout)
