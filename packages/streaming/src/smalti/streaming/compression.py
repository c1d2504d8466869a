"""Shard compression families and levels, named as mosaicml-streaming names them (``zstd:7``, ``gz``, ...)."""

from __future__ import annotations

import bz2
import gzip
import shutil
from typing import BinaryIO

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


def decompress(compression: str, data: bytes) -> bytes:
    family, _ = parse(compression)  # type: ignore[misc]
    if family == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    if family == "gz":
        return gzip.decompress(data)
    if family == "bz2":
        return bz2.decompress(data)
    if family == "br":
        import brotli

        return brotli.decompress(data)
    import snappy

    return snappy.decompress(data)


def decompress_stream(compression: str, src: BinaryIO, dst: BinaryIO) -> None:
    """Decompress the file ``src`` into the file ``dst`` in chunks (no whole-shard buffers for zstd, gz, bz2)."""
    family, _ = parse(compression)  # type: ignore[misc]
    if family == "zstd":
        import zstandard

        zstandard.ZstdDecompressor().copy_stream(src, dst, read_size=1 << 20, write_size=1 << 20)
    elif family == "gz":
        with gzip.GzipFile(fileobj=src, mode="rb") as f:
            shutil.copyfileobj(f, dst, 1 << 20)
    elif family == "bz2":
        with bz2.BZ2File(src, mode="rb") as f:
            shutil.copyfileobj(f, dst, 1 << 20)
    else:
        dst.write(decompress(compression, src.read()))


def extension(compression: str) -> str:
    """The file suffix a compressed shard gets (``.zstd``)."""
    return "." + parse(compression)[0]  # type: ignore[index]
