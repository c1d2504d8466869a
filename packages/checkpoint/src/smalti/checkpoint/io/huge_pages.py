"""Page-aligned host buffers backed by transparent huge pages, for ``O_DIRECT`` reads and writes.

The disk's DMA moves a buffer in as many pieces as the buffer has physically separate runs of memory. A
tensor's pages, allocated 4 KiB at a time, are almost all apart, so ``O_DIRECT`` from them is slower than
from 2 MiB huge pages; a copy into such a buffer costs less than the difference, and runs beside the disk on
another core (figures in the smalti-checkpoint README, "Why huge-page bounce buffers").

:func:`huge_page_buffer` maps a private anonymous region aligned to :data:`HUGE_PAGE_BYTES`, asks the kernel to
back it with huge pages (``madvise(MADV_HUGEPAGE)``: honoured under the common ``madvise`` setting of
``/sys/kernel/mm/transparent_hugepage/enabled``), and touches every page once so that its first use pays no
page fault. Where huge pages are unavailable the buffer is still page-aligned and works, only slower.
"""

from __future__ import annotations

import contextlib
import mmap

HUGE_PAGE_BYTES = 2 << 20


def huge_page_buffer(nbytes: int) -> memoryview:
    """A writable, zero-filled ``memoryview`` of ``nbytes`` (rounded up to whole huge pages), starting on a
    :data:`HUGE_PAGE_BYTES` boundary and backed by huge pages where the kernel allows. The view keeps its
    mapping alive; the mapping is unmapped when the last view of it is gone."""
    if nbytes <= 0:
        raise ValueError(f"huge_page_buffer needs a positive size, got {nbytes}")
    length = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    region = mmap.mmap(-1, length + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = memoryview(region)
    address = buffer_address(whole)
    skip = -address % HUGE_PAGE_BYTES  # the mapping is page-aligned: skip up to the next huge page boundary
    madvise = getattr(region, "madvise", None)
    if madvise is not None and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages: 4 KiB pages it is
            madvise(mmap.MADV_HUGEPAGE, skip, length)
    view = whole[skip : skip + length]
    zeros = bytes(HUGE_PAGE_BYTES)
    for start in range(0, length, HUGE_PAGE_BYTES):  # map every page now, not on the first real use
        view[start : start + HUGE_PAGE_BYTES] = zeros
    return view[:nbytes]


def buffer_address(view: memoryview) -> int:
    """The memory address of the first byte of ``view`` (read-only views too)."""
    import numpy

    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)
