"""NVSentinel interop (docs/nvsentinel.md): health events to its platform connector, and its device API both ways."""
