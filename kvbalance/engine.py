"""Instance: one serving engine = scheduler + block pool + prefix cache + executor.

``step(now)`` plans and executes one batch; ``complete(outcome, now)`` applies its result at the
time the step ends (``now + duration`` in simulation, the wall clock for real). The same object
runs under the discrete-event simulator and under the real engine loop.

With ``elastic=ElasticConfig(...)`` the instance lends its prefill activation reserve to the KV pool
during decode-only periods and reclaims it before prefills (``kvcache/elastic.py``), or, in static
mode, keeps it in the pool and fails with ``"oom"`` when a prefill no longer fits. Without it the
step path is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvbalance.batch import BatchPlan, StepResult
from kvbalance.executor.base import Executor
from kvbalance.kvcache.blocks import BlockPool, ElasticBlockPool
from kvbalance.kvcache.connector import KVConnector
from kvbalance.kvcache.elastic import OOM, ElasticConfig, ElasticReserve
from kvbalance.kvcache.manager import KVCacheManager
from kvbalance.request import Request, RequestState
from kvbalance.scheduler import POLICIES, Scheduler, SchedulerConfig


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """A snapshot of an instance's load, for routers, the server, metrics and reports.

    Token counts are what the instance still has to do or holds: ``queued_prefill_tokens`` are prompt
    (or recompute) tokens not yet computed, over waiting and running requests; ``decode_tokens`` the
    context of running requests past their prompt (KV read by every decode step);
    ``remaining_output_tokens`` the output budget not yet generated (an upper bound on decode work).
    """

    name: str
    num_waiting: int
    num_running: int
    num_loading: int  # requests whose KV is still arriving from outside (not schedulable yet)
    queued_prefill_tokens: int
    decode_tokens: int
    remaining_output_tokens: int
    kv_used_tokens: int  # KV held by requests
    kv_cached_tokens: int  # KV of cached blocks no request holds (evictable on demand)
    kv_capacity_tokens: int
    busy_s: float
    num_steps: int
    num_preemptions: int
    admitted_tokens: int  # cumulative: tokens that needed KV at admission
    prefix_hit_tokens: int  # cumulative: of those, served by the local prefix cache
    external_hit_tokens: int  # cumulative: of those, loaded from outside (KV connector)
    prefix_token_mismatches: int = 0  # cumulative: prefix-cache hits refused (the tokens differed)

    @property
    def kv_utilization(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0

    @property
    def outstanding_tokens(self) -> int:
        """Work left in tokens: prefill still to compute plus output still to generate."""
        return self.queued_prefill_tokens + self.remaining_output_tokens


@dataclass(frozen=True, slots=True)
class DecodeRunStep:
    """The plan of one step of a decode run, as far as step hooks read it."""

    num_tokens: int
    num_decode_seqs: int


@dataclass(frozen=True, slots=True)
class CohortStep(DecodeRunStep):
    """The plan of a step that is the decode cohort's alone, begun by ``Instance.cohort_run_begin``."""


class StepColumns:
    """Steps as a step hook that only records sees them, as columns: each step's start, duration and batch
    tokens, and the running and waiting requests and the KV tokens in use after it."""

    __slots__ = ("starts_s", "durations_s", "batch_tokens", "running", "waiting", "kv_used_tokens")

    def __init__(self) -> None:
        self.starts_s: list[float] = []
        self.durations_s: list[float] = []
        self.batch_tokens: list[int] = []
        self.running: list[int] = []
        self.waiting: list[int] = []
        self.kv_used_tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.starts_s)

    def add(self, start_s: float, duration_s: float, batch_tokens: int, running: int, waiting: int,
            kv_used_tokens: int) -> None:  # fmt: skip
        self.starts_s.append(start_s)
        self.durations_s.append(duration_s)
        self.batch_tokens.append(batch_tokens)
        self.running.append(running)
        self.waiting.append(waiting)
        self.kv_used_tokens.append(kv_used_tokens)


