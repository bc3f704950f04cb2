"""The names we write under on the API server."""

COMPONENT = "gpu-health-device-plugin"  # an Event's source and reporting component, our field manager
DEFAULT_PREFIX = "gpu-health.io"  # the domain of our annotation keys, on nodes and on pods
