"""perf/kernels.py and the per-kernel entry points of perf/cost.py, by hand (milliseconds each).

One kernel: ``time = max(flops / (peak eff_c(M)), bytes / (bw eff_m)) + latency`` with
eff_c(M) = eff_max M / (M + M_half) and the streaming memory time (bytes + b_half) / (bw eff_max ratio); a
weight GEMM [M x K] @ [K x N] + bias does 2 M K N FLOPs and moves dtype (K N + bias + M (K + N)) bytes. The
GEMM crossover is the smallest M at which compute wins, found here by walking M = 1, 2, ... on the formula.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvbalance.perf.cost import CostModel, allreduce_time
from kvbalance.perf.kernels import ATTENTION, ELEMENTWISE, GEMM, OpCount, OpTime, gemm_count, op_time
from kvbalance.specs import LinkSpec, MemoryCurve, ModelSpec, get_gpu

H, INTER, VOCAB, DT = 4096, 11008, 32000, 2  # llama-2-7b


def test_op_time_to_dict_has_every_field():
    t = OpTime("x", GEMM, 10.0, 20.0, 3.0, 2.0, 0.5)
    assert t.to_dict() == {
        "flops": 10.0,
        "bytes": 20.0,
        "compute_s": 3.0,
        "memory_s": 2.0,
        "latency_s": 0.5,
        "time_s": 3.5,
        "bound": "compute",
    }
    assert OpTime("y", GEMM, 0.0, 0.0, 2.0, 2.0).bound == "memory"  # a tie is memory-bound


def test_op_time_keeps_name_kind_and_the_attention_bandwidth_ratio():
    hw = dataclasses.replace(get_gpu("a100-80gb"), kv_memory_eff_ratio=0.5, memory_half_bytes=0.0)
    op = OpCount("attn_decode", ATTENTION, 0.0, 1e6, 4.0, repeat=3)
    t = op_time(op, hw)
    assert (t.name, t.kind, t.flops, t.bytes) == ("attn_decode", ATTENTION, 0.0, 3e6)
    # KV reads at half the streaming efficiency: 1e6 / (bw x eff_max x 0.5), three launches
    assert t.memory_s == pytest.approx(
        3 * 1e6 / (hw.mem_bandwidth_bytes_s * hw.memory_eff_max * 0.5), rel=1e-12
    )
    assert t.latency_s == 3 * hw.kernel_latency_s


def test_op_time_latency_follows_the_small_token_path():
    curve = MemoryCurve(
        eff=0.5, latency_s=3e-6, small_tokens=16, small_latency_s=1e-6, small_per_token_s=1e-7
    )
    hw = dataclasses.replace(get_gpu("a100-80gb"), elementwise_curves={"embedding": curve})
    small = op_time(OpCount("embedding", ELEMENTWISE, 0.0, 1e3, 8.0, 2, "embedding"), hw)
    assert small.latency_s == 2 * 1e-6 and small.memory_s == pytest.approx(2 * 8 * 1e-7, rel=1e-12)
    large = op_time(OpCount("embedding", ELEMENTWISE, 0.0, 1e3, 32.0, 2, "embedding"), hw)
    assert large.latency_s == 2 * 3e-6


def test_cost_model_kernel_shapes():
    cm = CostModel("llama-2-7b", "a100-80gb")
    assert cm.kernel("mlp_up", 10) == gemm_count("mlp_up", 10.0, H, 2 * INTER, DT)
    up = cm.kernel("mlp_up", 10)
    assert up.flops == 2 * 10 * H * 2 * INTER and up.bytes == DT * (H * 2 * INTER + 10 * (H + 2 * INTER))
    assert cm.kernel("qkv_proj", 3) == gemm_count("qkv_proj", 3.0, H, 3 * H, DT)
    assert cm.kernel("o_proj", 3).flops == 2 * 3 * H * H and cm.kernel("mlp_down", 1).flops == 2 * INTER * H
    head = cm.kernel("lm_head", 2)
    assert (head.name, head.kind, head.flops, head.size_tokens) == ("lm_head", GEMM, 2 * 2 * H * VOCAB, 2.0)
    norm = cm.kernel("final_norm", 6)
    assert norm == OpCount("final_norm", ELEMENTWISE, 5 * 6 * H, DT * (2 * 6 * H + H), 6.0, 1, "norm")
    act = cm.kernel("activation", 2)  # SwiGLU: 5 FLOPs per element, reads gate and up, writes one
    assert act == OpCount("activation", ELEMENTWISE, 5 * 2 * INTER, 3 * 2 * INTER * DT, 2.0, 1, "activation")
    with pytest.raises(
        ValueError,
        match=r"^op: 'attn_decode' is not a GEMM or element-wise operator \(known: qkv_proj, o_proj, mlp_up, mlp_down, lm_head, embedding,",
    ):
        cm.kernel("attn_decode", 1)


def test_cost_model_kernel_bias_of_an_opt_model():
    cm = CostModel("opt-13b", "a100-80gb")
    m = cm.model
    up = cm.kernel("mlp_up", 4)  # one up matrix with a bias of intermediate_size elements
    k, n = m.hidden_size, m.intermediate_size
    assert up.bytes == m.dtype_bytes * (k * n + n + 4 * (k + n))
    assert cm.kernel("final_norm", 4).curve == "layer_norm"


def test_allreduce_of_one_byte_is_not_free():
    link = LinkSpec("l", bandwidth_bytes_s=100.0, latency_s=0.5)
    assert allreduce_time(1, 2, link) == 2 * 1 / 2 * 1 / 100.0 + 0.5
    assert allreduce_time(0, 2, link) == 0.0 and allreduce_time(10, 1, link) == 0.0


def _walk_crossover(cm: CostModel, k: int, n: int, limit: int = 4096) -> int:
    """Smallest M with compute > memory by the roofline formulas, M = 1 .. limit (limit if never)."""
    hw = cm.gpu
    for m in range(1, limit + 1):
        compute = 2.0 * m * k * n * (m + hw.compute_half_tokens) / (m * hw.peak_flops * hw.compute_eff_max)
        memory = (DT * (k * n + m * (k + n)) + hw.memory_half_bytes) / (
            hw.mem_bandwidth_bytes_s * hw.memory_eff_max
        )
        if compute > memory:
            return m
    return limit


def test_gemm_crossover_is_the_first_compute_bound_token_count():
    cm = CostModel("llama-2-7b", "a100-80gb")
    for gemm, (k, n) in {"mlp_up": (H, 2 * INTER), "o_proj": (H, H)}.items():
        expect = _walk_crossover(cm, k, n)
        assert cm.gemm_crossover_tokens(gemm) == expect and isinstance(cm.gemm_crossover_tokens(gemm), int)
        assert cm.gemm_bound(expect - 1, gemm) == "memory" and cm.gemm_bound(expect, gemm) == "compute"
    assert cm.gemm_crossover_tokens() == cm.gemm_crossover_tokens("mlp_up") == 22
    assert cm.gemm_crossover_tokens("mlp_up", 4) == 4  # memory-bound at the limit: the limit
    slow = CostModel("llama-2-7b", dataclasses.replace(cm.gpu, peak_flops=1e9))
    assert slow.gemm_crossover_tokens() == 1  # compute-bound from one token on
    with pytest.raises(
        ValueError, match=r"^gemm: unknown 'lm_head' \(known: qkv_proj, o_proj, mlp_up, mlp_down\)$"
    ):
        cm.gemm_bound(8, "lm_head")


def test_gemm_crossover_is_of_the_gemm_asked_for():
    # a narrow MLP (I = 64): its up projection turns compute-bound much later than the QKV projection
    narrow = ModelSpec("narrow", 2, H, 32, 32, 128, 64, 1000, 4096)
    cm = CostModel(narrow, "a100-80gb")
    qkv = _walk_crossover(cm, H, 3 * H)
    assert _walk_crossover(cm, H, 2 * 64) == 4096  # not compute-bound within 4096 tokens
    assert cm.gemm_crossover_tokens("qkv_proj") == qkv and cm.gemm_crossover_tokens() == 1 << 20
    assert cm.gemm_crossover_tokens("qkv_proj", qkv + 1) == qkv  # the limit is checked on the same GEMM
