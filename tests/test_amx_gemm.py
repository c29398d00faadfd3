"""The AMX bf16 GEMM (kvbalance/model/amx_gemm.py) and its dispatch in kvbalance/model/packed.py: results
against float64 maths (one bf16 rounding of a float32 accumulation) and against oneDNN's packed matmul
(bit-identical up to 32 rows, within one bf16 ulp beyond), over M, N and K tails, bias, strided and
3-D inputs; the fallbacks (``KVBALANCE_NATIVE_AMX=0``, K not a multiple of 32, grad mode, many rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbalance.model import amx_gemm, packed

needs_amx = pytest.mark.skipif(not amx_gemm.available(), reason="no AMX-BF16 (or no compiler) here")

# (M, N, K): row tails (M % 16), column tails (N % 32: padded pairs), short and long K, two row blocks
SHAPES = [
    (1, 960, 576),
    (5, 100, 64),
    (16, 32, 32),
    (17, 33, 96),
    (31, 64, 160),
    (33, 48, 128),
    (64, 576, 1536),
]
SHAPES += [(70, 130, 224), (300, 40, 64)]


def _data(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    return x, w, b


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(
        x, torch.ops.mkldnn._reorder_linear_weight(w, 64), b, "none", [], ""
    )


def _ulp(v: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing at |v| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(2.0**-100))) - 7)


@needs_amx
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_float64_within_one_rounding(m, n, k, with_bias):
    x, w, b = _data(m, n, k)
    bias = b if with_bias else None
    y = amx_gemm.linear(x, amx_gemm.pack(w), bias)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    exact = x.double() @ w.double().T + (b.double() if with_bias else 0.0)
    # float32 accumulation over K (each step rounded: <= K 2^-24 of the absolute sum), then one bf16
    # rounding to nearest (<= half an ulp of the result)
    absum = x.double().abs() @ w.double().abs().T + (b.double().abs() if with_bias else 0.0)
    accum = k * 2.0**-24 * absum
    err = (y.double() - exact).abs()
    assert bool((err <= 0.5 * _ulp(exact + accum) + accum).all()), float((err - 0.5 * _ulp(exact)).max())


@needs_amx
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_kernel_against_onednn(m, n, k):
    x, w, b = _data(m, n, k, seed=1)
    for bias in (None, b):
        y = amx_gemm.linear(x, amx_gemm.pack(w), bias)
        ref = _onednn(x, w, bias)
        if m <= 32:  # oneDNN accumulates these in the same order: the same bits
            assert torch.equal(y, ref)
        else:  # beyond, it orders some sums differently: a few outputs differ, by one ulp where no
            # cancellation magnifies the two float32 accumulations' difference
            diff = (y.double() - ref.double()).abs()
            absum = x.double().abs() @ w.double().abs().T + (0.0 if bias is None else bias.double().abs())
            assert bool((diff <= _ulp(ref.double()) + 2 * k * 2.0**-24 * absum).all())
            assert float((y != ref).double().mean()) < 0.01


@needs_amx
def test_strided_and_3d_inputs_equal_the_contiguous_result():
    x, w, b = _data(40, 96, 128)
    p = amx_gemm.pack(w)
    want = amx_gemm.linear(x, p, b)
    wide = torch.zeros(40, 200, dtype=torch.bfloat16)
    wide[:, 8:136] = x
    assert torch.equal(amx_gemm.linear(wide[:, 8:136], p, b), want)  # row stride 200 read in place
    assert torch.equal(amx_gemm.linear(x.T.contiguous().T, p, b), want)  # column-major: copied
    assert torch.equal(amx_gemm.linear(x.view(4, 10, 128), p, b), want.view(4, 10, 96))
    assert amx_gemm.linear(x[:0], p).shape == (0, 96)


@needs_amx
def test_pack_is_one_copy_and_rejects_what_the_kernel_cannot_take():
    _, w, _ = _data(1, 100, 64)
    p = amx_gemm.pack(w)
    assert (p.n, p.k) == (100, 64) and p.nbytes == 128 * 64 * 2  # N padded to a pair of tiles
    assert amx_gemm.pack(w[:, :48]) is None  # K not a multiple of 32
    assert amx_gemm.pack(w.float()) is None
    with pytest.raises(ValueError, match="x: last dim 32"):
        amx_gemm.linear(torch.zeros(2, 32, dtype=torch.bfloat16), p)
    with pytest.raises(ValueError, match="x, bias: bf16"):
        amx_gemm.linear(torch.zeros(2, 64), p)


@needs_amx
def test_dispatch_runs_the_kernel_up_to_the_threshold_and_onednn_beyond(monkeypatch):
    _, w, b = _data(1, 192, 576)
    p = packed._pack(w)
    assert isinstance(p, amx_gemm.AmxPackedWeight)
    small, large = _data(packed.AMX_MAX_ROWS, 192, 576)[0], _data(packed.AMX_MAX_ROWS + 1, 192, 576)[0]
    assert torch.equal(packed._packed_linear(small, p, w, b), amx_gemm.linear(small, p, b))
    calls = []
    monkeypatch.setattr(amx_gemm, "linear", lambda *a: calls.append(a))
    assert torch.equal(packed._packed_linear(large, p, w, b), F.linear(large, w, b))
    x = small.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    packed._packed_linear(x, p, wg, None).float().sum().backward()  # grad mode: autograd's path
    assert x.grad is not None and wg.grad is not None
    assert calls == []


def test_env_switch_falls_back_to_onednn(monkeypatch):
    x, w, b = _data(8, 64, 128)
    if not packed._can_pack(w):
        pytest.skip("no native bf16 matmul here")
    p = packed._pack(w)
    monkeypatch.setenv("KVBALANCE_NATIVE_AMX", "0")
    assert not amx_gemm.available()
    # packed while the kernel was on, called with it off: oneDNN on the plain weight
    assert torch.equal(packed._packed_linear(x, p, w, b), F.linear(x, w, b))
    p_off = packed._pack(w)  # packed with it off: oneDNN's layout
    assert not isinstance(p_off, amx_gemm.AmxPackedWeight)
    assert torch.equal(packed._packed_linear(x, p_off, w, b), _onednn(x, w, b))


@needs_amx
def test_two_threads_give_the_same_bits():
    x, w, b = _data(40, 1000, 576)
    p = amx_gemm.pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = amx_gemm.linear(x, p, b)
        torch.set_num_threads(2)  # the column pairs split between the threads, each its own tiles
        two = amx_gemm.linear(x, p, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
