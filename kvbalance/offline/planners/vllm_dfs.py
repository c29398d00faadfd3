"""``vllm-dfs``: vLLM fed the job in DFS order (the paper's baseline setting): one operator after another."""

from __future__ import annotations

from kvbalance.offline.plan import PLANNERS
from kvbalance.offline.planners._common import DFSPlanner


@PLANNERS.register("vllm-dfs")
class VLLMDFSPlanner(DFSPlanner):
    name = "vllm-dfs"
    mode = "sequential"
