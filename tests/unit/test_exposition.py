"""Our exposition formats against prometheus_client's, byte for byte: the same families built through both (and the
real collectors' families), encoded as text and as OpenMetrics in every escaping scheme, for generated names, help
texts, awkward label values and floats; the encoder chosen for generated Accept headers; the process and platform
series under prometheus_client's names, help texts, types and labels."""

from __future__ import annotations

import math
import os
import platform
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import PlatformCollector as TheirPlatform
from prometheus_client import ProcessCollector as TheirProcess
from prometheus_client import exposition as their_text
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics import exposition as their_om
from prometheus_client.utils import floatToGoString

from plugin.devices.model import GpuEvent
from plugin.health.config import HealthConfig
from plugin.health.monitor import Monitor
from plugin.health.node_state import DeviceStatus, NodeState
from plugin.health.reasons import Reason, State
from plugin.kubelet.allocation import AllocationConfig
from plugin.kubelet.resources import WholeGpus
from plugin.kubelet.supervisor import Supervisor
from plugin.outlets.correlation import CorrelationStats
from plugin.outlets.metrics import Sources, build_registry
from plugin.outlets.reporter import ReporterStatus
from plugin.serve.exposition import (
    ALLOW_UTF8,
    DOTS,
    UNDERSCORES,
    VALUES,
    CounterFamily,
    Family,
    GaugeFamily,
    choose_encoder,
    encode_openmetrics,
    encode_text,
    go_float,
)
from plugin.serve.process import PlatformCollector, ProcessCollector, python_info
from tests.fakes import nvml_standin
from tests.unit.test_metrics_dra import idle_dra_mode

SCHEMES = (UNDERSCORES, ALLOW_UTF8, DOTS, VALUES)
SETTINGS = settings(max_examples=400, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Listed:
    """A registry of fixed families, for either library's encoder."""

    def __init__(self, families: Iterable[Any]) -> None:
        self.families = list(families)

    def collect(self) -> list[Any]:
        return self.families


def theirs_of(families: Iterable[Family]) -> Listed:
    """Our families rebuilt as prometheus_client's, sample for sample."""
    out = []
    for fam in families:
        m = Metric(fam.name, fam.documentation, fam.type)
        m.unit = fam.unit  # the name already carries it: set it as-is, not through the constructor again
        for s in fam.samples:
            m.add_sample(s.name, dict(s.labels), s.value, s.timestamp)
        out.append(m)
    return Listed(out)


def outcome(encode: Callable[[], bytes]) -> bytes | str:
    """The bytes, or the kind of error: a lone surrogate left unescaped cannot be written as UTF-8 by either."""
    try:
        return encode()
    except UnicodeEncodeError as exc:
        return type(exc).__name__


def assert_same(ours: Listed, theirs: Listed) -> None:
    for scheme in SCHEMES:
        assert outcome(lambda s=scheme: encode_text(ours, s)) == outcome(
            lambda s=scheme: their_text.generate_latest(theirs, s)), scheme
        assert outcome(lambda s=scheme: encode_openmetrics(ours, s)) == outcome(
            lambda s=scheme: their_om.generate_latest(theirs, s)), scheme


# Floats that have bitten exporters: signed zeros, tiny and huge magnitudes, the 1e+06 switch, infinities, NaN,
# integers past 2**53, and any other finite float.
AWKWARD = [0, 0.0, -0.0, 1, -1, 1e-9, 5e-324, 0.1, 123456.0, 1234567.0, 999999.9999, 1e6, 1e21, 1e22, -1e21,
           1.7976931348623157e308, math.inf, -math.inf, math.nan, 2**53 + 1, 2**63, 10**20, -(10**20)]
values = st.one_of(st.sampled_from(AWKWARD), st.floats(allow_nan=True, allow_infinity=True),
                   st.integers(min_value=-(10**30), max_value=10**30))
# Label values and help texts: quotes, backslashes, newlines (and what looks like their escapes), tabs, unicode.
texts = st.one_of(st.sampled_from(['', '"', "\\", "\n", '\\"', "\\n", "a\nb", 'say "hi"\\', "\t", "\r\n", "é",
                                   "GPU-5a1e0000", "日本", "\u2028", "\x00", "💥"]),
                  st.text(alphabet=st.sampled_from('ab"\\\n\r\t é日💥:.{}=,#'), max_size=12), st.text(max_size=8))
# Names mostly legacy, sometimes not (dots, dashes, colons, digits first, unicode), so each escaping scheme has
# something to rewrite; "up\n" counts as a legacy name to prometheus_client ($, not \Z). A label name may even hold
# a lone surrogate (a metric name may not: both refuse it), which the values scheme writes as _FFFD_.
names = st.one_of(st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True),
                  st.sampled_from(["up\n", "a.b", "1abc", "a:b", "é", "__", "a-b c"]),
                  st.text(alphabet=st.sampled_from("ab_:.-9 é\n"), min_size=1, max_size=8))
