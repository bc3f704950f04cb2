"""Metrics and probes: a Prometheus collector that reads the plugin's own state at scrape time, and one small HTTP
server for ``/metrics``, ``/healthz`` and ``/readyz``.

Nothing here computes health or sits in a hot path. The collector reads the node state's snapshot, the monitor's
counters, the supervisor's registration record and open streams, and whatever status objects other outlets expose,
only when Prometheus asks. Every label value is bounded: device IDs, states, reason codes, XID numbers, resource
names; never free text.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from plugin.health.monitor import Monitor
from plugin.health.node_state import NodeState
from plugin.health.reasons import State
from plugin.kubelet.supervisor import Supervisor
from plugin.validation import split_host_port

log = logging.getLogger(__name__)

STATES = tuple(s.value for s in State)
_CODE_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
POLL_QUANTILES = (0.5, 0.9, 0.99)


def label_code(code: str) -> str:
    """A reason code as a label value. Codes are a fixed, documented set; anything that does not look like one is
    folded into ``other`` so a bug upstream can never turn a label into free text."""
    return code if len(code) <= 48 and _CODE_RE.match(code) else "other"


class TransitionCounts:
    """Transitions counted by the state they went to and their leading reason code, pulled from the node state's
    sequence-numbered history at scrape time (no listener in the health path). If more transitions happened between
    two scrapes than the history holds, the ones that fell out are counted in ``missed``."""

    def __init__(self, state: NodeState) -> None:
        self._state = state
        self._lock = threading.Lock()
        self._seq = state.snapshot().seq  # transitions restored from the state dir happened in another process
        self.counts: dict[tuple[str, str], int] = {}
        self.missed = 0

    def update(self) -> dict[tuple[str, str], int]:
        with self._lock:
            batch = self._state.transitions_since(self._seq)
            if batch is None:
                now_seq = self._state.snapshot().seq
                self.missed += max(0, now_seq - self._seq)
                self._seq = now_seq
                batch = []
            for t in batch:
                code = label_code(t.reasons[0].code) if t.reasons else "none"
                key = (t.to_state, code)
                self.counts[key] = self.counts.get(key, 0) + 1
                self._seq = t.seq
            return dict(self.counts)


@dataclass
class Sources:
    """Where the numbers come from. Everything but the node state is optional, so each outlet can be off."""

    state: NodeState
    monitor: Monitor | None = None
    backend: object | None = None  # NVML call errors are read by duck typing: ``call_errors``
    supervisor: Supervisor | None = None
    # Status objects of other outlets, read by duck typing at scrape time (each may be None or absent):
    # annotations: ``ReporterStatus``-like counters; correlation: ``CorrelationStats``-like counters.
    annotations: Callable[[], object | None] = field(default=lambda: None)
    correlation: Callable[[], object | None] = field(default=lambda: None)


def _int_attr(obj: object | None, name: str) -> int | None:
    v = getattr(obj, name, None) if obj is not None else None
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    # Nearest-rank on a sorted copy: what an operator means by "p99 of the recent polls".
    idx = min(len(sorted_values) - 1, max(0, round(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[idx]


class PluginCollector(Collector):
    def __init__(self, sources: Sources) -> None:
        self.src = sources
        self.transitions = TransitionCounts(sources.state)

    def describe(self) -> Iterable[Metric]:
        # Describing by collecting would run the whole scrape at registration; an empty description is allowed
        # and keeps registration free.
        return []

    def collect(self) -> Iterable[Metric]:
        yield from self._devices()
        yield from self._transitions()
        yield from self._monitor()
        yield from self._kubelet()
        yield from self._outlets()

    def _devices(self) -> Iterable[Metric]:
        snap = self.src.state.snapshot()
        state = GaugeMetricFamily("gpu_health_device_state",
                                  "1 for the device's current state, 0 for the other three", labels=["device", "state"])
        reason = GaugeMetricFamily("gpu_health_device_reason",
                                   "1 for every reason the device currently carries", labels=["device", "reason"])
        kubelet = GaugeMetricFamily("gpu_health_device_kubelet_healthy",
                                    "1 when the kubelet is told the device is Healthy", labels=["device"])
        for d in snap.devices:
            for s in STATES:
                state.add_metric([d.id, s], 1.0 if d.state.value == s else 0.0)
            for r in d.reasons:
                reason.add_metric([d.id, label_code(r.code)], 1.0)
            kubelet.add_metric([d.id], 1.0 if d.kubelet_health == "Healthy" else 0.0)
        yield state
        yield reason
        yield kubelet
        yield GaugeMetricFamily("gpu_health_devices", "devices the node state holds", value=len(snap.devices))
        yield GaugeMetricFamily("gpu_health_backend_error", "1 while device discovery itself fails",
                                value=1.0 if snap.backend_error else 0.0)

    def _transitions(self) -> Iterable[Metric]:
        counts = self.transitions.update()
        fam = CounterMetricFamily("gpu_health_transitions",
                                  "device state transitions by the state entered and the leading reason code "
                                  "(none when the device recovered)", labels=["to", "reason"])
        for (to, code), n in sorted(counts.items()):
            fam.add_metric([to, code], n)
        yield fam
        yield CounterMetricFamily("gpu_health_transitions_missed",
                                  "transitions that fell out of the bounded history between two scrapes",
                                  value=self.transitions.missed)

    def _monitor(self) -> Iterable[Metric]:
        m = self.src.monitor
        errors = _int_attr(self.src.backend, "call_errors")
        yield CounterMetricFamily("gpu_health_nvml_call_errors", "NVML calls that failed (NotSupported excluded)",
                                  value=errors or 0)
        if m is None:
            return
        xids = CounterMetricFamily("gpu_health_xid_events", "XID events seen, by device and XID number",
                                   labels=["device", "xid"])
        for (uuid, xid), n in sorted(dict(m.xids_seen).items()):
            xids.add_metric([uuid, str(xid)], n)
        yield xids
        yield CounterMetricFamily("gpu_health_driver_events", "driver events of every kind seen",
                                  value=m.events_seen)
        # A summary: cumulative count and sum, and quantiles over the recent window the monitor keeps.
        poll = Metric("gpu_health_poll_duration_seconds", "time one health poll of every device took", "summary")
        recent = sorted(m.poll_durations[-200:])
        for q in POLL_QUANTILES if recent else ():
            poll.add_sample("gpu_health_poll_duration_seconds", {"quantile": str(q)}, _quantile(recent, q))
        poll.add_sample("gpu_health_poll_duration_seconds_count", {}, m.polls)
        poll.add_sample("gpu_health_poll_duration_seconds_sum", {}, m.poll_seconds)
        yield poll
        last = GaugeMetricFamily("gpu_health_loop_last_run_timestamp_seconds",
                                 "when each health loop last went round (unix seconds)", labels=["loop"])
        last.add_metric(["poll"], m.last_poll_at)
        last.add_metric(["events"], m.last_event_loop_at)
        yield last

    def _kubelet(self) -> Iterable[Metric]:
        sup = self.src.supervisor
        if sup is None:
            return
        rec = sup.record
        yield GaugeMetricFamily("gpu_health_registered", "1 while registered with the kubelet",
                                value=1.0 if rec.registered else 0.0)
        yield CounterMetricFamily("gpu_health_registrations", "successful registrations with the kubelet",
                                  value=rec.registrations)
        yield CounterMetricFamily("gpu_health_registration_failures", "failed registration attempts",
                                  value=rec.failures)
        yield GaugeMetricFamily("gpu_health_last_registration_timestamp_seconds",
                                "when the last successful registration happened (unix seconds; 0: never)",
                                value=rec.last_registered_at)
        streams = GaugeMetricFamily("gpu_health_listandwatch_streams", "open ListAndWatch streams",
                                    labels=["resource"])
        by_resource: dict[str, int] = {r.name: 0 for r in sup.resources}
        for server in list(sup.servers):
            name = server.resource.name
            by_resource[name] = by_resource.get(name, 0) + server.servicer.open_streams
        for name, n in sorted(by_resource.items()):
            streams.add_metric([name], n)
        yield streams

    def _outlets(self) -> Iterable[Metric]:
        ann = self.src.annotations()
        if ann is not None:
            # One series per kind of request: an alert on failed writes must not fire for a failed read, nor a
            # failed Event hide among the writes.
            for attr, name, doc in (
                ("writes", "gpu_health_annotation_writes", "node writes (annotation or condition patches) that "
                                                           "succeeded"),
                ("write_failures", "gpu_health_annotation_write_failures",
                 "node writes (annotation or condition patches) that failed"),
                ("reads", "gpu_health_node_reads", "reads of the Node that succeeded"),
                ("read_failures", "gpu_health_node_read_failures", "reads of the Node that failed"),
                ("events_written", "gpu_health_node_events", "Events on the Node posted or updated"),
                ("event_failures", "gpu_health_node_event_failures", "Events on the Node that could not be posted"),
                ("client_failures", "gpu_health_api_client_failures",
                 "attempts to build the Kubernetes client that failed (kubeconfig, service account)"),
            ):
                yield CounterMetricFamily(name, doc, value=_int_attr(ann, attr) or 0)
        corr = self.src.correlation()
        if corr is not None:
            for attr, name, doc in (
                ("lookups", "gpu_health_pod_resources_lookups", "PodResources List calls made"),
                ("lookup_failures", "gpu_health_pod_resources_failures", "PodResources List calls that failed"),
                ("events_posted", "gpu_health_pod_events", "Events posted on pods holding a failing device"),
                ("event_failures", "gpu_health_pod_event_failures", "Events on pods that could not be posted"),
                ("annotations", "gpu_health_pod_annotations", "pods annotated with a failing device"),
                ("annotation_failures", "gpu_health_pod_annotation_failures", "pod annotations that failed"),
            ):
                yield CounterMetricFamily(name, doc, value=_int_attr(corr, attr) or 0)
            ev = CounterMetricFamily("gpu_health_pod_evictions",
                                     "evictions requested for pods on a failing device, by result "
                                     "(evicted, blocked: a PodDisruptionBudget said no, failed)", labels=["result"])
            for result in ("evicted", "blocked", "failed"):
                ev.add_metric([result], _int_attr(corr, f"evictions_{result}") or 0)
            yield ev


def build_registry(sources: Sources, process: bool = True) -> CollectorRegistry:
    """A registry of our own (never the global one): tests build as many as they like side by side."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PluginCollector(sources))
    if process:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
    return registry


