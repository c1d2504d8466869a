"""Write-only files that hash what they write, for DCP's writer: the manifest needs no second pass over the data.

Two ways to write, picked by :func:`open_hashing_file`:

* :class:`BufferedHashingFile` (``direct=False``, and wherever ``O_DIRECT`` is refused): large writes go to the
  kernel straight from the caller's memory (a tensor's storage: no copy of ours), with ``sync_file_range``
  starting the kernel's writeback behind each 16 MiB, so the disk works while the next bytes come; the
  digest of each large write runs on a helper thread alongside its write. Small writes (zip headers, pickles)
  are gathered into one buffer first.
* :class:`DirectHashingFile` (``direct=True`` where the file system allows it): every byte is copied into
  reused huge-page bounce buffers (:data:`~smalti.checkpoint.io.BOUNCE_POOL`) and hashed right after its
  copy, while it is in the cache; a helper thread writes each full 16 MiB buffer with ``O_DIRECT`` while the
  next one fills (the copy and the hash release the GIL). A copy is cheaper than it looks: the disk's DMA
  moves a buffer in as many pieces as it has physically separate runs of memory, and a tensor's 4 KiB pages
  are almost all apart, so ``O_DIRECT`` from huge pages outruns ``O_DIRECT`` straight from a tensor's memory
  by more than the copy costs on the other core (figures in the README's performance section). A file
  system that accepts the ``O_DIRECT`` open but refuses the writes (EINVAL) gets them through the page cache.

``close`` calls ``fsync``: when it returns the file is durable and :attr:`digest` covers every byte, in order.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from smalti.checkpoint.hashes import DEFAULT_ALGORITHM, new_hasher, tagged
from smalti.checkpoint.io import (
    BOUNCE_BUFFERS,
    BOUNCE_POOL,
    CHUNK_BYTES,
    SYNC_FILE_RANGE_WRITE,
    align_down,
    buffer_address,
    leave_direct_io,
    open_maybe_direct,
    sync_file_range,
)

#: a file's first buffer goes to the disk when this much is in it, each next one when twice as much as the
#: one before (up to :data:`CHUNK_BYTES`): the disk starts before a whole chunk is copied
_FIRST_WRITE_BYTES = 1 << 20
#: large writes are copied into the bounce buffers and hashed in pieces of this size: small enough for the
#: hash to read each piece from the cache the copy just put it in, large enough that the GIL changes hands
#: seldom (under CPU load, 1 MiB pieces starved the disk: see the README's save path)
_COPY_PIECE_BYTES = 4 << 20
#: writes smaller than this are gathered into one buffer (zip headers and pickles between the tensors' bytes)
_SMALL_BYTES = 256 << 10


class _HashingFileBase:
    """The file interface torch.save and DCP use, over a new file written front to back.

    Not seekable: a seek would make the running digest wrong. :attr:`size` and :attr:`digest`
    (``"<algorithm>:<hex>"``) are final once :meth:`close` returns.
    """

    def __init__(self, path: str, fd: int, algorithm: str) -> None:
        self.path = path
        self._fd = fd
        self.algorithm = algorithm
        self._hash = new_hasher(algorithm)
        self._closed = False
        self.size = 0
        self.digest = ""

    def tell(self) -> int:
        return self.size

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def flush(self) -> None:
        """Nothing to do: :meth:`close` writes what is left and makes the file durable."""

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> _HashingFileBase:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(Exception):  # the error already raised (disk full, ...) is the one to report
            self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"write to closed file {self.path}")

    def close(self) -> None:  # pragma: no cover - each subclass closes its own way
        raise NotImplementedError


class BufferedHashingFile(_HashingFileBase):
    """Page-cache writes straight from the caller's memory, writeback started behind each 16 MiB."""

    def __init__(self, path: str, fd: int, algorithm: str = DEFAULT_ALGORITHM) -> None:
        super().__init__(path, fd, algorithm)
        self._small = bytearray()
        self._written = 0  # bytes handed to the kernel
        self._synced_to = 0  # writeback started up to here
        self._hasher: ThreadPoolExecutor | None = None

    def write(self, data: Any) -> int:
        """Hash ``data`` and write it (large writes from the caller's memory, small ones gathered)."""
        self._check_open()
        view = memoryview(data).cast("B")
        n = len(view)
        if n < _SMALL_BYTES:
            self._hash.update(view)
            self._small += view
            if len(self._small) >= _SMALL_BYTES:
                self._flush_small()
        else:
            self._flush_small()
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, "smalti-ckpt-hash")
            hashed = self._hasher.submit(self._hash.update, view)  # runs beside the writes (both drop the GIL)
            try:
                self._write_all(view)
            finally:
                hashed.result()  # the caller may reuse its memory once write returns
        self.size += n
        return n

    def close(self) -> None:
        """Write what is gathered, ``fsync`` and close; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._flush_small()
            os.fsync(self._fd)
            self.digest = tagged(self.algorithm, self._hash.hexdigest())
        finally:
            if self._hasher is not None:
                self._hasher.shutdown(wait=True)
            os.close(self._fd)

    def _flush_small(self) -> None:
        if self._small:
            small, self._small = self._small, bytearray()
            self._write_all(memoryview(small))

    def _write_all(self, view: memoryview) -> None:
        while view:
            piece = view[: CHUNK_BYTES - (self._written - self._synced_to)]
            n = os.write(self._fd, piece)
            view = view[n:]
            self._written += n
            if self._written - self._synced_to >= CHUNK_BYTES:
                self._start_writeback()

    def _start_writeback(self) -> None:
        if sync_file_range is not None:
            with contextlib.suppress(OSError):  # if refused, writeback starts at fsync, as without this hint
                sync_file_range(self._fd, self._synced_to, self._written - self._synced_to, SYNC_FILE_RANGE_WRITE)
        self._synced_to = self._written


class DirectHashingFile(_HashingFileBase):
    """``O_DIRECT`` writes from huge-page bounce buffers (see the module docstring): every byte is copied into
    the current buffer and hashed right after, while it is in the cache; a helper thread writes each full
    buffer while the next one fills. The buffers come from :data:`BOUNCE_POOL` and go back when the file
    closes."""

    def __init__(self, path: str, fd: int, algorithm: str = DEFAULT_ALGORITHM) -> None:
        super().__init__(path, fd, algorithm)
        self._direct = True
        self._io = ThreadPoolExecutor(1, "smalti-ckpt-write")
        self._buffers = BOUNCE_POOL.take(BOUNCE_BUFFERS)
        self._addresses = [buffer_address(buffer) for buffer in self._buffers]
        self._free = deque(range(len(self._buffers)))
        self._in_flight: deque[tuple[int, Future[Any]]] = deque()
        self._current = self._free.popleft()
        self._filled = 0
        self._limit = _FIRST_WRITE_BYTES  # the current buffer goes to the write thread when this much is in it
        self._submitted = 0  # file offset of the current buffer's first byte (a multiple of BLOCK_BYTES)
        self._failed = False  # a write failed: nothing more is written (the error went to the caller)

    def write(self, data: Any) -> int:
        """Copy ``data`` into the bounce buffers, hashing each piece right after its copy; each full buffer
        goes to the write thread (this waits only when every buffer is still being written)."""
        self._check_open()
        if self._failed:
            raise OSError(errno.EIO, f"an earlier write to {self.path} failed")
        view = memoryview(data).cast("B")
        total = len(view)
        if total < _SMALL_BYTES:  # a header or a pickle: too small for the release of the GIL to pay
            self._copy_small(view)
        else:
            address = buffer_address(view)
            done = 0
            while done < total:
                n = min(self._limit - self._filled, total - done, _COPY_PIECE_BYTES)
                ctypes.memmove(self._addresses[self._current] + self._filled, address + done, n)  # drops the GIL
                self._hash.update(self._buffers[self._current][self._filled : self._filled + n])
                self._filled += n
                done += n
                if self._filled == self._limit:
                    self._hand_over()
        self.size += total
        return total

    def _copy_small(self, view: memoryview) -> None:
        self._hash.update(view)
        while view:
            n = min(self._limit - self._filled, len(view))
            self._buffers[self._current][self._filled : self._filled + n] = view[:n]
            self._filled += n
            view = view[n:]
            if self._filled == self._limit:
                self._hand_over()

    def close(self) -> None:
        """Write what is left, wait for the writes, ``fsync`` and close; idempotent. The bounce buffers go
        back to :data:`BOUNCE_POOL` once no write uses them, whether or not the writes succeeded."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._failed:
                return  # the write error was raised already: the file stays incomplete, with no digest
            tail = self._buffers[self._current][: self._filled]
            self._in_flight.append((self._current, self._io.submit(self._write_tail, tail, self._submitted)))
            while self._in_flight:
                self._retire_oldest()
            self.digest = tagged(self.algorithm, self._hash.hexdigest())
        finally:
            self._io.shutdown(wait=True)  # every write submitted has returned: the buffers are free
            BOUNCE_POOL.give(self._buffers)
            self._buffers = []
            os.close(self._fd)

    def _hand_over(self) -> None:
        """Give the current (full) bounce buffer to the write thread and take a free one."""
        self._limit = min(2 * self._limit, CHUNK_BYTES)
        chunk = self._buffers[self._current][: self._filled]
        self._in_flight.append((self._current, self._io.submit(self._write_at, chunk, self._submitted)))
        self._submitted += self._filled
        if not self._free:
            self._retire_oldest()
        self._current = self._free.popleft()
        self._filled = 0

    def _retire_oldest(self) -> None:
        index, written = self._in_flight.popleft()
        try:
            written.result()  # a write error (disk full, I/O error) surfaces here, in the caller's thread
        except BaseException:
            self._failed = True
            raise
        self._free.append(index)

    def _write_at(self, data: memoryview, offset: int) -> None:
        while data:
            try:
                n = os.pwrite(self._fd, data, offset)
            except OSError as exc:
                if not (self._direct and exc.errno == errno.EINVAL):
                    raise
                self._leave_direct_io()  # opened with O_DIRECT but the file system refuses such writes
                continue
            data, offset = data[n:], offset + n

    def _write_tail(self, data: memoryview, offset: int) -> None:
        aligned = align_down(len(data))
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


def open_hashing_file(
    path: str | os.PathLike[str], direct: bool = False, algorithm: str = DEFAULT_ALGORITHM
) -> BufferedHashingFile | DirectHashingFile:
    """A new file at ``path`` (truncated if it exists) that hashes with ``algorithm`` what is written to it:
    :class:`DirectHashingFile` when ``direct`` and the file system allows ``O_DIRECT``, else
    :class:`BufferedHashingFile`."""
    path = os.fspath(path)
    fd, is_direct = open_maybe_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
    try:
        return DirectHashingFile(path, fd, algorithm) if is_direct else BufferedHashingFile(path, fd, algorithm)
    except BaseException:
        os.close(fd)
        raise
