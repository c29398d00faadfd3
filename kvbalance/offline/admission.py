"""Dual-scan admission on a live engine: the scheduler-facing half of dual scanning (BlendServe section 4.4).

The planner's static ``order`` plays the scan out on a fluid clock; this component plays it against the real
engine state instead. It holds the density-ordered requests and, before every step, releases requests into
the engine's waiting queue from the two ends under both of the scan's per-step limits (``dual_scan.py``):

* memory: a side may add requests while the KV its released, unfinished requests hold on average over their
  lives (p + d / 2 tokens each, with d the estimated output) stays within its share M_L or M_R (the paper's
  rule, ``memory_rule="average"``). ``memory_rule="peak"`` also keeps the peak of the memory-heavy side's
  projected KV within M_R: each released request holds p + its outputs so far and grows one token a step
  until its estimated output ends, and a new one may start only if that sum, with it, never exceeds the
  share. On averages a wave of long decodes starts together, grows in step and fills the whole memory at
  once (the compute-heavy side's prefills stop) before it ends together; the peak rule staggers them, which
  pays when the memory-heavy work spans several generations of the share and costs when it fits in one (a
  stagger then only delays the longest chain). ``memory_rule="auto"`` (the default) takes the peak rule when
  the memory-heavy requests' estimated KV area, sum (p d + d^2 / 2), exceeds 1.5 times the share held for the
  longest one's life (``generations``), the average rule otherwise. The peak rule trusts the estimated
  lengths, so the estimates of the memory-heavy requests are refined as they finish (``refit_lengths``,
  ``refit.py``: one Kaplan-Meier fit per group of requests estimated alike, the running ones censored).
  Measured in docs/reproductions.md (BlendServe, issue 28);
* prefill: a side may add requests while its prefill budget C_L or C_R (tokens per step, credited every step,
  none banked past one step) has credit; a release spends the request's computed prompt tokens. C_L follows
  ``budget_rule`` (``dual_scan.py``): by default the rate at which the compute-heavy side ends when the
  memory-heavy one does, counted from what is pending and from the running memory-heavy requests' remaining
  estimated outputs and KV area.

Both are recomputed each step from the densities and lengths at the two ends. The engine then admits what it
was given FCFS, so memory pressure and the prefill tokens of each step follow the plan's balance instead of
the queue's length.

The budgets are the step's chunked-prefill sizes, as in the paper (``pace_engine``, the default): before each
step the engine's token budget is set to its decoding requests plus C_L + C_R (at least 128 tokens), so a
released prompt is computed over the following steps at the budgets' rate. Credit alone paces releases, not
chunks: a 1,000-token prompt released on credit of 400 was prefilled whole in one step under the engine's
2,048-token budget, a compute-bound step followed by memory-bound ones with nothing to hide under them
(BlendServe trace #1, 16k requests: 71.5% of the practical optimum with credit alone, 81.7% paced;
docs/reproductions.md). Once the scan has released everything the engine's own budget returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvbalance.offline.dual_scan import BUDGET_RULES, CHUNK_QUANTUM, PrefillBudget, ScanEnds
from kvbalance.offline.refit import LengthRefit
from kvbalance.request import Request

MEMORY_RULES = ("auto", "peak", "average")
AUTO_PEAK_GENERATIONS = 1.5  # ``memory_rule="auto"``: the peak rule past this many generations (see above)


class DualScanAdmission:
    """Feeds ``warmup`` first, then ``seq`` (density non-increasing) from both ends under M_L / M_R and
    C_L / C_R (``enforce_budgets=False``: memory shares only).

    ``feeds`` tells a runner that this component adds the requests itself (``before_step`` calls
    ``instance.add_request``); ``pending`` is how many it still holds. Built by the planner over indices;
    ``bind(requests)`` gives a fresh copy that feeds those request objects (indexed like the planned job).
    ``prompt_lens`` are the prompt tokens a request computes (its shared prefix amortised), ``output_lens``
    the estimated outputs.
    """

    feeds = True

    def __init__(
        self,
        warmup: Sequence[int],
        seq: Sequence[int],
        prompt_lens: np.ndarray,
        output_lens: np.ndarray,
        eff_comp_s: np.ndarray,
        mem_s: np.ndarray,
        rho_root: float,
        m_tokens: float,
        chunk_tokens: int = 2048,
        enforce_budgets: bool = True,
        budget_rule: str = "aligned",
        requests: Sequence[Request] = (),
        memory_rule: str = "auto",
        pace_engine: bool = True,
        refit_lengths: bool = True,
    ) -> None:
        if budget_rule not in BUDGET_RULES:
            raise ValueError(f"budget_rule: must be one of {', '.join(BUDGET_RULES)}, got {budget_rule!r}")
        if memory_rule not in MEMORY_RULES:
            raise ValueError(f"memory_rule: must be one of {', '.join(MEMORY_RULES)}, got {memory_rule!r}")
        self._args = (warmup, seq, prompt_lens, output_lens, eff_comp_s, mem_s, rho_root, m_tokens)
        self._kw = {
            "chunk_tokens": chunk_tokens,
            "enforce_budgets": enforce_budgets,
            "budget_rule": budget_rule,
            "memory_rule": memory_rule,
            "pace_engine": pace_engine,
            "refit_lengths": refit_lengths,
        }
        self.pace_engine = pace_engine
        self._engine_budget: int | None = None  # the engine's own token budget, restored after the scan
        self.budget_rule = budget_rule
        self.memory_rule = memory_rule
        self.requests = requests
        self.warmup = list(warmup)
        self.seq = list(seq)
        self.pc = np.asarray(prompt_lens, dtype=np.float64)
        d = np.asarray(output_lens, dtype=np.float64)
        self.d0 = d  # the planner's estimates (priors)
        self.d = d.copy()  # the current estimates (``refit_lengths``)
        self.foot = self.pc + self.d / 2
        comp = np.asarray(eff_comp_s, dtype=np.float64)
        mem = np.asarray(mem_s, dtype=np.float64)
        self.heavy = (mem > 0) & (comp < rho_root * mem)  # memory-heavy: density below the job's
        s = np.asarray(self.seq, dtype=np.int64)
        take = (lambda a: np.asarray(a, dtype=np.float64)[s]) if len(s) else (lambda a: np.zeros(0))
        self._take = take
        self._comp_mem = (eff_comp_s, mem_s)
        self.ends = ScanEnds(take(eff_comp_s), take(mem_s), take(self.pc), take(self.d), rho_root, area=True)
        # one fit per prior value among the memory-heavy requests: requests estimated alike were estimated
        # from the same samples (one subtree's), so their errors share a factor; others do not
        self.refit: dict[float, LengthRefit] | None = {} if refit_lengths else None
        self._refit_step = 0
        self._refit_mean: dict[float, float] = {}
        self.rho_root = rho_root
        self.m_tokens = m_tokens
        self.generations = self._generations()
        if memory_rule == "auto":
            self.memory_rule = "peak" if self.generations > AUTO_PEAK_GENERATIONS else "average"
        self.chunk_tokens = chunk_tokens
        self.enforce_budgets = enforce_budgets
        self.left, self.right = 0, len(self.seq) - 1
        self.live: list[list[int]] = [[], []]  # released, unfinished request indices per side
        self.used = [0.0, 0.0]
        self.credit = [PrefillBudget(), PrefillBudget()]
        self.released: list[int] = []  # release order (every request exactly once)
        self.split: tuple[float, float] = (0.0, 0.0)  # this step's M_L, M_R
        self.budgets: tuple[int, int] = (0, 0)  # this step's C_L, C_R
        self.released_tokens: list[tuple[float, float]] = []  # per step: prompt tokens released per side

    def _generations(self) -> float:
        """How many times over the memory-heavy requests' estimated KV area, sum (p d + d^2 / 2), fills the
        memory-heavy share for the longest one's life (0: none)."""
        if not len(self.seq):
            return 0.0
        s = np.asarray(self.seq, dtype=np.int64)
        heavy = s[self.heavy[s]]
        if not len(heavy):
            return 0.0
        pc, d = self.pc[heavy], self.d[heavy]
        m_r = self.ends.split(0, len(self.seq) - 1, self.rho_root, self.m_tokens)[1]
        span = m_r * float(d.max())
        return float((pc * d + d * d / 2).sum()) / span if span > 0 else 0.0

    def bind(self, requests: Sequence[Request]) -> DualScanAdmission:
        return DualScanAdmission(*self._args, **self._kw, requests=requests)

    @property
    def pending(self) -> int:
        return len(self.warmup) + max(self.right - self.left + 1, 0)

    def _live_memory(self) -> tuple[int, float, float, float]:
        """(count, estimated output tokens still to decode, longest of them, KV-token-steps still to hold)
        of the released, unfinished memory-heavy requests."""
        rem, area = [], 0.0
        for side in (0, 1):
            for i in self.live[side]:
                if self.heavy[i]:
                    g = self.requests[i].num_output_tokens
                    r = max(float(self.d[i]) - g, 1.0)
                    rem.append(r)
                    area += (float(self.pc[i]) + g) * r + r * r / 2
        return len(rem), float(sum(rem)), max(rem, default=0.0), area

    def _peak_fits(self, i: int, cap: float) -> bool:
        """Whether the memory-heavy side's projected KV, with request ``i`` started now, stays within ``cap``
        at every future step (no later release counted): each live request holds its computed prompt plus
        its outputs so far and grows by one token a step until its estimated output is done."""
        held, left = [float(self.pc[i])], [max(float(self.d[i]), 1.0)]
        for j in self.live[1]:
            g = self.requests[j].num_output_tokens
            held.append(float(self.pc[j]) + g)
            left.append(max(float(self.d[j]) - g, 1.0))
        k, r = np.asarray(held), np.asarray(left)
        order = np.argsort(r, kind="stable")
        k, r = k[order], r[order]
        # just before the request with the t-th shortest remainder ends (step r_t - 1), every request from t on
        # still runs and has grown by r_t - 1 tokens: the sum peaks at one of those steps
        alive_k = np.cumsum(k[::-1])[::-1]
        alive_n = np.arange(len(r), 0, -1)
        return float(np.max(alive_k + alive_n * (r - 1.0))) <= cap

    def memory_allows(self, side: int, i: int, budget: tuple[float, float]) -> bool:
        """Whether ``side`` may start request ``i`` under its memory limit this step (``memory_rule``)."""
        if self.used[side] + float(self.foot[i]) > self._memory_cap(side, budget):
            return False
        return side == 0 or self.memory_rule == "average" or self._peak_fits(i, budget[1])

    def _memory_cap(self, side: int, budget: tuple[float, float]) -> float:
        """The KV a side may hold: its share; the compute-heavy side also whatever the other leaves free
        (its requests hold little KV for few steps, so its prefill budget, not memory, paces it)."""
        if side == 0:
            return max(budget[0], self.m_tokens - self.used[1])
        return budget[1]

    def _release(self, instance, i: int, now: float) -> None:
        self.released.append(i)
        instance.add_request(self.requests[i], now)

    def _pace(self, instance) -> None:
        """Set the engine's token budget for this step: its decodes plus C_L + C_R while the scan runs
        (``pace_engine``), its own budget after."""
        config = instance.scheduler.config
        if self._engine_budget is None:
            self._engine_budget = config.max_num_batched_tokens
        if self.left > self.right:
            config.max_num_batched_tokens = self._engine_budget
            return
        decodes = sum(
            1
            for r in instance.scheduler.running
            if r.num_prompt_tokens + r.num_output_tokens - r.num_computed_tokens == 1
        )
        chunk = max(CHUNK_QUANTUM, self.budgets[0] + self.budgets[1])
        config.max_num_batched_tokens = decodes + min(chunk, self._engine_budget)

    def before_step(self, instance, now: float) -> None:
        self._scan(instance, now)
        if self.pace_engine and self.enforce_budgets:
            self._pace(instance)

    REFIT_EVERY = 512  # steps between refits when no memory-heavy request finished

    def _refit(self, finished: list[int]) -> None:
        """Record finished memory-heavy requests and, where a group's fit is active, refine the estimates of
        its running and pending requests (``refit.py``); the scan's window sums follow."""
        fits = self.refit
        heavy_done = [i for i in finished if self.heavy[i]]
        for i in heavy_done:
            key = float(self.d0[i])
            fits.setdefault(key, LengthRefit()).add(self.requests[i].num_output_tokens, key)
        self._refit_step += 1
        if not heavy_done and self._refit_step < self.REFIT_EVERY:
            return
        self._refit_step = 0
        live: dict[float, list[int]] = {}
        for side in (0, 1):
            for i in self.live[side]:
                if self.heavy[i] and float(self.d0[i]) in fits:
                    live.setdefault(float(self.d0[i]), []).append(i)
        moved: dict[float, float] = {}
        for key, rf in fits.items():
            if not rf.active:
                continue
            mine = live.get(key, [])
            rf.fit([self.requests[i].num_output_tokens / max(key, 1.0) for i in mine])
            for i in mine:
                self.d[i] = rf.estimate(key, self.requests[i].num_output_tokens)
                self.foot[i] = self.pc[i] + self.d[i] / 2
            old = self._refit_mean.get(key, 1.0)
            if abs(rf.mean_ratio - old) > 0.01 * old:
                moved[key] = self._refit_mean[key] = rf.mean_ratio
        if moved and self.left <= self.right:
            pending = np.asarray(self.seq[self.left : self.right + 1], dtype=np.int64)
            pending = pending[self.heavy[pending]]
            for key, mean in moved.items():
                group = pending[self.d0[pending] == key]
                self.d[group] = np.maximum(key * mean, 1.0)
                self.foot[group] = self.pc[group] + self.d[group] / 2
            comp, mem = self._comp_mem
            take = self._take
            self.ends = ScanEnds(take(comp), take(mem), take(self.pc), take(self.d), self.rho_root, area=True)
        for side in (0, 1):
            self.used[side] = float(self.foot[self.live[side]].sum()) if self.live[side] else 0.0

    def _scan(self, instance, now: float) -> None:
        done: list[int] = []
        for side in (0, 1):  # forget finished requests
            keep = [i for i in self.live[side] if not self.requests[i].is_finished]
            if len(keep) != len(self.live[side]):
                done.extend(i for i in self.live[side] if self.requests[i].is_finished)
                self.live[side] = keep
                self.used[side] = float(self.foot[keep].sum()) if keep else 0.0
        if self.refit is not None:
            self._refit(done)
        while self.warmup:
            self._release(instance, self.warmup.pop(0), now)
        if self.left > self.right:
            return
        budget = self.ends.split(self.left, self.right, self.rho_root, self.m_tokens)
        c = self.ends.budgets(
            self.left, self.right, budget, self.chunk_tokens, self.budget_rule, self._live_memory()
        )
        self.split, self.budgets = budget, c
        out = [0.0, 0.0]
        for side in (0, 1):
            self.credit[side].new_step(c[side])
            while self.left <= self.right:
                i = self.seq[self.left] if side == 0 else self.seq[self.right]
                idle = (
                    not self.live[0] and not self.live[1]
                )  # nothing runs: start something, whatever the limits
                first = not self.live[side] and budget[side] > 0  # a side with memory may always start one
                if not idle:
                    if not first and not self.memory_allows(side, i, budget):
                        break
                    if self.enforce_budgets and not self.credit[side].open:
                        break
                self.used[side] += float(self.foot[i])
                self.credit[side].spend(float(self.pc[i]))
                out[side] += float(self.pc[i])
                self.live[side].append(i)
                if side == 0:
                    self.left += 1
                else:
                    self.right -= 1
                self._release(instance, i, now)
        self.released_tokens.append((out[0], out[1]))


