"""Reading checkpoint files ahead of the load, front to back, hashing every byte once on the way in.

A load has work to do before DCP asks for any tensor bytes (reading ``.metadata``, building the state dict,
creating the optimizer's state), and DCP's own reader then reads item by item through the page cache, with
the digest check of the same files as a second pass. :class:`ReadAhead` starts reading this rank's files
as soon as the checkpoint is chosen, in a background thread, with ``O_DIRECT`` where the file system
allows it (no page-cache copy for the CPU to make), and feeds every chunk to the file's hash (the algorithm
its manifest entry names) on one hash thread, so the next read is under way while a chunk is hashed. What it
read waits in memory (up to ``window_bytes`` ahead of the loader) until :class:`ReadAheadFileSystemReader`
hands it to DCP: the disk works while the trainer builds its state, and each byte is read from the disk
once, for both the load and the check. Tensors are copied from those buffers straight into their targets.

Files this rank loads but another rank reads ahead (and checks) are read by :class:`ReadAheadFileSystemReader`
the same way, item by item: each tensor's bytes go from the file straight into its target, without
``torch.load``'s allocation and copies.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import io
import mmap
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from smalti.checkpoint.errors import CheckpointCorruptError, CheckpointError
from smalti.checkpoint.hashes import check_algorithm, new_hasher
from smalti.checkpoint.hashing_file import ALIGN_BYTES, CHUNK_BYTES, leave_direct_io, open_maybe_direct
from smalti.checkpoint.safe_load import SafeFileSystemReader

#: how far ahead of the loader the reader may get, per rank, unless told otherwise
DEFAULT_WINDOW_BYTES = 64 << 20


@dataclasses.dataclass
class AheadFile:
    """One file to read ahead: its path relative to the checkpoint folder, its size from the manifest, and the
    digest to check it against as the manifest spells it, ``"<algorithm>:<hex>"`` (``None``: read it, do not
    hash it)."""

    relpath: str
    size: int
    hash: str | None = None


class _Chunk:
    __slots__ = ("start", "buffer", "address", "length", "hashed", "taken")

    def __init__(self, start: int, buffer: mmap.mmap, length: int) -> None:
        self.start = start
        self.buffer = buffer
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        self.length = length
        self.hashed = False
        self.taken = False

    @property
    def end(self) -> int:
        return self.start + self.length


class _Held:
    """What has been read of one file and is kept for the loader."""

    def __init__(self) -> None:
        self.chunks: deque[_Chunk] = deque()
        self.read_to = 0  # bytes read from the start of the file
        self.finished = False  # every byte read (or reading stopped on an error)
        self.keep = True  # False once the loader needs nothing more of this file
        self.error: Exception | None = None


class ReadAhead:
    """Reads ``files`` of ``folder`` in order, in a background thread, checking each one's digest (where given).

    The loader takes byte ranges with :meth:`span` (waiting for the reader where it must) and gives files up
    with :meth:`done_with`; :meth:`finish` stops keeping anything and waits for the last hash.
    """

    def __init__(
        self,
        folder: Path,
        files: list[AheadFile],
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        direct: bool = True,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        if chunk_bytes <= 0 or chunk_bytes % ALIGN_BYTES:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of {ALIGN_BYTES} (direct I/O)")
        self.folder = folder
        self.files = {f.relpath: f for f in files}
        self.order = [f.relpath for f in files]
        self.chunk_bytes = chunk_bytes
        self.window_bytes = max(window_bytes, chunk_bytes)
        self.direct = direct
        self._held = {rel: _Held() for rel in self.order}
        self._cond = threading.Condition()
        self._bytes_held = 0
        self._demand: tuple[str, int] | None = None  # (file, offset) the loader is waiting for
        self._free: list[mmap.mmap] = []
        for f in files:  # an algorithm missing here fails now, in the caller's thread, naming the fix
            if f.hash is not None:
                check_algorithm(f.hash.partition(":")[0], f"the manifest entry of {folder / f.relpath}")
        self._hasher = ThreadPoolExecutor(1, "smalti-ckpt-read-hash")
        self._problems: dict[str, Exception] = {}
        self.done: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, name="smalti-ckpt-read-ahead", daemon=True)
        self._thread.start()

    # -- the loader's side -------------------------------------------------------------------------------------
    def bytes_read(self, relpath: str) -> int:
        """How much of ``relpath`` has been read from the disk so far."""
        return self._held[relpath].read_to

    def holds(self, relpath: str) -> bool:
        """Whether ``relpath`` is being read ahead (the loader must then take its bytes from here)."""
        return relpath in self._held

    def span(self, relpath: str, start: int, end: int) -> io.RawIOBase:
        """A read-only file over bytes ``[start, end)`` of ``relpath``, once read (blocks until then)."""
        held = self._held[relpath]
        with self._cond:
            self._demand = (relpath, end)
            self._cond.notify_all()
            while held.read_to < end and not held.finished:
                self._cond.wait()
            self._demand = None
            if held.read_to < end:
                raise held.error or CheckpointCorruptError(
                    f"checkpoint file {self.folder / relpath} ends at byte {held.read_to}, before the item at "
                    f"{start}..{end} DCP's metadata points to (truncated)", str(self.folder / relpath)
                )
            if not held.keep:
                raise CheckpointError(f"{relpath} was given up before bytes {start}..{end} were taken")
            chunks = [c for c in held.chunks if c.end > start and c.start < end]
        return _Span(chunks, start, end)

    def release_before(self, relpath: str, offset: int) -> None:
        """The loader needs no byte of ``relpath`` before ``offset`` any more."""
        with self._cond:
            held = self._held[relpath]
            while held.chunks and held.chunks[0].end <= offset:
                self._take(held.chunks.popleft())
            self._cond.notify_all()

    def done_with(self, relpath: str) -> None:
        """The loader needs nothing more of ``relpath``: what is held of it is let go, the rest only hashed."""
        with self._cond:
            held = self._held[relpath]
            held.keep = False
            while held.chunks:
                self._take(held.chunks.popleft())
            self._cond.notify_all()

    def finish(self, timeout: float | None = None) -> None:
        """Let go of everything held, wait until every file is read and hashed, and raise the first problem
        (in file order): :class:`CheckpointCorruptError` for a bad file, else the I/O error met."""
        for relpath in self.order:
            self.done_with(relpath)
        self.done.result(timeout=timeout)
        for relpath in self.order:
            if relpath in self._problems:
                raise self._problems[relpath]

    # -- the reading side ---------------------------------------------------------------------------------------
    def _take(self, chunk: _Chunk) -> None:
        chunk.taken = True
        self._maybe_free(chunk)

    def _maybe_free(self, chunk: _Chunk) -> None:
        if chunk.taken and chunk.hashed:
            self._recycle(chunk.buffer)

    def _recycle(self, buffer: mmap.mmap) -> None:
        """Put ``buffer`` back on the free list and out of the window (the caller holds the lock)."""
        self._bytes_held -= len(buffer)
        self._free.append(buffer)
        self._cond.notify_all()

    def _run(self) -> None:
        try:
            for relpath in self.order:
                self._read_file(relpath, self._hasher)
            self._hasher.shutdown(wait=True)
            self.done.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - a bug here must reach the loader, not die with the thread
            self._hasher.shutdown(wait=True)
            with self._cond:
                for held in self._held.values():
                    held.finished = True
                    held.error = held.error or exc
                self._cond.notify_all()
            self.done.set_exception(exc)

    def _buffer(self, relpath: str, held: _Held) -> mmap.mmap:
        """A free chunk buffer, once the window has room (or the loader waits for bytes of this file)."""
        with self._cond:
            while True:
                demanded = self._demand is not None and self._demand[0] == relpath and self._demand[1] > held.read_to
                if self._bytes_held + self.chunk_bytes <= self.window_bytes or demanded or not held.keep:
                    break
                self._cond.wait()
            self._bytes_held += self.chunk_bytes
            return self._free.pop() if self._free else mmap.mmap(-1, self.chunk_bytes)

    def _read_file(self, relpath: str, hasher: ThreadPoolExecutor) -> None:
        held, expected = self._held[relpath], self.files[relpath]
        path = self.folder / relpath
        digest = new_hasher(expected.hash.partition(":")[0]) if expected.hash is not None else None
        try:
            fd, direct = open_maybe_direct(path, os.O_RDONLY, self.direct)
        except OSError as exc:
            self._fail(relpath, held, CheckpointError(f"cannot read checkpoint file {path}: {exc}"))
            return
        offset = 0
        try:
            while True:
                buffer = self._buffer(relpath, held)
                try:
                    n, direct = _read_at(fd, buffer, offset, direct)
                except OSError as exc:
                    self._give_back(buffer)
                    self._fail(relpath, held, CheckpointError(f"reading checkpoint file {path}: {exc}"))
                    return
                if n == 0:
                    self._give_back(buffer)
                    break
                chunk = _Chunk(offset, buffer, n)
                if digest is not None:
                    hasher.submit(self._hash, digest, chunk)
                else:
                    chunk.hashed = True
                with self._cond:
                    held.read_to = offset + n
                    if held.keep:
                        held.chunks.append(chunk)
                    else:
                        self._take(chunk)
                    self._cond.notify_all()
                offset += n
        finally:
            os.close(fd)
            with self._cond:
                held.finished = True
                self._cond.notify_all()
        # queued behind this file's last chunk: the hasher has seen every byte when it runs
        hasher.submit(self._conclude, relpath, offset, digest)

    def _conclude(self, relpath: str, size: int, digest: Any) -> None:
        path, expected = self.folder / relpath, self.files[relpath]
        if size != expected.size:
            self._problems[relpath] = CheckpointCorruptError(
                f"checkpoint file {path} has {size} bytes but the manifest says {expected.size}", str(path)
            )
        elif digest is not None and expected.hash is not None:
            algorithm, _, hexdigest = expected.hash.partition(":")
            if digest.hexdigest() != hexdigest:
                self._problems[relpath] = CheckpointCorruptError(
                    f"checkpoint file {path} has {algorithm} {digest.hexdigest()[:16]}… but the manifest says "
                    f"{hexdigest[:16]}… (corrupted)", str(path)
                )

    def _give_back(self, buffer: mmap.mmap) -> None:
        with self._cond:
            self._recycle(buffer)

    def _hash(self, digest: Any, chunk: _Chunk) -> None:
        digest.update(memoryview(chunk.buffer)[: chunk.length])
        with self._cond:
            chunk.hashed = True
            self._maybe_free(chunk)

    def _fail(self, relpath: str, held: _Held, error: Exception) -> None:
        self._problems[relpath] = error
        with self._cond:
            held.error = error
            held.finished = True
            self._cond.notify_all()


def _read_at(fd: int, buffer: mmap.mmap, offset: int, direct: bool) -> tuple[int, bool]:
    """Fill ``buffer`` from ``offset`` (short only at the end of the file); returns bytes read and whether
    the file is still read with ``O_DIRECT``."""
    view = memoryview(buffer)
    total = 0
    while total < len(view):
        try:
            n = os.preadv(fd, [view[total:]], offset + total)
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                raise
            leave_direct_io(fd)
            direct = False
            continue
        if n == 0:
            break
        total += n
        if direct and n % ALIGN_BYTES:
            break  # a short direct read: the end of the file
    return total, direct


class _Window(io.RawIOBase):
    """A seekable read-only file over bytes ``[start, end)`` of a file; subclasses say where the bytes come from."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__()
        self._start = start
        self._end = end
        self._pos = start

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos - self._start

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: self._start, os.SEEK_CUR: self._pos, os.SEEK_END: self._end}[whence]
        self._pos = min(max(base + offset, self._start), self._end)
        return self.tell()


