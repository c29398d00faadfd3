"""The AMX bf16 GEMM (kvbalance/model/amx_gemm.py) and its dispatch in kvbalance/model/packed.py: results
against float64 maths (one bf16 rounding of a float32 accumulation) and against oneDNN's packed matmul
(bit-identical to its kernel for up to 32 rows, at every M, so to oneDNN on 32-row slices of any call;
within an ulp of its kernel for more rows), over M from 1 to 300 with M, N and K tails, bias, strided
and 3-D inputs; the fallbacks (``KVBALANCE_NATIVE_AMX=0``, K not a multiple of 32, grad mode, many rows)."""

from __future__ import annotations

import pytest
import torch

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
SHAPES += [(70, 130, 224), (300, 40, 64), (20, 48, 64), (40, 16, 32)]
# above 32 rows (the decode batches of 33-128 sequences): each row tail (M % 16, M % 32), a column tail,
# one 16-row W tile, SmolLM2's shapes (K 576 and 1536)
SHAPES += [(33, 100, 96), (40, 576, 576), (47, 16, 64), (48, 960, 576), (57, 33, 1536)]
SHAPES += [(63, 576, 1536), (65, 48, 128), (80, 200, 576), (96, 72, 32), (113, 64, 160), (128, 130, 576)]


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
    y = amx_gemm.linear(x, w, bias)
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
def test_kernel_is_bit_identical_to_onednn_in_32_row_calls(m, n, k):
    x, w, b = _data(m, n, k, seed=1)
    for bias in (None, b):
        y = amx_gemm.linear(x, w, bias)
        # oneDNN's kernel for up to 32 rows sums in the same order: the same bits
        assert torch.equal(y, torch.cat([_onednn(x[i : i + 32], w, bias) for i in range(0, m, 32)]))
        if m > 32:  # its kernel for more rows orders a few sums differently: within an ulp (or the
            # two float32 accumulations' difference where cancellation magnifies it)
            ref = _onednn(x, w, bias)
            diff = (y.double() - ref.double()).abs()
            absum = x.double().abs() @ w.double().abs().T + (0.0 if bias is None else bias.double().abs())
            assert bool((diff <= _ulp(ref.double()) + 2 * k * 2.0**-24 * absum).all())
            assert float((y != ref).double().mean()) < 0.01


@needs_amx
@pytest.mark.parametrize("m", [40, 100])
def test_strided_and_3d_inputs_equal_the_contiguous_result(m):
    x, w, b = _data(m, 96, 128)
    want = amx_gemm.linear(x, w, b)
    wide = torch.zeros(m, 200, dtype=torch.bfloat16)
    wide[:, 8:136] = x
    assert torch.equal(amx_gemm.linear(wide[:, 8:136], w, b), want)  # row stride 200 read in place
    assert torch.equal(amx_gemm.linear(x.T.contiguous().T, w, b), want)  # column-major: copied
    assert torch.equal(amx_gemm.linear(x.view(4, m // 4, 128), w, b), want.view(4, m // 4, 96))
    assert amx_gemm.linear(x[:0], w).shape == (0, 96)


@needs_amx
def test_rows_are_independent_at_every_batch_size():
    # row i of a call of M rows equals the call of that row alone, for M on both sides of 32 (where the
    # activations' tile loads change hint) and of the dispatch threshold: no row sees another's data
    x, w, b = _data(128, 200, 576, seed=2)
    alone = torch.cat([amx_gemm.linear(x[i : i + 1], w, b) for i in range(128)])
    for m in (31, 32, 33, 48, 64, 96, 128):
        assert torch.equal(amx_gemm.linear(x[:m], w, b), alone[:m]), m


@needs_amx
def test_kernel_rejects_what_it_cannot_take():
    _, w, _ = _data(1, 100, 64)
    assert amx_gemm.supports(w)
    assert not amx_gemm.supports(w[:, :48])  # K not a multiple of 32
    assert not amx_gemm.supports(w.float()) and not amx_gemm.supports(w.T)
    with pytest.raises(ValueError, match="weight: "):
        amx_gemm.linear(torch.zeros(2, 48, dtype=torch.bfloat16), w[:, :48].contiguous())
    with pytest.raises(ValueError, match="x: last dim 32"):
        amx_gemm.linear(torch.zeros(2, 32, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="x, bias: bf16"):
        amx_gemm.linear(torch.zeros(2, 64), w)


@needs_amx
def test_dispatch_runs_the_kernel_up_to_the_threshold_and_onednn_beyond(monkeypatch):
    _, w, b = _data(1, 192, 576)
    p = packed._pack(w)  # oneDNN's layout: the kernel reads the plain weight
    small, large = _data(packed.AMX_MAX_ROWS, 192, 576)[0], _data(packed.AMX_MAX_ROWS + 1, 192, 576)[0]
    assert torch.equal(packed._packed_linear(small, p, w, b), amx_gemm.linear(small, w, b))
    calls = []
    monkeypatch.setattr(amx_gemm, "linear", lambda *a: calls.append(a))
    assert torch.equal(packed._packed_linear(large, p, w, b), _onednn(large, w, b))
    x = small.clone().requires_grad_()  # grad mode: left to oneDNN's op (the kernel has no backward)
    assert torch.equal(packed._packed_linear(x, p, w, b).detach(), _onednn(small, w, b))
    k48 = _data(4, 64, 48)
    assert torch.equal(
        packed._packed_linear(k48[0], packed._pack(k48[1]), k48[1], None), _onednn(k48[0], k48[1], None)
    )
    assert calls == []


def test_env_switch_falls_back_to_onednn(monkeypatch):
    x, w, b = _data(8, 64, 128)
    if not packed._can_pack(w):
        pytest.skip("no native bf16 matmul here")
    monkeypatch.setenv("KVBALANCE_NATIVE_AMX", "0")
    assert not amx_gemm.available()
    calls = []
    monkeypatch.setattr(amx_gemm, "linear", lambda *a: calls.append(a))
    assert torch.equal(packed._packed_linear(x, packed._pack(w), w, b), _onednn(x, w, b))
    assert calls == []


@needs_amx
def test_two_threads_give_the_same_bits():
    x, w, b = _data(40, 1000, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = amx_gemm.linear(x, w, b)
        torch.set_num_threads(2)  # the weight's 32-row blocks split between the threads, each its own tiles
        two = amx_gemm.linear(x, w, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
