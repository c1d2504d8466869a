"""DCP's file writer with each file's digest computed while the bytes go out, and a reusable host-memory stager
for async saves.

Every file DCP writes goes through a hashing file (:func:`~smalti.checkpoint.hashing_file.open_hashing_file`):
hashed on the way out (the manifest needs no second pass over the data), written from the tensors' own memory
through the page cache, or with direct I/O when asked. The digests are exact because DCP writes each file
front to back through one stream (offsets come from ``tell()``, never a seek).

The files are DCP's own (its ``FileSystemWriter`` lays them out; its ``FileSystemReader`` loads them): only
the file object under them differs, and what an entry costs. DCP stores every tensor as a ``torch.save`` archive
of its own, and ``torch.save`` costs ~0.2-1 ms of Python per call and makes ~39 small writes (headers, pickle,
padding, central directory), whatever the tensor's size: a checkpoint of many small tensors (LoRA adapters
with their AdamW state) paid per entry, not per byte. :meth:`HashingFileSystemWriter.write_data` writes the
same archives with :func:`~smalti.checkpoint.tensor_records.save_tensor` (torch.save's records replayed
through torch's zip writer, checked byte-identical per layout), and entries up to :data:`GATHER_BYTES` are
serialised in memory and reach the file in one write. With direct I/O that object copies every byte into reused huge-page
buffers that a helper thread writes with ``O_DIRECT`` (see :mod:`smalti.checkpoint.hashing_file` for why a
copy is faster than writing from the tensors' own pages).
"""

from __future__ import annotations

import io
import math
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import WriteResult

from smalti.checkpoint._compat import StorageInfo, split_by_size_and_type
from smalti.checkpoint.hashes import DEFAULT_ALGORITHM
from smalti.checkpoint.hashing_file import open_hashing_file
from smalti.checkpoint.tensor_records import save_tensor


@contextmanager
def _torch_save_settings() -> Iterator[None]:
    """In this thread, turn off the CRC-32 that ``torch.save`` computes over every tensor's bytes.

    That checksum is a second pass over the data, slower than the disk write itself (see the README's
    performance section), and the manifest's digest of every file covers the same bytes; ``torch.load`` reads such files as usual.
    torch keeps these settings per thread, so other threads' ``torch.save`` calls are unaffected.
    """
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = before


#: tensor entries up to this many bytes are serialised in memory and written to the file in one call
GATHER_BYTES = 1 << 20
#: DCP's data file suffix
DATA_SUFFIX = ".distcp"


def _entry_bytes(item: WriteItem) -> int:
    """The bytes of a tensor entry's data."""
    assert item.tensor_data is not None
    return math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize


def _on_a_device(planner: SavePlanner, item: WriteItem) -> bool:
    """Whether entry ``item`` is a tensor held off the host (a GPU's), without copying it."""
    return item.type != WriteItemType.BYTE_IO and planner.resolve_data(item).device.type != "cpu"


def _host_tensor(planner: SavePlanner, item: WriteItem) -> torch.Tensor:
    """Entry ``item``'s tensor on the host with a storage of its own size, as DCP's writer serialises it."""
    tensor = planner.resolve_data(item).detach().cpu()
    if tensor.untyped_storage().size() != tensor.nbytes:
        tensor = tensor.clone()  # torch.save writes the whole storage: not the rest of a larger one
    return tensor


class HashingFileSystem(FileSystem):
    """DCP's local file system that records ``{file name: {"size", "hash"}}`` of every file it writes.

    Renames (DCP writes ``.metadata`` through a temp name) carry the record to the new name.
    """

    def __init__(self, direct_io: bool = False, algorithm: str = DEFAULT_ALGORITHM) -> None:
        super().__init__()
        self.direct_io = direct_io
        self.algorithm = algorithm
        self.records: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        """Open ``path``; in a write mode, a hashing file (durable when closed, no zip CRC: see
        :func:`_torch_save_settings`) whose size and digest are recorded when the stream ends."""
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with _torch_save_settings(), open_hashing_file(path, self.direct_io, self.algorithm) as stream:
            yield stream
        with self._lock:
            self.records[Path(path).name] = {"size": stream.size, "hash": stream.digest}

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """Rename a file and move its record along."""
        super().rename(path, new_path)
        with self._lock:
            record = self.records.pop(Path(path).name, None)
            if record is not None:
                self.records[Path(new_path).name] = record