label_names = st.one_of(st.sampled_from(["device", "state", "le", "quantile", "__x", "a.b", "1x", "é", "x\ud800"]),
                        names)
stamps = st.one_of(st.none(), st.floats(min_value=-1e12, max_value=1e12, allow_nan=False))


@st.composite
def families(draw: st.DrawFn) -> tuple[list[Family], list[Any]]:
    """The same families built through our classes and prometheus_client's, the way collectors build them."""
    ours: list[Family] = []
    theirs: list[Any] = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["gauge", "counter", "raw"]))
        name = draw(st.one_of(names, names.map(lambda n: n + "_total")))
        doc = draw(texts)
        unit = draw(st.sampled_from(["", "", "seconds", "bytes"]))
        labelnames = draw(st.lists(label_names, max_size=3, unique=True))
        rows = draw(st.lists(st.tuples(st.lists(texts, min_size=len(labelnames), max_size=len(labelnames)),
                                       values, stamps, st.one_of(st.none(), values)), max_size=4))
        if kind == "gauge":
            g, pg = GaugeFamily(name, doc, labels=labelnames, unit=unit), GaugeMetricFamily(
                name, doc, labels=labelnames, unit=unit)
            for labels, v, ts, _ in rows:
                g.add_metric(labels, v, ts)
                pg.add_metric(labels, v, ts)
            ours.append(g)
            theirs.append(pg)
        elif kind == "counter":
            c, pc = CounterFamily(name, doc, labels=labelnames, unit=unit), CounterMetricFamily(
                name, doc, labels=labelnames, unit=unit)
            for labels, v, ts, created in rows:
                c.add_metric(labels, v, created, ts)
                pc.add_metric(labels, v, created, ts)
            ours.append(c)
            theirs.append(pc)
        else:  # a summary, or any other type, sample by sample; the suffixes the text format moves are among these
            typ = draw(st.sampled_from(["summary", "histogram", "info", "stateset", "gaugehistogram", "unknown",
                                        "untyped", "gauge", "counter"]))
            f, pf = Family(name, doc, typ, unit), Metric(name, doc, typ, unit)
            for labels, v, ts, _ in rows:
                suffix = draw(st.sampled_from(["", "_count", "_sum", "_created", "_gsum", "_gcount", "_total",
                                               "_bucket", "_info"]))
                named = dict(zip(labelnames, labels, strict=True))
                f.add_sample(f.name + suffix, named, v, ts)
                pf.add_sample(pf.name + suffix, dict(named), v, ts)
            ours.append(f)
            theirs.append(pf)
    return ours, theirs


@SETTINGS
@given(families())
def test_generated_families_encode_as_prometheus_client_encodes_them(built: tuple[list[Family], list[Any]]) -> None:
    ours, theirs = built
    assert_same(Listed(ours), Listed(theirs))


