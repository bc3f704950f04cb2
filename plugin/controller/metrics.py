"""The controller's metrics and probes, read at scrape time from the reconciler, the watcher and the elector
(docs/fleet.md lists the series)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from plugin.controller.leader import LeaderElector
from plugin.controller.reconciler import Reconciler
from plugin.controller.watcher import NodeWatcher
from plugin.serve.exposition import CounterFamily, Family, GaugeFamily

P = "gpu_health_controller_"


class ControllerCollector:
    def __init__(self, reconciler: Reconciler, watcher: NodeWatcher, leader: LeaderElector) -> None:
        self.r = reconciler
        self.w = watcher
        self.le = leader

    def collect(self) -> Iterator[Family]:
        c = self.r.counts()
        yield GaugeFamily(P + "gpu_nodes", "GPU nodes the controller sees", c["gpu_nodes"])
        q = GaugeFamily(P + "quarantined_nodes", "GPU nodes quarantined by this controller, by reason",
                        labels=["reason"])
        for reason, n in sorted(self.r.quarantined_by_reason().items()):
            q.add_metric([reason], n)
        yield q
        yield GaugeFamily(P + "unreadable_nodes", "GPU nodes whose node agent annotations cannot be read (a value "
                          "past the codec's bounds): neither quarantined nor released on them", c["unreadable"])
        yield GaugeFamily(P + "candidate_nodes", "GPU nodes a rule fires for that are not quarantined (the breaker "
                          "holds them back, or a write is pending)", c["candidates"])
        yield GaugeFamily(P + "quarantine_limit", "the most GPU nodes the breaker lets be quarantined now: the "
                          "smaller of the fraction's limit and the absolute cap", c["limit"])
        yield GaugeFamily(P + "quarantine_max_nodes", "the absolute cap on quarantined nodes "
                          "(--max-quarantined-nodes), 0 when there is none", self.r.breaker.max_nodes)
        yield GaugeFamily(P + "breaker_open", "1 while the circuit breaker stops quarantines",
                          1 if self.r.breaker.is_open else 0)
        yield CounterFamily(P + "breaker_trips", "times the circuit breaker opened in this process",
                            self.r.breaker.trips)
        yield GaugeFamily(P + "leader", "1 while this replica holds the Lease", 1 if self.le.is_leader() else 0)
        actions = CounterFamily(P + "actions", "writes and would-be writes, by action", labels=["action"])
        for action, n in sorted(self.r.stats.actions.items()):
            actions.add_metric([action], n)
        yield actions
        failures = CounterFamily(P + "api_failures", "failed API calls, by call", labels=["call"])
        for call, n in sorted({**self.r.stats.api_failures, "watch": self.w.failures,
                               "lease": self.le.failures}.items()):
            failures.add_metric([call], n)
        yield failures
        refused = CounterFamily(P + "refused_writes", "Node writes the API server refused for good (403, 422, ...), "
                                "by action: not retried until the node changes or the next resync",
                                labels=["action"])
        for action, n in sorted(self.r.stats.refused_writes.items()):
            refused.add_metric([action], n)
        yield refused
        yield CounterFamily(P + "conflicts", "writes refused with 409 (the Node moved on; read and decided again)",
                            self.r.stats.conflicts)
        yield CounterFamily(P + "evictions_blocked", "evictions a PodDisruptionBudget refused (retried later)",
                            self.r.stats.evictions_blocked)
        yield CounterFamily(P + "node_lists", "full LISTs of the Nodes (start, 410 Gone, resync)", self.w.lists)
        yield CounterFamily(P + "node_watch_events", "watch events received", self.w.events)
        yield CounterFamily(P + "decisions", "nodes the leader looked at (each changed or due node, once per step): "
                            "a fleet at rest adds none, a change adds one", self.r.stats.decisions)


class ControllerProbes:
    """``/healthz``: the watch and reconcile threads are alive and the reconcile loop went round lately.
    ``/readyz``: the Node cache is filled and its feed not failing (leader or standby alike: a standby must be ready
    to take over)."""

    def __init__(self, reconciler: Reconciler, watcher: NodeWatcher, stall_s: float = 180.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.r = reconciler
        self.w = watcher
        self.stall_s = stall_s
        self.clock = clock

    def liveness(self) -> tuple[bool, str]:
        if not self.w.alive():
            return False, "node watch thread died"
        if not self.r.alive():
            return False, "reconcile thread died"
        age = self.clock() - self.r.last_step_at
        if self.r.last_step_at and age > self.stall_s:
            return False, f"reconcile loop stalled: last ran {age:.0f}s ago (limit {self.stall_s:.0f}s)"
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        if not self.r.synced:
            why = f": {self.w.last_error}" if self.w.last_error else ""
            return False, f"node cache not synced yet{why}"
        if self.w.last_error:
            # The last LIST or watch failed and none has gone through since: the cache may be going stale.
            return False, f"node watch failing: {self.w.last_error}"
        c = self.r.counts()
        return True, f"ok: {c['gpu_nodes']} GPU nodes, {c['quarantined']} quarantined"
