"""What the node agent writes on the cluster and its readers read back: one codec per format, with both directions.

A layer of its own between health and its users: the agent's outlets encode with it, the fleet controller and
``kubectl gpu-health`` decode with it, and neither reader may import the outlets.
"""
