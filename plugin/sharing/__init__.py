"""Sharing: which kubelet resources the node advertises, as configured (the ``sharing:`` section, the MIG strategy)
and as modelled (pools of devices, selections of them), apart from the kubelet side that serves them.

``config`` parses and checks the section; ``model`` names the pools and selections. The agent's config loads the
section from here, and the kubelet side (plugin/kubelet/resources.py) turns it into the resources it serves.
``docs/sharing.md`` is the reference.
"""
