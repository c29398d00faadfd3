"""Dual scanning (BlendServe section 4.4): admit from both ends of the density-sorted leaves at once.

The left end holds compute-heavy requests (rho_L > rho_root), the right end memory-heavy ones (rho_R <
rho_root). The free KV memory M is split so the running mix has the job's density:

    M_L = M (rho_root - rho_R) / (rho_L - rho_R),  M_R = M - M_L   =>   rho_L M_L + rho_R M_R = rho_root M

Each side keeps about N = M_side / (p + d / 2) requests decoding (a request holds p + d / 2 tokens of KV on
average over its life) and needs a prefill budget of C = N p / d tokens per step to keep them coming; the
steps' chunked-prefill budgets are multiples of 128 tokens, as in the paper. The scan is played out on a
fluid clock counted in decode steps (a request occupies its side's memory from its admission until its d
steps are done; prefills are served at ``chunk_tokens`` per step), which turns it into a static admission
order that any engine can follow FCFS: the simulator and the real engine run the same order.
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


@dataclass
class DualScanResult:
    order: list[int]  # requests in admission order
    batches: list[list[int]] = field(default_factory=list)  # admitted together on the fluid clock
    batch_prefill_tokens: list[int] = field(default_factory=list)  # rounded up to multiples of 128
    m_left_tokens: float = 0.0  # the first split
    m_right_tokens: float = 0.0
    side: list[int] = field(default_factory=list)  # 0 = left, 1 = right, per entry of ``order``


def _window_density(comp: np.ndarray, mem: np.ndarray, lo: int, hi: int) -> float:
    m = mem[lo:hi].sum()
    return float(comp[lo:hi].sum() / m) if m > 0 else float("inf")


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
) -> DualScanResult:
    """Play the dual scan over ``seq`` (request indices, density non-increasing left to right).

    ``eff_comp_s`` is each request's Comp with its shared prefix amortised ((1 - s_i) Comp_i), so window
    densities are sum(eff_comp) / sum(mem). ``computed_tokens`` are the prompt tokens a request really
    computes (default: its whole prompt), which is what the prefill budget spends.
    """
    n = len(seq)
    seq = list(seq)
    p = np.asarray(prompt_lens, dtype=np.float64)
    d = np.asarray(output_lens, dtype=np.float64)
    pc = p if computed_tokens is None else np.asarray(computed_tokens, dtype=np.float64)
    comp_seq = np.asarray(eff_comp_s, dtype=np.float64)[seq] if n else np.zeros(0)
    mem_seq = np.asarray(mem_s, dtype=np.float64)[seq] if n else np.zeros(0)
    res = DualScanResult(order=[])
    left, right = 0, n - 1
    used = [0.0, 0.0]
    heap: list[tuple[float, int, int, float]] = []  # (finish step, tiebreak, side, footprint)
    now = prefill_clock = 0.0
    tick = 0
    first = True
    while left <= right:
        rho_l = _window_density(comp_seq, mem_seq, left, min(left + WINDOW, right + 1))
        rho_r = _window_density(comp_seq, mem_seq, max(right + 1 - WINDOW, left), right + 1)
        budget = memory_split(m_tokens, rho_root, rho_l, rho_r)
        if first:
            res.m_left_tokens, res.m_right_tokens = budget
            first = False
        batch: list[int] = []
        for side in (0, 1):
            while left <= right:
                i = seq[left] if side == 0 else seq[right]
                foot = p[i] + d[i] / 2
                if used[side] + foot > budget[side] and (used[side] > 0 or budget[side] <= 0):
                    if used[0] + used[1] > 0 or batch:
                        break
                used[side] += foot
                if side == 0:
                    left += 1
                else:
                    right -= 1
                start = max(now, prefill_clock)
                prefill_clock = start + pc[i] / chunk_tokens
                tick += 1
                heapq.heappush(heap, (prefill_clock + d[i], tick, side, foot))
                batch.append(i)
                res.order.append(i)
                res.side.append(side)
        if batch:
            res.batches.append(batch)
            tokens = float(pc[batch].sum())
            res.batch_prefill_tokens.append(int(math.ceil(tokens / CHUNK_QUANTUM) * CHUNK_QUANTUM))
        if heap:  # the next request to finish frees its side's memory
            now, _, side, foot = heapq.heappop(heap)
            used[side] -= foot
            while heap and heap[0][0] <= now:
                _, _, s2, f2 = heapq.heappop(heap)
                used[s2] -= f2
            if not heap:
                used = [0.0, 0.0]  # nothing runs: clear float residue
    return res
