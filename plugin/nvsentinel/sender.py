"""Sends our health to NVSentinel's platform connector as health events, only what changed (docs/nvsentinel.md).

Its own thread, woken by the node state, so the health engine never waits on NVSentinel. It keeps what NVSentinel
acknowledged per (GPU, check) and each step sends, in one batch, the difference between that and the snapshot now:
there is no queue, a failed send is simply retried with whatever the state is by then (latest wins), after an
exponential back-off with jitter. Every call has a deadline. After a failure, or when the socket file is replaced
(NVSentinel restarted), the next send carries every non-healthy check again, in case NVSentinel lost it; a healthy
node with nothing to report sends nothing, ever.

A batch NVSentinel refuses (a status other than the transient ones) is sent again one event at a time: the events it
takes are taken, and each one it refuses is counted, logged and not sent again until its check changes, so that one
event it cannot take never holds back the others. The checks of a GPU that left the node (replaced, or taken off
the bus for good) are closed once it stayed away past a grace period.
"""

from __future__ import annotations

import json
import logging
import os
import random
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from api.nvsentinel.platformconnector import health_event_pb2, health_event_pb2_grpc
from plugin.atomicfile import write_atomic
from plugin.backoff import Backoff
from plugin.health.node_state import NodeState
from plugin.kube.protocols import Closeable
from plugin.nvsentinel.healthevents import CheckState, changes, from_record, gpu_checks, to_event, to_record
from plugin.outlets.worker import OutletThread

log = logging.getLogger(__name__)

METHOD = "datamodels.PlatformConnector/HealthEventOccurredV1"
# Why a send failed: a closed set, each present in the metrics from the start.
NO_SOCKET = "no-socket"  # the socket file is absent (NVSentinel not deployed, or not mounted into our pod)
NOT_A_SOCKET = "not-a-socket"
UNAVAILABLE = "unavailable"  # nobody listening, or the connector restarting
DEADLINE = "deadline-exceeded"
UNIMPLEMENTED = "unimplemented"  # a peer that does not serve the method: another NVSentinel version
REJECTED = "rejected"  # any other status code
FAILURE_REASONS = (NO_SOCKET, NOT_A_SOCKET, UNAVAILABLE, DEADLINE, UNIMPLEMENTED, REJECTED)
_BY_CODE = {grpc.StatusCode.UNAVAILABLE: UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED: DEADLINE,
            grpc.StatusCode.UNIMPLEMENTED: UNIMPLEMENTED}


@dataclass(frozen=True)
class SenderSettings:
    socket: Path
    node_name: str
    store_only: bool = False
    deadline_s: float = 5.0  # one call; the connector answers a local batch in milliseconds
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    # How often an idle sender looks at the socket file, to see NVSentinel restart (a new inode) and resend.
    recheck_s: float = 10.0
    # Where what NVSentinel holds open from us is kept across our restarts (in the state dir): a fault that clears
    # while we are down is closed in NVSentinel by the next start, which nothing else could do.
    acked_file: Path | None = None
    # How long a GPU may be gone from the node before NVSentinel is told its checks are over: long enough for a
    # reset or a driver reload to bring it back under the same UUID.
    gone_grace_s: float = 600.0


@dataclass(frozen=True)
class SenderStatus:
    """What the metrics read: counters since start, and whether the last attempt reached NVSentinel."""

    events_sent: int
    failures_by_reason: Mapping[str, int]
    connected: bool
    pending_checks: int  # checks whose state NVSentinel does not have yet
    events_refused: int = 0  # events NVSentinel refused one by one (not sent again until their check changes)

    @property
    def failure_reasons(self) -> tuple[str, ...]:
        return FAILURE_REASONS