class InBatchPrefixDefer:
    """SGLang's in-batch prefix check, for every planner's engine: a waiting request whose first
    ``min_cached_blocks`` blocks (32 tokens at block 16: SGLang's in-batch threshold) are still being
    prefilled by a running request (or by one admitted ahead of it in this step), and that finds fewer than
    that many of its blocks in the cache, sits out this step instead of computing the same prefix again in the
    same batch (SGLang deprioritises requests sharing an in-batch prefix of 32+ tokens for one round). It is
    held out of the queue during the step and put back at its place after. Without it a DFS order, which puts
    a prefix's requests side by side, admits a group together and shares nothing within it. Only the first
    ``window`` waiting requests are examined per step. A prefix shorter than the threshold is not a shared
    prefix to this check (two requests whose first block alone is equal both run).
    """

    feeds = False

    def __init__(self, window: int = 64, min_cached_blocks: int = 2) -> None:
        self.window = window
        self.min_cached_blocks = min_cached_blocks
        self._held: list[Request] = []

    def bind(self, requests) -> InBatchPrefixDefer:
        return InBatchPrefixDefer(self.window, self.min_cached_blocks)

    def before_step(self, instance, now: float) -> None:
        sched = instance.scheduler
        waiting = sched.waiting
        if sched.cache is None or len(waiting) < 2:
            return
        kv, bs = sched.kv, sched.block_size
        k = self.min_cached_blocks
        span = k * bs  # the chained hash of block k - 1 names the first k blocks
        inflight = set()
        for r in sched.running:
            if r.num_computed_tokens < r.num_prompt_tokens and r.num_prompt_tokens >= span:
                inflight.add(kv.block_hashes(r, span)[k - 1])
        head = [waiting.popleft() for _ in range(min(self.window, len(waiting)))]
        keep: list[Request] = []
        for r in head:
            first = kv.block_hashes(r, span)[k - 1] if r.num_prompt_tokens >= span else None
            if first is not None and first in inflight and r.num_preemptions == 0:
                if kv.get_computed_blocks(r).num_blocks < k:
                    self._held.append(r)
                    continue
            keep.append(r)
            if first is not None:
                inflight.add(first)
        waiting.extendleft(reversed(keep))

    def after_step(self, instance, now: float) -> None:
        if self._held:
            instance.scheduler.waiting.extendleft(reversed(self._held))
            self._held = []

    @property
    def num_held(self) -> int:
        return len(self._held)
