"""benchmarks/roofline.py: the real-engine roofline's formulas, worked by hand on a toy model."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

_spec = importlib.util.spec_from_file_location(
    "roofline", Path(__file__).resolve().parents[1] / "benchmarks" / "roofline.py"
)
roofline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(roofline)

# layer params 1 x (4*2*(2*2+2*1) + 3*4*8) = 144, LM head 4*10 = 40, bf16 weights 368 B;
# K+V per token 1 layer x 2 x 1 head x 2 dims x 2 B = 8 B; attention 2*2*2*1 = 8 FLOPs per (query, key) pair and matmul
TOY = SimpleNamespace(
    hidden_size=4, intermediate_size=8, head_dim=2, num_heads=2, num_kv_heads=1, num_layers=1, vocab_size=10
)


def test_compute_bound_steps_match_the_hand_worked_figures():
    r = roofline.roofline_seconds(TOY, [(2, 3)], read_gbs=1.0, gemm_gflops=1.0)
    # prefill: 2*144*2 + 2*40 + 8*2^2 = 688 FLOPs (> 368 B at 1 B/ns)
    assert r["prefill_s"] == pytest.approx(688e-9)
    # decode j=1: 3 positions: max(368 + 3*8 B, 2*184 + 2*8*3 FLOPs) = 416; j=2: 4 positions: max(400, 432)
    assert r["decode_s"] == pytest.approx((416 + 432) * 1e-9)
    assert r["total_s"] == pytest.approx((688 + 848) * 1e-9)


def test_memory_bound_steps_read_all_weights_and_the_live_kv():
    r = roofline.roofline_seconds(TOY, [(2, 3), (5, 2)], read_gbs=0.001, gemm_gflops=1000.0)
    # j=1: both sequences live (3 + 6 positions): (368 + 9*8) B at 1 B/us; j=2: only the first (4 positions)
    assert r["decode_s"] == pytest.approx((368 + 72 + 368 + 32) * 1e-6)
    assert r["prefill_s"] == pytest.approx(368e-6)  # one read of the weights outweighs the FLOPs


def test_float32_doubles_the_bytes():
    bf16 = roofline.roofline_seconds(TOY, [(2, 3)], read_gbs=0.001, gemm_gflops=1000.0)
    fp32 = roofline.roofline_seconds(TOY, [(2, 3)], 0.001, 1000.0, weight_bytes=4, kv_bytes=4)
    assert fp32["decode_s"] == pytest.approx(2 * bf16["decode_s"])


def test_rates_must_be_positive():
    with pytest.raises(ValueError, match="read_gbs"):
        roofline.roofline_seconds(TOY, [(2, 3)], read_gbs=0.0, gemm_gflops=1.0)


def test_the_compiled_read_probe_reads_every_float():
    """The DRAM probe's compiled loop sums the whole buffer (so it really reads it), with any thread count."""
    torch = pytest.importorskip("torch")
    reader = roofline._native_reader()
    if reader is None:
        pytest.skip("no C compiler")
    x = torch.arange(3 * (1 << 16) + 64, dtype=torch.float32).remainder_(7)  # past a whole chunk of 2^16
    assert x.data_ptr() % 64 == 0
    for threads in (1, 2):
        assert reader(x.data_ptr(), x.numel(), threads) == pytest.approx(float(x.double().sum()), rel=1e-6)
    assert roofline.stream_read_gbs(1, gib=1 / 64) > 0
