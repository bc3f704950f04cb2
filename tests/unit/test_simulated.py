"""The simulated backend: node-file validation, every signal, and live reload on file changes."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from plugin.devices.simulated import NodeFileError, SimulatedBackend, builtin_node, parse_node
from plugin.health.config import HealthConfig
from plugin.health.policy import evaluate_reading
from tests.conftest import NodeFile


def test_builtin_node_is_an_8_gpu_h100_like_node() -> None:
    b = SimulatedBackend()
    gpus = b.discover().gpus
    assert len(gpus) == 8 and len({g.uuid for g in gpus}) == 8
    assert [g.numa_node for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert gpus[0].nvlink_peers == (1, 2, 3) and gpus[7].nvlink_peers == (4, 5, 6)
    assert all("H100" in g.name for g in gpus)


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda d: d.pop("gpus"), "gpus: expected a list"),
    (lambda d: d["gpus"][2].pop("numa_node"), "gpus[2] (GPU-5a1e0000-0000-4000-8000-000000000002).numa_node: missing"),
    (lambda d: d["gpus"][1].__setitem__("index", "one"), ".index: expected an integer"),
    (lambda d: d["gpus"][1].__setitem__("uuid", d["gpus"][0]["uuid"]), ".uuid: duplicate"),
    (lambda d: d["gpus"][3]["signals"].__setitem__("temperature_c", "hot"), "signals.temperature_c"),
    (lambda d: d["gpus"][3]["signals"].__setitem__("bogus", 1), "signals.bogus: unknown signal"),
    (lambda d: d["gpus"][3]["signals"].__setitem__("recovery_action", "panic"), "signals.recovery_action"),
    (lambda d: d["gpus"][3]["signals"].__setitem__("clock_event_reasons", ["idle"]), "clock_event_reasons"),
    (lambda d: d["gpus"][3]["signals"].__setitem__("pcie_link", {"gen": 0}), "pcie_link.gen"),
    (lambda d: d["gpus"][3]["signals"].__setitem__("lost", "yes"), "signals.lost: expected true or false"),
    (lambda d: d["gpus"][0].__setitem__("nvlink_peers", [1, 0]), "nvlink_peers: 0 is this GPU's own index"),
    (lambda d: d["gpus"][0].__setitem__("nvlink_peers", [1, "two"]), "nvlink_peers: expected an integer"),
])
def test_malformed_node_names_field_and_gpu(mutate: object, needle: str) -> None:
    doc = builtin_node()
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(NodeFileError) as err:
        parse_node(doc)
    assert needle in str(err.value)


def test_every_signal_reaches_the_policy(node_file: NodeFile) -> None:
    signals = {
        "ecc_uncorrected_volatile": 1, "row_remap_pending": True, "row_remap_failure": True,
        "retired_pages_pending": True, "temperature_c": 93, "clock_event_reasons": ["hw_slowdown",
                                                                                     "hw_power_brake_slowdown"],
        "pcie_link": {"gen": 5, "width": 8}, "nvlink_down": [3], "recovery_action": "node_reboot",
        "fabric_health": "limited_capacity",
    }
    node_file.doc["gpus"][0]["signals"] = signals
    node_file.write()
    b = SimulatedBackend(node_file.path)
    codes = {c.code for c in evaluate_reading(b.read(b.discover().gpus[0]), None, HealthConfig())}
    assert codes == {"ecc-uncorrected", "row-remap-pending", "row-remap-failure", "retired-pages-pending",
                     "temperature-shutdown", "hw-slowdown", "power-brake", "pcie-link-degraded", "nvlink-down",
                     "recovery-action-reboot", "fabric-limited"}


def test_lost_and_nvml_error_signals(node_file: NodeFile) -> None:
    node_file.set(1, lost=True)
    node_file.set(2, nvml_error=True)
    b = SimulatedBackend(node_file.path)
    gpus = b.discover().gpus
    assert b.read(gpus[1]).lost
    assert b.read(gpus[2]).errors and not b.read(gpus[2]).lost


def test_xid_entries_appended_since_last_read_are_events(node_file: NodeFile) -> None:
    node_file.set(3, xid_events=[13])  # history present at start is not replayed
    b = SimulatedBackend(node_file.path)
    assert b.wait_events(0.01) == ()
    node_file.set(3, xid_events=[13, 79, 48])
    assert b.reload()
    events = b.wait_events(1.0)
    assert [(e.uuid, e.kind, e.code) for e in events] == [(node_file.uuids[3], "xid", 79),
                                                          (node_file.uuids[3], "xid", 48)]
    assert b.reload() and b.wait_events(0.01) == ()  # nothing new


@pytest.mark.parametrize("atomic", [True, False])
def test_file_changes_are_picked_up_by_the_watcher(node_file: NodeFile, atomic: bool) -> None:
    b = SimulatedBackend(node_file.path)
    changed = threading.Event()
    b.watch(changed.set)
    try:
        node_file.set(4, temperature_c=91, atomic=atomic)
        assert changed.wait(5.0)
        gpu = b.discover().gpus[4]
        assert b.read(gpu).temperature_c == 91
    finally:
        b.close()


def test_bad_rewrite_keeps_last_good_state(node_file: NodeFile, caplog: pytest.LogCaptureFixture) -> None:
    b = SimulatedBackend(node_file.path)
    node_file.path.write_text(json.dumps({"gpus": [{"uuid": "GPU-x"}]}))
    assert not b.reload()
    assert "gpus[0] (GPU-x).index: missing" in (b.last_error or "")
    assert len(b.discover().gpus) == 8
    assert "keeping the last good state" in caplog.text
    node_file.path.write_text("{not json")
    assert not b.reload() and "not valid JSON" in (b.last_error or "")


def test_gpus_added_and_removed(node_file: NodeFile) -> None:
    b = SimulatedBackend(node_file.path)
    extra = dict(node_file.doc["gpus"][0], uuid="GPU-new", index=8, nvlink_peers=[], signals={})
    node_file.doc["gpus"].append(extra)
    node_file.write()
    assert b.reload() and len(b.discover().gpus) == 9
    node_file.doc["gpus"] = node_file.doc["gpus"][8:]
    node_file.write()
    assert b.reload() and [g.uuid for g in b.discover().gpus] == ["GPU-new"]


def test_unreadable_file_at_start_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(NodeFileError, match="cannot read"):
        SimulatedBackend(tmp_path / "missing.json")


def test_gpu_removed_without_editing_its_peers_leaves_their_links_down(node_file: NodeFile,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """GPU 3 falls off the bus: it goes from the file and nothing else changes. Its NVLink peers 0, 1 and 2 (an
    island of four) read their link to it as down, so health shows it; the other island is untouched."""
    b = SimulatedBackend(node_file.path)
    gone = node_file.doc["gpus"].pop(3)
    node_file.write()
    with caplog.at_level("WARNING", "plugin.devices.simulated"):
        assert b.reload(), b.last_error
        gpus = {g.index: g for g in b.discover().gpus}
        assert sorted(gpus) == [0, 1, 2, 4, 5, 6, 7]
        # Link k goes to the k-th entry of nvlink_peers: GPU 0 [1, 2, 3] -> link 2, GPU 1 [0, 2, 3] -> link 2.
        downs = {i: b.read(gpus[i]).nvlink_down for i in gpus}
        assert downs == {0: (2,), 1: (2,), 2: (2,), 4: (), 5: (), 6: (), 7: ()}
        assert gpus[0].nvlink_peers == (1, 2) and gpus[4].nvlink_peers == (5, 6, 7)  # only links with a far end
        reasons = evaluate_reading(b.read(gpus[1]), None, HealthConfig())
        assert [(r.code, r.message) for r in reasons] == [("nvlink-down", "NVLink down: link 2")]
        assert evaluate_reading(b.read(gpus[5]), None, HealthConfig()) == []
        # The same file read again, and polled again, is not news: one warning per link, not per reload or poll.
        for _ in range(3):
            assert b.reload()
            b.read(gpus[0])
    warnings = [r.getMessage() for r in caplog.records if "not in the node file" in r.getMessage()]
    assert len(warnings) == 3 and all("GPU index 3" in w for w in warnings), warnings
    # A link the file says is down anyway stays down once, whatever the cause.
    node_file.set(1, nvlink_down=[2, 0])
    assert b.reload() and b.read(gpus[1]).nvlink_down == (0, 2)
    # The GPU comes back: its peers' links are up again.
    node_file.doc["gpus"].insert(3, gone)
    node_file.set(1, nvlink_down=None)
    assert b.reload()
    again = {g.index: g for g in b.discover().gpus}
    assert [b.read(again[i]).nvlink_down for i in (0, 1, 2, 3)] == [(), (), (), ()]
    assert again[0].nvlink_peers == (1, 2, 3)
