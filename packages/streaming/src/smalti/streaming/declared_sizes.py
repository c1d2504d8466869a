"""What an MDS index may declare about a shard: the size limits and the check that refuses impossible sizes.

Kept apart from :mod:`smalti.streaming.mds` so that the columnar index (:mod:`smalti.streaming.shard_table`) can
apply the same rules without importing the module that reads it.
"""

from __future__ import annotations

from typing import Any

from smalti.streaming.errors import StreamingError

MAX_SHARD_BYTES = (1 << 32) - 1  # MDS sample offsets are 32-bit
# A zip whose index says it decompresses to more than this many times its own size (and past SMALL_SHARD_BYTES)
# is refused before it is decompressed: real shards compress 1-50x; zstd reaches ~14000x on all zeros.
MAX_COMPRESSION_RATIO = 2048
SMALL_SHARD_BYTES = 1 << 20


def whole(value: Any) -> bool:
    """Whether ``value`` is a JSON whole number (an int, not a bool, not negative)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_declared_sizes(entry: dict[str, Any], path: object, i: int) -> None:
    """Refuse shard ``i`` of index ``path`` when the sizes and counts it declares cannot be true of an MDS shard.

    Checked before anything is allocated, downloaded or decompressed from them: ``raw_data.bytes`` at most
    :data:`MAX_SHARD_BYTES` (32-bit offsets) and, for a shard of more than one sample, at most its
    ``size_limit`` (the writer starts a new shard before passing it); ``samples`` no more than the raw bytes
    can hold (each sample takes its 4-byte offset plus its fixed-size columns and the 4-byte lengths of its
    variable-size ones); ``zip_data.bytes`` decompressing to at most :data:`MAX_COMPRESSION_RATIO` times itself.
    """
    where = f"{path}: shard {i}"
    raw = entry.get("raw_data") or {}
    size, samples = raw.get("bytes"), entry.get("samples")
    if not whole(size) or size > MAX_SHARD_BYTES:
        raise StreamingError(f"{where} raw_data.bytes={size!r} is not a shard size: an MDS shard holds 0 to "
                             f"{MAX_SHARD_BYTES} bytes (its offsets are 32-bit); the index is damaged or hostile")
    if not whole(samples):
        raise StreamingError(f"{where} samples={samples!r} is not a count of samples; the index is damaged")
    limit = entry.get("size_limit")
    if samples > 1 and whole(limit) and limit and size > limit:
        raise StreamingError(f"{where} declares raw_data.bytes={size} for {samples} samples, more than its "
                             f"size_limit={limit} (only a shard of one sample may pass it); the index is damaged "
                             "or hostile")
    sizes = entry.get("column_sizes") or []
    if not all(s is None or whole(s) for s in sizes):
        raise StreamingError(f"{where} column_sizes={sizes!r} must be byte counts or null")
    smallest = 4 + sum(4 if s is None else s for s in sizes)  # offset entry + fixed columns + variable lengths
    if 8 + samples * smallest > size:
        raise StreamingError(f"{where} declares {samples} samples in raw_data.bytes={size}, but each sample takes "
                             f"at least {smallest} bytes (its offset and columns), so at most "
                             f"{max(0, (size - 8) // smallest)} fit; the index is damaged or hostile")
    zip_info = entry.get("zip_data")
    if zip_info:
        packed = zip_info.get("bytes")
        if not whole(packed) or packed > MAX_SHARD_BYTES:
            raise StreamingError(f"{where} zip_data.bytes={packed!r} is not a shard size (0 to {MAX_SHARD_BYTES})")
        if size > max(SMALL_SHARD_BYTES, packed * MAX_COMPRESSION_RATIO):
            raise StreamingError(f"{where} declares that its {packed}-byte zip decompresses to {size} bytes, more "
                                 f"than MAX_COMPRESSION_RATIO={MAX_COMPRESSION_RATIO} times its size; refused before "
                                 "decompressing (the index is damaged or hostile; data that really compresses so "
                                 "well, such as all zeros, is written without compression)")
