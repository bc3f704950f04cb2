"""Repeat offenders (issue 34): a node quarantined ``--repeat-limit`` times within ``--repeat-window`` stays
quarantined with reason ``repeat-offender`` until an operator releases it (``controller.<prefix>/release``).

The reconciler runs on a virtual clock against the in-memory API server (tests/fakes/controller_api.py), as in
tests/unit/test_controller_reconciler.py; the fleet view and ``kubectl gpu-health fleet release`` read and write the
same annotations.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from plugin import kubectl_plugin
from plugin.controller import fleetview, repeat
from plugin.controller.nodes import Keys
from plugin.controller.policy import UNHEALTHY_DEVICES
from plugin.controller.reconciler import Reconciler
from tests.fakes.controller_api import T0, P, controller_sample, gpu_node, rfc
from tests.unit.test_controller_reconciler import Rig

KEYS = Keys(P)
TAINT = KEYS.taint
DAY = 86400.0
WEEK = 7 * DAY
HOLD = 60.0


def annotations(rig: Rig, name: str = "n") -> dict[str, str]:
    return dict(rig.node(name)["metadata"].get("annotations") or {})


def history(rig: Rig, name: str = "n") -> list[str]:
    value = annotations(rig, name).get(KEYS.history, "")
    return value.split(",") if value else []


def fleet_rig(**settings: Any) -> Rig:
    """One node that will fail, and nine healthy ones so that the breaker's 10% lets it be quarantined."""
    return Rig([gpu_node("n"), *(gpu_node(f"ok{i}") for i in range(9))], recovery_hold_s=HOLD, **settings)


def fail(rig: Rig, name: str = "n") -> None:
    rig.agent(name, {1: "Unhealthy"}, since=rig.clock.now)
    rig.run_until(rig.clock.now + 1)


def recover(rig: Rig, name: str = "n") -> None:
    """Healthy again, and the clock past the recovery hold."""
    rig.agent(name, {1: "Healthy"}, since=rig.clock.now)
    rig.run_until(rig.clock.now + HOLD + 1)


def cycle(rig: Rig, times: int, every: float = DAY) -> None:
    """Fail, be quarantined, recover and (unless held) be released, ``times`` times, ``every`` apart."""
    for _ in range(times):
        fail(rig)
        recover(rig)
        rig.clock.now += every - HOLD - 2


def request_release(rig: Rig, note: str = "replaced GPU 1", name: str = "n") -> None:
    rig.api.edit(name, {"metadata": {"annotations": {KEYS.release: note}}})
    rig.watch(name)


# The pure part -------------------------------------------------------------------------------------------------

def test_the_history_keeps_the_window_and_at_most_the_limit() -> None:
    now = T0 + 10 * DAY
    old, recent, ahead = now - 8 * DAY, now - DAY, now + 600  # ahead: a replica whose clock runs fast wrote it
    assert repeat.record((old, recent, ahead), now, WEEK, 5) == (recent, now, ahead)
    assert repeat.record((now - 4, now - 3, now - 2, now - 1), now, WEEK, 3) == (now - 2, now - 1, now)
    assert repeat.record((), now, WEEK, 0) == ()
    assert repeat.is_repeat((1.0, 2.0), 2) and not repeat.is_repeat((1.0,), 2) and not repeat.is_repeat((1.0,), 0)


def test_the_history_reads_back_what_it_writes_and_skips_what_does_not_parse() -> None:
    times = (T0, T0 + DAY)
    assert repeat.parse_history(repeat.format_history(times)) == times
    assert repeat.format_history(times) == "2026-01-01T00:00:00Z,2026-01-02T00:00:00Z"
    # An operator's hand edit: what parses counts, the rest is left out rather than dropping the whole count.
    assert repeat.parse_history("2026-01-02T00:00:00Z, yesterday ,,2026-01-01T00:00:00Z") == times
    assert repeat.parse_history("") == () and repeat.parse_history(None) == ()


# Counting and holding ------------------------------------------------------------------------------------------

