"""gpu-health-device-plugin: a Kubernetes device plugin for NVIDIA GPUs with fine-grained health."""

