"""Dual scanning (BlendServe section 4.4): admit from both ends of the density-sorted leaves at once.

The left end holds compute-heavy requests (rho_L > rho_root), the right end memory-heavy ones (rho_R <
rho_root). The free KV memory M is split so the running mix has the job's density:

    M_L = M (rho_root - rho_R) / (rho_L - rho_R),  M_R = M - M_L   =>   rho_L M_L + rho_R M_R = rho_root M

Each side keeps about N = M_side / (p + d / 2) requests decoding (a request holds p + d / 2 tokens of KV on
average over its life) and needs a prefill budget of C = N p / d tokens per step to keep them coming; the
budgets are multiples of 128 tokens, as in the paper, and together at most the engine's chunk budget. Both
limits hold per step: a side admits while its KV share has room AND its prefill budget has tokens left this
step (``PrefillBudget``: C tokens of credit per step, none banked past one step), so the compute-heavy side's
prefills are spread over the memory-heavy side's decode steps instead of arriving in bursts that leave later
steps with memory work only. The compute-heavy side is paced by its budget, not capped by its share: its
requests hold little KV for few steps, so it may use what the memory-heavy side leaves free.

The compute-heavy side's budget C_L (``budget_rule``):

* ``"aligned"`` (default): the rate at which both sides end together, C_L = (prompt tokens the compute-heavy
  requests still have to compute) / (decode steps the memory-heavy side still needs: its pending and running
  requests' output tokens over the number it runs at once, at least the longest running one's remaining
  output), at most the chunk budget; the whole chunk budget once no memory-heavy request is left. The
  paper's rho_L M_L + rho_R M_R = rho_root M balance aims at the same end: measured on its trace #1 (64k
  requests), the paper's C_L paces the compute side at 512 tokens per step where ending together needs about
  1,000, because the density formulas leave the weight reads of every step out of its memory time, and the
  compute work is then spread over nearly twice the steps the memory work needs.
* ``"paper"``: C_L = N_L p / d as above.

The scan is played out on a fluid clock counted in decode steps (a request occupies its side's memory from
its admission until its d steps are done), which turns it into a static admission order; ``admission.py``
plays the same rules against the live engine.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

CHUNK_QUANTUM = 128  # the paper's chunked-prefill granularity (tokens)
WINDOW = 32  # requests at each end whose mean density stands for rho_L / rho_R


def memory_split(m_tokens: float, rho_root: float, rho_l: float, rho_r: float) -> tuple[float, float]:
    """(M_L, M_R) with M_L + M_R = M and rho_L M_L + rho_R M_R = rho_root M, clamped to [0, M] when rho_root
    lies outside [rho_R, rho_L] (then one side gets everything)."""
    if m_tokens < 0:
        raise ValueError(f"m_tokens: must be >= 0, got {m_tokens}")
    if rho_l <= rho_r:
        return m_tokens / 2, m_tokens / 2
    m_l = m_tokens * (rho_root - rho_r) / (rho_l - rho_r)
    m_l = min(max(m_l, 0.0), m_tokens)
    return m_l, m_tokens - m_l


def side_budget(m_side_tokens: float, p: float, d: float) -> tuple[float, int]:
    """(N, C): decode requests a side holds, N = M_side / (p + d / 2), and its per-step prefill budget
    C = N p / d rounded up to a multiple of 128 tokens."""
    n = m_side_tokens / (p + d / 2) if p + d / 2 > 0 else 0.0
    c = n * p / d if d > 0 else 0.0
    return n, int(math.ceil(c / CHUNK_QUANTUM) * CHUNK_QUANTUM)


def step_budgets(
    m_split: tuple[float, float],
    means: tuple[tuple[float, float], tuple[float, float]],
    chunk_tokens: int,
) -> tuple[int, int]:
    """(C_L, C_R) for memory shares ``m_split`` and each side's (mean computed prompt, mean output) at its
    end; each at least 128 tokens where the side has memory, scaled down together to fit ``chunk_tokens``."""
    c = []
    for m, (p, d) in zip(m_split, means):
        c.append(max(side_budget(m, p, d)[1], CHUNK_QUANTUM) if m > 0 else 0)
    total = c[0] + c[1]
    if total > chunk_tokens:
        c = [
            max(CHUNK_QUANTUM, int(x * chunk_tokens / total) // CHUNK_QUANTUM * CHUNK_QUANTUM) if x else 0
            for x in c
        ]
    return c[0], c[1]


class PrefillBudget:
    """A side's per-step prefill budget as credit: each step adds C tokens (never more than C held), an
    admission spends its computed prompt tokens; a side may admit while its credit is positive (so one
    request may overdraw it, and the overdraft is paid back over the next steps)."""

    def __init__(self) -> None:
        self.credit = 0.0

    def new_step(self, c_tokens: float, steps: float = 1.0) -> None:
        """Credit for ``steps`` (possibly fractional) steps at ``c_tokens`` per step."""
        self.credit = min(self.credit + c_tokens * steps, c_tokens)

    @property
    def open(self) -> bool:
        return self.credit > 0

    def spend(self, tokens: float) -> None:
        self.credit -= tokens


@dataclass
class DualScanResult:
    order: list[int]  # requests in admission order
    batches: list[list[int]] = field(default_factory=list)  # admitted together on the fluid clock
    batch_prefill_tokens: list[int] = field(default_factory=list)  # rounded up to multiples of 128
    m_left_tokens: float = 0.0  # the first split
    m_right_tokens: float = 0.0
    c_left_tokens: int = 0  # the first per-step prefill budgets
    c_right_tokens: int = 0
    side: list[int] = field(default_factory=list)  # 0 = left, 1 = right, per entry of ``order``
    admit_step: list[float] = field(default_factory=list)  # fluid-clock step of each admission in ``order``
    steps: float = 0.0  # fluid-clock length of the scan, in decode steps


BUDGET_RULES = ("aligned", "paper")


class ScanEnds:
    """The two ends of a density-ordered sequence: window densities (sum eff_comp / sum mem) and window means
    of computed prompt and output tokens, each over the WINDOW requests nearest an end; and, by prefix sums,
    the computed prompt tokens of the compute-heavy requests (density above ``rho_root``) and the output
    tokens, count and KV footprint of the memory-heavy ones between two positions."""

    def __init__(
        self,
        comp: np.ndarray,
        mem: np.ndarray,
        pc: np.ndarray,
        d: np.ndarray,
        rho_root: float = 0.0,
        area: bool = False,
    ) -> None:
        self.comp, self.mem, self.pc, self.d = comp, mem, pc, d
        self.rho_root = rho_root
        self.area = area  # count the memory side's steps left by its KV area too (``aligned_budget``)
        self._stats: dict[tuple[int, int], tuple[float, float, float]] = {}
        self.heavy = heavy = (mem > 0) & (comp < rho_root * mem)  # memory-heavy: density below the job's
        zero = np.zeros(1)
        self._pc_compute = np.concatenate([zero, np.cumsum(np.where(heavy, 0.0, pc))])
        self._d_memory = np.concatenate([zero, np.cumsum(np.where(heavy, d, 0.0))])
        self._n_memory = np.concatenate([zero, np.cumsum(heavy.astype(np.float64))])
        self._foot_memory = np.concatenate([zero, np.cumsum(np.where(heavy, pc + d / 2, 0.0))])
        # KV-token-steps a memory-heavy request occupies over its life: p d + d^2 / 2
        self._area_memory = np.concatenate([zero, np.cumsum(np.where(heavy, pc * d + d * d / 2, 0.0))])

    def _window(self, lo: int, hi: int) -> tuple[float, float, float]:
        """(density, mean computed prompt, mean output) of [lo, hi), memoised: a scan asks for the same
        windows every step until an end moves."""
        key = (lo, hi)
        st = self._stats.get(key)
        if st is None:
            if len(self._stats) > 64:
                self._stats.clear()
            m = float(self.mem[lo:hi].sum())
            c = float(self.comp[lo:hi].sum())
            k = max(hi - lo, 1)
            rho = c / m if m > 0 else float("inf")
            st = (rho, float(self.pc[lo:hi].sum()) / k, float(self.d[lo:hi].sum()) / k)
            self._stats[key] = st
        return st

    def _density(self, lo: int, hi: int) -> float:
        return self._window(lo, hi)[0]

    def windows(self, left: int, right: int) -> tuple[tuple[int, int], tuple[int, int]]:
        return (left, min(left + WINDOW, right + 1)), (max(right + 1 - WINDOW, left), right + 1)

    def split(self, left: int, right: int, rho_root: float, m_tokens: float) -> tuple[float, float]:
        (a, b), (c, e) = self.windows(left, right)
        return memory_split(m_tokens, rho_root, self._density(a, b), self._density(c, e))

    def budgets(
        self,
        left: int,
        right: int,
        m_split: tuple[float, float],
        chunk_tokens: int,
        rule: str = "aligned",
        live_memory: tuple[int, float, float] = (0, 0.0, 0.0),
    ) -> tuple[int, int]:
        """(C_L, C_R) for the pending requests [left, right]. ``live_memory`` = (count, output tokens still to
        decode, longest remaining output) of the running memory-heavy requests. The paper's rule for both
        sides (``step_budgets``); with ``rule="aligned"`` the compute-heavy ends' budgets together are the
        rate that ends both sides together (module docstring)."""
        stats = [self._window(lo, hi) for lo, hi in self.windows(left, right)]
        c = list(step_budgets(m_split, tuple((st[1], st[2]) for st in stats), chunk_tokens))
        if rule == "paper":
            return c[0], c[1]
        compute_sides = [side for side in (0, 1) if stats[side][0] > self.rho_root]
        if not compute_sides:
            return c[0], c[1]
        aligned = self.aligned_budget(left, right, m_split[1], chunk_tokens, live_memory)
        if len(compute_sides) == 2:
            c = [max(16, aligned // 2), max(16, aligned - aligned // 2)]
        else:
            c[compute_sides[0]] = aligned
        return c[0], c[1]

    def aligned_budget(
        self,
        left: int,
        right: int,
        m_memory_tokens: float,
        chunk_tokens: int,
        live_memory: tuple[float, ...] = (0, 0.0, 0.0),
    ) -> int:
        """Prefill tokens per step at which the compute-heavy requests in [left, right] end when the
        memory-heavy ones (pending there and ``live_memory`` running: count, output tokens left, longest
        left, and optionally the KV-token-steps left) do: at least 16, at most the chunk.

        The memory side's steps left are the most of: its output tokens over the requests it runs at once,
        its longest running request, and (``area``) the KV-token-steps its requests still occupy,
        sum (p d + d^2 / 2), over its share of the memory: with requests of very different lengths (a few
        long videos among many short answers) the count of what fits says little, the area does."""
        lo, hi = left, right + 1
        n_live, live_tokens, live_longest = live_memory[:3]
        live_area = live_memory[3] if len(live_memory) > 3 else 0.0
        decode = float(self._d_memory[hi] - self._d_memory[lo]) + live_tokens
        if decode <= 0:
            return chunk_tokens  # nothing memory-heavy left: compute at full speed
        pending = float(self._n_memory[hi] - self._n_memory[lo])
        foot = float(self._foot_memory[hi] - self._foot_memory[lo]) / pending if pending else 0.0
        fits = min(m_memory_tokens / foot, pending + n_live) if foot > 0 else 0.0
        steps = max(decode / max(float(n_live), fits, 1.0), live_longest, 1.0)
        if self.area and m_memory_tokens > 0:
            area = float(self._area_memory[hi] - self._area_memory[lo]) + live_area
            steps = max(steps, area / m_memory_tokens)
        tokens = float(self._pc_compute[hi] - self._pc_compute[lo])
        return min(chunk_tokens, max(16, int(math.ceil(tokens / steps))))


def dual_scan(
    seq: Sequence[int],
    prompt_lens: Sequence[float],
    output_lens: Sequence[float],
    eff_comp_s: Sequence[float],
    mem_s: Sequence[float],
    rho_root: float,
    m_tokens: float,
    chunk_tokens: int,
    computed_tokens: Sequence[float] | None = None,
    enforce_budgets: bool = True,
    budget_rule: str = "aligned",
) -> DualScanResult:
    """Play the dual scan over ``seq`` (request indices, density non-increasing left to right).

    ``eff_comp_s`` is each request's Comp with its shared prefix amortised ((1 - s_i) Comp_i), so window
    densities are sum(eff_comp) / sum(mem). ``computed_tokens`` are the prompt tokens a request really
    computes (default: its whole prompt), which is what the prefill budgets spend. Each step a side admits
    while its KV share M_L / M_R has room and its prefill budget C_L / C_R has credit (``enforce_budgets``;
    False: memory alone, the engine's chunk budget serving every prefill; ``budget_rule``: how C_L is set,
    module docstring); a side with nothing running may
    start one request past its memory share (not past its budget), and anyone may when nothing runs at all.
    """
    if budget_rule not in BUDGET_RULES:
        raise ValueError(f"budget_rule: must be one of {', '.join(BUDGET_RULES)}, got {budget_rule!r}")
    n = len(seq)
    seq = list(seq)
    p = np.asarray(prompt_lens, dtype=np.float64)
    d = np.asarray(output_lens, dtype=np.float64)
    pc = p if computed_tokens is None else np.asarray(computed_tokens, dtype=np.float64)
    comp_a = np.asarray(eff_comp_s, dtype=np.float64)
    mem_a = np.asarray(mem_s, dtype=np.float64)
    idx = np.asarray(seq, dtype=np.int64)
    take = (lambda a: a[idx]) if n else (lambda a: np.zeros(0))
    ends = ScanEnds(take(comp_a), take(mem_a), take(pc), take(d), rho_root)
    heavy = (mem_a > 0) & (comp_a < rho_root * mem_a)
    res = DualScanResult(order=[])
    left, right = 0, n - 1
    used = [0.0, 0.0]
    live = [0, 0]
    credit = [PrefillBudget(), PrefillBudget()]
    heap: list[tuple[float, int, int, float]] = []  # (finish step, tiebreak, side, footprint)
    live_heavy: dict[int, float] = {}  # running memory-heavy requests: finish step
    prefill_clock = [0.0, 0.0]  # when each side's admitted prefills are done, at its budget's rate
    now = 0.0
    credited = -1.0  # the clock up to which the budgets have been credited
    tick = 0
    first = True
    while left <= right:
        budget = ends.split(left, right, rho_root, m_tokens)
        if enforce_budgets:
            rem = [f - now for f in live_heavy.values()]
            live_mem = (len(rem), float(sum(rem)), max(rem, default=0.0))
            c = ends.budgets(left, right, budget, chunk_tokens, budget_rule, live_mem)
        else:
            c = (chunk_tokens, chunk_tokens)
        if first:
            res.m_left_tokens, res.m_right_tokens = budget
            res.c_left_tokens, res.c_right_tokens = c
            first = False
        for side in (0, 1):
            credit[side].new_step(c[side], now - credited)
        credited = now
        batch: list[int] = []
        credit_bound = False
        for side in (0, 1):
            while left <= right:
                i = seq[left] if side == 0 else seq[right]
                foot = p[i] + d[i] / 2
                idle = live[0] + live[1] == 0
                starter = live[side] == 0 and budget[side] > 0
                if not idle:
                    cap = max(budget[0], m_tokens - used[1]) if side == 0 else budget[1]
                    if not starter and used[side] + foot > cap:
                        break
                    if enforce_budgets and not credit[side].open:
                        credit_bound = True
                        break
                used[side] += foot
                live[side] += 1
                credit[side].spend(pc[i])
                if side == 0:
                    left += 1
                else:
                    right -= 1
                rate = max(c[side], 1) if enforce_budgets else chunk_tokens
                start = max(now, prefill_clock[side])
                prefill_clock[side] = start + pc[i] / rate
                finish = prefill_clock[side] + d[i]
                if heavy[i]:
                    live_heavy[i] = finish
                tick += 1
                heapq.heappush(heap, (finish, tick, side, foot))
                batch.append(i)
                res.order.append(i)
                res.side.append(side)
                res.admit_step.append(now)
        if batch:
            res.batches.append(batch)
            tokens = float(pc[batch].sum())
            res.batch_prefill_tokens.append(int(math.ceil(tokens / CHUNK_QUANTUM) * CHUNK_QUANTUM))
        if left > right:
            break
        nxt = heap[0][0] if heap else now + 1
        now = min(nxt, now + 1) if credit_bound else max(nxt, now + 1e-9)
        while heap and heap[0][0] <= now:
            _, _, s2, f2 = heapq.heappop(heap)
            used[s2] -= f2
            live[s2] -= 1
        if live_heavy:
            live_heavy = {k: f for k, f in live_heavy.items() if f > now}
        if not heap:
            used = [0.0, 0.0]  # nothing runs: clear float residue
    res.steps = max([now] + [h[0] for h in heap])
    return res