def test_the_fifth_quarantine_in_a_week_holds_the_node_until_an_operator_releases_it() -> None:
    rig = fleet_rig()
    cycle(rig, 4)
    assert rig.quarantined() == [] and len(history(rig)) == 4  # released four times, each one counted
    assert rig.events("GPUNodeReleased") and len(rig.events("GPUNodeReleased")) == 4
    fail(rig)
    ann = annotations(rig)
    assert ann[KEYS.reason] == repeat.REPEAT_OFFENDER and len(history(rig)) == 5
    assert rig.taints("n") == [{"key": TAINT, "value": repeat.REPEAT_OFFENDER, "effect": "NoSchedule"}]
    assert "quarantined 5 times in 168h" in ann[KEYS.message] and UNHEALTHY_DEVICES in ann[KEYS.message]
    assert "repeat-offender" in rig.events("GPUNodeQuarantined")[-1]["message"]
    assert controller_sample(rig.rec, "gpu_health_controller_quarantined_nodes", reason="repeat-offender") == 1

    # Fit for a day: still held, said once.
    rig.agent("n", {1: "Healthy"}, since=rig.clock.now)
    rig.run_until(rig.clock.now + DAY)
    assert rig.quarantined() == ["n"]
    [held] = rig.events("GPUNodeRepeatOffender")
    assert held["type"] == "Warning" and KEYS.release in held["message"]
    assert "kubectl gpu-health fleet release n" in held["message"]

    request_release(rig)
    rig.step()
    assert rig.quarantined() == [] and rig.taints("n") == []
    ann = annotations(rig)
    assert KEYS.history not in ann and KEYS.release not in ann  # the count starts over; the request is used up
    released = rig.events("GPUNodeReleased")[-1]
    assert "operator's request" in released["message"] and "replaced GPU 1" in released["message"]
    # Counted from zero again: the next four quarantines are ordinary ones.
    cycle(rig, 4)
    assert rig.quarantined() == [] and len(history(rig)) == 4


def test_a_release_request_while_it_still_fails_waits_for_the_hold() -> None:
    rig = fleet_rig(repeat_limit=1)
    fail(rig)
    assert annotations(rig)[KEYS.reason] == repeat.REPEAT_OFFENDER
    request_release(rig)
    rig.run_until(rig.clock.now + DAY)
    assert rig.quarantined() == ["n"] and annotations(rig)[KEYS.release] == "replaced GPU 1"
    rig.agent("n", {1: "Healthy"}, since=rig.clock.now)
    rig.run_until(rig.clock.now + HOLD - 1)
    assert rig.quarantined() == ["n"]
    rig.run_until(rig.clock.now + 2)
    assert rig.quarantined() == [] and KEYS.release not in annotations(rig)


def test_quarantines_older_than_the_window_do_not_count() -> None:
    rig = fleet_rig(repeat_limit=3, repeat_window_s=WEEK)
    cycle(rig, 2, every=5 * DAY)  # at T0 and T0+5d
    fail(rig)  # T0+10d: the first one is out of the window
    assert annotations(rig)[KEYS.reason] == UNHEALTHY_DEVICES
    assert history(rig) == [rfc(T0 + 5 * DAY), rfc(T0 + 10 * DAY)]  # pruned: only the window is kept
    recover(rig)
    assert rig.quarantined() == []


def test_the_history_outlives_the_release_and_is_bounded_by_the_limit() -> None:
    rig = fleet_rig(repeat_limit=3, repeat_window_s=30 * DAY)
    rig.api.edit("n", {"metadata": {"annotations": {KEYS.history: ",".join(rfc(T0 - i * 60) for i in range(10))}}})
    rig.watch("n")
    fail(rig)
    assert len(history(rig)) == 3 and annotations(rig)[KEYS.reason] == repeat.REPEAT_OFFENDER


def test_an_ordinary_quarantine_with_a_release_request_is_released_as_usual_and_its_count_reset() -> None:
    rig = fleet_rig()
    cycle(rig, 2)
    fail(rig)
    request_release(rig, "new board")
    rig.run_until(rig.clock.now + DAY)
    assert rig.quarantined() == ["n"]  # still failing: the request changes nothing yet
    recover(rig)
    assert rig.quarantined() == [] and KEYS.history not in annotations(rig) and KEYS.release not in annotations(rig)


