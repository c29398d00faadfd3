"""The Python side shared by the packed-panel GEMMs (:mod:`kvbalance.model.avx2_gemm`,
:mod:`kvbalance.model.avx512_gemm`): building and probing the library, the environment switch, packing a
weight and calling the C ``gemm(x, ldx, wp, bias, y, ldy, m, n, k, threads)``.

Each C file (``kvbalance/native/avx2_gemm.c``, ``avx512_gemm.c``) exports ``cpu_ok()`` (the CPU has the instructions), a ``veto`` probe (the CPU has a unit
that serves these shapes better: AVX-512 for the AVX2 kernel, AMX for the AVX-512 one), ``pack(w, n, k,
wp)`` and ``gemm`` (returning non-zero where it cannot allocate its buffers).
``KVBALANCE_NATIVE_GEMM=0`` turns every such kernel off; ``=1`` prefers each wherever it runs.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

import torch

from kvbalance.model import cbuild


class PanelGemm:
    """One compiled packed-panel GEMM: ``name``, the C files ``sources`` built with ``flags`` on first use
    where the CPU lists ``cpu_features`` (``fallback``: the library GEMM that runs otherwise); ``dtype``
    its weights, activations and outputs; ``size(n, k)`` the values a packed [N, K] weight holds; ``tag``
    the attribute set on packed copies (packed.py dispatches by it)."""

    def __init__(
        self,
        name: str,
        sources: tuple[str, ...],
        flags: tuple[str, ...],
        cpu_features: tuple[str, ...],
        fallback: str,
        dtype: torch.dtype,
        size: Callable[[int, int], int],
        tag: str,
        veto: str,
    ) -> None:
        self.name, self.sources, self.flags, self.dtype = name, sources, flags, dtype
        self.cpu_features, self.fallback = cpu_features, fallback
        self.size, self.tag, self.veto = size, tag, veto
        self._lock = threading.Lock()
        self._lib: list[ctypes.CDLL | None] = []

    def library(self) -> ctypes.CDLL | None:
        if not self._lib:
            with self._lock:
                if not self._lib:
                    lib = None
                    if cbuild.cpu_has(*self.cpu_features):  # elsewhere it could never run
                        lib = cbuild.load(self.name, self.sources, self.flags, self.fallback)
                    if lib is not None:
                        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
                        lib.pack.argtypes = [ptr, i64, i64, ptr]
                        lib.pack.restype = None
                        lib.gemm.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
                        lib.gemm.restype = ctypes.c_int
                        lib.ok = bool(lib.cpu_ok())
                        lib.vetoed = bool(getattr(lib, self.veto)())
                    self._lib.append(lib)
        return self._lib[0]

    def available(self) -> bool:
        """Whether the kernel runs here: the CPU has its instructions, native kernels are on and it builds."""
        if not cbuild.native_enabled() or os.environ.get("KVBALANCE_NATIVE_GEMM") == "0":
            return False
        lib = self.library()
        return lib is not None and lib.ok

    def preferred(self) -> bool:
        """Whether linears of its dtype take this kernel over the library's GEMM here."""
        if not self.available():
            return False
        return os.environ.get("KVBALANCE_NATIVE_GEMM") == "1" or not self.library().vetoed

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [N, K] -> the packed panels (1-D, ``size(N, K)`` values, tagged)."""
        kind = str(self.dtype).removeprefix("torch.")
        if weight.dtype != self.dtype or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(
                f"weight: expected a 2-D {kind} CPU tensor, got {tuple(weight.shape)} {weight.dtype}"
            )
        lib = self.library()
        if lib is None or not lib.ok:
            raise RuntimeError(f"{self.name}: not available on this machine (available() is False)")
        w = weight.detach().contiguous()
        n, k = w.shape
        out = torch.empty(self.size(n, k), dtype=self.dtype)
        lib.pack(w.data_ptr(), n, k, out.data_ptr())
        setattr(
            out, self.tag, True
        )  # packed.py runs a weight through the kernel its packed copy was made for
        return out

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x`` [..., K] @ W^T (+ ``bias`` [N]) -> [..., N], ``packed`` from :meth:`pack` of W [N, K]."""
        if x.dtype != self.dtype or x.device.type != "cpu":
            kind = str(self.dtype).removeprefix("torch.")
            raise ValueError(f"x: expected a {kind} CPU tensor, got {x.dtype} on {x.device}")
        k = x.shape[-1]
        if packed.numel() != self.size(n, k):
            raise ValueError(f"packed: {packed.numel()} values do not hold a [{n}, {k}] weight")
        x2 = x.reshape(-1, k)
        if k and x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        y = torch.empty(*x.shape[:-1], n, dtype=self.dtype)
        if m == 0 or n == 0:
            return y
        if k == 0:
            return y.copy_(bias.expand_as(y)) if bias is not None else y.zero_()
        b = None if bias is None else bias.detach().to(torch.float32).contiguous()
        rc = self.library().gemm(
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
            raise MemoryError(f"{self.name}: could not allocate its buffers")
        return y
