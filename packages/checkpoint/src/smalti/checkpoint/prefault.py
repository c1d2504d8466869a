"""Mapping the pages of freshly allocated tensors in the background, before a load copies into them.

A load fills state that did not exist a moment before (an optimizer's moments: two thirds of an AdamW
checkpoint). The first write to each 4 KiB page of such memory is a page fault (the kernel zeroes and maps
the page), and on a virtual machine that can cost more than the copy itself (figures in the README's
performance section). :class:`Prefaulter` asks the kernel to map
those pages (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+: one call per tensor, no per-page fault) on a
helper thread, while the loader waits for the disk; the copy then writes into mapped pages. Where the call
is missing (older kernels, other systems) nothing is done and the copy faults the pages in as before.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterable

import torch

from smalti.checkpoint.io.files import libc_function

MADV_POPULATE_WRITE = 23
PAGE_BYTES = 4096


_madvise: Callable[[int, int, int], int] | None = libc_function(
    "madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
)


def whole_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """``(address, length)`` of the pages that lie wholly inside ``tensor``'s bytes (length 0: none): only
    those are touched, so memory the tensor shares a page with is never asked about."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // PAGE_BYTES) * PAGE_BYTES
    last = end // PAGE_BYTES * PAGE_BYTES
    return first, max(last - first, 0)


def populate(tensor: torch.Tensor) -> bool:
    """Map the whole pages of a CPU ``tensor`` now (their contents are unchanged); False where the kernel
    cannot (no ``MADV_POPULATE_WRITE``), True otherwise."""
    if _madvise is None or tensor.device.type != "cpu":
        return False
    address, length = whole_pages(tensor)
    return length == 0 or _madvise(address, length, MADV_POPULATE_WRITE) == 0


class Prefaulter:
    """Maps the pages of ``tensors`` on a helper thread, in order (ctypes calls drop the GIL); :meth:`join`
    waits for it. Stops at the first tensor the kernel refuses (the copy then faults the rest in itself)."""

    #: tensors smaller than this are left to the copy (a thread's worth of work is not there)
    MIN_BYTES = 1 << 20

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        local = [
            t.to_local() if hasattr(t, "to_local") else t for t in tensors
        ]  # a DTensor: this rank's shard
        self._tensors = [
            t for t in local if t.device.type == "cpu" and t.numel() * t.element_size() >= self.MIN_BYTES
        ]
        self._thread: threading.Thread | None = None
        if self._tensors and _madvise is not None:
            self._thread = threading.Thread(target=self._run, name="smalti-ckpt-prefault", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        for tensor in self._tensors:
            if not populate(tensor):
                return

    def join(self) -> None:
        """Wait until every page is mapped (or the kernel refused)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