def test_a_release_request_on_a_node_not_held_resets_its_count_at_once() -> None:
    rig = fleet_rig()
    cycle(rig, 3)
    request_release(rig, "burn-in passed")
    rig.step()
    ann = annotations(rig)
    assert KEYS.history not in ann and KEYS.release not in ann
    [ev] = rig.events("GPUNodeQuarantineCountReset")
    assert "burn-in passed" in ev["message"]
    # Used up: it does not release the node's next repeat-offender quarantine unasked.
    rig.rec.s = type(rig.rec.s)(**{**rig.rec.s.__dict__, "repeat_limit": 1})
    fail(rig)
    recover(rig)
    assert rig.quarantined() == ["n"] and annotations(rig)[KEYS.reason] == repeat.REPEAT_OFFENDER


def test_a_dry_run_counts_nothing_and_writes_nothing() -> None:
    rig = fleet_rig(repeat_limit=1, dry_run=True)
    request_release(rig)
    fail(rig)
    assert rig.api.writes() == []
    assert KEYS.history not in annotations(rig)
    assert "repeat-offender" in rig.events("GPUQuarantineDryRun")[-1]["message"]


def test_with_the_count_off_nothing_is_recorded_and_a_held_node_is_released() -> None:
    rig = fleet_rig(repeat_limit=1)
    fail(rig)
    assert annotations(rig)[KEYS.reason] == repeat.REPEAT_OFFENDER
    # The operator turns the count off (--repeat-limit 0) and the controller restarts.
    rig.rec = Reconciler(rig.api, type(rig.settings)(**{**rig.settings.__dict__, "repeat_limit": 0}), rig.lead,
                         clock=rig.clock)
    rig.rec.replace(rig.api.list_nodes("")[0])
    rig.rec.leadership_changed(True)
    recover(rig)
    assert rig.quarantined() == []
    before = history(rig)
    fail(rig)
    assert history(rig) == before  # nothing new recorded while it is off


# The attacker on one node, and interleavings --------------------------------------------------------------------

def test_the_agent_cannot_reset_its_count_or_release_itself_under_its_own_prefix() -> None:
    """The admission policy lets the agent write only under gpu-health.io/ (story 32 on the local cluster proves it
    refuses controller.gpu-health.io/); what it writes there is not the controller's record."""
    rig = fleet_rig(repeat_limit=2)
    cycle(rig, 1)
    rig.api.edit("n", {"metadata": {"annotations": {f"{P}/quarantine-history": "", f"{P}/release": "me",
                                                    f"{P}/quarantine-reason": "unhealthy-devices"}}})
    rig.watch("n")
    fail(rig)
    assert annotations(rig)[KEYS.reason] == repeat.REPEAT_OFFENDER and len(history(rig)) == 2
    recover(rig)
    rig.run_until(rig.clock.now + DAY)
    assert rig.quarantined() == ["n"]


def test_a_new_leader_keeps_the_count_and_the_hold() -> None:
    rig = fleet_rig(repeat_limit=3)
    cycle(rig, 2)

    def new_leader() -> None:  # another process: nothing in memory, only what the Nodes say
        rig.rec = Reconciler(rig.api, rig.settings, rig.lead, clock=rig.clock)
        rig.rec.replace(rig.api.list_nodes("")[0])
        rig.rec.leadership_changed(True)

    new_leader()
    fail(rig)
    assert annotations(rig)[KEYS.reason] == repeat.REPEAT_OFFENDER
    rig.agent("n", {1: "Healthy"}, since=rig.clock.now)
    new_leader()
    rig.run_until(rig.clock.now + DAY)
    assert rig.quarantined() == ["n"]


def test_a_conflict_decides_the_count_on_the_node_as_read_again() -> None:
    """An operator removes the history by hand (a documented reset) between the controller's read and its write:
    the quarantine is refused (409), read again, and counts from what the Node says now."""
    rig = fleet_rig(repeat_limit=2)
    cycle(rig, 1)
    rig.agent("n", {1: "Unhealthy"}, since=rig.clock.now)
    rig.api.before_patch = lambda name: rig.api.edit(name, {"metadata": {"annotations": {KEYS.history: None}}})
    rig.run_until(rig.clock.now + 1)
    assert rig.rec.stats.conflicts == 1
    assert annotations(rig)[KEYS.reason] == UNHEALTHY_DEVICES and len(history(rig)) == 1


def test_clock_skew_a_time_ahead_still_counts() -> None:
    """A replica whose clock ran an hour ahead recorded a quarantine: this one, behind, still counts it."""
    rig = fleet_rig(repeat_limit=2)
    rig.api.edit("n", {"metadata": {"annotations": {KEYS.history: rfc(T0 + 3600)}}})
    rig.watch("n")
    fail(rig)
    assert annotations(rig)[KEYS.reason] == repeat.REPEAT_OFFENDER
    assert history(rig) == [rfc(T0), rfc(T0 + 3600)]