class HashingFileSystemWriter(FileSystemWriter):
    """DCP's file writer with one file per rank (per thread), hashing as it writes (see ``fs.records``).

    Every file is fsynced by its hashing file when closed, so DCP's own ``sync_files`` (an fsync before the
    last buffered bytes are written) is off. Its files and metadata are byte for byte those of DCP's
    ``FileSystemWriter`` (with the zip CRC off), written at a lower cost per entry (:meth:`write_data`).
    """

    def __init__(
        self, folder: Path, thread_count: int = 1, direct_io: bool = False, algorithm: str = DEFAULT_ALGORITHM
    ) -> None:
        super().__init__(str(folder), single_file_per_rank=True, sync_files=False, thread_count=thread_count)
        self.fs = HashingFileSystem(direct_io, algorithm)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        """Write this rank's entries as DCP's ``FileSystemWriter`` does (the same files, one per thread, the
        same archives at the same offsets, byte entries first), with each tensor's archive written by
        :func:`~smalti.checkpoint.tensor_records.save_tensor` and each small one in a single write."""
        if any(_on_a_device(planner, item) for item in plan.items):
            # DCP's own loop copies the next device tensor to the host while it writes this one; this loop would
            # copy them one at a time. Host tensors (CPU training, async saves' staged copies) take this loop.
            return super().write_data(plan, planner)
        prefix = plan.storage_data.prefix
        files = [(f"{prefix}{i}{DATA_SUFFIX}", bucket)
                 for i, bucket in enumerate(split_by_size_and_type(self.thread_count, plan.items))]
        if len(files) == 1:
            written = [self._write_file(planner, *files[0])]
        else:
            with ThreadPoolExecutor(len(files), "smalti-ckpt-file") as pool:
                written = list(pool.map(lambda file: self._write_file(planner, *file), files))
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result([result for results in written for result in results])
        return done

    def _write_file(self, planner: SavePlanner, name: str, items: list[WriteItem]) -> list[WriteResult]:
        results = []
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            for item in [i for i in items if i.type == WriteItemType.BYTE_IO]:
                offset = stream.tell()
                stream.write(planner.resolve_data(item).getbuffer())
                results.append(_result(item, name, offset, stream.tell() - offset))
            for item in [i for i in items if i.type != WriteItemType.BYTE_IO]:
                tensor = _host_tensor(planner, item)
                offset = stream.tell()
                if _entry_bytes(item) <= GATHER_BYTES:
                    record = io.BytesIO()
                    save_tensor(tensor, record)
                    with record.getbuffer() as view:
                        stream.write(view)
                else:
                    save_tensor(tensor, stream)  # its data goes out in one large write, from its own memory
                results.append(_result(item, name, offset, stream.tell() - offset))
        return results


def _result(item: WriteItem, file_name: str, offset: int, length: int) -> WriteResult:
    """DCP's record of where entry ``item`` went."""
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=StorageInfo(file_name, offset, length))


def _layout(state_dict: Any) -> Any:
    """The structure, shapes and dtypes of a state dict's tensors: what a cached staging buffer must match."""
    if isinstance(state_dict, dict):
        return tuple((k, _layout(v)) for k, v in state_dict.items())
    if isinstance(state_dict, (list, tuple)):
        return tuple(_layout(v) for v in state_dict)
    if isinstance(state_dict, torch.Tensor):
        local = state_dict.to_local() if hasattr(state_dict, "to_local") else state_dict
        return ("T", tuple(local.shape), local.dtype, type(state_dict).__name__)
    return type(state_dict).__name__


