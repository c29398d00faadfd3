"""``sglang-dfs``: SGLang fed the job in DFS order, sequential operators. In this simulator vLLM and SGLang share one
scheduler and one cost model, so this row equals ``vllm-dfs`` by construction (the paper's two differ by engine
implementation, not by order)."""

from __future__ import annotations

from kvbalance.offline.plan import PLANNERS
from kvbalance.offline.planners._common import DFSPlanner


@PLANNERS.register("sglang-dfs")
class SGLangDFSPlanner(DFSPlanner):
    name = "sglang-dfs"
    mode = "sequential"