def test_a_name_that_is_no_utf8_is_refused_as_prometheus_client_refuses_it() -> None:
    with pytest.raises(UnicodeEncodeError):
        GaugeMetricFamily("x\ud800", "")
    with pytest.raises(ValueError, match="invalid metric name"):
        GaugeFamily("x\ud800", "")
    with pytest.raises(ValueError, match="cannot be empty"):
        CounterFamily("_total", "")


@pytest.mark.parametrize("value", AWKWARD)
def test_awkward_floats_and_label_values(value: float) -> None:
    labels = ["a\"b\\c\nd", "é日💥", ""]
    g = GaugeFamily("x", 'help with "quotes", \\ and\nnewline', labels=["a", "b", "c"])
    g.add_metric(labels, value)
    pg = GaugeMetricFamily("x", 'help with "quotes", \\ and\nnewline', labels=["a", "b", "c"])
    pg.add_metric(labels, value)
    assert_same(Listed([g]), Listed([pg]))
    assert go_float(value) == floatToGoString(value)


@SETTINGS
@given(st.one_of(values, st.floats()))
def test_go_float_is_float_to_go_string(value: float) -> None:
    assert go_float(value) == floatToGoString(value)


def test_the_formats_differences_are_the_ones_prometheus_client_has() -> None:
    c = CounterFamily("jobs_total", "done \"jobs\"\n", labels=["k"])
    c.add_metric(['v"\\'], 1e6, created=1.5)
    text, om = encode_text(Listed([c])).decode(), encode_openmetrics(Listed([c])).decode()
    assert text == ('# HELP jobs_total done "jobs"\\n\n# TYPE jobs_total counter\njobs_total{k="v\\"\\\\"} 1e+06\n'
                    '# HELP jobs_created done "jobs"\\n\n# TYPE jobs_created gauge\njobs_created{k="v\\"\\\\"} 1.5\n')
    assert om == ('# HELP jobs done \\"jobs\\"\\n\n# TYPE jobs counter\njobs_total{k="v\\"\\\\"} 1e+06\n'
                  'jobs_created{k="v\\"\\\\"} 1.5\n# EOF\n')


