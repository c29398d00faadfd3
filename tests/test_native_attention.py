"""The native CPU paged decode-attention kernel against gathered scaled_dot_product_attention."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvbalance.model import native  # noqa: E402

if native.native_library() is None:
    pytest.skip("no C compiler: the engine uses the PyTorch path", allow_module_level=True)


# groups around the AVX2 kernel's tiles (8 heads scored, 4 weighted at a time), head dims of 2-32 chunks
@pytest.mark.parametrize(
    "group, head_dim, block_size",
    [
        (3, 64, 16),
        (1, 32, 8),
        (4, 128, 32),
        (5, 16, 64),
        (7, 64, 16),
        (8, 128, 24),
        (9, 48, 16),
        (16, 256, 8),
    ],
)
def test_matches_gathered_sdpa(group, head_dim, block_size):
    g = torch.Generator().manual_seed(0)
    kvh, num_blocks, b = 2, 40, 5
    k = torch.randn(kvh, num_blocks, block_size, head_dim, generator=g)
    v = torch.randn(kvh, num_blocks, block_size, head_dim, generator=g)
    ctx = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 2, 5 * block_size])
    max_blocks = int((ctx.max() + block_size - 1) // block_size)
    perm = torch.randperm(num_blocks, generator=g)
    table = perm[: b * max_blocks].view(b, max_blocks).clone()  # scattered physical blocks
    q = torch.randn(b, kvh, group, head_dim, generator=g)
    scale = head_dim**-0.5
    out = native.paged_decode_attention(q, k, v, table, ctx, scale)
    for i in range(b):
        n = int(ctx[i])
        kc = k[:, table[i]].reshape(kvh, -1, head_dim)[:, :n]
        vc = v[:, table[i]].reshape(kvh, -1, head_dim)[:, :n]
        ref = torch.nn.functional.scaled_dot_product_attention(q[i], kc, vc, scale=scale)
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-4)


def test_cpus_with_avx2_but_no_avx512_run_the_avx2_kernel():
    """Which kernel -march=native builds: the AVX2 one exactly where the CPU has AVX2 and FMA but not
    AVX-512F (the portable kernel's 16-float vectors spill there)."""
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    expected = {"avx2", "fma"} <= flags and "avx512f" not in flags
    assert native.native_library(3, 64).avx2 == expected


def _reference(q, k, v, table, ctx, scale):
    kvh, _, _, head_dim = k.shape
    outs = []
    for i in range(q.shape[0]):
        n = int(ctx[i])
        kc = k[:, table[i]].reshape(kvh, -1, head_dim)[:, :n]
        vc = v[:, table[i]].reshape(kvh, -1, head_dim)[:, :n]
        outs.append(torch.nn.functional.scaled_dot_product_attention(q[i], kc, vc, scale=scale))
    return torch.stack(outs)


def test_long_contexts_with_peaked_scores_rescale_the_running_softmax():
    """Many blocks whose scores rise block after block (every block rescales the accumulators), keys far
    below the maximum (weights underflow), and context lengths off the 16-key vector width."""
    g = torch.Generator().manual_seed(1)
    kvh, num_blocks, block_size, head_dim, group = 3, 96, 64, 64, 3
    ctx = torch.tensor([1, 15, 17, 63, 65, 500, 1000, 1500])
    max_blocks = int((ctx.max() + block_size - 1) // block_size)
    table = torch.randint(0, num_blocks, (len(ctx), max_blocks), generator=g)
    k = torch.randn(kvh, num_blocks, block_size, head_dim, generator=g)
    ramp = torch.linspace(0, 6, num_blocks)[None, :, None, None]  # later blocks score higher
    k = k + ramp
    v = torch.randn(kvh, num_blocks, block_size, head_dim, generator=g)
    q = 4 * torch.randn(len(ctx), kvh, group, head_dim, generator=g).abs()
    scale = head_dim**-0.5
    out = native.paged_decode_attention(q, k, v, table, ctx, scale)
    # scores reach ~150 here, so float32 rounding shows: compare with a float64 reference (float32
    # SDPA itself is 5e-5 from it; the kernel ~2e-5)
    ref = _reference(q.double(), k.double(), v.double(), table, ctx, scale)
    torch.testing.assert_close(out.double(), ref, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("group, head_dim, block_size", [(3, 64, 64), (1, 32, 8), (4, 128, 32)])
def test_bfloat16_cache_is_widened_exactly(group, head_dim, block_size):
    """A bf16 cache is read as the float32 values it holds: the output equals the float32 kernel's over
    the widened cache up to float32 summation order (head dims of 32k sum even and odd elements in
    separate lanes), and matches a float64 reference within float32 rounding."""
    g = torch.Generator().manual_seed(2)
    kvh, num_blocks = 2, 48
    k = torch.randn(kvh, num_blocks, block_size, head_dim, generator=g).bfloat16()
    v = torch.randn(kvh, num_blocks, block_size, head_dim, generator=g).bfloat16()
    ctx = torch.tensor([1, block_size - 1, block_size + 3, 4 * block_size, 7 * block_size - 5])
    max_blocks = int((ctx.max() + block_size - 1) // block_size)
    table = torch.randperm(num_blocks, generator=g)[: len(ctx) * max_blocks].view(len(ctx), max_blocks)
    q = torch.randn(len(ctx), kvh, group, head_dim, generator=g)
    scale = head_dim**-0.5
    out = native.paged_decode_attention(q, k, v, table, ctx, scale)
    assert out.dtype == torch.float32
    widened = native.paged_decode_attention(q, k.float(), v.float(), table, ctx, scale)
    torch.testing.assert_close(out, widened, atol=2e-6, rtol=1e-5)
    ref = _reference(q.double(), k.double(), v.double(), table, ctx, scale)
    torch.testing.assert_close(out.double(), ref, atol=3e-5, rtol=1e-4)
    # bf16 queries (a bf16 model): widened in, the float32 result rounded once on the way out
    out16 = native.paged_decode_attention(q.bfloat16(), k, v, table, ctx, scale, amx=False)
    assert out16.dtype == torch.bfloat16
    expected = native.paged_decode_attention(q.bfloat16().float(), k, v, table, ctx, scale).bfloat16()
    assert torch.equal(out16, expected)


needs_amx = pytest.mark.skipif(not native.has_amx(), reason="no AMX-BF16 here: the portable path only")


def _bf16_case(seed, group, head_dim, block_size, ctx, kvh=2, peaked=False):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.tensor(ctx)
    max_blocks = int((ctx.max() + block_size - 1) // block_size)
    num_blocks = len(ctx) * max_blocks + 3
    k = torch.randn(kvh, num_blocks, block_size, head_dim, generator=g)
    if peaked:  # later blocks score higher: every window rescales the running softmax
        k = k + torch.linspace(0, 6, num_blocks)[None, :, None, None]
    v = torch.randn(kvh, num_blocks, block_size, head_dim, generator=g)
    table = torch.randperm(num_blocks, generator=g)[: len(ctx) * max_blocks].view(len(ctx), max_blocks)
    q = torch.randn(len(ctx), kvh, group, head_dim, generator=g)
    if peaked:
        q = 4 * q.abs()
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), table, ctx


@needs_amx
@pytest.mark.parametrize(
    "group, head_dim, block_size, ctx",
    [
        (3, 64, 64, [1, 15, 16, 17, 63, 64, 65, 200, 256, 257, 700]),  # SmolLM2; windows of 256 keys
        (1, 32, 16, [1, 5, 16, 33, 300]),
        (4, 128, 32, [2, 31, 97, 600]),
        (3, 64, 128, [100, 129, 513]),  # a block longer than half a window
    ],
)
def test_amx_scores_match_the_float64_reference(group, head_dim, block_size, ctx):
    """The AMX path (bf16 x bf16 products exact, float32 sums): within one bf16 rounding of the output
    of the float32 path over the same bf16 inputs and of a float64 reference."""
    q, k, v, table, ctx = _bf16_case(4, group, head_dim, block_size, ctx)
    scale = head_dim**-0.5
    out = native.paged_decode_attention(q, k, v, table, ctx, scale, amx=True)
    assert out.dtype == torch.bfloat16
    fp32 = native.paged_decode_attention(q.float(), k, v, table, ctx, scale, amx=False)
    torch.testing.assert_close(out.float(), fp32, atol=1e-5, rtol=2**-8)
    ref = _reference(q.double(), k.double(), v.double(), table, ctx, scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=2**-8)
    widened = native.paged_decode_attention(q, k, v, table, ctx, scale, amx=False)
    assert (out != widened).float().mean() < 0.01  # bf16 ties aside, the two paths round alike


@needs_amx
def test_amx_rescales_across_windows_and_takes_any_scale():
    """Scores rising block after block (each 256-key window rescales the accumulators), weights that
    underflow, and a scale that is not a power of two (applied to the float32 scores)."""
    q, k, v, table, ctx = _bf16_case(5, 3, 64, 64, [1, 65, 300, 1000, 1500], kvh=3, peaked=True)
    for scale in (0.125, 0.1):
        out = native.paged_decode_attention(q, k, v, table, ctx, scale, amx=True)
        ref = _reference(q.double(), k.double(), v.double(), table, ctx, scale)
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=2**-8)


@needs_amx
def test_amx_falls_back_where_blocks_are_not_16_rows():
    """Block sizes off the 16-row tile take the portable path (a tile would read past the block)."""
    q, k, v, table, ctx = _bf16_case(6, 3, 64, 8, [1, 7, 9, 40])
    out = native.paged_decode_attention(q, k, v, table, ctx, 0.125, amx=True)
    assert torch.equal(out, native.paged_decode_attention(q, k, v, table, ctx, 0.125, amx=False))


@needs_amx
def test_amx_threads_split_the_units_and_agree():
    """Each thread takes a contiguous run of (sequence, head) units of about equal keys: any thread
    count gives the one-thread result exactly (every unit is computed the same way)."""
    q, k, v, table, ctx = _bf16_case(8, 3, 64, 64, [1, 900, 5, 64, 300, 2, 1000], kvh=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.paged_decode_attention(q, k, v, table, ctx, 0.125, amx=True)
        for n in (2, 3, 5):
            torch.set_num_threads(n)
            assert torch.equal(native.paged_decode_attention(q, k, v, table, ctx, 0.125, amx=True), one)
    finally:
        torch.set_num_threads(threads)


def test_amx_switch(monkeypatch):
    """``KVBALANCE_NATIVE_AMX=0`` keeps the portable path; float32 queries never take the AMX path."""
    monkeypatch.setenv("KVBALANCE_NATIVE_AMX", "0")
    assert not native.has_amx()
    q, k, v, table, ctx = _bf16_case(7, 3, 64, 64, [70, 130])
    out = native.paged_decode_attention(q, k, v, table, ctx, 0.125)
    assert torch.equal(out, native.paged_decode_attention(q, k, v, table, ctx, 0.125, amx=False))
    lib = native.native_library(3, 64, torch.bfloat16, torch.float32)
    assert lib is not None and not lib.amx  # the float32-query build has no AMX path


def test_a_compiler_without_amx_builds_the_portable_kernel(monkeypatch, tmp_path, caplog):
    """On an AMX CPU, a compiler that rejects the AMX flags: one warning names the kernel and the
    fallback, the portable kernel alone is built (the failure is remembered, so later processes do not
    retry it) and bf16 attention still runs."""
    import logging
    import shutil

    from kvbalance.model import cbuild

    monkeypatch.setattr(cbuild, "cpu_has", lambda *features: True)  # as if this CPU had AMX
    monkeypatch.setattr(cbuild, "_warned", set())
    caplog.set_level(logging.WARNING, logger="kvbalance.model.cbuild")
    cc = tmp_path / "cc"
    real = shutil.which("gcc") or shutil.which("cc")
    cc.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -mamx-tile ] && exit 1; done\nexec {real} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("KVBALANCE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_libs", {})
    lib = native.native_library(3, 64, torch.bfloat16, torch.bfloat16)
    assert lib is not None and not lib.amx and not native.has_amx()
    assert len(list((tmp_path / "cache" / "native").glob("*_amx_*.failed"))) == 1
    warned = [r.getMessage() for r in caplog.records]
    assert (
        len(warned) == 1
        and "paged_attention_g3_d64_bb_amx" in warned[0]
        and "the portable kernel" in warned[0]
    )
    q, k, v, table, ctx = _bf16_case(9, 3, 64, 64, [3, 70])
    ref = _reference(q.double(), k.double(), v.double(), table, ctx, 0.125)
    out = native.paged_decode_attention(q, k, v, table, ctx, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=2**-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_kv_equals_index_copy_from_strided_rows(dtype):
    g = torch.Generator().manual_seed(3)
    kvh, num_blocks, block_size, hd, t = 3, 10, 16, 64, 7
    fused = torch.randn(t, 2 * kvh + 5, hd, generator=g).to(dtype)  # K and V are views into one buffer
    k, v = fused[:, 1 : 1 + kvh], fused[:, 1 + kvh : 1 + 2 * kvh]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    kc, vc = (torch.zeros(kvh, num_blocks, block_size, hd, dtype=dtype) for _ in range(2))
    assert native.can_write_kv(k, v, kc)
    native.write_kv(k, v, kc, vc, slots)
    ref_k, ref_v = (torch.zeros(kvh, num_blocks * block_size, hd, dtype=dtype) for _ in range(2))
    ref_k.index_copy_(1, slots, k.transpose(0, 1))
    ref_v.index_copy_(1, slots, v.transpose(0, 1))
    assert torch.equal(kc.view_as(ref_k), ref_k) and torch.equal(vc.view_as(ref_v), ref_v)
    assert not native.can_write_kv(k.float() if dtype == torch.bfloat16 else k.bfloat16(), v, kc)


def test_threads_split_the_units_and_give_the_same_bits():
    """Threads take contiguous runs of (sequence, head) units of about equal keys (uneven contexts here);
    each unit's result does not depend on which thread ran it or what it prefetched."""
    g = torch.Generator().manual_seed(4)
    kvh, num_blocks, block_size, head_dim, group = 3, 64, 16, 64, 3
    ctx = torch.tensor([1, 300, 17, 64, 5, 200, 33])
    max_blocks = int((ctx.max() + block_size - 1) // block_size)
    table = torch.randint(0, num_blocks, (len(ctx), max_blocks), generator=g)
    k = torch.randn(kvh, num_blocks, block_size, head_dim, generator=g)
    v = torch.randn(kvh, num_blocks, block_size, head_dim, generator=g)
    q = torch.randn(len(ctx), kvh, group, head_dim, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.paged_decode_attention(q, k, v, table, ctx, 0.125)
        torch.set_num_threads(2)
        two = native.paged_decode_attention(q, k, v, table, ctx, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(one, _reference(q, k, v, table, ctx, 0.125), atol=1e-5, rtol=1e-4)