def _pair_up(source: Any, buffers: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """The staged state dict (``buffers``' tensors, ``source``'s other values); ``(source, buffer)`` tensor
    pairs to copy are appended to ``pairs``."""
    if isinstance(source, torch.Tensor):
        if hasattr(source, "to_local"):  # DTensor: copy the local shard into the buffer DTensor's shard
            pairs.append((source._local_tensor, buffers._local_tensor))
        else:
            pairs.append((source, buffers))
        return buffers
    if isinstance(source, dict):
        return {key: _pair_up(value, buffers[key], pairs) for key, value in source.items()}
    if isinstance(source, (list, tuple)):
        staged = [_pair_up(value, buffers[i], pairs) for i, value in enumerate(source)]
        return tuple(staged) if isinstance(source, tuple) else staged
    return source


def storage_key(tensor: torch.Tensor) -> int:
    """What identifies a tensor's memory (its storage's address), for :attr:`ReusedHostStager.deferrable`."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().data_ptr()


class ReusedHostStager(AsyncStager):
    """Copies a state dict into host buffers allocated once and reused by every later save of the same layout.

    Buffers are pinned when CUDA is available (fast device-to-host copies). With ``background=True``, the
    tensors whose storage is in :attr:`deferrable` (the caller sets it before each save to the parameters
    and optimizer state, which only an optimizer step changes) are copied on a helper thread while the
    training loop goes on with its next forward and backward; :meth:`wait_for_staging` must be called
    before anything changes them (the :class:`~smalti.checkpoint.Checkpointer` calls it from an optimizer
    step pre-hook and ahead of the events where plugins may touch weights). Every other tensor (buffers,
    which a forward may update) is copied before :meth:`stage` returns. The caller must not stage again
    before the previous write is done (the Checkpointer waits for the previous save first).
    """

    _synchronize_after_execute = False

    def __init__(self, background: bool = False) -> None:
        self._cache: Any = None
        self._layout: Any = None
        self._executor = ThreadPoolExecutor(1, "smalti-ckpt-stage") if background else None
        self._pending: Future[Any] | None = None
        self._stream: Any = None
        #: storage keys (:func:`storage_key`) of the tensors that may be copied in the background
        self.deferrable: set[int] = set()

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | Future[dict[str, Any]]:
        """Copy ``state_dict`` into the cached host buffers (allocating them on first use or a layout change);
        a future of the staged dict when part of the copy runs in the background."""
        from smalti.checkpoint._compat import create_cpu_state_dict

        self.wait_for_staging()
        layout = _layout(state_dict)
        if self._cache is None or layout != self._layout:
            self._cache = create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._layout = layout
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged = _pair_up(state_dict, self._cache, pairs)
        later = [pair for pair in pairs if self._executor is not None and storage_key(pair[0]) in self.deferrable]
        deferred = {id(source) for source, _ in later}
        for source, buffer in pairs:
            if id(source) not in deferred:
                buffer.copy_(source)
        if not later:
            return staged
        ready = None
        if any(source.is_cuda for source, _ in later):
            ready = torch.cuda.Event()
            ready.record()  # the copies must see what the training stream has computed so far
        assert self._executor is not None
        self._pending = self._executor.submit(self._copy, later, ready, staged)
        return self._pending

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], ready: Any, staged: Any) -> Any:
        if ready is None:
            for source, buffer in pairs:
                buffer.copy_(source)
            return staged
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            for source, buffer in pairs:
                buffer.copy_(source, non_blocking=True)
        self._stream.synchronize()
        return staged

    def wait_for_staging(self) -> float:
        """Block until the background copy (if any) is done; the seconds waited. Re-raises its error."""
        pending, self._pending = self._pending, None
        if pending is None:
            return 0.0
        start = time.perf_counter()
        already_done = pending.done()
        pending.result()
        return 0.0 if already_done else time.perf_counter() - start

    def synchronize_staging(self) -> None:
        """Wait for the background copy (DCP calls this only when :meth:`stage` returned no future)."""
        self.wait_for_staging()

    def close(self) -> None:
        """Wait for any copy in flight, then drop the host buffers and the helper thread."""
        self.wait_for_staging()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._cache = None
        self._layout = None
