"""The prefill-attention kernel (kvbalance/model/native_prefill.py: AMX, or AVX-512 BF16 where the CPU has
no AMX) against a float64 reference and torch's bf16 SDPA: whole prompts and later chunks, across block and
key-block boundaries, GQA groups 1 and 3; threads; the strided QKV view; the fallbacks
(``KVBALANCE_NATIVE=0``, ``KVBALANCE_NATIVE_AMX=0``, other dtypes and shapes) and the engine's prefill
branch taking it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvbalance.model import native_prefill
from kvbalance.model.llama import Attention, LlamaConfig, build_step_metadata

needs_kernel = pytest.mark.skipif(
    not native_prefill.available(), reason="no AMX-BF16 or AVX512-BF16, or no compiler here"
)


def _case(seed, n, q_start, block_size, heads, kvh, peaked=False):
    """bf16 chunk queries as the strided view out of fused QKV rows, and a cache whose blocks are scattered."""
    g = torch.Generator().manual_seed(seed)
    ctx = q_start + n
    used = (ctx + block_size - 1) // block_size
    k = torch.randn(kvh, used + 3, block_size, 64, generator=g)
    if peaked:  # later keys score higher: the running maximum keeps rising (conditional rescaling)
        k = k + torch.linspace(0, 3, (used + 3) * block_size).view(1, -1, block_size, 1)
    v = torch.randn(kvh, used + 3, block_size, 64, generator=g)
    table = torch.randperm(used + 3, generator=g)[:used]
    qkv = torch.randn(n, (heads + 2 * kvh) * 64, generator=g) * (4 if peaked else 2)
    q = qkv.bfloat16()[:, : heads * 64].view(n, heads, 64)
    return q, k.bfloat16(), v.bfloat16(), table


def _context(cache, table, ctx):
    bs = cache.shape[2]
    pos = torch.arange(ctx)
    return cache[:, table[pos // bs], pos % bs]  # [kvh, ctx, 64]


def _reference(q, k, v, table, q_start, scale):
    """Causal softmax attention in float64 over the bf16 values: [n, heads * 64]."""
    n, heads, _ = q.shape
    ctx, group = q_start + n, heads // k.shape[0]
    kc, vc = _context(k, table, ctx).double(), _context(v, table, ctx).double()
    allowed = torch.arange(ctx)[None, :] <= (q_start + torch.arange(n))[:, None]
    out = torch.empty(n, heads, 64, dtype=torch.float64)
    for h in range(heads):
        s = (q[:, h].double() @ kc[h // group].T * scale).masked_fill(~allowed, -math.inf)
        out[:, h] = torch.softmax(s, dim=-1) @ vc[h // group]
    return out.reshape(n, -1)


def _sdpa(q, k, v, table, q_start, scale):
    """Torch's bf16 SDPA as the engine called it before the kernel (gathered context, float mask)."""
    n, ctx = q.shape[0], q_start + q.shape[0]
    allowed = torch.arange(ctx)[None, :] <= (q_start + torch.arange(n))[:, None]
    bias = torch.zeros(n, ctx).masked_fill(~allowed, -math.inf).bfloat16()
    kc, vc = _context(k, table, ctx)[None], _context(v, table, ctx)[None]
    qp = q.transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(qp, kc, vc, attn_mask=bias, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(n, -1)


@needs_kernel
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
@pytest.mark.parametrize("q_start, block_size", [(0, 64), (40, 64), (64, 64), (5, 16), (48, 16)])
@pytest.mark.parametrize("heads, kvh", [(9, 3), (4, 4)])
def test_kernel_matches_the_float64_reference(n, q_start, block_size, heads, kvh):
    """q_start 0, mid-block and on a block edge; n across the 16-query units; within one bf16 rounding of
    float64, and on average at least as close as torch's bf16 SDPA."""
    q, k, v, table = _case(n * 1000 + q_start, n, q_start, block_size, heads, kvh)
    out = native_prefill.paged_prefill_attention(q, k, v, table, q_start, 0.125)
    assert out.shape == (n, heads * 64) and out.dtype == torch.bfloat16
    ref = _reference(q, k, v, table, q_start, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=2**-8)
    ours, torch_err = (
        (out.double() - ref).abs().mean(),
        (_sdpa(q, k, v, table, q_start, 0.125).double() - ref).abs(),
    )
    assert ours <= torch_err.mean() * 1.02 + 1e-7


@needs_kernel
@pytest.mark.parametrize("scale", [0.125, 0.1])
def test_rising_scores_rescale_and_long_chunks_match(scale):
    """A later chunk of 300 over 700 cached keys whose scores keep rising (the running maximum is raised
    block after block; conditional rescaling must stay exact) and a 200-token whole prompt."""
    for n, q_start in ((300, 700), (200, 0)):
        q, k, v, table = _case(11, n, q_start, 64, 9, 3, peaked=True)
        out = native_prefill.paged_prefill_attention(q, k, v, table, q_start, scale)
        torch.testing.assert_close(
            out.double(), _reference(q, k, v, table, q_start, scale), atol=1e-4, rtol=2**-8
        )


@needs_kernel
def test_thread_count_does_not_change_the_bits():
    q, k, v, table = _case(3, 130, 70, 64, 9, 3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_prefill.paged_prefill_attention(q, k, v, table, 70, 0.125)
        for t in (2, 3):
            torch.set_num_threads(t)
            assert torch.equal(native_prefill.paged_prefill_attention(q, k, v, table, 70, 0.125), one)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_strided_queries_equal_contiguous_ones_and_bad_tables_are_rejected():
    q, k, v, table = _case(4, 33, 20, 16, 9, 3)
    assert not q.is_contiguous()
    out = native_prefill.paged_prefill_attention(q, k, v, table, 20, 0.125)
    assert torch.equal(out, native_prefill.paged_prefill_attention(q.contiguous(), k, v, table, 20, 0.125))
    with pytest.raises(ValueError, match="block_table"):
        native_prefill.paged_prefill_attention(q, k, v, table[:2], 20, 0.125)


def test_can_use_falls_back_for_other_dtypes_shapes_and_the_switch(monkeypatch):
    q, k, v, table = _case(5, 20, 0, 64, 9, 3)
    assert native_prefill.can_use(q, k, v) == native_prefill.available()
    assert not native_prefill.can_use(q.float(), k.float(), v.float())  # fp32 model
    assert not native_prefill.can_use(q[..., :32], k[..., :32].contiguous(), v[..., :32].contiguous())
    k8 = k.view(3, -1, 8, 64)  # blocks of 8 rows: a 16-row tile would cross blocks
    assert not native_prefill.can_use(q, k8, v.view(3, -1, 8, 64))
    assert not native_prefill.can_use(q.transpose(1, 2).contiguous().transpose(1, 2), k, v)
    monkeypatch.setenv("KVBALANCE_NATIVE", "0")
    assert not native_prefill.available() and not native_prefill.can_use(q, k, v)


def _attention_layer(seed):
    config = LlamaConfig(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, num_layers=1)
    torch.manual_seed(seed)
    layer = Attention(config).bfloat16()
    layer.k_cache = torch.randn(3, 12, 16, 64).bfloat16()
    layer.v_cache = torch.randn(3, 12, 16, 64).bfloat16()
    return layer


@pytest.mark.parametrize("q_start", [0, 37])
def test_the_prefill_branch_takes_the_kernel_and_the_switch_keeps_sdpa(monkeypatch, q_start):
    """``Attention._attend`` on a prefill chunk: the kernel where it can run (output equal to calling it),
    SDPA under ``KVBALANCE_NATIVE=0``; both within bf16 rounding of each other."""
    layer, n = _attention_layer(6), 40
    table = [7, 2, 9, 0, 5, 11]
    meta = build_step_metadata([q_start], [n], [table], [0], 16, 3, "cpu", torch.bfloat16)
    (g,) = meta.groups
    q = torch.randn(n, 9, 64).bfloat16()
    k_new = layer.k_cache.view(3, -1, 64)[:, meta.slot_mapping].transpose(0, 1)
    v_new = layer.v_cache.view(3, -1, 64)[:, meta.slot_mapping].transpose(0, 1)
    calls = []
    real = native_prefill.paged_prefill_attention
    monkeypatch.setattr(native_prefill, "paged_prefill_attention", lambda *a: calls.append(1) or real(*a))
    out = layer._attend(q, g, k_new, v_new)
    if native_prefill.available():
        assert calls and torch.equal(
            out, real(q, layer.k_cache, layer.v_cache, g.block_index, q_start, layer.scale)
        )
    monkeypatch.setenv("KVBALANCE_NATIVE", "0")
    calls.clear()
    sdpa = layer._attend(q, g, k_new, v_new)
    assert not calls
    torch.testing.assert_close(out.float(), sdpa.float(), atol=2e-2, rtol=2**-6)


def test_the_kernel_builds_where_the_cpu_has_amx():
    """A source that no longer compiles must fail here, not skip every kernel test above."""
    from pathlib import Path

    from kvbalance.model import cbuild

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "amx_bf16" not in flags or cbuild.compiler() is None or not cbuild.native_enabled():
        pytest.skip("no AMX-BF16 or no compiler here")
    assert native_prefill.library() is not None and native_prefill.available()


def _cpu_flags() -> set[str]:
    from pathlib import Path

    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_the_avx512_kernel_builds_where_the_cpu_has_avx512_bf16_and_runs_without_amx(monkeypatch):
    """Where the CPU has AVX-512F and AVX512-BF16 the AVX-512 kernel is built and runs; it is the kernel
    whenever AMX does not run (no AMX, or ``KVBALANCE_NATIVE_AMX=0``)."""
    from kvbalance.model import cbuild

    if cbuild.compiler() is None or not cbuild.native_enabled():
        pytest.skip("no compiler here")
    lib = native_prefill.avx512_library()
    if {"avx512f", "avx512_bf16"} <= _cpu_flags():
        assert lib is not None and lib.avx512
    else:  # not built where it could never run (tests/test_native_build.py compiles it everywhere)
        assert lib is None
    monkeypatch.setenv("KVBALANCE_NATIVE_AMX", "0")
    assert native_prefill.library() is lib
    assert native_prefill.available() == (lib is not None)
