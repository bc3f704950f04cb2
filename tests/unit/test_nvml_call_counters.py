"""The NVML backend's call-error counters under racing threads: no update lost, however the threads interleave."""

from __future__ import annotations

import sys
import threading
import time
from types import FrameType
from typing import Any

from plugin.devices import nvml as nvml_module
from plugin.devices.nvml import NvmlBackend
from tests.fakes.fake_pynvml import eight_gpu_node


def _yield_inside_the_backends_calls(frame: FrameType, event: str, arg: Any) -> Any:
    """A trace that gives the GIL away between any two bytecodes of the backend's call wrapper.

    On CPython 3.11 a thread switch cannot fall between the load and the store of ``n += 1``, so a counter without
    its lock never loses an update in an ordinary run, and a plain hammering test passes either way. Yielding at
    every bytecode of the wrapper makes the interleaving a free-threaded build would allow happen here."""
    if frame.f_code.co_filename != nvml_module.__file__ or frame.f_code.co_name != "_call":
        return None
    frame.f_trace_opcodes = True

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            time.sleep(0)
        return local

    return local


def test_call_errors_counted_from_racing_threads_lose_no_update() -> None:
    nv = eight_gpu_node()
    b = NvmlBackend(nv)
    nv.fail[("nvmlDeviceGetTemperature", None)] = "unknown"
    gpu = b.discover().gpus[0]
    b.read(gpu)
    per_read = b.call_errors  # the failing calls one read makes
    assert per_read >= 1
    per_thread, threads = 40, 4
    start = threading.Barrier(threads)

    def hammer() -> None:
        sys.settrace(_yield_inside_the_backends_calls)
        try:
            start.wait()
            for _ in range(per_thread):
                b.read(gpu)
        finally:
            sys.settrace(None)

    workers = [threading.Thread(target=hammer) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60.0)
    assert not any(w.is_alive() for w in workers)
    assert b.call_errors == per_read * (1 + per_thread * threads)
    b.close()
