"""What keeps the fleet controller's facts small (issue 27) without changing a decision: Nodes read from separate JSON
documents share their repeated strings, their devices and their assessments; what no decision reads (device times,
GPU ids) is not kept, and what one does read (which GPUs are bad, every label) still moves the decision key."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from plugin.backoff import Backoff
from plugin.controller import nodes
from plugin.controller.nodes import NAME, Keys, NodeFacts, facts_of
from plugin.controller.policy import UNHEALTHY_DEVICES, Rules, assess
from plugin.controller.reconciler import Reconciler, Settings
from tests.fakes.controller_api import T0, FakeControllerApi, FakeLeadership, P, gpu_node, merge_patch, rfc

KEYS = Keys(P)


def served(doc: dict[str, Any]) -> dict[str, Any]:
    """The Node as a client reads it: its own JSON text parsed, so no string is shared with another Node's."""
    return json.loads(json.dumps(doc))  # type: ignore[no-any-return]


def test_nodes_from_separate_documents_share_their_strings_and_devices() -> None:
    labels = {"kubernetes.io/hostname": "", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    a = facts_of(served(gpu_node("node-a", {3: "Unhealthy"}, labels={**labels, "kubernetes.io/hostname": "node-a"})),
                 KEYS)
    b = facts_of(served(gpu_node("node-b", {3: "Unhealthy"}, since=T0 + 60,
                                 labels={**labels, "kubernetes.io/hostname": "node-b"})), KEYS)
    assert a.devices == b.devices and a.devices is b.devices  # other GPU ids, other times: the same devices
    for da, db in zip(a.devices, b.devices, strict=True):
        assert da.key is db.key and da.state is db.state and da.action is db.action and da.code is db.code
    assert a.node_state is b.node_state == "Unhealthy"
    # Labels that differ only by the node's name (the hostname label) are one tuple, read back per node.
    assert a.labels is b.labels and a.labels[:2] == ("kubernetes.io/hostname", NAME)
    assert (a.label("kubernetes.io/hostname"), b.label("kubernetes.io/hostname")) == ("node-a", "node-b")
    assert a.label("nvidia.com/gpu.product") == "NVIDIA-H100-80GB-HBM3" and a.label("pool") is None
    c = facts_of(served(gpu_node("node-c", labels={**labels, "team": "ml", "kubernetes.io/hostname": "other"})),
                 KEYS)
    assert c.labels is not a.labels and c.label("kubernetes.io/hostname") == "other"
    assert all(x is y for x, y in zip(a.labels[2:], c.labels[2:4], strict=True))  # gpu.product: interned strings


def test_facts_have_no_dict_per_instance() -> None:
    f = facts_of(served(gpu_node("n")), KEYS)
    for obj in (f, f.devices[0], assess(f, Rules()), Backoff(1.0, 2.0)):
        assert not hasattr(obj, "__dict__"), type(obj).__name__
    # Without a generator given, back-offs share one: a generator each is 2.5 KB per Node.
    assert Backoff(1.0, 2.0)._rng is Backoff(3.0, 4.0)._rng


def facts(doc: dict[str, Any]) -> NodeFacts:
    return facts_of(served(doc), KEYS)


def test_the_decision_key_ignores_device_times_and_ids_and_follows_states_and_labels() -> None:
    base = gpu_node("n", {1: "Unhealthy"})
    key = facts(base).decision_key()
    later = copy.deepcopy(base)
    ann = later["metadata"]["annotations"]
    for k in [k for k in ann if k.startswith(f"{P}/gpu.")]:
        entry = json.loads(ann[k])
        entry["since"], entry["id"] = rfc(T0 + 3600), entry["id"] + "-replaced"
        ann[k] = json.dumps(entry)
    later["metadata"]["resourceVersion"] = "2"
    assert facts(later).decision_key() == key  # no rule reads them: nothing to decide
    relabelled = merge_patch(base, {"metadata": {"labels": {"team": "a"}}})
    named = merge_patch(base, {"metadata": {"labels": {"kubernetes.io/hostname": "n"}}})
    renamed = merge_patch(named, {"metadata": {"labels": {"kubernetes.io/hostname": "m"}}})
    assert facts(named).decision_key() != key and facts(named).decision_key() != facts(renamed).decision_key()
    for doc in (relabelled, gpu_node("n", {1: "Unhealthy", 2: "Degraded"})):
        assert facts(doc).decision_key() != key


def test_bad_gpus_are_counted_by_the_nodes_own_numbering() -> None:
    """Two Unhealthy MIG devices of one GPU are one bad GPU; of two GPUs, two: as with the ids themselves."""
    def node(parents: tuple[str, str]) -> NodeFacts:
        doc = gpu_node("n", gpus=2)
        ann = doc["metadata"]["annotations"]
        for gi, parent in enumerate(parents):
            ann[f"{P}/gpu.0.mig.{gi}.0"] = json.dumps({"id": f"MIG-{gi}", "parent": parent, "state": "Unhealthy",
                                                       "action": "reset-gpu", "reasons": []})
        return facts(doc)

    rules = Rules(unhealthy_devices=2)
    one, two = node(("GPU-n-0", "GPU-n-0")), node(("GPU-n-0", "GPU-n-1"))
    assert assess(one, rules).reason is None
    a = assess(two, rules)
    assert a.reason == UNHEALTHY_DEVICES and a.message.startswith("2 of 2 GPUs Unhealthy")


def test_the_reconcilers_entries_share_facts_parts_and_assessments() -> None:
    rec = Reconciler(FakeControllerApi(), Settings(keys=KEYS, rules=Rules()), FakeLeadership(leader=False))
    rec.replace([served(gpu_node(f"n{i}", since=T0 + i)) for i in range(3)])
    entries = [rec.entries[f"n{i}"] for i in range(3)]
    assert all(e.assessment is entries[0].assessment for e in entries) and entries[0].assessment.fit
    assert all(e.facts.devices is entries[0].facts.devices for e in entries)


def test_what_is_shared_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodes, "_shared", {})  # an empty table of its own; the other tests' stays as it was
    values = [("unique", i) for i in range(nodes._SHARED_MAX + 100)]
    assert all(nodes.shared(v) is v for v in values)
    assert len(nodes._shared) == nodes._SHARED_MAX
    again = ("unique", 0)
    assert nodes.shared(again) is values[0]  # kept ones still answer
    late = ("unique", nodes._SHARED_MAX + 50)
    assert nodes.shared(late) is late  # past the bound: itself, not kept
