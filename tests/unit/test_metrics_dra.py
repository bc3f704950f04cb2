"""DRA mode's series: the ResourceSlice writer's requests, the driver's prepared claims and its results by reason,
each read through the real object at scrape time and parsed back as Prometheus reads it (the health streams need a
served socket: tests/integration/test_dra_server.py). And device-plugin mode's exposition, which they must leave as
it was."""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from plugin.app import App
from plugin.config import Config
from plugin.devices.model import GpuEvent
from plugin.dra import slices as rs
from plugin.dra.checkpoint import Checkpoint
from plugin.dra.driver import PREPARE, RESULTS, UNPREPARE, ClaimRef, Driver, RequestError, Result, Unavailable
from plugin.dra.mode import DraMode, DraSettings
from plugin.dra.slicewriter import SliceWriter
from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from plugin.kube.errors import ApiFailure
from plugin.outlets.metrics import Sources, build_registry
from plugin.serve.exposition import Registry, encode_text
from tests.conftest import FakeClock, write_kubeconfig
from tests.fakes import nvml_standin
from tests.fakes.node_devices import Node
from tests.integration.test_dra_driver import NODE, T0, FakeClaims, Plugin, ours, uid
from tests.unit.test_dra_podstatus import FakePods, prepared
from tests.unit.test_dra_podstatus import Harness as PodHarness
from tests.unit.test_metrics import named, scrape, value
from tests.unit.test_slicewriter import FakeSliceServer

GOLDEN = Path(__file__).with_name("device_plugin_exposition.txt")


def idle_dra_mode(state: NodeState, root: Path) -> DraMode:
    """DRA mode built as the App builds it and not started: a source of every DRA series, its API never called."""
    settings = DraSettings(node_name=NODE, plugin_dir=root / "plugin", registry_dir=root / "registry",
                           cdi_dir=root / "cdi", state_dir=root / "state", dev_dir=str(root / "dev"))
    return DraMode(settings, state, FakeClaims(), FakeSliceServer, time.monotonic, pods=FakePods)


def types(registry: Registry) -> dict[str, str]:
    text = generate_latest(registry).decode()  # type: ignore[arg-type]
    return {fam.name: fam.type for fam in text_string_to_metric_families(text)}


# The ResourceSlice writer -----------------------------------------------------------------------------------------

class Writer:
    """The real slice writer on a virtual clock, against the fake API server, with a client that can fail."""

    def __init__(self, server: FakeSliceServer) -> None:
        self.server = server
        self.client_error: ApiFailure | None = None
        self.clock = FakeClock(1000.0)
        self.state = NodeState()
        self.node = Node(self.state, n=4)
        self.writer = SliceWriter(self.state, rs.SliceSettings(node_name=NODE), self._client, clock=self.clock,
                                  rng=random.Random(7))
        self.registry = build_registry(Sources(self.state, slice_writer=self.writer.status), process=False)

    def _client(self) -> FakeSliceServer:
        if self.client_error is not None:
            raise self.client_error
        return self.server

    def run(self, seconds: float) -> None:
        """Tick as the thread would, jumping to each deadline, for ``seconds`` of virtual time."""
        end = self.clock.now + seconds
        while True:
            deadline = self.writer.tick(self.clock.now)
            if self.clock.now >= end:
                return
            self.clock.now = min(max(deadline, self.clock.now), end)

    def failures(self) -> dict[str, float]:
        return {dict(k)["kind"]: v for k, v in named(scrape(self.registry), "gpu_health_dra_slice_failures_total")
                .items()}


