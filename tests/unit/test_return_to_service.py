"""A GPU comes back after the action its fault asked for (issue 34): a reboot, a reset, a driver reload, the operator,
a passed recovery check; and nothing else brings it back.

The health engine over the simulated backend and a real state dir, on a fake clock; a plugin restart is a new
Monitor over the same state dir, a reboot is a restart under another boot id. The recovery check is the real
command runner running real processes.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plugin.devices.model import Gpu
from plugin.devices.simulated import SimulatedBackend
from plugin.health.config import HealthConfig
from plugin.health.monitor import ClearRefused, Monitor
from plugin.health.node_state import NodeState, Transition
from plugin.health.reasons import State
from plugin.health.recovery import CommandRecoveryChecker
from plugin.health.store import StateStore
from tests.unit.test_monitor import MIG, gpu_doc
from tests.unit.test_monitor import Node as MonitorNode

BOOT_1 = "0a4b7e52-0c5e-4c1e-9a53-5d0f3c6e0001"
BOOT_2 = "0a4b7e52-0c5e-4c1e-9a53-5d0f3c6e0002"
UUID0 = gpu_doc(0)["uuid"]
UUID1 = gpu_doc(1)["uuid"]


def doc(i: int, pci: str | None = None, uuid: str | None = None, migs: int = 0, **signals: Any) -> dict[str, Any]:
    d = gpu_doc(i, migs, **signals)
    d["pci_bus_id"] = pci or f"00000000:{0x18 + i:02X}:00.0"
    if uuid:
        d["uuid"] = uuid
    return d


class Node(MonitorNode):
    """test_monitor's node with a boot id and, optionally, a recovery check. ``restart(boot)``: the plugin starts
    again under that boot id (the same one: a plugin restart; another: the node rebooted). Every change and poll is
    flushed to the state file at once, as the persister thread would write it."""

    def __init__(self, tmp: Path, gpus: list[dict[str, Any]], cfg: HealthConfig | None = None,
                 check: str = "", busy: Callable[[Gpu], str] = lambda g: "") -> None:
        self.check = check
        self.busy = busy
        self.stop = threading.Event()
        self.woken = threading.Event()
        self.boot = BOOT_1
        super().__init__(tmp, gpus, cfg)

    def restart(self, boot: str | None = None, gpus: list[dict[str, Any]] | None = None) -> None:
        if hasattr(self, "monitor"):
            self.save()  # a plugin's stop ends with a final write
        self.boot = boot or self.boot
        if gpus is not None:
            self.write(gpus)
        self.backend = SimulatedBackend(self.file, clock=self.clock)
        self.state = NodeState()
        self.recovery = None
        if self.check:
            self.recovery = CommandRecoveryChecker(self.check, 30.0, self.busy, self.woken.set, self.stop)
        self.monitor = Monitor(self.backend, self.state, self.cfg, 5.0, threading.Event(),
                               StateStore(self.state_dir), clock=self.clock, boot_id=self.boot,
                               recovery=self.recovery)
        self.poll()

    def change(self, gpus: list[dict[str, Any]]) -> None:
        super().change(gpus)
        self.save()

    def poll(self, advance: float = 5.0) -> None:
        super().poll(advance)
        self.save()

    def driver_reset(self, gpus: list[dict[str, Any]], i: int) -> None:
        """The driver asks for a reset of GPU ``i``, then its recovery action returns to none: the reset happened."""
        for action in ("gpu_reset", "none"):
            gpus[i]["signals"]["recovery_action"] = action
            self.change(gpus)
            self.poll()

    def codes(self, device_id: str) -> list[str]:
        return [r.code for r in self.device(device_id).reasons]

    def notes(self) -> list[Transition]:
        return [t for t in self.state.history() if t.note]

    def saved(self) -> dict[str, Any]:
        return dict(json.loads((self.state_dir / "state.json").read_text()))

    def await_check(self) -> None:
        assert self.woken.wait(30), "the recovery check never finished"
        self.woken.clear()
        self.poll()


def xid(node: Node, i: int, *xids: int, **signals: Any) -> list[dict[str, Any]]:
    gpus = [doc(0), doc(1)]
    gpus[i] = doc(i, xid_events=list(xids), **signals)
    node.change(gpus)
    return gpus


# A reboot -------------------------------------------------------------------------------------------------------

def test_a_reboot_returns_a_gpu_whose_fault_a_reboot_mends_and_a_plugin_restart_does_not(tmp_path: Path) -> None:
    node = Node(tmp_path, [doc(0), doc(1)])
    xid(node, 1, 79)
    assert node.device(UUID1).state is State.UNHEALTHY
    node.restart(BOOT_1)  # the plugin restarts, the node did not: the existing promise, nothing heals
    assert node.codes(UUID1) == ["xid-79"]
    # The node reboots: the XID history is gone from the driver, the GPU reads clean, the boot id is new.
    node.restart(BOOT_2, [doc(0), doc(1)])
    d = node.device(UUID1)
    assert d.state is State.HEALTHY and d.cleared is not None
    assert d.cleared.codes == ("xid-79",) and d.cleared.why == "node rebooted"
    [t] = node.notes()
    assert (t.id, t.from_state, t.to_state, t.note) == (UUID1, "Absent", "Healthy", "cleared xid-79: node rebooted")
    # The history in the state dir keeps why, for watchers resuming after the next restart.
    assert [e.get("note") for e in node.saved()["transitions"] if e.get("note")] == ["cleared xid-79: node rebooted"]
    assert node.device(UUID0).state is State.HEALTHY and node.device(UUID0).cleared is None


def test_a_reboot_does_not_clear_a_fault_the_gpu_still_shows_and_the_judgement_is_made_once(tmp_path: Path) -> None:
    node = Node(tmp_path, [doc(0), doc(1)])
    xid(node, 1, 79)
    # After the reboot the driver still asks for one: the reboot did not mend the GPU.
    node.restart(BOOT_2, [doc(0), doc(1, recovery_action="node_reboot")])
    reasons = {r.code: r for r in node.device(UUID1).reasons}
    assert set(reasons) == {"xid-79", "recovery-action-reboot"}
    assert "kept across a node reboot: the GPU still shows recovery-action-reboot" in reasons["xid-79"].message
    # The driver stops asking (no reboot): the recovery-action reason clears, the latch stays, and a plugin restart
    # in this same boot does not clear it either: it was judged under this boot.
    node.change([doc(0), doc(1)])
    for _ in range(3):
        node.poll()
    assert node.codes(UUID1) == ["xid-79"]
    node.restart(BOOT_2)
    assert node.codes(UUID1) == ["xid-79"]
    node.restart("0a4b7e52-0c5e-4c1e-9a53-5d0f3c6e0003")  # the next reboot does
    assert node.device(UUID1).state is State.HEALTHY


def test_a_reboot_keeps_what_it_does_not_mend_and_says_so(tmp_path: Path) -> None:
    node = Node(tmp_path, [doc(0), doc(1)])
    xid(node, 1, 64, 48)  # xid-64: support; xid-48: a reset (or a reboot) mends it
    assert set(node.codes(UUID1)) == {"xid-64", "xid-48"}
    node.restart(BOOT_2, [doc(0), doc(1)])
    [r] = node.device(UUID1).reasons
    assert r.code == "xid-64" and r.message.endswith("kept across a node reboot: a reboot does not clear it")
    assert node.device(UUID1).state is State.UNHEALTHY
    assert node.notes()[-1].note == "cleared xid-48: node rebooted"


def test_a_reboot_with_the_gpu_still_lost_clears_nothing_until_it_answers(tmp_path: Path) -> None:
    node = Node(tmp_path, [doc(0), doc(1)])
    xid(node, 1, 79)
    node.restart(BOOT_2, [doc(0), doc(1, lost=True)])
    assert set(node.codes(UUID1)) == {"xid-79", "gpu-lost"}
    node.change([doc(0), doc(1)])
    node.poll()
    assert node.device(UUID1).state is State.HEALTHY


def test_a_reboot_clears_the_latches_of_a_gpus_mig_devices_too(tmp_path: Path) -> None:
    node = Node(tmp_path, [doc(0, migs=1), doc(1)])
    node.change([doc(0, migs=1, mig_events=[{"gpu_instance_id": 1, "xid": 48}]), doc(1)])
    assert node.device(MIG).state is State.UNHEALTHY and node.device(UUID0).state is State.HEALTHY
    node.restart(BOOT_1, [doc(0, migs=1), doc(1)])
    assert node.device(MIG).state is State.UNHEALTHY
    node.restart(BOOT_2)
    assert node.device(MIG).state is State.HEALTHY


# A reset and a driver reload --------------------------------------------------------------------------------------

def test_the_drivers_reset_request_ending_clears_only_the_latches_a_reset_mends(tmp_path: Path) -> None:
    node = Node(tmp_path, [doc(0), doc(1)])
    gpus = xid(node, 1, 48, 64, 79)
    node.poll()
    node.driver_reset(gpus, 1)
    assert "xid-48" not in node.codes(UUID1)
    assert {"xid-64", "xid-79"} <= set(node.codes(UUID1))
    notes = [t.note for t in node.notes()]
    assert notes == ["cleared xid-48: GPU reset: the driver's recovery action went from gpu_reset to none"]
    # The state stayed Unhealthy: the clearance is a transition of its own, from == to.
    t = node.notes()[0]
    assert t.from_state == t.to_state == "Unhealthy"


def test_a_gpu_replaced_at_the_same_pci_address_starts_clean_and_the_old_record_stays(tmp_path: Path) -> None:
    node = Node(tmp_path, [doc(0), doc(1)])
    xid(node, 1, 64)
    pci = doc(1)["pci_bus_id"]
    new = "GPU-5a1e0000-0000-4000-8000-0000000000aa"
    node.restart(BOOT_2, [doc(0), doc(1, uuid=new)])
    assert node.device(new).state is State.HEALTHY
    assert node.state.snapshot().get(UUID1) is None
    saved = node.saved()["devices"]
    assert saved[UUID1]["pci"] == pci and saved[UUID1]["replaced_by"] == new
    assert [r["code"] for r in saved[UUID1]["latched"]] == ["xid-64"]


# The operator -----------------------------------------------------------------------------------------------------

def test_the_operator_clears_a_latch_by_index_with_a_note_in_the_history(tmp_path: Path) -> None:
    node = Node(tmp_path, [doc(0), doc(1)])
    xid(node, 1, 79)
    assert node.monitor.clear("1", "xid-79", "reseated, ticket 4711") == [(UUID1, "xid-79")]
    d = node.device(UUID1)
    assert d.state is State.HEALTHY
    assert node.notes()[-1].note == "cleared xid-79: by the operator: reseated, ticket 4711"
    node.restart(BOOT_1)  # and it stays cleared across a restart
    assert node.device(UUID1).state is State.HEALTHY


def test_the_operator_is_refused_while_the_condition_is_present_and_nothing_changes(tmp_path: Path) -> None:
    node = Node(tmp_path, [doc(0), doc(1)])
    xid(node, 1, 79, lost=True)
    node.poll()
    with pytest.raises(ClearRefused, match="still lost"):
        node.monitor.clear(UUID1, None, "x")
    node.change([doc(0), doc(1, row_remap_failure=True)])
    node.poll()
    with pytest.raises(ClearRefused, match="row-remap-failure is still present"):
        node.monitor.clear(UUID1, "row-remap-failure", "x")
    with pytest.raises(ClearRefused, match="no device 'GPU-nope'"):
        node.monitor.clear("GPU-nope", None, "x")
    with pytest.raises(ClearRefused, match="xid-13 cannot be cleared: the device has no such reason"):
        node.monitor.clear(UUID1, "xid-13", "x")
    assert set(node.codes(UUID1)) == {"xid-79", "row-remap-failure"}
    assert node.notes() == []
    # All of it at once: what may be cleared is, what is present stays, and the answer says which.
    assert node.monitor.clear(UUID1, None, "after the reseat") == [(UUID1, "xid-79")]
    assert node.codes(UUID1) == ["row-remap-failure"]


def test_clearing_every_device_clears_what_each_may_lose_and_refuses_only_when_none_can(tmp_path: Path) -> None:
    node = Node(tmp_path, [doc(0), doc(1)])
    node.change([doc(0, xid_events=[48]), doc(1, xid_events=[63])])
    assert sorted(node.monitor.clear(None, None, "maintenance done")) == [(UUID0, "xid-48"), (UUID1, "xid-63")]
    with pytest.raises(ClearRefused, match="nothing to clear"):
        node.monitor.clear(None, None, "again")


def test_the_monitors_own_reasons_are_not_the_operators_to_clear(tmp_path: Path) -> None:
    node = Node(tmp_path, [doc(0), doc(1)])
    node.monitor.set_external(UUID1, [])
    from plugin.health.reasons import Action, Reason, Source
    node.monitor.set_external(UUID1, [Reason("external-xid", State.UNHEALTHY, "theirs", Source.EXTERNAL,
                                             Action.RESET_GPU, 1.0)])
    with pytest.raises(ClearRefused, match="another health provider's"):
        node.monitor.clear(UUID1, "external-xid", "x")


# The recovery check -----------------------------------------------------------------------------------------------

def script(tmp: Path, body: str) -> str:
    path = tmp / "check.py"
    path.write_text(body)
    return f"{sys.executable} {path} {{index}} {{uuid}} {{pci}}"


def test_with_a_recovery_check_a_reboot_waits_for_it_to_pass(tmp_path: Path) -> None:
    seen = tmp_path / "seen"
    check = script(tmp_path, f"import sys; open({str(seen)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')")
    node = Node(tmp_path, [doc(0), doc(1)], check=check)
    xid(node, 1, 79)
    node.restart(BOOT_2, [doc(0), doc(1)])
    d = node.device(UUID1)
    assert d.state is State.UNHEALTHY and [r.code for r in d.reasons] == ["recovery-check-pending"]
    assert "xid-79 cleared (node rebooted)" in d.reasons[0].message
    node.await_check()
    d = node.device(UUID1)
    assert d.state is State.HEALTHY
    assert d.cleared is not None and d.cleared.why == "node rebooted; recovery check passed"
    assert seen.read_text() == f"1 {UUID1} {doc(1)['pci_bus_id']}\n"  # only the GPU whose fault cleared
    node.stop.set()


def test_a_failed_recovery_check_keeps_the_gpu_out_with_its_output_until_a_reset_runs_it_again(tmp_path: Path) -> None:
    verdict = tmp_path / "verdict"
    verdict.write_text("fail")
    check = script(tmp_path, f"import sys\nv = open({str(verdict)!r}).read()\nprint('diag: memory test', v)\n"
                             "sys.exit(0 if v == 'pass' else 3)\n")
    node = Node(tmp_path, [doc(0), doc(1)], check=check)
    node.driver_reset(xid(node, 1, 48), 1)
    assert "recovery-check-pending" in node.codes(UUID1)
    node.await_check()
    [r] = [r for r in node.device(UUID1).reasons if r.code == "recovery-check-failed"]
    assert "diag: memory test fail" in r.message and "3" in r.message
    for _ in range(5):
        node.poll(advance=3600)
    assert "recovery-check-failed" in node.codes(UUID1)  # time does not clear it
    verdict.write_text("pass")
    node.restart(BOOT_2)  # a reboot: the check runs again, and passes
    assert node.codes(UUID1) == ["recovery-check-pending"]
    node.await_check()
    assert node.device(UUID1).state is State.HEALTHY
    node.stop.set()


def test_gpu_model_has_the_fields_the_check_substitutes() -> None:
    # {index}, {uuid} and {pci} come from the discovered GPU; a rename here breaks the recipe in the docs.
    assert {"index", "uuid", "pci_bus_id"} <= set(Gpu.__dataclass_fields__)


def test_a_check_the_operator_made_moot_never_runs_later_under_a_new_workload(tmp_path: Path) -> None:
    # The GPU waits for its check while a pod holds it; the operator clears it; the pod ends and a new one may be
    # scheduled there any moment: the queued check must be gone, not started once the GPU looks free.
    seen = tmp_path / "seen"
    check = script(tmp_path, f"import sys; open({str(seen)!r}, 'a').write(sys.argv[2] + '\\n')")
    holder = {"pod": "pod ml/train-0"}
    node = Node(tmp_path, [doc(0), doc(1)], check=check, busy=lambda g: holder["pod"] if g.index == 1 else "")
    xid(node, 1, 79)
    node.restart(BOOT_2, [doc(0), doc(1)])
    [pending] = node.device(UUID1).reasons
    # The message says why it has not run ("queued", then "held by pod ml/train-0" once the worker has looked).
    assert pending.code == "recovery-check-pending" and pending.message.endswith(")")
    node.monitor.clear(UUID1, "recovery-check-pending", "checked by hand")
    assert node.device(UUID1).state is State.HEALTHY
    holder["pod"] = ""
    assert node.recovery is not None
    node.recovery.request(Gpu(UUID0, 0, pci_bus_id=doc(0)["pci_bus_id"]))  # another GPU's check: the worker looks
    assert node.woken.wait(30)
    assert [r.device_id for r in node.recovery.results()] == [UUID0]
    assert seen.read_text() == f"{UUID0}\n"  # GPU 1's check never ran
    node.stop.set()
