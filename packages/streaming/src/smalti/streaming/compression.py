"""Shard compression families and levels, named as mosaicml-streaming names them (``zstd:7``, ``gz``, ...)."""

from __future__ import annotations

import bz2
import contextlib
import gzip
import importlib
from collections.abc import Callable
from typing import Any, BinaryIO

from smalti.streaming.errors import StreamingError

_DEFAULT_LEVEL = {"br": 11, "bz2": 9, "gz": 9, "zstd": 3, "snappy": None}
_LEVELS = {"br": range(0, 12), "bz2": range(1, 10), "gz": range(0, 10), "zstd": range(1, 23)}


def parse(compression: str | None) -> tuple[str, int | None] | None:
    """``"zstd:7"`` -> ``("zstd", 7)``; raise naming the value when the family or level is unknown."""
    if not compression:
        return None
    family, _, level = compression.partition(":")
    if family not in _DEFAULT_LEVEL:
        raise StreamingError(f"compression {compression!r}: family must be one of {', '.join(_DEFAULT_LEVEL)}")
    if not level:
        return family, _DEFAULT_LEVEL[family]
    if family == "snappy" or int(level) not in _LEVELS[family]:
        raise StreamingError(f"compression {compression!r}: level {level} is not valid for {family}")
    return family, int(level)


_MODULES = {"zstd": "zstandard", "br": "brotli", "snappy": "snappy"}


def preload(compression: str | None) -> None:
    """Import the codec of ``compression`` now (in the calling thread); a missing codec is left for its use."""
    parsed = parse(compression)
    if parsed and parsed[0] in _MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(_MODULES[parsed[0]])


def compress(compression: str, data: bytes) -> bytes:
    family, level = parse(compression)  # type: ignore[misc]
    if family == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=level).compress(data)
    if family == "gz":
        return gzip.compress(data, compresslevel=level)
    if family == "bz2":
        return bz2.compress(data, compresslevel=level)
    if family == "br":
        import brotli

        return brotli.compress(data, quality=level)
    import snappy

    return snappy.compress(data)


CHUNK = 1 << 20  # bytes read and written per step while decompressing


class OutputLimitError(Exception):
    """Decompressed output would pass the limit given to :func:`decompress_stream` (caught and named by mds)."""

    def __init__(self, produced: int) -> None:
        super().__init__(f"output reached {produced} bytes")
        self.produced = produced


class _BoundedSink:
    """Writes to ``dst``, refusing any write that would take the output past ``limit`` bytes."""

    def __init__(self, dst: BinaryIO, limit: int | None, on_write: Callable[[Any], None] | None) -> None:
        self.dst, self.limit, self.on_write = dst, limit, on_write
        self.written = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if self.limit is not None and self.written + n > self.limit:
            raise OutputLimitError(self.written + n)
        if self.on_write is not None:
            self.on_write(data)
        self.dst.write(data)
        self.written += n
        return n


def _snappy_length(data: bytes) -> int:
    """The uncompressed length a raw snappy block declares in its leading varint."""
    length = shift = 0
    for byte in data[:5]:
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return length
        shift += 7
    raise ValueError("snappy block has no valid length header")


def _brotli_stream(src: BinaryIO, sink: _BoundedSink) -> None:
    import brotli

    d = brotli.Decompressor()
    while chunk := src.read(CHUNK):
        sink.write(d.process(chunk, output_buffer_limit=CHUNK))
        while not d.can_accept_more_data():  # output held back by the limit: drain it before more input
            sink.write(d.process(b"", output_buffer_limit=CHUNK))
    while not d.is_finished():  # all input given: the rest of the output, a chunk at a time
        out = d.process(b"", output_buffer_limit=CHUNK)
        if not out:
            break
        sink.write(out)
    if not d.is_finished():
        raise ValueError("brotli stream is truncated")


def _zstd_stream(src: Any, sink: _BoundedSink) -> None:
    """Every zstd frame of ``src`` (a file, or a buffer read in place) into ``sink``, through one reused
    buffer: no new object per chunk (fresh megabyte objects cost page faults that took longer than
    decompressing the raw blocks of incompressible tokens)."""
    import zstandard

    buf = memoryview(bytearray(CHUNK))
    reader = zstandard.ZstdDecompressor().stream_reader(src, read_size=CHUNK, read_across_frames=True,
                                                        closefd=False)
    with reader:
        while n := reader.readinto(buf):
            sink.write(buf[:n])


class _BufferReader:
    """A bytes-like object read as a file, a chunk (a copy) at a time."""

    def __init__(self, data: Any) -> None:
        self.view, self.pos = memoryview(data).cast("B"), 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.pos + n)
        chunk = bytes(self.view[self.pos : end])
        self.pos = end
        return chunk

    def readable(self) -> bool:
        return True


def decompress_stream(compression: str, src: Any, dst: BinaryIO, limit: int | None = None,
                      on_write: Callable[[Any], None] | None = None) -> int:
    """Decompress ``src`` (a file, or a bytes-like object such as a mapped file) into the file ``dst`` in
    chunks of about :data:`CHUNK` bytes.

    Nothing past ``limit`` output bytes is ever written: :class:`OutputLimitError` is raised before a write
    would pass it, having decompressed at most about two chunks beyond the limit in memory (a snappy block is
    refused from its length header, before it is decompressed).
    ``on_write(chunk)`` sees every chunk written (to hash the output). Returns the bytes written.
    """
    family, _ = parse(compression)  # type: ignore[misc]
    sink = _BoundedSink(dst, limit, on_write)
    if family == "zstd":
        _zstd_stream(src, sink)
        return sink.written
    if not hasattr(src, "read"):
        src = _BufferReader(src)
    if family in ("gz", "bz2"):
        opener = gzip.GzipFile(fileobj=src, mode="rb") if family == "gz" else bz2.BZ2File(src, mode="rb")
        with opener as f:
            while chunk := f.read(CHUNK):
                sink.write(chunk)
    elif family == "br":
        _brotli_stream(src, sink)
    else:
        import snappy

        data = src.read()
        declared = _snappy_length(data)
        if limit is not None and declared > limit:
            raise OutputLimitError(declared)
        sink.write(snappy.decompress(data))
    return sink.written


def extension(compression: str) -> str:
    """The file suffix a compressed shard gets (``.zstd``)."""
    return "." + parse(compression)[0]  # type: ignore[index]
