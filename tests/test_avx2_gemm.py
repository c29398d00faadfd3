"""The AVX2 float32 GEMM (model/avx2_gemm.py) against float64 products, and its place in packed.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvbalance.model import avx2_gemm, packed  # noqa: E402

if not avx2_gemm.available():
    pytest.skip("no AVX2 + FMA here, or no C compiler: MKL's path only", allow_module_level=True)


def _case(m, n, k, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


def _close_to_float64(y, x, w, b):
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    # each output sums K products in float32: error bound ~ K * eps * sum |x_i w_i|
    bound = x.shape[1] * 2**-23 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert ((y.double() - ref).abs() <= bound).all()


# rows around the 6-row micro-kernel and the 96-row blocks, columns off the 16-wide panels, K off its slices
@pytest.mark.parametrize(
    "m, n, k, bias",
    [
        (1, 16, 8, False),
        (5, 17, 33, True),
        (6, 576, 576, False),
        (13, 960, 576, True),
        (64, 3072, 576, False),
        (97, 40, 1536, True),
        (200, 33, 385, False),
        (7, 1, 769, True),
    ],
)
def test_matches_float64_within_float32_rounding(m, n, k, bias):
    x, w, b = _case(m, n, k, bias=bias)
    y = avx2_gemm.linear(x, avx2_gemm.pack(w), n, b)
    assert y.shape == (m, n) and y.dtype == torch.float32
    _close_to_float64(y, x, w, b)


def test_the_packed_panels_hold_the_weight_columns_zero_padded():
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)  # N = 20: a full panel and one of 4 columns
    p = avx2_gemm.pack(w).view(2, 3, 16)  # [panel][k][column]
    assert torch.equal(p[0], w[:16].T)
    assert torch.equal(p[1, :, :4], w[16:].T) and not p[1, :, 4:].any()


def test_rows_get_the_same_bits_whatever_the_batch_and_threads():
    """Batch invariance: a row's output does not depend on how many rows share the call, where it sits
    in them, or the thread count (each output's sums run in one fixed order)."""
    x, w, b = _case(150, 200, 700, seed=1, bias=True)
    p = avx2_gemm.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = avx2_gemm.linear(x, p, 200, b)
        torch.set_num_threads(2)
        assert torch.equal(avx2_gemm.linear(x, p, 200, b), full)
    finally:
        torch.set_num_threads(threads)
    for rows in (slice(0, 1), slice(37, 44), slice(100, 150)):
        assert torch.equal(avx2_gemm.linear(x[rows], p, 200, b), full[rows])


def test_strided_rows_and_leading_dims():
    x, w, _ = _case(24, 48, 64, seed=2)
    p = avx2_gemm.pack(w)
    wide = torch.randn(24, 100)
    wide[:, 10:74] = x
    strided = wide[:, 10:74]  # rows 100 floats apart
    assert torch.equal(avx2_gemm.linear(strided, p, 48), avx2_gemm.linear(x, p, 48))
    assert torch.equal(avx2_gemm.linear(x.view(2, 12, 64), p, 48), avx2_gemm.linear(x, p, 48).view(2, 12, 48))


def test_bad_inputs_name_the_field():
    x, w, _ = _case(4, 32, 16)
    with pytest.raises(ValueError, match="weight"):
        avx2_gemm.pack(w.double())
    with pytest.raises(ValueError, match="packed"):
        avx2_gemm.linear(x, avx2_gemm.pack(w), 15)
    with pytest.raises(ValueError, match="x"):
        avx2_gemm.linear(x.double(), avx2_gemm.pack(w), 32)


def test_packed_linear_takes_it_where_preferred(monkeypatch):
    """packed.linear runs the AVX2 kernel over its panels where it is preferred, MKL's packed weight where
    KVBALANCE_NATIVE_GEMM=0, and both agree with F.linear."""
    layer = torch.nn.Linear(96, 80, bias=True)
    x = torch.randn(9, 96)
    calls = []
    real = avx2_gemm.linear
    monkeypatch.setattr(avx2_gemm, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.inference_mode():
        ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
        for env, expect_kernel in (("1", True), ("0", False)):
            monkeypatch.setenv("KVBALANCE_NATIVE_GEMM", env)
            calls.clear()
            layer.packed_weight, layer.packed_version = (
                packed._pack(layer.weight),
                packed._version(layer.weight),
            )
            torch.testing.assert_close(packed.linear(x, layer), ref, atol=1e-5, rtol=1e-5)
            assert bool(calls) == expect_kernel


def test_a_weight_runs_through_the_kernel_it_was_packed_for(monkeypatch):
    """Packed while the kernel was preferred, run after KVBALANCE_NATIVE_GEMM=0 (and the reverse): each
    packed copy goes to the GEMM whose layout it holds."""
    layer = torch.nn.Linear(64, 48, bias=False)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        ref = torch.nn.functional.linear(x, layer.weight)
        for pack_env, run_env in (("1", "0"), ("0", "1")):
            monkeypatch.setenv("KVBALANCE_NATIVE_GEMM", pack_env)
            layer.packed_weight, layer.packed_version = (
                packed._pack(layer.weight),
                packed._version(layer.weight),
            )
            monkeypatch.setenv("KVBALANCE_NATIVE_GEMM", run_env)
            torch.testing.assert_close(packed.linear(x, layer), ref, atol=1e-5, rtol=1e-5)