class _Span(_Window):
    """A window over the read-ahead chunks that hold its bytes."""

    def __init__(self, chunks: list[_Chunk], start: int, end: int) -> None:
        super().__init__(start, end)
        self._chunks = chunks

    def copy_to(self, target: torch.Tensor, offset: int) -> None:
        """Copy ``target.numel()`` bytes from ``offset`` (within the span) into the uint8 tensor ``target``
        (on any device), piece by piece from the chunks."""
        begin, end = self._start + offset, self._start + offset + target.numel()
        if end > self._end:
            raise CheckpointError(f"bytes {offset}..{end - self._start} lie outside a span of {self._end - self._start}")
        copied = 0
        for chunk in self._chunks:
            lo, hi = max(begin, chunk.start), min(end, chunk.end)
            if lo >= hi:
                continue
            piece = torch.frombuffer(memoryview(chunk.buffer)[lo - chunk.start : hi - chunk.start], dtype=torch.uint8)
            target[lo - begin : hi - begin].copy_(piece)
            copied += hi - lo
        if copied != end - begin:
            raise CheckpointError(f"bytes {offset}..{end - self._start} of a span were let go before they were read")

    def readinto(self, target: Any) -> int:
        out = memoryview(target).cast("B")
        if not len(out):
            return 0
        if out.readonly:
            raise ValueError("readinto needs a writable buffer")
        target_address = ctypes.addressof(ctypes.c_char.from_buffer(out))
        done = 0
        for chunk in self._chunks:
            if self._pos >= self._end or done == len(out):
                break
            if chunk.end <= self._pos:
                continue
            at = self._pos - chunk.start
            if at < 0:
                raise CheckpointError(f"bytes {self._pos}..{chunk.start} were let go before they were read")
            n = min(chunk.length - at, len(out) - done, self._end - self._pos)
            # ctypes calls run without the GIL: the read-ahead thread keeps the disk busy during large copies
            ctypes.memmove(target_address + done, chunk.address + at, n)
            done += n
            self._pos += n
        return done


