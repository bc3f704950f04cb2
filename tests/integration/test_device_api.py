"""NVSentinel's device API both ways against a stand-in server on a real unix socket (tests/fakes/device_api.py), with
the real health engine over a simulated node. The provider's steps are driven on a virtual clock, so "an idle node
writes nothing" is counted over many rounds; the consumer runs on its own thread as in the plugin. Tests play
another provider through a real gRPC client."""

from __future__ import annotations

import logging
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.nvsentinel.deviceapi.v1alpha1 import gpu_pb2
from plugin.app import App
from plugin.config import ConfigError, load
from plugin.devices.simulated import SimulatedBackend, builtin_node
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import DeviceStatus, NodeState
from plugin.health.reasons import Action, KubeletHealth, State
from plugin.nvsentinel.deviceapi import (
    DeviceApiConsumer,
    DeviceApiProvider,
    DeviceApiSettings,
    DeviceApiStats,
    _lenient,
)
from plugin.nvsentinel.gpuconditions import CONDITION_TYPE
from tests.conftest import FakeClock, NodeFile
from tests.fakes.device_api import FakeDeviceApi
from tests.integration.conftest import wait_state
from tests.integration.test_dra_app import _free_port
from tests.integration.test_dra_server import poll

LABEL = "--device-api-socket"


def two_gpus() -> dict[str, object]:
    gpus = builtin_node()["gpus"][:2]
    for g in gpus:
        g["nvlink_peers"] = [1 - g["index"]]
    return {"gpus": gpus}


@dataclass
class Rig:
    node: NodeFile
    backend: SimulatedBackend
    state: NodeState
    monitor: Monitor
    fake: FakeDeviceApi
    settings: DeviceApiSettings
    stats: DeviceApiStats
    clock: FakeClock
    provider: DeviceApiProvider

    @property
    def uuids(self) -> list[str]:
        return self.node.uuids

    def fault(self, index: int, **signals: object) -> None:
        self.node.set(index, **signals)
        assert self.backend.reload()
        self.monitor.poll_once()

    def step(self, advance: float = 0.0) -> float:
        self.clock.advance(advance)
        return self.provider.step(self.clock())

    def device(self, uuid: str) -> DeviceStatus:
        d = self.state.snapshot().get(uuid)
        assert d is not None
        return d

    def wait_state(self, predicate: object, timeout: float = 10.0) -> bool:
        return wait_state(self.state, predicate, timeout)


@pytest.fixture
def rig(short_socket_dir: Path) -> Iterator[Rig]:
    node = NodeFile(short_socket_dir / "node.json", two_gpus())
    backend = SimulatedBackend(node.path)
    state = NodeState()
    monitor = Monitor(backend, state, HealthConfig(clear_after_polls=1), 5.0, threading.Event())
    monitor.poll_once()
    fake = FakeDeviceApi(short_socket_dir / "device.sock")
    fake.start()
    settings = DeviceApiSettings(socket=fake.socket_path, label=LABEL, provide=True, consume=True,
                                 call_timeout_s=2.0, resync_s=30.0, backoff_initial_s=0.05, backoff_max_s=0.2)
    stats = DeviceApiStats()
    clock = FakeClock()
    provider = DeviceApiProvider(state, settings, stats, clock=clock)
    yield Rig(node, backend, state, monitor, fake, settings, stats, clock, provider)
    provider.stop()
    fake.stop()


@pytest.fixture
def consumer(rig: Rig) -> Iterator[DeviceApiConsumer]:
    c = DeviceApiConsumer(rig.monitor, rig.settings, rig.stats, ours=rig.provider.ours)
    c.start()
    yield c
    c.stop()


def other_provider_writes(fake: FakeDeviceApi, name: str, *conditions: gpu_pb2.Condition, uuid: str = "",
                          action: str | None = None) -> None:
    """Another provider's read-modify-write: create the GPU if needed, replace its own conditions, keep the rest."""
    client = fake.client()
    if uuid:
        client.CreateGpu(gpu_pb2.CreateGpuRequest(gpu=gpu_pb2.Gpu(metadata=gpu_pb2.ObjectMeta(name=name),
                                                                  spec=gpu_pb2.GpuSpec(uuid=uuid))))
    gpu = client.GetGpu(gpu_pb2.GetGpuRequest(name=name)).gpu
    mine = {c.type for c in conditions}
    kept = [c for c in gpu.status.conditions if c.type not in mine]
    status = gpu_pb2.GpuStatus(conditions=[*kept, *conditions],
                               recommended_action=gpu.status.recommended_action if action is None else action)
    client.UpdateGpuStatus(gpu_pb2.UpdateGpuStatusRequest(name=name, status=status,
                                                          resource_version=gpu.resource_version))


