"""Cost model: exact operator counts and formulas that hold whatever the fitted efficiency curves are.

FLOPs and bytes come from the model's shape alone (Llama-2-7B: 32 layers, hidden 4096, 32 heads of 128,
MLP 11008, vocab 32000, fp16), so they are pinned exactly; times are checked through the roofline
definitions (``compute_time_s`` / ``memory_time_s`` of the same spec) and the ring all-reduce formula,
never through today's constants (DESIGN.md, "The cost model").
"""

from __future__ import annotations

import dataclasses

import pytest

from kvbalance.perf.cost import (
    ATTENTION,
    GEMM,
    CostModel,
    allreduce_time,
    breakdown_total_s,
    compute_time_s,
    kv_heads_per_rank,
    memory_time_s,
    transfer_time,
)
from kvbalance.perf.memory import kv_bytes_per_token
from kvbalance.specs import LinkSpec, get_gpu, get_model

L, H, HEADS, HD, INTER, VOCAB, DT = 32, 4096, 32, 128, 11008, 32000, 2


@pytest.fixture(scope="module")
def cm():
    return CostModel("llama-2-7b", "a100-80gb")


def test_prefill_attention_flops_count_every_earlier_context_key(cm):
    # a 512-token chunk after 1536 tokens of context: token i sees 1536 + i + 1 keys
    n, ctx = 512, 2048
    pairs = n * (ctx - n) + n * (n + 1) / 2
    assert pairs == 917_760
    op = cm.op_times([(n, ctx, False)])["attn_prefill"]
    assert op.flops == 4 * HD * HEADS * pairs * L
    # KV of the whole context read once, q read and the output written
    assert op.bytes == (ctx * 2 * HEADS * HD * DT + 2 * n * HEADS * HD * DT) * L
    alone = cm.op_times([(n, n, False)])["attn_prefill"]
    assert alone.flops == 4 * HD * HEADS * (n * (n + 1) / 2) * L < op.flops
    assert cm.step_seconds([(n, ctx, False)]) > cm.step_seconds([(n, n, False)])


def test_two_prefill_chunks_add_their_pairs_and_contexts(cm):
    both = cm.op_times([(100, 300, True), (50, 50, False)])["attn_prefill"]
    pairs = 100 * 200 + 100 * 101 / 2 + 50 * 51 / 2
    assert both.flops == 4 * HD * HEADS * pairs * L
    assert both.bytes == ((300 + 50) * 2 * HEADS * HD * DT + 2 * 150 * HEADS * HD * DT) * L


def test_decode_attention_reads_each_sequences_context(cm):
    op = cm.op_times([(1, 100, True), (1, 900, True)])["attn_decode"]
    assert op.flops == 4 * HD * HEADS * 1000 * L
    assert op.bytes == (1000 * 2 * HEADS * HD * DT + 2 * 2 * HEADS * HD * DT) * L
    assert "attn_prefill" not in cm.op_times([(1, 100, True)])


def test_gemm_counts_are_two_flops_per_weight_per_token(cm):
    ops = cm.op_times([(10, 10, True)])
    shapes = {"qkv_proj": (H, 3 * H), "o_proj": (H, H), "mlp_up": (H, 2 * INTER), "mlp_down": (INTER, H)}
    for name, (k, n) in shapes.items():
        assert ops[name].flops == 2 * 10 * k * n * L
        assert ops[name].bytes == DT * (k * n + 10 * (k + n)) * L
    # the LM head runs once per sampled token
    assert ops["lm_head"].flops == 2 * 1 * H * VOCAB
    assert ops["lm_head"].bytes == DT * (H * VOCAB + (H + VOCAB))


def test_norm_and_embedding_counts(cm):
    t = 6
    ops = cm.op_times([(t, t, False)])
    assert ops["embedding"].flops == 0 and ops["embedding"].bytes == 2 * t * H * DT
    assert ops["norm"].flops == 5 * t * H * 2 * L
    assert ops["norm"].bytes == DT * (2 * t * H + H) * 2 * L
    assert ops["final_norm"].flops == 5 * t * H and ops["final_norm"].bytes == DT * (2 * t * H + H)
    assert "lm_head" not in ops


def test_step_totals_are_the_sums_over_operators(cm):
    seqs = [(300, 700, True), (1, 50, True), (1, 4000, True)]
    b = cm.step(seqs)
    assert b.compute_s > 0 and b.memory_s > 0  # a mixed step has both compute- and memory-bound kernels
    assert b.flops == sum(o.flops * o.repeat for o in cm.op_counts(seqs))
    assert b.bytes == sum(o.bytes * o.repeat for o in cm.op_counts(seqs))
    assert breakdown_total_s(b) == b.compute_s + b.memory_s + b.overhead_s + b.comm_s + b.transfer_s
    assert b.comm_s == 0.0
    assert cm.step([]).compute_s == 0.0 and cm.step_seconds([]) == 0.0


