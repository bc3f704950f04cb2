"""Events on the Node, one per node and burst (issue 27): a driver rollout takes a node's 8 GPUs Unknown within
half a second, and that is one Event naming them, not eight. The pure aggregator on an injected monotonic clock
(``now`` passed in), so the burst window and the pacing are checked without sleeping."""

from __future__ import annotations

from itertools import pairwise

from plugin.health.node_state import Transition
from plugin.health.reasons import Reason, State
from plugin.outlets.events import Entry, EventAggregator, event_for, name_list
from tests.fakes.node_devices import MESSAGES, reason

T0 = 1_767_225_600.0
HEALTHY, UNKNOWN, DEGRADED, UNHEALTHY = (State.HEALTHY.value, State.UNKNOWN.value, State.DEGRADED.value,
                                         State.UNHEALTHY.value)
NAMES = {f"GPU-{i}": f"gpu.{i}" for i in range(8)}


class Feed:
    """One node's aggregator, fed transitions at monotonic times and flushed the way the reporter does: every due
    entry is created, or patched when it already has an Event in the window."""

    def __init__(self, **kw: float) -> None:
        self.agg = EventAggregator("n1", **kw)  # type: ignore[arg-type]
        self.seq = 0
        self.creates: list[tuple[float, Entry, int]] = []  # (now, entry, count sent)
        self.patches: list[tuple[float, Entry, int]] = []

    def change(self, now: float, gpu: int, frm: str, to: str, *codes: str, rs: tuple[Reason, ...] = ()) -> None:
        self.seq += 1
        reasons = rs or tuple(reason(c, T0 + now) for c in codes)
        self.agg.observe([Transition(self.seq, f"GPU-{gpu}", frm, to, reasons, T0 + now)], NAMES, now)

    def flush(self, now: float) -> list[Entry]:
        due = self.agg.due(now)
        for e in due:
            if self.agg.needs_create(e, now):
                self.creates.append((now, e, self.agg.create_body(e, "uid", "default")["count"]))
                self.agg.created(e, f"ev-{len(self.creates)}", now)
            else:
                self.patches.append((now, e, self.agg.patch_body(e)["count"]))
                self.agg.patched(e, now)
        return due


def storm_down(f: Feed, at: float, gpus: range = range(8)) -> None:
    """The rollout's shape: the GPUs go Unknown one after the other within 0.5 s."""
    for k, g in enumerate(gpus):
        f.change(at + k * 0.5 / len(gpus), g, HEALTHY, UNKNOWN, "nvml-error")


def test_a_burst_of_eight_unknown_is_one_event_naming_all_eight() -> None:
    f = Feed(window_s=600.0, min_interval_s=10.0, burst_s=1.0)
    storm_down(f, 0.0)
    assert f.flush(0.9) == []  # the burst is still open: more GPUs may join
    assert f.agg.next_due() == 1.0  # ... but no longer than the burst window after its first transition
    f.flush(1.0)
    assert len(f.creates) == 1
    _, e, count = f.creates[0]
    assert (e.spec.reason, e.spec.type, e.spec.codes, count) == ("GPUUnknown", "Warning", ("nvml-error",), 1)
    assert e.spec.message == ("8 GPUs (gpu.0, gpu.1, gpu.2, gpu.3, gpu.4, gpu.5, gpu.6, gpu.7): Healthy -> Unknown: "
                              f"nvml-error: {MESSAGES['nvml-error']} (action: contact-support)")
    f.flush(100.0)
    assert len(f.creates) == 1 and f.patches == []


def test_a_recovery_burst_is_one_gpurecovered_event() -> None:
    f = Feed(burst_s=1.0)
    storm_down(f, 0.0)
    f.flush(1.0)
    for k in range(8):
        f.change(30.0 + k / 16, k, UNKNOWN, HEALTHY)
    f.flush(31.0)
    assert [(e.spec.reason, e.spec.type) for _, e, _ in f.creates] == [("GPUUnknown", "Warning"),
                                                                        ("GPURecovered", "Normal")]
    back = f.creates[1][1].spec.message
    assert back == "8 GPUs (gpu.0, gpu.1, gpu.2, gpu.3, gpu.4, gpu.5, gpu.6, gpu.7): Unknown -> Healthy"


def test_a_lone_fault_keeps_the_per_gpu_reason_and_message() -> None:
    f = Feed(burst_s=1.0)
    f.change(0.0, 3, HEALTHY, UNHEALTHY, "xid-79", "ecc-uncorrected")
    f.flush(1.0)
    (_, e, count), = f.creates
    t = Transition(9, "GPU-3", HEALTHY, UNHEALTHY, (reason("xid-79", T0), reason("ecc-uncorrected", T0)), T0)
    single = event_for(t, "gpu.3")
    assert single is not None
    assert (e.spec.reason, e.spec.type, e.spec.message, count) == (single.reason, single.type, single.message, 1)
    assert e.spec.message == (f"gpu.3 (GPU-3): Healthy -> Unhealthy: xid-79: {MESSAGES['xid-79']} "
                              "(action: reboot-node); also ecc-uncorrected")


