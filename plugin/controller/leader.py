"""Leader election on a coordination.k8s.io/v1 Lease, the way client-go's leaderelection does it, so that of the
Deployment's replicas exactly one acts.

- A standby reads the Lease every ``retry_period``. It takes the Lease over only when the record (holder, renew
  time, transitions) has not changed for ``lease_duration`` by its own clock: clocks of different machines are
  never compared.
- The leader renews every ``retry_period`` with an update carrying the Lease's ``resourceVersion`` (no read first:
  a renewal is one request). A 409 means someone else wrote the Lease: it reads again at the next round.
- The leader counts as leader only until ``renew_deadline`` after it *sent* its last successful renewal (or the
  write that took the Lease), which is shorter than ``lease_duration``: it stops acting before anyone else may take
  over, so two replicas never act at once. Counted from the send, not the answer: the server applied the write
  somewhere in between, and a standby's clock starts from an answer that came after that, so a slow answer cannot
  stretch a term into the next leader's. The reconciler asks :meth:`is_leader` immediately before each write.
- On a clean stop the leader hands the Lease back (holder cleared), so a standby takes over at once.

The leader also keeps small state on the Lease's annotations (the breaker): :meth:`set_annotation` queues a value
for the next renewal, and :meth:`annotations` is what the last read or write returned.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from plugin.controller.api import LeaseApi
from plugin.kube.errors import ApiFailure

log = logging.getLogger(__name__)


def _micro_time(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(self, api: LeaseApi, namespace: str, name: str, identity: str, *, lease_duration_s: float,
                 renew_deadline_s: float, retry_period_s: float, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 on_change: Callable[[bool], None] | None = None,
                 on_annotations: Callable[[], None] | None = None) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self._clock = clock
        self._wall = wall
        self._on_change = on_change
        self._on_annotations = on_annotations  # an operator's edit of the Lease (a breaker reset) wakes the worker
        self._annotations_seen: dict[str, str] = {}
        self._lock = threading.Lock()
        self._lease: dict[str, Any] | None = None  # the Lease as we last wrote or read it while holding it
        self._lease_seen: dict[str, Any] | None = None  # as last read while someone else held it
        self._observed: tuple[object, ...] | None = None
        self._observed_at = 0.0
        self._renewed_at: float | None = None
        self._pending: dict[str, str] = {}
        self._was_leader = False
        self.holder = ""
        self.transitions = 0
        self.failures = 0
        self.requests = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # What the others ask ---------------------------------------------------------------------------------------

    def is_leader(self) -> bool:
        with self._lock:
            return self._renewed_at is not None and self._clock() - self._renewed_at < self.renew_deadline_s

    def annotations(self) -> dict[str, str]:
        with self._lock:
            lease = self._lease or {}
            out = dict((lease.get("metadata") or {}).get("annotations") or {})
            out.update(self._pending)
            return out

    def set_annotation(self, key: str, value: str) -> None:
        with self._lock:
            self._pending[key] = value

    # The loop --------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._thread.start()

    def stop(self, release: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.retry_period_s + 5.0)
        if release and self.is_leader():
            self._release()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.step()
            self._stop.wait(self.retry_period_s)

    def step(self) -> None:
        """One round: renew when leading, else read and maybe take over. Never raises."""
        try:
            if self._lease is not None and self._holds(self._lease):
                self._renew()
            else:
                self._try_acquire()
        except ApiFailure as exc:
            self.failures += 1
            if exc.status == 409:
                self._lease = None  # read it again next round
            else:
                log.warning("leader election: %s", exc)
        self._notify()

    def _holds(self, lease: dict[str, Any]) -> bool:
        return str((lease.get("spec") or {}).get("holderIdentity") or "") == self.identity

    def _notify(self) -> None:
        seen = self.seen_annotations()
        if seen != self._annotations_seen:
            self._annotations_seen = seen
            if self._on_annotations is not None:
                self._on_annotations()
        now_leader = self.is_leader()
        if now_leader != self._was_leader:
            self._was_leader = now_leader
            log.info("leader election: %s the leader of lease %s/%s", "now" if now_leader else "no longer",
                     self.namespace, self.name)
            if self._on_change is not None:
                self._on_change(now_leader)

    def _spec(self, acquire: bool, transitions: int) -> dict[str, Any]:
        now = _micro_time(self._wall())
        spec: dict[str, Any] = {"holderIdentity": self.identity,
                                "leaseDurationSeconds": max(1, round(self.lease_duration_s)),
                                "renewTime": now, "leaseTransitions": transitions}
        if acquire:
            spec["acquireTime"] = now
        return spec

    def _body(self, lease: dict[str, Any] | None, spec: dict[str, Any]) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        with self._lock:
            pending = dict(self._pending)
        if lease is not None:
            old = lease.get("metadata") or {}
            meta["resourceVersion"] = old.get("resourceVersion")
            annotations = dict(old.get("annotations") or {})
            if spec.get("acquireTime") is None and (lease.get("spec") or {}).get("acquireTime"):
                spec = {**spec, "acquireTime": (lease.get("spec") or {}).get("acquireTime")}
        else:
            annotations = {}
        annotations.update(pending)
        if annotations:
            meta["annotations"] = annotations
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    def _written(self, lease: dict[str, Any], sent: dict[str, str], sent_at: float) -> None:
        with self._lock:
            self._lease = lease
            self._renewed_at = sent_at
            for k, v in sent.items():
                if self._pending.get(k) == v:
                    del self._pending[k]
        self.holder = self.identity

    def _renew(self) -> None:
        assert self._lease is not None
        sent = dict(self._pending)
        spec = self._spec(False, int((self._lease.get("spec") or {}).get("leaseTransitions") or 0))
        self.requests += 1
        body = self._body(self._lease, spec)
        sent_at = self._clock()
        self._written(self.api.update_lease(self.namespace, self.name, body), sent, sent_at)

    def _try_acquire(self) -> None:
        self.requests += 1
        try:
            lease: dict[str, Any] | None = self.api.get_lease(self.namespace, self.name)
        except ApiFailure as exc:
            if exc.status != 404:
                raise
            lease = None
        # When the answer came, not when the read was sent: the record was written before the server read it, so
        # the lease duration counted from here ends after the holder's renew deadline, whatever the latency.
        now = self._clock()
        if lease is None:
            sent = dict(self._pending)
            self.requests += 1
            body = self._body(None, self._spec(True, 0))
            sent_at = self._clock()
            self._written(self.api.create_lease(self.namespace, body), sent, sent_at)
            return
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        record = (holder, spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed, self._observed_at = record, now
        with self._lock:
            self._lease = lease if holder == self.identity else None
            if holder != self.identity:
                self._renewed_at = None
                self._lease_seen = lease
                # What we queued while leading is stale now that another replica (or nobody) holds it: the next
                # leader's state is on the Lease, and taking it over later must not write ours over it.
                self._pending.clear()
        self.holder = holder
        self.transitions = int(spec.get("leaseTransitions") or 0)
        if holder == self.identity:
            self._renew_from(lease)
            return
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration_s)
        if holder and now - self._observed_at < duration:
            return  # someone holds it and renewed within the duration we have watched it for
        sent = dict(self._pending)
        self.requests += 1
        body = self._body(lease, self._spec(True, self.transitions + (1 if holder else 0)))
        sent_at = self._clock()
        self._written(self.api.update_lease(self.namespace, self.name, body), sent, sent_at)
        log.info("leader election: took over lease %s/%s from %r", self.namespace, self.name, holder or "nobody")

    def _renew_from(self, lease: dict[str, Any]) -> None:
        with self._lock:
            self._lease = lease
        self._renew()

    def seen_annotations(self) -> dict[str, str]:
        """The annotations of the Lease as last read, leader or not (a standby shows the breaker too)."""
        with self._lock:
            lease = self._lease or self._lease_seen or {}
            return dict((lease.get("metadata") or {}).get("annotations") or {})

    def _release(self) -> None:
        lease = self._lease
        if lease is None:
            return
        spec = {"holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": _micro_time(self._wall()),
                "leaseTransitions": int((lease.get("spec") or {}).get("leaseTransitions") or 0)}
        try:
            self.api.update_lease(self.namespace, self.name, self._body(lease, spec))
            log.info("leader election: handed lease %s/%s back", self.namespace, self.name)
        except ApiFailure as exc:
            log.warning("leader election: could not hand the lease back: %s", exc)
        with self._lock:
            self._renewed_at = None
