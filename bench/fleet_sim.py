#!/usr/bin/env python3
"""Fleet simulation (issue 5): writes per second to the API server from every node's cluster reporter.

5,000 nodes x 8 GPUs over one virtual day, at 19 remediations per 1,000 nodes per day, plus one correlated event: a
driver rollout that hits 10% of the nodes within one minute. Each node runs the reporter's real scheduling code
(``plugin.kube.ratelimit.WriteScheduler``: debounce, per-node token bucket) on a virtual clock; a node writes when its
scheduler lets it and its desired annotations differ from what it last wrote. Compared with one write per
transition (no coalescing).

Idle polling is measured, not assumed: ``idle_poll_check`` runs one node's real health engine (the simulated backend,
plugin/health/monitor.py) and computes its desired annotations (plugin/schema/annotations.py) after each of a few
polls of an unchanged node. If they moved (the defect of issue 12: ``since`` set to the time of each poll), every
node would want a write at each poll and write at its token-bucket rate; the figure for that is reported beside
the transition-driven ones, so the two can be compared.

Model (stated, not measured):
- a remediation: one GPU goes Unhealthy; after a repair time uniform in 10..60 min it comes back Healthy
  (2 transitions);
- the rollout: each hit node, at a uniformly random moment of the minute, sees its 8 GPUs go Unknown one after the
  other within 0.5 s while the driver reloads, then Healthy again 20..40 s later, again within 0.5 s
  (16 transitions per node).

    python bench/fleet_sim.py                       # 5,000 nodes, seed 1
    python bench/fleet_sim.py --nodes 20000 --seed 7
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import threading
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plugin.backoff import Backoff
from plugin.devices.simulated import SimulatedBackend
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.kube.ratelimit import WriteScheduler
from plugin.schema.annotations import desired_annotations, last_transitions

DAY = 86_400.0


class NodeSim:
    """One node's reporter, reduced to what decides writes: desired vs written, and the real scheduler."""

    def __init__(self, rng: random.Random, debounce: float, min_interval: float) -> None:
        self.sched = WriteScheduler(debounce, min_interval, Backoff(1.0, 300.0, rng=rng), now=-DAY)
        self.desired = 0  # a version: bumped on every transition
        self.written = 0
        self.wake_at = math.inf


def idle_poll_check(poll_interval: float, polls: int = 20) -> dict[str, object]:
    """Poll an unchanged node with the real engine; count the polls after which its desired annotations moved."""
    now = [1_767_225_600.0]
    state = NodeState()
    monitor = Monitor(SimulatedBackend(clock=lambda: now[0]), state, HealthConfig(), poll_interval,
                      threading.Event(), clock=lambda: now[0])
    monitor.poll_once()

    def desired() -> dict[str, str]:
        return desired_annotations(state.snapshot(), last_transitions(state.history())).annotations

    before, moved = desired(), 0
    for _ in range(polls):
        now[0] += poll_interval
        monitor.poll_once()
        after = desired()
        moved += after != before
        before = after
    return {"poll_interval_s": poll_interval, "polls": polls, "polls_that_moved_annotations": moved}


