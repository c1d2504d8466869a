"""DCP's file writer with sha256 computed while the bytes go out, and a reusable host-memory stager for async saves.

Hashing on the way out spares the manifest a second pass over every file, and a helper thread hashes each
buffer while it is being written; the digests are exact because DCP writes each file front to back
through one stream (offsets come from ``tell()``, never a seek).
While a file is written, ``sync_file_range`` starts the kernel's writeback of what is already written, so
the disk works while Python serialises and hashes the next bytes; ``fsync`` at the end still makes the file
durable before DCP reports the write done.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import AsyncStager

_WRITEBACK_CHUNK = 32 << 20
_SYNC_FILE_RANGE = getattr(os, "sync_file_range", None)
_SYNC_FILE_RANGE_WRITE = getattr(os, "SYNC_FILE_RANGE_WRITE", 2)


@contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """In this thread, turn off the CRC-32 that ``torch.save`` computes over every tensor's bytes.

    That checksum is a second pass over the data at about 1.6 GB/s, slower than the disk write itself, and
    the manifest's sha256 of every file covers the same bytes; ``torch.load`` reads such files as usual.
    torch keeps this setting per thread, so other threads' ``torch.save`` calls are unaffected.
    """
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = before


class _HashingStream:
    """A binary file opened for writing that feeds every byte written to a sha256 digest."""

    def __init__(self, raw: Any, hasher: ThreadPoolExecutor) -> None:
        self.raw = raw
        self._hasher = hasher
        self.digest = hashlib.sha256()
        self.size = 0
        self._flushed_to = 0
        try:
            self._fd: int | None = raw.fileno()
        except (AttributeError, OSError):
            self._fd = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        # Hash on the helper thread while this one writes the same (read-only) bytes: both release the GIL,
        # so a save costs max(write, hash) instead of their sum. Waiting before returning keeps the digest
        # in write order and the caller's buffer alive until both are done with it.
        hashed = self._hasher.submit(self.digest.update, view)
        written = 0
        try:
            while written < len(view):
                written += self.raw.write(view[written:])
        finally:
            hashed.result()
        self.size += written
        if self._fd is not None and _SYNC_FILE_RANGE is not None and self.size - self._flushed_to >= _WRITEBACK_CHUNK:
            self.raw.flush()
            try:
                _SYNC_FILE_RANGE(self._fd, self._flushed_to, self.size - self._flushed_to, _SYNC_FILE_RANGE_WRITE)
            except OSError:
                self._fd = None  # not supported here (some network file systems): leave writeback to fsync
            self._flushed_to = self.size
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def seekable(self) -> bool:
        return False  # a seek would make the running digest wrong

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()

    @property
    def closed(self) -> bool:
        return self.raw.closed


class HashingFileSystem(FileSystem):
    """DCP's local file system that records ``{file name: {"size", "sha256"}}`` of every file it writes.

    Renames (DCP writes ``.metadata`` through a temp name) carry the record to the new name.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        """Open ``path``; in a write mode, hash what is written (no zip CRC: see :func:`_without_zip_crc32`)
        and record it when the stream ends."""
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with (
            _without_zip_crc32(),
            super().create_stream(path, mode) as raw,
            ThreadPoolExecutor(1, "smalti-ckpt-hash") as hasher,
        ):
            stream = _HashingStream(raw, hasher)
            yield stream
        with self._lock:
            self.records[Path(path).name] = {"size": stream.size, "sha256": stream.digest.hexdigest()}

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """Rename a file and move its record along."""
        super().rename(path, new_path)
        with self._lock:
            record = self.records.pop(Path(path).name, None)
            if record is not None:
                self.records[Path(new_path).name] = record


class HashingFileSystemWriter(FileSystemWriter):
    """DCP's file writer with one file per rank (per thread), fsynced, hashing as it writes (see ``fs.records``)."""

    def __init__(self, folder: Path, thread_count: int = 1) -> None:
        super().__init__(str(folder), single_file_per_rank=True, sync_files=True, thread_count=thread_count)
        self.fs = HashingFileSystem()


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


class ReusedHostStager(AsyncStager):
    """Copies a state dict into host buffers allocated once and reused by every later save of the same layout.

    The copy is the only part of an async save the training loop waits for. Buffers are pinned when CUDA is
    available (fast device-to-host copies). The caller must not stage again before the previous write is
    done (the :class:`~smalti.checkpoint.Checkpointer` waits for the previous save first).
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._cache: Any = None
        self._layout: Any = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into the cached host buffers (allocating them on first use or a layout change)."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = _layout(state_dict)
        if self._cache is None or layout != self._layout:
            self._cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._layout = layout
        return _copy_state_dict(state_dict, self._cache, non_blocking=False)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies synchronously."""

    def close(self) -> None:
        """Drop the host buffers."""
        self._cache = None
        self._layout = None
