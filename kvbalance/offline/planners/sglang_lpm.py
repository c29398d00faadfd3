"""``sglang-lpm``: SGLang's cache-aware scheduling as it really behaves on an offline job.

SGLang's default policy (``--schedule-policy lpm``) sorts the waiting queue by the longest prefix each request
matches in the radix cache, but falls back to FCFS while more than 128 requests wait (the match is too costly to
recompute over a long queue). An offline job puts every request in the queue at once, so the job runs in input
order until only 128 remain. The plan's order is the input order; ``LPMAdmission`` reorders the waiting queue
before every step.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbalance.offline.plan import PLANNERS, OfflinePlan, PlanContext
from kvbalance.offline.planners._common import weights
from kvbalance.request import Request

LPM_FCFS_FALLBACK = 128  # SGLang: more waiting requests than this -> FCFS


class LPMAdmission:
    """Before each step: with at most ``fallback`` requests waiting, order them by longest cached prefix."""

    feeds = False  # the runner queues the whole job; this only reorders the waiting queue

    def __init__(self, fallback: int = LPM_FCFS_FALLBACK) -> None:
        self.fallback = fallback

    def bind(self, requests) -> LPMAdmission:
        return self  # stateless

    def before_step(self, instance, now: float) -> None:
        # the waiting queue and the prefix cache are the scheduler's; LPM needs both, as SGLang's policy does
        sched = instance.scheduler
        waiting = sched.waiting
        if sched.cache is None or len(waiting) < 2 or len(waiting) > self.fallback:
            return

        def matched(req: Request) -> int:
            return sched.kv.get_computed_blocks(req).num_blocks

        ranked = sorted(waiting, key=lambda r: -matched(r))  # stable: FCFS among equal matches
        waiting.clear()
        waiting.extend(ranked)


@PLANNERS.register("sglang-lpm")
class SGLangLPMPlanner:
    name = "sglang-lpm"
    mode = "sequential"

    def plan(self, requests: Sequence[Request], ctx: PlanContext) -> OfflinePlan:
        order = list(range(len(requests)))
        return OfflinePlan(
            self.name, order, mode=self.mode, weights=weights(requests), admission=LPMAdmission()
        )
