"""DRA mode's kubelet side as one piece the App starts in place of the device-plugin supervisor: the driver
(prepare/unprepare), its sockets (DRA, health, registration), the node's ResourceSlice writer and the pod-condition
writer (health in the status of pods served with no claim), wired together.

It also answers the probes as the supervisor does (``record``, ``failure``), so /readyz means "the kubelet took
our registration" in both modes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from plugin.dra.driver import Driver
from plugin.dra.health import HealthSettings
from plugin.dra.podstatus import PodConditionSettings, PodConditionWriter
from plugin.dra.server import DraServer
from plugin.dra.slices import DRIVER, SliceSettings
from plugin.dra.slicewriter import SliceWriter
from plugin.health.node_state import NodeState
from plugin.kube.protocols import ClaimApi, PodStatusApi, SliceApi
from plugin.sharing.config import SharingConfig


@dataclass(frozen=True)
class DraSettings:
    node_name: str
    plugin_dir: Path
    registry_dir: Path
    cdi_dir: Path
    state_dir: Path
    dev_dir: str
    allow_unhealthy: bool = False
    degraded_as: str = "Healthy"
    unhealthy_effect: str = "NoSchedule"
    degraded_taint: bool = True
    taint_prefix: str = "gpu-health.io"
    mig_strategy: str = "none"  # --mig-strategy: none or mixed (the config refuses single in DRA mode)
    # The sharing section: which devices several claims may hold at once.
    sharing: SharingConfig = field(default_factory=SharingConfig)
    resource_name: str = "nvidia.com/gpu"  # what the sharing entries call a whole GPU
    debounce_s: float = 1.0
    min_interval_s: float = 10.0
    resync_s: float = 600.0
    backoff_max_s: float = 300.0


@dataclass(frozen=True)
class _Record:
    """The registration record as the probes and the registration collector read it."""

    registered: bool
    registrations: int
    failures: int
    last_registered_at: float
    last_error: str


class DraMode:
    def __init__(self, settings: DraSettings, state: NodeState, claims: ClaimApi,
                 slices: Callable[[], SliceApi], clock: Callable[[], float],
                 pods: Callable[[], PodStatusApi] | None = None) -> None:
        self.settings = settings
        self.state = state
        # Its own connection: the kubelet's prepare calls must not queue behind the slice writer's requests.
        self._claims = claims
        self.slice_writer = SliceWriter(
            state, SliceSettings(node_name=settings.node_name, taint_prefix=settings.taint_prefix,
                                 unhealthy_effect=settings.unhealthy_effect,
                                 degraded_taint=settings.degraded_taint, mig_strategy=settings.mig_strategy,
                                 sharing=settings.sharing, resource_name=settings.resource_name),
            slices, debounce_s=settings.debounce_s, min_interval_s=settings.min_interval_s,
            resync_s=settings.resync_s, backoff_max_s=settings.backoff_max_s, clock=clock)
        # Pods that asked for nvidia.com/gpu with no claim get their devices' health as a condition (the kubelet
        # shows it only for claims a container names). Without a client for it (tests of other parts), none.
        self.pod_conditions: PodConditionWriter | None = None
        if pods is not None:
            self.pod_conditions = PodConditionWriter(
                state, PodConditionSettings(taint_prefix=settings.taint_prefix, degraded_as=settings.degraded_as,
                                            mig_strategy=settings.mig_strategy),
                lambda: self.driver.prepared(), pods, settings.state_dir, debounce_s=settings.debounce_s,
                min_interval_s=settings.min_interval_s, backoff_max_s=settings.backoff_max_s, clock=clock)
        conditions = self.pod_conditions
        # Prepare reads the writer's settings as they are now: the same rule the slice is built from, taints off
        # included once the writer finds the cluster drops them.
        self.driver = Driver(state, self._claims, settings.node_name, settings.cdi_dir, settings.state_dir,
                             settings.dev_dir, allow_unhealthy=settings.allow_unhealthy,
                             slice_settings=lambda: self.slice_writer.settings,
                             claims_changed=conditions.claims_changed if conditions is not None else lambda: None)
        self.server = DraServer(settings.plugin_dir, settings.registry_dir, state, self.driver,
                                HealthSettings(pool=settings.node_name, degraded_as=settings.degraded_as,
                                               mig_strategy=settings.mig_strategy),
                                driver_name=DRIVER, on_registered=self.slice_writer.resync_now)

    def start(self) -> None:
        self.server.start()
        self.slice_writer.start()
        if self.pod_conditions is not None:
            self.pod_conditions.start()

    def shutdown(self, timeout_s: float = 1.0) -> None:
        # The slice stays: a restarting plugin must not make its devices vanish; the kubelet removes it 30 s after
        # the last plugin of the driver went, which is what an uninstall needs.
        self.slice_writer.stop(timeout=min(timeout_s, 0.5))
        if self.pod_conditions is not None:
            self.pod_conditions.stop(timeout=min(timeout_s, 0.5))
        self.server.stop(grace_s=min(timeout_s, 0.5))
        self._claims.close()

    # What the probes and metrics read (plugin/outlets/metrics/sources.py: SupervisorLoop, RegistrationHolder) ---

    @property
    def record(self) -> _Record:
        c = self.server.registration.counts()
        status = self.server.status()
        return _Record(registered=status.registered, registrations=c.registrations, failures=c.failures,
                       last_registered_at=c.last_registered_at, last_error=status.last_error)

    def failure(self) -> str | None:
        # No loop of its own that could die: the sockets' audit and the slice writer recover from their errors.
        return None
