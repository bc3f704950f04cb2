#!/usr/bin/env python3
"""Fleet simulation (issues 5 and 27): writes per second to the API server from every node's cluster reporter.

N nodes x 8 GPUs over one virtual day, at 19 remediations per 1,000 nodes per day, plus one correlated event (the
storm): a driver rollout that hits a share of the nodes within one minute (``--storm``; 10% by default, the issue 27
question is 5% of 50,000). Each node runs the reporter's real scheduling code (``plugin.kube.ratelimit.WriteScheduler``:
debounce, per-node token bucket) on a virtual clock; a node writes when its scheduler lets it and its desired
annotations differ from what it last wrote. Compared with one write per transition (no coalescing).

Idle polling is measured, not assumed: ``idle_poll_check`` runs one node's real health engine (the simulated backend,
plugin/health/monitor.py) and computes its desired annotations (plugin/schema/annotations.py) after each of a few
polls of an unchanged node. If they moved (the defect of issue 12: ``since`` set to the time of each poll), every
node would want a write at each poll and write at its token-bucket rate; the figure for that is reported beside
the transition-driven ones, so the two can be compared.

Model (stated, not measured):
- a remediation: one GPU goes Unhealthy; after a repair time uniform in 10..60 min it comes back Healthy
  (2 transitions);
- the storm (a driver rollout): each hit node, at a uniformly random moment of the minute, sees its 8 GPUs go
  Unknown one after the other within 0.5 s while the driver reloads, then Healthy again 20..40 s later, again within
  0.5 s (16 transitions per node).

bench/bench_agent_writes.py plays the same storm to a few hundred real reporters against a real API server and
compares what they write with what ``storm_transitions`` and ``coalesce`` predict for the same events.

    python bench/fleet_sim.py                                # 5,000 nodes, 10% storm, seed 1
    python bench/fleet_sim.py --nodes 50000 --storm 0.05     # issue 27
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
from collections.abc import Iterable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plugin.backoff import Backoff
from plugin.devices.simulated import SimulatedBackend
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState, Transition
from plugin.health.reasons import State
from plugin.kube.ratelimit import WriteScheduler
from plugin.outlets.events import EventAggregator
from plugin.schema.annotations import desired_annotations, last_transitions

DAY = 86_400.0
STORM_WINDOW_S = 60.0  # the hit nodes' events start within this
STORM_SPREAD_S = 0.5  # a node's GPUs change one after the other within this
STORM_BACK_S = (20.0, 40.0)  # the driver is back after this long (uniform)


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


def storm_events(rng: random.Random, hit: Iterable[int], start: float,
                 window: float = STORM_WINDOW_S) -> list[tuple[int, float, float]]:
    """Per hit node: ``(node, down_at, back_at)``, its driver going away at a random moment of the window and
    coming back 20..40 s later."""
    out = []
    for n in hit:
        at = start + rng.uniform(0, window)
        out.append((n, at, at + rng.uniform(*STORM_BACK_S)))
    return out


def storm_changes(events: Iterable[tuple[int, float, float]], gpus: int) -> list[tuple[float, int, int, bool]]:
    """What ``storm_events`` does to each GPU: ``(time, node, gpu, back)``, a node's GPUs going Unknown one after
    the other within 0.5 s, and Healthy again the same way (``back``)."""
    out = []
    for n, at, back in events:
        for g in range(gpus):
            out.append((at + g * STORM_SPREAD_S / gpus, n, g, False))
            out.append((back + g * STORM_SPREAD_S / gpus, n, g, True))
    return out


def storm_transitions(events: Iterable[tuple[int, float, float]], gpus: int) -> list[tuple[float, int]]:
    """The transitions of ``storm_events``, ``(time, node)``, 2 x ``gpus`` per node."""
    return [(t, n) for t, n, _, _ in storm_changes(events, gpus)]


def coalesce(transitions: Sequence[tuple[float, int]], rng: random.Random, debounce: float,
             min_interval: float) -> list[tuple[float, int]]:
    """When each node's reporter writes, given its transitions: ``(time, node)`` of every write, in time order.
    Each node starts with a full token bucket and nothing pending."""
    sims: dict[int, NodeSim] = {}
    writes: list[tuple[float, int]] = []
    queue: list[tuple[float, int, int]] = [(when, 0, n) for when, n in transitions]  # kind 0=transition 1=wake
    heapq.heapify(queue)
    while queue:
        now, kind, n = heapq.heappop(queue)
        sim = sims.get(n)
        if sim is None:
            sim = sims[n] = NodeSim(rng, debounce, min_interval)
        if kind == 0:
            sim.desired += 1
            sim.sched.changed(now)
        elif now != sim.wake_at:
            continue  # a superseded wake-up
        if sim.desired != sim.written and sim.sched.try_start(now):
            sim.written = sim.desired
            sim.sched.succeeded()
            writes.append((now, n))
        if sim.desired != sim.written:
            due = sim.sched.due_at(now)
            if due != sim.wake_at:
                sim.wake_at = due
                heapq.heappush(queue, (due, 1, n))
    return writes


# A device's change as the Events see it: (time, node, gpu, from state, to state).
Change = tuple[float, int, int, str, str]
HEALTHY, UNHEALTHY, UNKNOWN = State.HEALTHY.value, State.UNHEALTHY.value, State.UNKNOWN.value


def storm_device_changes(events: Iterable[tuple[int, float, float]], gpus: int) -> list[Change]:
    return [(t, n, g, UNKNOWN, HEALTHY) if back else (t, n, g, HEALTHY, UNKNOWN)
            for t, n, g, back in storm_changes(events, gpus)]


def event_writes(changes: Sequence[Change], window_s: float = 600.0, min_interval_s: float = 10.0,
                 burst_s: float = 1.0) -> list[tuple[float, int]]:
    """When each node's reporter writes an Event (a create or a patch of an aggregated one), given its devices'
    changes in time order: the reporter's real ``EventAggregator`` per node (alike changes of a node's devices
    within ``burst_s``, the reporter's debounce, are one Event; a key is written at most once per
    ``min_interval_s``), fed at each change and flushed then and when the next burst closes or key is due, as the
    reporter's step does. Reason codes are left out: they only split keys further."""
    aggs: dict[int, EventAggregator] = {}
    wake: dict[int, float] = {}
    writes: list[tuple[float, int]] = []
    queue: list[tuple[float, int, int, int]] = [(c[0], 0, i, c[1]) for i, c in enumerate(changes)]
    heapq.heapify(queue)
    seq = 0
    while queue:
        now, kind, i, n = heapq.heappop(queue)
        agg = aggs.get(n)
        if agg is None:
            agg = aggs[n] = EventAggregator(f"node-{n}", window_s, min_interval_s, burst_s=burst_s)
        if kind == 0:
            seq += 1
            _, _, g, before, after = changes[i]
            agg.observe([Transition(seq, f"GPU-{n}-{g}", before, after, (), now)], {f"GPU-{n}-{g}": f"gpu.{g}"},
                        now)
        elif now != wake.get(n):
            continue  # a superseded wake-up
        for e in agg.due(now):
            writes.append((now, n))
            if agg.needs_create(e, now):
                agg.created(e, f"event-{len(writes)}", now)
            else:
                agg.patched(e, now)
        due = agg.next_due()
        if due != math.inf and due != wake.get(n):
            wake[n] = due
            heapq.heappush(queue, (due, 1, 0, n))
    return writes


