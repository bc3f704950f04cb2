"""The one option library of both programs (the node agent's ``run`` and ``gpu-health-controller``): each declares
its options as fields of a frozen dataclass (``spec`` in ``table``), and this package derives the flag, the
environment variable and the file key of each, merges flags > environment > file > defaults (``sources``), builds
the argparse flags (``flags``) and gives the generated docs and the chart schema what they read."""
