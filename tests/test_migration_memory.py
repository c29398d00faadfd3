"""Migrations conserve memory on both GPUs, and candidate moves are priced by the cost models."""

from __future__ import annotations

import pytest

from kvbalance.cluster.migration import ATTENTION, LAYER, AdaptiveMigrator
from kvbalance.cluster.migration_candidates import (
    GPUState,
    attention_candidates,
    candidates_from,
    layer_candidates,
)
from kvbalance.cluster.migration_memory import (
    GPUMemory,
    cancel_move,
    commit_move,
    kv_capacity_tokens,
    reserve_move,
)
from kvbalance.perf.cost import CostModel
from kvbalance.perf.migration import attention_split_step, layer_migration_cost, pipeline_step
from kvbalance.specs import get_link

GIB = 1 << 30


def total(*gpus: GPUMemory) -> int:
    return sum(g.weight_bytes + g.kv_bytes for g in gpus)


def test_layer_move_conserves_weights_and_kv_across_both_gpus():
    src = GPUMemory(80 * GIB, weight_bytes=26 * GIB, kv_bytes=30 * GIB)
    dst = GPUMemory(80 * GIB, weight_bytes=26 * GIB, kv_bytes=10 * GIB)
    w, kv = 6 * GIB, 7 * GIB
    dst = reserve_move(dst, w, kv)  # in flight: the source still serves from its copy
    assert dst.reserved_bytes == w + kv and src.weight_bytes == 26 * GIB
    assert total(src, dst) == 92 * GIB
    src, dst = commit_move(src, dst, w, kv)
    assert (src.weight_bytes, src.kv_bytes) == (20 * GIB, 23 * GIB)
    assert (dst.weight_bytes, dst.kv_bytes, dst.reserved_bytes) == (32 * GIB, 17 * GIB, 0)
    assert total(src, dst) == 92 * GIB and src.free_bytes == 37 * GIB
    assert kv_capacity_tokens(src, 819200 * 30 / 40) == 37 * GIB // (819200 * 30 / 40)


def test_moves_that_do_not_fit_or_do_not_add_up_are_refused():
    dst = GPUMemory(40 * GIB, weight_bytes=26 * GIB, kv_bytes=10 * GIB)
    with pytest.raises(ValueError, match="dst"):
        reserve_move(dst, 3 * GIB, 2 * GIB)
    src = GPUMemory(80 * GIB, weight_bytes=26 * GIB, kv_bytes=1 * GIB)
    with pytest.raises(ValueError, match="src"):
        commit_move(src, reserve_move(GPUMemory(80 * GIB), 0, 2 * GIB), 0, 2 * GIB)
    with pytest.raises(ValueError, match="dst"):
        commit_move(src, GPUMemory(80 * GIB), 0, GIB)  # nothing reserved
    with pytest.raises(ValueError, match="capacity_bytes"):
        GPUMemory(GIB, weight_bytes=2 * GIB)


def test_an_abort_and_a_preemption_crossing_an_attention_move_lose_nothing():
    """Moving K/V of three requests (a, b, c); a aborts and b is preempted while the copy is in flight."""
    per = {"a": 2 * GIB, "b": 3 * GIB, "c": 4 * GIB}
    home = GPUMemory(80 * GIB, weight_bytes=26 * GIB, kv_bytes=sum(per.values()) + 5 * GIB)
    helper = reserve_move(GPUMemory(80 * GIB, weight_bytes=26 * GIB), 0, sum(per.values()))
    before = total(home, helper)
    # a aborts, b is preempted: the home frees their blocks, the helper drops their reservations
    for rid in ("a", "b"):
        home = GPUMemory(home.capacity_bytes, home.weight_bytes, home.kv_bytes - per[rid])
        helper = cancel_move(helper, 0, per[rid])
    home, helper = commit_move(home, helper, 0, per["c"])  # the move lands for c only
    assert total(home, helper) == before - per["a"] - per["b"]
    assert helper.reserved_bytes == 0 and helper.kv_bytes == per["c"] and home.kv_bytes == 5 * GIB
    with pytest.raises(ValueError, match="dst"):
        cancel_move(helper, 0, 1)  # nothing left to cancel: no double free


def state(gpu: str, util: float, batch, kv_tokens: int = 0, rate: float = 0.0) -> GPUState:
    cm = CostModel("llama-13b", "a100-80gb")
    mem = GPUMemory(80 * GIB, weight_bytes=cm.model.weight_bytes, kv_bytes=kv_tokens * cm.kv_bytes_per_token)
    return GPUState(gpu, cm, util, mem, tuple(batch), kv_tokens, rate)


def test_layer_candidates_predict_utilisation_from_the_pipeline_stages():
    link = get_link("nvlink")
    hot = state("p", 0.9, [(512, 512, True)] * 4)
    cold = state("d", 0.2, [(1, 600, True)] * 8)
    cands = layer_candidates(hot, cold, link)
    assert [c.layers for c in cands] == [(35, 40), (30, 40), (25, 40), (20, 40)]
    c = cands[1]
    before = hot.cost_model.step_seconds(list(hot.batch))
    p = pipeline_step(hot.cost_model, cold.cost_model, list(hot.batch), 30, link)
    assert c.kind == LAYER and c.src_util_after == pytest.approx(0.9 * p.stage1.total_s / before)
    assert c.dst_util_after == pytest.approx(0.2 + 0.9 * p.stage2.total_s / before)
    assert c.transfer_s == pytest.approx(layer_migration_cost(hot.cost_model, (30, 40), 0, link).transfer_s)
    full = state("d", 0.2, [(1, 600, True)] * 8, kv_tokens=70_000)  # no room left for any layer range
    assert layer_candidates(hot, full, link) == []


def test_attention_candidates_and_the_policy_pick_one_for_a_memory_bound_decode_gpu():
    link = get_link("nvlink")
    hot = state("d", 0.95, [(1, 2048, True)] * 32, kv_tokens=32 * 2048, rate=32 / 0.03)
    cold = state("p", 0.3, [(512, 512, True)] * 2)
    cands = attention_candidates(hot, cold, link)
    assert [c.kv_heads for c in cands] == [5, 10, 20]
    s = attention_split_step(hot.cost_model, cold.cost_model, list(hot.batch), 10 / 40, 1.0, link)
    before = hot.cost_model.step_seconds(list(hot.batch))
    assert cands[1].src_util_after == pytest.approx(0.95 * s.home_busy_s / before)
    assert cands[1].kv_bytes == 32 * 2048 * hot.cost_model.kv_bytes_per_token // 4
    from kvbalance.cluster.monitor import GPUUtilization

    utils = {
        "d": GPUUtilization("d", 0.1, 0.85, 0.95, 0.0, 2.0),
        "p": GPUUtilization("p", 0.25, 0.05, 0.3, 0.0, 2.0),
    }
    d = AdaptiveMigrator().decide(0.0, utils, candidates_from(hot, [hot, cold], link))
    assert d.action == ATTENTION and d.candidate.dst == "p"
