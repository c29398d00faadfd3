"""Continuous batching over the paged KV cache: token budget, chunked prefill, preemption by recompute.

Each request advances ``num_computed_tokens`` toward ``num_tokens`` (prompt + output so far);
prefill and decode are the same operation at different sizes, so chunked prefill, prefix-cache
hits, KV loaded from outside and recompute after preemption share one code path (vLLM v1's view).
Which requests advance each step is the policy's choice (``kvbalance/scheduler/policies/``: ``sarathi``
stall-free batching by default, ``vllm`` prefill-first); this class provides the two primitives they
use, :meth:`schedule_running` and :meth:`admit_waiting`.

The scheduler speaks requests and tokens only: blocks belong to the :class:`KVCacheManager`, KV from or
to outside to the :class:`~kvbalance.kvcache.connector.KVConnector` (scheduler half), and it emits a
:class:`BatchPlan`; it never imports an executor. When a running request cannot grow, the newest running
request is preempted (its blocks freed, its computed tokens reset; its full blocks stay in the prefix
cache) and later resumes by recompute. For the elastic KV reserve (``kvcache/elastic.py``) it exposes
``admission_open`` (closed while the prefill activation reserve is lent: only decodes run),
``has_prefill_work`` and ``preempt``.
"""

from __future__ import annotations

from collections import deque

from kvbalance.batch import BatchPlan, ScheduledSeq, StepResult
from kvbalance.kvcache.blocks import BlockPool
from kvbalance.kvcache.connector import KVConnector, NullConnector
from kvbalance.kvcache.manager import KVCacheManager
from kvbalance.request import Request, RequestState
from kvbalance.scheduler.base import POLICIES
from kvbalance.scheduler.cohort import CohortScheduling
from kvbalance.scheduler.config import SchedulerConfig  # importers of kvbalance.scheduler.core keep it here
from kvbalance.scheduler.control import RequestControl

# policies whose plan, when every running request decodes and none can be admitted, is exactly "one token for
# each running request, in order" (both run schedule_running first or only; see decode_run_ready)
DECODE_RUN_POLICIES = ("sarathi", "vllm")


