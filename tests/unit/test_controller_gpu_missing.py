"""The fleet controller's gpu-missing rule: a node whose agent says it is short of a GPU (the ``node`` annotation)
is quarantined with that reason once it has said so for the grace period on the controller's own clock; a GPU back
within the grace quarantines nothing; a node with a GPU missing is never fit to be released."""

from __future__ import annotations

import json
from typing import Any

from plugin.controller.nodes import Keys, facts_of
from plugin.controller.policy import GPU_MISSING, REBOOT_REQUIRED, Rules, assess
from tests.fakes.controller_api import T0, P, gpu_node, rfc
from tests.unit.test_controller_reconciler import TAINT, Rig

MISSING = json.dumps({"reasons": [{"code": "gpu-missing", "severity": "Unhealthy", "action": "reboot-node",
                                   "message": "1 GPU on the PCI bus not seen by NVML: 0000:98:00.0",
                                   "since": rfc(T0)}]})


def short(name: str, **kw: Any) -> dict[str, Any]:
    """A node whose 8 GPUs in NVML are Healthy and whose agent finds a ninth on the bus (state Unhealthy)."""
    doc = gpu_node(name, **kw)
    ann = doc["metadata"]["annotations"]
    ann[f"{P}/node"] = MISSING
    ann[f"{P}/state"] = "Unhealthy"
    return doc


def test_the_rule_reads_the_node_key_and_comes_after_reboot_required() -> None:
    f = facts_of(short("n"), Keys(P))
    assert f.node_codes == ("gpu-missing",)
    a = assess(f, Rules())
    assert (a.reason, a.fit) == (GPU_MISSING, False)
    assert assess(f, Rules(gpu_missing=False)).reason is None and not assess(f, Rules(gpu_missing=False)).fit
    assert assess(facts_of(short("n", reboot=(2,)), Keys(P)), Rules()).reason == REBOOT_REQUIRED
    assert facts_of(gpu_node("ok"), Keys(P)).node_codes == ()
    # A change of the key is a change of what a decision depends on.
    assert f.decision_key() != facts_of(gpu_node("n"), Keys(P)).decision_key()


def test_a_node_short_of_a_gpu_is_quarantined_after_the_grace() -> None:
    rig = Rig([short("short"), gpu_node("good")], gpu_missing_grace_s=600.0)
    rig.run_until(T0 + 599)
    assert rig.quarantined() == [] and rig.api.writes() == []  # a reset may bring it back within the grace
    rig.run_until(T0 + 601)
    assert rig.quarantined() == ["short"]
    assert rig.node("short")["spec"]["taints"] == [{"key": TAINT, "value": GPU_MISSING, "effect": "NoSchedule"}]
    [ev] = rig.events("GPUNodeQuarantined")
    assert GPU_MISSING in ev["message"]


def test_a_gpu_back_within_the_grace_quarantines_nothing_and_the_grace_starts_over() -> None:
    rig = Rig([short("flaky")], gpu_missing_grace_s=600.0)
    rig.run_until(T0 + 300)
    back = gpu_node("flaky")
    rig.api.nodes["flaky"]["metadata"]["annotations"] = back["metadata"]["annotations"]
    rig.watch("flaky")
    rig.run_until(T0 + 900)
    assert rig.quarantined() == []
    rig.api.nodes["flaky"]["metadata"]["annotations"] = short("flaky")["metadata"]["annotations"]
    rig.watch("flaky")
    rig.run_until(T0 + 1400)  # 500 s of the new streak: not yet
    assert rig.quarantined() == []
    rig.run_until(T0 + 1501)
    assert rig.quarantined() == ["flaky"]


def test_no_grace_quarantines_at_once() -> None:
    rig = Rig([short("short")], gpu_missing_grace_s=0.0)
    rig.step()
    assert rig.quarantined() == ["short"]
