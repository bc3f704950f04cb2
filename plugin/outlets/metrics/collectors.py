"""The Prometheus collectors: one per source, each reading its source only when Prometheus scrapes, and the
registry that holds the ones whose source exists.

Nothing here computes health or sits in a hot path. Every label value is bounded: device IDs, states, reason
codes, XID numbers, resource names, results, operations and kinds of failure; never free text.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from plugin.health.node_state import Snapshot
from plugin.health.reasons import State
from plugin.outlets.metrics.sources import (
    ClaimCounters,
    CorrelationCounters,
    DeviceApiCounters,
    HealthStreamCount,
    KernelLogCounters,
    MonitorStats,
    NodeHistory,
    NvmlCallCounter,
    NvsentinelCounters,
    PodConditionCounters,
    RegistrationHolder,
    RegistrationSource,
    ReporterCounters,
    SliceWriterCounters,
    WriterCounters,
)
from plugin.serve.exposition import Collector, CounterFamily, Family, GaugeFamily, Registry
from plugin.serve.process import PlatformCollector, ProcessCollector

STATES = tuple(s.value for s in State)
_CODE_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
POLL_QUANTILES = (0.5, 0.9, 0.99)


def label_code(code: str) -> str:
    """A reason code as a label value. Codes are a fixed, documented set; anything that does not look like one is
    folded into ``other`` so a bug upstream can never turn a label into free text."""
    return code if len(code) <= 48 and _CODE_RE.match(code) else "other"


class DeviceCollector:
    """Each device's state, reasons and kubelet health in the node state's current snapshot."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Family]:
        snap = self._snapshot()
        state = GaugeFamily("gpu_health_device_state",
                            "1 for the device's current state, 0 for the other three", labels=["device", "state"])
        reason = GaugeFamily("gpu_health_device_reason",
                             "1 for every reason the device currently carries", labels=["device", "reason"])
        kubelet = GaugeFamily("gpu_health_device_kubelet_healthy",
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
        yield GaugeFamily("gpu_health_devices", "devices the node state holds", value=len(snap.devices))
        yield GaugeFamily("gpu_health_backend_error", "1 while device discovery itself fails",
                          value=1.0 if snap.backend_error else 0.0)


class TransitionCollector:
    """Transitions counted by the state they went to and their leading reason code, pulled from the node state's
    sequence-numbered history at scrape time (no listener in the health path). If more transitions happened between
    two scrapes than the history holds, the ones that fell out are counted in ``missed``."""

    def __init__(self, history: NodeHistory) -> None:
        self._history = history
        self._lock = threading.Lock()  # two scrapes at once must not count one batch twice
        self._seq = history.snapshot().seq  # transitions restored from the state dir happened in another process
        self._counts: dict[tuple[str, str], int] = {}
        self._missed = 0

    def update(self) -> tuple[dict[tuple[str, str], int], int]:
        """Count what happened since the last call; return the counts and the missed total."""
        with self._lock:
            batch = self._history.transitions_since(self._seq)
            if batch is None:
                now_seq = self._history.snapshot().seq
                self._missed += max(0, now_seq - self._seq)
                self._seq = now_seq
                batch = []
            for t in batch:
                self._seq = t.seq
                if t.from_state == t.to_state:
                    continue  # a clearance that kept the state entered nothing
                code = label_code(t.reasons[0].code) if t.reasons else "none"
                key = (t.to_state, code)
                self._counts[key] = self._counts.get(key, 0) + 1
            return dict(self._counts), self._missed

    def collect(self) -> Iterable[Family]:
        counts, missed = self.update()
        fam = CounterFamily("gpu_health_transitions",
                            "device state transitions by the state entered and the leading reason code "
                            "(none when the device recovered)", labels=["to", "reason"])
        for (to, code), n in sorted(counts.items()):
            fam.add_metric([to, code], n)
        yield fam
        yield CounterFamily("gpu_health_transitions_missed",
                            "transitions that fell out of the bounded history between two scrapes",
                            value=missed)


class NvmlErrorCollector:
    """Failed NVML calls. Exported as 0 for a backend without NVML (simulated, unavailable), so a dashboard or an
    alert on the rate reads a flat line there rather than no data."""

    def __init__(self, backend: NvmlCallCounter | None) -> None:
        self._backend = backend

    def collect(self) -> Iterable[Family]:
        errors = self._backend.call_errors if self._backend is not None else 0
        yield CounterFamily("gpu_health_nvml_call_errors", "NVML calls that failed (NotSupported excluded)",
                            value=errors)
        skipped = GaugeFamily("gpu_health_nvml_check_unavailable",
                              "1 for each health check skipped on a GPU because its NVML call crashed the plugin "
                              "before (same GPU model and driver)", labels=["device", "check"])
        for uuid, checks in sorted((self._backend.unavailable() if self._backend is not None else {}).items()):
            for check in sorted(checks):
                skipped.add_metric([uuid, check], 1)
        yield skipped


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    # Nearest-rank on a sorted copy: what an operator means by "p99 of the recent polls".
    idx = min(len(sorted_values) - 1, max(0, round(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[idx]


class MonitorCollector:
    """The health monitor's XID and driver event counters, its poll durations and when its loops last ran."""

    def __init__(self, monitor: MonitorStats) -> None:
        self._monitor = monitor

    def collect(self) -> Iterable[Family]:
        m = self._monitor
        xids = CounterFamily("gpu_health_xid_events", "XID events seen, by device and XID number",
                             labels=["device", "xid"])
        for (uuid, xid), n in sorted(dict(m.xids_seen).items()):
            xids.add_metric([uuid, str(xid)], n)
        yield xids
        yield CounterFamily("gpu_health_driver_events", "driver events of every kind seen",
                            value=m.events_seen)
        yield GaugeFamily("gpu_health_gpus_missing",
                          "GPUs missing from NVML: on the PCI bus but not listed, or short of the expected count "
                          "(the node reason gpu-missing; 0 while every GPU is there)", value=m.gpus_missing)
        # A summary: cumulative count and sum, and quantiles over the recent window the monitor keeps.
        poll = Family("gpu_health_poll_duration_seconds", "time one health poll of every device took", "summary")
        recent = sorted(m.poll_durations[-200:])
        for q in POLL_QUANTILES if recent else ():
            poll.add_sample("gpu_health_poll_duration_seconds", {"quantile": str(q)}, _quantile(recent, q))
        poll.add_sample("gpu_health_poll_duration_seconds_count", {}, m.polls)
        poll.add_sample("gpu_health_poll_duration_seconds_sum", {}, m.poll_seconds)
        yield poll
        last = GaugeFamily("gpu_health_loop_last_run_timestamp_seconds",
                           "when each health loop last went round (unix seconds)", labels=["loop"])
        last.add_metric(["poll"], m.last_poll_at)
        last.add_metric(["events"], m.last_event_loop_at)
        yield last


class RegistrationCollector:
    """The kubelet registration record: the device-plugin supervisor's, or DRA mode's plugin registration."""

    def __init__(self, holder: RegistrationHolder) -> None:
        self._holder = holder

    def collect(self) -> Iterable[Family]:
        rec = self._holder.record
        yield GaugeFamily("gpu_health_registered", "1 while registered with the kubelet",
                          value=1.0 if rec.registered else 0.0)
        yield CounterFamily("gpu_health_registrations", "successful registrations with the kubelet",
                            value=rec.registrations)
        yield CounterFamily("gpu_health_registration_failures", "failed registration attempts",
                            value=rec.failures)
        yield GaugeFamily("gpu_health_last_registration_timestamp_seconds",
                          "when the last successful registration happened (unix seconds; 0: never)",
                          value=rec.last_registered_at)


class ListAndWatchCollector:
    """The open ListAndWatch streams of each resource the supervisor serves (0 while unserved)."""

    def __init__(self, supervisor: RegistrationSource) -> None:
        self._supervisor = supervisor

    def collect(self) -> Iterable[Family]:
        sup = self._supervisor
        streams = GaugeFamily("gpu_health_listandwatch_streams", "open ListAndWatch streams",
                              labels=["resource"])
        by_resource: dict[str, int] = {r.name: 0 for r in sup.resources}
        for server in list(sup.servers):  # a copy: the supervisor replaces its servers while we read
            name = server.resource.name
            by_resource[name] = by_resource.get(name, 0) + server.servicer.open_streams
        for name, n in sorted(by_resource.items()):
            streams.add_metric([name], n)
        yield streams


def _counters(*rows: tuple[str, str, int]) -> Iterator[Family]:
    """Unlabelled counters from (name, help, value) rows."""
    for name, doc, value in rows:
        yield CounterFamily(name, doc, value=value)


class ReportingCollector:
    """The cluster reporter's requests, one series per kind: an alert on failed writes must not fire for a failed
    read, nor a failed Event hide among the writes."""

    def __init__(self, status: Callable[[], ReporterCounters]) -> None:
        self._status = status

    def collect(self) -> Iterable[Family]:
        s = self._status()
        yield from _counters(
            ("gpu_health_annotation_writes", "node writes (annotation or condition patches) that succeeded",
             s.writes),
            ("gpu_health_annotation_write_failures", "node writes (annotation or condition patches) that failed",
             s.write_failures),
            ("gpu_health_node_reads", "reads of the Node that succeeded", s.reads),
            ("gpu_health_node_read_failures", "reads of the Node that failed", s.read_failures),
            ("gpu_health_node_events", "Events on the Node posted or updated", s.events_written),
            ("gpu_health_node_event_failures", "Events on the Node that could not be posted", s.event_failures),
            ("gpu_health_api_client_failures",
             "attempts to build the Kubernetes client that failed (kubeconfig, service account)", s.client_failures),
        )


class CorrelationCollector:
    """The pod correlator's PodResources lookups and what it told or did to the pods on a failing device."""

    def __init__(self, stats: Callable[[], CorrelationCounters]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Family]:
        c = self._stats()
        yield from _counters(
            ("gpu_health_pod_resources_lookups", "PodResources List calls made", c.lookups),
            ("gpu_health_pod_resources_failures", "PodResources List calls that failed", c.lookup_failures),
            ("gpu_health_pod_events", "Events posted on pods holding a failing device", c.events_posted),
            ("gpu_health_pod_event_failures", "Events on pods that could not be posted", c.event_failures),
            ("gpu_health_pod_annotations", "pods annotated with a failing device", c.annotations),
            ("gpu_health_pod_annotation_failures", "pod annotations that failed", c.annotation_failures),
        )
        ev = CounterFamily("gpu_health_pod_evictions",
                           "evictions requested for pods on a failing device, by result "
                           "(evicted, blocked: a PodDisruptionBudget said no, failed)", labels=["result"])
        for result, n in (("evicted", c.evictions_evicted), ("blocked", c.evictions_blocked),
                          ("failed", c.evictions_failed)):
            ev.add_metric([result], n)
        yield ev


def _failures_by_kind(name: str, doc: str, s: WriterCounters) -> CounterFamily:
    """A writer's failures labelled by kind, every kind it can count present at 0 before its first failure."""
    failures = CounterFamily(name, doc, labels=["kind"])
    by_kind = {label_code(k): 0 for k in s.failure_kinds}
    for kind, n in s.failures_by_kind.items():
        by_kind[label_code(kind)] = by_kind.get(label_code(kind), 0) + n
    for kind, n in by_kind.items():
        failures.add_metric([kind], n)
    return failures


class SliceWriterCollector:
    """DRA mode's ResourceSlice writer, as the reporter's requests are exported: successes, failures by kind (each
    kind at 0 before its first), conflicts, and whether the last attempt failed and when one last did."""

    def __init__(self, status: Callable[[], SliceWriterCounters]) -> None:
        self._status = status

    def collect(self) -> Iterable[Family]:
        s = self._status()
        yield from _counters(
            ("gpu_health_dra_slice_writes", "creates, updates and deletes of the node's ResourceSlice that succeeded",
             s.writes),
            ("gpu_health_dra_slice_reads", "reads of the node's ResourceSlice (and its Node) that succeeded",
             s.reads),
            ("gpu_health_dra_slice_conflicts",
             "ResourceSlice writes refused because the slice had changed (409), answered by a re-read", s.conflicts),
        )
        yield _failures_by_kind("gpu_health_dra_slice_failures",
                                "failed ResourceSlice requests by kind (client: building the API client, read, "
                                "write, not-served: the API server does not serve resource.k8s.io/v1)", s)
        yield GaugeFamily("gpu_health_dra_slice_ok", "0 while the ResourceSlice writer's last attempt failed",
                          value=1.0 if s.ok else 0.0)
        yield GaugeFamily("gpu_health_dra_slice_last_error_timestamp_seconds",
                          "when a ResourceSlice request last failed (unix seconds; 0: never)",
                          value=s.last_error_at or 0.0)
        yield GaugeFamily("gpu_health_dra_slice_taints_published",
                          "1 while device taints are published in the ResourceSlice, 0 once the API server was "
                          "seen dropping them (DRADeviceTaints off)", value=1.0 if s.taints_published else 0.0)
        yield GaugeFamily("gpu_health_dra_slice_sharing_published",
                          "1 while shared GPUs are published for several claims at once, 0 once the API server was "
                          "seen dropping allowMultipleAllocations (DRAConsumableCapacity off)",
                          value=1.0 if s.sharing_published else 0.0)


class PodConditionCollector:
    """DRA mode's pod-condition writer (health in the status of pods served with no claim), exported as the slice
    writer is."""

    def __init__(self, status: Callable[[], PodConditionCounters]) -> None:
        self._status = status

    def collect(self) -> Iterable[Family]:
        s = self._status()
        yield from _counters(
            ("gpu_health_dra_pod_condition_writes",
             "pod status patches that set the devices' health condition of a pod served with no claim", s.writes),
            ("gpu_health_dra_pod_condition_skipped",
             "pods left alone because they were gone (404) or made again under their name (422)", s.skipped),
        )
        yield _failures_by_kind("gpu_health_dra_pod_condition_failures",
                                "failed pod-condition work by kind (client: building the API client, write: a pod "
                                "status patch, state-file: saving what was written)", s)
        yield GaugeFamily("gpu_health_dra_pod_condition_pods",
                          "pods whose extended-resource claim is prepared on the node: each gets the condition",
                          value=float(s.pods))
        yield GaugeFamily("gpu_health_dra_pod_condition_ok", "0 while the pod-condition writer's last attempt failed",
                          value=1.0 if s.ok else 0.0)


class ClaimCollector:
    """DRA mode's driver: the claims prepared on the node, and each claim's prepare and unprepare by result."""

    def __init__(self, driver: ClaimCounters) -> None:
        self._driver = driver

    def collect(self) -> Iterable[Family]:
        yield GaugeFamily("gpu_health_dra_prepared_claims", "ResourceClaims prepared on this node (the checkpoint)",
                          value=self._driver.prepared_claims)
        results = CounterFamily("gpu_health_dra_claim_results",
                                "claims the kubelet asked to prepare or unprepare, by operation and result (ok, "
                                "or the kind of error the claim was answered with)", labels=["operation", "result"])
        for (operation, result), n in self._driver.result_counts().items():
            results.add_metric([label_code(operation), label_code(result)], n)
        yield results


class HealthStreamCollector:
    """DRA mode's health stream: how many kubelet watches are open."""

    def __init__(self, server: HealthStreamCount) -> None:
        self._server = server

    def collect(self) -> Iterable[Family]:
        yield GaugeFamily("gpu_health_dra_health_streams", "open DRAResourceHealth NodeWatchResources streams",
                          value=self._server.health_streams)


class NvsentinelCollector:
    """The health events sent to NVSentinel's platform connector (only with --nvsentinel-socket)."""

    def __init__(self, status: Callable[[], NvsentinelCounters]) -> None:
        self._status = status

    def collect(self) -> Iterable[Family]:
        s = self._status()
        yield CounterFamily("gpu_health_nvsentinel_events_sent",
                            "health events NVSentinel's platform connector accepted", value=s.events_sent)
        failures = CounterFamily("gpu_health_nvsentinel_send_failures",
                                 "sends of health events that failed, by reason (no-socket, not-a-socket, "
                                 "unavailable, deadline-exceeded, unimplemented, rejected)", labels=["reason"])
        for reason, n in s.failures_by_reason.items():
            failures.add_metric([label_code(reason)], n)
        yield failures
        yield GaugeFamily("gpu_health_nvsentinel_connected",
                          "1 while NVSentinel's socket is there and the last send (if any) succeeded",
                          value=1.0 if s.connected else 0.0)
        yield GaugeFamily("gpu_health_nvsentinel_pending_checks",
                          "checks whose current state NVSentinel does not have yet", value=s.pending_checks)
        yield CounterFamily("gpu_health_nvsentinel_events_refused",
                            "health events NVSentinel refused one by one (each sent again once its check changes)",
                            value=s.events_refused)
class DeviceApiCollector:
    """NVSentinel's device API: the provider's writes, each role's connection, the external reasons held and the
    malformed conditions refused. Every label value is from a closed set, each present from the start."""

    def __init__(self, stats: DeviceApiCounters) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Family]:
        s = self._stats
        writes = CounterFamily("gpu_health_device_api_writes",
                               "device API writes by operation (create, update-status) and result (ok, exists, "
                               "conflict: ABORTED and read again, not-found, unimplemented, error)",
                               labels=["operation", "result"])
        for (operation, result), n in sorted(s.writes().items()):
            writes.add_metric([label_code(operation), label_code(result)], n)
        yield writes
        connected = GaugeFamily("gpu_health_device_api_connected",
                                "1 while the role's last call to the device API (provider) or its watch (consumer) "
                                "succeeded", labels=["role"])
        for role, up in sorted(s.connected().items()):
            connected.add_metric([role], 1.0 if up else 0.0)
        yield connected
        yield GaugeFamily("gpu_health_device_api_external_reasons",
                          "reasons other providers' conditions on the device API give our GPUs now",
                          value=s.external_reasons)
        rejected = CounterFamily("gpu_health_device_api_rejected_conditions",
                                 "conditions (or GPUs, or watch events) from the device API skipped as malformed, by "
                                 "kind", labels=["kind"])
        for kind, n in sorted(s.rejections().items()):
            rejected.add_metric([label_code(kind)], n)
        yield rejected


class KernelLogCollector:
    """The kernel log as a source of driver events (only with --kernel-log)."""

    def __init__(self, stats: KernelLogCounters) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Family]:
        s = self._stats
        yield GaugeFamily("gpu_health_kernel_log_readable",
                          "1 while the kernel log (--kernel-log) is open and being read",
                          value=1.0 if s.readable else 0.0)
        yield CounterFamily("gpu_health_kernel_log_records", "kernel log records read (after the saved cursor)",
                            value=s.records)
        lines = CounterFamily("gpu_health_kernel_log_driver_lines",
                              "NVIDIA driver lines read from the kernel log, by kind (xid, fell-off-bus, init-failed, "
                              "sxid)", labels=["kind"])
        for kind, n in sorted(dict(s.driver_lines).items()):
            lines.add_metric([label_code(kind)], n)
        yield lines
        unmatched = CounterFamily("gpu_health_kernel_log_unmatched_lines",
                                  "driver lines naming a PCI address no GPU NVML sees has (every sxid line: an "
                                  "NVSwitch is no GPU), by kind", labels=["kind"])
        for kind, n in sorted(dict(s.unmatched).items()):
            unmatched.add_metric([label_code(kind)], n)
        yield unmatched
        yield CounterFamily("gpu_health_kernel_log_malformed_records",
                            "kernel log lines skipped as not a record (or a record cut short)", value=s.malformed)
        yield CounterFamily("gpu_health_kernel_log_gaps",
                            "times records were gone from the ring before they were read (driver events may have been "
                            "missed)", value=s.lost)


@dataclass(frozen=True)
class Sources:
    """Where the numbers come from. Everything but the node state is optional, so each outlet can be off; a
    source that is None gets no collector, and so no series (NVML call errors excepted: see
    :class:`NvmlErrorCollector`). The reporter's status, the correlator's counters and the slice writer's status are
    read through a call at every scrape."""

    state: NodeHistory
    monitor: MonitorStats | None = None
    backend: NvmlCallCounter | None = None  # the NVML backend; None for one without NVML
    supervisor: RegistrationSource | None = None
    annotations: Callable[[], ReporterCounters] | None = None  # the cluster reporter's status
    correlation: Callable[[], CorrelationCounters] | None = None
    # DRA mode's parts, all None in device-plugin mode, whose series then stay exactly what they were.
    registration: RegistrationHolder | None = None  # DRA mode's registration record (the supervisor has its own)
    slice_writer: Callable[[], SliceWriterCounters] | None = None  # the ResourceSlice writer's status
    pod_conditions: Callable[[], PodConditionCounters] | None = None  # the pod-condition writer's status
    claims: ClaimCounters | None = None  # the DRA driver
    health_streams: HealthStreamCount | None = None  # the DRA server
    nvsentinel: Callable[[], NvsentinelCounters] | None = None  # the NVSentinel sender's status
    device_api: DeviceApiCounters | None = None  # NVSentinel's device API, when either role is on
    kernel_log: KernelLogCounters | None = None  # the kernel log reader's counters, with --kernel-log


def collectors(sources: Sources) -> list[Collector]:
    """One collector per source that exists, in the order their series have always been exposed."""
    out: list[Collector] = [DeviceCollector(sources.state.snapshot), TransitionCollector(sources.state),
                            NvmlErrorCollector(sources.backend)]
    if sources.monitor is not None:
        out.append(MonitorCollector(sources.monitor))
    if sources.supervisor is not None:
        out += [RegistrationCollector(sources.supervisor), ListAndWatchCollector(sources.supervisor)]
    if sources.registration is not None:
        out.append(RegistrationCollector(sources.registration))
    if sources.slice_writer is not None:
        out.append(SliceWriterCollector(sources.slice_writer))
    if sources.pod_conditions is not None:
        out.append(PodConditionCollector(sources.pod_conditions))
    if sources.claims is not None:
        out.append(ClaimCollector(sources.claims))
    if sources.health_streams is not None:
        out.append(HealthStreamCollector(sources.health_streams))
    if sources.annotations is not None:
        out.append(ReportingCollector(sources.annotations))
    if sources.correlation is not None:
        out.append(CorrelationCollector(sources.correlation))
    if sources.nvsentinel is not None:
        out.append(NvsentinelCollector(sources.nvsentinel))
    if sources.device_api is not None:
        out.append(DeviceApiCollector(sources.device_api))
    if sources.kernel_log is not None:
        out.append(KernelLogCollector(sources.kernel_log))
    return out


def build_registry(sources: Sources, process: bool = True) -> Registry:
    """A registry of our own (there is no global one): tests build as many as they like side by side.
    Registration reads no source; ``process`` adds the process's own series (memory, CPU, file descriptors)."""
    registry = Registry()
    for collector in collectors(sources):
        registry.register(collector)
    if process:
        registry.register(ProcessCollector())
        registry.register(PlatformCollector())
    return registry