class HealthEventSender(OutletThread):
    def __init__(self, state: NodeState, settings: SenderSettings, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, rng: random.Random | None = None) -> None:
        super().__init__(state, clock, version=-1, thread_name="nvsentinel", label="NVSentinel health events",
                         log=log)
        self.settings = settings
        self._wall = wall
        self._backoff = Backoff(settings.backoff_initial_s, settings.backoff_max_s, jitter=True, rng=rng)
        self._acked: dict[tuple[str, str], CheckState] = self._load_acked()
        self._retry_at = 0.0
        # (device, inode, ctime) of the socket we last reached: a new file may well get the old one's inode number
        self._identity: tuple[int, int, int] | None = None
        # The first send carries every open check: NVSentinel may have lost what it held while we were away.
        self._resend = True
        self._failing = ""  # the reason of the current failure streak, logged once
        self._channel: grpc.Channel | None = None
        self._lock = threading.Lock()  # the counters, read by the scrape thread
        self._sent = 0
        self._failures = dict.fromkeys(FAILURE_REASONS, 0)
        self._connected = False
        self._pending = 0
        self._refused: dict[tuple[str, str], CheckState] = {}  # what NVSentinel refused, as it was then
        self._refused_count = 0
        self._gone_since: dict[str, float] = {}  # GPUs with open checks that left the snapshot, since when

    def status(self) -> SenderStatus:
        with self._lock:
            return SenderStatus(self._sent, dict(self._failures), self._connected, self._pending,
                                self._refused_count)

    def _clients(self) -> Iterable[Closeable | None]:
        return (self._channel,)

    # The step -------------------------------------------------------------------------------------------------

    def step(self, now: float) -> float:
        snap = self.state.snapshot()
        self._version = snap.version
        gpus, wanted = gpu_checks(snap)
        identity, problem = self._socket()
        if identity is not None and self._identity is not None and identity != self._identity:
            # A new socket file: NVSentinel restarted and may hold nothing of ours. Send everything, now.
            log.info("NVSentinel's socket %s was replaced: sending every open check again", self.settings.socket)
            self._reconnect()
            self._resend = True
            self._retry_at = 0.0
        if problem is None and self._failing in (NO_SOCKET, NOT_A_SOCKET):
            self._retry_at = 0.0  # the socket is there now: no reason to wait out the back-off
        if now < self._retry_at:
            return self._retry_at
        closing = self._gone_past_grace(gpus, now)
        todo = changes(self._acked, gpus | closing, wanted, everything=self._resend)
        self._refused = {k: c for k, c in self._refused.items() if wanted.get(k) == c}
        todo = [c for c in todo if self._refused.get(c.key) != c]  # refused as it is: wait for a change
        self._set_pending(len(todo))
        if problem is not None:
            return self._failed(now, problem, len(todo), detail="")
        assert identity is not None
        self._identity = identity
        if not todo:
            if self._failing in (NO_SOCKET, NOT_A_SOCKET):
                log.info("NVSentinel's socket %s is there now", self.settings.socket)
                self._failing = ""
                self._backoff.reset()
            with self._lock:
                self._connected = not self._failing  # nothing to send: the socket being there is all we know
            return now + self.settings.recheck_s
        try:
            self._send(todo)
        except grpc.RpcError as exc:
            reason, detail = _why(exc)
            if reason != REJECTED:
                return self._failed(now, reason, len(todo), detail=detail)
            taken, failure = self._one_by_one(todo, detail)
            self._ack(taken)
            with self._lock:
                self._sent += len(taken)
            if failure is not None:
                return self._failed(now, failure[0], len(todo) - len(taken), detail=failure[1])
            todo = []  # acknowledged and counted above
        self._ack(todo)
        with self._lock:
            self._sent += len(todo)
        self._resend = False
        n = self._backoff.reset()
        if self._failing:
            log.info("NVSentinel reached again at %s after %d failed attempts; every open check was sent again",
                     self.settings.socket, n)
            self._failing = ""
        with self._lock:
            self._connected = True
            self._pending = 0
        return now + self.settings.recheck_s

    def _one_by_one(self, todo: list[CheckState], detail: str) -> tuple[list[CheckState], tuple[str, str] | None]:
        """The batch was refused: each check alone. Returns those taken, and the failure that stopped the round
        (a transient one: the rest waits for the back-off), if any."""
        if len(todo) == 1:
            self._refuse(todo[0], detail)
            return [], None
        taken: list[CheckState] = []
        for c in todo:
            try:
                self._send([c])
            except grpc.RpcError as exc:
                reason, why = _why(exc)
                if reason != REJECTED:
                    return taken, (reason, why)
                self._refuse(c, why)
                continue
            taken.append(c)
        return taken, None

    def _refuse(self, c: CheckState, detail: str) -> None:
        self._refused[c.key] = c
        with self._lock:
            self._refused_count += 1
        log.warning("NVSentinel refused the health event of GPU %s (index %d) check %s (%s): the other events "
                    "are sent; this one is sent again once its check changes", c.gpu_uuid, c.gpu_index, c.check, detail)

    def _gone_past_grace(self, gpus: set[str], now: float) -> set[str]:
        """GPUs with checks NVSentinel holds open that have been gone from the node past the grace period."""
        open_gpus = {c.gpu_uuid for c in self._acked.values()}
        self._gone_since = {u: self._gone_since.get(u, now) for u in open_gpus - gpus}
        return {u for u, since in self._gone_since.items() if now - since >= self.settings.gone_grace_s}

    def _ack(self, todo: list[CheckState]) -> None:
        if not todo:
            return
        for c in todo:
            if c.healthy:
                self._acked.pop(c.key, None)
            else:
                self._acked[c.key] = c
        self._save_acked()

    def _load_acked(self) -> dict[tuple[str, str], CheckState]:
        path = self.settings.acked_file
        if path is None:
            return {}
        try:
            return from_record(json.loads(path.read_text()))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            # Only closing checks left open across a restart depends on it; the open ones are sent again anyway.
            log.warning("%s unreadable (%s): checks NVSentinel holds open from before this start are not closed",
                        path, exc)
            return {}

    def _save_acked(self) -> None:
        path = self.settings.acked_file
        if path is None:
            return
        try:
            write_atomic(path, json.dumps(to_record(self._acked.values()), separators=(",", ":")).encode())
        except OSError as exc:
            log.warning("cannot write %s (%s): a restart will not close checks that clear meanwhile", path, exc)

    def _socket(self) -> tuple[tuple[int, int, int] | None, str | None]:
        """The socket file's identity, or why there is none to send to."""
        try:
            st = os.stat(self.settings.socket)
        except OSError:  # absent, or a directory on the way we may not read: nothing to send to either way
            return None, NO_SOCKET
        if not stat.S_ISSOCK(st.st_mode):
            return None, NOT_A_SOCKET
        return (st.st_dev, st.st_ino, st.st_ctime_ns), None

    def _send(self, todo: list[CheckState]) -> None:
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"unix://{self.settings.socket}")
        stub = health_event_pb2_grpc.PlatformConnectorStub(self._channel)
        now = self._wall()
        batch = health_event_pb2.HealthEvents(version=1, events=[
            to_event(c, node_name=self.settings.node_name, now=now, store_only=self.settings.store_only)
            for c in todo])
        stub.HealthEventOccurredV1(batch, timeout=self.settings.deadline_s)

    def _reconnect(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _failed(self, now: float, reason: str, pending: int, detail: str) -> float:
        with self._lock:
            self._connected = False
            if pending:  # a missing socket with nothing to send is no failed send
                self._failures[reason] += 1
        if pending:
            # The next success may reach a restarted NVSentinel: it gets every open check again.
            self._resend = True
        if reason != self._failing:
            self._failing = reason
            log.warning("%s", self._explain(reason, detail))
        delay = self._backoff.next_delay()
        if reason in (NOT_A_SOCKET, UNIMPLEMENTED, REJECTED):
            # Our configuration or NVSentinel's version is wrong: a person must act, so look again only slowly.
            delay = self._backoff.maximum
        self._retry_at = now + delay
        # A fresh channel for the next attempt: gRPC's own reconnect back-off (up to minutes) must not outlast ours.
        self._reconnect()
        if reason in (NO_SOCKET, NOT_A_SOCKET):
            self._identity = None
        return self._retry_at

    def _explain(self, reason: str, detail: str) -> str:
        path = self.settings.socket
        if reason == NO_SOCKET:
            return (f"NVSentinel health events: no socket at {path} (--nvsentinel-socket); nothing is sent until it "
                    "appears (is NVSentinel deployed, and its socket mounted into this pod?)")
        if reason == NOT_A_SOCKET:
            return (f"--nvsentinel-socket: {path} is not a socket; health events are not sent until it is "
                    "NVSentinel's platform connector socket")
        if reason == UNIMPLEMENTED:
            return (f"NVSentinel at {path} does not serve {METHOD} (UNIMPLEMENTED): another NVSentinel version? "
                    f"Retrying every {self._backoff.maximum:g}s")
        return f"NVSentinel health events to {path} failed ({detail}); retrying with back-off"

    def _set_pending(self, n: int) -> None:
        with self._lock:
            self._pending = n


def _why(exc: grpc.RpcError) -> tuple[str, str]:
    """A failed call's reason (of FAILURE_REASONS) and its one-line detail."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    reason = _BY_CODE.get(code, REJECTED) if code is not None else REJECTED
    return reason, f"{code.name if code is not None else 'error'}: {detail}"
