"""The metrics outlet: Prometheus collectors that read the plugin's own state at scrape time (collectors) and the
process's (process), the narrow views of the plugin they read it through (sources), the exposition formats
(exposition), the liveness and readiness probes (probes), and the HTTP server for all three paths (server). It
knows nothing of the App: ``plugin.app`` wires the sources in."""

from plugin.outlets.metrics.collectors import Sources, build_registry, label_code
from plugin.outlets.metrics.probes import Probes
from plugin.serve.http import MetricsServer

__all__ = ["MetricsServer", "Probes", "Sources", "build_registry", "label_code"]
