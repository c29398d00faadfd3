"""The executor's greedy fast path (``greedy_argmax``, the fused bf16 argmax kernel) equals torch.argmax."""

import pytest
import torch

from kvbalance.executor.torch import greedy_argmax
from kvbalance.model import fused

needs_kernels = pytest.mark.skipif(fused.library() is None, reason="no C compiler / kernels disabled")


def _hard_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 4099, generator=g) * 8).to(torch.bfloat16)  # coarse: many exact ties
    x[0] = -torch.rand(4099, generator=g).to(torch.bfloat16) - 1  # all negative
    x[1, :] = -0.0
    x[1, 7] = 0.0  # +0 and -0 are equal: the first index wins, whichever sign comes first
    x[5, :] = 0.0
    x[5, 7] = -0.0
    x[2, :] = float("-inf")
    x[2, 9] = -3.0e38
    x[3, 100] = float("inf")
    x[4, :] = -1e-40  # negative subnormals
    x[4, 50] = 1e-40
    x[6, 4097] = 1e4  # the maximum in the tail after the last full 16-lane chunk
    x[7, 3000] = float("nan")  # a NaN is the maximum (torch's rule)
    x[8, :] = float("-inf")  # all -inf: index 0
    x[9, 17] = x[9, 33] = x[9, 5] = 1e5  # the same maximum in three lanes: the smallest index
    return x


@needs_kernels
@pytest.mark.parametrize("n", [1, 5, 15, 16, 17, 31, 32, 4099])
def test_kernel_matches_torch_argmax(n):
    x = _hard_rows()[:, :n]
    assert fused.argmax_rows(x) == torch.argmax(x.float(), dim=-1).tolist()


@needs_kernels
def test_kernel_reads_strided_rows_and_rejects_bad_input():
    x = _hard_rows()
    view = x[::3, 1:]  # row stride 3 * 4099, rows offset by one element
    assert fused.argmax_rows(view) == torch.argmax(view.float(), dim=-1).tolist()
    with pytest.raises(ValueError, match="x:"):
        fused.argmax_rows(x.half())
    with pytest.raises(ValueError, match="empty"):
        fused.argmax_rows(x[:, :0])


def test_greedy_argmax_in_inference_and_float32():
    x = _hard_rows()
    with torch.inference_mode():  # the executor's mode: the kernel path where it is built
        assert greedy_argmax(x) == torch.argmax(x.float(), dim=-1).tolist()
    y = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1))
    y[3, 10] = y[3, 20] = 99.0
    assert greedy_argmax(y) == torch.argmax(y, dim=-1).tolist()
