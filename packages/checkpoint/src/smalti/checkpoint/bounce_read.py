"""Reading checkpoint files front to back with ``O_DIRECT`` into reused huge-page buffers, on I/O threads.

The disk moves data far faster into memory on 2 MiB huge pages than into a tensor's scattered 4 KiB pages
(see :mod:`smalti.checkpoint.io.huge_pages`, and the README's performance section for the figures). So a
load reads each file in
:data:`CHUNK_BYTES` pieces into a few reused huge-page ("bounce") buffers: :class:`ReadPipeline`'s I/O
threads keep the next reads in flight (``preadv`` runs without the GIL) while the caller copies the bytes of
the current buffer into the tensors (a memory copy, several times the disk's speed) and feeds the file's
digest with every byte, in file order (:class:`FileStream`).

``O_DIRECT`` needs block-aligned offsets, lengths and buffer addresses: the pipeline reads whole aligned
blocks covering what is asked for (a file's last block comes back partial) and the stream hands out the
bytes asked for. Where a file system refuses ``O_DIRECT`` (tmpfs, some network file systems: ``EINVAL``)
the same reads go through the page cache.
"""

from __future__ import annotations

import collections
import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from smalti.checkpoint.errors import CheckpointError
from smalti.checkpoint.io import (
    BLOCK_BYTES,
    BOUNCE_POOL,
    CHUNK_BYTES,
    READ_FLAGS,
    chunk_ranges,
    huge_page_buffer,
    leave_direct_io,
    merge_ranges,
    open_maybe_direct,
)

#: reads in flight at once (one per I/O thread): the next ones are already queued at the disk when one ends
#: (a virtual disk that splits reads into 4 MiB requests reads faster the more it has queued: see the README)
DEFAULT_IO_THREADS = 3
#: read buffers of a pipeline (in flight, and read but not yet copied out of): at least 2 per I/O thread
DEFAULT_BUFFERS = 6
#: reads of at least this size let go of each buffer as soon as they have copied out of it
LARGE_READ_BYTES = 1 << 20


class _Job:
    """The reads of one file: its chunks, which are issued, and their results (by index)."""

    def __init__(self, path: Path, ranges: list[tuple[int, int]], chunk_bytes: int) -> None:
        self.path = path
        self.chunks = chunk_ranges(ranges, chunk_bytes)
        self.issued = 0
        self.in_flight = 0
        self.results: dict[int, tuple[int, memoryview] | BaseException] = {}
        self.last: int | None = None  # index of the chunk where the file ended (no chunk after it is read)
        self.cancelled = False
        self.fd: int | None = None
        self.direct = True

    def has_work(self) -> bool:
        return not self.cancelled and self.last is None and self.issued < len(self.chunks)


