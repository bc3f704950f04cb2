#!/usr/bin/env python3
"""The node agents' writes to a real API server in a storm (issue 27), checked against bench/fleet_sim.py's model.

A fleet of N realistic GPU Nodes on a real kube-apiserver (bench/_fleet.py, no heartbeats) and, per Node, the node
agent's real writer: a ``KubeReporter`` (plugin/outlets/reporter.py) with the default settings (annotations and
Events on, debounce 1 s, one write per 10 s per node), its own NodeState, its own ``KubeClient`` (its own
connection) and its own worker thread on the real clock, as in the plugin. All agents use one service account, so
the audit log tells their requests from the bench's own.

1. Start-up: each agent reconciles its Node once (the fleet's annotations name other GPUs), and is left to settle.
2. Idle (``--idle`` s): every agent's node state is republished every 5 s with unchanged devices whose ``since``
   is the time of the poll, as a health poll publishes it. Target: 0 writes.
3. Storm: the storm of fleet_sim.py (``storm_events``/``storm_changes``: each hit node's 8 GPUs go Unknown within
   0.5 s at a random moment of ``--window`` s, and Healthy again 20..40 s later), played into the hit agents' node
   states on the real clock. ``--storm`` is the share of the agents hit; the default hits all of them, so that a
   few hundred agents give a storm big enough to count.

The Node PATCHes and the Event writes (and any other request of the agents) are counted from the API server's
audit log, per second of the storm, and compared with what fleet_sim predicts for the same events (``coalesce``:
the same ``WriteScheduler`` on a virtual clock; ``event_writes``: the same ``EventAggregator``): writes in all, per
node, and the peak 1 s / 10 s / 60 s. The API server's answer
time for those PATCHes (audit stage time minus receive time) and the CPU of etcd and kube-apiserver during the
storm say how loaded it was. Last, fleet_sim's model at ``--project-nodes`` (50,000) with a ``--project-storm``
(5 %) storm gives the whole fleet's aggregate.

    python bench/bench_agent_writes.py                          # 300 agents, all hit within 60 s
    python bench/bench_agent_writes.py --agents 20 --idle 15    # a quick check that it runs
    python bench/bench_agent_writes.py --window 7.2             # 300 arrivals at the 50,000-node storm's rate
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._common import cpu_seconds, machine, pct  # noqa: E402
from bench._fleet import AuditedRequest, Fleet  # noqa: E402
from bench.fleet_sim import (  # noqa: E402
    coalesce,
    event_writes,
    per_second,
    rates,
    share,
    simulate,
    storm_changes,
    storm_device_changes,
    storm_events,
    storm_transitions,
)
from plugin.health.node_state import NodeState  # noqa: E402
from plugin.health.reasons import State  # noqa: E402
from plugin.kube.client import KubeClient  # noqa: E402
from plugin.outlets.reporter import KubeReporter, ReporterSettings  # noqa: E402
from tests.fakes.node_devices import Node, status  # noqa: E402

ACCOUNT = "node-agents"
POLL_INTERVAL_S = 5.0  # the plugin's default health poll interval
GPUS = 8


class Agent:
    """One node's agent: its node state, its devices, its real reporter."""

    def __init__(self, name: str, kubeconfig: Path, seed: int) -> None:
        self.name = name
        self.state = NodeState()
        self.node = Node(self.state, n=GPUS)
        self.node.publish(time.time())
        self.reporter = KubeReporter(self.state, ReporterSettings(node_name=name), lambda: KubeClient(kubeconfig),
                                     rng=random.Random(seed))

    def poll_unchanged(self, now: float) -> None:
        """What a health poll of a node whose devices did not change publishes: the same states, ``since`` now."""
        self.state.publish([status(g, since=now) for g in self.node.gpus], now)


def wait_for(what: str, cond: Any, timeout: float, every: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f} s")
        time.sleep(every)


def settled(agents: list[Agent]) -> bool:
    return all(not a.reporter.status().pending and a.reporter.status().reads > 0 for a in agents)


def sleep_until(mono: float) -> None:
    delay = mono - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def agents_requests(fleet: Fleet, user: str, since: float, until: float) -> list[AuditedRequest]:
    return [r for r in fleet.requests(since, until) if r.user == user]


def node_patches(reqs: list[AuditedRequest]) -> list[AuditedRequest]:
    return [r for r in reqs if r.verb == "patch" and r.resource == "nodes"]


def event_posts(reqs: list[AuditedRequest]) -> list[AuditedRequest]:
    return [r for r in reqs if r.verb in ("create", "patch") and r.resource == "events"]


