"""Serving HTTP for both programs: the small bounded server behind /metrics and the probes, the Prometheus
exposition formats, and the process collector. What is exported is each program's business."""
