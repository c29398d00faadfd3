"""Step time of an instance after a BanaServe migration landed, as a ``SimExecutor`` step model.

``MigratedStepModel`` wraps an instance's step model (``SimExecutor.step_model``) and, once a move has
landed, predicts steps with the cost models of ``kvbalance.perf.migration``:

* layer-level (layers ``[k, L)`` on a helper GPU): a step with decodes takes the two-stage pipeline's
  latency (``pipeline_step``: stage 1 here, activation hand-off, stage 2 on the helper; a decode's next
  token needs all three); a prefill-only step (independent batches, e.g. a P/D prefill instance) takes
  the pipeline's interval, ``max(stage 1, hand-off, stage 2)``, the stages of consecutive batches
  overlapping. Simplification: such a step's tokens are reported at the interval's end, not the
  latency's (TTFT understated by ``latency - interval``). The home breakdown keeps stage 1's compute /
  memory / overhead; the rest of the step (waiting on the hand-off and the helper) goes to ``comm_s``.
* attention-level (``kv_head_share`` of the KV heads of the moved decodes' context on a helper): decode
  steps take ``attention_split_step``'s time, with the helper's context share = the moved requests'
  moved context over the step's decode context (it shrinks as they finish or grow at home). The moved
  share of decode attention leaves the home breakdown; the rest of the step waits in ``comm_s``.

After each prediction ``last_helper`` is the helper GPU's share of that step (``None`` when none), which
the cluster records on the helper's monitor track and busy time, and ``last_wait_s`` the part of the
step the home GPU only waits (not its busy time). Contention on the helper: a share that ran while the
helper's own instance was mid-step delays the helper's next step by its length (``pending_s``, added
to that step as waiting); a share run while the helper was idle delays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbalance.batch import BatchPlan, StepBreakdown
from kvbalance.perf.cost import CostModel, SeqWork, breakdown_total_s
from kvbalance.perf.migration import StageTimes, attention_split_step, pipeline_step
from kvbalance.specs import LinkSpec


def _stage_breakdown(s: StageTimes, waited_s: float = 0.0) -> StepBreakdown:
    return StepBreakdown(
        compute_s=s.compute_s, memory_s=s.memory_s, overhead_s=s.overhead_s, comm_s=s.comm_s + waited_s
    )


@dataclass
class LayerSplit:
    """Layers ``[split_layer, L)`` run on ``helper`` (the same model on the helper GPU)."""

    helper: CostModel
    split_layer: int
    link: LinkSpec


@dataclass
class AttentionSplit:
    """``kv_head_share`` of the KV heads of ``moved_tokens`` (request id -> context moved) live on ``helper``."""

    helper: CostModel
    kv_head_share: float
    link: LinkSpec
    moved_tokens: dict[str, int] = field(default_factory=dict)


class MigratedStepModel:
    """``predict(plan) -> StepBreakdown``: ``inner``'s until a split is set, the split's step after."""

    def __init__(self, cost_model: CostModel, inner=None) -> None:
        self.cost_model = cost_model
        self.inner = inner if inner is not None else cost_model
        self.layer: LayerSplit | None = None
        self.attention: AttentionSplit | None = None
        self.last_helper: StepBreakdown | None = None
        self.last_wait_s = 0.0
        self.last_had_decodes = False
        self.pending_s = 0.0  # as a helper: GPU time its share of another instance's steps took meanwhile
        self.last_seqs: tuple[SeqWork, ...] = ()  # the latest non-empty step (candidates' batch)
        self.last_rids: tuple[str, ...] = ()
        self.last_decode_seqs: tuple[SeqWork, ...] = ()  # the latest step with decodes, and its requests
        self.last_decode_rids: tuple[str, ...] = ()

    def predict(self, plan: BatchPlan) -> StepBreakdown:
        bd = self._predict(plan)
        if self.pending_s:  # the GPU ran a source's share meanwhile: this step waits that long
            bd.comm_s += self.pending_s
            self.last_wait_s += self.pending_s
            self.pending_s = 0.0
        return bd

    def _predict(self, plan: BatchPlan) -> StepBreakdown:
        seqs = CostModel.plan_seqs(plan)
        self.last_helper = None
        self.last_wait_s = 0.0
        self.last_had_decodes = any(n == 1 for n, _, _ in seqs)
        if seqs:
            self.last_seqs = tuple(seqs)
            self.last_rids = tuple(s.request.request_id for s in plan.seqs)
            if self.last_had_decodes:
                self.last_decode_seqs, self.last_decode_rids = self.last_seqs, self.last_rids
        if not seqs:
            return self.inner.predict(plan)
        if self.layer is not None:
            return self._layer_step(seqs)
        if self.attention is not None and any(n == 1 for n, _, _ in seqs):
            return self._attention_step(plan, seqs)
        return self.inner.predict(plan)

    def _layer_step(self, seqs: list[SeqWork]) -> StepBreakdown:
        ls = self.layer
        p = pipeline_step(self.cost_model, ls.helper, seqs, ls.split_layer, ls.link)
        self.last_helper = _stage_breakdown(p.stage2)
        pipelined = not any(n == 1 for n, _, _ in seqs)
        self.last_wait_s = (p.interval_s if pipelined else p.latency_s) - p.stage1.total_s
        return _stage_breakdown(p.stage1, self.last_wait_s)

    def _attention_step(self, plan: BatchPlan, seqs: list[SeqWork]) -> StepBreakdown:
        a = self.attention
        cm = self.cost_model
        ctx = sum(c for n, c, _ in seqs if n == 1)
        moved = sum(
            min(a.moved_tokens.get(s.request.request_id, 0), s.context_len)
            for s in plan.seqs
            if s.num_new_tokens == 1
        )
        share = min(1.0, moved / ctx) if ctx else 0.0
        base = cm.step(seqs)
        if share == 0:
            return base
        split = attention_split_step(cm, a.helper, seqs, a.kv_head_share, share, a.link)
        attn = cm.op_times(seqs)["attn_decode"]
        off = a.kv_head_share * share * attn.time_s  # the helper's share of decode attention
        if attn.compute_s > attn.memory_s:
            base.compute_s = max(0.0, base.compute_s - off)
        else:
            base.memory_s = max(0.0, base.memory_s - off)
        self.last_wait_s = max(0.0, split.step_s - breakdown_total_s(base))
        base.comm_s += self.last_wait_s
        self.last_helper = StepBreakdown(memory_s=split.helper_busy_s)
        return base
