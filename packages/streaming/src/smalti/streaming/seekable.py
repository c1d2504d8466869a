"""zstd shards in several frames with a seek table (zstd's seekable format), read a few samples at a time.

A shard written so is a run of ordinary zstd frames, each holding whole samples (about ``frame_size`` bytes
of the raw shard; the first also holds the header with the sample offsets), followed by a skippable frame
holding the seek table (facebook/zstd ``contrib/seekable_format``)::

    0x184D2A5E | table size | (compressed size u32, raw size u32) per frame | frames u32 | 0x00 | 0x8F92EAB1

Any zstd decoder reads the whole file as the concatenation of the frames' contents (the skippable frame is
skipped): mosaicml-streaming decodes these shards unchanged. :class:`SparseShard` decompresses only the
frames holding the bytes asked for, so the first batch need not wait for whole shards.
"""

from __future__ import annotations

import mmap
import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

SKIPPABLE_MAGIC = 0x184D2A5E
SEEKABLE_MAGIC = 0x8F92EAB1
_FOOTER = struct.Struct("<IBI")  # Number_Of_Frames, Seek_Table_Descriptor, Seekable_Magic_Number
_HEADER = struct.Struct("<II")  # Skippable_Magic_Number, Frame_Size
_RESERVED_BITS = 0b0111_1100
_CHECKSUM_FLAG = 0b1000_0000
MAX_FRAME_RAW = 1 << 30  # the reference implementation's limit on a frame's decompressed size


def frame_cuts(offsets: np.ndarray, frame_size: int) -> list[int]:
    """Where frames of a raw shard begin and end: each frame runs from one sample's start to the first
    sample start at least ``frame_size`` bytes further (or the shard's end), so every sample lies in one
    frame. ``offsets`` are the shard's ``N + 1`` sample offsets (the last is the shard's size); the first
    frame starts at byte 0 and so also holds the header."""
    offsets = np.asarray(offsets, dtype=np.int64)
    end = int(offsets[-1])
    cuts, start = [0], 0
    while start < end:
        k = int(np.searchsorted(offsets, start + frame_size, side="left"))
        start = int(offsets[k]) if k < len(offsets) else end
        cuts.append(start)
    return cuts


