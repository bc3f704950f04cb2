"""The demo: the plugin's main job on a simulated 8-GPU node, with no GPU and no cluster.

An embedded kubelet stand-in registers the plugin; a script rewrites the node file to inject faults and recoveries;
the view shows each device's state and the kubelet's capacity/allocatable as they change.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import grpc

from plugin.app import App
from plugin.config import Config
from plugin.devices.simulated import SimulatedBackend, builtin_node
from plugin.devtools.standin import KubeletStandin
from plugin.health.config import HealthConfig

CLEAR = "\x1b[H\x1b[2J"
COLORS = {"Healthy": "\x1b[32m", "Degraded": "\x1b[33m", "Unhealthy": "\x1b[31m", "Unknown": "\x1b[35m"}
RESET = "\x1b[0m"


class Interrupted(Exception):
    """Ctrl-C: the script stops where it is and the demo shuts down in order."""


def _write_atomic(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


class Demo:
    def __init__(self, root: Path, duration_s: float, plain: bool) -> None:
        self.root = root
        self.plain = plain
        self.duration_s = duration_s
        # In a directory of its own: the backend watches the file's directory, and the state dir's writes (the
        # last one while everything stops) are no change of the node.
        self.node_file = root / "node" / "node.json"
        self.node_file.parent.mkdir()
        self.node = builtin_node()
        _write_atomic(self.node_file, self.node)
        dev = root / "host" / "dev"
        dev.mkdir(parents=True)
        for name in [f"nvidia{i}" for i in range(8)] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]:
            (dev / name).touch()
        self.kubelet = KubeletStandin(root / "device-plugins")
        # A short poll and quick clearing keep the demo lively; production defaults are 5 s and 3 polls.
        cfg = Config(backend="simulated", simulated_node=self.node_file, device_plugin_dir=root / "device-plugins",
                     state_dir=root / "state", dev_root=root / "host", poll_interval=0.5,
                     health=HealthConfig(clear_after_polls=2), metrics_address="off")
        self.app = App(cfg, SimulatedBackend(self.node_file))
        assert self.app.supervisor is not None  # the demo runs the device-plugin mode
        self.supervisor = self.app.supervisor
        self.log: list[str] = []
        self.started = time.monotonic()
        self._lock = threading.Lock()
        # Frames come from the script and from the kubelet stand-in's threads; one lock keeps them whole and in
        # order, and once the final frame is out nothing else is drawn (shutdown makes every device Unhealthy to
        # the kubelet, which is not the state the demo ends in).
        self._draw_lock = threading.Lock()
        self._live = False
        self.interrupted = threading.Event()  # set by run_demo's SIGINT handler
        self.uuids = [g["uuid"] for g in self.node["gpus"]]

    def say(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.started:5.1f}s] {msg}"
        with self._lock:
            self.log.append(line)
        if self.plain:
            print(line, flush=True)
        else:
            self.draw()

    def signals(self, index: int, **signals: Any) -> None:
        gpu = self.node["gpus"][index]
        for k, v in signals.items():
            if v is None:
                gpu["signals"].pop(k, None)
            else:
                gpu["signals"][k] = v
        _write_atomic(self.node_file, self.node)

    def render(self) -> str:
        snap = self.app.state.snapshot()
        cap, alloc = self.kubelet.capacity()
        reg = self.supervisor.record
        lines = [f"gpu-health-device-plugin demo: simulated 8-GPU node  |  kubelet: nvidia.com/gpu capacity={cap} "
                 f"allocatable={alloc}  registrations={reg.registrations}", ""]
        lines.append(f"{'IDX':<4}{'DEVICE':<14}{'STATE':<11}{'KUBELET':<10}{'REASONS'}")
        for d in snap.devices:
            color = "" if self.plain else COLORS.get(d.state.value, "")
            why = "; ".join(f"{r.code} -> {r.action}" for r in d.reasons) or "-"
            kube = self.kubelet.health(d.id) or "?"
            lines.append(f"{d.gpu.index:<4}{d.id[-12:]:<14}{color}{d.state.value:<11}{'' if self.plain else RESET}"
                         f"{kube:<10}{why}")
        return "\n".join(lines)

    def draw(self, final: bool = False) -> None:
        """Redraw the live view; ``final`` draws the last frame and stops the view."""
        if self.plain:
            return
        with self._draw_lock:
            if not self._live:
                return
            if final:
                self._live = False
            with self._lock:
                tail = self.log[-12:]
            sys.stdout.write(CLEAR + self.render() + "\n\nEvents:\n" + "\n".join(tail) + "\n")
            sys.stdout.flush()

    def wait(self, what: str, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        # Some steps change only the fine-grained state (the kubelet sees nothing), so wake on either side.
        deadline = time.monotonic() + timeout
        version = -1
        while not (ok := predicate()) and time.monotonic() < deadline:
            self._check_interrupt()
            version = self.app.state.wait_for_change(version, 0.05).version
        if not ok:
            self.say(f"!! timed out waiting for {what}")
        return ok

    def _check_interrupt(self) -> None:
        if self.interrupted.is_set():
            raise Interrupted

    def _pause(self, seconds: float) -> None:
        if self.interrupted.wait(seconds):
            raise Interrupted

    def run(self) -> int:
        """0 when every step behaved, 1 when one did not, 130 when interrupted (nothing more printed but one line on
        stderr)."""
        self.kubelet.on_update = self.draw
        self.kubelet.start()
        self.app.start()
        try:
            ok = self._script()
        except Interrupted:
            with self._draw_lock:
                self._live = False  # the shutdown's frames are not the demo's
            self._stop()
            print("gpu-health-plugin demo: interrupted", file=sys.stderr, flush=True)
            return 130
        # The last frame (or table) is the state the script ended in, drawn before shutdown begins.
        self.draw(final=True)
        if self.plain:
            print("\n" + self.render(), flush=True)
        self._stop()
        print("\ndemo finished: " + ("every step behaved as expected" if ok else "SOME STEPS FAILED"))
        return 0 if ok else 1

    def _stop(self) -> None:
        self.app.stop.set()
        self.app.shutdown()
        self.kubelet.stop()

    def _script(self) -> bool:
        # The kubelet sees our devices inside its Register call, a moment before the plugin records the round.
        ok = self.wait("registration", lambda: self.kubelet.capacity() == (8, 8) and self._registrations() == 1)
        # The view goes live with the registration already in its events, so no frame shows a registered plugin
        # under an empty event list.
        with self._draw_lock:
            self._live = True
        self.say("plugin registered: 8 GPUs advertised, all Healthy")
        resp = self.kubelet.allocate(self.uuids[:2])
        env = resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"]
        self.say(f"Allocate(GPU 0, 1) -> NVIDIA_VISIBLE_DEVICES={env}, "
                 f"{len(resp.container_responses[0].devices)} device nodes")
        pref = self.kubelet.preferred(self.uuids, [self.uuids[5]], 4)
        self.say("GetPreferredAllocation(size 4, must include GPU 5) -> GPUs "
                 + ",".join(str(self.uuids.index(u)) for u in pref) + " (one NVLink island)")
        step = self.duration_s / 8
        script: list[tuple[str, Callable[[], None], Callable[[], bool]]] = [
            ("GPU 3 runs hot (90 C): Degraded, still allocatable", lambda: self.signals(3, temperature_c=90),
             lambda: self.kubelet.capacity() == (8, 8) and self._state(3) == "Degraded"),
            ("GPU 5 reports XID 79 (fallen off the bus): Unhealthy, latched",
             lambda: self.signals(5, xid_events=[79]), lambda: self.kubelet.capacity() == (8, 7)),
            ("GPU 1 has a row remap pending: Degraded until reset", lambda: self.signals(1, row_remap_pending=True),
             lambda: self._state(1) == "Degraded"),
            ("GPU 3 cools down (45 C): recovers after 2 clean polls", lambda: self.signals(3, temperature_c=45),
             lambda: self._state(3) == "Healthy"),
            ("kubelet restarts (sockets wiped): the plugin re-registers, GPU 5 stays Unhealthy",
             self.kubelet.restart,
             lambda: self.kubelet.capacity() == (8, 7) and self.kubelet.view() is not None
             and self.kubelet.view().connected and self._registrations() == 2),  # type: ignore[union-attr]
            ("GPU 6 loses NVLink 2: Unhealthy", lambda: self.signals(6, nvlink_down=[2]),
             lambda: self.kubelet.capacity() == (8, 6)),
            ("GPU 6 NVLink back: recovers", lambda: self.signals(6, nvlink_down=None),
             lambda: self.kubelet.capacity() == (8, 7)),
        ]
        for text, act, done in script:
            self._pause(step)
            self.say(text)
            act()
            ok = self.wait(text, done) and ok
            self.draw()
        try:
            self.kubelet.allocate([self.uuids[5]])
            self.say("!! Allocate(GPU 5) was accepted")
            ok = False
        except grpc.RpcError as exc:
            self.say(f"Allocate(GPU 5) -> {exc.code().name}: {exc.details()}")
        self._pause(step / 2)
        return ok

    def _registrations(self) -> int:
        return self.supervisor.record.registrations

    def _state(self, index: int) -> str:
        d = self.app.state.snapshot().get(self.uuids[index])
        return d.state.value if d else "?"


def run_demo(duration_s: float = 20.0, plain: bool = False) -> int:
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="gpu-health-demo-") as tmp:
        demo = Demo(Path(tmp), duration_s, plain)

        def on_sigint(signum: int, frame: FrameType | None) -> None:
            demo.interrupted.set()  # only this: the script sees it at its next wait and stops in order

        previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            return demo.run()
        finally:
            signal.signal(signal.SIGINT, previous)
