"""The one owner of sockets and registration: serve, confirm, Register; re-serve and re-register when the kubelet
restarts (its socket is created again) or our socket disappears; clean up on stop. Device state is untouched.

One thread runs one explicit state machine (``Phase``)::

    SERVE ──ok──▶ REGISTER ──ok──▶ WATCH ──signal that holds up──▶ SERVE
      │              │               ▲ └─ none, or stale: dropped ─┘ (stays in WATCH)
      └──fail──▶ BACKOFF ◀──fail─────┘
                 (waits, then retries the step that failed; only a new kubelet or the loss of our socket
                  ends a registration back-off early, nothing ends a serve back-off early)

The watchdog thread only queues signals (``kubelet.sock`` appeared by create or rename, our socket deleted or
renamed away). The loop judges each one when it takes it, against what is true then: a ``kubelet.sock`` whose
identity (inode, ctime) is the kubelet it already registered with is dropped, so the two signals of one kubelet
restart, or a creation seen while a round is already registering with that kubelet, lead to one registration.
"""

from __future__ import annotations

import enum
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugin.backoff import Backoff
from plugin.health.node_state import NodeState
from plugin.kubelet.allocation import AllocationConfig
from plugin.kubelet.resources import Resource
from plugin.kubelet.server import DevicePluginServicer
from plugin.sockets import UnixGrpcServer

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
AUDIT_S = 1.0  # while registered, how often the loop re-checks the dir itself (a missed or overflowed inotify)


def plugin_options() -> api_pb2.DevicePluginOptions:
    # Built once: Register sends it and GetDevicePluginOptions returns the same object.
    return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


class PluginServer:
    """One gRPC server for one resource on a socket whose name is unique to this instance."""

    def __init__(self, plugin_dir: Path, resource: Resource, servicer: DevicePluginServicer,
                 max_workers: int = 64) -> None:
        short = resource.name.split("/")[-1].replace(".", "-")
        self.endpoint = f"gpu-health-{short}-{secrets.token_hex(4)}.sock"
        self.path = plugin_dir / self.endpoint
        self.resource = resource
        self.servicer = servicer
        # Born 0600 at its final name (see bind_unix): the kubelet runs as root, nobody else may connect.
        self._grpc = UnixGrpcServer(self.path, 0o600,
                                    lambda s: api_pb2_grpc.add_DevicePluginServicer_to_server(servicer, s),
                                    max_workers, f"dp-{short}")

    def start(self, confirm_timeout_s: float = 5.0) -> None:
        """Serve and confirm the socket answers. Raises OSError, RuntimeError (bind) or grpc.RpcError (confirm)."""
        def confirm(ch: grpc.Channel) -> None:
            api_pb2_grpc.DevicePluginStub(ch).GetDevicePluginOptions(api_pb2.Empty(), timeout=confirm_timeout_s)

        self._grpc.start(confirm)

    def stop(self, grace_s: float = 0.5) -> None:
        self.servicer.close()
        self._grpc.stop(grace_s)


def register(kubelet_socket: Path, server: PluginServer, options: api_pb2.DevicePluginOptions,
             timeout_s: float = 15.0) -> None:
    """Call the kubelet's Register. Raises grpc.RpcError or OSError with the kubelet's reason."""
    if not kubelet_socket.exists():
        raise FileNotFoundError(f"{kubelet_socket} does not exist (is the kubelet running?)")
    with grpc.insecure_channel(f"unix://{kubelet_socket}") as ch:
        api_pb2_grpc.RegistrationStub(ch).Register(
            api_pb2.RegisterRequest(version=API_VERSION, endpoint=server.endpoint,
                                    resource_name=server.resource.name, options=options),
            timeout=timeout_s)


@dataclass
class RegistrationRecord:
    registered: bool = False
    registrations: int = 0
    failures: int = 0
    last_registered_at: float = 0.0
    last_error: str = ""
    serve_failures: int = 0  # attempts to serve that failed (bind, read-only dir, confirm), all streaks together


class Phase(enum.Enum):
    SERVE = "serve"  # stop the old servers, start a fresh one per resource on fresh socket names
    REGISTER = "register"  # Register every served resource not yet registered in this round
    WATCH = "watch"  # registered: wait for a signal and judge it
    BACKOFF = "backoff"  # the last SERVE or REGISTER failed: wait, then retry it
    STOPPED = "stopped"  # asked to stop
    DEAD = "dead"  # the loop raised: /healthz fails so the kubelet restarts the pod


