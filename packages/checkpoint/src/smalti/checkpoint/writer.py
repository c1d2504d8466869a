"""DCP's file writer with sha256 computed while the bytes go out, and a reusable host-memory stager for async saves.

Every file DCP writes goes through a :class:`~smalti.checkpoint.hashing_file.HashingFile`: hashed on the way
out (the manifest needs no second pass over the data) and written with direct I/O where possible. The
digests are exact because DCP writes each file front to back through one stream (offsets come from
``tell()``, never a seek).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import AsyncStager

from smalti.checkpoint.hashing_file import HashingFile


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


class HashingFileSystem(FileSystem):
    """DCP's local file system that records ``{file name: {"size", "sha256"}}`` of every file it writes.

    Renames (DCP writes ``.metadata`` through a temp name) carry the record to the new name.
    """

    def __init__(self, direct_io: bool = True) -> None:
        super().__init__()
        self.direct_io = direct_io
        self.records: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        """Open ``path``; in a write mode, a :class:`HashingFile` (durable when closed, no zip CRC: see
        :func:`_without_zip_crc32`) whose size and sha256 are recorded when the stream ends."""
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with _without_zip_crc32(), HashingFile(path, direct=self.direct_io) as stream:
            yield stream
        with self._lock:
            self.records[Path(path).name] = {"size": stream.size, "sha256": stream.sha256}

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """Rename a file and move its record along."""
        super().rename(path, new_path)
        with self._lock:
            record = self.records.pop(Path(path).name, None)
            if record is not None:
                self.records[Path(new_path).name] = record


class HashingFileSystemWriter(FileSystemWriter):
    """DCP's file writer with one file per rank (per thread), hashing as it writes (see ``fs.records``).

    Every file is fsynced by its :class:`HashingFile` when closed, so DCP's own ``sync_files`` (an fsync
    before the last buffered bytes are written) is off.
    """

    def __init__(self, folder: Path, thread_count: int = 1, direct_io: bool = True) -> None:
        super().__init__(str(folder), single_file_per_rank=True, sync_files=False, thread_count=thread_count)
        self.fs = HashingFileSystem(direct_io)


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
