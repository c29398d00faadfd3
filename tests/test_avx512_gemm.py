"""The AVX512-BF16 GEMM (model/avx512_gemm.py) against float64 products, and its place in packed.py."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvbalance.model import avx512_gemm, cbuild, packed  # noqa: E402


def _cpu_flags() -> set[str]:
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.exists() else []:
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_it_runs_exactly_where_the_cpu_has_avx512_bf16():
    """A source that no longer compiles must fail here, not skip every test below."""
    if cbuild.compiler() is None or not cbuild.native_enabled():
        pytest.skip("no C compiler here")
    assert avx512_gemm.available() == ({"avx512f", "avx512_bf16"} <= _cpu_flags())
    assert avx512_gemm.preferred() == (avx512_gemm.available() and "amx_bf16" not in _cpu_flags())


needs_kernel = pytest.mark.skipif(not avx512_gemm.available(), reason="no AVX512-BF16 or no C compiler here")


def _case(m, n, k, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


def _close_to_float64(y, x, w, b):
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    # float32 sums of exact products (K * eps * sum |x_i w_i|), then one rounding to bf16 (half an ulp: <= 2^-8)
    bound = x.shape[1] * 2**-23 * (x.double().abs() @ w.double().abs().T) + 2**-8 * ref.abs() + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()


# rows around the 12-row micro-kernel and the 192-row blocks, columns off the 32-wide panels, odd K
@needs_kernel
@pytest.mark.parametrize(
    "m, n, k, bias",
    [
        (1, 32, 8, False),
        (5, 17, 33, True),
        (12, 576, 576, False),
        (13, 960, 576, True),
        (51, 3072, 576, False),
        (64, 576, 1536, True),
        (200, 33, 385, False),
        (7, 1, 769, True),
        (400, 70, 64, False),
    ],
)
def test_matches_float64_within_one_bf16_rounding(m, n, k, bias):
    x, w, b = _case(m, n, k, bias=bias)
    y = avx512_gemm.linear(x, avx512_gemm.pack(w), n, b)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _close_to_float64(y, x, w, b)


@needs_kernel
def test_the_packed_panels_hold_pairs_of_the_weight_columns_zero_padded():
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3).bfloat16()  # N = 40: a full panel and 8 columns
    p = avx512_gemm.pack(w).view(2, 2, 32, 2)  # [panel][k pair][column][k within the pair]; K = 3 -> 2 pairs
    assert torch.equal(p[0, :, :, 0], w[:32, 0::2].T) and torch.equal(p[0, 0, :, 1], w[:32, 1])
    assert not p[0, 1, :, 1].any()  # the odd K's missing partner
    assert torch.equal(p[1, 0, :8, 0], w[32:, 0]) and not p[1, :, 8:].any()


@needs_kernel
def test_rows_get_the_same_bits_whatever_the_batch_and_threads():
    """Batch invariance: a row's output does not depend on how many rows share the call, where it sits in
    them (across 12-row micro-kernels and 192-row blocks), or the thread count."""
    x, w, b = _case(450, 200, 700, seed=1, bias=True)
    p = avx512_gemm.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = avx512_gemm.linear(x, p, 200, b)
        for n in (2, 3):
            torch.set_num_threads(n)
            assert torch.equal(avx512_gemm.linear(x, p, 200, b), full)
    finally:
        torch.set_num_threads(threads)
    for rows in (slice(0, 1), slice(37, 44), slice(100, 150), slice(190, 390)):
        assert torch.equal(avx512_gemm.linear(x[rows], p, 200, b), full[rows])


@needs_kernel
def test_strided_rows_and_leading_dims():
    x, w, _ = _case(24, 48, 64, seed=2)
    p = avx512_gemm.pack(w)
    wide = torch.randn(24, 100).bfloat16()
    wide[:, 10:74] = x
    strided = wide[:, 10:74]  # rows 100 values apart
    assert torch.equal(avx512_gemm.linear(strided, p, 48), avx512_gemm.linear(x, p, 48))
    assert torch.equal(
        avx512_gemm.linear(x.view(2, 12, 64), p, 48), avx512_gemm.linear(x, p, 48).view(2, 12, 48)
    )


@needs_kernel
def test_bad_inputs_name_the_field():
    x, w, _ = _case(4, 32, 16)
    with pytest.raises(ValueError, match="weight"):
        avx512_gemm.pack(w.float())
    with pytest.raises(ValueError, match="packed"):
        avx512_gemm.linear(x, avx512_gemm.pack(w), 33)  # two panels
    with pytest.raises(ValueError, match="x"):
        avx512_gemm.linear(x.float(), avx512_gemm.pack(w), 32)


@needs_kernel
def test_packed_linear_takes_it_where_preferred_and_each_copy_runs_its_own_kernel(monkeypatch):
    """packed.linear runs the kernel over its panels where it is preferred (``KVBALANCE_NATIVE_GEMM=1``),
    oneDNN's packed weight under ``=0``; a copy packed under one setting and run under the other still
    goes to the GEMM whose layout it holds; all agree with F.linear within a bf16 rounding."""
    if not packed.native_bf16_matmul():
        pytest.skip("oneDNN has no native bf16 here")
    layer = torch.nn.Linear(96, 80, bias=True).bfloat16()
    x = torch.randn(9, 96).bfloat16()
    calls = []
    real = avx512_gemm.linear
    monkeypatch.setattr(avx512_gemm, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.inference_mode():
        ref = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
        for pack_env, run_env in (("1", "1"), ("0", "0"), ("1", "0"), ("0", "1")):
            monkeypatch.setenv("KVBALANCE_NATIVE_GEMM", pack_env)
            calls.clear()
            layer.packed_weight, layer.packed_version = (
                packed._pack(layer.weight),
                packed._version(layer.weight),
            )
            monkeypatch.setenv("KVBALANCE_NATIVE_GEMM", run_env)
            torch.testing.assert_close(packed.linear(x, layer).float(), ref, atol=1e-2, rtol=2**-7)
            assert bool(calls) == (pack_env == "1")
