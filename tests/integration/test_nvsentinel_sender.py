"""Our health events reaching a fake NVSentinel platform connector (real gRPC on a unix socket).

The sender is driven one step at a time on a virtual clock (``step(now)``), so back-off and idleness are checked
over many virtual minutes without sleeping; the last test runs the whole App on a simulated node.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from api.nvsentinel.platformconnector import health_event_pb2 as pb
from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from plugin.nvsentinel.healthevents import AGENT, MEMORY, XID
from plugin.nvsentinel.sender import FAILURE_REASONS, METHOD, HealthEventSender, SenderSettings
from plugin.outlets.metrics import Sources, build_registry
from plugin.serve.exposition import encode_text
from tests.fakes.node_devices import Node
from tests.fakes.platform_connector import FakePlatformConnector
from tests.integration.conftest import Env, running_app

T0 = 1000.0


@pytest.fixture()
def sock(short_socket_dir: Path) -> Path:
    return short_socket_dir / "nvsentinel.sock"


@pytest.fixture()
def connector(sock: Path) -> Iterator[FakePlatformConnector]:
    fake = FakePlatformConnector(sock).start()
    yield fake
    fake.stop()


@pytest.fixture()
def node() -> Node:
    n = Node(NodeState(), n=4)
    n.publish(T0)
    return n


def sender(node: Node, sock: Path, **kw: object) -> HealthEventSender:
    settings = SenderSettings(socket=sock, node_name="gpu-node-1", **kw)  # type: ignore[arg-type]
    return HealthEventSender(node.state, settings, wall=lambda: 1_767_225_600.0, rng=random.Random(7))


def uuid_of(e: pb.HealthEvent) -> str:
    return next(x.entityValue for x in e.entitiesImpacted if x.entityType == "GPU_UUID")


def checks(batch: pb.HealthEvents) -> list[tuple[str, str, bool, bool]]:
    return [(uuid_of(e), e.checkName, e.isHealthy, e.isFatal) for e in batch.events]


def test_a_transition_is_sent_as_the_table_says_and_its_recovery_closes_the_same_check(
        node: Node, sock: Path, connector: FakePlatformConnector) -> None:
    s = sender(node, sock)
    assert s.step(T0) == T0 + s.settings.recheck_s
    assert connector.calls == 0, "a healthy node sends nothing"
    node.set(2, State.UNHEALTHY, "xid-79", now=T0 + 1)
    s.step(T0 + 1)
    [batch] = connector.batches
    [e] = batch.events
    assert (e.agent, e.checkName, e.isFatal, e.isHealthy, list(e.errorCode)) == (AGENT, XID, True, False, ["79"])
    assert e.recommendedAction == pb.RESTART_BM and e.nodeName == "gpu-node-1"
    assert e.processingStrategy == pb.EXECUTE_REMEDIATION
    assert uuid_of(e) == node.gpus[2].uuid
    assert s.status().events_sent == 1 and s.status().connected and s.status().pending_checks == 0

    node.set(2, State.HEALTHY, now=T0 + 2)
    s.step(T0 + 2)
    rec = connector.batches[-1].events[0]
    assert rec.isHealthy and not rec.isFatal
    assert (rec.checkName, list(rec.entitiesImpacted)) == (e.checkName, list(e.entitiesImpacted))
    s.step(T0 + 3)
    assert len(connector.batches) == 2


def test_store_only(node: Node, sock: Path, connector: FakePlatformConnector) -> None:
    s = sender(node, sock, store_only=True)
    node.set(0, State.DEGRADED, "thermal-slowdown", now=T0)
    s.step(T0)
    [e] = connector.events
    assert e.processingStrategy == pb.STORE_ONLY and not e.isFatal


def test_an_idle_node_sends_nothing_over_many_steps(node: Node, sock: Path,
                                                   connector: FakePlatformConnector) -> None:
    s = sender(node, sock)
    now = T0
    for _ in range(500):  # 500 wake-ups: over an hour of virtual time
        now = max(now + 1, s.step(now))
    assert connector.calls == 0
    node.set(1, State.UNHEALTHY, "ecc-uncorrected", now=now)
    for _ in range(500):
        now = max(now + 1, s.step(now))
    assert connector.calls == 1, "an open check is sent once, not again while it holds"


def test_open_checks_at_start_are_sent_once(sock: Path, connector: FakePlatformConnector) -> None:
    """Latches restored from the state file are in the first snapshot: the first step sends them."""
    n = Node(NodeState(), n=4)
    n.set(0, State.UNHEALTHY, "xid-79", now=T0)
    n.set(3, State.DEGRADED, "thermal-slowdown", now=T0)
    s = sender(n, sock)
    s.step(T0)
    s.step(T0 + 100)
    [batch] = connector.batches
    assert sorted(checks(batch)) == sorted([(n.gpus[0].uuid, XID, False, True),
                                            (n.gpus[3].uuid, "GpuHealthThermal", False, False)])


def test_a_check_left_open_before_a_restart_is_closed_once_the_fault_is_gone(
        sock: Path, connector: FakePlatformConnector, tmp_path: Path) -> None:
    """A polled fault that cleared while the plugin was down: NVSentinel still holds the check open, and only the
    plugin can close it. What NVSentinel acknowledged is kept in the state dir for that."""
    record = tmp_path / "state" / "nvsentinel.json"
    n = Node(NodeState(), n=4)
    n.set(2, State.UNHEALTHY, "ecc-uncorrected", now=T0)
    n.set(0, State.UNHEALTHY, "xid-79", now=T0)
    first = sender(n, sock, acked_file=record)
    first.step(T0)
    assert len(connector.batches) == 1
    # The restart: GPU 2 polls clean now (its ECC counters were reset); GPU 0's latch was restored.
    again = Node(NodeState(), n=4)
    again.set(0, State.UNHEALTHY, "xid-79", now=T0 + 60)
    second = sender(again, sock, acked_file=record)
    second.step(T0 + 60)
    second.step(T0 + 200)
    assert len(connector.batches) == 2
    assert sorted(checks(connector.batches[1])) == sorted([(n.gpus[2].uuid, MEMORY, True, False),
                                                           (n.gpus[0].uuid, XID, False, True)])
    # Nothing left to close: a third start sends only the open check again.
    third = sender(again, sock, acked_file=record)
    third.step(T0 + 300)
    assert checks(connector.batches[2]) == [(n.gpus[0].uuid, XID, False, True)]


def test_an_unreadable_record_of_acknowledged_checks_is_one_line_not_a_failure(
        sock: Path, connector: FakePlatformConnector, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    record = tmp_path / "nvsentinel.json"
    record.write_text("{not json")
    n = Node(NodeState(), n=2)
    n.set(1, State.UNHEALTHY, "xid-79", now=T0)
    with caplog.at_level(logging.WARNING):
        sender(n, sock, acked_file=record).step(T0)
    assert [r.getMessage() for r in caplog.records if "nvsentinel.json" in r.getMessage()]
    assert checks(connector.batches[0]) == [(n.gpus[1].uuid, XID, False, True)]


def test_unavailable_backs_off_and_the_latest_state_wins(node: Node, sock: Path,
                                                         connector: FakePlatformConnector) -> None:
    s = sender(node, sock)
    connector.fail_next(4, grpc.StatusCode.UNAVAILABLE)
    node.set(0, State.UNHEALTHY, "xid-79", now=T0)
    now, waits = T0, []
    for _ in range(4):
        nxt = s.step(now)
        assert s.step(now + (nxt - now) / 2) == nxt, "no attempt before the back-off ends"
        waits.append(nxt - now)
        now = nxt
    assert connector.calls == 4 and connector.batches == []
    # Exponential with equal jitter: the n-th wait within [2^(n-1)/2, 2^(n-1)].
    assert all(2 ** i / 2 <= w <= 2 ** i for i, w in enumerate(waits)), waits
    assert s.status().failures_by_reason["unavailable"] == 4 and not s.status().connected
    assert s.status().pending_checks == 1

    # Meanwhile GPU 0 recovers and GPU 1 fails: what is sent is the state now, not a queue of the past.
    node.set(0, State.HEALTHY, now=now)
    node.set(1, State.UNHEALTHY, "ecc-uncorrected", now=now)
    s.step(now)
    [batch] = connector.batches
    assert checks(batch) == [(node.gpus[1].uuid, MEMORY, False, True)]
    assert s.status().connected and s.status().events_sent == 1


def test_an_event_nvsentinel_refuses_holds_back_no_other_and_is_not_resent_until_it_changes(
        node: Node, sock: Path, connector: FakePlatformConnector, caplog: pytest.LogCaptureFixture) -> None:
    # Before (issue 35, 6): the whole batch was refused and resent every 60 s forever, GPU 0's event with it.
    s = sender(node, sock)
    connector.refuse_gpus = {node.gpus[1].uuid}
    node.set(0, State.UNHEALTHY, "xid-79", now=T0)
    node.set(1, State.UNHEALTHY, "ecc-uncorrected", now=T0)
    with caplog.at_level(logging.WARNING):
        s.step(T0)
    assert [checks(b) for b in connector.batches] == [[(node.gpus[0].uuid, XID, False, True)]]
    st = s.status()
    assert st.events_sent == 1 and st.events_refused == 1 and st.connected and st.pending_checks == 0
    assert st.failures_by_reason["rejected"] == 0  # a refused event is no failed send
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and node.gpus[1].uuid in refused[0] and MEMORY in refused[0], refused
    calls = connector.calls
    now = T0
    for _ in range(10):  # idle: the refused event is not tried again, nor anything else
        now = s.step(now + 61)
    assert connector.calls == calls
    # The check clears (nothing to close: NVSentinel never took it), then fails again: tried once more.
    node.set(1, State.HEALTHY, now=now)
    s.step(now)
    assert connector.calls == calls
    node.set(1, State.UNHEALTHY, "ecc-uncorrected", now=now + 1)
    s.step(now + 1)
    assert connector.calls == calls + 1 and s.status().events_refused == 2
    connector.refuse_gpus = set()
    node.set(1, State.HEALTHY, now=now + 2)
    s.step(now + 2)
    node.set(1, State.UNHEALTHY, "ecc-uncorrected", now=now + 3)
    s.step(now + 3)
    assert checks(connector.batches[-1]) == [(node.gpus[1].uuid, MEMORY, False, True)]


def test_the_open_checks_of_a_gpu_gone_past_the_grace_period_are_closed(
        node: Node, sock: Path, connector: FakePlatformConnector) -> None:
    # Before: a GPU taken out (replaced) left its checks open in NVSentinel forever.
    s = sender(node, sock, gone_grace_s=600.0)
    node.set(3, State.UNHEALTHY, "xid-79", now=T0)
    s.step(T0)
    assert checks(connector.batches[-1]) == [(node.gpus[3].uuid, XID, False, True)]
    node.remove(3, now=T0 + 1)
    s.step(T0 + 1)
    s.step(T0 + 599)
    assert len(connector.batches) == 1, "within the grace period it may come back (a reset, a reload)"
    s.step(T0 + 602)
    assert checks(connector.batches[-1]) == [(node.gpus[3].uuid, XID, True, False)]
    s.step(T0 + 1000)
    assert len(connector.batches) == 2


def test_a_gpu_back_within_the_grace_period_keeps_its_open_checks(
        node: Node, sock: Path, connector: FakePlatformConnector) -> None:
    s = sender(node, sock, gone_grace_s=600.0)
    node.set(3, State.UNHEALTHY, "xid-79", now=T0)
    s.step(T0)
    node.remove(3, now=T0 + 1)
    s.step(T0 + 1)
    node.set(3, State.UNHEALTHY, "xid-79", now=T0 + 300)
    s.step(T0 + 300)
    s.step(T0 + 2000)
    assert len(connector.batches) == 1


def test_the_back_off_is_capped(node: Node, sock: Path, connector: FakePlatformConnector) -> None:
    s = sender(node, sock, backoff_max_s=60.0)
    connector.fail_next(12, grpc.StatusCode.UNAVAILABLE)
    node.set(0, State.UNHEALTHY, "xid-79", now=T0)
    now = T0
    for _ in range(12):
        nxt = s.step(now)
        assert nxt - now <= 60.0
        now = nxt
    assert s.step(now) == now + s.settings.recheck_s
    assert len(connector.batches) == 1


def test_a_failure_then_success_resends_every_open_check(node: Node, sock: Path,
                                                         connector: FakePlatformConnector) -> None:
    s = sender(node, sock)
    node.set(0, State.UNHEALTHY, "xid-79", now=T0)
    s.step(T0)
    connector.fail_next(1)
    node.set(1, State.DEGRADED, "thermal-slowdown", now=T0 + 1)
    retry = s.step(T0 + 1)
    s.step(retry)
    assert sorted(checks(connector.batches[-1])) == sorted([(node.gpus[0].uuid, XID, False, True),
                                                             (node.gpus[1].uuid, "GpuHealthThermal", False, False)])


def test_a_restarted_connector_gets_every_open_check_again(node: Node, sock: Path,
                                                           connector: FakePlatformConnector) -> None:
    s = sender(node, sock)
    node.set(0, State.UNHEALTHY, "xid-79", now=T0)
    s.step(T0)
    connector.restart()  # a new socket file: the inode differs
    assert connector.batches == []
    nxt = s.step(T0 + 10)
    assert checks(connector.batches[-1]) == [(node.gpus[0].uuid, XID, False, True)]
    s.step(nxt)
    assert len(connector.batches) == 1


def test_a_missing_socket_is_one_line_and_a_count(node: Node, sock: Path, caplog: pytest.LogCaptureFixture) -> None:
    s = sender(node, sock)
    node.set(0, State.UNHEALTHY, "xid-79", now=T0)
    now = T0
    with caplog.at_level(logging.INFO, logger="plugin.nvsentinel.sender"):
        for _ in range(20):
            now = s.step(now)
    lines = [r.getMessage() for r in caplog.records if str(sock) in r.getMessage()]
    assert len(lines) == 1 and "--nvsentinel-socket" in lines[0], lines
    assert s.status().failures_by_reason["no-socket"] == 20 and not s.status().connected
    assert node.state.snapshot().get(node.gpus[0].uuid).state is State.UNHEALTHY  # type: ignore[union-attr]

    fake = FakePlatformConnector(sock).start()  # NVSentinel arrives: what is open is sent at once
    try:
        node.set(3, State.DEGRADED, "thermal-slowdown", now=now - 1)
        s.step(now - 1)
        assert {uuid_of(e) for e in fake.events} == {node.gpus[0].uuid, node.gpus[3].uuid}
    finally:
        fake.stop()


def test_a_regular_file_at_the_path_is_named(node: Node, sock: Path, caplog: pytest.LogCaptureFixture) -> None:
    sock.write_text("not a socket")
    s = sender(node, sock)
    node.set(0, State.UNHEALTHY, "xid-79", now=T0)
    with caplog.at_level(logging.WARNING, logger="plugin.nvsentinel.sender"):
        nxt = s.step(T0)
        s.step(nxt)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"--nvsentinel-socket: {sock} is not a socket")
    assert s.status().failures_by_reason["not-a-socket"] == 2
    assert nxt - T0 == s.settings.backoff_max_s, "a configuration error is looked at again only slowly"


def test_a_peer_without_the_method_is_named_and_retried_slowly(node: Node, sock: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    fake = FakePlatformConnector(sock, serve_method=False).start()
    try:
        s = sender(node, sock)
        node.set(0, State.UNHEALTHY, "xid-79", now=T0)
        with caplog.at_level(logging.WARNING, logger="plugin.nvsentinel.sender"):
            nxt = s.step(T0)
            nxt2 = s.step(nxt)
        [line] = [r.getMessage() for r in caplog.records]
        assert METHOD in line and "UNIMPLEMENTED" in line
        assert (nxt - T0, nxt2 - nxt) == (60.0, 60.0)
        assert s.status().failures_by_reason["unimplemented"] == 2
    finally:
        fake.stop()


def test_the_metrics_follow_the_sender(node: Node, sock: Path, connector: FakePlatformConnector) -> None:
    s = sender(node, sock)
    with_sender = build_registry(Sources(node.state, nvsentinel=s.status), process=False)
    without = build_registry(Sources(node.state), process=False)
    assert "nvsentinel" not in encode_text(without).decode(), "no series while the option is off"
    text = encode_text(with_sender).decode()
    for reason in FAILURE_REASONS:
        assert f'gpu_health_nvsentinel_send_failures_total{{reason="{reason}"}} 0.0' in text
    connector.fail_next(1)
    node.set(0, State.UNHEALTHY, "xid-79", now=T0)
    node.set(1, State.UNHEALTHY, "ecc-uncorrected", now=T0)
    retry = s.step(T0)
    text = encode_text(with_sender).decode()
    assert 'gpu_health_nvsentinel_send_failures_total{reason="unavailable"} 1.0' in text
    assert "gpu_health_nvsentinel_connected 0.0" in text and "gpu_health_nvsentinel_pending_checks 2.0" in text
    s.step(retry)
    text = encode_text(with_sender).decode()
    assert "gpu_health_nvsentinel_events_sent_total 2.0" in text and "gpu_health_nvsentinel_connected 1.0" in text
    assert "gpu_health_nvsentinel_pending_checks 0.0" in text


# The whole plugin ---------------------------------------------------------------------------------------------------

@pytest.fixture()
def app_env(short_socket_dir: Path, dev_root: Path, sock: Path) -> Iterator[Env]:
    with running_app(short_socket_dir, dev_root, nvsentinel_socket=sock, node_name="gpu-node-int") as e:
        yield e


def test_a_simulated_fault_reaches_nvsentinel_as_the_mapped_event(app_env: Env, sock: Path) -> None:
    e = app_env
    sender_ = e.app.nvsentinel
    assert sender_ is not None
    # No connector yet: the kubelet path is unaffected, and the sender counts what it could not send.
    e.node.set(4, xid_events=[79])
    uuid4 = e.node.uuids[4]
    assert e.wait_kubelet(lambda: e.kubelet.health(uuid4) == "Unhealthy")
    assert e.wait_state(lambda: sender_.status().failures_by_reason["no-socket"] >= 1)

    fake = FakePlatformConnector(sock).start()
    try:
        e.node.set(1, ecc_uncorrected_volatile=2)  # a state change wakes the sender: it finds the socket
        assert fake.wait_for(lambda: len(fake.events) >= 2), fake.events
        by_gpu = {uuid_of(ev): ev for ev in fake.events}
        xid = by_gpu[uuid4]
        assert (xid.checkName, xid.isFatal, list(xid.errorCode), xid.recommendedAction) == (
            XID, True, ["79"], pb.RESTART_BM)
        assert xid.nodeName == "gpu-node-int"
        assert by_gpu[e.node.uuids[1]].checkName == MEMORY
    finally:
        fake.stop()
