"""Overlap mode of the cost model: compute-, memory- and network-bound work of one step run concurrently.

NanoFlow (OSDI'25) splits a batch into nano-batches and runs GEMMs / prefill attention (compute), decode
attention (memory) and the TP all-reduce (network) at the same time on one device, so a step lasts about as
long as its busiest resource, not the sum of its operators (NanoFlow's optimal-throughput model, Eq. 5;
BlendServe's T = max(T_comp, T_mem)). Here, over the cost model's per-operator rooflines
(``CostModel.op_times``):

    sequential (vLLM, SGLang):  T = sum_op max(c_op, m_op) + comm + overhead
    overlap (NanoFlow-style):   T = min(sum_op max(c_op, m_op) + comm,
                                        f * max(sum_op c_op, sum_op m_op, comm)) + overhead

(overhead: the kernel latencies of ``CostModel.step`` and the engine's host time per step: paid in full by a
serial engine, set against the overlapped step's GPU time by an overlapped one, :mod:`kvbalance.perf.engines`).

with ``f`` the interference factor (>= 1) of kernels sharing SMs, L2 and HBM. The default 1.10 is an
unfitted engineering figure, not a measurement: NanoFlow's own interference profiling (section 4.1.2)
shows concurrent GEMM and GEMV kernels each losing performance versus running alone, and its end-to-end
throughput reaches 50-72% of the resource bound; fit ``f`` from a profile when one exists. The cap keeps
overlap never slower than sequential. Launch overhead stays serial (nano-batches add launches, not hide them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbalance.batch import BatchPlan, StepBreakdown
from kvbalance.perf.cost import CostModel, SeqWork

DEFAULT_INTERFERENCE_FACTOR = 1.10


@dataclass(frozen=True)
class OverlapConfig:
    """``interference_factor``: multiplier (>= 1) on the busiest resource's time when operators overlap."""

    interference_factor: float = DEFAULT_INTERFERENCE_FACTOR

    def __post_init__(self) -> None:
        if not self.interference_factor >= 1.0:
            raise ValueError(f"interference_factor: must be >= 1, got {self.interference_factor}")


def resource_times_s(times: dict, comm_s: float) -> tuple[float, float, float, float]:
    """(sum of compute times, sum of memory times, sum of per-operator rooflines, all-reduce) of ``times``
    (``CostModel.op_times``)."""
    comp = sum(t.compute_s for t in times.values())
    mem = sum(t.memory_s for t in times.values())
    seq = sum(t.time_s for t in times.values())
    return comp, mem, seq, comm_s


class OverlapStepModel:
    """Step durations in overlap mode, with the same interface as ``CostModel.predict`` / ``step``."""

    def __init__(self, cost_model: CostModel, config: OverlapConfig | None = None) -> None:
        self.cost_model = cost_model
        self.config = config or OverlapConfig()

    def step(self, seqs: Sequence[SeqWork]) -> StepBreakdown:
        """Breakdown of an overlapped step: the overlapped core goes to ``compute_s`` or ``memory_s``
        (whichever resource is busier), the rest of the fields as in sequential mode."""
        if not seqs:
            return StepBreakdown()
        cm = self.cost_model
        overlapped_host = cm.engine.overlap
        # sequential breakdown: its overhead (kernel latencies, a serial engine's host time) stays serial
        seqb = cm.gpu_step(seqs) if overlapped_host else cm.step(seqs)
        times = cm.op_times(seqs)
        comp, mem, _, comm = resource_times_s(times, seqb.comm_s)
        seq = seqb.compute_s + seqb.memory_s
        core = min(seq + comm, self.config.interference_factor * max(comp, mem, comm))
        b = StepBreakdown(overhead_s=seqb.overhead_s)
        if overlapped_host:  # the engine's host work hides under this step's (shorter) GPU time
            b.overhead_s += cm.host_time(seqs, core + seqb.overhead_s).exposed_s
        if comm > max(comp, mem):
            b.comm_s = core
        elif comp >= mem:
            b.compute_s = core
        else:
            b.memory_s = core
        for t in times.values():
            b.flops += t.flops
            b.bytes += t.bytes
        return b

    def predict(self, plan: BatchPlan) -> StepBreakdown:
        return self.step(CostModel.plan_seqs(plan))


def step_model(cost_model: CostModel, mode: str, interference_factor: float = DEFAULT_INTERFERENCE_FACTOR):
    """The step-time model for ``mode``: the cost model itself ("sequential") or its overlap view."""
    if mode == "sequential":
        return cost_model
    if mode == "overlap":
        return OverlapStepModel(cost_model, OverlapConfig(interference_factor))
    raise ValueError(f"mode: must be 'sequential' or 'overlap', got {mode!r}")
