"""``gpu-health-controller``: wire the config, the API client, the elector, the watcher, the reconciler and the
metrics together, and run until SIGTERM or SIGINT (exit 0, the Lease handed back)."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from plugin import logs
from plugin.controller.config import ControllerConfig, parse_or_exit
from plugin.controller.leader import LeaderElector
from plugin.controller.metrics import ControllerCollector, ControllerProbes
from plugin.controller.nodes import CONTROLLER, Keys
from plugin.controller.policy import Rules
from plugin.controller.reconciler import Reconciler, Settings
from plugin.controller.watcher import NodeWatcher
from plugin.kube.client import KubeClient
from plugin.kube.errors import ApiFailure
from plugin.options.durations import format_duration

log = logging.getLogger("plugin.controller")


def settings_of(cfg: ControllerConfig) -> Settings:
    return Settings(
        keys=Keys(cfg.annotation_prefix),
        rules=Rules(unhealthy_devices=cfg.unhealthy_devices, unhealthy_fraction=cfg.unhealthy_fraction,
                    reboot_required=cfg.reboot_required, capacity_gap=cfg.capacity_gap,
                    gpu_missing=cfg.gpu_missing),
        gpu_missing_grace_s=cfg.gpu_missing_grace_s, recovery_hold_s=cfg.recovery_hold_s,
        repeat_limit=cfg.repeat_limit, repeat_window_s=cfg.repeat_window_s,
        no_execute_after_s=cfg.no_execute_after_s, cordon=cfg.cordon,
        label=cfg.quarantine_label, drain=cfg.drain, drain_per_minute=cfg.drain_per_minute,
        max_quarantined_fraction=cfg.max_quarantined_fraction, max_quarantined_nodes=cfg.max_quarantined_nodes,
        dry_run=cfg.dry_run, reset_breaker=cfg.reset_breaker,
        namespace=cfg.namespace, lease_name=cfg.lease_name, identity=cfg.identity)


class Controller:
    """The running controller; tests and benchmarks start it in-process the same way main() does."""

    def __init__(self, cfg: ControllerConfig) -> None:
        self.cfg = cfg
        # Three connections: the watch holds its own; the Lease renewals must never queue behind a slow write. And
        # one per quarantine writer when there is more than one (--write-concurrency): each has one request in flight.
        def client() -> KubeClient:
            return KubeClient(cfg.kubeconfig, cfg.write_timeout_s, component=CONTROLLER)

        self.work_api = client()
        self.lease_api = client()
        # Reads only (LIST pages of a big fleet, the watch): the client's default timeout, not the fencing bound.
        self.watch_api = KubeClient(cfg.kubeconfig, component=CONTROLLER)
        self.writer_apis = [client() for _ in range(cfg.write_concurrency)] if cfg.write_concurrency > 1 else []
        self.reconciler: Reconciler
        self.leader = LeaderElector(self.lease_api, cfg.namespace, cfg.lease_name, cfg.identity,
                                    lease_duration_s=cfg.lease_duration_s, renew_deadline_s=cfg.renew_deadline_s,
                                    retry_period_s=cfg.retry_period_s,
                                    on_change=lambda leading: self.reconciler.leadership_changed(leading),
                                    on_annotations=lambda: self.reconciler.lease_changed())
        self.reconciler = Reconciler(self.work_api, settings_of(cfg), self.leader, writers=self.writer_apis)
        self.watcher = NodeWatcher(self.watch_api, cfg.node_selector, self.reconciler,
                                   resync_s=cfg.resync_interval_s)
        self.metrics = None
        if cfg.metrics_address != "off":
            from plugin.serve.exposition import Registry
            from plugin.serve.http import MetricsServer
            from plugin.serve.process import ProcessCollector

            registry = Registry()
            registry.register(ControllerCollector(self.reconciler, self.watcher, self.leader))
            registry.register(ProcessCollector())
            self.metrics = MetricsServer(cfg.metrics_address, registry, ControllerProbes(self.reconciler,
                                                                                         self.watcher))

    def start(self) -> None:
        if self.metrics is not None:
            self.metrics.start()
        self.watcher.start()
        self.reconciler.start()
        self.leader.start()
        mode = " (dry run: Events only)" if self.cfg.dry_run else ""
        cap = f", at most {self.cfg.max_quarantined_nodes} nodes" if self.cfg.max_quarantined_nodes else ""
        log.info("gpu-health-controller %s started%s: lease %s/%s, selector %r, breaker limit %.0f%%%s",
                 self.cfg.identity, mode, self.cfg.namespace, self.cfg.lease_name, self.cfg.node_selector,
                 self.cfg.max_quarantined_fraction * 100, cap)
        log.info("effective config: %s", json.dumps(self.cfg.effective(), sort_keys=True))

    def stop(self) -> None:
        """SIGTERM: no write starts from here; those in flight land or time out (each within --write-timeout);
        only then is the Lease handed back, so the next leader never races one of ours. At worst three write
        timeouts: the drain, the elector's renewal in flight, the hand-back (13 s at the default 4 s, inside the
        Deployment's 15 s grace period)."""
        drained = self.reconciler.stop(timeout_s=self.cfg.write_timeout_s + 1.0)
        if not drained:
            log.warning("stopping with a write still in flight: the lease is not handed back; a standby takes over "
                        "when it lapses (%s)", format_duration(self.cfg.lease_duration_s))
        self.leader.stop(release=drained)
        self.watcher.stop()
        if self.metrics is not None:
            self.metrics.stop()
        for api in (self.work_api, self.lease_api, *self.writer_apis):
            api.close()


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_or_exit(list(sys.argv[1:] if argv is None else argv))
    logs.setup(cfg.log_level, cfg.log_format)
    try:
        controller = Controller(cfg)
    except ApiFailure as exc:
        print(f"gpu-health-controller: error: {exc.message}", file=sys.stderr)
        return 2
    done = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping", signum)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    controller.start()
    done.wait()
    controller.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