def test_the_slice_writers_requests_failures_by_kind_and_last_error_are_exported() -> None:
    w = Writer(FakeSliceServer(served=False))
    assert types(w.registry) == {
        "gpu_health_devices": "gauge", "gpu_health_device_state": "gauge", "gpu_health_device_reason": "gauge",
        "gpu_health_device_kubelet_healthy": "gauge", "gpu_health_backend_error": "gauge",
        "gpu_health_transitions": "counter", "gpu_health_transitions_missed": "counter",
        "gpu_health_nvml_call_errors": "counter", "gpu_health_nvml_check_unavailable": "gauge",
        "gpu_health_dra_slice_writes": "counter", "gpu_health_dra_slice_reads": "counter",
        "gpu_health_dra_slice_conflicts": "counter", "gpu_health_dra_slice_failures": "counter",
        "gpu_health_dra_slice_ok": "gauge", "gpu_health_dra_slice_last_error_timestamp_seconds": "gauge",
        "gpu_health_dra_slice_taints_published": "gauge",
        "gpu_health_dra_slice_sharing_published": "gauge"}
    # Every kind at 0 before its first failure: an alert on a rate sees a flat line, not a series appearing.
    assert w.failures() == {"client": 0, "read": 0, "write": 0, "not-served": 0}
    s = scrape(w.registry)
    assert value(s, "gpu_health_dra_slice_ok") == 1
    assert value(s, "gpu_health_dra_slice_last_error_timestamp_seconds") == 0
    assert value(s, "gpu_health_dra_slice_taints_published") == 1

    # No client (a kubeconfig that cannot be read), then an API server that does not serve resource.k8s.io/v1.
    w.client_error = ApiFailure(0, "no service account token")
    w.node.publish(T0)
    before = time.time()
    w.run(0)
    assert w.failures() == {"client": 1, "read": 0, "write": 0, "not-served": 0}
    s = scrape(w.registry)
    assert value(s, "gpu_health_dra_slice_ok") == 0
    assert before <= (value(s, "gpu_health_dra_slice_last_error_timestamp_seconds") or 0) <= time.time()
    w.client_error = None
    w.run(5)
    assert w.failures() == {"client": 1, "read": 0, "write": 0, "not-served": 1}
    assert value(scrape(w.registry), "gpu_health_dra_slice_reads_total") == 1  # the GET answered; the create 404

    # Served again: the create goes through at the back-off cap, and the writer is ok.
    w.server.served = True
    w.run(300)
    s = scrape(w.registry)
    assert (value(s, "gpu_health_dra_slice_writes_total"), value(s, "gpu_health_dra_slice_ok")) == (1, 1)

    # Another writer's edit makes the next PUT a 409, answered by a re-read.
    w.server.foreign_edit()
    w.node.set(1, State.UNHEALTHY, "xid-79", now=T0 + 1)
    w.run(30)
    s = scrape(w.registry)
    assert value(s, "gpu_health_dra_slice_conflicts_total") == 1
    assert value(s, "gpu_health_dra_slice_writes_total") == 2
    assert value(s, "gpu_health_dra_slice_reads_total") == 3

    # A failed write, then a failed read (the resync after a kubelet registration).
    def refuse_update(name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        raise ApiFailure(503, "etcdserver: request timed out")

    def refuse_get(name: str) -> dict[str, Any] | None:
        raise ApiFailure(500, "internal error")

    update, get = w.server.update_resource_slice, w.server.get_resource_slice
    w.server.update_resource_slice = refuse_update  # type: ignore[method-assign]
    w.node.set(1, State.HEALTHY, now=T0 + 2)
    w.run(5)
    failed = w.failures()
    assert failed["write"] >= 1 and failed["read"] == 0  # re-reads and retries of the write, each paced
    w.server.update_resource_slice = update  # type: ignore[method-assign]
    w.server.get_resource_slice = refuse_get  # type: ignore[method-assign]
    w.run(30)
    failed = w.failures()
    assert failed["read"] >= 1 and value(scrape(w.registry), "gpu_health_dra_slice_ok") == 0
    w.server.get_resource_slice = get  # type: ignore[method-assign]
    w.run(600)
    s = scrape(w.registry)
    assert value(s, "gpu_health_dra_slice_ok") == 1 and value(s, "gpu_health_dra_slice_writes_total") == 3
    # What a scrape says is the writer's own status, nothing lost or added on the way.
    st = w.writer.status()
    assert w.failures() == {**dict.fromkeys(st.failure_kinds, 0), **st.failures_by_kind}
    assert (st.writes, st.reads, st.conflicts) == (3, value(s, "gpu_health_dra_slice_reads_total"), 1)


def test_an_api_server_dropping_taints_shows_as_taints_not_published() -> None:
    w = Writer(FakeSliceServer(drop_taints=True))
    w.node.publish(T0)
    w.run(5)
    assert value(scrape(w.registry), "gpu_health_dra_slice_taints_published") == 1
    w.node.set(2, State.UNHEALTHY, "xid-79", now=T0 + 1)
    w.run(30)
    assert value(scrape(w.registry), "gpu_health_dra_slice_taints_published") == 0


# The pod-condition writer ---------------------------------------------------------------------------------------

def test_the_pod_condition_writers_writes_pods_skips_and_failures_are_exported(tmp_path: Path) -> None:
    h = PodHarness(tmp_path)
    registry = build_registry(Sources(h.state, pod_conditions=h.writer.status), process=False)

    def failures() -> dict[str, float]:
        return {dict(k)["kind"]: v for k, v in
                named(scrape(registry), "gpu_health_dra_pod_condition_failures_total").items()}

    assert failures() == {"client": 0, "write": 0, "state-file": 0}
    h.node.publish(T0)
    h.server.add("train")
    h.prepare(prepared("train-ext", 1, pod="train"))
    h.prepare(prepared("gone-ext", 2, pod="gone"))  # no such pod: left alone
    h.for_(5)
    s = scrape(registry)
    assert (value(s, "gpu_health_dra_pod_condition_writes_total"), value(s, "gpu_health_dra_pod_condition_pods"),
            value(s, "gpu_health_dra_pod_condition_skipped_total"),
            value(s, "gpu_health_dra_pod_condition_ok")) == (1, 2, 1, 1)
    h.server.fail_next = [ApiFailure(503, "unavailable")]
    h.set(1, State.UNHEALTHY, "xid-79")
    h.for_(12)
    assert failures() == {"client": 0, "write": 1, "state-file": 0}
    h.for_(60)
    s = scrape(registry)
    assert (value(s, "gpu_health_dra_pod_condition_writes_total"), value(s, "gpu_health_dra_pod_condition_ok")) \
        == (2, 1)


# The driver ---------------------------------------------------------------------------------------------------------

class Prepares(Plugin):
    """test_dra_driver's node of eight GPUs and faked ResourceClaims, its real driver called directly (no socket),
    and a registry reading it."""

    def __init__(self, root: Path, dev_dir: str) -> None:
        super().__init__(root, root, dev_dir)
        self.driver: Driver = Driver(self.state, self.api, NODE, self.cdi_dir, self.state_dir, dev_dir)
        self.registry = build_registry(Sources(self.state, claims=self.driver), process=False)

    def claim(self, name: str, results: list[dict[str, Any]] | None) -> ClaimRef:
        self.api.add("ns", name, uid(name), results)
        return ClaimRef("ns", uid(name), name)

    def results(self) -> dict[tuple[str, str], float]:
        return {(dict(k)["operation"], dict(k)["result"]): v
                for k, v in named(scrape(self.registry), "gpu_health_dra_claim_results_total").items()}

    def nonzero(self) -> dict[tuple[str, str], float]:
        return {k: v for k, v in self.results().items() if v}


@pytest.fixture
def prepares(tmp_path: Path, dev_root: Path) -> Prepares:
    return Prepares(tmp_path, str(dev_root / "dev"))


def test_every_result_is_exported_at_zero_and_labels_are_a_closed_set(prepares: Prepares) -> None:
    assert types(prepares.registry)["gpu_health_dra_claim_results"] == "counter"
    assert types(prepares.registry)["gpu_health_dra_prepared_claims"] == "gauge"
    results = prepares.results()
    assert set(results) == {(op, r.value) for op, rs_ in RESULTS.items() for r in rs_}
    assert set(results.values()) == {0}
    assert {r for _, r in results} == {"ok", "claim-not-found", "api-error", "not-allocated", "not-ours",
                                       "not-allocatable", "cdi-error", "checkpoint-error", "invalid-request",
                                       "unavailable"}
    assert value(scrape(prepares.registry), "gpu_health_dra_prepared_claims") == 0


def test_each_kind_of_claim_error_is_counted_under_its_result(prepares: Prepares) -> None:
    p = prepares
    p.node.set(2, State.UNHEALTHY, "xid-79", now=T0 + 1)
    good = p.claim("good", [ours("gpu-0")])
    batch = [good,
             ClaimRef("ns", uid("missing"), "missing"),  # 404
             p.claim("recreated", [ours("gpu-1")]),  # the claim of that name has another UID now
             p.claim("forbidden", [ours("gpu-1")]),
             p.claim("pending", None),
             p.claim("malformed", [{"request": "gpus", "driver": rs.DRIVER, "pool": NODE}]),
             p.claim("foreign", [{"request": "gpus", "driver": "other.example.com", "pool": NODE, "device": "gpu-0"}]),
             p.claim("elsewhere", [ours("gpu-99")]),
             p.claim("broken", [ours("gpu-2")])]
    p.api.objects[("ns", "recreated")]["metadata"]["uid"] = uid("recreated-again")
    p.api.failures[("ns", "forbidden")] = ApiFailure(403, "resourceclaims is forbidden")
    out = p.driver.prepare(batch)
    assert [c.uid for c in batch if not out[c.uid].error] == [good.uid]
    assert p.nonzero() == {(PREPARE, "ok"): 1, (PREPARE, "claim-not-found"): 2, (PREPARE, "api-error"): 1,
                           (PREPARE, "not-allocated"): 2, (PREPARE, "not-ours"): 2, (PREPARE, "not-allocatable"): 1}
    assert value(scrape(p.registry), "gpu_health_dra_prepared_claims") == 1
    # No claim UID, name or message reaches a label.
    text = generate_latest(p.registry).decode()  # type: ignore[arg-type]
    dra = "\n".join(line for line in text.splitlines() if "gpu_health_dra_" in line)
    assert dra and not re.search(r"[0-9a-f]{8}-[0-9a-f]{4}-|forbidden|gpu-99|ns/", dra)

    # A call refused whole counts each of its claims.
    with pytest.raises(RequestError, match=re.escape("claims[1].name is empty")):
        p.driver.prepare([good, ClaimRef("ns", uid("x"), "")])
    with pytest.raises(RequestError, match=re.escape("claims[0].namespace is empty")):
        p.driver.unprepare([ClaimRef("", uid("y"), "y")])
    assert p.results()[(PREPARE, "invalid-request")] == 2 and p.results()[(UNPREPARE, "invalid-request")] == 1

    # A CDI dir that is a file: the spec can be neither written nor removed.
    p.cdi_dir.rename(p.cdi_dir.with_name("cdi.saved"))
    p.cdi_dir.write_text("")
    assert p.driver.prepare([p.claim("no-cdi", [ours("gpu-3")])])[uid("no-cdi")].error
    assert p.driver.unprepare([good])[good.uid]
    assert (p.results()[(PREPARE, "cdi-error")], p.results()[(UNPREPARE, "cdi-error")]) == (1, 1)
    p.cdi_dir.unlink()
    p.cdi_dir.with_name("cdi.saved").rename(p.cdi_dir)

    # A checkpoint that cannot be written (a directory in its place), on prepare and on unprepare.
    checkpoint = p.state_dir / Checkpoint.FILE
    checkpoint.unlink()
    checkpoint.mkdir()
    no_save = p.claim("no-save", [ours("gpu-4")])
    assert "cannot write the checkpoint" in p.driver.prepare([no_save])[no_save.uid].error
    assert "cannot write the checkpoint" in p.driver.unprepare([good])[good.uid]
    assert (p.results()[(PREPARE, "checkpoint-error")], p.results()[(UNPREPARE, "checkpoint-error")]) == (1, 1)
    assert value(scrape(p.registry), "gpu_health_dra_prepared_claims") == 1  # still prepared: nothing was saved
    checkpoint.rmdir()
    assert p.driver.unprepare([good, ClaimRef("ns", uid("never"), "never")]) == {good.uid: "", uid("never"): ""}
    assert p.results()[(UNPREPARE, "ok")] == 2
    assert value(scrape(p.registry), "gpu_health_dra_prepared_claims") == 0


def test_a_checkpoint_that_cannot_be_read_counts_every_claim_as_unavailable(tmp_path: Path, dev_root: Path) -> None:
    (tmp_path / "state" / Checkpoint.FILE).mkdir(parents=True)  # read() fails, as EIO would
    p = Prepares(tmp_path, str(dev_root / "dev"))
    claims = [p.claim(n, [ours(f"gpu-{i}")]) for i, n in enumerate(("a", "b", "c"))]
    with pytest.raises(Unavailable, match="cannot read the DRA checkpoint"):
        p.driver.prepare(claims)
    with pytest.raises(Unavailable, match="cannot read the DRA checkpoint"):
        p.driver.unprepare(claims[:1])
    assert p.nonzero() == {(PREPARE, "unavailable"): 3, (UNPREPARE, "unavailable"): 1}


def test_counts_from_parallel_calls_add_up_while_scrapes_read_them(prepares: Prepares) -> None:
    p = prepares
    claims = [p.claim(f"c{i}", [ours(f"gpu-{i}")]) for i in range(8)]
    stop = threading.Event()
    seen: list[float] = []

    def scraper() -> None:
        while not stop.is_set():
            seen.append(p.results()[(PREPARE, "ok")])

    t = threading.Thread(target=scraper)
    t.start()
    with futures.ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda i: p.driver.prepare([claims[i % 8]]), range(400)))
    stop.set()
    t.join()
    assert p.results()[(PREPARE, "ok")] == 400
    assert seen == sorted(seen)  # a counter a scrape reads never goes back
    assert value(scrape(p.registry), "gpu_health_dra_prepared_claims") == 8


