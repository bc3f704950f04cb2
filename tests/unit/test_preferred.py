"""GetPreferredAllocation's pure search: whole GPUs against an independent exhaustive search on random topologies of
up to 8 GPUs, health preference, the greedy fallback on large nodes, and the replica policies."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from plugin.devices.model import Gpu
from plugin.health.node_state import DeviceStatus
from plugin.health.reasons import State
from plugin.kubelet.allocation import preferred_gpus, preferred_replicas


def status(g: Gpu, state: State = State.HEALTHY) -> DeviceStatus:
    health = "Healthy" if state in (State.HEALTHY, State.DEGRADED) else "Unhealthy"
    return DeviceStatus(g.uuid, g, state, (), 0.0, health)


def reference_score(chosen: Sequence[DeviceStatus]) -> tuple[int, int, int, int]:
    """Written apart from the plugin's table on purpose: the rule as the issue states it, pair by pair."""
    degraded = sum(d.state != State.HEALTHY for d in chosen)
    links = switch = numa = 0
    for a, b in itertools.combinations([d.gpu for d in chosen], 2):
        links += b.index in a.nvlink_peers or a.index in b.nvlink_peers
        switch += a.pcie_switch is not None and a.pcie_switch == b.pcie_switch
        numa += a.numa_node is not None and a.numa_node == b.numa_node
    return (-degraded, links, switch, numa)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[tuple[Gpu, ...], list[DeviceStatus], list[DeviceStatus], int]:
    n = draw(st.integers(1, 8))
    pairs = list(itertools.combinations(range(n), 2))
    linked = draw(st.sets(st.sampled_from(pairs))) if pairs else set()
    # Links may be recorded on one side only (NVML reports each GPU's own links): both must count.
    one_sided = draw(st.booleans())
    gpus = []
    for i in range(n):
        peers = tuple(sorted({b for a, b in linked if a == i} | (set() if one_sided else
                                                                  {a for a, b in linked if b == i})))
        gpus.append(Gpu(uuid=f"GPU-{i}", index=i, numa_node=draw(st.sampled_from([0, 1, None])),
                        nvlink_peers=peers, pcie_switch=draw(st.sampled_from(["sw0", "sw1", "sw2", None]))))
    states = [draw(st.sampled_from([State.HEALTHY, State.HEALTHY, State.DEGRADED])) for _ in range(n)]
    devs = [status(g, s) for g, s in zip(gpus, states, strict=True)]
    available = draw(st.permutations(devs).map(lambda p: list(p[:draw(st.integers(1, n))])))
    must = draw(st.lists(st.sampled_from(available), unique_by=lambda d: d.id, max_size=len(available)))
    size = draw(st.integers(max(1, len(must)), n))
    return tuple(gpus), available, must, size


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_whole_gpus_match_an_exhaustive_search(case: tuple[tuple[Gpu, ...], list[DeviceStatus],
                                                            list[DeviceStatus], int]) -> None:
    gpus, available, must, size = case
    got = preferred_gpus(gpus, available, must, size)
    by_id = {d.id: d for d in available}
    assert len(got) == len(set(got)) == min(size, len(available))
    assert set(got) <= set(by_id) and {d.id for d in must} <= set(got)
    rest = [d for d in available if d not in must]
    need = min(size, len(available)) - len(must)
    best = max(reference_score([*must, *combo]) for combo in itertools.combinations(rest, need))
    assert reference_score([by_id[i] for i in got]) == best


