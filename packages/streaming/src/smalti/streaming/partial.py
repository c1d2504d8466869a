"""A few samples of a shard read from its seekable zstd zip, without decompressing the whole shard.

The first batch of an epoch draws on several shards (with ``py1e``, 3 of 7 in the bench); decompressing
them whole before it can be cut was most of its wait. :func:`read_rows` decompresses only the frames that
hold the shard's header and the rows asked for (see :mod:`smalti.streaming.seekable`); the whole shard is
still decompressed to its local copy as before, for the rest of the epoch.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from smalti.streaming import compression as comp
from smalti.streaming.errors import ShardCorruptError, StreamingError
from smalti.streaming.mds import ShardReader, _map, verify_buffer
from smalti.streaming.seekable import SparseShard, read_seek_table


class PartialShardReader(ShardReader):
    """A :class:`~smalti.streaming.mds.ShardReader` over a :class:`SparseShard`: the frames of the samples
    read are decompressed on demand. :meth:`column_views` shows only what was loaded: call :meth:`load_rows`
    for the rows to be read through them first (``gather`` and ``reader[i]`` load by themselves)."""

    def __init__(self, sparse: SparseShard, path: Path, entry: dict[str, Any], stream: str = "",
                 allow_unsafe_types: bool = False) -> None:
        size = len(sparse.buffer)
        sparse.load(0, min(4, size))
        (count,) = struct.unpack_from("<I", sparse.buffer, 0) if size >= 4 else (0,)
        sparse.load(0, min(4 + 4 * (count + 1), size))  # the sample offsets (ShardReader checks the count)
        super().__init__(path, entry, stream, allow_unsafe_types, data=sparse.buffer)
        self.sparse = sparse

    def load_rows(self, rows: Any) -> None:
        """Decompress the frames holding samples ``rows``; raise naming the shard when their offsets are bad."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if not len(rows):
            return
        if rows.min() < 0 or rows.max() >= len(self):
            bad = int(rows[(rows < 0) | (rows >= len(self))][0])
            raise IndexError(f"sample {bad} is out of range for shard {self.path} ({len(self)} samples)")
        begins = self.offsets[rows].astype(np.int64)
        ends = self.offsets[rows + 1].astype(np.int64)
        if (begins <= 0).any() or (ends < begins).any() or (ends > len(self.data)).any():
            raise ShardCorruptError(f"shard {self.path} of stream {self.stream or self.path.parent}: the offsets "
                                    f"of samples {rows[:4].tolist()}... lie outside its {len(self.data)} bytes")
        try:
            self.sparse.load_ranges(begins, ends)
        except Exception as exc:  # zstd errors on damaged frames
            raise ShardCorruptError(f"shard {self.path} of stream {self.stream or self.path.parent} does not "
                                    f"decompress: {exc}") from exc

    def __getitem__(self, i: int) -> dict[str, Any]:
        if 0 <= i < len(self):
            self.load_rows([i])
        return super().__getitem__(i)

    def gather(self, rows: np.ndarray | list[int]) -> list[dict[str, Any]]:
        self.load_rows(rows)
        return super().gather(rows)


def read_rows(packed: Path, entry: dict[str, Any], rows: Any, stream: str = "", validate_hash: bool = True,
              allow_unsafe_types: bool = False) -> PartialShardReader | None:
    """A reader of the shard ``entry`` from its local zip ``packed`` that has decompressed the frames holding
    samples ``rows``; ``None`` when the zip is not zstd with a seek table (read it whole, as before).

    With ``validate_hash`` the zip is checked against the index's hashes first, as a whole decompression
    checks it. The reader keeps a mapping of the zip, so it reads on after the file is deleted.
    """
    info = entry.get("zip_data")
    if not info or (comp.parse(entry.get("compression")) or ("",))[0] != "zstd":
        return None
    with open(packed, "rb") as f:
        data = _map(f)
    try:
        table = read_seek_table(data, entry["raw_data"]["bytes"])  # (bad tables are checked by the hash next)
        if table is not None:
            if validate_hash:
                verify_buffer(data, info, packed, stream)
            raw = packed.parent / entry["raw_data"]["basename"]
            try:
                reader = PartialShardReader(SparseShard(data, table), raw, entry, stream, allow_unsafe_types)
            except StreamingError:  # ShardCorruptError included: already names the shard
                raise
            except Exception as exc:  # a damaged header frame (ZstdError, ValueError)
                raise ShardCorruptError(f"shard {packed} of stream {stream or packed.parent} does not "
                                        f"decompress: {exc}") from exc
            reader.load_rows(rows)
            return reader
    except BaseException:
        _close(data)
        raise
    _close(data)
    return None


def _close(data: Any) -> None:
    if isinstance(data, mmap.mmap):
        data.close()
