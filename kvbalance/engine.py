"""Instance: one serving engine = scheduler + block pool + prefix cache + executor.

``step(now)`` plans and executes one batch; ``complete(outcome, now)`` applies its result at the
time the step ends (``now + duration`` in simulation, the wall clock for real). The same object
runs under the discrete-event simulator and under the real engine loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbalance.executor.base import BatchPlan, Executor, StepResult
from kvbalance.kvcache.blocks import BlockPool
from kvbalance.kvcache.prefix import RadixCache
from kvbalance.request import Request, RequestState
from kvbalance.scheduler import Scheduler, SchedulerConfig


@dataclass
class StepOutcome:
    plan: BatchPlan
    result: StepResult
    start_s: float


class Instance:
    def __init__(
        self,
        executor: Executor,
        *,
        num_blocks: int,
        block_size: int = 16,
        scheduler_config: SchedulerConfig | None = None,
        max_context: int = 1 << 30,
        name: str = "instance-0",
    ) -> None:
        self.name = name
        self.executor = executor
        self.pool = BlockPool(num_blocks, block_size)
        self.config = scheduler_config or SchedulerConfig()
        self.cache = RadixCache(self.pool) if self.config.enable_prefix_caching else None
        self.scheduler = Scheduler(self.config, self.pool, self.cache)
        self.max_context = max_context
        self.num_steps = 0
        self.busy_s = 0.0

    # -- admission ----------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.pool.capacity_tokens

    def rejection_reason(self, req: Request) -> str | None:
        need = req.num_prompt_tokens + req.max_tokens
        if need > self.max_context:
            return (
                f"context_length: prompt ({req.num_prompt_tokens}) + max_tokens ({req.max_tokens}) = {need} "
                f"exceeds the model context ({self.max_context})"
            )
        if self.pool.blocks_for_tokens(req.max_total_tokens) > self.pool.num_blocks:
            return (
                f"kv_capacity: needs {req.max_total_tokens} KV tokens, more than the whole cache "
                f"({self.kv_capacity_tokens} tokens) can ever hold"
            )
        return None

    def add_request(self, req: Request, now: float) -> bool:
        """Queue a request, or reject it with a reason if it can never be served. Returns accepted."""
        reason = self.rejection_reason(req)
        if reason is not None:
            req.state = RequestState.REJECTED
            req.reject_reason = reason
            req.finish_s = now
            return False
        self.scheduler.add(req)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- stepping -----------------------------------------------------------------
    def step(self, now: float) -> StepOutcome | None:
        plan = self.scheduler.schedule(now)
        if plan.is_empty:
            return None
        result = self.executor.execute(plan)
        self.num_steps += 1
        self.busy_s += result.duration_s
        return StepOutcome(plan, result, now)

    def complete(self, outcome: StepOutcome, now: float) -> list[Request]:
        return self.scheduler.update(outcome.plan, outcome.result, now)

    def abort(self, req: Request, now: float) -> None:
        self.scheduler.abort(req, now)

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