class ReadPipeline:
    """I/O threads reading the chunks of the files :meth:`open` is called for, in that order, each into one of
    ``buffers`` huge-page buffers of ``chunk_bytes``; a buffer is read into again once its stream lets go of it.
    The streams must be consumed (or cancelled) in the order they were opened.

    The threads start with the first :meth:`open` and end with :meth:`close`; they take the buffers as they
    first need them, from the process-wide pool the saves use (:data:`~smalti.checkpoint.io.BOUNCE_POOL`,
    so a load after a save maps no new memory), and :meth:`close` gives the free ones back.
    """

    def __init__(self, buffers: int | None = None, chunk_bytes: int = 0, io_threads: int = 0) -> None:
        chunk_bytes = chunk_bytes or CHUNK_BYTES
        io_threads = io_threads or DEFAULT_IO_THREADS
        buffers = buffers or DEFAULT_BUFFERS
        if chunk_bytes % BLOCK_BYTES or buffers < 2:
            raise ValueError(
                f"ReadPipeline needs 2 or more buffers of whole {BLOCK_BYTES}-byte blocks, got "
                f"{buffers} of {chunk_bytes}"
            )
        self.chunk_bytes = chunk_bytes
        # buffers of the pool's size are borrowed from it and given back at close; other sizes are mapped
        self._pool = BOUNCE_POOL if chunk_bytes == CHUNK_BYTES else None
        self._free: list[memoryview] = []
        # allocated by the I/O threads as they first need them: the first read starts after mapping 16 MiB, not
        # all of them, and the caller goes on meanwhile (mapping costs time: see the README's load path)
        self._unallocated = buffers
        self._jobs: collections.deque[_Job] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"smalti-ckpt-read-{i}", daemon=True)
            for i in range(max(io_threads, 1))
        ]
        self._started = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def open(
        self, path: Path, ranges: list[tuple[int, int]], feed: Callable[[int, memoryview], None] | None = None
    ) -> FileStream:
        """A stream of bytes ``ranges`` (``[start, end)``, any alignment) of ``path``; ``feed(offset, bytes)``
        gets every byte read, in order, once (a file's digest)."""
        job = _Job(path, merge_ranges(ranges), self.chunk_bytes)
        with self._cond:
            if self._closed:
                raise CheckpointError(f"reading {path}: the read pipeline is closed")
            self._jobs.append(job)
            if not self._started:
                self._started = True
                for thread in self._threads:
                    thread.start()
            self._cond.notify_all()
        return FileStream(self, job, feed)

    def close(self) -> None:
        """Stop the I/O threads (reads in flight finish first) and close the files still open."""
        with self._cond:
            self._closed = True
            for job in self._jobs:
                job.cancelled = True
            self._cond.notify_all()
        for thread in self._threads:
            if thread.is_alive():
                thread.join()
        for job in self._jobs:
            self._close_file(job)
        self._jobs.clear()
        if self._pool is not None:  # no thread reads into them any more
            self._pool.give(self._free)
            self._free = []

    # --- the I/O threads

    def _next(self) -> tuple[_Job, int, memoryview | None] | None:
        """Under the lock: the next chunk to read and a buffer for it (``None``: allocate one), waiting for
        both; ``None``: closed."""
        while True:
            if self._closed:
                return None
            while self._jobs and not self._jobs[0].has_work() and self._jobs[0].in_flight == 0:
                done = self._jobs.popleft()  # every chunk read (or the file ended, or cancelled)
                self._close_file(done)
            job = next((j for j in self._jobs if j.has_work()), None)
            if job is not None and (self._free or self._unallocated):
                if job.fd is None:
                    try:
                        job.fd, job.direct = open_maybe_direct(job.path, READ_FLAGS, direct=True)
                    except OSError as exc:
                        job.results[job.issued] = CheckpointError(
                            f"cannot read checkpoint file {job.path}: {exc}"
                        )
                        job.last = job.issued
                        self._cond.notify_all()
                        continue
                index = job.issued
                job.issued += 1
                job.in_flight += 1
                if self._free:
                    return job, index, self._free.pop()
                self._unallocated -= 1
                return job, index, None
            self._cond.wait()

    def _work(self) -> None:
        while True:
            with self._cond:
                task = self._next()
            if task is None:
                return
            job, index, buffer = task
            offset, length = job.chunks[index]
            result: tuple[int, memoryview] | BaseException
            try:
                if buffer is None:
                    pool = self._pool
                    buffer = pool.take(1)[0] if pool is not None else huge_page_buffer(self.chunk_bytes)
                result = (self._read(job, buffer[:length], offset), buffer)
            except Exception as exc:  # any failure reaches the reader, named; a dead thread would hang it
                result = CheckpointError(f"reading checkpoint file {job.path} at byte {offset}: {exc!r}")
            with self._cond:
                job.in_flight -= 1
                if isinstance(result, BaseException) or job.cancelled:
                    if buffer is None:
                        self._unallocated += 1
                    else:
                        self._free.append(buffer)
                if not job.cancelled:
                    job.results[index] = result
                    if isinstance(result, BaseException) or result[0] < length:
                        job.last = index if job.last is None else min(job.last, index)
                    for later in [i for i in job.results if job.last is not None and i > job.last]:
                        dropped = job.results.pop(later)  # read beside the one that found the file's end
                        if not isinstance(dropped, BaseException):
                            self._free.append(dropped[1])
                self._cond.notify_all()

    def _read(self, job: _Job, view: memoryview, offset: int) -> int:
        """Fill ``view`` from ``offset``: the bytes read (fewer only where the file ends)."""
        done = 0
        while done < len(view):
            fd, direct = job.fd, job.direct
            assert fd is not None
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not direct:
                    raise
                # O_DIRECT refused for this read: the page cache it is, for the rest of the file
                with self._cond:
                    if job.direct:
                        leave_direct_io(fd)
                        job.direct = False
                continue
            if n == 0:
                break
            done += n
            if job.direct and n % BLOCK_BYTES:
                break  # O_DIRECT returned a partial block: the file's end
        return done

    @staticmethod
    def _close_file(job: _Job) -> None:
        if job.fd is not None:
            os.close(job.fd)
            job.fd = None

    # --- for the streams

    def _result(self, job: _Job, index: int, deadline: float | None) -> tuple[int, memoryview] | None:
        """Chunk ``index``'s ``(bytes read, buffer)``, waiting for it; ``None`` past the file's end."""
        with self._cond:
            while index not in job.results:
                if job.last is not None and index > job.last or job.cancelled:
                    return None
                if self._closed:
                    raise CheckpointError(f"reading checkpoint file {job.path}: the read pipeline is closed")
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    raise CheckpointError(f"reading checkpoint file {job.path}: timed out")
                self._cond.wait(timeout)
            result = job.results[index]
            if isinstance(result, BaseException):
                raise result  # left in place: asking again raises it again
            del job.results[index]
        return result

    def _release(self, buffer: memoryview) -> None:
        with self._cond:
            self._free.append(buffer)
            self._cond.notify_all()

    def _cancel(self, job: _Job) -> None:
        with self._cond:
            job.cancelled = True
            for result in job.results.values():
                if not isinstance(result, BaseException):
                    self._free.append(result[1])
            job.results.clear()
            self._cond.notify_all()


