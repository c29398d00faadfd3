"""Zeroed CPU tensors backed by transparent huge pages (2 MiB), for the KV cache.

Decode attention reads each sequence's KV blocks (8 KiB per head and block at SmolLM2's shape) from all
over a cache of a gigabyte or more: with 4 KiB pages nearly every block costs a TLB miss and a page walk
whose entries are not in cache either. Backed by 2 MiB pages, the same walks stay in the TLB. Measured on
the development machine with ``benchmarks/bench_decode_attention.py`` (one thread, 30 layers, blocks at
random through a 1.5 GB cache, best of 5; ``--small-pages`` for 4 KiB): 64 sequences x 200 tokens 41.5 ->
27.6 ms per step (7.1 -> 10.7 GB/s of K/V), 16 x 1,000 40.1 -> 31.0 ms, 64 x 1,000 138 -> 123 ms.

Linux's THP policy is usually ``madvise``: memory gets huge pages only where the process asks for them
(``madvise(MADV_HUGEPAGE)``) before first touching it. :func:`zeros` maps anonymous memory (zero-filled
by the kernel, as ``torch.zeros``), asks for huge pages, faults them in (:func:`prefault`) and wraps it
as a tensor that keeps the mapping alive. Elsewhere (no ``mmap.MADV_HUGEPAGE``, a CUDA device, under 2 MiB) it is ``torch.zeros``.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 * 2**20


def available() -> bool:
    """Whether this platform can ask for transparent huge pages (Linux's ``MADV_HUGEPAGE``)."""
    return hasattr(mmap, "MADV_HUGEPAGE")


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``, on huge pages where the CPU and OS allow."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE_BYTES or not available():
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP disabled ("never"): small pages, as torch.zeros
        pass
    t = torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)
    prefault(buf)
    return t


def prefault(buf: mmap.mmap) -> None:
    """Fault every page of ``buf`` in now, writing one zero byte per huge page (the kernel hands out
    zeroed pages, so the contents stay zeros). A lazily mapped KV cache otherwise takes its page faults
    (each a 2 MiB zero fill, and under THP's ``defrag=madvise`` a compaction) in the first steps that
    write each page: measured on this machine, 0.69 s of KV writes in the prefill of 64 ShareGPT prompts
    (20k tokens) that take 0.07 s on touched pages. vLLM's cache (``torch.zeros``) is touched at
    start-up too."""
    view = memoryview(buf)
    try:
        view[::HUGE_PAGE_BYTES] = bytes(-(-len(buf) // HUGE_PAGE_BYTES))  # one byte per huge page
    finally:
        view.release()