class _FileSpan(_Window):
    """A window over an open file, read with ``pread`` (for the files this rank loads but does not read ahead);
    :meth:`copy_to` reads a tensor's bytes straight into it."""

    def __init__(self, fd: int, start: int, end: int, path: Path) -> None:
        super().__init__(start, end)
        self._fd = fd
        self._path = path

    def copy_to(self, target: torch.Tensor, offset: int) -> None:
        """Read ``target.numel()`` bytes from ``offset`` (within the span) into the uint8 tensor ``target``."""
        begin = self._start + offset
        if begin + target.numel() > self._end:
            raise CheckpointError(f"bytes {offset}..{offset + target.numel()} lie outside a span of {self._end - self._start}")
        host = target if target.device.type == "cpu" else torch.empty(target.shape, dtype=torch.uint8)
        view = memoryview(host.numpy()).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], begin + done)
            if n == 0:
                raise CheckpointCorruptError(
                    f"checkpoint file {self._path} ends at byte {begin + done}, before the item at "
                    f"{self._start}..{self._end} DCP's metadata points to (truncated)", str(self._path)
                )
            done += n
        if host is not target:
            target.copy_(host)

    def readinto(self, target: Any) -> int:
        out = memoryview(target).cast("B")[: self._end - self._pos]
        if not len(out):
            return 0
        n = os.preadv(self._fd, [out], self._pos)
        self._pos += n
        return n


