"""The Python side shared by the packed-panel GEMMs (:mod:`kvbalance.model.avx2_gemm`,
:mod:`kvbalance.model.avx512_gemm`): input checks, the 2-D view of the activations, the output, the empty
cases and the call of the C ``gemm(x, ldx, wp, bias, y, ldy, m, n, k, threads)``."""

from __future__ import annotations

import torch


def linear(
    gemm, name: str, x: torch.Tensor, packed: torch.Tensor, n: int, size: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x`` [..., K] @ W^T (+ ``bias`` [N]) -> [..., N] in ``packed``'s dtype through the C ``gemm`` of kernel
    ``name``; ``size``: the number of values a packed [N, K] weight holds (checked against ``packed``)."""
    dtype = packed.dtype
    if x.dtype != dtype or x.device.type != "cpu":
        raise ValueError(
            f"x: expected a {str(dtype).removeprefix('torch.')} CPU tensor, got {x.dtype} on {x.device}"
        )
    k = x.shape[-1]
    if packed.numel() != size:
        raise ValueError(f"packed: {packed.numel()} values do not hold a [{n}, {k}] weight")
    x2 = x.reshape(-1, k)
    if k and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(*x.shape[:-1], n, dtype=dtype)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.copy_(bias.expand_as(y)) if bias is not None else y.zero_()
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    rc = gemm(
        x2.data_ptr(),
        x2.stride(0),
        packed.data_ptr(),
        None if b is None else b.data_ptr(),
        y.data_ptr(),
        n,
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    if rc:
        raise MemoryError(f"{name}: could not allocate the packed activations")
    return y
