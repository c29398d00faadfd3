"""Simulated executor: durations from the cost model, modelled KV transfers, deterministic stand-in tokens."""

import pytest

from kvbalance.batch import BatchPlan, KVTransfer, ScheduledSeq
from kvbalance.executor.sim import STANDIN_BASE, SimExecutor, is_standin_token, standin_token
from kvbalance.perf.cost import CostModel, breakdown_total_s
from kvbalance.request import Request
from kvbalance.specs import get_link


@pytest.fixture
def cm():
    return CostModel("llama-2-7b", "a100-80gb")


def _plan():
    a, b, c = Request("a", list(range(100))), Request("b", list(range(40))), Request("c", list(range(900)))
    return BatchPlan(
        seqs=[ScheduledSeq(b, 40, 1, True), ScheduledSeq(a, 0, 100, True), ScheduledSeq(c, 0, 512, False)]
    )


def test_duration_is_the_cost_model_prediction(cm):
    plan = _plan()
    result = SimExecutor(cm).execute(plan)
    assert result.duration_s == pytest.approx(cm.step_time(plan))
    assert result.breakdown.transfer_s == 0.0
    assert breakdown_total_s(result.breakdown) == pytest.approx(result.duration_s)


def test_samples_only_for_sampling_seqs(cm):
    result = SimExecutor(cm).execute(_plan())
    assert set(result.sampled) == {"a", "b"}
    assert result.sampled["b"] == standin_token("b", 41)
    assert result.sampled["a"] == standin_token("a", 100)


def test_standin_tokens_are_deterministic_and_distinct(cm):
    r1 = SimExecutor(cm).execute(_plan())
    r2 = SimExecutor(CostModel("tiny-llama", "h100")).execute(_plan())
    assert r1.sampled == r2.sampled  # depends only on (request_id, position)
    tokens = {standin_token(rid, pos) for rid in ("a", "b", "req-17") for pos in range(0, 5000, 7)}
    assert len(tokens) == 3 * len(range(0, 5000, 7))
    for t in tokens:
        assert is_standin_token(t) and STANDIN_BASE <= t < 2**62
    assert not is_standin_token(151645)


def test_kv_transfers_cost_bytes_over_the_link(cm):
    link = get_link("net-100g")
    plan = BatchPlan(
        kv_loads=[KVTransfer("x", [0, 1], 32, "load")],
        kv_saves=[KVTransfer("y", [2], 16, "save"), KVTransfer("z", [3], 4000, "save")],
    )
    result = SimExecutor(cm, link, overlap_transfers=False).execute(plan)
    expected = sum(link.latency_s + n * 524288 / link.bandwidth_bytes_s for n in (32, 16, 4000))
    assert result.duration_s == pytest.approx(expected)
    assert result.finished_loads == ["x"] and result.finished_saves == ["y", "z"]
    assert result.sampled == {}


def test_overlapped_transfers_only_add_what_compute_does_not_hide(cm):
    plan = _plan()
    plan.kv_loads = [KVTransfer("small", [0], 16, "load")]
    hidden = SimExecutor(cm, "nvlink").execute(plan)
    assert hidden.breakdown.transfer_s == 0.0
    assert hidden.duration_s == pytest.approx(cm.step_time(plan))
    plan.kv_loads = [KVTransfer("big", list(range(1000)), 16000, "load")]
    exposed = SimExecutor(cm, "pcie4").execute(plan)
    moved = get_link("pcie4").latency_s + 16000 * 524288 / get_link("pcie4").bandwidth_bytes_s
    assert exposed.duration_s == pytest.approx(moved)
    assert exposed.breakdown.transfer_s == pytest.approx(moved - cm.step_time(plan))


def test_tensor_parallel_transfers_move_one_shard_per_gpu():
    link = get_link("net-400g")
    plan = BatchPlan(kv_saves=[KVTransfer("s", [0], 1000, "save")])
    tp1 = SimExecutor(CostModel("llama-2-13b", "a100-80gb", 1), link, overlap_transfers=False).execute(plan)
    tp2 = SimExecutor(CostModel("llama-2-13b", "a100-80gb", 2), link, overlap_transfers=False).execute(plan)
    assert tp2.duration_s - link.latency_s == pytest.approx((tp1.duration_s - link.latency_s) / 2)


def test_empty_plan_takes_no_time(cm):
    ex = SimExecutor(cm)
    result = ex.execute(BatchPlan())
    assert result.duration_s == 0.0 and result.sampled == {}
    assert ex.num_steps == 1


def test_bad_transfer_direction_is_named(cm):
    with pytest.raises(ValueError, match="^direction"):
        SimExecutor(cm).execute(BatchPlan(kv_loads=[KVTransfer("x", [0], 16, "sideways")]))


def test_from_names():
    ex = SimExecutor.from_names("llama-3-8b", "h100", tp=2, link="nvlink4")
    assert ex.cost_model.tp == 2 and ex.link.name == "nvlink4"
