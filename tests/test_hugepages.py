"""executor/hugepages.py: zeroed tensors on memory advised for transparent huge pages."""

import gc

import pytest
import torch

from kvbalance.executor import hugepages

needs_thp = pytest.mark.skipif(not hugepages.available(), reason="no MADV_HUGEPAGE on this platform")


def _smaps_field(ptr: int, field: str) -> list[str]:
    """The ``field`` line (e.g. ``VmFlags:``) of the mapping of this process that holds address ``ptr``
    (/proc/self/smaps), split after the name."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == field:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


def _vm_flags(ptr: int) -> list[str]:
    return _smaps_field(ptr, "VmFlags:")


@needs_thp
def test_a_large_tensor_is_zeroed_writable_and_advised_for_huge_pages():
    t = hugepages.zeros((3, 1024, 1024), torch.bfloat16)  # 6 MiB
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    assert "hg" in _vm_flags(t.data_ptr())  # madvise(MADV_HUGEPAGE) reached the kernel
    gc.collect()  # the tensor alone keeps its mapping alive
    t[2, 1023, 1023] = 7.0
    t[0].fill_(1.0)
    assert t.float().sum().item() == 1024 * 1024 + 7.0


@needs_thp
def test_the_pages_are_faulted_in_at_allocation():
    """Resident before anything touches them (no page faults, no THP compaction in the first steps)."""
    t = hugepages.zeros((8, 1024, 1024), torch.bfloat16)  # 16 MiB
    rss_kb = int(_smaps_field(t.data_ptr(), "Rss:")[0])
    assert rss_kb >= 16 * 1024
    assert not t.any()


def test_small_or_non_cpu_tensors_are_plain_zeros(monkeypatch):
    # under a huge page no mapping is made (asserted on the call, not on /proc: torch's allocator may
    # place a small tensor in whatever mapping it likes)
    def no_mmap(*args, **kwargs):
        raise AssertionError("hugepages.zeros mapped memory for a tensor under one huge page")

    monkeypatch.setattr(hugepages.mmap, "mmap", no_mmap)
    t = hugepages.zeros((4, 8), torch.float32)
    assert t.shape == (4, 8) and t.dtype == torch.float32 and not t.any()
    t = hugepages.zeros((hugepages.HUGE_PAGE_BYTES // 2 - 1,), torch.bfloat16)  # 2 bytes short of one
    assert not t.any()
