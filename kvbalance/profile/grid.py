"""The profile grid and its measurement: step shapes (prefill chunks, decode batches x contexts, mixed steps),
each timed as the engine times it (``TorchExecutor.execute`` on a ``BatchPlan``; warm-up first, median of
repeats)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvbalance.perf.cost import SeqWork


@dataclass
class GridPoint:
    """One step shape: ``seqs`` = [(num_new_tokens, context_len_after_step, samples)] (cost.py's SeqWork)."""

    name: str
    seqs: list[SeqWork]


def profile_grid(quick: bool, max_context: int) -> list[GridPoint]:
    """Prefill chunks (fresh and after a context), decode batches x contexts and mixed steps (decodes plus
    one prefill chunk, as Sarathi-style batching makes them). Contexts are clipped to ``max_context``."""
    if quick:
        prefill, chunked = (8, 32, 96), ((32, 96),)
        batches, contexts = (1, 4, 16), (16, 96)
        mixed = ((4, 64, 32),)
    else:
        prefill, chunked = (16, 64, 256, 512), ((128, 512), (512, 1024))
        batches, contexts = (1, 4, 16, 32, 64), (64, 256, 1024)
        mixed = ((8, 256, 248), (32, 512, 224), (63, 256, 449), (16, 1024, 496))
    cap = max_context
    grid = [GridPoint(f"prefill-{n}", [(n, n, True)]) for n in prefill if n <= cap]
    grid += [GridPoint(f"chunk-{n}@{c}", [(n, c, True)]) for n, c in chunked if c <= cap]
    for b in batches:
        for c in contexts:
            if c <= cap:
                grid.append(GridPoint(f"decode-{b}x{c}", [(1, c, True)] * b))
    for b, c, n in mixed:
        if c <= cap and n <= cap:
            grid.append(GridPoint(f"mixed-{b}x{c}+{n}", [(1, c, True)] * b + [(n, n, True)]))
    return grid


# -- measuring real steps -----------------------------------------------------------------------------


def _build_executor(model: str, num_blocks: int, block_size: int, threads: int, seed: int):
    import torch

    from kvbalance.executor.torch import TorchExecutor
    from kvbalance.model.weights import load_model

    loaded = load_model(model, seed=seed)
    ex = TorchExecutor(
        loaded.config, loaded.state_dict, num_blocks, block_size, "cpu", torch.float32, threads
    )
    return ex, loaded.config


def _plan(point: GridPoint, block_size: int, vocab: int, rng: np.random.Generator):
    """A BatchPlan for ``point``: one Request per sequence on its own blocks, with random token ids."""
    from kvbalance.batch import BatchPlan, ScheduledSeq
    from kvbalance.request import Request, SamplingParams

    seqs, next_block = [], 0
    for i, (n, ctx, sample) in enumerate(point.seqs):
        req = Request(
            f"p{i}", rng.integers(0, vocab, ctx).tolist(), SamplingParams(max_tokens=2, ignore_eos=True)
        )
        blocks = -(-ctx // block_size)
        req.block_ids = list(range(next_block, next_block + blocks))
        next_block += blocks
        seqs.append(ScheduledSeq(req, ctx - n, n, sample))
    return BatchPlan(seqs, block_size)


@dataclass
class StepSample:
    """A grid point's measurement (seconds): median of repeats of the executor's step time."""

    name: str
    seqs: list[SeqWork]
    step_s: float  # StepResult.duration_s, median (what the engine's clock sees)
    forward_s: float  # StepBreakdown.compute_s, median (the model forward alone)
    min_step_s: float
    cpu_s: float  # thread CPU time of the step, median (near the step time unless the machine is shared)
    repeats: int
    predicted_s: float | None = None

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _, _ in self.seqs)


def measure_grid(
    executor,
    grid: Sequence[GridPoint],
    *,
    vocab: int,
    warmup: int = 1,
    repeats: int = 3,
    max_repeat_s: float = 4.0,
    seed: int = 0,
    progress: Callable[[StepSample], None] | None = None,
) -> list[StepSample]:
    """Time each grid point with ``executor.execute`` (after ``warmup`` untimed runs of the first point)."""
    rng = np.random.default_rng(seed)
    bs = executor.block_size
    if grid and warmup:
        first = _plan(grid[0], bs, vocab, rng)
        for _ in range(warmup):
            executor.execute(first)
    out = []
    for point in grid:
        need = sum(-(-c // bs) for _, c, _ in point.seqs)
        if need > executor.num_blocks:
            raise ValueError(
                f"kv_tokens: grid point {point.name} needs {need} blocks, executor has {executor.num_blocks}"
            )
        plan = _plan(point, bs, vocab, rng)
        executor.execute(plan)  # per-shape warm-up (allocator, oneDNN primitive caches)
        steps, fwds, cpus = [], [], []
        spent = time.perf_counter()
        for _ in range(repeats):
            c0 = time.thread_time()
            res = executor.execute(plan)
            cpus.append(time.thread_time() - c0)
            steps.append(res.duration_s)
            fwds.append(res.breakdown.compute_s)
            if time.perf_counter() - spent > max_repeat_s:
                break
        sample = StepSample(point.name, list(point.seqs), statistics.median(steps), statistics.median(fwds),
                            min(steps), statistics.median(cpus), len(steps))  # fmt: skip
        out.append(sample)
        if progress is not None:
            progress(sample)
    return out


def kv_blocks_for_grid(grid: Sequence[GridPoint], block_size: int) -> int:
    return max(sum(-(-c // block_size) for _, c, _ in p.seqs) for p in grid)
