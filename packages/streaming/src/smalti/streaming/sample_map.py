"""Where each global sample id lives: the shards of a dataset's streams in one numbering, their sizes and
their first ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class SampleMap:
    """Every shard of every stream, numbered stream after stream; global sample ids run through them in that
    order. ``shards[i]`` is ``(stream index, index entry)``, ``stream_shards`` each stream's shard numbers,
    ``samples``/``raw_bytes``/``zip_bytes`` per-shard columns and ``starts`` each shard's first global id
    (and the total last)."""

    def __init__(self, shards: Sequence[tuple[int, dict[str, Any]]], stream_shards: Sequence[Sequence[int]],
                 samples: np.ndarray, raw_bytes: np.ndarray, zip_bytes: np.ndarray) -> None:
        self.shards, self.stream_shards = shards, stream_shards
        self.samples, self.raw_bytes, self.zip_bytes = samples, raw_bytes, zip_bytes
        self.starts = np.concatenate([[0], np.cumsum(samples)]).astype(np.int64)
        self.num_samples = int(self.starts[-1])
        self.stream_sizes = [int(samples[np.asarray(ids, dtype=np.int64)].sum()) for ids in stream_shards]

    def __len__(self) -> int:
        return len(self.shards)

    def shard_ids(self, shards: Sequence[int]) -> list[np.ndarray]:
        """The global sample ids of each of ``shards``."""
        return [np.arange(self.starts[s], self.starts[s + 1]) for s in shards]

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shard and offset in it of each global sample id."""
        shards = np.searchsorted(self.starts, samples, side="right") - 1
        return shards, samples - self.starts[shards]

    def groups(self, ids: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``(shard, positions in ids, offsets in the shard)`` for each shard ``ids`` touch, in first-use order."""
        if not len(ids):
            return []
        shards, offsets = self.locate(ids)
        first_shard = shards[0]
        if shards[-1] == first_shard and (shards == first_shard).all():
            return [(int(first_shard), np.arange(len(ids)), offsets)]
        unique, first, inverse = np.unique(shards, return_index=True, return_inverse=True)
        by_shard = np.argsort(inverse, kind="stable")  # positions grouped by shard, in order within each
        counts = np.bincount(inverse.reshape(-1), minlength=len(unique))
        ends = np.cumsum(counts)
        starts = ends - counts
        out = []
        for k in np.argsort(first, kind="stable").tolist():
            pos = by_shard[starts[k] : ends[k]]
            out.append((int(unique[k]), pos, offsets[pos]))
        return out