class FailureStreak:
    """The failures in a row of one kind of step: how long to wait after each (the one back-off formula, without
    jitter: the kubelet is a local peer, not a fleet's shared server) and whether one is worth a log line: the first
    of a streak, a changed reason, and each time the streak doubles from 8 attempts on (so a failure that lasts hours
    still shows its reason now and then, at a logarithmic cost)."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self._backoff = Backoff(initial_s, max_s, jitter=False)
        self._last_reason = ""

    @property
    def attempts(self) -> int:
        return self._backoff.failures

    def failed(self, reason: str) -> tuple[float, bool]:
        """Record one failed attempt; return (seconds to wait, whether to log it)."""
        delay = self._backoff.next_delay()
        n = self._backoff.failures
        worth = n == 1 or reason != self._last_reason or (n >= 8 and n & (n - 1) == 0)
        self._last_reason = reason
        return delay, worth

    def succeeded(self) -> int:
        """End the streak; return how many attempts had failed in it."""
        self._last_reason = ""
        return self._backoff.reset()


def _failure_kind(exc: BaseException) -> str:
    """A serve failure without the parts that change at every attempt (fresh socket and temporary names, gRPC's
    debug string): what decides whether a streak's reason changed."""
    if isinstance(exc, OSError):
        return f"{type(exc).__name__} {exc.errno} {exc.strerror}"
    if isinstance(exc, grpc.RpcError):
        return f"RpcError {exc.code()} {exc.details()}"
    return type(exc).__name__


@dataclass(frozen=True)
class Signal:
    """What the watchdog saw, queued for the loop to judge when it takes it."""

    kind: str  # KUBELET_APPEARED, SOCKET_GONE or RESTART
    name: str  # the file concerned, or the reason of a forced restart


KUBELET_APPEARED = "kubelet.sock appeared"
SOCKET_GONE = "our socket is gone"
RESTART = "restart requested"


class _DirHandler(FileSystemEventHandler):
    def __init__(self, supervisor: Supervisor) -> None:
        self._sup = supervisor

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.is_directory:
            return
        src = os.fsdecode(event.src_path)
        kind = event.event_type
        # The kubelet binds kubelet.sock in place (created); a harness may bind elsewhere and rename it in (moved).
        appeared = src if kind == "created" else os.fsdecode(event.dest_path) if kind == "moved" else ""
        if os.path.basename(appeared) == KUBELET_SOCKET:  # the watch is not recursive: it is in the plugin dir
            self._sup.kubelet_socket_created()
        if kind in ("deleted", "moved") and os.path.basename(src) in self._sup.current_endpoints():
            self._sup.our_socket_gone(os.path.basename(src))


@dataclass
class _Round:
    """One serve-and-register round: which kubelet it registers with and which endpoints are done."""

    kubelet: tuple[int, int] | None = None
    done: set[str] = field(default_factory=set)