def test_different_codes_or_reasons_in_one_burst_are_separate_events() -> None:
    f = Feed(burst_s=1.0)
    f.change(0.0, 0, HEALTHY, UNKNOWN, "nvml-error")
    f.change(0.1, 1, HEALTHY, UNKNOWN, "nvml-error")
    f.change(0.2, 2, HEALTHY, UNHEALTHY, "xid-79")
    f.change(0.3, 3, HEALTHY, UNHEALTHY, "xid-79")
    f.change(0.4, 4, HEALTHY, UNHEALTHY, "ecc-uncorrected")
    f.change(0.5, 5, HEALTHY, DEGRADED, "thermal-slowdown")
    f.flush(1.5)
    got = sorted((e.spec.reason, e.spec.codes, e.spec.devices) for _, e, _ in f.creates)
    assert got == [("GPUDegraded", ("thermal-slowdown",), ("gpu.5",)),
                   ("GPUUnhealthy", ("ecc-uncorrected",), ("gpu.4",)),
                   ("GPUUnhealthy", ("xid-79",), ("gpu.2", "gpu.3")),
                   ("GPUUnknown", ("nvml-error",), ("gpu.0", "gpu.1"))]


def test_the_same_burst_again_bumps_the_count_of_its_event() -> None:
    f = Feed(window_s=600.0, min_interval_s=10.0, burst_s=1.0)
    storm_down(f, 0.0)
    f.flush(1.0)
    for k in range(8):
        f.change(5.0 + k / 16, k, UNKNOWN, HEALTHY)
    storm_down(f, 6.0)  # the driver reloads again: the same 8 GPUs, the same code
    f.flush(7.0)
    assert f.agg.next_due() == 11.0  # paced: the key was written at 1.0
    f.flush(11.0)
    unknown = [(at, c) for at, e, c in f.creates + f.patches if e.spec.reason == "GPUUnknown"]
    assert [c for _, e, c in f.creates if e.spec.reason == "GPUUnknown"] == [1]
    assert unknown == [(1.0, 1), (11.0, 2)]
    assert [(at, c) for at, _, c in f.patches] == [(11.0, 2)]


def test_a_key_is_written_at_most_once_per_interval_however_often_its_burst_repeats() -> None:
    f = Feed(window_s=600.0, min_interval_s=10.0, burst_s=1.0)
    writes: list[float] = []
    for r in range(20):  # a burst every 2 s for 40 s, down and up
        storm_down(f, r * 2.0, range(4))
        for g in range(4):
            f.change(r * 2.0 + 1.2 + g * 0.1, g, UNKNOWN, HEALTHY)
        for now in (r * 2.0 + 1.0, r * 2.0 + 1.5, r * 2.0 + 2.0):
            writes += [now for _ in f.flush(now)]
    f.flush(100.0)
    creates = [c for _, e, c in f.creates]
    assert len(f.creates) == 2  # one Event per direction, for 40 occurrences
    down = [(at, c) for at, e, c in f.creates + f.patches if e.spec.reason == "GPUUnknown"]
    assert all(b[0] - a[0] >= 10.0 for a, b in pairwise(down))
    assert down[-1][1] == 20 and creates == [1, 1]  # every burst counted once, none lost


def test_a_gpu_failing_after_a_lone_event_was_posted_gets_its_own_event() -> None:
    f = Feed(window_s=600.0, min_interval_s=10.0, burst_s=1.0)
    f.change(0.0, 0, HEALTHY, UNKNOWN, "nvml-error")
    f.flush(1.0)
    f.change(3.0, 1, HEALTHY, UNKNOWN, "nvml-error")  # after gpu.0's burst closed
    f.flush(4.0)
    f.flush(100.0)
    assert [(e.spec.devices, c) for _, e, c in f.creates] == [(("gpu.0",), 1), (("gpu.1",), 1)]
    assert f.patches == []  # gpu.0's Event is neither re-sent nor counted again
    assert f.creates[1][1].spec.message.startswith("gpu.1 (GPU-1): Healthy -> Unknown")


