"""Simulated executor: a step lasts as long as the cost model predicts, KV transfers cost bytes over a link,
and sampled tokens are deterministic stand-ins.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from dataclasses import replace

from kvbalance.batch import BatchPlan, KVTransfer, StepResult
from kvbalance.perf.cost import CostModel, breakdown_total_s, plan_shape, transfer_time
from kvbalance.specs import LinkSpec, get_link

# Stand-in token ids live far above any real vocabulary (< 2**18 for every preset) so they never collide with
# prompt tokens: STANDIN_BASE + (crc32(request_id) << 24) + position. Unique per (request, position) for
# positions below 2**24, always < 2**62 (fits int64, NOT int32), and a function of only the two, so a
# recompute after preemption yields the same tokens and runs are reproducible bit for bit.
STANDIN_BASE = 1 << 60
_POS_BITS = 24
_POS_MASK = (1 << _POS_BITS) - 1


def standin_token(request_id: str, position: int) -> int:
    """The stand-in token a simulated step samples for ``request_id`` at sequence ``position``."""
    if position < 0:
        raise ValueError(f"position: must be >= 0, got {position}")
    crc = zlib.crc32(request_id.encode("utf-8"))
    return STANDIN_BASE + (crc << _POS_BITS) + (position & ((1 << _POS_BITS) - 1))


def is_standin_token(token_id: int) -> bool:
    return token_id >= STANDIN_BASE


SHAPE_CACHE_MAX = 200_000  # shapes kept per executor (a bound on memory; past it, new shapes are not kept)
# After this many steps, an executor whose hit rate is below SHAPE_CACHE_MIN_HITS stops using the cache (exact
# either way): with decode contexts growing every step, most shapes are new (8% hits on Vidur's set-up, where
# the key and copy cost about 9% more than they save), while saturated or fixed-length runs repeat shapes.
SHAPE_CACHE_PROBATION = 2000
SHAPE_CACHE_MIN_HITS = 0.3


def fast_paths_enabled() -> bool:
    """The simulator's exact fast paths (step-shape cache, ...) are on unless ``KVBALANCE_SIM_FAST=0``."""
    return os.environ.get("KVBALANCE_SIM_FAST", "1") != "0"


def decode_runs_enabled() -> bool:
    """Decode runs (``Instance.decode_run``) are opt-in, ``KVBALANCE_SIM_DECODE_RUNS=1``: exact, but each
    step still costs one cost-model evaluation, which dominates, while the readiness check and set-up cost
    O(batch) per attempt; measured 0.81x (llama-2-7b, one A100, 8 req/s) to 1.15x (llama-2-70b TP4, 2 req/s)."""
    return fast_paths_enabled() and os.environ.get("KVBALANCE_SIM_DECODE_RUNS", "0") == "1"


# what the cost model's step time depends on (``perf.cost.plan_shape``): the shape cache's key
step_shape = plan_shape