# The fleet view and the release command -------------------------------------------------------------------------

def test_the_fleet_view_shows_the_count_the_repeat_offender_and_the_request(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rig = fleet_rig(repeat_limit=3, max_quarantined_fraction=0.5)
    cycle(rig, 2)
    fail(rig)
    fail(rig, "ok0")
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps({"items": [rig.node(n) for n in sorted(rig.api.nodes)]}))
    assert kubectl_plugin.main(["fleet", "--from-file", str(nodes)]) == 0
    out = capsys.readouterr().out
    assert "quarantined by gpu-health-controller: 2 (20.0%), repeat offenders: 1, breaker" in out.splitlines()[0]
    rows = {ln.split()[0]: ln.split("   ") for ln in out.splitlines() if ln.startswith(("n ", "ok0 "))}
    assert [c.strip() for c in rows["n"] if c.strip()][1:4] == ["repeat-offender", rfc(T0 + 2 * DAY), "3"]
    assert [c.strip() for c in rows["ok0"] if c.strip()][1:4] == [UNHEALTHY_DEVICES, rfc(T0 + 2 * DAY + 1), "1"]
    assert ("1 repeat offender, held until an operator releases it: kubectl gpu-health fleet release NODE --note "
            f'TEXT (or kubectl annotate node NODE {KEYS.release}="<why>" --overwrite)') in out

    request_release(rig, "new GPU")
    nodes.write_text(json.dumps({"items": [rig.node(n) for n in sorted(rig.api.nodes)]}))
    assert kubectl_plugin.main(["fleet", "--from-file", str(nodes), "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    [n] = [r for r in doc["nodes"] if r["node"] == "n"]
    assert n["repeatOffender"] is True and n["quarantines"] == 3 and n["releaseRequested"] == "new GPU"
    assert n["quarantineHistory"] == history(rig) and doc["repeatOffenders"] == 1
    view = fleetview.fleet([rig.node("n")], None)
    assert fleetview.render_table(view.rows).splitlines()[1].endswith("release requested (new GPU); "
                                                                     + annotations(rig)[KEYS.message])


def fake_kubectl(tmp_path: Path, rc: int = 0) -> tuple[Path, Path]:
    fake, record = tmp_path / "kubectl", tmp_path / "calls.jsonl"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                    "print('node/' + sys.argv[3] + ' annotated')\n"
                    f"sys.stderr.write('boom' if {rc} else ''); sys.exit({rc})\n")
    fake.chmod(0o755)
    return fake, record


def test_fleet_release_annotates_the_node_with_the_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake, record = fake_kubectl(tmp_path)
    rc = kubectl_plugin.main(["fleet", "release", "gpu-7", "--note", "  replaced\nGPU 3 ", "--kubectl", str(fake),
                              "--context", "prod"])
    out, err = capsys.readouterr()
    assert (rc, err) == (0, "")
    assert [json.loads(ln) for ln in record.read_text().splitlines()] == [
        ["annotate", "node", "gpu-7", f"{KEYS.release}=replaced GPU 3", "--overwrite", "--context", "prod"]]
    assert out.startswith("node/gpu-7 annotated\nrelease requested")


@pytest.mark.parametrize(("argv", "says"), [
    (["Bad_Node", "--note", "x"], "NODE: expected a node name"),
    (["gpu-7", "--note", "  "], "--note: must not be empty"),
    (["gpu-7", "--note", "x", "--prefix", "Not A Prefix"], "--prefix: expected a DNS subdomain"),
])
def test_fleet_release_refuses_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     argv: list[str], says: str) -> None:
    fake, record = fake_kubectl(tmp_path)
    assert kubectl_plugin.main(["fleet", "release", *argv, "--kubectl", str(fake)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err
    assert not record.exists()


def test_fleet_release_reports_a_kubectl_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake, _ = fake_kubectl(tmp_path, rc=1)
    assert kubectl_plugin.main(["fleet", "release", "gpu-7", "--note", "x", "--kubectl", str(fake)]) == 1
    assert "kubectl annotate node failed: boom" in capsys.readouterr().err
