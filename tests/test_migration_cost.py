"""Migration cost models against hand computation (kvbalance.perf.migration)."""

from __future__ import annotations

import pytest

from kvbalance.perf.cost import CostModel
from kvbalance.perf.migration import (
    LSE_BYTES,
    activation_bytes,
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

GB_LINK = LinkSpec("test-1gbps", 1e9, 0.0)  # 1 ms per MB, no latency: hand arithmetic stays exact
MB = 1_000_000


@pytest.fixture(scope="module")
def cm():
    return CostModel("llama-13b", "a100-80gb")


def test_live_migration_one_round_then_stop_and_copy():
    # 160 tokens = 10 blocks -> 10 ms; 100 tok/s writes 1 token meanwhile, re-dirtying block 10 only
    c = live_migration_cost(160, 100.0, 16, MB, GB_LINK)
    assert c.round_blocks == (10,) and c.final_blocks == 1 and c.converged
    assert c.precopy_s == pytest.approx(0.010) and c.downtime_s == pytest.approx(0.001)
    assert c.total_bytes == 11 * MB


def test_live_migration_copies_a_partial_last_block_again():
    # 150 tokens: 9 full blocks + a partial one (10 copied); the token written meanwhile lands in block 9
    c = live_migration_cost(150, 100.0, 16, MB, GB_LINK)
    assert c.round_blocks == (10,) and c.final_blocks == 1 and c.total_bytes == 11 * MB


def test_live_migration_rounds_copy_what_was_written_meanwhile():
    # round 0: 10 blocks, 10 ms, 32 tokens -> positions 160..191 = blocks 10, 11 dirty
    # round 1: 2 blocks, 2 ms (t = 12 ms), floor(3200 * 0.012) = 38 tokens -> position 198, block 12 dirty
    c = live_migration_cost(160, 3200.0, 16, MB, GB_LINK)
    assert c.round_blocks == (10, 2) and c.final_blocks == 1 and c.rounds == 2
    assert c.precopy_s == pytest.approx(0.012) and c.downtime_s == pytest.approx(0.001)
    assert c.total_bytes == 13 * MB and c.total_s == pytest.approx(0.013)


def test_live_migration_latency_and_sync_per_round():
    link = LinkSpec("lat", 1e9, 1e-3)
    c = live_migration_cost(160, 100.0, 16, MB, link)  # round 0: 1 ms latency + 10 ms; 1 token written
    assert c.precopy_s == pytest.approx(0.011)
    assert c.downtime_s == pytest.approx(0.001 + 0.001 + 2 * 0.001)  # latency + 1 block + handshake


def test_live_migration_that_cannot_converge_stops_at_max_rounds():
    # 32000 tok/s writes 2 blocks per ms; the link drains 1: dirty blocks grow, never under the threshold
    c = live_migration_cost(160, 32000.0, 16, MB, GB_LINK, max_rounds=4)
    assert c.rounds == 4 and not c.converged
    assert c.final_blocks > c.round_blocks[0]


def test_layer_weights_and_kv_bytes_by_hand(cm):
    # llama-13b layer: 4 * 5120^2 (q, k, v, o) + 3 * 5120 * 13824 (gate, up, down) + 2 * 5120 (norms)
    params = 4 * 5120**2 + 3 * 5120 * 13824 + 2 * 5120
    assert layer_weight_bytes(cm, (30, 40)) == 10 * params * 2
    assert layer_kv_bytes_per_token(cm, (30, 40)) == 2 * 10 * 5120 * 2
    tp2 = CostModel("llama-13b", "a100-80gb", tp=2)
    assert layer_weight_bytes(tp2, (30, 40)) == 10 * params
    with pytest.raises(ValueError, match="layers"):
        layer_weight_bytes(cm, (30, 41))


def test_layer_migration_moves_weights_then_kv_in_rounds(cm):
    link = LinkSpec("nv", 300e9, 0.0)
    idle = layer_migration_cost(cm, (30, 40), 32 * 1024, link, num_requests=32)
    w, kv = layer_weight_bytes(cm, (30, 40)), 32 * 1024 * 204800
    assert idle.weight_bytes == w and idle.kv_bytes == kv
    assert idle.transfer_s == pytest.approx((w + kv) / 300e9)  # nothing written meanwhile: one round
    busy = layer_migration_cost(cm, (30, 40), 32 * 1024, link, decode_tokens_per_s=32 / 0.03, num_requests=32)
    assert busy.live.round_blocks[0] == 32 * 64 and busy.live.final_blocks == 32  # each request's last block
    assert busy.total_bytes == w + kv + 32 * 16 * 204800


@pytest.mark.parametrize("model, tp", [("opt-13b", 1), ("llama-3-8b", 2), ("qwen2.5-7b", 1)])
def test_stage_times_add_up_to_the_step_for_other_shapes(model, tp):
    cm = CostModel(model, "h100-sxm", tp=tp)
    seqs = [(1, 700, True)] * 8 + [(300, 300, True)]
    L = cm.model.num_layers
    a, b = stage_times(cm, seqs, (0, L // 3)), stage_times(cm, seqs, (L // 3, L))
    assert stage_times(cm, seqs, (0, L)).total_s == pytest.approx(cm.step_seconds(seqs))
    assert a.total_s + b.total_s == pytest.approx(
        cm.step_seconds(seqs) + cm.step_fixed_host_s
    )  # paid per stage
    assert a.comm_s + b.comm_s == pytest.approx(cm.comm_s(8 + 300))


def test_stage_times_split_the_step_by_layers(cm):
    seqs = [(1, 900, True)] * 24 + [(512, 512, True)]
    full = stage_times(cm, seqs, (0, 40))
    assert full.total_s == pytest.approx(cm.step_seconds(seqs))
    a, b = stage_times(cm, seqs, (0, 25)), stage_times(cm, seqs, (25, 40))
    assert a.compute_s + b.compute_s == pytest.approx(full.compute_s)
    assert a.memory_s + b.memory_s == pytest.approx(full.memory_s)
    assert a.overhead_s + b.overhead_s == pytest.approx(full.overhead_s + cm.step_fixed_host_s)  # per stage
    # a per-layer operator (the MLP) splits 25:15; the LM head sits wholly on the last stage
    times = cm.op_times(seqs)
    only_head = stage_times(cm, seqs, (39, 40)).memory_s + stage_times(cm, seqs, (39, 40)).compute_s
    per_layer = (full.compute_s + full.memory_s - times["embedding"].time_s - times["final_norm"].time_s) / 40
    head = times["lm_head"].time_s
    assert only_head == pytest.approx(per_layer + times["final_norm"].time_s + head - head / 40, rel=0.02)


def test_pipeline_step_is_two_stages_plus_activation_handoff(cm):
    link = LinkSpec("nv", 300e9, 8e-6)
    seqs = [(1, 1024, True)] * 32
    p = pipeline_step(cm, cm, seqs, 30, link)
    handoff = 8e-6 + 32 * 5120 * 2 / 300e9
    assert activation_bytes(cm, 32) == 32 * 5120 * 2
    assert p.handoff_s == pytest.approx(handoff)
    assert p.latency_s == pytest.approx(p.stage1.total_s + handoff + p.stage2.total_s)
    assert p.interval_s == pytest.approx(max(p.stage1.total_s, p.stage2.total_s))
    assert p.latency_s > cm.step_seconds(seqs)  # one extra step overhead and the hand-off
    h100 = CostModel("llama-13b", "h100-sxm")
    assert pipeline_step(cm, h100, seqs, 30, link).stage2.total_s < p.stage2.total_s  # faster helper GPU
    with pytest.raises(ValueError, match="split_layer"):
        pipeline_step(cm, cm, seqs, 40, link)


def test_attention_migration_bytes_by_head_share(cm):
    link = LinkSpec("nv", 300e9, 8e-6)
    nbytes, seconds = attention_migration_cost(cm, 10, 32 * 1024, link)
    assert nbytes == 32 * 1024 * 819200 * 10 // 40
    assert seconds == pytest.approx(8e-6 + nbytes / 300e9 + 2 * 8e-6)
    with pytest.raises(ValueError, match="kv_heads"):
        attention_migration_cost(cm, 40, 100, link)


def test_attention_split_divides_decode_attention_and_adds_the_merge_exchange(cm):
    link = LinkSpec("nv", 300e9, 8e-6)
    seqs = [(1, 2048, True)] * 32
    assert attention_split_step(cm, cm, seqs, 0.0, 1.0, link).step_s == pytest.approx(cm.step_seconds(seqs))
    s = attention_split_step(cm, cm, seqs, 0.25, 1.0, link)
    attn = cm.op_times(seqs)["attn_decode"].time_s
    rest = cm.step_seconds(seqs) - attn
    assert s.home_busy_s == pytest.approx(rest + 0.75 * attn)
    # decode attention: 4 * head_dim FLOPs per (head, key) and K+V of each context token, every layer
    assert s.helper_flops == pytest.approx(0.25 * 40 * 4 * 128 * 40 * 32 * 2048)
    kv_read, q_io = 32 * 2048 * 2 * 5120 * 2, 2 * 32 * 5120 * 2
    assert s.helper_bytes == pytest.approx(0.25 * 40 * (kv_read + q_io))
    assert s.helper_busy_s == pytest.approx(0.25 * attn + 40 * cm.gpu.per_layer_overhead_s)
    heads = 10  # a quarter of 40 query heads
    assert merge_exchange_bytes(cm, 32, 0.25) == 32 * heads * (2 * 128 * 2 + LSE_BYTES)
    assert s.exchange_bytes == 40 * 32 * heads * (2 * 128 * 2 + LSE_BYTES)
    per_layer_x = 2 * 8e-6 + 32 * heads * (2 * 128 * 2 + LSE_BYTES) / 300e9
    assert s.exchange_s == pytest.approx(40 * per_layer_x)
    assert s.step_s == pytest.approx(rest + 40 * max(0.75 * attn / 40, per_layer_x + s.helper_busy_s / 40))
    assert s.step_s < cm.step_seconds(seqs)  # the two partial attentions run side by side
    half_context = attention_split_step(cm, cm, seqs, 0.25, 0.5, link)
    assert half_context.home_busy_s == pytest.approx(rest + (1 - 0.125) * attn)