class FileStream:
    """The bytes of one file as :class:`ReadPipeline` reads them, handed out by :meth:`read_into`. Offsets
    should mostly increase: each read lets go of the buffers that end before its start, and of those it has
    copied out of (a read under :data:`LARGE_READ_BYTES` keeps the one it started in); bytes asked for again
    after that, or outside the ranges the stream reads, are read from the file once more (page cache)."""

    def __init__(
        self, pipeline: ReadPipeline, job: _Job, feed: Callable[[int, memoryview], None] | None
    ) -> None:
        self.path = job.path
        self._pipeline = pipeline
        self._job = job
        self._feed = feed
        self._next_index = 0
        # (offset, bytes read, buffer) of the chunks taken and not handed back yet
        self._held: collections.deque[tuple[int, int, memoryview]] = collections.deque()
        self._released_to = 0  # the buffers of bytes below this offset are handed back
        self._ended = not job.chunks  # every chunk taken (or the file ended)
        self._fallback_fd: int | None = None
        #: ``time.monotonic()`` after which waiting for a read fails (``None``: no limit)
        self.deadline: float | None = None

    def read_into(self, offset: int, view: memoryview) -> int:
        """Copy bytes ``[offset, offset + len(view))`` of the file into ``view``; how many were copied (fewer
        where the file ends)."""
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        total = len(view)
        done = 0
        self._let_go_before(offset)
        # asked for again: from the file, up to where the stream's bytes take over
        if offset < self._released_to:
            upto = min(total, self._released_to - offset)
            done = self._pread(offset, view[:upto])
            if done < upto:
                return done
        large = total >= LARGE_READ_BYTES
        target = np.frombuffer(view, np.uint8)  # np.copyto lets go of the GIL (a memoryview copy would not)
        while done < total:
            at = offset + done
            chunk = self._chunk_holding(at, offset)
            if chunk is None:  # in no range the stream reads, or past the file's end
                return done + self._pread(at, view[done:])
            start, nbytes, buffer = chunk
            source = np.frombuffer(buffer, np.uint8)
            upto = min(total, start + nbytes - offset)
            begin = offset + done - start
            np.copyto(target[done:upto], source[begin : begin + upto - done])
            done = upto
            # a large read (a tensor's) lets go of every buffer it is done with; a small one (a peek at an item's
            # headers) keeps the one it started in, where the next read (the tensor's) most likely starts
            self._let_go_before(offset + done, None if large else offset)
        return done

    def drain(self) -> None:
        """Take (and feed) every byte left, copying nothing, and hand back every buffer."""
        while self._take():
            self._let_go_before(self._held[-1][0] + self._held[-1][1])
        self._let_go_before(1 << 62)

    def cancel(self) -> None:
        """Stop reading: the buffers go back to the pipeline, the rest of the file is not read."""
        while self._held:
            self._pipeline._release(self._held.popleft()[2])
        self._pipeline._cancel(self._job)
        self._ended = True
        self.close()

    def close(self) -> None:
        """Close the file opened for bytes asked for again (the stream's own reads are the pipeline's)."""
        if self._fallback_fd is not None:
            os.close(self._fallback_fd)
            self._fallback_fd = None

    # --- inside

    def _take(self) -> bool:
        """Take the next chunk from the pipeline into ``_held``; False where the file (or the ranges) ended."""
        if self._ended:
            return False
        index = self._next_index
        result = self._pipeline._result(self._job, index, self.deadline)
        if result is None:
            self._ended = True
            return False
        self._next_index += 1
        nbytes, buffer = result
        offset, length = self._job.chunks[index]
        self._held.append((offset, nbytes, buffer))
        if self._feed is not None:
            # here, in order, in this thread: a hash thread measured slower (1 GiB load, 11 interleaved rounds:
            # 0.476 s with one, 0.408 s without, 0.404 s with no hash at all)
            self._feed(offset, buffer[:nbytes])
        self._ended = nbytes < length or self._next_index == len(self._job.chunks)
        return True

    def _chunk_holding(self, at: int, floor: int) -> tuple[int, int, memoryview] | None:
        """The held chunk with byte ``at``, taking chunks up to it (handing back those before ``floor``);
        ``None`` where no chunk has it."""
        while True:
            for chunk in self._held:
                if chunk[0] <= at < chunk[0] + chunk[1]:
                    return chunk
            if self._held and at < self._held[-1][0] + self._held[-1][1]:
                return None  # between two ranges
            if not self._take():
                return None
            self._let_go_before(floor)

    def _let_go_before(self, offset: int, keep: int | None = None) -> None:
        """Hand back every held buffer whose bytes all lie before ``offset`` (but the one holding byte
        ``keep``)."""
        done = [
            c
            for c in self._held
            if c[0] + c[1] <= offset and not (keep is not None and c[0] <= keep < c[0] + c[1])
        ]
        if not done:
            return
        gone = {id(chunk) for chunk in done}
        self._held = collections.deque(c for c in self._held if id(c) not in gone)
        for chunk in done:
            self._pipeline._release(chunk[2])
        if not self._held or self._held[0][0] >= done[-1][0]:
            self._released_to = max(self._released_to, done[-1][0] + done[-1][1])

    def _pread(self, offset: int, view: memoryview) -> int:
        if self._fallback_fd is None:
            try:
                self._fallback_fd, _ = open_maybe_direct(self.path, READ_FLAGS, direct=False)
            except OSError as exc:
                raise CheckpointError(f"cannot read checkpoint file {self.path}: {exc}") from None
        done = 0
        while done < len(view):
            n = os.preadv(self._fallback_fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done
