"""``O_DIRECT``'s alignment: offsets, lengths and buffer addresses in whole blocks, and byte ranges cut into
block-aligned reads of at most one chunk."""

from __future__ import annotations

from smalti.checkpoint.io.pool import CHUNK_BYTES

#: ``O_DIRECT``'s alignment of offsets, lengths and buffers (the largest logical block size in common use)
BLOCK_BYTES = 4096


def align_down(n: int) -> int:
    """``n`` rounded down to a whole number of blocks."""
    return n // BLOCK_BYTES * BLOCK_BYTES


def align_up(n: int) -> int:
    """``n`` rounded up to a whole number of blocks."""
    return -(-n // BLOCK_BYTES) * BLOCK_BYTES


def merge_ranges(ranges: list[tuple[int, int]], gap: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """``[start, end)`` ranges widened to whole blocks, sorted, and merged where less than ``gap`` apart (one
    longer read beats two reads and a seek)."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted((align_down(s), align_up(e)) for s, e in ranges if e > s):
        if merged and start <= merged[-1][1] + gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def chunk_ranges(ranges: list[tuple[int, int]], chunk_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` reads of at most ``chunk_bytes`` covering ``ranges`` (``[start, end)``), in order."""
    return [(at, min(chunk_bytes, end - at)) for start, end in ranges for at in range(start, end, chunk_bytes)]