# Probes -----------------------------------------------------------------------------------------------------------

class Probes:
    """``/healthz``: the process, its health loops and the supervisor loop are alive. The event loop goes round
    every fraction of a second and the poller once per interval; either falling behind by more than ``stall_s``
    means a stuck thread (a hung driver call, a deadlock), which only a restart fixes, as does a supervisor loop
    that died. ``/readyz``: registered with the kubelet."""

    def __init__(self, monitor: Monitor | None, supervisor: Supervisor | None, stall_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.monitor = monitor
        self.supervisor = supervisor
        self.stall_s = stall_s
        self.clock = clock

    def liveness(self) -> tuple[bool, str]:
        # A dead supervisor loop never re-registers after a kubelet restart: only a pod restart brings it back.
        dead = self.supervisor.failure() if self.supervisor is not None else None
        if dead is not None:
            return False, f"supervisor loop died: {dead}"
        m = self.monitor
        if m is None:
            return True, "ok: no health loops configured"
        now = self.clock()
        problems: list[str] = []
        notes: list[str] = []
        for loop, last, limit in (("poll", m.last_poll_at, m.poll_interval_s + self.stall_s),
                                  ("events", m.last_event_loop_at, self.stall_s)):
            if last <= 0:
                problems.append(f"{loop} loop has not run yet")
                continue
            age = now - last
            if age > limit:
                problems.append(f"{loop} loop stalled: last ran {age:.1f}s ago (limit {limit:.1f}s)")
            else:
                notes.append(f"{loop} loop ran {max(age, 0.0):.1f}s ago")
        if problems:
            return False, "; ".join(problems)
        return True, "ok: " + "; ".join(notes)

    def readiness(self) -> tuple[bool, str]:
        sup = self.supervisor
        if sup is None:
            return False, "not registered: no kubelet supervisor"
        rec = sup.record
        if rec.registered:
            return True, f"ok: registered with the kubelet ({rec.registrations} registrations)"
        why = f": {rec.last_error}" if rec.last_error else ""
        return False, f"not registered with the kubelet{why}"


# HTTP server ------------------------------------------------------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: Prometheus reuses its connection scrape after scrape
    # Headers and body go out as two writes; with Nagle on, the second waits for the client's delayed ACK of the
    # first, which added ~40 ms to every keep-alive request (bench/bench_metrics.py).
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            try:
                body = encoder(self.server.registry)
            except Exception:  # a broken collector must not kill the server: say so and keep serving
                log.exception("metrics collection failed")
                self._send(500, b"metrics collection failed\n", "text/plain; charset=utf-8")
                return
            self._send(200, body, content_type)
        elif path in ("/healthz", "/livez"):
            ok, text = self.server.probes.liveness()
            self._send(200 if ok else 503, (text + "\n").encode(), "text/plain; charset=utf-8")
        elif path == "/readyz":
            ok, text = self.server.probes.readiness()
            self._send(200 if ok else 503, (text + "\n").encode(), "text/plain; charset=utf-8")
        else:
            self._send(404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        # Probes hit this every few seconds; access logs would drown the health transitions.
        log.debug("http %s", format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    registry: CollectorRegistry
    probes: Probes


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """Serves the registry and the probes on ``HOST:PORT`` in its own threads; port 0 picks a free port."""

    def __init__(self, address: str, registry: CollectorRegistry, probes: Probes) -> None:
        host, port = split_host_port(address)
        self.requested = (host, port)
        self.registry = registry
        self.probes = probes
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("metrics server not started")
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        host, port = self.requested
        cls = _Server6 if ":" in host else _Server
        try:
            httpd = cls((host, port), _Handler)
        except OSError as exc:
            # The kubelet path matters more than metrics: keep serving devices. The liveness probe (if one is
            # configured on this port) then fails, which makes the problem visible where it belongs.
            self.error = f"cannot serve metrics on {host or '*'}:{port}: {exc.strerror or exc}"
            log.error("%s; continuing without /metrics, /healthz and /readyz", self.error)
            return
        httpd.registry = self.registry
        httpd.probes = self.probes
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="metrics-http", daemon=True)
        self._thread.start()
        log.info("serving /metrics, /healthz and /readyz on %s:%d", host or "*", self.port)

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(2.0)



def make_metrics_server(app: Any) -> MetricsServer | None:
    """The server the config asks for (None when ``--metrics-address off``), reading the parts of a running
    :class:`plugin.app.App`. Other outlets are looked up at scrape time, so one that is off simply has no series."""
    cfg = app.cfg
    if cfg.metrics_address == "off":
        return None

    def annotations() -> object | None:
        reporter = getattr(app, "kube_reporter", None)
        return reporter.status() if reporter is not None else None

    def correlation() -> object | None:
        correlator = getattr(app, "correlator", None)
        return correlator.stats if correlator is not None else None

    sources = Sources(app.state, app.monitor, app.backend, app.supervisor, annotations, correlation)
    probes = Probes(app.monitor, app.supervisor, cfg.stall_threshold, clock=app.monitor.clock)
    return MetricsServer(cfg.metrics_address, build_registry(sources), probes)
