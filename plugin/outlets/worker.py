"""The worker thread each cluster outlet of the node agent (the node reporter, pod correlation, the slice writer)
runs its steps in, woken by the node state."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from plugin.health.node_state import NodeState
from plugin.kube.protocols import Closeable

ERROR_RETRY_S = 5.0  # how long a worker waits after an unexpected error in a step
MAX_WAIT_S = 3600.0  # a worker looks again at least this often, whatever its step said


class OutletThread:
    """The thread a cluster outlet runs in. It calls :meth:`step` with the clock's time, then sleeps until the
    deadline that step returned or until the node state moves past ``_version`` (the version the last step took
    in), whichever comes first. A subclass implements ``step`` and names the clients to close in ``_clients``;
    ``step`` stays callable on its own, so tests and benchmarks drive the same code on a virtual clock."""

    def __init__(self, state: NodeState, clock: Callable[[], float], *, version: int, thread_name: str, label: str,
                 log: logging.Logger) -> None:
        self.state = state
        self._clock = clock
        self._version = version
        self._thread_name = thread_name
        self._label = label  # starts the outlet's log lines
        self._log = log
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self, now: float) -> float:
        """Do whatever is due at ``now``; return when to be called next (or sooner, on a state change)."""
        raise NotImplementedError

    def _clients(self) -> Iterable[Closeable | None]:
        """What to close once the thread has stopped; None for a client never built."""
        return ()

    def _woken(self) -> bool:
        """Whether something besides a new snapshot asks for a step before the deadline (checked while waiting)."""
        return False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping.set()
        self.state.poke()
        if self._thread is not None:
            self._thread.join(timeout)
        for client in self._clients():
            if client is None:
                continue
            try:
                client.close()
            except Exception:  # closing a broken connection must not fail the shutdown
                pass

    def _run(self) -> None:
        while not self._stopping.is_set() and not self.state.closed:
            try:
                deadline = self.step(self._clock())
            except Exception:
                # A bug here must not end the outlet for the life of the process; the kubelet path is unaffected
                # either way.
                self._log.exception("%s: unexpected error; retrying in %gs", self._label, ERROR_RETRY_S)
                deadline = self._clock() + ERROR_RETRY_S
            wait = max(0.0, min(deadline - self._clock(), MAX_WAIT_S))
            self.state.wait_for_change(self._version, wait, abort=lambda: self._stopping.is_set() or self._woken())