class Scheduler(RequestControl, CohortScheduling):
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager | BlockPool,
        connector: KVConnector | None = None,
    ) -> None:
        self.config = config
        if isinstance(kv, BlockPool):
            kv = KVCacheManager(kv, config.enable_prefix_caching, config.block_hasher())
        self.kv = kv
        self.pool = kv.pool
        self.cache = kv.cache
        self.block_size = kv.block_size
        self.policy = POLICIES.get(config.policy)()
        self.connector: KVConnector = connector if connector is not None else NullConnector()
        self._null_connector = isinstance(self.connector, NullConnector)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # WAITING_FOR_KV: blocks held, contents still arriving
        self._load_target: dict[str, int] = {}  # request id -> computed tokens once its load lands
        self._held: dict[str, list[int]] = {}  # request id -> blocks kept until a save / a load lands
        self._held_for_load: dict[str, bool] = {}  # request id -> held for a load (True) or a save (False)
        self._held_paths: dict[str, object] = {}  # request id -> its cache lock while held (or None)
        self._watermark_blocks = int(config.watermark * kv.pool.num_blocks)
        self.admission_open = True  # False while the elastic reserve is lent: no new prefills
        # counters
        self.num_preemptions = 0
        self.admitted_tokens = 0  # tokens that needed KV at admission (prompt, or prompt + output on resume)
        self.prefix_hit_tokens = 0  # of those, tokens served by the prefix cache
        self.external_hit_tokens = 0  # of those, tokens loaded from outside through the connector
        self._cohort = None  # the decode cohort (scheduler/cohort.py), off until enable_cohort

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

    @property
    def num_loading(self) -> int:
        return len(self.loading)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    @property
    def kv_used_tokens(self) -> int:
        """Tokens of KV held by requests (blocks in use minus cached-but-idle ones, in tokens)."""
        return self.kv.kv_used_tokens

    # -- planning ---------------------------------------------------------------
    def schedule(self, now: float) -> BatchPlan:
        plan = BatchPlan(block_size=self.block_size)
        self.policy.schedule(self, plan, now)
        if not self._null_connector:
            self.connector.build_connector_meta(plan)
        return plan

    def has_prefill_work(self) -> bool:
        """Whether the next step could compute prompt tokens (a request waits or a running one is mid-prompt)."""
        if self.waiting or self.loading:
            return True
        self.settle()
        # a prompt token left (even one: the last chunk of a k x budget + 1 prompt) or a multi-token recompute
        return any(
            r.num_computed_tokens < r._num_prompt
            or r._num_prompt + len(r.output_token_ids) - r.num_computed_tokens > 1
            for r in self.running
        )

    def decode_run_ready(self) -> bool:
        """Whether every step from now on is the same plan shape until a request finishes or needs a block:
        each running request decodes one token (a policy of ``DECODE_RUN_POLICIES`` with the batch inside its
        token budget), nothing can be admitted (no request waits, or the batch is at ``max_num_seqs``), no KV
        is in flight, and only the length rule can stop a request (``Instance.decode_run`` relies on this)."""
        if self._cohort is not None:
            self._dissolve()  # Instance.decode_run writes the requests itself
        running = self.running
        if not running or self.loading or self._held or self.policy.name not in DECODE_RUN_POLICIES:
            return False
        if self.waiting and len(running) < self.config.max_num_seqs:
            return False
        if self.policy.name == "sarathi" and len(running) > self.config.max_num_batched_tokens:
            return False
        for r in reversed(running):  # requests mid-prompt, the usual reason to say no, are the newest
            if (
                r._num_prompt + len(r.output_token_ids) - r.num_computed_tokens != 1
                or r.first_token_s is None
            ):
                return False
            sp = r.sampling
            if (
                sp.stop_token_ids
                or sp.logprobs is not None
                or (not sp.ignore_eos and r.eos_token_id is not None)
            ):
                return False
        return True

    def schedule_running(self, plan: BatchPlan, budget: int) -> int:
        """Advance running requests (decodes first, then prefill chunks) within ``budget``; return what is left.

        A request that cannot grow first shrinks its prefill chunk to the free blocks, else preempts the
        newest running request not yet scheduled in this step (possibly itself)."""
        if self._cohort is not None:
            return self._cohort_schedule_running(plan, budget)
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:
            if r._num_prompt + len(r.output_token_ids) - r.num_computed_tokens == 1:
                decodes.append(r)
            else:
                prefills.append(r)
        seqs = plan.seqs
        first = len(seqs)  # the sequences this call schedules are seqs[first:]
        preempted = self.num_preemptions
        bs = self.block_size
        running = RequestState.RUNNING
        for req in decodes:  # one token each, the step's last: the common case, kept lean
            if budget <= 0:
                break
            if preempted != self.num_preemptions and req.state is not running:
                continue  # preempted earlier in this step
            computed = req.num_computed_tokens
            if computed >= len(req.block_ids) * bs and not self._grow(req, computed, 1, seqs, first):
                continue
            seqs.append(ScheduledSeq(req, computed, 1, True))
            budget -= 1
        return self._schedule_prefills(prefills, seqs, budget, first, preempted)

    def _schedule_prefills(
        self, prefills: list[Request], seqs: list[ScheduledSeq], budget: int, first: int, preempted: int
    ) -> int:
        """:meth:`schedule_running`'s second half: prefill chunks (and recomputes) of running requests within
        ``budget``, in order; ``seqs[first:]`` are this step's, ``preempted`` the preemption count it began with.
        Returns the budget left."""
        bs = self.block_size
        running = RequestState.RUNNING
        for req in prefills:
            if budget <= 0:
                break
            if preempted != self.num_preemptions and req.state is not running:
                continue  # preempted earlier in this step
            computed = req.num_computed_tokens
            total = req._num_prompt + len(req.output_token_ids)
            n = total - computed
            if n > budget:
                n = budget
            if computed + n > len(req.block_ids) * bs:  # needs new blocks
                n = self._grow(req, computed, n, seqs, first)
                if n <= 0:
                    continue
            seqs.append(ScheduledSeq(req, computed, n, computed + n == total))
            budget -= n
        return budget

    def _grow(self, req: Request, computed: int, n: int, seqs: list[ScheduledSeq], first: int) -> int:
        """Blocks for ``req``'s ``n`` new tokens: a prefill chunk shrinks to the free blocks, else the newest
        running request not yet scheduled is preempted (possibly ``req``: then 0) until they fit; returns the
        tokens ``req`` computes (the same ``n`` once nothing else needed preempting)."""
        kv = self.kv
        want = n
        while not kv.allocate_slots(req, computed + n):
            if n > 1:  # a prefill chunk: shrink it to the blocks that are free
                fit = kv.max_tokens_fitting(req) - computed
                if fit >= 1:
                    n = min(n, fit)
                    if not kv.allocate_slots(req, computed + n):
                        raise RuntimeError("block accounting: a chunk that fits failed to allocate")
                    return n
            victim = self._pick_victim(seqs, first)
            self._preempt(victim)
            if victim is req:
                return 0
            n = want
        return n

    def _pick_victim(self, seqs: list[ScheduledSeq], first: int) -> Request:
        """The newest running request not among ``seqs[first:]`` (scheduled in this step), else the newest."""
        scheduled = {s.request.request_id for s in seqs[first:]}
        cohort = self._cohort  # its members decode in every step they are in (scheduled first)
        for req in reversed(self.running):
            if req.request_id not in scheduled and not (cohort and req.request_id in cohort):
                return req
        return self.running[-1]

    def admit_waiting(self, plan: BatchPlan, budget: int, now: float, *, whole_prompts: bool) -> None:
        """Admit waiting requests in queue order (FCFS: the head waits until its first chunk fits)."""
        kv = self.kv
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hit = kv.get_computed_blocks(req)
            cached = hit.num_blocks * self.block_size
            external, load_async = 0, False
            if not self._null_connector:
                external, load_async = self._external_tokens(req, cached)
            start = cached + external  # tokens whose KV is there (or arriving) once admitted
            n = 0 if load_async else req.num_tokens - start
            if whole_prompts:
                if n > budget and plan.seqs:
                    break
            else:
                n = min(n, budget)
            # the watermark keeps headroom so running requests can grow; with nothing running there is no
            # one to protect, and a request that fits the pool (the rejection rule) must be admissible
            watermark = self._watermark_blocks if self.running else 0
            if not kv.can_admit(hit, start + n, watermark):
                break
            self.waiting.popleft()
            kv.admit(req, hit, start + n)
            req.num_computed_tokens = cached
            req.num_cached_tokens = cached
            req.prefix_hit_tokens += cached
            self.prefix_hit_tokens += cached
            self.external_hit_tokens += external
            self.admitted_tokens += req.num_tokens
            if req.first_scheduled_s is None:
                req.first_scheduled_s = now
            if not self._null_connector:
                self.connector.update_state_after_alloc(req, req.block_ids, external)
            if load_async:
                req.state = RequestState.WAITING_FOR_KV
                self.loading[req.request_id] = req
                self._load_target[req.request_id] = start
                continue
            req.num_computed_tokens = start  # a synchronous load lands before this step's compute
            req.state = RequestState.RUNNING
            self.running.append(req)
            if self._cohort is not None:
                self._cohort_enter(req)
            plan.seqs.append(ScheduledSeq(req, start, n, start + n == req.num_tokens))
            budget -= n

    def _external_tokens(self, req: Request, cached: int) -> tuple[int, bool]:
        external, load_async = self.connector.get_num_new_matched_tokens(req, cached)
        if not 0 <= external <= req.num_tokens - 1 - cached:
            raise ValueError(
                f"num_external_tokens: connector offered {external} tokens for {req.request_id}, "
                f"must be in [0, {req.num_tokens - 1 - cached}] (the last token is always computed)"
            )
        return external, load_async and external > 0

    # -- applying results ---------------------------------------------------------
    def update(self, plan: BatchPlan, result: StepResult, now: float) -> list[Request]:
        """Apply an executed plan at time ``now``; return the requests that finished."""
        if self._cohort is not None:
            return self._cohort_update(plan, result, now)
        finished: list[Request] = []
        running = RequestState.RUNNING
        if result.finished_loads or result.finished_saves:
            self._apply_transfers(result.finished_loads, result.finished_saves)
        for s in plan.seqs:
            req = s.request
            if req.state is not running:
                continue  # aborted while the step ran
            reason = self._apply_seq(s, result, now)[0]
            if reason is not None:
                self._finish_step(req, reason, now, finished)
        if finished:
            self.running = [r for r in self.running if r.state is running]
        return finished

    def _apply_seq(self, s: ScheduledSeq, result: StepResult, now: float) -> tuple[str | None, bool]:
        """Apply one executed sequence of a running request: its computed tokens, its sampled token (token time,
        logprobs, stop rule), a block it filled published. Returns (its stop reason, None if it goes on;
        whether it sampled and goes on with only the length rule able to stop it: a decode cohort may take it)."""
        req = s.request
        n = s.num_new_tokens
        computed = req.num_computed_tokens = req.num_computed_tokens + n
        reason = None
        plain = False
        if s.sample:
            rid = req.request_id
            token = result.sampled[rid]
            out = req.output_token_ids
            out.append(token)
            if req.first_token_s is None:
                req.first_token_s = now
            req.token_times_s.append(now)
            sp = req.sampling
            if sp.logprobs is not None and rid in result.logprobs:
                req.output_logprobs.append(result.logprobs[rid])
            if sp.stop_token_ids or (not sp.ignore_eos and req.eos_token_id is not None):
                reason = self._stop_reason(req, token)
            elif len(out) >= sp.max_tokens:  # _stop_reason's length rule, for a request no token stops
                reason = "length"
            else:
                plain = sp.logprobs is None
        # a block filled up in this step: publish it (the cached path always reaches the last full block)
        bs = self.block_size
        if self.cache is not None and computed // bs > (computed - n) // bs:
            self.kv.cache_full_blocks(req)
        return reason, plain

    def _finish_step(self, req: Request, reason: str, now: float, finished: list[Request]) -> None:
        """``req`` stopped in the step that ended at ``now``: its blocks go, it is finished with ``reason``."""
        self._release(req, finished=True)
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        req.finish_s = now
        finished.append(req)

    def _apply_transfers(self, finished_loads: list[str], finished_saves: list[str]) -> None:
        """The worker half reported transfers done: loaded requests become runnable, held blocks go."""
        self.connector.update_connector_output(finished_loads, finished_saves)
        for rid in finished_loads:
            req = self.loading.pop(rid, None)
            target = self._load_target.pop(rid, None)
            if req is not None:
                req.num_computed_tokens = target
                req.state = RequestState.RUNNING
                self.running.append(req)
                if self._cohort is not None:
                    self._cohort_enter(req)
                if self.cache is not None:
                    self.kv.cache_full_blocks(req)
            elif rid in self._held and self._held_for_load.get(rid):
                self._free_held(rid)
        for rid in finished_saves:
            if rid in self._held and not self._held_for_load.get(rid):
                self._free_held(rid)

    def _free_held(self, rid: str) -> None:
        self.kv.release_held(self._held.pop(rid), self._held_paths.pop(rid))
        self._held_for_load.pop(rid, None)

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

    # -- releasing --------------------------------------------------------------
    def _hold(self, req: Request, for_load: bool) -> None:
        """Keep ``req``'s blocks and its cache lock (a transfer still uses them) after it leaves: cached
        blocks under a transfer must not look evictable. Both go when the transfer lands (``_free_held``)."""
        self._held[req.request_id] = req.block_ids
        self._held_paths[req.request_id] = self.kv.detach(req)
        self._held_for_load[req.request_id] = for_load

    def _release(self, req: Request, *, finished: bool) -> None:
        if finished:
            self.kv.forget(req)
            if not self._null_connector and self.connector.request_finished(req, req.block_ids):
                self._hold(req, for_load=False)
                return
        self.kv.free(req)

    def _preempt(self, req: Request) -> None:
        if self._cohort is not None:
            self._cohort_forget(req)
        self._release(req, finished=False)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.state = RequestState.WAITING
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # -- checks -----------------------------------------------------------------
    def check_invariants(self) -> None:
        self.settle()
        for req in self.running:
            if req.state is not RequestState.RUNNING:
                raise AssertionError(f"{req} in the running list")
        for req in self.loading.values():
            if req.state is not RequestState.WAITING_FOR_KV:
                raise AssertionError(f"{req} in the loading list")
        for req in self.waiting:
            if req.block_ids:
                raise AssertionError(f"{req}: waiting but holds blocks")
        self.kv.check_invariants([*self.running, *self.loading.values()], self._held, self._held_paths)
