"""The direct-I/O engine the checkpoint's saves and loads share.

* :mod:`~smalti.checkpoint.io.blocks`: ``O_DIRECT``'s block alignment (:data:`BLOCK_BYTES`, :func:`align_down`,
  :func:`align_up`) and the cutting of byte ranges into block-aligned reads of at most a chunk
  (:func:`merge_ranges`, :func:`chunk_ranges`).
* :mod:`~smalti.checkpoint.io.files`: opening a file with ``O_DIRECT`` where the file system takes it
  (:func:`open_maybe_direct`), turning it off on an open file (:func:`leave_direct_io`) and the kernel's
  writeback hint (:func:`sync_file_range`).
* :mod:`~smalti.checkpoint.io.huge_pages`: page-aligned buffers on transparent huge pages.
* :mod:`~smalti.checkpoint.io.pool`: :data:`BOUNCE_POOL`, the process-wide stock of :data:`CHUNK_BYTES`
  huge-page ("bounce") buffers both the writes (:mod:`smalti.checkpoint.hashing_file`) and the reads
  (:mod:`smalti.checkpoint.bounce_read`) borrow, so a load after a save maps no new memory.

The engine imports nothing else of smalti-checkpoint: the reads and the writes build on it, never on each other.
"""

from smalti.checkpoint.io.blocks import BLOCK_BYTES, align_down, align_up, chunk_ranges, merge_ranges
from smalti.checkpoint.io.files import (
    READ_FLAGS,
    SYNC_FILE_RANGE_WRITE,
    leave_direct_io,
    libc_function,
    open_maybe_direct,
    sync_file_range,
)
from smalti.checkpoint.io.huge_pages import HUGE_PAGE_BYTES, buffer_address, huge_page_buffer
from smalti.checkpoint.io.pool import BOUNCE_BUFFERS, BOUNCE_POOL, CHUNK_BYTES, BouncePool

__all__ = [
    "BLOCK_BYTES",
    "BOUNCE_BUFFERS",
    "BOUNCE_POOL",
    "CHUNK_BYTES",
    "HUGE_PAGE_BYTES",
    "READ_FLAGS",
    "SYNC_FILE_RANGE_WRITE",
    "BouncePool",
    "align_down",
    "align_up",
    "buffer_address",
    "chunk_ranges",
    "huge_page_buffer",
    "leave_direct_io",
    "libc_function",
    "merge_ranges",
    "open_maybe_direct",
    "sync_file_range",
]