def test_roofline_efficiency_curves_follow_their_definitions():
    hw = get_gpu("a100-80gb")
    eff = hw.compute_eff_max
    x = 64.0
    assert compute_time_s(1e12, x, hw) == pytest.approx(
        1e12 * (x + hw.compute_half_tokens) / (x * hw.peak_flops * eff)
    )
    attn = compute_time_s(1e12, x, hw, ATTENTION)
    assert attn == pytest.approx(compute_time_s(1e12, x, hw, GEMM) / hw.attention_eff_ratio)
    assert compute_time_s(1e12, 0.25, hw) == compute_time_s(1e12, 1.0, hw)  # sizes below one token clamp
    assert compute_time_s(0.0, x, hw) == 0.0 and memory_time_s(0.0, hw) == 0.0
    b = 1e9
    assert memory_time_s(b, hw) == pytest.approx(
        (b + hw.memory_half_bytes) / (hw.mem_bandwidth_bytes_s * hw.memory_eff_max)
    )
    assert memory_time_s(b, hw, ATTENTION) == pytest.approx(memory_time_s(b, hw) / hw.kv_memory_eff_ratio)


def test_ring_allreduce_formula_and_tp_comm_per_layer():
    link = LinkSpec("test", bandwidth_bytes_s=100e9, latency_s=5e-6)
    assert allreduce_time(1e9, 4, link) == pytest.approx(2 * 3 / 4 * 1e9 / 100e9 + 5e-6)
    assert allreduce_time(1e9, 2, link) == pytest.approx(1e9 / 100e9 + 5e-6)
    assert allreduce_time(1e9, 1, link) == 0.0 and allreduce_time(0, 4, link) == 0.0
    cm2 = CostModel("llama-2-7b", "a100-80gb", tp=2, link=link)
    assert cm2.comm_s(10) == pytest.approx(2 * L * allreduce_time(10 * H * DT, 2, link))
    assert cm2.comm_s(0) == 0.0
    assert cm2.step([(10, 10, True)]).comm_s == pytest.approx(cm2.comm_s(10))
    ops = cm2.op_times([(10, 10, True)])
    assert ops["qkv_proj"].flops == 2 * 10 * H * (3 * H // 2) * L  # each rank holds half the heads
    assert ops["mlp_down"].flops == 2 * 10 * (INTER // 2) * H * L
    assert ops["lm_head"].flops == 2 * H * (VOCAB // 2)


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    link = LinkSpec("test", bandwidth_bytes_s=50e9, latency_s=1e-5)
    assert transfer_time(5e9, link) == pytest.approx(1e-5 + 0.1)
    assert transfer_time(0, link) == 0.0
    with pytest.raises(ValueError, match="num_bytes"):
        transfer_time(-1, link)


def test_kv_bytes_per_token_and_replicated_kv_heads():
    m = get_model("llama-3-8b")  # 8 KV heads
    assert kv_heads_per_rank(m, 1) == 8 and kv_heads_per_rank(m, 4) == 2 and kv_heads_per_rank(m, 16) == 1
    assert kv_bytes_per_token(m, 1) == 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_token(m, 2) == 2 * 32 * 4 * 128 * 2
    cm = CostModel(m, "h100-sxm", tp=2)
    assert cm.kv_transfer_bytes(10) == 10 * 2 * 32 * 4 * 128 * 2


def test_gemm_crossover_is_where_compute_overtakes_memory(cm):
    x = cm.gemm_crossover_tokens("mlp_down")
    assert cm.gemm_bound(x, "mlp_down") == "compute" and cm.gemm_bound(x - 1, "mlp_down") == "memory"
    fast_memory = dataclasses.replace(cm.gpu, mem_bandwidth_bytes_s=cm.gpu.mem_bandwidth_bytes_s * 4)
    # more bandwidth: the memory time shrinks, so the GEMM turns compute-bound at fewer tokens
    assert CostModel("llama-2-7b", fast_memory).gemm_crossover_tokens("mlp_down") < x
    assert cm.gemm_crossover_tokens("mlp_down", limit=2) == 2  # not compute-bound within the limit
    with pytest.raises(ValueError, match="gemm: unknown 'attn'"):
        cm.gemm_bound(8, "attn")