def test_a_gpu_failing_within_the_window_joins_the_burst_before_anything_is_posted() -> None:
    f = Feed(burst_s=1.0)
    f.change(0.0, 0, HEALTHY, UNKNOWN, "nvml-error")
    f.change(0.99, 6, HEALTHY, UNKNOWN, "nvml-error")
    f.change(1.0, 7, HEALTHY, UNKNOWN, "nvml-error")  # the window is closed: a burst of its own
    f.flush(2.0)
    assert [e.spec.devices for _, e, _ in f.creates] == [("gpu.0", "gpu.6"), ("gpu.7",)]
    assert f.creates[0][1].spec.message.startswith("2 GPUs (gpu.0, gpu.6): Healthy -> Unknown")


def test_a_burst_from_different_states_says_which_came_from_where() -> None:
    f = Feed(burst_s=1.0)
    f.change(0.0, 0, HEALTHY, UNKNOWN, "nvml-error")
    f.change(0.1, 1, DEGRADED, UNKNOWN, "nvml-error")
    f.change(0.2, 5, HEALTHY, UNKNOWN, "nvml-error")
    f.flush(1.0)
    (_, e, _), = f.creates
    assert e.spec.message.startswith("3 GPUs (gpu.0, gpu.1, gpu.5): Healthy (gpu.0, gpu.5), Degraded (gpu.1) -> "
                                     "Unknown: nvml-error: ")


def test_a_burst_whose_messages_differ_says_whose_it_shows() -> None:
    f = Feed(burst_s=1.0)
    ecc = reason("ecc-uncorrected", T0)
    f.change(0.0, 2, HEALTHY, UNHEALTHY, rs=(ecc,))
    f.change(0.1, 4, HEALTHY, UNHEALTHY, rs=(Reason(ecc.code, ecc.severity, "7 volatile uncorrected ECC errors",
                                                    ecc.source, ecc.action, T0),))
    f.flush(1.0)
    (_, e, _), = f.creates
    assert e.spec.message == ("2 GPUs (gpu.2, gpu.4): Healthy -> Unhealthy: ecc-uncorrected: 7 volatile uncorrected "
                              "ECC errors (action: reset-gpu) (as on gpu.4; the GPUs' messages differ)")


def test_a_gpu_flapping_within_its_burst_counts_each_time() -> None:
    f = Feed(burst_s=1.0)
    for k in range(3):
        f.change(k * 0.3, 1, HEALTHY, UNHEALTHY, "xid-79")
        f.change(k * 0.3 + 0.1, 1, UNHEALTHY, HEALTHY)
    f.flush(1.1)  # both bursts closed: the Unhealthy one at 1.0, the Recovered one at 1.1
    assert sorted((e.spec.reason, c) for _, e, c in f.creates) == [("GPURecovered", 3), ("GPUUnhealthy", 3)]


def test_a_long_device_list_is_named_compactly_with_its_count() -> None:
    f = Feed(burst_s=1.0)
    names = {f"GPU-{i}": f"gpu.{i}" for i in range(300)}
    ts = [Transition(i + 1, d, HEALTHY, UNKNOWN, (reason("nvml-error", T0),), T0) for i, d in enumerate(names)]
    f.agg.observe(ts, names, 0.0)
    f.flush(1.0)
    (_, e, _), = f.creates
    assert e.spec.message == ("300 GPUs (gpu.0-299): Healthy -> Unknown: nvml-error: "
                              f"{MESSAGES['nvml-error']} (action: contact-support)")
    # Runs of 3 or more collapse; shorter ones, and hashed names (whose digits are not an index), stay as they are.
    many = [f"gpu.{i}" for i in (*range(40), 41, 42, *range(50, 90))] + ["dev.00000000000000a1"]
    assert name_list(many, 60) == "dev.00000000000000a1, gpu.0-39, gpu.41, gpu.42, gpu.50-89"
    # Names that cannot collapse: as many as fit, and how many more, so the total is never lost.
    hashed = [f"dev.{i:016x}" for i in range(40)]
    short = name_list(hashed, 100)
    assert len(short) <= 100 and short.startswith("dev.0000000000000000, dev.0000000000000001, ")
    shown, more = short.split(", ... and ")
    assert len(shown.split(", ")) + int(more.removesuffix(" more")) == 40


def test_open_bursts_and_keys_stay_bounded() -> None:
    f = Feed(burst_s=1.0, max_keys=4)
    codes = ["xid-79", "ecc-uncorrected", "thermal-slowdown", "nvml-error"]
    for k in range(8):  # 8 distinct (reason, codes) bursts open at once, at most 4 kept open
        c = codes[k % 4]
        f.change(k * 0.01, k, HEALTHY, UNHEALTHY if k < 4 else DEGRADED, c)
    assert len(f.agg.bursts) <= 4 and len(f.agg.entries) <= 4
    f.flush(2.0)
    assert len(f.creates) == 4
