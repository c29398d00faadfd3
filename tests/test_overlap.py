"""Overlap mode: step = min(sequential, f * max(compute, memory, network)) + overhead, never slower than sequential."""

import pytest

from kvbalance.batch import BatchPlan, ScheduledSeq
from kvbalance.executor.sim import SimExecutor
from kvbalance.perf.cost import CostModel, breakdown_total_s
from kvbalance.perf.overlap import OverlapConfig, OverlapStepModel, step_model
from kvbalance.request import Request


@pytest.fixture
def cm():
    return CostModel("llama-3.1-8b", "a100-80gb")


def _mixed():
    # 64 decodes at a 4k context (memory-heavy attention) plus a 1024-token prefill chunk (compute-heavy GEMMs)
    return [(1, 4096, True)] * 64 + [(1024, 1024, True)]


def test_overlap_step_is_max_of_resources_times_interference(cm):
    seqs = _mixed()
    times = cm.op_times(seqs)
    comp = sum(t.compute_s for t in times.values())
    mem = sum(t.memory_s for t in times.values())
    sb = cm.step(seqs)
    seq = sb.compute_s + sb.memory_s
    f = 1.25
    b = OverlapStepModel(cm, OverlapConfig(f)).step(seqs)
    expect = min(seq, f * max(comp, mem)) + sb.overhead_s
    assert breakdown_total_s(b) == pytest.approx(expect, rel=1e-12)
    assert b.flops == pytest.approx(sum(t.flops for t in times.values()))


def test_overlap_hides_the_smaller_resource(cm):
    seqs = _mixed()
    seq_t = cm.step_seconds(seqs)
    ovl_t = breakdown_total_s(OverlapStepModel(cm, OverlapConfig(1.0)).step(seqs))
    assert ovl_t < seq_t
    # a huge interference factor falls back to the sequential sum, never above it
    assert breakdown_total_s(OverlapStepModel(cm, OverlapConfig(100.0)).step(seqs)) == pytest.approx(seq_t)


def test_overlap_adds_little_for_a_single_bound_step(cm):
    # a pure 2048-token prefill is compute-bound almost everywhere: overlap gains at most the memory part
    seqs = [(2048, 2048, True)]
    times = cm.op_times(seqs)
    mem_part = sum(t.memory_s for t in times.values() if t.bound == "memory")
    seq_t = cm.step_seconds(seqs)
    ovl_t = breakdown_total_s(OverlapStepModel(cm, OverlapConfig(1.0)).step(seqs))
    assert seq_t - mem_part - 1e-12 <= ovl_t <= seq_t


def test_tp_all_reduce_is_a_third_resource():
    cm = CostModel("llama-3.1-70b", "a100-80gb", tp=8)
    seqs = _mixed()
    times = cm.op_times(seqs)
    comp = sum(t.compute_s for t in times.values())
    mem = sum(t.memory_s for t in times.values())
    sb = cm.step(seqs)
    seq, comm = sb.compute_s + sb.memory_s, sb.comm_s
    assert comm > 0
    b = OverlapStepModel(cm, OverlapConfig(1.1)).step(seqs)
    assert breakdown_total_s(b) == pytest.approx(min(seq + comm, 1.1 * max(comp, mem, comm)) + sb.overhead_s)


def test_sim_executor_takes_the_overlap_step_model(cm):
    reqs = [Request(f"d{i}", list(range(4000))) for i in range(32)]
    plan = BatchPlan(seqs=[ScheduledSeq(r, 4000, 1, True) for r in reqs])
    plan.seqs.append(ScheduledSeq(Request("p", list(range(1024))), 0, 1024, True))
    seq_ex, ovl_ex = SimExecutor(cm), SimExecutor(cm, step_model=step_model(cm, "overlap"))
    assert seq_ex.execute(plan).duration_s == pytest.approx(cm.step_time(plan))
    ovl = ovl_ex.execute(plan).duration_s
    assert ovl == pytest.approx(breakdown_total_s(OverlapStepModel(cm).predict(plan)))
    assert ovl < cm.step_time(plan)


def test_bad_mode_and_factor_name_the_field(cm):
    with pytest.raises(ValueError, match="mode"):
        step_model(cm, "parallel")
    with pytest.raises(ValueError, match="interference_factor"):
        OverlapConfig(0.9)