class SimExecutor:
    """Executes a :class:`BatchPlan` by asking a :class:`CostModel` how long it takes.

    KV loads/saves move ``num_tokens * kv_bytes_per_token / tp`` bytes over ``link`` (default: PCIe 4.0, a
    host or peer copy). With ``overlap_transfers`` (default) a transfer runs layer by layer under the
    step's compute, so only the part longer than the compute adds to the step (BanaServe's layer-wise
    overlapped fetch/compute/store); without it the whole transfer adds. Every transfer in the plan
    finishes within the step. ``step_model`` (anything with ``predict(plan) -> StepBreakdown``, e.g.
    ``perf.overlap.OverlapStepModel``) replaces the cost model's sequential step time.

    ``shape_cache`` (default: on unless ``KVBALANCE_SIM_FAST=0``) keeps the cost model's breakdown per
    :func:`step_shape`, so a step of a shape seen before skips the roofline (exact: the same breakdown, copied).
    It applies to the plain cost model only (a ``step_model`` may read more of the plan), and turns itself off
    after ``SHAPE_CACHE_PROBATION`` steps with fewer than ``SHAPE_CACHE_MIN_HITS`` of them hits.
    """

    def __init__(
        self,
        cost_model: CostModel,
        link: LinkSpec | str | None = None,
        overlap_transfers: bool = True,
        step_model=None,
        shape_cache: bool | None = None,
    ) -> None:
        self.cost_model = cost_model
        self.step_model = step_model if step_model is not None else cost_model
        self._fast = fast_paths_enabled()
        if shape_cache is None:
            shape_cache = self._fast
        self._shapes: dict[tuple, object] | None = {} if shape_cache and step_model is None else None
        self.shape_hits = 0
        self.shape_lookups = 0
        self.link = get_link(link) if link is not None else get_link("pcie4")
        self.overlap_transfers = overlap_transfers
        self.num_steps = 0
        self.busy_s = 0.0
        self._standin_base: dict[str, int] = {}

    @classmethod
    def from_names(cls, model: str, gpu: str, tp: int = 1, link: str | None = None) -> SimExecutor:
        return cls(CostModel(model, gpu, tp), link)

    def transfer_s(self, transfers: list[KVTransfer]) -> float:
        """Time to move the KV of ``transfers`` one after another over the link."""
        total = 0.0
        for t in transfers:
            if t.direction not in ("load", "save"):
                raise ValueError(f"direction: must be 'load' or 'save', got {t.direction!r} ({t.request_id})")
            total += transfer_time(self.cost_model.kv_transfer_bytes(t.num_tokens), self.link)
        return total

    def predict(self, plan: BatchPlan):
        """The step's compute breakdown (a fresh object: callers add to it)."""
        shapes = self._shapes
        if shapes is None:
            return self.step_model.predict(plan)
        key = step_shape(plan)
        hit = shapes.get(key)
        self.shape_lookups += 1
        if hit is None:
            hit = self.step_model.predict(plan)
            if len(shapes) < SHAPE_CACHE_MAX:
                shapes[key] = hit
            if (
                self.shape_lookups == SHAPE_CACHE_PROBATION
                and self.shape_hits < SHAPE_CACHE_MIN_HITS * self.shape_lookups
            ):
                self._shapes = None  # shapes rarely repeat here: the key costs more than the hits save
            return replace(hit)
        self.shape_hits += 1
        return replace(hit)

    # -- decode runs (``Instance.decode_run``): many identical-shape decode steps without a plan each ------
    @property
    def supports_decode_runs(self) -> bool:
        """Whether :meth:`decode_step_s` gives what :meth:`execute` would (the plain cost model only, and the
        fast paths on)."""
        return self.step_model is self.cost_model and self._fast

    def decode_step_s(self, num_seqs: int, context_sum: int) -> float:
        """Duration :meth:`execute` gives any step of ``num_seqs`` sampling decodes (one new token each, no
        transfers) whose contexts after the step sum to ``context_sum``: the cost model sees a step through its
        shape (:func:`step_shape`), so one plan of that shape stands for all; ``CostModel.decode_step`` takes the
        two sums in O(1), and no shape is cached (a run's context sum grows every step). Counts nothing
        (:meth:`note_step`)."""
        compute_s = breakdown_total_s(self.cost_model.decode_step(num_seqs, context_sum))
        return compute_s + max(0.0, 0.0 - compute_s)  # execute()'s arithmetic with nothing to transfer

    def decode_step_fn(self, num_seqs: int):
        """``context_sum -> decode_step_s(num_seqs, context_sum)``, the same value, with what does not depend on
        the context sum done once (``CostModel.decode_step_fn``): for runs of cohort-only steps."""
        return self.cost_model.decode_step_fn(num_seqs)

    def note_step(self, duration_s: float) -> None:
        """Account one step run outside :meth:`execute` (a decode run's)."""
        self.num_steps += 1
        self.busy_s += duration_s

    def _base(self, request_id: str) -> int:
        """``standin_token(request_id, 0)``, memoised: a request's stand-in token at position p is this plus
        p (mod the position mask)."""
        base = self._standin_base.get(request_id)
        if base is None:
            base = self._standin_base[request_id] = standin_token(request_id, 0)
        return base

    def decode_tokens(self, request_id: str, first_context_len: int, count: int) -> Sequence[int]:
        """The stand-in tokens :meth:`execute` samples for ``request_id`` over ``count`` decode steps, the first
        at context length ``first_context_len`` (a ``range`` where they are consecutive: callers extend a list)."""
        base = self._base(request_id)
        lo = first_context_len & _POS_MASK
        if lo + count <= _POS_MASK + 1:
            return range(base + lo, base + lo + count)
        return [base + ((first_context_len + k) & _POS_MASK) for k in range(count)]

    def execute_cohort_chunk(self, plan: BatchPlan) -> StepResult:
        """:meth:`execute` of a plan that is the decode cohort plus one prompt chunk of two or more tokens and no
        transfers (``Instance.step``'s fast path): the breakdown from ``CostModel.cohort_chunk_step`` (no shape
        key: the cohort's context sum rarely repeats; a cached shape would give the same breakdown), the chunk's
        sample if it has one; the same result."""
        breakdown = self.cost_model.cohort_chunk_step(plan)
        compute_s = breakdown_total_s(breakdown)
        breakdown.transfer_s = max(0.0, 0.0 - compute_s) if self.overlap_transfers else 0.0
        duration = compute_s + breakdown.transfer_s
        sampled = {}
        s = plan.seqs[0]
        if s.sample:
            rid = s.request.request_id
            sampled[rid] = self._base(rid) + ((s.start + s.num_new_tokens) & _POS_MASK)
        self.num_steps += 1
        self.busy_s += duration
        return StepResult(duration_s=duration, sampled=sampled, finished_loads=[], finished_saves=[],
                          breakdown=breakdown)  # fmt: skip

    def execute(self, plan: BatchPlan) -> StepResult:
        breakdown = self.predict(plan)
        compute_s = breakdown_total_s(breakdown)
        loads, saves = plan.kv_loads, plan.kv_saves
        moved_s = self.transfer_s(loads) + self.transfer_s(saves) if loads or saves else 0.0
        breakdown.transfer_s = max(0.0, moved_s - compute_s) if self.overlap_transfers else moved_s
        duration = compute_s + breakdown.transfer_s
        sampled = {}
        for s in plan.seqs:
            if s.sample:
                rid = s.request.request_id
                sampled[rid] = self._base(rid) + ((s.start + s.num_new_tokens) & _POS_MASK)
        self.num_steps += 1
        self.busy_s += duration
        return StepResult(
            duration_s=duration,
            sampled=sampled,
            finished_loads=[t.request_id for t in loads] if loads else [],
            finished_saves=[t.request_id for t in saves] if saves else [],
            breakdown=breakdown,
        )