class Supervisor:
    def __init__(self, plugin_dir: Path, resources: list[Resource], state: NodeState, alloc: AllocationConfig,
                 stop: threading.Event, backoff_initial_s: float = 0.1, backoff_max_s: float = 5.0) -> None:
        self.plugin_dir = plugin_dir
        self.resources = resources
        self.state = state
        self.alloc = alloc
        self.stop = stop
        self.options = plugin_options()
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.servers: list[PluginServer] = []
        self.record = RegistrationRecord()
        self.registered_event = threading.Event()  # set after every successful round of registration
        # Guards servers, the signal queue and the phase; the loop waits on it, so a signal or stop wakes it.
        self._cond = threading.Condition()
        self._signals: list[Signal] = []
        self._phase = Phase.SERVE
        self._idle = False  # the loop is waiting in WATCH with nothing queued
        self._observer: Observer | None = None  # type: ignore[valid-type]
        self._thread: threading.Thread | None = None
        self._death: str | None = None
        self._serve_backoff = FailureStreak(backoff_initial_s, backoff_max_s)
        self._register_backoff = FailureStreak(backoff_initial_s, backoff_max_s)
        self._retry = Phase.SERVE  # what BACKOFF goes back to
        self._delay_s = 0.0
        # The kubelet (kubelet.sock's inode, ctime) of the last complete registration.
        self._registered_with: tuple[int, int] | None = None
        # With several resources, a retry after one failed must not register the others again: the kubelet would
        # see a second plugin on the same socket.
        self._round = _Round()

    # Signals (watchdog thread) ------------------------------------------------------------------------------------

    def current_endpoints(self) -> set[str]:
        with self._cond:
            return {s.endpoint for s in self.servers}

    def kubelet_socket_created(self) -> None:
        """kubelet.sock appeared (created or renamed in). Judged by the loop when it takes it, not now."""
        self._signal(Signal(KUBELET_APPEARED, KUBELET_SOCKET))

    def our_socket_gone(self, endpoint: str) -> None:
        self._signal(Signal(SOCKET_GONE, endpoint))

    def request_restart(self, reason: str) -> None:
        """Serve and register afresh, whatever the state of the dir."""
        self._signal(Signal(RESTART, reason))

    def _signal(self, sig: Signal) -> None:
        with self._cond:
            self._signals.append(sig)
            self._cond.notify_all()

    # Observation --------------------------------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._phase

    def pending(self) -> list[str]:
        """The signals queued and not yet judged, as text."""
        with self._cond:
            return [f"{s.kind}: {s.name}" for s in self._signals]

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until ``predicate()`` holds; re-checked at every phase change and signal."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def wait_settled(self, timeout: float) -> bool:
        """Block until the loop is registered and waiting with no signal left to judge."""
        return self.wait_for(lambda: self._phase is Phase.WATCH and self._idle and not self._signals, timeout)

    def failure(self) -> str | None:
        """Why the loop no longer runs although nobody asked it to stop; None while it runs (or before start)."""
        if self._death is not None:
            return self._death
        t = self._thread
        if t is not None and not t.is_alive() and not self.stop.is_set():
            return "the supervisor thread ended"
        return None

    def alive(self) -> bool:
        return self.failure() is None

    # Lifecycle ----------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        observer = Observer()
        observer.schedule(_DirHandler(self), str(self.plugin_dir), recursive=False)
        observer.daemon = True
        observer.start()
        self._observer = observer
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 3.0) -> None:
        self.stop.set()
        with self._cond:
            self._cond.notify_all()
        # The observer feeds the loop: it ends first, before the loop and before the servers' sockets are removed
        # from the directory it watches (a watchdog observer stopped with an event in flight logs it).
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(1.0)
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._cond:
            servers, self.servers = self.servers, []
        for s in servers:
            s.stop(grace_s=0.2)

    # The loop -----------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            phase = Phase.SERVE
            while not self.stop.is_set():
                self._set_phase(phase)
                if phase is Phase.SERVE:
                    phase = self._serve()
                elif phase is Phase.REGISTER:
                    phase = self._register_round()
                elif phase is Phase.WATCH:
                    phase = self._watch()
                else:
                    phase = self._backoff()
            self._set_phase(Phase.STOPPED)
        except BaseException as exc:  # whatever it was, only a restart of the pod brings the loop back
            self._death = f"{type(exc).__name__}: {exc}"
            log.critical("the supervisor loop died; /healthz now fails so the pod is restarted", exc_info=True)
            self._set_phase(Phase.DEAD)

    def _set_phase(self, phase: Phase) -> None:
        with self._cond:
            self._phase = phase
            self._idle = False
            self._cond.notify_all()

    def _fail(self, retry: Phase, delay_s: float) -> Phase:
        self._retry, self._delay_s = retry, delay_s
        return Phase.BACKOFF

    def _serve(self) -> Phase:
        self.record.registered = False
        self.registered_event.clear()
        self._round = _Round()
        with self._cond:
            old, self.servers = self.servers, []
        for s in old:  # before the new ones: the kubelet must never see two of our servers for one resource
            s.stop(grace_s=0.2)
        fresh: list[PluginServer] = []
        for resource in self.resources:
            servicer = DevicePluginServicer(self.state, resource, self.alloc, self.options)
            server = PluginServer(self.plugin_dir, resource, servicer)
            try:
                server.start()
            except (grpc.RpcError, OSError, RuntimeError) as exc:
                server.stop(0)
                for s in fresh:  # all or none: a round registers every resource or none of them
                    s.stop(0)
                self.record.serve_failures += 1
                why = f"cannot serve {resource.name} on {server.path}: {exc}"
                self.record.last_error = why  # /readyz says why we are not registered
                delay, worth = self._serve_backoff.failed(f"{resource.name}: {_failure_kind(exc)}")
                if worth:
                    log.error("%s; retrying in %gs (attempt %d)", why, delay, self._serve_backoff.attempts)
                else:
                    log.debug("%s; retrying in %gs", why, delay)
                return self._fail(Phase.SERVE, delay)
            fresh.append(server)
        with self._cond:
            self.servers = fresh
        failed = self._serve_backoff.succeeded()
        for server in fresh:
            log.info("serving %s on %s", server.resource.name, server.path)
        if failed:
            log.info("serving again after %d failed attempts", failed)
        return Phase.REGISTER

    def _register_round(self) -> Phase:
        ident = self._kubelet_identity()
        if self._round.done and ident != self._round.kubelet:
            # Part of this round went to a kubelet that has since been replaced: start the round afresh.
            log.info("the kubelet changed in the middle of a registration round; serving afresh")
            return Phase.SERVE
        self._round.kubelet = ident
        kubelet_socket = self.plugin_dir / KUBELET_SOCKET
        for server in list(self.servers):
            if server.endpoint in self._round.done:
                continue
            try:
                register(kubelet_socket, server, self.options)
            except (grpc.RpcError, OSError) as exc:
                why = str(exc.details() if isinstance(exc, grpc.RpcError) else exc)
                self.record.failures += 1
                self.record.last_error = why
                delay, worth = self._register_backoff.failed(why)
                if worth:
                    log.warning("registration of %s failed, retrying with backoff (attempt %d): %s",
                                server.resource.name, self._register_backoff.attempts, why)
                return self._fail(Phase.REGISTER, delay)
            self._round.done.add(server.endpoint)
            log.info("registered %s with the kubelet (endpoint %s)", server.resource.name, server.endpoint)
        self._register_backoff.succeeded()
        self._registered_with = ident
        self.record.registered = True
        self.record.registrations += 1
        self.record.last_registered_at = time.time()
        self.record.last_error = ""
        self.registered_event.set()
        return Phase.WATCH

    def _take(self, timeout_s: float) -> list[Signal]:
        """Wait up to ``timeout_s`` for signals (or stop) and take them all."""
        with self._cond:
            if not self._signals and not self.stop.is_set():
                self._idle = self._phase is Phase.WATCH
                self._cond.notify_all()
                self._cond.wait(timeout_s)
                self._idle = False
            signals, self._signals = self._signals, []
            return signals

    def _watch(self) -> Phase:
        signals = self._take(AUDIT_S)
        if signals:
            return self._judge(signals) or Phase.WATCH
        return self._audit() or Phase.WATCH

    def _backoff(self) -> Phase:
        deadline = time.monotonic() + self._delay_s
        while not self.stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            signals = self._take(remaining)
            nxt = self._judge(signals) if signals else None
            # A new kubelet or our socket gone makes a registration likely to work now. A serve failure is about
            # our side (the dir, the path, the bind): nothing seen in the dir is a reason to try again sooner.
            if nxt is not None and self._retry is Phase.REGISTER:
                return nxt
        return self._retry

    def _judge(self, signals: list[Signal]) -> Phase | None:
        """What the queued signals call for, judged against the dir and the kubelet as they are now."""
        nxt: Phase | None = None
        endpoints = self.current_endpoints()
        for sig in signals:
            if sig.kind == RESTART:
                log.info("(re)starting device plugin servers: %s", sig.name)
                nxt = Phase.SERVE
            elif sig.kind == SOCKET_GONE:
                if sig.name in endpoints and not (self.plugin_dir / sig.name).exists():
                    log.info("our socket %s was deleted; serving afresh", sig.name)
                    nxt = Phase.SERVE
                else:
                    log.debug("dropped: %s (%s) no longer applies", sig.kind, sig.name)
            else:
                ident = self._kubelet_identity()
                if ident is None:
                    log.debug("kubelet.sock appeared and went again")
                elif self.record.registered and ident == self._registered_with:
                    log.info("kubelet.sock created, but already registered with that kubelet")
                elif not self.record.registered and ident == self._round.kubelet:
                    log.debug("kubelet.sock created: the kubelet this round already tried")
                elif self.record.registered or self._round.done:
                    log.info("kubelet.sock created (kubelet restarted); serving afresh and registering again")
                    nxt = Phase.SERVE
                elif nxt is None:
                    log.info("kubelet.sock created; registering")
                    nxt = Phase.REGISTER
        return nxt

    def _audit(self) -> Phase | None:
        """Registered and nothing signalled: check what the signals would have said, in case one was missed."""
        ident = self._kubelet_identity()
        if ident is not None and ident != self._registered_with:
            log.info("kubelet.sock is a different kubelet than the one registered with (no event seen)")
            return Phase.SERVE
        for server in list(self.servers):
            if not server.path.exists():
                log.info("our socket %s is gone (no event seen); serving afresh", server.endpoint)
                return Phase.SERVE
        return None

    def _kubelet_identity(self) -> tuple[int, int] | None:
        try:
            st = (self.plugin_dir / KUBELET_SOCKET).stat()
        except OSError:
            return None
        return st.st_ino, st.st_ctime_ns
