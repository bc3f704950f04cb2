"""The fleet controller `gpu-health-controller`: quarantines failing GPU nodes, behind a circuit breaker."""
