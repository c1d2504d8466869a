"""A write-only file that hashes and writes in a pipeline: the caller only copies bytes into aligned buffers.

Each full buffer goes to two helper threads at once: one feeds it to sha256, the other writes it to disk,
with ``O_DIRECT`` where the file system allows it (no page-cache copy and no kernel writeback work for
the CPU, which on small machines is what a checkpoint save is short of). Elsewhere the writes are
buffered and ``sync_file_range`` starts the kernel's writeback behind each buffer, so the disk works
while the next bytes are produced. ``close`` waits for both threads and ``fsync``\\ s: when it returns the
file is durable and :attr:`HashingFile.sha256` covers every byte, in order.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import mmap
import os
import sys
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

CHUNK_BYTES = 16 << 20
_BUFFERS = 3
ALIGN_BYTES = 4096  # O_DIRECT needs offsets, lengths and addresses aligned to the logical block size (<= 4 KiB)
SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait for it
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _load_sync_file_range() -> Callable[[int, int, int, int], None] | None:
    """Linux's ``sync_file_range(2)`` through ctypes (the ``os`` module does not expose it); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int

    def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
        if function(fd, offset, nbytes, flags) != 0:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))

    return sync_file_range


sync_file_range = _load_sync_file_range()


def open_maybe_direct(path: str | os.PathLike[str], flags: int, direct: bool) -> tuple[int, bool]:
    """``os.open`` with ``O_DIRECT`` added when ``direct`` and the file system allows it; the descriptor and
    whether it is direct (a file system without direct I/O answers EINVAL: the file opens without it)."""
    flags |= getattr(os, "O_CLOEXEC", 0)
    if direct and _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, 0o666), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o666), False


def leave_direct_io(fd: int) -> None:
    """Turn ``O_DIRECT`` off for an open file (for an unaligned tail, or a file system that refuses direct I/O
    on the first read or write although it accepted the open)."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


class HashingFile:
    """A new file at ``path``, written front to back, with the sha256 and size of what was written.

    ``direct=False`` never tries ``O_DIRECT``. Not seekable: a seek would make the running digest wrong.
    """

    def __init__(self, path: str | os.PathLike[str], direct: bool = True) -> None:
        self.path = os.fspath(path)
        self._fd, self._direct = open_maybe_direct(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
        self._digest = hashlib.sha256()
        self._hasher = ThreadPoolExecutor(1, "smalti-ckpt-hash")
        self._io = ThreadPoolExecutor(1, "smalti-ckpt-write")
        self._buffers = [mmap.mmap(-1, CHUNK_BYTES) for _ in range(_BUFFERS)]
        self._free = deque(range(_BUFFERS))
        self._in_flight: deque[tuple[int, Future[Any], Future[Any]]] = deque()
        self._current = self._free.popleft()
        self._filled = 0
        self._submitted = 0  # file offset of the current buffer's first byte
        self._closed = False
        self.size = 0
        self.sha256 = ""

    # -- the file interface torch.save and DCP use --------------------------------------------------------
    def write(self, data: Any) -> int:
        """Copy ``data`` into the buffers (handing each full one to the hash and write threads)."""
        if self._closed:
            raise ValueError(f"write to closed file {self.path}")
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            room = CHUNK_BYTES - self._filled
            n = min(room, len(view))
            self._buffers[self._current][self._filled : self._filled + n] = view[:n]
            self._filled += n
            view = view[n:]
            if self._filled == CHUNK_BYTES:
                self._hand_over()
        self.size += total
        return total

    def tell(self) -> int:
        return self.size

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def flush(self) -> None:
        """Nothing to do: bytes reach the disk in whole buffers and at :meth:`close`, which makes them durable."""

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Write what is left, wait for the hash and the writes, ``fsync`` and close; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            tail = memoryview(self._buffers[self._current])[: self._filled]
            hashed = self._hasher.submit(self._digest.update, tail)
            written = self._io.submit(self._write_tail, tail, self._submitted)
            self._in_flight.append((self._current, hashed, written))
            while self._in_flight:
                self._retire_oldest()
            self.sha256 = self._digest.hexdigest()
        finally:
            self._hasher.shutdown(wait=True)
            self._io.shutdown(wait=True)
            os.close(self._fd)

    def __enter__(self) -> HashingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the pipeline ---------------------------------------------------------------------------------------
    def _hand_over(self) -> None:
        chunk = memoryview(self._buffers[self._current])
        hashed = self._hasher.submit(self._digest.update, chunk)
        written = self._io.submit(self._write_at, chunk, self._submitted)
        self._in_flight.append((self._current, hashed, written))
        self._submitted += CHUNK_BYTES
        if not self._free:
            self._retire_oldest()
        self._current = self._free.popleft()
        self._filled = 0

    def _retire_oldest(self) -> None:
        index, hashed, written = self._in_flight.popleft()
        hashed.result()
        written.result()  # a write error (disk full, I/O error) surfaces here, in the caller's thread
        self._free.append(index)

    def _write_at(self, data: memoryview, offset: int) -> None:
        start = offset
        while data:
            try:
                n = os.pwrite(self._fd, data, offset)
            except OSError as exc:
                if not (self._direct and exc.errno == errno.EINVAL):
                    raise
                self._leave_direct_io()  # opened with O_DIRECT but the file system refuses such writes
                continue
            data, offset = data[n:], offset + n
        if not self._direct and sync_file_range is not None:
            with contextlib.suppress(OSError):  # if refused, writeback starts at fsync, as without this hint
                sync_file_range(self._fd, start, offset - start, SYNC_FILE_RANGE_WRITE)

    def _write_tail(self, data: memoryview, offset: int) -> None:
        aligned = len(data) // ALIGN_BYTES * ALIGN_BYTES
        if aligned:
            self._write_at(data[:aligned], offset)
        if aligned < len(data):
            self._leave_direct_io()  # the last bytes are not a whole block
            self._write_at(data[aligned:], offset + aligned)
        os.fsync(self._fd)

    def _leave_direct_io(self) -> None:
        if self._direct:
            leave_direct_io(self._fd)
            self._direct = False