def simulate(nodes: int, gpus: int, rate_per_1000: float, rollout_fraction: float, seed: int,
             debounce: float, min_interval: float, poll_interval: float = 5.0) -> dict[str, object]:
    idle = idle_poll_check(poll_interval)
    rng = random.Random(seed)
    transitions: list[tuple[float, int]] = []  # (time, node)
    # Poisson arrivals: the expected count per day, at exponential gaps.
    t = 0.0
    remediations = 0
    while True:
        t += rng.expovariate(nodes * rate_per_1000 / 1000.0 / DAY)
        if t >= DAY:
            break
        remediations += 1
        n = rng.randrange(nodes)
        transitions.append((t, n))
        transitions.append((t + rng.uniform(600, 3600), n))
    rollout_start = DAY / 2
    hit = rng.sample(range(nodes), int(nodes * rollout_fraction))
    for n in hit:
        at = rollout_start + rng.uniform(0, 60)
        back = at + rng.uniform(20, 40)
        for g in range(gpus):
            transitions.append((at + g * 0.5 / gpus, n))
            transitions.append((back + g * 0.5 / gpus, n))
    transitions.sort()

    sims: dict[int, NodeSim] = {}
    writes: Counter[int] = Counter()  # per second
    per_transition: Counter[int] = Counter()
    queue: list[tuple[float, int, int]] = []  # (time, kind 0=transition 1=wake, node)
    for when, n in transitions:
        queue.append((when, 0, n))
    heapq.heapify(queue)
    total_writes = 0
    while queue:
        now, kind, n = heapq.heappop(queue)
        sim = sims.get(n)
        if sim is None:
            sim = sims[n] = NodeSim(rng, debounce, min_interval)
        if kind == 0:
            per_transition[int(now)] += 1
            sim.desired += 1
            sim.sched.changed(now)
        elif now != sim.wake_at:
            continue  # a superseded wake-up
        if sim.desired != sim.written and sim.sched.try_start(now):
            sim.written = sim.desired
            sim.sched.succeeded()
            writes[int(now)] += 1
            total_writes += 1
        if sim.desired != sim.written:
            due = sim.sched.due_at(now)
            if due != sim.wake_at:
                sim.wake_at = due
                heapq.heappush(queue, (due, 1, n))

    def peak(c: Counter[int], window: int) -> float:
        if not c:
            return 0.0
        lo, hi = min(c), max(c)
        best, acc = 0, 0
        for s in range(lo, hi + 1):
            acc += c.get(s, 0) - c.get(s - window, 0)
            best = max(best, acc)
        return best / window

    n_trans = len(transitions)
    return {
        "nodes": nodes, "gpus_per_node": gpus, "remediations": remediations,
        "rollout_nodes": len(hit), "transitions": n_trans,
        "settings": {"debounce_s": debounce, "min_interval_s": min_interval},
        "coalesced": {"writes": total_writes, "mean_per_s": round(total_writes / DAY, 4),
                      "peak_1s": peak(writes, 1), "peak_10s_avg": peak(writes, 10), "peak_60s_avg": peak(writes, 60)},
        "one_write_per_transition": {"writes": n_trans, "mean_per_s": round(n_trans / DAY, 4),
                                     "peak_1s": peak(per_transition, 1), "peak_10s_avg": peak(per_transition, 10),
                                     "peak_60s_avg": peak(per_transition, 60)},
        "ratio_writes": round(total_writes / n_trans, 3) if n_trans else None,
        "ratio_peak_1s": round(peak(writes, 1) / peak(per_transition, 1), 3) if per_transition else None,
        "resync_reads_per_s": round(nodes / 600.0, 2),
        "idle_polls": idle,
        # Writes/s that idle polling adds on top of the transitions: none when polls leave the annotations alone,
        # else each node writes once per token (or per poll, if polls are rarer).
        "idle_writes_per_s": (round(nodes / max(min_interval, poll_interval), 1)
                              if idle["polls_that_moved_annotations"] else 0.0),
        "idle_writes_per_s_if_each_poll_moved_annotations": round(nodes / max(min_interval, poll_interval), 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--rate", type=float, default=19.0, help="remediations per 1,000 nodes per day")
    ap.add_argument("--rollout", type=float, default=0.10, help="fraction of nodes hit by the rollout")
    ap.add_argument("--debounce", type=float, default=1.0)
    ap.add_argument("--min-interval", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--poll-interval", type=float, default=5.0, help="the plugin's health poll interval")
    a = ap.parse_args()
    print(json.dumps(simulate(a.nodes, a.gpus, a.rate, a.rollout, a.seed, a.debounce, a.min_interval,
                              a.poll_interval), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