def nvml_ready(status: str) -> gpu_pb2.Condition:
    return gpu_pb2.Condition(type="NVMLReady", status=status, reason="XidError" if status != "True" else "Ok",
                             message="XID 79 seen by NVML" if status != "True" else "")


# Provider ----------------------------------------------------------------------------------------------------------

def test_every_gpu_is_created_under_its_lowercased_uuid_with_our_healthy_condition(rig: Rig) -> None:
    rig.step()
    assert sorted(rig.fake.gpus) == sorted(u.lower() for u in rig.uuids)
    for uuid in rig.uuids:
        gpu = rig.fake.gpus[uuid.lower()]
        assert gpu.spec.uuid == uuid
        (c,) = gpu.status.conditions
        assert (c.type, c.status, c.reason) == (CONDITION_TYPE, "True", "Healthy") and c.last_transition_time.seconds
        assert gpu.status.recommended_action == ""
    assert rig.stats.writes()[("create", "ok")] == 2 and rig.stats.connected()["provider"]


def test_a_fault_writes_our_condition_and_action_and_keeps_another_providers(rig: Rig) -> None:
    rig.step()
    name = rig.uuids[0].lower()
    other_provider_writes(rig.fake, name, nvml_ready("True"))
    rig.fault(0, ecc_uncorrected_volatile=2)
    rig.step()
    gpu = rig.fake.gpus[name]
    by_type = {c.type: c for c in gpu.status.conditions}
    assert set(by_type) == {CONDITION_TYPE, "NVMLReady"} and by_type["NVMLReady"].status == "True"
    ours = by_type[CONDITION_TYPE]
    assert (ours.status, ours.reason) == ("False", "EccUncorrected")
    assert ours.message.startswith("Unhealthy: ecc-uncorrected: ")
    assert gpu.status.recommended_action == "reset-gpu"
    rig.fault(0, ecc_uncorrected_volatile=None)
    rig.step(advance=1.0)
    gpu = rig.fake.gpus[name]
    assert {c.type: c.status for c in gpu.status.conditions} == {CONDITION_TYPE: "True", "NVMLReady": "True"}
    assert gpu.status.recommended_action == "", "the action we wrote goes with the fault"


def test_a_conflicting_write_between_our_read_and_write_is_read_again_and_both_conditions_kept(rig: Rig) -> None:
    rig.step()
    name = rig.uuids[0].lower()
    rig.fake.after_get = lambda n: other_provider_writes(rig.fake, n, nvml_ready("False"))
    rig.fault(0, ecc_uncorrected_volatile=2)
    rig.step()
    assert rig.stats.writes()[("update-status", "conflict")] == 1
    assert {c.type: c.status for c in rig.fake.gpus[name].status.conditions} == {
        CONDITION_TYPE: "False", "NVMLReady": "False"}


def test_an_idle_node_writes_nothing_over_many_rounds(rig: Rig) -> None:
    rig.step()
    creates, updates = rig.fake.writes("CreateGpu"), rig.fake.writes("UpdateGpuStatus")
    for _ in range(200):
        rig.monitor.poll_once()
        rig.step(advance=1.0)  # 200 s: several resyncs, which only read
    assert (rig.fake.writes("CreateGpu"), rig.fake.writes("UpdateGpuStatus")) == (creates, updates)
    assert rig.fake.writes("GetGpu") > 0


def test_our_transition_time_moves_only_when_our_status_does(rig: Rig) -> None:
    rig.step()
    name = rig.uuids[0].lower()
    rig.fault(0, ecc_uncorrected_volatile=2)
    rig.step()
    first = rig.fake.condition(name, CONDITION_TYPE)
    assert first is not None
    rig.fault(0, ecc_uncorrected_volatile=2, temperature_c=95)  # another reason, the same status
    rig.step()
    again = rig.fake.condition(name, CONDITION_TYPE)
    assert again is not None and again.message != first.message
    assert again.last_transition_time == first.last_transition_time


