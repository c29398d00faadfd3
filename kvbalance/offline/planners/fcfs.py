"""``fcfs``: the job in input order (what vLLM's ``LLM.generate`` does with its inputs)."""

from __future__ import annotations

from collections.abc import Sequence

from kvbalance.offline.plan import PLANNERS, OfflinePlan, PlanContext
from kvbalance.request import Request


@PLANNERS.register("fcfs")
class FCFSPlanner:
    name = "fcfs"
    mode = "sequential"

    def plan(self, requests: Sequence[Request], ctx: PlanContext) -> OfflinePlan:
        order = list(range(len(requests)))
        weights = [float(r.num_prompt_tokens + r.max_tokens) for r in requests]
        return OfflinePlan(self.name, order, mode=self.mode, weights=weights)
