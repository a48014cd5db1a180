"""Host memory backed by 2 MiB pages, for the bytes a CPU decode step streams (its weights and K/V buffers).

A decode step reads every weight once. From 4 KiB pages, each 4 KiB streamed is another TLB entry, and in a virtual
machine a TLB miss walks two page tables (the guest's and the host's). Linux backs an anonymous private mapping with
transparent huge pages when the mapping is advised so (`madvise(MADV_HUGEPAGE)`) and THP is `always` or `madvise`
(/sys/kernel/mm/transparent_hugepage/enabled); glibc's malloc, behind both torch's and XLA's CPU allocators, does
not advise. Measured on a 2-core AMD EPYC VM (docs/design.md §7.29): a sum over 256 MB streamed 33-36 GB/s from
2 MiB pages against 28-30 from 4 KiB pages in the same process, and the trained default model decoded 73.5 tok/s
against 57.8 with its weights and K/V there.

Nothing here changes a value: the arrays hold the same bytes wherever they live. Where the kernel has no such advice
(not Linux, or THP `never`), or `TWINCACHE_HUGE_PAGES=0` is set (a host where THP's compaction stalls or its
rounding costs too much memory), the buffer is plain memory with the same alignment.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np

from twincache.switches import switch

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB granule) transparent huge page
ALIGNMENT = 64  # each array's start: a cache line, and what XLA-CPU needs to share an array without a copy
OPT_OUT = "TWINCACHE_HUGE_PAGES"  # "0": no advice, plain pages


def huge_pages_wanted() -> bool:
    """Whether to advise 2 MiB pages: yes unless TWINCACHE_HUGE_PAGES is "0" (read at each allocation)."""
    return switch(OPT_OUT, on="advise 2 MiB pages, the default", off="plain 4 KiB pages")


def host_buffer(nbytes: int) -> np.ndarray:
    """A writable, zero-filled uint8 array of `nbytes` whose start is 2 MiB aligned, in a private anonymous mapping
    advised MADV_HUGEPAGE where the platform has the advice. It owns its mapping: the memory is returned when the
    last array or tensor viewing it is gone. Pages are taken on first write (untouched ones cost no memory)."""
    if nbytes < 0:
        raise ValueError(f"a host buffer of {nbytes} bytes: give a size >= 0")
    # MAP_PRIVATE: a shared anonymous mapping is shmem, which THP backs only under shmem_enabled (default never).
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags) if flags else mmap.mmap(-1, nbytes + HUGE_PAGE)
    if hasattr(mmap, "MADV_HUGEPAGE") and huge_pages_wanted():
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first write: pages fault in as 2 MiB ones
        except OSError:  # THP compiled out of this kernel: plain pages, same bytes
            pass
    whole = np.frombuffer(mapping, dtype=np.uint8)  # [nbytes + 2 MiB]; keeps `mapping` alive
    start = -whole.ctypes.data % HUGE_PAGE
    return whole[start:start + nbytes]


def arena_offsets(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Where each of several arrays of these byte sizes starts in one host buffer (ALIGNMENT apart), and the
    buffer's size."""
    offsets, end = [], 0
    for size in nbytes:
        offsets.append(end)
        end += -(-size // ALIGNMENT) * ALIGNMENT
    return offsets, end