class ReadAheadFileSystemReader(SafeFileSystemReader):
    """DCP's file reader taking the bytes of the files a :class:`ReadAhead` holds from it (in its file order,
    items by offset); other files are read item by item with ``pread``, tensors straight into their targets.
    ``.metadata`` is read without running code from it (see :mod:`smalti.checkpoint.safe_load`;
    ``trust_pickles`` lifts that)."""

    def __init__(self, path: str | os.PathLike[str], read_ahead: ReadAhead | None, trust_pickles: bool = False) -> None:
        super().__init__(path, trust_pickles)
        self.read_ahead = read_ahead
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's ``.metadata``, unpickled once per reader (through the restricted unpickler): the load reads it
        before DCP does (to check the keys and make the optimizer's state), and on a large run it is the biggest
        file every rank reads whole."""
        if args or kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata()
        self._metadata.storage_meta.load_id = self.load_id  # DCP's reset() gives each load its own id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        ahead = self.read_ahead
        if ahead is None:
            return self._read_directly(plan.items, planner)
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        try:
            for relpath in ahead.order:
                if relpath not in per_file:
                    ahead.done_with(relpath)
            for relpath in ahead.order:
                for item in sorted(per_file.get(relpath, ()), key=lambda i: self.storage_data[i.storage_index].offset):
                    info = self.storage_data[item.storage_index]
                    span = ahead.span(relpath, info.offset, info.offset + info.length)
                    self._load_item(item, info, span, planner)
                    ahead.release_before(relpath, info.offset + info.length)
                ahead.done_with(relpath)
        finally:
            for relpath in ahead.order:
                ahead.done_with(relpath)
        rest = [item for item in plan.items if not ahead.holds(self.storage_data[item.storage_index].relative_path)]
        return self._read_directly(rest, planner)

    def _read_directly(self, items: list[Any], planner: LoadPlanner) -> torch.futures.Future[None]:
        """Load ``items`` from files no read-ahead holds (another rank reads them ahead and checks them): each
        file opened once, its items in offset order, tensors read straight into their targets where the
        layouts allow (as from the read-ahead's buffers), else as DCP's reader would."""
        per_file: dict[str, list[Any]] = {}
        for item in items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relpath, file_items in per_file.items():
            path = Path(self.path) / relpath
            with open(path, "rb", buffering=0) as f:
                for item in sorted(file_items, key=lambda i: self.storage_data[i.storage_index].offset):
                    info = self.storage_data[item.storage_index]
                    self._load_item(item, info, _FileSpan(f.fileno(), info.offset, info.offset + info.length, path), planner)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _load_item(self, item: Any, info: Any, span: _Span | _FileSpan, planner: LoadPlanner) -> None:
        """What DCP's reader does with one item's bytes: hand them over, or load the tensor into its target."""
        stream = self.transforms.transform_load_stream(item, info.transform_descriptors or (), span)
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(stream.read(-1)))
            return
        if stream is span:
            if self._copy_in_place(item, span, planner):
                return
            span.seek(0)
        if not stream.seekable():
            stream = io.BytesIO(stream.read(-1))
        tensor = torch.load(stream, map_location="cpu", weights_only=True)
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointError(f"item {item.storage_index} has size {tuple(tensor.size())}, its target {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    @staticmethod
    def _copy_in_place(item: Any, span: _Span | _FileSpan, planner: LoadPlanner) -> bool:
        """Copy the item's tensor bytes from the read-ahead buffers straight into its target; False (nothing
        done) where the layouts do not allow it, and ``torch.load`` takes over.

        ``torch.load`` would allocate a new tensor (fresh pages the kernel must zero and map) and copy into it,
        then DCP copies that into the target: two copies and an allocation, the largest CPU cost of a load.
        Here only the pickle is read (with its storages on the meta device, to learn dtype, shape, strides and
        offset), and when the (narrowed) saved tensor and the target are both contiguous with the same dtype
        and shape, the bytes are copied from the buffers into the target, one copy.
        """
        from torch import _weights_only_unpickler

        try:
            archive = torch._C.PyTorchFileReader(span)
            if archive.has_record("byteorder") and archive.get_record("byteorder") != b"little":
                return False
            keys: list[str] = []

            def storage_on_meta(saved_id: Any) -> Any:
                _, storage_type, key, _, numel = saved_id
                keys.append(key)
                dtype = storage_type.dtype
                untyped = torch.UntypedStorage(numel * torch._utils._element_size(dtype), device="meta")
                return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

            unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(archive.get_record("data.pkl")), encoding="utf-8")
            unpickler.persistent_load = storage_on_meta
            saved = unpickler.load()
            if not isinstance(saved, torch.Tensor) or len(keys) != 1:
                return False
            saved = narrow_tensor_by_index(saved, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if not (saved.is_contiguous() and target.is_contiguous() and saved.dtype == target.dtype
                    and saved.size() == target.size()):
                return False
            record = f"data/{keys[0]}"
            record_start = archive.get_record_offset(record)
            start = record_start + saved.storage_offset() * saved.element_size()
            nbytes = saved.numel() * saved.element_size()
            if start + nbytes > record_start + archive.get_record_size(record):
                return False
        except Exception:  # noqa: BLE001 - anything unexpected: torch.load reads the item as DCP would
            return False
        if nbytes:
            span.copy_to(target.reshape(-1).view(torch.uint8), start)
        planner.commit_tensor(item, target)
        return True
