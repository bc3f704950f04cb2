"""The writer that keeps the node's DRA ResourceSlice on the API server (DRA driver mode).

A thin writer around the pure parts in ``slices.py``, on the paced-writer base it shares with the node reporter
(plugin/kube/writer.py, plugin/outlets/reporter.py):

- only on change: it keeps the server's copy from its last read or write and asks ``slice_changed`` whether what it
  wants differs; an unchanged node costs no request at all but one GET every ``resync_s``;
- a burst is coalesced (a write ``debounce_s`` after the first unwritten change, with the state of that moment) and
  a token bucket (one token per ``min_interval_s``) bounds the writes;
- failures back off exponentially with jitter and are logged once per back-off; an API server that does not serve
  resource.k8s.io/v1 is logged once and asked again at the back-off cap;
- every PUT carries the resourceVersion it was computed from; a 409 re-reads and recomputes at once (bounded);
- the API server drops device taints while its DRADeviceTaints gate is off: seen once, logged once, and the writer
  stops asking for taints, so its comparison with the stored copy settles instead of writing forever; the devices
  the taints kept claims off are left out of the slice until they recover (rewritten at once, in the same step:
  an untainted faulty device is allocatable).

Stopping leaves the slice in place: a restarting plugin must not make the node's devices vanish from the scheduler.
The Node owns the slice (when its UID could be read), so deleting the node deletes it; ``delete_slice`` is the
explicit uninstall path.

Time is passed in (``tick(now)``), so tests drive it on a virtual clock.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from plugin.backoff import Backoff
from plugin.dra.shares import sharing_dropped
from plugin.dra.slices import (
    PublishedDevice,
    SliceSettings,
    must_recreate,
    next_generation,
    published_devices,
    resource_slice,
    slice_name,
    taints_dropped,
    update_body,
)
from plugin.health.node_state import NodeState
from plugin.kube.errors import ApiFailure
from plugin.kube.protocols import SliceApi
from plugin.kube.ratelimit import WriteScheduler
from plugin.kube.writer import PacedWriter, WriterStatus
from plugin.outlets.worker import OutletThread

log = logging.getLogger(__name__)

LABEL = "resource slice"


@dataclass(frozen=True, kw_only=True)
class SliceWriterStatus(WriterStatus):
    """For metrics and the health stream. ``writes`` are creates, updates and deletes of the slice, ``reads`` its
    GETs."""

    taints_published: bool = True  # false once the API server was seen dropping our device taints
    sharing_published: bool = True  # false once it was seen dropping allowMultipleAllocations
    # Every kind ``failures_by_kind`` can hold, so the metrics show each at 0 before its first failure. A label
    # value each: no spaces.
    failure_kinds: ClassVar[tuple[str, ...]] = ("client", "read", "write", "not-served")


class _NotServed(Exception):
    """The API server answered 404 for the slice collection: it does not serve resource.k8s.io/v1."""

    def __init__(self, failure: ApiFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure


class SliceWriter(PacedWriter[SliceWriterStatus, SliceApi], OutletThread):
    RECOVERED = "API server answering again"

    def __init__(self, state: NodeState, settings: SliceSettings, client_factory: Callable[[], SliceApi],
                 debounce_s: float = 1.0, min_interval_s: float = 10.0, resync_s: float = 600.0,
                 backoff_max_s: float = 300.0, clock: Callable[[], float] = time.monotonic, *,
                 backoff_initial_s: float = 1.0, rng: random.Random | None = None,
                 recheck_window_s: float = 180.0, recheck_every_s: float = 10.0) -> None:
        OutletThread.__init__(self, state, clock, version=0, thread_name="slice-writer", label=LABEL, log=log)
        self.settings = settings
        self.name = slice_name(settings)
        self._resync_s = resync_s
        # A starting kubelet deletes the node's slices from a goroutine that first waits for its Node, retrying
        # 1, 2, 4, ... s, so the delete may land minutes after it took us and after our re-read: for a while after
        # each registration the slice is read again every few seconds (a GET each), then once a resync again.
        self._recheck_window_s = recheck_window_s
        self._recheck_every_s = recheck_every_s
        self._recheck_until = -math.inf
        self._backoff = Backoff(backoff_initial_s, backoff_max_s, rng=rng or random.Random())
        PacedWriter.__init__(self, SliceWriterStatus(taints_published=settings.taints,
                                                        sharing_published=settings.consumable),
                             WriteScheduler(debounce_s, min_interval_s, self._backoff, clock()), client_factory,
                             time.time, label=LABEL, log=log)
        self._devices: list[PublishedDevice] = []
        self._current: dict[str, Any] | None = None  # the server's copy, from our last read or write
        self._need_read = True
        self._need_node = not settings.node_uid  # the Node's UID, so the Node owns the slice
        self._next_resync = math.inf
        self._not_served_logged = False
        self._retired = False  # delete_slice ran: never write the slice again
        self._resync = threading.Event()  # resync_now asked, from another thread

    def _not_served(self, f: ApiFailure, now: float) -> None:
        # Not a passing fault: DRA is off on the cluster (or it is older than 1.34). Asking at the cap still picks
        # it up without a restart once someone turns it on, and one line says it all, not one per attempt.
        delay = self._sched.failed(now, self._backoff.maximum)
        self._count_failure("resource.k8s.io/v1 not served", f, "not-served")
        if not self._not_served_logged:
            log.error("%s: the API server does not serve resource.k8s.io/v1 ResourceSlices (%s): DRA is off on "
                      "this cluster or it is older than 1.34; the node's GPUs are not published to DRA; asking "
                      "again every %.0fs", LABEL, f, delay)
            self._not_served_logged = True

    # One step -------------------------------------------------------------------------------------------------

    def tick(self, now: float) -> float:
        """Do whatever is due at ``now``; return when to be called next (or sooner, on a state change)."""
        if self._retired:
            return math.inf
        if self._resync.is_set():
            self._resync.clear()
            self._need_read = True
            self._recheck_until = now + self._recheck_window_s
        snap = self.state.snapshot()
        if snap.version == 0:
            return math.inf  # nothing published yet: writing now would empty the pool of a restarting node
        if snap.version != self._version:
            # A MIG layout change is a new snapshot like any other: the devices follow, and the write with them.
            self._devices = published_devices(snap.devices, self.settings.mig_strategy)
            self._version = snap.version
        retry_at = self._connect(now)
        if retry_at is not None:
            return retry_at
        if (self._need_read or now >= self._next_resync) and not self._sched.blocked(now):
            self._read(now)
        self._check_pending(now)
        if not self._need_read and self._sched.try_start(now):
            self._write(now)
        deadlines = [self._sched.due_at(now), self._next_resync]
        if self._need_read:
            deadlines.append(max(now, self._sched.blocked_until))
        return min(deadlines)

    def resync_now(self) -> None:
        """Read the slice again at once (from any thread): the kubelet deletes a driver's slices some time after
        its plugin went, so a plugin that registers again must not wait for the next resync to put it back."""
        self._resync.set()
        self.state.poke()

    def _woken(self) -> bool:
        return self._resync.is_set()  # resync_now: wake the thread, whose wait otherwise ends only on a snapshot

    def _desired(self) -> dict[str, Any]:
        return resource_slice(self._devices, self.settings)

    def _check_pending(self, now: float) -> None:
        if self._need_read:
            return
        if update_body(self._current, self._desired()) is None:
            self._sched.settled()
        else:
            self._sched.changed(now)

    def _read(self, now: float) -> bool:
        assert self._api is not None
        try:
            current = self._api.get_resource_slice(self.name)
            # Our slice vanished (the Node was deleted and made again, or someone deleted the slice): a new Node
            # has a new UID, and a slice owned by the old one would be collected again at once.
            if self._need_node or (current is None and self._current is not None):
                node = self._api.get_node(self.settings.node_name)
                self.settings = replace(self.settings, node_uid=node.uid)
                self._need_node = False
        except ApiFailure as f:
            if f.status == 404:  # only get_node raises on 404: a missing slice is None
                f = ApiFailure(404, f"node {self.settings.node_name} does not exist (check --node-name)")
            self._failed(f"reading ResourceSlice {self.name} and its Node", f, self._sched.failed(now, f.retry_after),
                         "read")
            return False
        self._current = current
        self._need_read = False
        self._next_resync = now + (self._recheck_every_s if now < self._recheck_until else self._resync_s)
        self._update(reads=self.status().reads + 1)
        if not self._not_served_logged:  # a GET answers while the API is not served: nothing recovered yet
            self._recovered()
        return True

    def _write(self, now: float) -> None:
        assert self._api is not None
        writes = 0

        def write() -> bool:
            nonlocal writes
            desired = self._desired()
            body = update_body(self._current, desired)
            if body is None:
                return True
            stored = self._send(body, desired)
            writes += 1
            self._current = stored
            if taints_dropped(body, stored):
                self._taints_off()  # the slice without the tainted devices is due in this same step
            if self.settings.consumable and sharing_dropped(body, stored):
                self._sharing_off()  # the plain slice is due in this same step
            return False

        try:
            # 409: someone changed (or created) the slice since our read; 404 on a PUT: someone deleted it.
            if not self._until_settled(write, lambda: self._read(now), frozenset({404, 409})):
                return
        except _NotServed as exc:
            self._need_read = True
            self._not_served(exc.failure, now)
            return
        except ApiFailure as f:
            self._need_read = True  # converge from what the server really has once it answers again
            self._failed(f"writing ResourceSlice {self.name}", f, self._sched.failed(now, f.retry_after), "write")
            return
        finally:
            if writes:
                self._update(writes=self.status().writes + writes)
        if self._not_served_logged and writes:
            log.info("%s: the API server now serves resource.k8s.io/v1; ResourceSlice %s written", LABEL, self.name)
            self._not_served_logged = False
        self._sched.succeeded()
        self._recovered()
        self._check_pending(now)  # a change that arrived while the write was in flight stays pending

    def _send(self, body: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
        assert self._api is not None
        current = self._current
        if current is not None and must_recreate(current, desired):
            # Driver, node and pool name are immutable: an update changing one is refused.
            self._api.delete_resource_slice(self.name)
            self._current = None
            # Past the old generation, so no consumer that saw the old pool takes the new one for older.
            body = dict(desired)
            body["spec"] = {**desired["spec"],
                            "pool": {**desired["spec"]["pool"], "generation": next_generation(current, desired)}}
            current = None
        if current is None:
            try:
                return self._api.create_resource_slice(body)
            except ApiFailure as f:
                if f.status == 404:
                    raise _NotServed(f) from None
                raise
        return self._api.update_resource_slice(self.name, body)

    def _taints_off(self) -> None:
        log.warning("%s: the API server dropped the device taints of ResourceSlice %s: the DRADeviceTaints "
                    "feature gate is off on this cluster, so devices kept from pods (Unhealthy, and as "
                    "health.kubeletHealth maps them, Unknown or Degraded) are left out of the slice until they "
                    "recover, and only the health stream carries device health", LABEL, self.name)
        self.settings = replace(self.settings, taints=False)
        self._update(taints_published=False)

    def _sharing_off(self) -> None:
        log.warning("%s: the API server dropped allowMultipleAllocations from ResourceSlice %s: the "
                    "DRAConsumableCapacity feature gate is off on this cluster, so the GPUs the sharing section names "
                    "are published as plain devices, one claim each; pods share one by naming the same "
                    "ResourceClaim (docs/dra.md, \"Shared GPUs\")", LABEL, self.name)
        self.settings = replace(self.settings, consumable=False)
        self._update(sharing_published=False)

    # Uninstall ------------------------------------------------------------------------------------------------

    def delete_slice(self) -> None:
        """Delete the node's slice (already gone is fine), for an explicit uninstall; the writer never writes it
        again. Call it after :meth:`stop`; a failure raises :class:`ApiFailure`."""
        self._retired = True
        api = self._api_factory()
        try:
            api.delete_resource_slice(self.name)
        finally:
            api.close()
        self._current = None
        self._update(writes=self.status().writes + 1)