def compress_frames(raw: Any, cuts: list[int], level: int) -> bytes:
    """``raw`` as one zstd frame per ``[cuts[i], cuts[i+1])``, followed by the seek table."""
    import zstandard

    compressor = zstandard.ZstdCompressor(level=level)
    view = memoryview(raw)
    frames = [compressor.compress(view[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    sizes = [(len(f), b - a) for f, a, b in zip(frames, cuts[:-1], cuts[1:])]
    return b"".join(frames) + seek_table(sizes)


def seek_table(sizes: list[tuple[int, int]]) -> bytes:
    """The skippable frame holding the seek table of frames of ``(compressed, raw)`` sizes (no checksums)."""
    entries = np.asarray(sizes, dtype="<u4").reshape(-1, 2).tobytes()
    body = entries + _FOOTER.pack(len(sizes), 0, SEEKABLE_MAGIC)
    return _HEADER.pack(SKIPPABLE_MAGIC, len(body)) + body


@dataclass(frozen=True)
class SeekTable:
    """Where each frame is: ``packed[i]`` / ``raw[i]`` are the offsets of frame ``i`` in the compressed file
    and in the raw shard (``n + 1`` of each; the last ones are the ends)."""

    packed: np.ndarray
    raw: np.ndarray

    def __len__(self) -> int:
        return len(self.raw) - 1

    def frames(self, begin: int, end: int) -> range:
        """The frames holding raw bytes ``[begin, end)`` (none when empty)."""
        if end <= begin:
            return range(0)
        first = int(np.searchsorted(self.raw, begin, side="right")) - 1
        last = int(np.searchsorted(self.raw, end, side="left"))
        return range(max(first, 0), min(last, len(self)))


def read_seek_table(data: Any, raw_size: int) -> SeekTable | None:
    """The seek table at the end of the zstd file ``data``, or ``None`` when it has none that describes it
    exactly: frames that fill the file up to the table and add up to ``raw_size`` raw bytes. Such a file
    (a single-frame shard, as mosaicml-streaming writes them) is read whole as before."""
    size = len(data)
    if size < _HEADER.size + _FOOTER.size:
        return None
    frames, descriptor, magic = _FOOTER.unpack_from(data, size - _FOOTER.size)
    entry = 12 if descriptor & _CHECKSUM_FLAG else 8
    if magic != SEEKABLE_MAGIC or descriptor & _RESERVED_BITS or frames == 0:
        return None
    table = _HEADER.size + frames * entry + _FOOTER.size
    if table > size:
        return None
    skip_magic, body = _HEADER.unpack_from(data, size - table)
    if skip_magic != SKIPPABLE_MAGIC or body != table - _HEADER.size:
        return None
    entries = np.frombuffer(data, dtype="<u4", count=frames * entry // 4, offset=size - table + _HEADER.size)
    entries = entries.reshape(frames, entry // 4).astype(np.int64)
    packed = np.concatenate([[0], np.cumsum(entries[:, 0])])
    raw = np.concatenate([[0], np.cumsum(entries[:, 1])])
    if packed[-1] != size - table or raw[-1] != raw_size:
        return None
    return SeekTable(packed, raw)


class SparseShard:
    """The raw bytes of a shard of which only the byte ranges asked for are decompressed.

    ``buffer`` is an anonymous mapping of the shard's raw size in 4 KiB pages: pages never written cost
    nothing, so the first batch's few samples touch a few pages, not whole frames (fresh pages, and huge
    pages even more, cost more to fault in than decompressing the frames they would hold). Each frame is
    decompressed into a scratch buffer this thread reuses, and only the ranges asked for are copied out.
    Bytes not loaded read as zeros: readers call :meth:`load_ranges` for every range they read.
    """

    def __init__(self, packed: Any, table: SeekTable) -> None:
        self.packed, self.table = packed, table
        size = int(table.raw[-1])
        self.buffer: Any = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if size else b""
        if size and hasattr(mmap, "MADV_NOHUGEPAGE"):
            self.buffer.madvise(mmap.MADV_NOHUGEPAGE)
        self._loaded: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self.decompressed = 0  # raw bytes decompressed so far (whole frames)

    def load_ranges(self, begins: Any, ends: Any) -> None:
        """Decompress raw bytes ``[begins[k], ends[k])`` into ``buffer`` (raises ``ValueError`` or zstd's
        error on a damaged frame). Each frame holding any of them is decompressed once per call."""
        with self._lock:
            todo = [(b, e) for b, e in zip(np.asarray(begins).tolist(), np.asarray(ends).tolist())
                    if e > b and (b, e) not in self._loaded]
            if not todo:
                return
            by_frame: dict[int, list[tuple[int, int]]] = {}
            for b, e in todo:
                for frame in self.table.frames(b, e):
                    by_frame.setdefault(frame, []).append((b, e))
            for frame in sorted(by_frame):
                lo = int(self.table.raw[frame])
                data = self._decompress(frame)
                for b, e in by_frame[frame]:
                    first, last = max(b, lo), min(e, lo + len(data))
                    self.buffer[first:last] = data[first - lo : last - lo]
            self._loaded.update(todo)

    def load(self, begin: int, end: int) -> None:
        """Decompress raw bytes ``[begin, end)`` into ``buffer``."""
        self.load_ranges([begin], [end])

    def _decompress(self, frame: int) -> memoryview:
        """Frame ``frame``'s raw bytes, in this thread's scratch buffer (valid until its next call)."""
        import zstandard

        size = int(self.table.raw[frame + 1] - self.table.raw[frame])
        scratch = getattr(_scratch, "buffer", None)
        if scratch is None or len(scratch) < size:
            scratch = _scratch.buffer = bytearray(max(size, 1 << 20))
        out = memoryview(scratch)[:size]
        src = memoryview(self.packed)[int(self.table.packed[frame]) : int(self.table.packed[frame + 1])]
        got = 0
        with zstandard.ZstdDecompressor().stream_reader(src, closefd=False) as reader:
            while got < size and (n := reader.readinto(out[got:])):
                got += n
            extra = reader.read(1)
        if got != size or extra:
            raise ValueError(f"frame {frame} holds {'more than ' if extra else ''}{got} bytes, the seek table "
                             f"says {size}")
        self.decompressed += size
        return out


_scratch = threading.local()
