"""The process-wide stock of huge-page bounce buffers the checkpoint's direct-I/O writes and reads borrow."""

from __future__ import annotations

import os
import threading

from smalti.checkpoint.io.huge_pages import huge_page_buffer

#: the size of one bounce buffer: one direct-I/O write or read
CHUNK_BYTES = 16 << 20
#: bounce buffers per direct-I/O file written: one filling, the others queued for or in the write
BOUNCE_BUFFERS = 4


class BouncePool:
    """A process-wide stock of :data:`CHUNK_BYTES` huge-page buffers that the direct-I/O writes and reads borrow.

    Mapping and faulting in tens of MiB of huge pages costs milliseconds per file; kept here they are paid for
    once per process. A user takes its buffers when it starts and gives them back when it is done (after its
    last write or read has returned, so no I/O touches a buffer someone else fills). At most ``keep`` idle
    buffers are kept (the rest are unmapped as their last view goes): by default two written files' worth,
    128 MiB, enough for two DCP writer threads; :meth:`clear` lets them go. A forked child process starts with
    an empty stock.
    """

    def __init__(self, keep: int = 2 * BOUNCE_BUFFERS) -> None:
        self.keep = keep
        self._idle: list[memoryview] = []
        self._lock = threading.Lock()

    def take(self, count: int) -> list[memoryview]:
        """``count`` buffers: idle ones first, new ones for the rest."""
        with self._lock:
            taken = [self._idle.pop() for _ in range(min(count, len(self._idle)))]
        return taken + [huge_page_buffer(CHUNK_BYTES) for _ in range(count - len(taken))]

    def give(self, buffers: list[memoryview]) -> None:
        """Return buffers no write or read is using any more."""
        with self._lock:
            self._idle += buffers[: max(self.keep - len(self._idle), 0)]

    def clear(self) -> None:
        """Drop every idle buffer (their memory goes back to the system)."""
        with self._lock:
            self._idle = []

    @property
    def idle(self) -> int:
        """How many buffers are in stock."""
        return len(self._idle)


BOUNCE_POOL = BouncePool()
if hasattr(os, "register_at_fork"):  # a forked child's copy of the stock would be its private (copied) pages
    os.register_at_fork(after_in_child=lambda: BOUNCE_POOL.__init__(BOUNCE_POOL.keep))
