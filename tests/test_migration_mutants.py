"""perf/migration.py edges by hand (milliseconds each): every move costs bytes / bandwidth + latency plus a
synchronisation (two latencies by default); Llumnix's pre-copy rounds; BanaServe's layer and attention moves.

Link used throughout: 1 MB/s with 1 ms latency, so a round of n bytes takes 0.001 + n / 1e6 seconds.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvbalance.perf.cost import CostModel
from kvbalance.perf.migration import (
    AttentionSplitStep,
    LiveMigrationCost,
    StageTimes,
    attention_migration_cost,
    attention_split_step,
    layer_kv_bytes_per_token,
    layer_migration_cost,
    layer_weight_bytes,
    live_migration_cost,
    merge_exchange_bytes,
    pipeline_step,
    stage_times,
)
from kvbalance.specs import LinkSpec

LINK = LinkSpec("l", bandwidth_bytes_s=1e6, latency_s=1e-3)


@pytest.fixture(scope="module")
def cm():
    return CostModel("llama-2-7b", "a100-80gb")


def test_live_migration_two_rounds_by_hand():
    # round 0: ceil(32/16) = 2 blocks + 500 fixed bytes: 0.001 + 2500 / 1e6 = 3.5 ms, 17 tokens written (49)
    # round 1: blocks 2, 3 = 2 blocks, 3 ms; by then 32 tokens written (64): block 3 alone is left
    c = live_migration_cost(32, 5000.0, 16, 1000.0, LINK, fixed_bytes=500.0, sync_s=0.25)
    assert (c.round_blocks, c.final_blocks, c.converged, c.total_bytes) == ((2, 2), 1, True, 500 + 5 * 1000)
    assert c.precopy_s == pytest.approx(0.0035 + 0.003, rel=1e-12)
    assert c.downtime_s == pytest.approx(0.001 + 0.001 + 0.25, rel=1e-12)  # the given sync, not 2 ms
    d = live_migration_cost(32, 5000.0, 16, 1000.0, LINK, fixed_bytes=500.0)
    assert d.downtime_s == pytest.approx(0.002 + 0.002, rel=1e-12)
    three = live_migration_cost(32, 5000.0, 16, 1000.0, LINK, stop_copy_blocks=2, fixed_bytes=500.0)
    assert three.round_blocks == (2,) and three.final_blocks == 2  # 2 blocks may go in the stop-and-copy


def test_live_migration_stops_at_eight_rounds_by_default():
    c = live_migration_cost(32, 1e6, 16, 1000.0, LINK)
    assert c.rounds == 8 and not c.converged and c.final_blocks > 1
    assert live_migration_cost(32, 1e6, 16, 1000.0, LINK, max_rounds=3).rounds == 3


def test_live_migration_input_errors_name_the_field():
    good = dict(context_tokens=32, decode_tokens_per_s=1.0, block_size=16, block_bytes=10.0, link=LINK)
    for name in ("context_tokens", "decode_tokens_per_s", "block_bytes"):
        with pytest.raises(ValueError, match=f"^{name}: must be >= 0, got -1$"):
            live_migration_cost(**{**good, name: -1})
    for name in ("sync_s", "fixed_bytes", "stop_copy_blocks"):
        with pytest.raises(ValueError, match=f"^{name}: must be >= 0, got -1$"):
            live_migration_cost(**good, **{name: -1})
    for name in ("block_size", "num_requests", "max_rounds"):
        for bad in (0, 2.0):
            with pytest.raises(ValueError, match=f"^{name}: must be an integer >= 1, got {bad}$"):
                live_migration_cost(**{**good, name: bad})


def test_layer_ranges_and_weights(cm):
    m = cm.model
    assert layer_weight_bytes(cm, (0, 1)) == m.layer_params * m.dtype_bytes
    tp2 = CostModel("llama-2-7b", "a100-80gb", tp=2)
    w = layer_weight_bytes(tp2, (2, 5))
    assert w == 3 * m.layer_params * m.dtype_bytes // 2 and isinstance(w, int)
    assert layer_kv_bytes_per_token(cm, (0, 8)) == cm.kv_bytes_per_token / 4
    for bad in ((3, 3), (-1, 2), (0, 33), (0.0, 2)):
        with pytest.raises(
            ValueError, match=r"^layers: need 0 <= a < b <= 32 \(num_layers of llama-2-7b\), got "
        ):
            layer_weight_bytes(cm, bad)


def test_layer_migration_defaults_and_fields(cm):
    per_tok = layer_kv_bytes_per_token(cm, (0, 4))
    c = layer_migration_cost(cm, (0, 4), 100, LINK)  # no decodes by default: one round, one request
    assert c.layers == (0, 4) and c.weight_bytes == layer_weight_bytes(cm, (0, 4))
    assert c.kv_bytes == int(round(100 * per_tok)) and c.live.rounds == 1 and c.live.round_blocks == (7,)
    assert c.live == live_migration_cost(100, 0.0, 16, per_tok * 16, LINK, 1, 8, None, c.weight_bytes, 1)
    s = layer_migration_cost(cm, (1, 3), 100, LINK, sync_s=0.5)
    d = layer_migration_cost(cm, (1, 3), 100, LINK)  # default sync: two latencies
    assert s.layers == (1, 3) and s.live.downtime_s - d.live.downtime_s == pytest.approx(
        0.5 - 0.002, rel=1e-9
    )
    # requests taken alike: 33 tokens over 2 requests is 16 each (one block), not 16.5 (two)
    two = layer_migration_cost(cm, (0, 1), 33, LINK, num_requests=2)
    assert two.live.round_blocks == (2,)
    fast = layer_migration_cost(cm, (0, 1), 32, LINK, decode_tokens_per_s=1e7)
    assert fast.live.rounds == 8 and not fast.live.converged
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match=f"^num_requests: must be an integer >= 1, got {bad}$"):
            layer_migration_cost(cm, (0, 1), 32, LINK, num_requests=bad)
    with pytest.raises(ValueError, match="^kv_tokens: must be >= 0, got -1$"):
        layer_migration_cost(cm, (0, 1), -1, LINK)


def test_stage_times_of_an_empty_step_and_the_per_step_operators(cm):
    assert stage_times(cm, [], (0, 32)) == StageTimes(0.0, 0.0, 0.0, 0.0)
    seqs = [(1, 100, True)]
    times = cm.op_times(seqs)
    first, last = stage_times(cm, seqs, (0, 1)), stage_times(cm, seqs, (31, 32))
    # both hold one layer; the embedding runs on the first, the final norm and LM head on the last
    emb = times["embedding"].memory_s
    tail = times["final_norm"].memory_s + times["lm_head"].memory_s
    assert last.memory_s - first.memory_s == pytest.approx(tail - emb, rel=1e-9)
    middle = stage_times(cm, seqs, (10, 11))
    assert first.memory_s - middle.memory_s == pytest.approx(emb, rel=1e-9)


def test_pipeline_split_layer_bounds(cm):
    seqs = [(1, 100, True)]
    assert pipeline_step(cm, cm, seqs, 1, LINK).stage1 == stage_times(cm, seqs, (0, 1))
    for k in (0, 32):
        with pytest.raises(ValueError, match=f"^split_layer: need 0 < k < 32, got {k}$"):
            pipeline_step(cm, cm, seqs, k, LINK)
    other = CostModel("llama-2-13b", "a100-80gb")
    with pytest.raises(ValueError, match="^helper: runs llama-2-13b, home runs llama-2-7b$"):
        pipeline_step(cm, other, seqs, 1, LINK)
    with pytest.raises(ValueError, match="^helper: runs llama-2-13b, home runs llama-2-7b$"):
        attention_split_step(cm, other, seqs, 0.5, 1.0, LINK)


def test_attention_migration_heads_on_the_gpu(cm):
    # 32 KV heads: moving 1 moves 1/32 of the KV
    n, s = attention_migration_cost(cm, 1, 100, LINK)
    assert n == round(100 * cm.kv_bytes_per_token / 32) and s == pytest.approx(
        0.001 + n / 1e6 + 0.002, rel=1e-12
    )
    assert attention_migration_cost(cm, 1, 100, LINK, sync_s=0.5)[1] == pytest.approx(0.001 + n / 1e6 + 0.5)
    tp2 = CostModel("llama-3.1-70b", "a100-80gb", tp=2)  # 8 KV heads, 4 per GPU
    with pytest.raises(ValueError, match=r"^kv_heads: need 0 < n < 4 \(KV heads on this GPU"):
        attention_migration_cost(tp2, 4, 100, LINK)
    with pytest.raises(ValueError, match=r"^kv_heads: need 0 < n < 4 \(KV heads on this GPU.*got 0$"):
        attention_migration_cost(tp2, 0, 100, LINK)
    tp16 = CostModel("llama-3.1-70b", "a100-80gb", tp=16)  # 8 KV heads replicated: one per GPU, none to split
    with pytest.raises(ValueError, match=r"^kv_heads: need 0 < n < 1 \(KV heads on this GPU"):
        attention_migration_cost(tp16, 1, 100, LINK)


def test_merge_exchange_bytes_by_hand(cm):
    # 3 decodes, half of 32 query heads: 3 x 16 x (2 x 128 x 2 + 4)
    assert merge_exchange_bytes(cm, 3, 0.5) == 3 * 16 * (2 * 128 * 2 + 4)
    assert merge_exchange_bytes(cm, 3, 0.5, lse_bytes=0) == 3 * 16 * 512


def test_attention_split_without_a_move_is_the_full_step(cm):
    cm = CostModel("llama-2-7b", dataclasses.replace(cm.gpu, per_layer_overhead_s=1e-5))  # launches cost
    seqs = [(1, 500, True)] * 4
    full = stage_times(cm, seqs, (0, 32)).total_s
    assert attention_split_step(cm, cm, seqs, 0.0, 1.0, LINK) == AttentionSplitStep(full, full, 0.0, 0, 0.0)
    prefill = [(64, 64, True)]  # no decode attention to split
    p = stage_times(cm, prefill, (0, 32)).total_s
    assert attention_split_step(cm, cm, prefill, 0.5, 1.0, LINK) == AttentionSplitStep(p, p, 0.0, 0, 0.0)
    for name, args in (("kv_head_share", (1.5, 1.0)), ("helper_context_share", (0.5, -0.5))):
        with pytest.raises(
            ValueError, match=f"^{name}: must be in \\[0, 1\\], got {args[0] if name[0] == 'k' else args[1]}$"
        ):
            attention_split_step(cm, cm, seqs, *args, LINK)


def test_attention_split_step_by_hand(cm):
    cm = CostModel(
        "llama-2-7b", dataclasses.replace(cm.gpu, per_layer_overhead_s=1e-5)
    )  # the helper's launches
    seqs = [(1, 2000, True)] * 8
    full = stage_times(cm, seqs, (0, 32)).total_s
    attn = cm.op_times(seqs)["attn_decode"]
    slow_link = dataclasses.replace(LINK, bandwidth_bytes_s=1e12, latency_s=1e-7)
    r = attention_split_step(cm, cm, seqs, 0.5, 1.0, slow_link)
    x = 2 * 1e-7 + merge_exchange_bytes(cm, 8, 0.5) / 1e12  # per layer: queries out, outputs + LSE back
    helper_l = 0.5 * attn.time_s / 32 + cm.gpu.per_layer_overhead_s
    home_l = 0.5 * attn.time_s / 32
    assert r.helper_busy_s == pytest.approx(32 * helper_l, rel=1e-9)
    assert r.home_busy_s == pytest.approx(full - attn.time_s + 32 * home_l, rel=1e-9)
    assert r.step_s == pytest.approx(full - attn.time_s + 32 * max(home_l, x + helper_l), rel=1e-9)
    assert r.exchange_s == pytest.approx(32 * x, rel=1e-9)
    assert r.exchange_bytes == round(32 * merge_exchange_bytes(cm, 8, 0.5))
    assert (r.helper_flops, r.helper_bytes) == (0.5 * attn.flops, 0.5 * attn.bytes)


def test_live_migration_cost_fields():
    c = LiveMigrationCost((2, 1), 1, 0.5, 0.25, 100, True)
    assert c.rounds == 2 and c.total_s == 0.75


def test_stage_times_count_a_compute_memory_tie_as_memory_like_the_step(cm):
    # compute T h / peak equals memory 3 T h dt / bw for the residual add when bw = 6 x peak (dt = 2)
    tie = dataclasses.replace(
        cm.gpu,
        peak_flops=1e12,
        mem_bandwidth_bytes_s=6e12,
        compute_eff_max=1.0,
        memory_eff_max=1.0,
        compute_half_tokens=0.0,
        memory_half_bytes=0.0,
        elementwise_curves={},
    )
    tcm = CostModel("llama-2-7b", tie)
    seqs = [(8, 8, True)]
    add = tcm.op_times(seqs)["residual_add"]
    assert add.compute_s == add.memory_s > 0
    step, stage = tcm.step(seqs), stage_times(tcm, seqs, (0, 32))
    assert stage.compute_s == pytest.approx(step.compute_s, rel=1e-12)
    assert stage.memory_s == pytest.approx(step.memory_s, rel=1e-12)
