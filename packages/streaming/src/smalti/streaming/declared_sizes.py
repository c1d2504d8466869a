"""What an MDS index may declare about a shard: the size limits and the check that refuses impossible sizes.

Kept apart from :mod:`smalti.streaming.mds` so that the columnar index (:mod:`smalti.streaming.shard_table`) can
apply the same rules without importing the module that reads it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from smalti.streaming.errors import StreamingError

MAX_SHARD_BYTES = (1 << 32) - 1  # MDS sample offsets are 32-bit
# A zip whose index says it decompresses to more than this many times its own size (and past SMALL_SHARD_BYTES)
# is refused before it is decompressed: real shards compress 1-50x; zstd reaches ~14000x on all zeros.
MAX_COMPRESSION_RATIO = 2048
SMALL_SHARD_BYTES = 1 << 20


def whole(value: Any) -> bool:
    """Whether ``value`` is a JSON whole number (an int, not a bool, not negative)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def smallest_sample(column_sizes: Any) -> int | None:
    """The fewest bytes a sample of these ``column_sizes`` takes in a shard: its 4-byte offset, its fixed-size
    columns and the 4-byte lengths of its variable-size ones (``None`` marks one); ``None`` when the list is
    not one of byte counts and nulls."""
    sizes = column_sizes or []
    if not isinstance(sizes, list) or not all(s is None or whole(s) for s in sizes):
        return None
    return 4 + sum(4 if s is None else s for s in sizes)


def _rules(samples: Any, raw: Any, packed: Any, smallest: int | None, limit: Any) -> list[tuple[str, Any]]:
    """The rules a shard's declared sizes must keep, in the order they are checked, each as (name, broken):
    ``broken`` is a function giving a bool for Python ints or a bool array for int64 columns of shards of one
    configuration (the rules use operators only, so this one text serves :func:`check_declared_sizes` and
    :func:`declared_sizes_ok`). A value that is not a whole number comes as ``-1``; ``packed`` is ``None``
    for a shard without a zip."""
    zipped = packed is not None
    return [
        ("raw", lambda: (raw < 0) | (raw > MAX_SHARD_BYTES)),
        ("samples", lambda: samples < 0),
        ("limit", lambda: whole(limit) and limit > 0 and (samples > 1) & (raw > limit)),
        ("column_sizes", lambda: smallest is None),
        ("fit", lambda: smallest is not None and 8 + samples * smallest > raw),
        ("zip", lambda: zipped and (packed < 0) | (packed > MAX_SHARD_BYTES)),
        ("ratio", lambda: zipped and (raw > SMALL_SHARD_BYTES) & (raw > packed * MAX_COMPRESSION_RATIO)),
    ]


def declared_sizes_ok(samples: np.ndarray, raw: np.ndarray, packed: np.ndarray | None, column_sizes: Any,
                      size_limit: Any) -> np.ndarray:
    """Per shard, whether it passes :func:`check_declared_sizes`: shards that share ``column_sizes`` and
    ``size_limit`` (one configuration of a columnar index), as int64 columns of sample counts, raw and zip
    sizes (``packed`` ``None`` when they have no zip)."""
    # Clamped where the verdict cannot change, so that no product overflows int64: a size past the limit
    # stays past it, and a sample count past a quarter of the raw bytes (a sample takes at least 4) stays
    # one that does not fit and stays more than one.
    raw = np.minimum(raw, MAX_SHARD_BYTES + 1)
    samples = np.minimum(samples, (np.maximum(raw, 0) >> 2) + 2)
    packed = None if packed is None else np.minimum(packed, MAX_SHARD_BYTES + 1)
    smallest = smallest_sample(column_sizes)
    smallest = None if smallest is None else min(smallest, MAX_SHARD_BYTES + 1)
    ok = np.ones(len(samples), dtype=bool)
    for _, broken in _rules(samples, raw, packed, smallest, size_limit):
        ok &= np.logical_not(broken())
    return ok


def check_declared_sizes(entry: dict[str, Any], path: object, i: int) -> None:
    """Refuse shard ``i`` of index ``path`` when the sizes and counts it declares cannot be true of an MDS shard.

    Checked before anything is allocated, downloaded or decompressed from them: ``raw_data.bytes`` at most
    :data:`MAX_SHARD_BYTES` (32-bit offsets) and, for a shard of more than one sample, at most its
    ``size_limit`` (the writer starts a new shard before passing it); ``samples`` no more than the raw bytes
    can hold (each sample takes its 4-byte offset plus its fixed-size columns and the 4-byte lengths of its
    variable-size ones); ``zip_data.bytes`` decompressing to at most :data:`MAX_COMPRESSION_RATIO` times itself.
    """
    where = f"{path}: shard {i}"
    raw_info = entry.get("raw_data") or {}
    size, samples, limit = raw_info.get("bytes"), entry.get("samples"), entry.get("size_limit")
    column_sizes = entry.get("column_sizes")
    zip_info = entry.get("zip_data")
    packed = zip_info.get("bytes") if zip_info else None
    smallest = smallest_sample(column_sizes)
    broken = next((name for name, test in _rules(samples if whole(samples) else -1, size if whole(size) else -1,
                                                 (packed if whole(packed) else -1) if zip_info else None,
                                                 smallest, limit) if test()), None)
    if broken == "raw":
        raise StreamingError(f"{where} raw_data.bytes={size!r} is not a shard size: an MDS shard holds 0 to "
                             f"{MAX_SHARD_BYTES} bytes (its offsets are 32-bit); the index is damaged or hostile")
    if broken == "samples":
        raise StreamingError(f"{where} samples={samples!r} is not a count of samples; the index is damaged")
    if broken == "limit":
        raise StreamingError(f"{where} declares raw_data.bytes={size} for {samples} samples, more than its "
                             f"size_limit={limit} (only a shard of one sample may pass it); the index is damaged "
                             "or hostile")
    if broken == "column_sizes":
        raise StreamingError(f"{where} column_sizes={column_sizes!r} must be byte counts or null")
    if broken == "fit":
        raise StreamingError(f"{where} declares {samples} samples in raw_data.bytes={size}, but each sample takes "
                             f"at least {smallest} bytes (its offset and columns), so at most "
                             f"{max(0, (size - 8) // smallest)} fit; the index is damaged or hostile")
    if broken == "zip":
        raise StreamingError(f"{where} zip_data.bytes={packed!r} is not a shard size (0 to {MAX_SHARD_BYTES})")
    if broken == "ratio":
        raise StreamingError(f"{where} declares that its {packed}-byte zip decompresses to {size} bytes, more "
                             f"than MAX_COMPRESSION_RATIO={MAX_COMPRESSION_RATIO} times its size; refused before "
                             "decompressing (the index is damaged or hostile; data that really compresses so "
                             "well, such as all zeros, is written without compression)")
