"""Offline batch inference (BlendServe): compute density, the resource-aware prefix tree, node splitting,
dual scanning and the planners that order a whole job known up front (see ``plan.py`` for the interface)."""
