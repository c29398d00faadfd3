"""Continuous batching over the paged KV cache: token budget, chunked prefill, preemption by recompute.

Each request advances ``num_computed_tokens`` toward ``num_tokens`` (prompt + output so far);
prefill and decode are the same operation at different sizes, so chunked prefill, prefix-cache
hits and recompute after preemption share one code path (vLLM v1's view). Two policies:

* ``sarathi`` (default): stall-free batching as in Sarathi-Serve — running requests first
  (decodes, then unfinished prefill chunks), then new prefill chunks fill the step's token budget.
* ``vllm``: prefill-first as in vLLM v0 — whenever waiting requests fit, a step runs only whole
  prompts; otherwise it decodes every running request.

When a running request cannot grow, the newest running request is preempted (its blocks freed,
its computed tokens reset; its full blocks stay in the prefix cache) and later resumes by
recompute. The scheduler speaks requests, tokens and blocks only and emits a :class:`BatchPlan`;
it never imports an executor. For the elastic KV reserve (``kvcache/elastic.py``) it exposes
``admission_open`` (closed while the prefill activation reserve is lent to the KV pool: only
decodes run), ``has_prefill_work`` and ``preempt``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from kvbalance.batch import BatchPlan, ScheduledSeq, StepResult
from kvbalance.kvcache.blocks import BlockPool
from kvbalance.kvcache.prefix import RadixCache, RadixNode, request_block_hashes
from kvbalance.request import Request, RequestState


@dataclass
class SchedulerConfig:
    """Batching knobs. ``max_num_batched_tokens`` is the per-step token budget (Sarathi's chunk size)."""

    policy: Literal["sarathi", "vllm"] = "sarathi"
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    watermark: float = 0.01  # share of blocks kept free at admission, so new requests do not preempt at once

    def __post_init__(self) -> None:
        if self.policy not in ("sarathi", "vllm"):
            raise ValueError(f"policy: must be 'sarathi' or 'vllm', got {self.policy!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark: must be in [0, 1), got {self.watermark}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, cache: RadixCache | None = None) -> None:
        self.config = config
        self.pool = pool
        self.cache = cache if config.enable_prefix_caching else None
        self.block_size = pool.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # request id -> (deepest locked cache node, blocks cached): its first blocks live in the prefix cache
        self._paths: dict[str, tuple[RadixNode, int]] = {}
        self._watermark_blocks = int(config.watermark * pool.num_blocks)
        self.admission_open = True  # False while the elastic reserve is lent: no new prefills
        # counters
        self.num_preemptions = 0
        self.admitted_tokens = 0  # tokens that needed KV at admission (prompt, or prompt + output on resume)
        self.prefix_hit_tokens = 0  # of those, tokens served by the prefix cache

    # -- queue ------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.state = RequestState.WAITING
        self.waiting.append(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def kv_used_tokens(self) -> int:
        """Tokens of KV held by running requests (blocks in use minus cached-but-idle ones, in tokens)."""
        idle = self.cache.evictable_blocks if self.cache is not None else 0
        return (self.pool.num_used - idle) * self.block_size

    # -- planning ---------------------------------------------------------------
    def schedule(self, now: float) -> BatchPlan:
        plan = BatchPlan(block_size=self.block_size)
        if self.config.policy == "vllm":
            if self.waiting and self.admission_open:
                self._admit(plan, self.config.max_num_batched_tokens, now, whole_prompts=True)
                if plan.seqs:
                    return plan
            self._schedule_running(plan, budget=1 << 62)
        else:
            budget = self._schedule_running(plan, self.config.max_num_batched_tokens)
            if budget > 0 and self.admission_open:
                self._admit(plan, budget, now, whole_prompts=False)
        return plan

    def has_prefill_work(self) -> bool:
        """Whether the next step could compute prompt tokens (a request waits or a running one is mid-prompt)."""
        if self.waiting:
            return True
        # a prompt token left (even one: the last chunk of a k x budget + 1 prompt) or a multi-token recompute
        return any(
            r.num_computed_tokens < r._num_prompt
            or r._num_prompt + len(r.output_token_ids) - r.num_computed_tokens > 1
            for r in self.running
        )

    def _available_blocks(self) -> int:
        return self.pool.num_free + (self.cache.evictable_blocks if self.cache is not None else 0)

    def _ensure_free(self, n: int) -> bool:
        short = n - self.pool.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.pool.num_free >= n

    def _schedule_running(self, plan: BatchPlan, budget: int) -> int:
        bs = self.block_size
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:
            (
                decodes if r._num_prompt + len(r.output_token_ids) - r.num_computed_tokens == 1 else prefills
            ).append(r)
        scheduled: set[str] = set()
        seqs = plan.seqs
        preempted = False
        for req in decodes + prefills:
            if budget <= 0:
                break
            if preempted and req.state is not RequestState.RUNNING:
                continue  # preempted earlier in this step
            computed = req.num_computed_tokens
            total = req._num_prompt + len(req.output_token_ids)
            n = min(total - computed, budget)
            if computed + n > len(req.block_ids) * bs:  # needs new blocks
                while True:
                    n = min(total - computed, budget)
                    need = self.pool.blocks_for_tokens(computed + n) - len(req.block_ids)
                    if self._ensure_free(need):
                        break
                    if n > 1:  # a prefill chunk: shrink it to the blocks that are free
                        fit = (len(req.block_ids) + self.pool.num_free) * bs - computed
                        if fit >= 1:
                            n = min(n, fit)
                            need = self.pool.blocks_for_tokens(computed + n) - len(req.block_ids)
                            break
                    victim = self._pick_victim(scheduled)
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        n = 0
                        break
                if n <= 0:
                    continue
                if need > 0:
                    req.block_ids.extend(self.pool.allocate(need))
            seqs.append(ScheduledSeq(req, computed, n, computed + n == total))
            scheduled.add(req.request_id)
            budget -= n
        return budget

    def _pick_victim(self, scheduled: set[str]) -> Request:
        """The newest running request not yet scheduled in this step (or, failing that, the newest)."""
        for req in reversed(self.running):
            if req.request_id not in scheduled:
                return req
        return self.running[-1]

    def _admit(self, plan: BatchPlan, budget: int, now: float, *, whole_prompts: bool) -> None:
        bs = self.block_size
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            node, hit = None, 0
            if self.cache is not None:
                node, hit = self.cache.match_prefix(request_block_hashes(req, bs, req.num_tokens - 1))
            cached = hit * bs
            n = req.num_tokens - cached
            if whole_prompts:
                if n > budget and plan.seqs:
                    break
            else:
                n = min(n, budget)
            need = self.pool.blocks_for_tokens(cached + n) - hit
            unlocked_hits = self.cache.unlocked_blocks_on_path(node) if hit else 0
            # The watermark keeps headroom so running requests can grow; with nothing running there is no
            # one to protect, and a request that fits the pool (the rejection rule) must be admissible.
            watermark = self._watermark_blocks if self.running else 0
            if need + watermark > self._available_blocks() - unlocked_hits:
                break  # FCFS: the head waits until its first chunk fits
            self.waiting.popleft()
            hit_blocks: list[int] = []
            if hit:
                self.cache.lock(node)
                hit_blocks = self.cache.blocks_of(node)
                self.pool.incref(hit_blocks)
                self._paths[req.request_id] = (node, hit)
            if not self._ensure_free(need):  # cannot happen: availability was checked above
                raise RuntimeError("block accounting: admission check passed but allocation failed")
            req.block_ids = hit_blocks + self.pool.allocate(need)
            req.num_computed_tokens = cached
            req.num_cached_tokens = cached
            req.prefix_hit_tokens += cached
            self.prefix_hit_tokens += cached
            self.admitted_tokens += req.num_tokens
            req.state = RequestState.RUNNING
            if req.first_scheduled_s is None:
                req.first_scheduled_s = now
            self.running.append(req)
            plan.seqs.append(ScheduledSeq(req, cached, n, cached + n == req.num_tokens))
            budget -= n

    # -- applying results ---------------------------------------------------------
    def update(self, plan: BatchPlan, result: StepResult, now: float) -> list[Request]:
        """Apply an executed plan at time ``now``; return the requests that finished."""
        finished: list[Request] = []
        cache = self.cache
        bs = self.block_size
        paths = self._paths
        sampled = result.sampled
        running = RequestState.RUNNING
        for s in plan.seqs:
            req = s.request
            if req.state is not running:
                continue  # aborted while the step ran
            req.num_computed_tokens += s.num_new_tokens
            reason = None
            if s.sample:
                token = sampled[req.request_id]
                req.output_token_ids.append(token)
                if req.first_token_s is None:
                    req.first_token_s = now
                req.token_times_s.append(now)
                if req.sampling.logprobs is not None and req.request_id in result.logprobs:
                    req.output_logprobs.append(result.logprobs[req.request_id])
                reason = self._stop_reason(req, token)
            if cache is not None:
                path = paths.get(req.request_id)
                if req.num_computed_tokens // bs > (0 if path is None else path[1]):
                    self._cache_full_blocks(req)
            if reason is not None:
                self._release(req)
                req.state = RequestState.FINISHED
                req.finish_reason = reason
                req.finish_s = now
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.state is running]
        return finished

    @staticmethod
    def _stop_reason(req: Request, token: int) -> str | None:
        sp = req.sampling
        if (sp.stop_token_ids and token in sp.stop_token_ids) or (
            not sp.ignore_eos and req.eos_token_id is not None and token == req.eos_token_id
        ):
            return "stop"
        if len(req.output_token_ids) >= sp.max_tokens:
            return "length"
        return None

    def _cache_full_blocks(self, req: Request) -> None:
        node, have = self._paths.get(req.request_id) or (self.cache.root, 0)
        full = req.num_computed_tokens // self.block_size
        if full <= have:
            return
        hashes = request_block_hashes(req, self.block_size, full * self.block_size)
        node, cached = self.cache.extend(node, have, hashes, req.block_ids)
        table = req.block_ids
        if table[have:full] != cached:
            for i, b in enumerate(cached, start=have):
                own = table[i]
                if b != own:  # computed concurrently by another request: share its block
                    self.pool.incref((b,))
                    self.pool.free((own,))
                    table[i] = b
        self._paths[req.request_id] = (node, full)

    # -- releasing --------------------------------------------------------------
    def _release(self, req: Request) -> None:
        path = self._paths.pop(req.request_id, None)
        if path is not None:
            self.cache.unlock(path[0])
        self.pool.free(req.block_ids)
        req.block_ids = []

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.state = RequestState.WAITING
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def preempt(self, req: Request) -> None:
        """Preempt a running request from outside (it frees its blocks and resumes later by recompute)."""
        if req.state is not RequestState.RUNNING:
            raise ValueError(f"req: {req.request_id} is {req.state.value}, not running")
        self._preempt(req)

    def finish_request(self, req: Request, reason: str, now: float, state=RequestState.FINISHED) -> None:
        """End a request from outside (stop string matched, client abort)."""
        if req.is_finished:
            return
        if req.state is RequestState.RUNNING:
            self._release(req)
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.state = state
        req.finish_reason = reason
        req.finish_s = now

    def abort(self, req: Request, now: float) -> None:
        self.finish_request(req, "abort", now, state=RequestState.ABORTED)

    # -- checks -----------------------------------------------------------------
    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.cache is not None:
            self.cache.check_invariants()
        refs: dict[int, int] = {}
        for req in self.running:
            if req.state is not RequestState.RUNNING:
                raise AssertionError(f"{req} in the running list")
            if len(req.block_ids) < self.pool.blocks_for_tokens(req.num_computed_tokens):
                raise AssertionError(f"{req}: fewer blocks than computed tokens need")
            for b in req.block_ids:
                refs[b] = refs.get(b, 0) + 1
            path = self._paths.get(req.request_id)
            if path is not None and self.cache.blocks_of(path[0]) != req.block_ids[: path[1]]:
                raise AssertionError(f"{req}: locked cache path and block table disagree")
        for req in self.waiting:
            if req.block_ids:
                raise AssertionError(f"{req}: waiting but holds blocks")
        cached = self.cache.all_block_ids() if self.cache is not None else set()
        for b in range(self.pool.num_total_blocks):
            expect = refs.get(b, 0) + (1 if b in cached else 0)
            if self.pool.ref_count(b) != expect:
                raise AssertionError(f"block {b}: ref count {self.pool.ref_count(b)} != holders {expect}")
