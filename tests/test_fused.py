"""The fused bf16 CPU kernels (model/fused.py) against the torch compositions they replace.

Exact (bit-identical) where the maths is the same float32 ops in the same order: the residual add, RoPE
(against the float32 composition on the widened inputs, rounded once), and the fused add + RMSNorm against the plain RMSNorm of
the added rows. Within one bf16 ulp per element where the order differs: RMSNorm against torch's bf16
``F.rms_norm`` (the sum of squares; measured exact here) and SiLU-and-mul against torch's bf16
``F.silu(gate) * up`` (which rounds silu before the product; against the float32 composition rounded
once, >99.9% exact). Each kernel runs in two
builds: the AVX-512 one this CPU loads and the portable vector code (compiled without AVX-512).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from kvbalance.model import fused, llama, native  # noqa: E402

if fused.library() is None:
    pytest.skip("no C compiler: the model runs its PyTorch path", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BF16 = torch.bfloat16


@pytest.fixture(params=["native", "portable"])
def kernels(request, monkeypatch):
    """Each kernel test runs on the library this CPU loads and on the build without AVX-512."""
    if request.param == "portable":
        lib = fused._load("fused_portable", (*fused.FLAGS, "-mno-avx512f"))
        if lib is None:
            pytest.skip("the compiler cannot build without AVX-512 here")
        monkeypatch.setitem(fused._libs, BF16, lib)
    return request.param


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 ulps (bit patterns mapped to ordered integers; -0 and +0 are 0 apart)."""

    def ordered(x):
        i = x.contiguous().view(torch.int16).int()
        return torch.where(i < 0, -32768 - i, i)

    return (ordered(a) - ordered(b)).abs()


def strided(t: int, n: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    """[t, n] bf16 rows inside wider rows (row stride n + 24): the kernels take row strides, no copies."""
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(t, n + 24, generator=g)).to(BF16)[:, 5 : 5 + n]


@pytest.mark.parametrize("t, n", [(1, 576), (7, 576), (33, 100), (5, 13)])
def test_rms_norm_is_torch_bf16_rms_norm_within_one_ulp(kernels, t, n):
    x = strided(t, n, 3.0)
    x[0] *= 1e-3  # a row whose mean square (~1e-5) is near eps
    w = (0.3 * torch.randn(n, generator=torch.Generator().manual_seed(1)) + 1).to(BF16)
    out = fused.rms_norm(x, w, 1e-5)
    assert out.dtype == BF16 and out.shape == (t, n)
    assert ulps(out, F.rms_norm(x, (n,), w, 1e-5)).max() <= 1


@pytest.mark.parametrize("t, n", [(1, 576), (9, 576), (4, 13)])
def test_add_rms_norm_adds_as_torch_and_norms_as_the_plain_kernel(kernels, t, n):
    h, delta = strided(t, n, 2.0, seed=2), strided(t, n, 1.0, seed=3)
    w = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(BF16)
    added = h + delta  # torch's bf16 add: float32 sum, rounded once
    out = torch.empty(t, n + 8, dtype=BF16)[:, :n]  # a strided output too
    normed = fused.add_rms_norm(h, delta, w, 1e-6, out=out)
    assert normed.data_ptr() == out.data_ptr()
    assert torch.equal(h, added)  # in place, bit-identical
    assert torch.equal(normed, fused.rms_norm(added, w, 1e-6))  # fused and unfused orders agree exactly
    assert ulps(normed, F.rms_norm(added, (n,), w, 1e-6)).max() <= 1


@pytest.mark.parametrize("t, inter", [(1, 1536), (9, 1536), (3, 20)])
def test_silu_and_mul_is_torch_bf16_silu_times_up_within_one_ulp(kernels, t, inter):
    gate_up = strided(t, 2 * inter, 4.0, seed=5)
    out = fused.silu_and_mul(gate_up)
    assert out.shape == (t, inter)
    # torch's bf16 composition rounds silu first (so half an ulp moves): within one ulp
    assert ulps(out, F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).max() <= 1
    # the float32 composition rounded once: the same but where the exp polynomial tips a rounding
    f32 = gate_up.float()
    d = ulps(out, (F.silu(f32[:, :inter]) * f32[:, inter:]).to(BF16))
    assert d.max() <= 1 and (d == 0).float().mean() > 0.999


