"""Sarathi-Serve's stall-free batching (the default policy).

Running requests go first — decodes, then unfinished prefill chunks — and new prefill chunks fill what is
left of the step's token budget (chunked prefill: ``min(needed, budget)``), so decodes never stall
behind a long prompt (Agrawal et al., OSDI'24, "stall-free scheduling").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kvbalance.scheduler.base import POLICIES

if TYPE_CHECKING:
    from kvbalance.batch import BatchPlan
    from kvbalance.scheduler.core import Scheduler


@POLICIES.register("sarathi")
class SarathiPolicy:
    name: ClassVar[str] = "sarathi"
    whole_prompts: ClassVar[bool] = False

    @staticmethod
    def token_budget(chunk_size: int, max_context: int) -> int:
        return chunk_size

    def schedule(self, scheduler: Scheduler, plan: BatchPlan, now: float) -> None:
        budget = scheduler.schedule_running(plan, scheduler.config.max_num_batched_tokens)
        if budget > 0 and scheduler.admission_open:
            scheduler.admit_waiting(plan, budget, now, whole_prompts=False)