def kinds(reqs: list[AuditedRequest]) -> dict[str, int]:
    return dict(Counter(f"{r.verb} {r.resource}{'/' + r.subresource if r.subresource else ''}" for r in reqs))


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-health-agents-"))
    out: dict[str, Any] = {"machine": machine(), "agents": args.agents, "storm_share": args.storm,
                           "window_s": args.window, "idle_s": args.idle, "seed": args.seed}
    with Fleet(args.agents, workdir, kwok=False, realistic=True, seed=args.seed) as fleet:
        kubeconfig = fleet.kubeconfig_for(ACCOUNT)
        user = Fleet.user_of(ACCOUNT)
        agents = [Agent(name, kubeconfig, i) for i, name in enumerate(sorted(fleet.node_names))]
        t = time.time()
        for a in agents:
            a.reporter.start()
        try:
            wait_for("the agents' start-up reconcile", lambda: settled(agents), 300)
            out["startup"] = {"s": round(time.time() - t, 1),
                              "requests": kinds(agents_requests(fleet, user, t, time.time() + 1))}

            # Idle: polls that change nothing, for --idle seconds after the last agent settled.
            idle_from = time.time()
            mono = time.monotonic()
            versions = [a.state.snapshot().version for a in agents]
            polls = 0
            while time.monotonic() < mono + args.idle:
                now = time.time()
                for a in agents:
                    a.poll_unchanged(now)
                polls += 1
                sleep_until(mono + polls * POLL_INTERVAL_S)
            idle_to = time.time()
            idle_reqs = agents_requests(fleet, user, idle_from, idle_to)
            moved = sum(a.state.snapshot().version - v for a, v in zip(agents, versions, strict=True))
            out["idle"] = {"s": round(idle_to - idle_from, 1), "polls_per_agent": polls, "new_snapshots": moved,
                           "node_writes": len(node_patches(idle_reqs)), "requests": kinds(idle_reqs),
                           "writes_per_s": round(len(node_patches(idle_reqs)) / (idle_to - idle_from), 4)}

            out["storm"] = storm(args, fleet, user, agents)
        finally:
            for a in agents:
                a.reporter.stop()
        statuses = [a.reporter.status() for a in agents]
        out["reporters"] = {"writes": sum(s.writes for s in statuses), "reads": sum(s.reads for s in statuses),
                            "conflicts": sum(s.conflicts for s in statuses),
                            "failures": sum(s.failures for s in statuses),
                            "events_written": sum(s.events_written for s in statuses)}
        out["fleet_timings_s"] = fleet.timings

    out["projection"] = project(args, out)
    return out


def storm(args: argparse.Namespace, fleet: Fleet, user: str, agents: list[Agent]) -> dict[str, Any]:
    rng = random.Random(args.seed)
    hit = rng.sample(range(len(agents)), max(1, round(len(agents) * args.storm)))
    events = storm_events(rng, hit, 0.0, args.window)  # times relative to the storm's start
    changes = sorted(storm_changes(events, GPUS))
    predicted = coalesce(sorted(storm_transitions(events, GPUS)), random.Random(args.seed), 1.0, 10.0)
    predicted_events = event_writes(sorted(storm_device_changes(events, GPUS)), burst_s=1.0)  # the debounce

    pids = fleet.pids()
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    own0 = time.process_time()
    wall0 = time.time() + 1.0
    mono0 = time.monotonic() + 1.0
    late = []
    for at, n, g, back in changes:
        sleep_until(mono0 + at)
        late.append(time.monotonic() - (mono0 + at))
        node = agents[n].node
        if back:
            node.set(g, State.HEALTHY, now=time.time())
        else:
            node.set(g, State.UNKNOWN, "nvml-error", now=time.time())
    last_write = max(w for w, _ in predicted + predicted_events)
    sleep_until(mono0 + last_write + 2.0)
    wait_for("the agents to write the storm's end", lambda: settled(agents), 120)
    time.sleep(1.0)  # the last PATCH's audit entry
    span = time.monotonic() - mono0
    wall1 = time.time()
    cpu = {name: round((cpu_seconds(pid) - cpu0[name]) / span, 3) for name, pid in pids.items()}
    cpu["bench process (all agents)"] = round((time.process_time() - own0) / span, 3)

    reqs = agents_requests(fleet, user, wall0 - 0.5, wall1)
    patches = node_patches(reqs)
    posts = event_posts(reqs)
    observed = per_second(r.time - wall0 for r in patches)
    expected = per_second(w for w, _ in predicted)
    names = {i: a.name for i, a in enumerate(agents)}
    per_node_pred = Counter(names[n] for _, n in predicted)
    per_node_obs = Counter(r.name for r in patches)
    # Where each observed write lands against its predicted one, per node and in order: the model's timing error.
    pred_times: dict[str, list[float]] = {}
    for w, n in predicted:
        pred_times.setdefault(names[n], []).append(w)
    offsets = []
    for name, times in pred_times.items():
        obs = sorted(r.time - wall0 for r in patches if r.name == name)
        offsets += [o - p for o, p in zip(obs, times, strict=False)]
    span_s = int(span) + 1
    return {
        "hit_agents": len(hit), "transitions": len(changes),
        "play_lateness_ms": {"p50": round(pct(late, 50) * 1000, 1), "max": round(max(late) * 1000, 1)},
        "node_writes": {"predicted": len(predicted), "observed": len(patches),
                        "nodes_matching_prediction": sum(per_node_obs[k] == v for k, v in per_node_pred.items()),
                        "nodes_hit": len(per_node_pred),
                        "unexpected_nodes": sorted(set(per_node_obs) - set(per_node_pred))[:10]},
        "write_time_minus_predicted_ms": ({"p50": round(statistics.median(offsets) * 1000, 1),
                                           "p99": round(pct(offsets, 99) * 1000, 1),
                                           "max": round(max(offsets) * 1000, 1)} if offsets else None),
        "writes_per_s": {"predicted": rates(expected, 0, span_s), "observed": rates(observed, 0, span_s)},
        "event_writes": {"predicted": len(predicted_events), "observed": len(posts),
                         "predicted_per_s": rates(per_second(w for w, _ in predicted_events), 0, span_s),
                         "observed_per_s": rates(per_second(r.time - wall0 for r in posts), 0, span_s)},
        "node_writes_and_events_observed_per_s": rates(per_second(r.time - wall0 for r in patches + posts),
                                                      0, span_s),
        "one_write_per_transition": rates(per_second(at for at, _, _, _ in changes), 0, span_s),
        "requests": kinds(reqs),
        "patch_answer_ms": latency(patches), "event_answer_ms": latency(posts),
        "cpu_cores": cpu, "span_s": round(span, 1),
    }