def builtin_gpus() -> tuple[Gpu, ...]:
    return tuple(Gpu(uuid=f"GPU-{i}", index=i, numa_node=i // 4,
                     nvlink_peers=tuple(p for p in range(i // 4 * 4, i // 4 * 4 + 4) if p != i),
                     pcie_switch=f"sw{i // 2}") for i in range(8))


def test_every_size_on_the_builtin_node_keeps_islands_and_switches() -> None:
    gpus = builtin_gpus()
    devs = [status(g) for g in gpus]
    assert preferred_gpus(gpus, devs, [], 2) == ["GPU-0", "GPU-1"]
    assert preferred_gpus(gpus, devs, [devs[6]], 2) == ["GPU-6", "GPU-7"]  # NVLink and the same switch
    assert sorted(preferred_gpus(gpus, devs, [devs[5]], 4)) == ["GPU-4", "GPU-5", "GPU-6", "GPU-7"]
    assert len(preferred_gpus(gpus, devs, [], 8)) == 8


def test_healthy_before_degraded_but_degraded_when_nothing_else_fits() -> None:
    gpus = builtin_gpus()
    devs = [status(g, State.DEGRADED if g.index == 1 else State.HEALTHY) for g in gpus]
    # GPU 1 shares GPU 0's switch, but a degraded GPU loses to any healthy one.
    assert preferred_gpus(gpus, devs, [devs[0]], 2) != ["GPU-0", "GPU-1"]
    assert preferred_gpus(gpus, devs[:2], [], 2) == ["GPU-0", "GPU-1"]


def test_large_nodes_fall_back_to_greedy_and_stay_valid() -> None:
    gpus = tuple(Gpu(uuid=f"GPU-{i}", index=i, numa_node=i // 8,
                     nvlink_peers=tuple(p for p in range(i // 8 * 8, i // 8 * 8 + 8) if p != i)) for i in range(16))
    devs = [status(g) for g in gpus]
    got = preferred_gpus(gpus, devs, [devs[9]], 4)
    assert len(got) == 4 and "GPU-9" in got and all(8 <= int(i[4:]) < 16 for i in got)


def replicas_of(gpus: Sequence[Gpu], n: int, states: dict[int, State] | None = None
                ) -> list[tuple[str, DeviceStatus, int]]:
    states = states or {}
    return [(f"{g.uuid}::{k}", status(g, states.get(g.index, State.HEALTHY)), n) for g in gpus for k in range(n)]


def parents(ids: Sequence[str]) -> list[str]:
    return [i.split("::")[0] for i in ids]


def test_distributed_spreads_and_avoids_busy_and_degraded_gpus() -> None:
    gpus = builtin_gpus()[:4]
    items = replicas_of(gpus, 4, {2: State.DEGRADED})
    got = preferred_replicas(items, [], 3, "distributed")
    assert sorted(parents(got)) == ["GPU-0", "GPU-1", "GPU-3"]
    # GPU 0 and 1 each have a replica held elsewhere (not offered): the next two go to GPU 3, then GPU 0.
    offered = [it for it in items if it[0] not in ("GPU-0::0", "GPU-1::0")]
    assert parents(preferred_replicas(offered, [], 1, "distributed")) == ["GPU-3"]
    got = preferred_replicas(offered, [], 6, "distributed")
    assert sorted(parents(got)) == ["GPU-0", "GPU-0", "GPU-1", "GPU-1", "GPU-3", "GPU-3"]
    # Only the degraded GPU has room: it is still used.
    only_two = [it for it in items if it[0].startswith("GPU-2")]
    assert parents(preferred_replicas(only_two, [], 2, "distributed")) == ["GPU-2", "GPU-2"]


def test_packed_fills_gpus_in_use_first() -> None:
    gpus = builtin_gpus()[:4]
    items = replicas_of(gpus, 4)
    offered = [it for it in items if it[0] not in ("GPU-2::0", "GPU-2::1")]  # GPU 2 half used
    assert parents(preferred_replicas(offered, [], 2, "packed")) == ["GPU-2", "GPU-2"]
    # Three do not fit on GPU 2: a fresh GPU that holds all three beats spreading.
    assert parents(preferred_replicas(offered, [], 3, "packed")) == ["GPU-0"] * 3
    # Six fit nowhere: fill the busiest first, then the next.
    got = parents(preferred_replicas(offered, [], 6, "packed"))
    assert got == ["GPU-2", "GPU-2", "GPU-0", "GPU-0", "GPU-0", "GPU-0"]


def test_replicas_must_include_and_shortfall() -> None:
    items = replicas_of(builtin_gpus()[:2], 2)
    got = preferred_replicas(items, [items[3]], 2, "distributed")
    assert got[0] == "GPU-1::1" and parents(got) == ["GPU-1", "GPU-0"]
    assert len(preferred_replicas(items, [], 10, "packed")) == 4  # fewer than asked: all there is
    assert preferred_replicas(items, [items[0], items[1]], 2, "packed") == ["GPU-0::0", "GPU-0::1"]
