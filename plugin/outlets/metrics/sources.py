"""What the metrics outlet reads: one narrow protocol per source, each only what a collector or a probe uses.

The plugin's real objects (the node state, the monitor, the NVML backend, the supervisor, the reporter's status,
the correlator's counters, and in DRA mode the slice writer's status, the driver and its server) satisfy these
structurally; ``plugin.app`` passes them, so the type checker proves it
there. Everything is read-only: nothing here may change what it reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from plugin.health.node_state import Snapshot, Transition


class NodeHistory(Protocol):
    """The node state's snapshot and its sequence-numbered history of transitions."""

    def snapshot(self) -> Snapshot: ...

    def transitions_since(self, seq: int) -> list[Transition] | None: ...


class LoopTimes(Protocol):
    """When each health loop last went round (the monitor's clock; 0: never)."""

    @property
    def last_poll_at(self) -> float: ...

    @property
    def last_event_loop_at(self) -> float: ...


class MonitorStats(LoopTimes, Protocol):
    """The health monitor's cumulative counters and its window of recent poll durations."""

    @property
    def polls(self) -> int: ...

    @property
    def poll_seconds(self) -> float: ...

    @property
    def poll_durations(self) -> Sequence[float]: ...

    @property
    def events_seen(self) -> int: ...

    @property
    def xids_seen(self) -> Mapping[tuple[str, int], int]: ...

    @property
    def gpus_missing(self) -> int: ...


class KernelLogCounters(Protocol):
    """The kernel log reader's counters (``--kernel-log``), each dict keyed by a closed set of line kinds."""

    @property
    def readable(self) -> bool: ...

    @property
    def records(self) -> int: ...

    @property
    def driver_lines(self) -> Mapping[str, int]: ...

    @property
    def unmatched(self) -> Mapping[str, int]: ...

    @property
    def malformed(self) -> int: ...

    @property
    def lost(self) -> int: ...


class HealthLoops(LoopTimes, Protocol):
    """What liveness compares with the clock: the loops' last rounds and the poll cadence."""

    @property
    def poll_interval_s(self) -> float: ...


class NvmlCallCounter(Protocol):
    @property
    def call_errors(self) -> int: ...

    def unavailable(self) -> dict[str, dict[str, str]]:
        """Per GPU, the checks skipped because they crashed the library before, and why."""
        ...


class RegistrationRecordView(Protocol):
    """The supervisor's record of its registrations with the kubelet."""

    @property
    def registered(self) -> bool: ...

    @property
    def registrations(self) -> int: ...

    @property
    def failures(self) -> int: ...

    @property
    def last_registered_at(self) -> float: ...

    @property
    def last_error(self) -> str: ...


class Named(Protocol):
    @property
    def name(self) -> str: ...


class StreamCount(Protocol):
    @property
    def open_streams(self) -> int: ...


class ServedResource(Protocol):
    """One device plugin server: the resource it serves and its servicer's open ListAndWatch streams."""

    @property
    def resource(self) -> Named: ...

    @property
    def servicer(self) -> StreamCount: ...


class RegistrationHolder(Protocol):
    """Whatever keeps the kubelet registration record: the device-plugin supervisor, or DRA mode."""

    @property
    def record(self) -> RegistrationRecordView: ...


class RegistrationSource(RegistrationHolder, Protocol):
    """The supervisor as the registration collectors see it: the record, the resources and the servers now."""

    @property
    def resources(self) -> Sequence[Named]: ...

    @property
    def servers(self) -> Sequence[ServedResource]: ...


class SupervisorLoop(RegistrationHolder, Protocol):
    """The supervisor as the probes see it: whether its loop died, and the registration record."""

    def failure(self) -> str | None: ...


class ReporterCounters(Protocol):
    """The cluster reporter's request counters, one per kind of request."""

    @property
    def writes(self) -> int: ...

    @property
    def write_failures(self) -> int: ...

    @property
    def reads(self) -> int: ...

    @property
    def read_failures(self) -> int: ...

    @property
    def events_written(self) -> int: ...

    @property
    def event_failures(self) -> int: ...

    @property
    def client_failures(self) -> int: ...


class CorrelationCounters(Protocol):
    """The pod correlator's counters: PodResources lookups, and what it told or did to pods."""

    @property
    def lookups(self) -> int: ...

    @property
    def lookup_failures(self) -> int: ...

    @property
    def events_posted(self) -> int: ...

    @property
    def event_failures(self) -> int: ...

    @property
    def annotations(self) -> int: ...

    @property
    def annotation_failures(self) -> int: ...

    @property
    def evictions_evicted(self) -> int: ...

    @property
    def evictions_blocked(self) -> int: ...

    @property
    def evictions_failed(self) -> int: ...


# DRA mode ---------------------------------------------------------------------------------------------------------

class WriterCounters(Protocol):
    """What every paced writer's status shows (plugin/kube/writer.py): its writes, whether its last attempt failed
    and when one last did, and its failures by kind, every kind it can count named."""

    @property
    def ok(self) -> bool: ...

    @property
    def last_error_at(self) -> float | None: ...

    @property
    def writes(self) -> int: ...

    @property
    def failures_by_kind(self) -> Mapping[str, int]: ...

    @property
    def failure_kinds(self) -> Sequence[str]: ...


class SliceWriterCounters(WriterCounters, Protocol):
    """The ResourceSlice writer's status (DRA mode): also its reads, conflicts, and what the API server dropped."""

    @property
    def reads(self) -> int: ...

    @property
    def conflicts(self) -> int: ...

    @property
    def taints_published(self) -> bool: ...

    @property
    def sharing_published(self) -> bool: ...


class PodConditionCounters(WriterCounters, Protocol):
    """The pod-condition writer's status (DRA mode): also the pods it looks after and those it left alone."""

    @property
    def pods(self) -> int: ...

    @property
    def skipped(self) -> int: ...


class ClaimCounters(Protocol):
    """The DRA driver: the claims prepared now, and every claim's prepare or unprepare by (operation, result),
    each possible pair present from the start."""

    @property
    def prepared_claims(self) -> int: ...

    def result_counts(self) -> Mapping[tuple[str, str], int]: ...


class HealthStreamCount(Protocol):
    """The DRA server: its open DRAResourceHealth streams."""

    @property
    def health_streams(self) -> int: ...


# NVSentinel -------------------------------------------------------------------------------------------------------

class NvsentinelCounters(Protocol):
    """The NVSentinel health-event sender's status: events sent, failed sends by reason (each reason of the closed
    set present from the start), whether NVSentinel is reachable, and how many checks it does not have yet."""

    @property
    def events_sent(self) -> int: ...

    @property
    def failures_by_reason(self) -> Mapping[str, int]: ...

    @property
    def connected(self) -> bool: ...

    @property
    def pending_checks(self) -> int: ...

    @property
    def events_refused(self) -> int: ...
# NVSentinel's device API --------------------------------------------------------------------------------------------

class DeviceApiCounters(Protocol):
    """The device API's provider and consumer: writes by (operation, result), whether each role is connected, the
    reasons other providers give our GPUs now, and the conditions refused as malformed, by kind."""

    def writes(self) -> Mapping[tuple[str, str], int]: ...

    def connected(self) -> Mapping[str, bool]: ...

    @property
    def external_reasons(self) -> int: ...

    def rejections(self) -> Mapping[str, int]: ...