@pytest.fixture(scope="module")
def every_source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A registry with every source on and every family holding series, free text in a reason included."""
    tmp = tmp_path_factory.mktemp("m")
    backend, _ = nvml_standin.open_backend(tmp / "nvml", uuid_prefix="GPU-fake-")
    state = NodeState()
    monitor = Monitor(backend, state, HealthConfig(), 5.0, threading.Event())
    sup = Supervisor(tmp / "dp", [WholeGpus()], state, AllocationConfig(dev_root=tmp), threading.Event())
    dra = idle_dra_mode(state, tmp)  # beside the supervisor only here: the App runs one or the other
    registry = build_registry(Sources(state, monitor, backend, sup,
                                      annotations=lambda: ReporterStatus(node="n", writes=3),
                                      correlation=lambda: CorrelationStats(evictions_blocked=2),
                                      slice_writer=dra.slice_writer.status,
                                      pod_conditions=dra.pod_conditions.status if dra.pod_conditions else None,
                                      claims=dra.driver,
                                      health_streams=dra.server), process=False)
    monitor.poll_once()
    monitor.handle_events([GpuEvent("GPU-fake-0", "xid", 79, 0.0), GpuEvent("GPU-fake-1", "xid", 13, 0.0)])
    gpu = backend.discover().gpus[0]
    bad = Reason('free "text"\\\n', State.UNHEALTHY, "m", "poll", "none", 0.0)
    state.publish([DeviceStatus(gpu.uuid, gpu, State.UNHEALTHY, (bad,), 1.0, "Unhealthy")], 1.0)
    yield registry
    backend.close()


def test_the_real_collectors_encode_as_prometheus_client_encodes_them(every_source: Any) -> None:
    families = list(every_source.collect())
    assert len(families) > 20 and all(f.samples for f in families if f.name not in (
        "gpu_health_device_reason", "gpu_health_nvml_check_unavailable"))
    assert_same(Listed(families), theirs_of(families))
    # And prometheus_client's own text encoder reads our registry directly (the metric tests parse it that way).
    assert their_text.generate_latest(Listed(families)) == encode_text(Listed(families))


ACCEPT_PARTS = ["application/openmetrics-text", "text/plain", " text/plain ", "*/*", "application/json",
                "TEXT/PLAIN", "application/openmetrics-text "]
PARAMS = ["version=1.0.0", "version=0.0.4", "version=2.0.0", "version=1", "version=1.0", "version=", "version=0.0.1",
          " version=1.0.0 ", "version = 1.0.0", "escaping=dots", "escaping=values", "escaping=allow-utf-8",
          "escaping=underscores", "escaping=nope", "q=0.5", "charset=utf-8", "version=1.x", "version=x",
          "version=10.0.0"]
accepts = st.lists(st.tuples(st.sampled_from(ACCEPT_PARTS), st.lists(st.sampled_from(PARAMS), max_size=3)),
                   max_size=4).map(lambda entries: ",".join(";".join([m, *p]) for m, p in entries))


@SETTINGS
@given(accepts)
def test_the_encoder_is_chosen_from_accept_as_prometheus_client_chooses_it(every_source: Any, accept: str) -> None:
    try:
        their_encoder, their_type = their_text.choose_encoder(accept)
    except TypeError:
        # A version it cannot compare (1.x) fails the whole request there; here that entry is passed over.
        return
    our_encoder, our_type = choose_encoder(accept)
    assert our_type == their_type
    families = list(every_source.collect())
    assert our_encoder(Listed(families)) == their_encoder(theirs_of(families))


def test_a_version_that_does_not_compare_is_passed_over() -> None:
    with pytest.raises(TypeError):
        their_text.choose_encoder("application/openmetrics-text; version=x")
    assert choose_encoder("application/openmetrics-text; version=x")[1] == "text/plain; version=0.0.4; charset=utf-8"
    _, ctype = choose_encoder("application/openmetrics-text; version=1.x, application/openmetrics-text")
    assert ctype == "application/openmetrics-text; version=1.0.0; charset=utf-8"


def shape(families: Iterable[Any]) -> list[tuple[str, str, str, str, list[tuple[str, dict[str, str]]]]]:
    return [(f.name, f.documentation, f.type, f.unit, [(s.name, s.labels) for s in f.samples]) for f in families]


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="no /proc here")
def test_process_series_have_prometheus_client_names_help_types_and_labels() -> None:
    ours, theirs = list(ProcessCollector().collect()), list(TheirProcess(registry=None).collect())
    assert shape(ours) == shape(theirs)
    assert [f.name for f in ours] == ["process_virtual_memory_bytes", "process_resident_memory_bytes",
                                      "process_start_time_seconds", "process_cpu_seconds", "process_open_fds",
                                      "process_max_fds"]
    mine = {f.name: f.samples[0].value for f in ours}
    other = {f.name: f.samples[0].value for f in theirs}
    assert mine["process_start_time_seconds"] == other["process_start_time_seconds"]
    assert mine["process_max_fds"] == other["process_max_fds"]
    assert abs(mine["process_open_fds"] - other["process_open_fds"]) <= 2  # each listing holds its own fd
    assert 0 < mine["process_resident_memory_bytes"] == pytest.approx(other["process_resident_memory_bytes"], rel=0.1)
    assert mine["process_cpu_seconds"] <= other["process_cpu_seconds"]  # read first; CPU time only grows


def test_process_series_are_absent_without_proc(tmp_path: Path) -> None:
    assert list(ProcessCollector(proc=str(tmp_path)).collect()) == []


def test_python_info_is_what_platform_says() -> None:
    ours, theirs = list(PlatformCollector().collect()), list(TheirPlatform(registry=None).collect())
    assert shape(ours) == shape(theirs)
    assert encode_text(Listed(ours)) == their_text.generate_latest(Listed(theirs))
    assert python_info()["version"] == platform.python_version()
    assert python_info()["implementation"] == platform.python_implementation()