def test_silu_and_mul_at_the_edges_of_exp_follows_torch(kernels):
    """Where e^-g overflows (g < -88.72) silu is -0 as torch's; e^-g underflowing is silu(g) = g; inf, nan."""
    g = [-200.0, -100.0, -88.0, -80.0, -1e-30, 0.0, 1e-30, 0.5, 88.0, 1e30, float("inf"), -float("inf")]
    gate = torch.tensor([g]).to(BF16)
    out = fused.silu_and_mul(torch.cat([gate, torch.ones_like(gate)], dim=1))
    ref = F.silu(gate)
    assert ulps(out[:, :-1], ref[:, :-1]).max() <= 1
    assert torch.isnan(out[0, -1]) and torch.isnan(ref[0, -1])  # -inf / (1 + inf), as torch
    nan = fused.silu_and_mul(torch.tensor([[float("nan"), 1.0]]).to(BF16))
    assert torch.isnan(nan).all()


@pytest.mark.parametrize("t, heads, head_dim", [(1, 12, 64), (9, 12, 64), (5, 3, 16), (4, 2, 40)])
def test_rope_is_the_float32_composition_rounded_once(kernels, t, heads, head_dim):
    kv = 3  # trailing heads (the v of a QKV row) stay as they are
    g = torch.Generator().manual_seed(6)
    x = strided(t, (heads + kv) * head_dim, 1.0, seed=7)
    angles = 1000 * torch.rand(t, head_dim // 2, generator=g)
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    before = x.clone()
    fused.rope_(x, cos, sin, heads, head_dim)
    widened = before[:, : heads * head_dim].float().view(t, heads, head_dim)
    rotated = llama.apply_rope(widened, cos.float(), sin.float())
    assert torch.equal(x[:, : heads * head_dim], rotated.reshape(t, -1).to(BF16))
    assert torch.equal(x[:, heads * head_dim :], before[:, heads * head_dim :])


def test_bad_input_names_the_field():
    x, w = torch.randn(3, 8).to(BF16), torch.ones(8, dtype=BF16)
    with pytest.raises(ValueError, match="x: expected a 2-D CPU bfloat16 or float32"):
        fused.rms_norm(x.double(), w, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        fused.rms_norm(x.float(), w, 1e-5)  # a bfloat16 weight for float32 rows
    with pytest.raises(ValueError, match="weight"):
        fused.rms_norm(x, torch.ones(7, dtype=BF16), 1e-5)
    with pytest.raises(ValueError, match="delta"):
        fused.add_rms_norm(x, x[:2], w, 1e-5)
    with pytest.raises(ValueError, match="out"):
        fused.rms_norm(x, w, 1e-5, out=torch.empty(2, 8, dtype=BF16))
    with pytest.raises(ValueError, match="gate_up"):
        fused.silu_and_mul(torch.ones(2, 7, dtype=BF16))
    with pytest.raises(ValueError, match="gate_up: expected a 2-D"):
        fused.silu_and_mul(torch.ones(2, 8, dtype=BF16).t())  # columns not contiguous
    with pytest.raises(ValueError, match="cos"):
        fused.rope_(torch.ones(3, 16, dtype=BF16), torch.ones(3, 4), torch.ones(3, 4, dtype=BF16), 2, 8)
    with pytest.raises(ValueError, match="num_heads"):
        fused.rope_(
            torch.ones(3, 16, dtype=BF16), torch.ones(3, 4, dtype=BF16), torch.ones(3, 4, dtype=BF16), 3, 8
        )


def test_disabled_by_kvbalance_native_0(monkeypatch):
    monkeypatch.setenv("KVBALANCE_NATIVE", "0")
    monkeypatch.setattr(fused, "_libs", {})
    assert fused.library() is None and not fused.supports(torch.ones(2, dtype=BF16))
    assert fused.library(torch.float32) is None and not fused.supports(torch.ones(2))
    monkeypatch.setattr(fused, "_libs", {})  # decided again once the variable is gone
    monkeypatch.delenv("KVBALANCE_NATIVE")
    assert fused.library() is not None


@pytest.mark.parametrize("rows", [1, 37])
def test_float32_kernels_match_torch_float32(rows):
    """The float32 build (-DELEM_F32=1): the residual add is exact, RMSNorm within a few float32 ulps of
    F.rms_norm (the sum of squares is ordered differently), SiLU-and-mul within its polynomial exp's error,
    RoPE bit-identical to apply_rope and the argmax equal to torch's; rows off the 16-lane width."""
    g = torch.Generator().manual_seed(11)
    n, i, hd = 72, 100, 64
    x, d, w = (
        torch.randn(rows, n, generator=g),
        torch.randn(rows, n, generator=g),
        torch.randn(n, generator=g),
    )
    ref = torch.nn.functional.rms_norm(x, (n,), w, 1e-5)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), ref, atol=0, rtol=4 * 2**-23)
    h = x.clone()
    out = fused.add_rms_norm(h, d, w, 1e-5)
    assert torch.equal(h, x + d)
    torch.testing.assert_close(
        out, torch.nn.functional.rms_norm(x + d, (n,), w, 1e-5), atol=0, rtol=4 * 2**-23
    )
    gu = 4 * torch.randn(rows, 2 * i, generator=g)
    gate, up = gu.split(i, dim=1)
    torch.testing.assert_close(
        fused.silu_and_mul(gu), torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=1e-6
    )
    qk = torch.randn(rows, 3 * hd, generator=g)
    ang = torch.rand(rows, hd // 2, generator=g) * 10
    expect = llama.apply_rope(qk.view(rows, 3, hd), ang.cos(), ang.sin()).view(rows, -1)
    fused.rope_(qk, ang.cos(), ang.sin(), 3, hd)
    assert torch.equal(qk, expect)
    logits = torch.randn(rows, 1000, generator=g)
    assert fused.argmax_rows(logits) == logits.argmax(-1).tolist()


def test_fused_kernels_run_only_for_bf16_and_float32_on_the_cpu_without_autograd():
    with torch.inference_mode():
        assert fused.supports(torch.ones(2, dtype=BF16)) and fused.supports(torch.ones(2))
        assert not fused.supports(torch.ones(2, dtype=torch.float16))
        assert not fused.supports(torch.ones(2, dtype=torch.float64))
    with torch.no_grad():
        assert fused.supports(torch.ones(2, dtype=BF16))
    with torch.enable_grad():
        assert not fused.supports(torch.ones(2, dtype=BF16))  # C kernels record no gradients


# -- the model's bf16 forward ---------------------------------------------------------------------


# SmolLM2's head dim; hidden and intermediate sizes off the 16-lane vector width (the kernels' row tails)
CONFIG = llama.LlamaConfig(
    name="tiny-fused", vocab_size=256, hidden_size=72, intermediate_size=100, num_layers=3, num_heads=4,
    num_kv_heads=2, head_dim=64, max_context=256,
)  # fmt: skip


def _bf16_model_step(config=CONFIG):
    from kvbalance.executor.torch import TorchExecutor
    from kvbalance.model.weights import random_weights

    ex = TorchExecutor(config, random_weights(config, seed=0), num_blocks=16, block_size=16, dtype=BF16)
    meta = llama.build_step_metadata(
        [0, 0, 0], [20, 7, 1], [[0, 1], [2], [3]], [0, 1, 2], 16, ex.model.layers[0].attn.group, "cpu", BF16
    )
    ids = torch.randint(0, config.vocab_size, (28,), generator=torch.Generator().manual_seed(0))
    return ex.model, ids, meta


def test_fused_residual_forward_equals_the_decoder_layer_loop_bit_for_bit():
    """vLLM's residual fusion changes no bit: the adds round as torch's and each norm is the plain kernel."""
    model, ids, meta = _bf16_model_step()
    with torch.inference_mode():
        fast = model(ids, meta)
        h = model.embed(ids)
        for layer in model.layers:
            h = layer(h, meta)
    assert torch.equal(fast, h)


def test_without_the_kernels_the_bf16_model_runs_torch_and_agrees(monkeypatch):
    model, ids, meta = _bf16_model_step()
    with torch.inference_mode():
        fast = model.compute_logits(model(ids, meta))
        monkeypatch.setattr(fused, "_libs", {BF16: None, torch.float32: None})
        monkeypatch.setattr(native, "_libs", {}, raising=True)
        monkeypatch.setenv("KVBALANCE_NATIVE", "0")
        slow = model.compute_logits(model(ids, meta))
    assert (fast - slow).abs().max() < 0.05 * slow.abs().max()  # bf16 roundings apart, nothing more


def test_rows_split_across_threads_change_no_bit():
    x, d = strided(37, 576, 2.0, seed=8), strided(37, 576, 1.0, seed=9)
    w, gate_up = torch.ones(576, dtype=BF16), strided(37, 300, 3.0, seed=10)
    cos, sin = torch.rand(37, 32).cos().to(BF16), torch.rand(37, 32).sin().to(BF16)

    def run():
        h, q = x.clone(), x.clone()
        fused.rope_(q, cos, sin, 9, 64)
        return (
            fused.rms_norm(x, w, 1e-5),
            fused.add_rms_norm(h, d, w, 1e-5),
            h,
            fused.silu_and_mul(gate_up),
            q,
        )

    one = run()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = run()
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