def latency(reqs: list[AuditedRequest]) -> dict[str, float] | None:
    """How long the API server took to answer (audit stage time minus receive time), in ms."""
    ms = [(r.completed - r.time) * 1000 for r in reqs if r.completed]
    return {"p50": round(pct(ms, 50), 1), "p99": round(pct(ms, 99), 1), "max": round(max(ms), 1)} if ms else None


def project(args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any]:
    """The whole fleet's aggregate from the model the bench checked, beside what this API server took."""
    sim = simulate(args.project_nodes, GPUS, 19.0, args.project_storm, args.seed, 1.0, 10.0)
    agg = sim["aggregate_writes_per_s"]
    assert isinstance(agg, dict)
    s = out["storm"]
    observed_per_hit = s["node_writes"]["observed"] / s["hit_agents"]
    hit50k = sim["rollout_nodes"]
    assert isinstance(hit50k, int)
    return {"nodes": args.project_nodes, "storm_share": args.project_storm, "storm_nodes": hit50k,
            "aggregate_writes_per_s": agg,
            "storm_writes_from_observed_per_node_discipline": round(observed_per_hit * hit50k),
            "observed_writes_per_hit_node": round(observed_per_hit, 3),
            "idle_writes_per_s_from_observed": out["idle"]["writes_per_s"] * args.project_nodes / args.agents,
            "observed_events_per_hit_node": round(s["event_writes"]["observed"] / s["hit_agents"], 3),
            "storm_events_from_observed_per_node_discipline": round(
                s["event_writes"]["observed"] / s["hit_agents"] * hit50k),
            "bench_observed_peak_1s": s["writes_per_s"]["observed"]["peak_1s"],
            "bench_observed_peak_1s_with_events": s["node_writes_and_events_observed_per_s"]["peak_1s"],
            "bench_patch_answer_ms": s["patch_answer_ms"], "bench_event_answer_ms": s["event_answer_ms"],
            "command": f"python bench/fleet_sim.py --nodes {args.project_nodes} --storm {args.project_storm} "
                       f"--seed {args.seed}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=300, help="nodes, each with its own agent's writer")
    ap.add_argument("--storm", type=share, default=1.0, help="share of the agents hit by the storm")
    ap.add_argument("--window", type=float, default=60.0, help="seconds within which the hit nodes' drivers go")
    ap.add_argument("--idle", type=float, default=60.0, help="seconds of idle polling measured before the storm")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--project-nodes", type=int, default=50_000)
    ap.add_argument("--project-storm", type=share, default=0.05,
                    help="share of the projected fleet hit by the storm")
    ap.add_argument("--workdir", type=Path, help="where the fleet keeps its files (default: a new temporary dir)")
    args = ap.parse_args()
    if args.agents < 1:
        ap.error("--agents: must be at least 1")
    if args.storm == 0:
        ap.error("--storm: 0 hits no agent; the storm needs at least one")
    if args.window < 0:
        ap.error(f"--window: seconds, at least 0, not {args.window}")
    if args.idle < 10:
        # The model starts each node with a full token bucket: the start-up write must be a token's time ago.
        ap.error(f"--idle: seconds, at least 10 (one token of the reporter's bucket), not {args.idle}")
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