class RunStepResult:
    """The result of one step of a cohort run, as far as step hooks read it (its duration)."""

    __slots__ = ("duration_s",)

    def __init__(self, duration_s: float) -> None:
        self.duration_s = duration_s


@dataclass
class StepOutcome:
    plan: BatchPlan
    result: StepResult
    start_s: float


@dataclass
class CohortChunkOutcome(StepOutcome):
    """A step that is the decode cohort plus one prompt chunk, run by :meth:`Instance.step`'s fast path (executed
    by ``SimExecutor.execute_cohort_chunk``, completed by ``Scheduler.cohort_chunk_end``)."""


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
        elastic: ElasticConfig | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        self.name = name
        self.executor = executor
        if elastic is None:
            self.pool = BlockPool(num_blocks, block_size)
        elif elastic.mode == "elastic":  # the reserve region: blocks [num_blocks, num_blocks + E), detached
            self.pool = ElasticBlockPool(num_blocks, block_size, elastic.reserve_blocks)
        else:  # static overcommit: the region is in the pool for good
            self.pool = BlockPool(num_blocks + elastic.reserve_blocks, block_size)
        self.config = scheduler_config or SchedulerConfig()
        self.kv = KVCacheManager(self.pool, self.config.enable_prefix_caching, self.config.block_hasher())
        self.cache = self.kv.cache
        self.scheduler = Scheduler(self.config, self.kv, connector)
        self.max_context = max_context
        self.num_steps = 0
        self.busy_s = 0.0
        self.cohort_run_steps = 0  # of num_steps, those run by cohort_run_begin (no plan)
        self.cohort_chunk_steps = 0  # of num_steps, the cohort plus one prompt chunk (step's fast path)
        self._chunk_fast = False  # the executor runs those (execute_cohort_chunk): on with the cohort
        self._run_shapes: dict[int, DecodeRunStep] = {}  # _cohort_run's plan stand-ins, per member count
        self._cohort_steps: dict[int, CohortStep] = {}  # cohort_run_begin's
        # a request must fit the pool it can always count on (lent blocks may be reclaimed)
        self.max_request_blocks = (
            num_blocks if elastic is not None and elastic.mode == "elastic" else self.pool.num_blocks
        )
        self.elastic = (
            ElasticReserve(elastic, self.pool, self.cache, num_blocks) if elastic is not None else None
        )
        self.failed = False  # static overcommit ran out of activation memory (CUDA OOM)
        self.failure_reason: str | None = None
        self._pending_s = 0.0  # modelled lend/reclaim latency not yet charged to a step

    # -- admission ----------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.pool.capacity_tokens

    def rejection_reason(self, req: Request) -> str | None:
        if self.failed:
            return OOM
        need = req.num_prompt_tokens + req.max_tokens
        if need > self.max_context:
            return (
                f"context_length: prompt ({req.num_prompt_tokens}) + max_tokens ({req.max_tokens}) = {need} "
                f"exceeds the model context ({self.max_context})"
            )
        if self.pool.blocks_for_tokens(req.max_total_tokens) > self.max_request_blocks:
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

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def kv_used_tokens(self) -> int:
        return self.scheduler.kv_used_tokens

    def load(self) -> InstanceLoad:
        """A typed snapshot of what this instance holds and still has to do (O(requests))."""
        sched = self.scheduler
        sched.settle()  # the decode cohort's requests written up to now
        prefill = decode = remaining = 0
        for r in sched.running:
            prompt_left = r.num_prompt_tokens - r.num_computed_tokens
            if prompt_left > 0:
                prefill += prompt_left
            else:
                decode += r.num_computed_tokens
            remaining += r.max_tokens - r.num_output_tokens
        for r in (*sched.waiting, *sched.loading.values()):
            prefill += r.num_tokens - r.num_computed_tokens
            remaining += r.max_tokens - r.num_output_tokens
        return InstanceLoad(
            name=self.name,
            num_waiting=sched.num_waiting,
            num_running=sched.num_running,
            num_loading=sched.num_loading,
            queued_prefill_tokens=prefill,
            decode_tokens=decode,
            remaining_output_tokens=remaining,
            kv_used_tokens=sched.kv_used_tokens,
            kv_cached_tokens=(
                self.cache.evictable_blocks * self.pool.block_size if self.cache is not None else 0
            ),
            kv_capacity_tokens=self.kv_capacity_tokens,
            busy_s=self.busy_s,
            num_steps=self.num_steps,
            num_preemptions=sched.num_preemptions,
            admitted_tokens=sched.admitted_tokens,
            prefix_hit_tokens=sched.prefix_hit_tokens,
            external_hit_tokens=sched.external_hit_tokens,
            prefix_token_mismatches=self.cache.num_token_mismatches if self.cache is not None else 0,
        )

    def enable_decode_cohort(self) -> bool:
        """Run this instance's plain decodes as a cohort (``scheduler/cohort.py``: a step costs O(prefill
        sequences + block events), the result bit for bit the step-by-step one) if the executor takes cohort
        plans (``supports_decode_runs``) and there is no elastic reserve; returns whether it is on. For a
        caller where nothing reads running requests between steps but through this instance (``load``,
        ``abort``, ``finish_request``, ``check_invariants`` bring them up to date)."""
        ex = self.executor
        if self.elastic is not None or not getattr(ex, "supports_decode_runs", False):
            return False
        self.scheduler.enable_cohort(ex.decode_tokens)
        self.kv.enable_lazy_hashes()
        self._chunk_fast = hasattr(ex, "execute_cohort_chunk")
        return True

    # -- stepping -----------------------------------------------------------------
    def step(self, now: float) -> StepOutcome | None:
        elastic = self.elastic
        if elastic is not None:
            if self.failed:
                return None
            self._pending_s += self._switch_reserve(elastic, now)
        plan = self.scheduler.schedule(now)
        if self._chunk_fast and plan.cohort_seqs and len(plan.seqs) == 1 and plan.seqs[0].num_new_tokens > 1:
            if not plan.kv_loads and not plan.kv_saves:  # the cohort plus one prompt chunk (no elastic here)
                result = self.executor.execute_cohort_chunk(plan)
                self.num_steps += 1
                self.cohort_chunk_steps += 1
                self.busy_s += result.duration_s
                return CohortChunkOutcome(plan, result, now)
        if plan.is_empty:
            return None
        if elastic is not None:
            if not elastic.fits(plan):
                self._fail(OOM, now)
                return None
            result = self.executor.execute(plan)
            if self._pending_s:
                result.duration_s += self._pending_s
                result.breakdown.overhead_s += self._pending_s
                self._pending_s = 0.0
        else:
            result = self.executor.execute(plan)
        self.num_steps += 1
        self.busy_s += result.duration_s
        return StepOutcome(plan, result, now)

    def _switch_reserve(self, elastic: ElasticReserve, now: float) -> float:
        """The elastic reserve's lend or reclaim before planning: the scheduler preempts the requests that
        hold lent blocks, the reserve attaches or detaches its region, admission closes or reopens."""
        sched = self.scheduler
        switch = elastic.before_step(sched.running, bool(sched.waiting), sched.has_prefill_work())
        for req in switch.preempt:
            sched.preempt(req)
        latency_s = elastic.apply(switch, now)
        if switch.admission_open is not None:
            sched.admission_open = switch.admission_open
        return latency_s

    def decode_run(
        self,
        now: float,
        horizon_s: float,
        on_step: Callable[[StepOutcome, float], None],
        max_steps: int = 1 << 20,
    ) -> float | None:
        """Run at once the decode-only steps that follow from ``now`` while nothing can change their shape,
        exactly as one :meth:`step` and :meth:`complete` each would (same blocks, tokens, times and counters),
        and return when the last one ends (None: not one step could be run this way; step normally).

        A run needs the scheduler's ``decode_run_ready``, an executor with ``supports_decode_runs``, no elastic
        reserve, and ends before: a step that would end at or after ``horizon_s`` (the caller's next event that
        can read or change this instance), a request's last token, a step whose new blocks are more than the
        free ones (eviction and preemption take the normal path), or ``max_steps``. Per step it costs the cost
        model's step time and the block events (a block allocated or filled), not one update per request;
        ``on_step(outcome, end_s)`` gets each step as the normal path's hooks would (``outcome.plan`` is a
        ``DecodeRunStep``: token and sequence counts only; requests' token lists catch up at block events and
        at the end)."""
        ex = self.executor
        if self.elastic is not None or self.failed or not getattr(ex, "supports_decode_runs", False):
            return None
        sched = self.scheduler
        if not sched.decode_run_ready():
            return None
        reqs = list(sched.running)
        n = len(reqs)
        c0 = [r.num_computed_tokens for r in reqs]
        ctx = sum(c0)
        first_s = ex.decode_step_s(n, ctx + n)
        if not now + first_s < horizon_s:  # the first step already reaches the horizon: step normally
            return None
        steps_left = (
            min(r.sampling.max_tokens - len(r.output_token_ids) for r in reqs) - 1
        )  # the last is normal
        limit = min(steps_left, max_steps)
        if limit < 1:
            return None
        kv, pool, bs = sched.kv, self.pool, self.pool.block_size
        caching = sched.cache is not None
        # block events by step residue mod bs, in running order (the order the normal path meets them)
        allocs: dict[int, list[int]] = {}
        first_alloc = []
        fills: dict[int, list[int]] = {}
        for i, r in enumerate(reqs):
            a = len(r.block_ids) * bs - c0[i] + 1  # first step whose token needs a new block
            first_alloc.append(a)
            allocs.setdefault(a % bs, []).append(i)
            fills.setdefault(-c0[i] % bs, []).append(i)
        done = [0] * n  # steps already written into each request's token lists
        ends: list[float] = []
        t = now
        for j in range(1, limit + 1):
            d = first_s if j == 1 else ex.decode_step_s(n, ctx + j * n)
            end = t + d
            if not end < horizon_s:
                break
            grow = [i for i in allocs.get(j % bs, ()) if first_alloc[i] <= j]
            if len(grow) > pool.num_free:
                break
            for i in grow:
                if not kv.allocate_slots(reqs[i], c0[i] + j):
                    raise RuntimeError("block accounting: a decode run's block failed to allocate")
            ex.note_step(d)
            self.num_steps += 1
            self.busy_s += d
            ends.append(end)
            if caching:
                for i in fills.get(j % bs, ()):
                    self._catch_up(reqs[i], c0[i], done, i, j, ends)
                    kv.cache_full_blocks(reqs[i])
            on_step(StepOutcome(DecodeRunStep(n, n), StepResult(d), t), end)
            t = end
        if not ends:
            return None
        for i, r in enumerate(reqs):
            self._catch_up(r, c0[i], done, i, len(ends), ends)
        return t

    def cohort_run_begin(
        self,
        now: float,
        horizon_s: float,
        on_step: Callable[[StepOutcome, float], None],
        on_finish: Callable[[Request], None],
        columns: StepColumns | None = None,
        cross: Callable[[float, float, int], float | None] | None = None,
    ) -> tuple[float, StepOutcome | None]:
        """Run the steps from ``now`` that are the decode cohort's alone (``Scheduler.cohort_run_ready``), each
        exactly as :meth:`step` then :meth:`complete` would (same blocks, tokens, times, counters), without a
        plan: per step, the cost model's time from the cohort's two sums (``decode_step_fn``) and the members'
        block events. ``on_step(outcome, end_s)`` gets each step (``outcome.plan`` is a ``DecodeRunStep``,
        ``outcome.result`` a ``RunStepResult``: counts and duration only), then ``on_finish`` each request it
        finished; with ``columns``, the steps are added there instead (for a hook that only records) and
        ``on_finish`` gets the finished requests at the end. The run stops at a step whose new blocks might need
        a preemption, when the next step is no longer the cohort's alone, and at the step that would end at or
        after ``horizon_s`` (the caller's next event that can read or change this instance): that one is begun
        where it is the cohort's alone, as :meth:`step` would begin it but without a plan (its new blocks
        allocated, its time from ``decode_step_fn``, the same as ``execute``'s). ``cross``: asked before
        beginning it whether to run it and go on to a later horizon (``Scheduler.cohort_run``).

        Returns the time reached and the begun step's outcome (``outcome.plan`` a ``CohortStep``,
        ``outcome.result`` a ``RunStepResult``; :meth:`complete` ends it, ``Scheduler.cohort_step_end``), or
        None: none begun; :meth:`step` plans the next step."""
        begun: list[tuple[float, float, int]] = []
        t = self._cohort_run(now, horizon_s, on_step, on_finish, columns, lambda *a: begun.append(a), cross)
        if not begun:
            return t, None
        start_s, d, n = begun[0]
        return t, self._begun(start_s, d, n)

    def _cohort_run(
        self,
        now: float,
        horizon_s: float,
        on_step: Callable[[StepOutcome, float], None],
        on_finish: Callable[[Request], None],
        columns: StepColumns | None,
        begin: Callable[[float, float, int], None] | None,
        cross: Callable[[float, float, int], float | None] | None = None,
    ) -> float:
        if self.elastic is not None or self.failed:
            return now
        ex = self.executor
        if columns is not None:
            return self._cohort_run_recorded(now, horizon_s, on_finish, columns, begin, cross)
        shapes = self._run_shapes

        def step_done(start_s: float, d: float, n: int, finished: list[Request]) -> None:
            ex.note_step(d)
            self.num_steps += 1
            self.cohort_run_steps += 1
            self.busy_s += d
            plan = shapes.get(n)
            if plan is None:
                plan = shapes[n] = DecodeRunStep(n, n)
            on_step(StepOutcome(plan, RunStepResult(d), start_s), start_s + d)
            for req in finished:
                on_finish(req)

        return self.scheduler.cohort_run(now, horizon_s, ex.decode_step_fn, step_done, begin, cross)

    def _begun(self, start_s: float, d: float, n: int) -> StepOutcome:
        """Account a cohort-only step begun at ``start_s`` (as :meth:`step` does) and give its outcome."""
        self.executor.note_step(d)
        self.num_steps += 1
        self.cohort_run_steps += 1
        self.busy_s += d
        plan = self._cohort_steps.get(n)
        if plan is None:
            plan = self._cohort_steps[n] = CohortStep(n, n)
        return StepOutcome(plan, RunStepResult(d), start_s)

    def _cohort_run_recorded(
        self,
        now: float,
        horizon_s: float,
        on_finish: Callable[[Request], None],
        cols: StepColumns,
        begin: Callable[[float, float, int], None] | None = None,
        cross: Callable[[float, float, int], float | None] | None = None,
    ) -> float:
        ex, sched, kv = self.executor, self.scheduler, self.kv
        first = len(cols)
        add = cols.add
        done: list[Request] = []

        def step_done(start_s: float, d: float, n: int, finished: list[Request]) -> None:
            add(start_s, d, n, len(sched.running), len(sched.waiting), kv.kv_used_tokens)
            if finished:
                done.extend(finished)

        t = sched.cohort_run(now, horizon_s, ex.decode_step_fn, step_done, begin, cross)
        durations = cols.durations_s
        if len(durations) > first:
            for i in range(first, len(durations)):  # the same sums, in the same order, as step by step
                d = durations[i]
                ex.note_step(d)
                self.busy_s += d
            self.num_steps += len(durations) - first
            self.cohort_run_steps += len(durations) - first
            for req in done:
                on_finish(req)
        return t

    def _catch_up(self, req: Request, c0: int, done: list[int], i: int, j: int, ends: list[float]) -> None:
        """Write steps done[i]+1 .. j of a decode run into ``req`` (computed tokens, tokens, token times)."""
        k = done[i]
        if k == j:
            return
        req.num_computed_tokens = c0 + j
        req.output_token_ids.extend(self.executor.decode_tokens(req.request_id, c0 + k + 1, j - k))
        req.token_times_s.extend(ends[k:j])
        done[i] = j

    def complete(self, outcome: StepOutcome, now: float) -> list[Request]:
        plan = outcome.plan
        if plan.__class__ is CohortStep:  # begun by cohort_run_begin
            return self.scheduler.cohort_step_end(now)
        if outcome.__class__ is CohortChunkOutcome:  # step's fast path
            return self.scheduler.cohort_chunk_end(plan, outcome.result, now)
        return self.scheduler.update(plan, outcome.result, now)

    def _fail(self, reason: str, now: float) -> None:
        """The instance is dead (e.g. CUDA OOM): reject everything it holds with ``reason``."""
        self.failed = True
        self.failure_reason = reason
        sched = self.scheduler
        for req in [*sched.running, *sched.waiting]:
            sched.finish_request(req, reason, now, state=RequestState.REJECTED)
            req.reject_reason = reason

    def abort(self, req: Request, now: float) -> None:
        self.scheduler.abort(req, now)

    def transfers_done(self, finished_loads: list[str], finished_saves: list[str]) -> None:
        """The worker half finished these KV transfers between steps (e.g. a cluster's link model): loaded
        requests become runnable, blocks held for a save are released."""
        if finished_loads or finished_saves:
            self.scheduler._apply_transfers(list(finished_loads), list(finished_saves))

    def finish_request(self, req: Request, reason: str, now: float) -> None:
        """End a request from outside with ``reason`` (e.g. a stop string matched in the detokenised text)."""
        self.scheduler.finish_request(req, reason, now)

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()