def per_second(times: Iterable[float]) -> Counter[int]:
    return Counter(int(t) for t in times)


def peak(c: Counter[int], window: int, lo: int | None = None, hi: int | None = None) -> float:
    """The highest mean per second over ``window`` consecutive seconds, the windows lying within [lo, hi]."""
    if not c:
        return 0.0
    lo = min(c) if lo is None else lo
    hi = max(c) if hi is None else hi
    best, acc = 0, 0
    for s in range(lo, hi + 1):
        acc += c.get(s, 0) - (c.get(s - window, 0) if s - window >= lo else 0)
        best = max(best, acc)
    return best / window


def rates(c: Counter[int], lo: int | None = None, hi: int | None = None) -> dict[str, float]:
    return {"peak_1s": peak(c, 1, lo, hi), "peak_10s_avg": round(peak(c, 10, lo, hi), 2),
            "peak_60s_avg": round(peak(c, 60, lo, hi), 2)}


def simulate(nodes: int, gpus: int, rate_per_1000: float, storm_share: float, seed: int,
             debounce: float, min_interval: float, poll_interval: float = 5.0) -> dict[str, object]:
    idle = idle_poll_check(poll_interval)
    rng = random.Random(seed)
    transitions: list[tuple[float, int]] = []  # (time, node)
    changes: list[Change] = []  # the same, per device, for the Events
    # Poisson arrivals: the expected count per day, at exponential gaps.
    t = 0.0
    remediations = 0
    while True:
        t += rng.expovariate(nodes * rate_per_1000 / 1000.0 / DAY)
        if t >= DAY:
            break
        remediations += 1
        n = rng.randrange(nodes)
        back = t + rng.uniform(600, 3600)
        transitions += [(t, n), (back, n)]
        g = remediations % gpus  # which GPU only splits the Events' keys: not drawn, so the draws stay as before
        changes += [(t, n, g, HEALTHY, UNHEALTHY), (back, n, g, UNHEALTHY, HEALTHY)]
    storm_start = DAY / 2
    hit = rng.sample(range(nodes), int(nodes * storm_share))
    events = storm_events(rng, hit, storm_start)
    transitions += storm_transitions(events, gpus)
    transitions.sort()
    changes += storm_device_changes(events, gpus)
    changes.sort()
    writes = coalesce(transitions, rng, debounce, min_interval)
    ev = per_second(w for w, _ in event_writes(changes, burst_s=debounce))
    coalesced, per_transition = per_second(w for w, _ in writes), per_second(w for w, _ in transitions)
    # The storm's span: from its first transition until the last hit node can have written its last change.
    lo = int(storm_start)
    hi = int(storm_start + STORM_WINDOW_S + STORM_BACK_S[1] + STORM_SPREAD_S + debounce + min_interval) + 1
    in_storm = sum(v for s, v in coalesced.items() if lo <= s <= hi)

    total_writes, n_trans = len(writes), len(transitions)
    idle_writes = (round(nodes / max(min_interval, poll_interval), 1)
                   if idle["polls_that_moved_annotations"] else 0.0)
    storm_rates = rates(coalesced, lo, hi)
    ev_storm = rates(ev, lo, hi)
    both = coalesced + ev
    both_storm = rates(both, lo, hi)
    n_events = sum(ev.values())
    return {
        "nodes": nodes, "gpus_per_node": gpus, "remediations": remediations,
        "storm_share": storm_share, "rollout_nodes": len(hit), "transitions": n_trans,
        "settings": {"debounce_s": debounce, "min_interval_s": min_interval},
        "coalesced": {"writes": total_writes, "mean_per_s": round(total_writes / DAY, 4), **rates(coalesced)},
        "one_write_per_transition": {"writes": n_trans, "mean_per_s": round(n_trans / DAY, 4),
                                     **rates(per_transition)},
        "ratio_writes": round(total_writes / n_trans, 3) if n_trans else None,
        "ratio_peak_1s": round(peak(coalesced, 1) / peak(per_transition, 1), 3) if per_transition else None,
        # Events on the Node (on by default): one per node, reason and burst, each key paced on its own.
        "events": {"writes": n_events, "mean_per_s": round(n_events / DAY, 4), **rates(ev)},
        "storm": {"span_s": [lo - int(storm_start), hi - int(storm_start)], "writes": in_storm,
                  "coalesced": storm_rates, "one_write_per_transition": rates(per_transition, lo, hi),
                  "event_writes": sum(v for s, v in ev.items() if lo <= s <= hi), "events": ev_storm,
                  "node_writes_and_events": both_storm},
        # The issue 27 answer in one place: what the whole fleet's agents send, idle, on average, in the storm;
        # Node PATCHes (annotations), and with the Events.
        "aggregate_writes_per_s": {"idle": idle_writes, "mean_day": round(total_writes / DAY, 4),
                                   "storm_peak_1s": storm_rates["peak_1s"],
                                   "storm_peak_10s_avg": storm_rates["peak_10s_avg"],
                                   "storm_peak_60s_avg": storm_rates["peak_60s_avg"],
                                   "with_events_mean_day": round((total_writes + n_events) / DAY, 4),
                                   "with_events_storm_peak_1s": both_storm["peak_1s"],
                                   "with_events_storm_peak_10s_avg": both_storm["peak_10s_avg"],
                                   "with_events_storm_peak_60s_avg": both_storm["peak_60s_avg"]},
        "resync_reads_per_s": round(nodes / 600.0, 2),
        "idle_polls": idle,
        # Writes/s that idle polling adds on top of the transitions: none when polls leave the annotations alone,
        # else each node writes once per token (or per poll, if polls are rarer).
        "idle_writes_per_s": idle_writes,
        "idle_writes_per_s_if_each_poll_moved_annotations": round(nodes / max(min_interval, poll_interval), 1),
    }


def share(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a share of the nodes from 0 to 1, not {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"a share of the nodes from 0 to 1, not {text!r}")
    return v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--rate", type=float, default=19.0, help="remediations per 1,000 nodes per day")
    ap.add_argument("--storm", "--rollout", dest="storm", type=share, default=0.10,
                    help="share of the nodes hit by the storm (a driver rollout within one minute)")
    ap.add_argument("--debounce", type=float, default=1.0)
    ap.add_argument("--min-interval", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--poll-interval", type=float, default=5.0, help="the plugin's health poll interval")
    a = ap.parse_args()
    if a.nodes < 1:
        ap.error("--nodes: must be at least 1")
    print(json.dumps(simulate(a.nodes, a.gpus, a.rate, a.storm, a.seed, a.debounce, a.min_interval,
                              a.poll_interval), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
