"""Bounds on the sizes a checkpoint's DCP metadata declares, checked before anything is read or allocated.

DCP's ``.metadata`` says where each entry lies (``offset``, ``length`` in a data file) and how it is stored
(``transform_descriptors``: ``stream.zstd/1`` for a zstd-compressed entry). Taken on trust, a crafted file
makes a load read outside its files, or inflate a few kB of zstd into gigabytes of memory. Here:

- every entry's offset and length are non-negative integers whose end lies inside the file
  (:func:`check_extent`), checked against the file's own length before it is read;
- a transformed entry decodes to at most what it can hold (:func:`decoded_limit`): a tensor chunk's
  ``prod(sizes) * dtype size`` (from the metadata's shape and dtype) plus :data:`ARCHIVE_OVERHEAD` for
  ``torch.save``'s headers, an object record :data:`MAX_OBJECT_BYTES`. A zstd frame that declares a larger
  content size is refused before decompression; one that does not is decompressed with that output limit
  (:func:`decode_bounded`) and refused as soon as it passes it.

A refusal is :class:`EntryTooLargeError` naming the file, the entry and the limit.
"""

from __future__ import annotations

import io
import math
from typing import Any

from smalti.checkpoint.errors import CheckpointCorruptError

#: what ``torch.save`` of one tensor holds beside the tensor's bytes (zip headers, its pickle, alignment)
ARCHIVE_OVERHEAD = 64 << 10
#: the most bytes an object record (optimizer hyperparameters, not a tensor) may decode to
MAX_OBJECT_BYTES = 64 << 20
#: the transforms a load can decode (torch's zstd stream, the only one DCP writes)
KNOWN_TRANSFORMS = ("stream.zstd/1",)
_READ = 1 << 20


class EntryTooLargeError(CheckpointCorruptError):
    """A checkpoint entry declares, or decodes to, more bytes than its file or its tensor can hold (or a
    negative or non-integer offset or length)."""


def check_extent(info: Any, file_size: int | None, where: str) -> None:
    """Refuse an entry (DCP's ``_StorageInfo``) whose offset or length is not a non-negative integer, or whose
    end lies past ``file_size`` (``None``: only the types and signs), or whose transforms are unknown."""
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    for name, value in (("offset", offset), ("length", length)):
        if type(value) is not int or value < 0:
            raise EntryTooLargeError(f"{where} declares {name} {value!r}: not a non-negative integer", where)
    if file_size is not None and offset + length > file_size:
        raise EntryTooLargeError(
            f"{where} declares bytes {offset}..{offset + length}, past the end of its file ({file_size} bytes)",
            where,
        )
    descriptors = getattr(info, "transform_descriptors", None)
    if descriptors is not None and (
        not isinstance(descriptors, (list, tuple)) or any(d not in KNOWN_TRANSFORMS for d in descriptors)
    ):
        raise EntryTooLargeError(
            f"{where} is stored with transforms {descriptors!r:.200}; only {', '.join(KNOWN_TRANSFORMS)} is read",
            where,
        )


def _chunk_of(entry: Any, index: Any) -> Any:
    chunks = list(getattr(entry, "chunks", None) or ())
    hint = getattr(index, "index", None)
    if isinstance(hint, int) and 0 <= hint < len(chunks) and chunks[hint].offsets == index.offset:
        return chunks[hint]
    return next((chunk for chunk in chunks if chunk.offsets == index.offset), None)


def decoded_limit(metadata: Any, index: Any, where: str) -> int:
    """The most bytes the entry at ``index`` (DCP's ``MetadataIndex``) may decode to: its tensor chunk's bytes
    (shape times dtype size, from the metadata) plus :data:`ARCHIVE_OVERHEAD`, or :data:`MAX_OBJECT_BYTES` for
    an object record."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entry = (getattr(metadata, "state_dict_metadata", None) or {}).get(index.fqn)
    if not isinstance(entry, TensorStorageMetadata):
        return MAX_OBJECT_BYTES
    chunk = _chunk_of(entry, index)
    if chunk is None:
        raise EntryTooLargeError(f"{where}: the metadata has no chunk of {index.fqn!r} at {index.offset}", where)
    sizes = list(chunk.sizes)
    if any(type(s) is not int or s < 0 for s in sizes):
        raise EntryTooLargeError(f"{where}: the chunk of {index.fqn!r} has sizes {sizes!r}", where)
    return math.prod(sizes) * entry.properties.dtype.itemsize + ARCHIVE_OVERHEAD


def decode_bounded(raw: bytes, descriptors: Any, limit: int, where: str) -> bytes:
    """The bytes of a transformed entry, never more than ``limit`` (:class:`EntryTooLargeError` past it: a
    declared content size is checked before decompressing; the output is cut at ``limit + 1`` bytes)."""
    import zstandard

    data = raw
    for descriptor in reversed(list(descriptors or ())):  # applied in the order written: undone last first
        if descriptor not in KNOWN_TRANSFORMS:
            raise EntryTooLargeError(f"{where} is stored with unknown transform {descriptor!r}", where)
        try:
            declared = zstandard.frame_content_size(data[:18])
        except zstandard.ZstdError:
            declared = -1  # not readable here: the decompressor below says what is wrong
        if declared > limit:
            raise EntryTooLargeError(
                f"{where} declares {declared} bytes once decompressed; it can hold at most {limit} "
                "(its tensor's shape and dtype, or the object-record limit)", where,
            )
        out = io.BytesIO()
        try:
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True) as reader:
                while chunk := reader.read(min(_READ, limit + 1 - out.tell())):
                    out.write(chunk)
                    if out.tell() > limit:
                        raise EntryTooLargeError(
                            f"{where} decompresses to more than {limit} bytes, what it can hold (its tensor's "
                            "shape and dtype, or the object-record limit); refused before reading more", where,
                        )
        except zstandard.ZstdError as exc:
            raise CheckpointCorruptError(f"{where} is not valid zstd data: {exc}", where) from None
        data = out.getvalue()
    return data