def test_the_result_set_is_closed(prepares: Prepares) -> None:
    with pytest.raises(ValueError, match="unprepare has no result 'not-ours'"):
        prepares.driver._results.add(UNPREPARE, Result.NOT_OURS)


# Device-plugin mode -----------------------------------------------------------------------------------------------

def shape(text: str) -> str:
    """The exposition without sample values and without the process's own series (its memory, CPU and Python
    version vary between runs and hosts): every HELP and TYPE line, every series name and label set, in order."""
    out = []
    for line in text.splitlines():
        name = line.split(" ")[2] if line.startswith("#") else re.split(r"[{ ]", line)[0]
        if not name.startswith(("process_", "python_")):
            out.append(line if line.startswith("#") else line.rsplit(" ", 1)[0])
    return "\n".join(out) + "\n"


def test_device_plugin_mode_exposes_exactly_what_it_did_before_dra_metrics(tmp_path: Path) -> None:
    """Every outlet on (reporter, correlator, NVML), as written before DRA mode had series of its own
    (device_plugin_exposition.txt); a change here is a change operators' dashboards see, so it is made on purpose."""
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:9")
    cfg = Config(backend="simulated", device_plugin_dir=tmp_path / "dp", state_dir=tmp_path / "state",
                 dev_root=tmp_path, metrics_address="127.0.0.1:0", node_name="n1", kubeconfig=kubeconfig)
    app = App(cfg, nvml_standin.open_backend(tmp_path / "nvml", uuid_prefix="GPU-fake-")[0])
    try:
        assert app.dra is None and app.kube_reporter is not None and app.correlator is not None
        app.monitor.poll_once()
        app.monitor.handle_events([GpuEvent("GPU-fake-0", "xid", 79, 0.0)])
        assert app.metrics_server is not None
        assert shape(encode_text(app.metrics_server.registry).decode()) == GOLDEN.read_text()
    finally:
        app.backend.close()