def test_a_restarted_server_gets_our_gpus_and_condition_again(rig: Rig) -> None:
    rig.fault(0, ecc_uncorrected_volatile=2)
    rig.step()
    rig.fake.restart()  # empty again: found at the next resync, which reads
    rig.step(advance=31.0)
    assert sorted(rig.fake.gpus) == sorted(u.lower() for u in rig.uuids)
    c = rig.fake.condition(rig.uuids[0].lower(), CONDITION_TYPE)
    assert c is not None and c.status == "False"
    # Down, then back: the failure backs off, and the first round after it writes everything again.
    rig.fake.stop()
    retry_at = rig.step(advance=1.0)
    assert not rig.stats.connected()["provider"] and retry_at > rig.clock()
    rig.fake.gpus.clear()
    rig.fake.start()
    rig.step(advance=retry_at - rig.clock())
    assert sorted(rig.fake.gpus) == sorted(u.lower() for u in rig.uuids) and rig.stats.connected()["provider"]


def test_a_server_of_another_version_is_named_by_the_method_it_lacks(rig: Rig,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    rig.fake.unimplemented = {"GetGpu"}
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            rig.step(advance=1.0)
    lines = [r.getMessage() for r in caplog.records if "GetGpu" in r.getMessage()]
    assert len(lines) == 1, "once per streak"
    assert LABEL in lines[0] and "does not implement GetGpu" in lines[0]


def test_a_write_a_server_does_not_implement_is_counted_as_such(rig: Rig) -> None:
    # Told apart from other errors on /metrics: a version mismatch wants an upgrade, not a look at the server's logs.
    rig.fake.unimplemented = {"CreateGpu"}
    rig.step(advance=1.0)
    writes = rig.stats.writes()
    assert writes[("create", "unimplemented")] >= 1
    assert writes[("create", "error")] == 0


def test_a_path_that_is_not_a_socket_is_one_line_and_retried(short_socket_dir: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    path = short_socket_dir / "not-a-socket"
    path.write_text("")
    settings = DeviceApiSettings(socket=path, label=LABEL, provide=True, consume=False, backoff_initial_s=0.05,
                                 backoff_max_s=0.2)
    state = NodeState()
    provider = DeviceApiProvider(state, settings, DeviceApiStats(), clock=FakeClock())
    with caplog.at_level(logging.WARNING):
        deadlines = [provider.step(1_000_000.0 + i) for i in range(5)]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"{LABEL}: {path} exists but is not a socket")
    assert all(d > 0 for d in deadlines)


def test_providing_or_consuming_without_a_socket_is_refused_at_start_naming_both_options() -> None:
    with pytest.raises(ConfigError) as err:
        load({"device_api_provide": "true", "device_api_consume": "true"}, {}, None)
    text = str(err.value)
    assert "--device-api-socket" in text and "--device-api-provide" in text and "--device-api-consume" in text


# Consumer --------------------------------------------------------------------------------------------------------

def test_another_providers_condition_becomes_an_external_reason_until_cleared(
        rig: Rig, consumer: DeviceApiConsumer) -> None:
    uuid = rig.uuids[0]
    name = uuid.lower()
    other_provider_writes(rig.fake, name, nvml_ready("False"), uuid=uuid.upper().replace("GPU-", "GPU-"),
                          action="reboot-node")
    assert rig.wait_state(lambda: rig.device(uuid).state is State.UNHEALTHY)
    d = rig.device(uuid)
    assert [(r.code, r.action.value) for r in d.reasons] == [("external-nvml-ready", "reboot-node")]
    assert d.kubelet_health is KubeletHealth.UNHEALTHY and rig.stats.external_reasons == 1
    other_provider_writes(rig.fake, name, nvml_ready("True"))
    assert rig.wait_state(lambda: rig.device(uuid).state is State.HEALTHY and not rig.device(uuid).reasons)
    other_provider_writes(rig.fake, name, nvml_ready("Unknown"))
    assert rig.wait_state(lambda: rig.device(uuid).state is State.UNKNOWN)
    rig.fake.client().DeleteGpu(gpu_pb2.DeleteGpuRequest(name=name))
    assert rig.wait_state(lambda: rig.device(uuid).state is State.HEALTHY)
    assert rig.stats.external_reasons == 0


def test_our_own_condition_is_never_read_back(rig: Rig, consumer: DeviceApiConsumer) -> None:
    rig.step()
    rig.fault(0, ecc_uncorrected_volatile=2)
    rig.step()  # ours now says False on GPU 0
    # A marker after it: the watch delivers in order, so once GPU 1's reason is in, GPU 0's write has been read.
    other_provider_writes(rig.fake, rig.uuids[1].lower(), nvml_ready("False"))
    assert rig.wait_state(lambda: rig.device(rig.uuids[1]).state is State.UNHEALTHY)
    assert [r.code for r in rig.device(rig.uuids[0]).reasons] == ["ecc-uncorrected"]


def test_malformed_conditions_are_skipped_alone_and_counted(rig: Rig, consumer: DeviceApiConsumer,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    uuid = rig.uuids[0]
    with caplog.at_level(logging.WARNING):
        other_provider_writes(rig.fake, uuid.lower(), gpu_pb2.Condition(type="", status="False"),
                              gpu_pb2.Condition(type="Odd", status="Maybe"),
                              gpu_pb2.Condition(type="Huge", status="False", message="x" * 20000),
                              nvml_ready("False"), uuid=uuid)
        rig.fake.put_raw(gpu_pb2.Gpu(metadata=gpu_pb2.ObjectMeta(name="no-uuid")))
        assert rig.wait_state(lambda: rig.device(uuid).state is State.UNHEALTHY)
        assert poll(lambda: rig.stats.rejections()["no-uuid"] >= 1)
    assert [r.code for r in rig.device(uuid).reasons] == ["external-nvml-ready"]
    counts = rig.stats.rejections()
    assert counts["empty-type"] >= 1 and counts["bad-status"] >= 1 and counts["bad-message"] >= 1
    lines = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert any("Maybe" in line for line in lines) and any("no spec.uuid" in line for line in lines)
    assert len(lines) == len({line.split("(")[1].split(")")[0] for line in lines}), "one line per kind"


def test_the_action_we_wrote_is_not_taken_back_as_another_providers(rig: Rig, consumer: DeviceApiConsumer) -> None:
    # Before (issue 35, 3): the GPU's one recommended_action field held ours (reset-gpu); another provider's False
    # came with it, so the external reason carried our action, and once our fault cleared we published it again as
    # ours, for as long as the other provider said False.
    uuid, name = rig.uuids[0], rig.uuids[0].lower()
    rig.step()
    rig.fault(0, ecc_uncorrected_volatile=2)
    rig.step()
    assert rig.fake.gpus[name].status.recommended_action == "reset-gpu"
    other_provider_writes(rig.fake, name, nvml_ready("False"))  # no action of its own: ours stays in the field
    assert rig.wait_state(lambda: any(r.code == "external-nvml-ready" for r in rig.device(uuid).reasons))
    external = next(r for r in rig.device(uuid).reasons if r.code == "external-nvml-ready")
    assert external.action is Action.CONTACT_SUPPORT, external
    rig.fault(0, ecc_uncorrected_volatile=None)
    rig.step(advance=1.0)
    other_provider_writes(rig.fake, rig.uuids[1].lower(), nvml_ready("False"))  # a marker: GPU 0 is read by now
    assert rig.wait_state(lambda: rig.device(rig.uuids[1]).state is State.UNHEALTHY)
    rig.step(advance=1.0)
    assert [(r.code, r.action) for r in rig.device(uuid).reasons] == [("external-nvml-ready", Action.CONTACT_SUPPORT)]
    assert rig.fake.gpus[name].status.recommended_action != "reset-gpu"
    # Another provider naming an action of its own is taken at its word.
    other_provider_writes(rig.fake, name, nvml_ready("False"), action="reboot-node")
    assert rig.wait_state(lambda: [r.action for r in rig.device(uuid).reasons] == [Action.REBOOT_NODE])


def test_two_objects_naming_one_gpu_keep_each_others_findings(rig: Rig, consumer: DeviceApiConsumer) -> None:
    # Another server's naming: its object for GPU 0 is not ours (we name it by the lowercased UUID). Before (issue 35,
    # 7) the last event of either object won: our own object's event erased the other provider's False.
    uuid = rig.uuids[0]
    other_provider_writes(rig.fake, "node-a-gpu-0", nvml_ready("False"), uuid=uuid)
    assert rig.wait_state(lambda: rig.device(uuid).state is State.UNHEALTHY)
    rig.step()  # our objects, with our Healthy condition only: an event for GPU 0 that holds no finding
    # A marker after it: the watch delivers in order, so once GPU 1's reason is in, our GPU 0 event has been read.
    other_provider_writes(rig.fake, rig.uuids[1].lower(), nvml_ready("False"))
    assert rig.wait_state(lambda: rig.device(rig.uuids[1]).state is State.UNHEALTHY)
    assert [r.code for r in rig.device(uuid).reasons] == ["external-nvml-ready"]
    rig.fake.client().DeleteGpu(gpu_pb2.DeleteGpuRequest(name="node-a-gpu-0"))
    assert rig.wait_state(lambda: rig.device(uuid).state is State.HEALTHY and not rig.device(uuid).reasons)
    assert rig.device(rig.uuids[1]).state is State.UNHEALTHY


def test_an_event_that_does_not_parse_is_skipped_not_fatal() -> None:
    good = gpu_pb2.WatchGpusResponse(type="ADDED", object=gpu_pb2.Gpu(
        status=gpu_pb2.GpuStatus(conditions=[gpu_pb2.Condition(type="T", message="ZZZZ")])))
    data = good.SerializeToString()
    assert _lenient(data) == good
    assert _lenient(data.replace(b"ZZZZ", b"\xff\xfe\xff\xfe")) is None


def test_a_lost_stream_keeps_the_reasons_until_the_relist_replaces_them(rig: Rig,
                                                                       consumer: DeviceApiConsumer) -> None:
    uuid = rig.uuids[0]
    other_provider_writes(rig.fake, uuid.lower(), nvml_ready("False"), uuid=uuid)
    assert rig.wait_state(lambda: rig.device(uuid).state is State.UNHEALTHY)
    rig.fake.stop()
    assert poll(lambda: not rig.stats.connected()["consumer"])
    assert rig.device(uuid).state is State.UNHEALTHY, "kept while the device API is away"
    rig.fake.gpus.clear()
    rig.fake.start()
    assert rig.wait_state(lambda: rig.device(uuid).state is State.HEALTHY), "the re-list has no such GPU"
    assert poll(lambda: rig.stats.connected()["consumer"])


# Through the App ---------------------------------------------------------------------------------------------------

def test_the_app_publishes_to_and_reads_from_the_device_api(short_socket_dir: Path, dev_root: Path) -> None:
    root = short_socket_dir
    node = NodeFile(root / "node.json", two_gpus())
    fake = FakeDeviceApi(root / "device.sock")
    fake.start()
    port = _free_port()
    cfg = load({"backend": "simulated", "simulated_node": str(node.path), "state_dir": str(root / "state"),
                "dev_root": str(dev_root), "device_plugin_dir": str(root / "dp"), "poll_interval": "0.1",
                "metrics_address": f"127.0.0.1:{port}", "device_api_socket": str(fake.socket_path),
                "device_api_provide": "true", "device_api_consume": "true"}, {}, None)
    app = App(replace(cfg, health=HealthConfig(clear_after_polls=1)))
    app.start()
    try:
        names = sorted(u.lower() for u in node.uuids)
        assert fake.wait(lambda: sorted(fake.gpus) == names and all(
            fake.condition(n, CONDITION_TYPE) is not None for n in names))
        node.set(1, ecc_uncorrected_volatile=1)
        assert fake.wait(lambda: (c := fake.condition(names[1], CONDITION_TYPE)) is not None and c.status == "False")
        uuid = node.uuids[0]
        other_provider_writes(fake, uuid.lower(), nvml_ready("False"))

        def external_on_gpu0() -> bool:
            d = app.state.snapshot().get(uuid)
            return d is not None and d.kubelet_health is KubeletHealth.UNHEALTHY
        assert wait_state(app.state, external_on_gpu0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            body = r.read().decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(body) for s in fam.samples}
        assert samples[("gpu_health_device_api_connected", (("role", "consumer"),))] == 1.0
        assert samples[("gpu_health_device_api_external_reasons", ())] == 1.0
        assert samples[("gpu_health_device_api_writes_total", (("operation", "create"), ("result", "ok")))] == 2
        assert samples[("gpu_health_device_api_rejected_conditions_total", (("kind", "bad-status"),))] == 0
    finally:
        app.stop.set()
        app.shutdown()
        fake.stop()
