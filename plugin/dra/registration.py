"""The kubelet's plugin registration (pluginregistration.Registration) for the DRA driver.

The kubelet's plugin watcher finds our socket in its plugins_registry dir, asks GetInfo who we are and where our
services are, and tells us with NotifyRegistrationStatus whether it took us. Nothing is called by us: the servicer
answers and records what the kubelet said, for probes and metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from api.pluginregistration.v1 import api_pb2, api_pb2_grpc
from plugin.dra.driver import SERVICE_NAMES
from plugin.dra.health import HEALTH_SERVICE_NAMES

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"

# DRA lists the gRPC services a plugin serves as its "versions": the kubelet picks the newest DRAPlugin and the
# newest DRAResourceHealth it knows from this list.
SUPPORTED_VERSIONS: tuple[str, ...] = (*SERVICE_NAMES, *HEALTH_SERVICE_NAMES)


@dataclass(frozen=True)
class RegistrationCounts:
    registered: bool  # the kubelet's last word on this registration socket was "registered"
    registrations: int  # successful registrations seen since start (one per kubelet start or socket re-creation)
    failures: int  # registrations the kubelet refused
    info_calls: int
    last_error: str  # the kubelet's reason of the last refusal; empty once registered again
    last_registered_at: float  # unix seconds; 0 before the first


class RegistrationServicer(api_pb2_grpc.RegistrationServicer):
    def __init__(self, driver_name: str, endpoint: str, versions: Sequence[str] = SUPPORTED_VERSIONS,
                 on_registered: Callable[[], None] | None = None) -> None:
        # Called after each registration: a kubelet that starts deletes the node's ResourceSlices, so the slice
        # writer must look again whenever a kubelet takes us.
        self.on_registered = on_registered
        self.info = api_pb2.PluginInfo(type=PLUGIN_TYPE, name=driver_name, endpoint=endpoint,
                                       supported_versions=list(versions))
        self._lock = threading.Lock()
        self._registered = False
        self._registrations = 0
        self._failures = 0
        self._info_calls = 0
        self._last_error = ""
        self._last_registered_at = 0.0

    def GetInfo(self, request: api_pb2.InfoRequest, context: grpc.ServicerContext) -> api_pb2.PluginInfo:
        with self._lock:
            self._info_calls += 1
        return self.info

    def NotifyRegistrationStatus(self, request: api_pb2.RegistrationStatus,
                                 context: grpc.ServicerContext) -> api_pb2.RegistrationStatusResponse:
        with self._lock:
            self._registered = request.plugin_registered
            if request.plugin_registered:
                self._registrations += 1
                self._last_error = ""
                self._last_registered_at = time.time()
            else:
                self._failures += 1
                self._last_error = request.error or "(no reason given)"
        if request.plugin_registered:
            log.info("registered with the kubelet as DRA driver %s (endpoint %s)", self.info.name,
                     self.info.endpoint)
            if self.on_registered is not None:
                self.on_registered()
        else:
            log.warning("the kubelet refused the registration of DRA driver %s: %s", self.info.name,
                        request.error or "(no reason given)")
        return api_pb2.RegistrationStatusResponse()

    def forget(self) -> None:
        """Our registration socket was re-created: the kubelet dropped the old registration with it."""
        with self._lock:
            self._registered = False

    def counts(self) -> RegistrationCounts:
        with self._lock:
            return RegistrationCounts(self._registered, self._registrations, self._failures, self._info_calls,
                                      self._last_error, self._last_registered_at)
