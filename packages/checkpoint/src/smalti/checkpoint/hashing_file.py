"""Write-only files that hash what they write, for DCP's writer: the manifest needs no second pass over the data.

Two ways to write, picked by :func:`open_hashing_file`:

* :class:`BufferedHashingFile` (``direct=False``, and wherever ``O_DIRECT`` is refused): large writes go to the
  kernel straight from the caller's memory (a tensor's storage: no copy of ours), with ``sync_file_range``
  starting the kernel's writeback behind each 16 MiB, so the disk works while the next bytes come; the
  digest of each large write runs on a helper thread alongside its write. Small writes (zip headers, pickles)
  are gathered into one buffer first.
* :class:`DirectHashingFile` (``direct=True`` where the file system allows it): ``O_DIRECT`` needs the memory
  address, the file offset and the length of every write to be multiples of the disk's block size. A large
  write (a tensor's bytes) whose memory address is congruent to its file offset modulo :data:`ALIGN_BYTES`
  (the save lays each tensor out so: :meth:`DirectHashingFile.align_to`) is written with ``O_DIRECT``
  straight from the caller's memory, every whole block of it; only the partial blocks at its two ends go
  through a page-aligned 16 MiB bounce buffer, with the small writes between (zip headers, pickles). Other
  writes are copied into the bounce buffers, which a helper thread writes while the next one fills.

``close`` calls ``fsync``: when it returns the file is durable and :attr:`digest` covers every byte, in order.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import sys
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from smalti.checkpoint.hashes import DEFAULT_ALGORITHM, new_hasher, tagged

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


#: writes smaller than this are gathered into one buffer (zip headers and pickles between the tensors' bytes)
_SMALL_BYTES = 256 << 10


def buffer_address(view: memoryview) -> int:
    """The memory address of the first byte of ``view`` (read-only views too)."""
    import numpy

    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)


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
    """``O_DIRECT`` writes: whole blocks of suitably placed large writes straight from the caller's memory,
    everything else copied into aligned bounce buffers that a helper thread writes (see the module docstring).

    :attr:`copied` counts the bytes that went through the bounce buffers.
    """

    def __init__(self, path: str, fd: int, algorithm: str = DEFAULT_ALGORITHM) -> None:
        super().__init__(path, fd, algorithm)
        self._direct = True
        self._io = ThreadPoolExecutor(1, "smalti-ckpt-write")
        self._buffers = [mmap.mmap(-1, CHUNK_BYTES) for _ in range(_BUFFERS)]
        self._free = deque(range(_BUFFERS))
        self._in_flight: deque[tuple[int, Future[Any]]] = deque()
        self._current = self._free.popleft()
        self._filled = 0
        self._submitted = 0  # file offset of the current buffer's first byte (a multiple of ALIGN_BYTES)
        self.copied = 0

    def align_to(self, address: int) -> None:
        """Pad the file with zeros up to the next offset congruent to ``address`` modulo :data:`ALIGN_BYTES`,
        so that bytes at ``address`` written next go out straight from memory (at most 4095 bytes)."""
        pad = (address - self.size) % ALIGN_BYTES
        if pad:
            self.write(bytes(pad))

    def write(self, data: Any) -> int:
        """Hash ``data`` and write it: whole blocks straight from ``data`` where its address allows, the rest
        copied into the bounce buffers (each full one goes to the write thread)."""
        self._check_open()
        view = memoryview(data).cast("B")
        total = len(view)
        head = (-self.size) % ALIGN_BYTES  # bytes up to the next block boundary of the file
        body = (total - head) // ALIGN_BYTES * ALIGN_BYTES
        if total >= _SMALL_BYTES and body > 0 and (buffer_address(view) - self.size) % ALIGN_BYTES == 0:
            self._write_in_place(view, head, body)
        else:
            self._hash.update(view)
            self._copy_in(view)
        self.size += total
        return total

    def _write_in_place(self, view: memoryview, head: int, body: int) -> None:
        self._copy_in(view[:head])
        if self._filled:  # the bounce buffer now ends on a block boundary: out it goes
            self._hand_over()
        offset = self._submitted
        written = self._io.submit(self._write_at, view[head : head + body], offset)
        try:
            self._hash.update(view)  # in file order: the bytes before these were hashed as they were copied
        finally:
            written.result()  # the caller may change its memory once write returns
        self._submitted = offset + body
        self._copy_in(view[head + body :])

    def _copy_in(self, view: memoryview) -> None:
        while view:
            n = min(CHUNK_BYTES - self._filled, len(view))
            self._buffers[self._current][self._filled : self._filled + n] = view[:n]
            self._filled += n
            self.copied += n
            view = view[n:]
            if self._filled == CHUNK_BYTES:
                self._hand_over()

    def close(self) -> None:
        """Write what is left, wait for the writes, ``fsync`` and close; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            tail = memoryview(self._buffers[self._current])[: self._filled]
            self._in_flight.append((self._current, self._io.submit(self._write_tail, tail, self._submitted)))
            while self._in_flight:
                self._retire_oldest()
            self.digest = tagged(self.algorithm, self._hash.hexdigest())
        finally:
            self._io.shutdown(wait=True)
            os.close(self._fd)

    def _hand_over(self) -> None:
        """Give the current bounce buffer (full, or ending on a block boundary) to the write thread."""
        chunk = memoryview(self._buffers[self._current])[: self._filled]
        self._in_flight.append((self._current, self._io.submit(self._write_at, chunk, self._submitted)))
        self._submitted += self._filled
        if not self._free:
            self._retire_oldest()
        self._current = self._free.popleft()
        self._filled = 0

    def _retire_oldest(self) -> None:
        index, written = self._in_flight.popleft()
        written.result()  # a write error (disk full, I/O error) surfaces here, in the caller's thread
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


HashingFile = BufferedHashingFile | DirectHashingFile


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