@dataclass(frozen=True)
class InstanceConfig:
    """What one instance is, whatever runs its steps (the simulator, the real engine, an experiment).

    ``chunk_size`` is the per-step token budget asked for; the policy turns it into the one it runs with
    (``vllm`` runs whole prompts, so its budget covers the longest admissible prompt).
    """

    kv_tokens: int
    block_size: int = 16
    policy: str = "sarathi"
    chunk_size: int = 512
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    max_context: int = 1 << 30
    elastic: ElasticConfig | None = None
    name: str = "instance-0"
    prefix_caching_hash_algo: str = "sha256"  # sha256 / blake2b name real KV; poly64: simulation
    prefix_caching_salt: str = ""
    prefix_caching_model: str = ""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.kv_tokens < self.block_size:
            raise ValueError(
                f"kv_tokens: {self.kv_tokens} is less than one block of {self.block_size} tokens"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES.names())}, got {self.policy!r}")

    @property
    def num_blocks(self) -> int:
        return self.kv_tokens // self.block_size

    @property
    def token_budget(self) -> int:
        return POLICIES.get(self.policy).token_budget(self.chunk_size, self.max_context)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            policy=self.policy,
            max_num_batched_tokens=self.token_budget,
            max_num_seqs=self.max_num_seqs,
            enable_prefix_caching=self.enable_prefix_caching,
            watermark=self.watermark,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            prefix_caching_salt=self.prefix_caching_salt,
            prefix_caching_model=self.prefix_caching_model,
        )


def build_instance(
    config: InstanceConfig, executor: Executor, connector: KVConnector | None = None
) -> Instance:
    """The one way an instance is assembled (simulation, the real engine and the experiments)."""
    return Instance(
        executor,
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        scheduler_config=config.scheduler_config(),
        max_context=config.max_context,
        name=config.name,
        elastic=config.elastic,
        connector=connector,
    )
