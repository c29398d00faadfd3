"""``nanoflow-dfs``: NanoFlow fed the job in DFS order: compute- and memory-bound operators overlap (``perf/overlap.py``)."""

from __future__ import annotations

from kvbalance.offline.plan import PLANNERS
from kvbalance.offline.planners._common import DFSPlanner


@PLANNERS.register("nanoflow-dfs")
class NanoFlowDFSPlanner(DFSPlanner):
    name = "nanoflow-dfs"
    mode = "overlap"
