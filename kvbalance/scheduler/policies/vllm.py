"""vLLM v0's prefill-first scheduling.

Whenever waiting requests fit, a step runs only whole prompts (up to the token budget); otherwise it
decodes every running request. Prompts are never chunked, so the budget must cover the longest prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kvbalance.scheduler.base import POLICIES

if TYPE_CHECKING:
    from kvbalance.batch import BatchPlan
    from kvbalance.scheduler.core import Scheduler

UNLIMITED = 1 << 62


@POLICIES.register("vllm")
class VllmPolicy:
    name: ClassVar[str] = "vllm"
    whole_prompts: ClassVar[bool] = True

    @staticmethod
    def token_budget(chunk_size: int, max_context: int) -> int:
        return max(chunk_size, max_context)  # a whole prompt of any admissible length fits a step

    def schedule(self, scheduler: Scheduler, plan: BatchPlan, now: float) -> None:
        if scheduler.waiting and scheduler.admission_open:
            scheduler.admit_waiting(plan, scheduler.config.max_num_batched_tokens, now, whole_prompts=True)
            if plan.seqs:
                return
        scheduler.schedule_running(plan, budget=UNLIMITED)
