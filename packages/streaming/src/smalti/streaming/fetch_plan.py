"""The fetch plan: which process of a node fetches which shard of the epoch, and when."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from smalti.streaming.cache import ShardCache
from smalti.streaming.epoch_plan import GridRemaining, Remaining
from smalti.streaming.layout import RankLayout
from smalti.streaming.sample_map import SampleMap
from smalti.streaming.stream import Stream

log = logging.getLogger(__name__)

NEEDS_WALK_SAMPLES = 1 << 22  # node samples walked to measure the cache an epoch needs; past it, a prefix
WALK_SAMPLES = 1 << 16  # node columns computed per step of a walk of the order


@dataclass(frozen=True)
class CacheNeeds:
    """What one node's share of an epoch asks of its shard cache, measured on the order (see :func:`cache_needs`).

    ``min_cache_bytes`` is the smallest ``cache_limit`` that keeps every shard from the fetch of its first
    use (``window_steps`` ahead) to its last use: with it, each shard is fetched once per epoch; below it,
    some are fetched again. ``shards_per_window_mean``/``_max`` are the order's locality: distinct shards the
    node reads in each window of ``window_steps`` global batches. ``steps`` global batches were walked, all
    of the epoch when ``complete``; ``last_use`` is each shard's last step (``-1``: not read by this node).
    """

    min_cache_bytes: int
    min_cache_shards: int
    shards_per_window_mean: float
    shards_per_window_max: int
    window_steps: int
    steps: int
    complete: bool
    last_use: np.ndarray

    def describe(self) -> str:
        """One line for the log: the cache this layout and order need, and their locality."""
        scope = "epoch" if self.complete else f"first {self.steps} global batches of the epoch"
        return (f"cache_limit >= {_size_text(self.min_cache_bytes)} ({self.min_cache_shards} shards) keeps "
                f"every shard fetched once per {scope}; locality: {self.shards_per_window_mean:.1f} shards per "
                f"{self.window_steps} global batches on average, {self.shards_per_window_max} at most")


def _size_text(n: int) -> str:
    for unit, scale in (("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10)):
        if n >= scale:
            return f"{-(-n * 10 // scale) / 10:g}{unit}"
    return f"{n}b"


def cache_needs(remaining: Remaining | GridRemaining, columns: tuple[int, int],
                locate: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], shard_bytes: np.ndarray,
                window_steps: int, max_samples: int = NEEDS_WALK_SAMPLES,
                chunk_samples: int = WALK_SAMPLES) -> CacheNeeds:
    """Measure the cache a node needs for the rest of an epoch: walk its ``columns`` of the ``remaining``
    global batches (``locate`` maps sample ids to shards), a chunk at a time, keeping each shard's first and
    last step; memory grows with the shards, not the samples. A shard is live from ``window_steps`` before
    its first step (the fetch plan fetches that far ahead) to its last; the most bytes live at once is the
    smallest cache that never evicts a shard the node reads again.
    """
    lo, hi = columns
    width = max(hi - lo, 1)
    n_shards = len(shard_bytes)
    first = np.full(n_shards, -1, dtype=np.int64)
    last = np.full(n_shards, -1, dtype=np.int64)
    chunk = max(window_steps, chunk_samples // width // window_steps * window_steps)
    total = len(remaining)
    limit = min(total, max(window_steps, -(-max_samples // width)))
    windows: list[int] = []
    k = 0
    while k < limit:
        end = min(k + chunk, limit)
        rows = remaining.rows(k, end, lo, hi)
        valid = rows >= 0
        shards = np.full(rows.shape, -1, dtype=np.int64)
        shards[valid] = locate(rows[valid])[0]
        steps = np.broadcast_to(np.arange(k, end)[:, None], rows.shape)
        s, t = shards[valid], steps[valid]
        unique, at = np.unique(s, return_index=True)  # steps ascend through the flattened rows
        first[unique] = np.where(first[unique] < 0, t[at], first[unique])
        unique, at = np.unique(s[::-1], return_index=True)
        last[unique] = t[::-1][at]
        w = (t - k) // window_steps
        per_window = np.unique(w * n_shards + s) // n_shards
        windows.extend(np.bincount(per_window, minlength=-(-(end - k) // window_steps)).tolist())
        k = end
    read = np.flatnonzero(first >= 0)
    start = np.maximum(first[read] - window_steps, 0)
    # live from `start` to `last`: add at start, remove after last; the peak of the running sum is the need
    times = np.concatenate([start, last[read] + 1])
    sizes = np.concatenate([shard_bytes[read], -shard_bytes[read]])
    counts = np.concatenate([np.ones(len(read), np.int64), -np.ones(len(read), np.int64)])
    by_time = np.lexsort((sizes, times))  # removals before additions at one step
    need_bytes = int(np.cumsum(sizes[by_time]).max(initial=0))
    need_shards = int(np.cumsum(counts[np.lexsort((counts, times))]).max(initial=0))
    return CacheNeeds(min_cache_bytes=need_bytes, min_cache_shards=need_shards,
                      shards_per_window_mean=float(np.mean(windows)) if windows else 0.0,
                      shards_per_window_max=max(windows, default=0), window_steps=window_steps, steps=k,
                      complete=k >= total, last_use=last)


def node_cache_needs(remaining: Remaining | GridRemaining, table: SampleMap, streams: Sequence[Stream],
                     layout: RankLayout, predownload: int) -> CacheNeeds:
    """:func:`cache_needs` of the node of rank ``layout`` for ``remaining``, fetching ``predownload`` samples
    ahead; shards of streams without a remote are never evicted, so they count for nothing."""
    remote = np.array([s.remote is not None for s in streams], dtype=bool)
    owner = np.repeat(np.arange(len(streams)), [len(ids) for ids in table.stream_shards])
    sizes = np.where(remote[owner], table.raw_bytes, 0)
    window = max(1, -(-predownload // layout.batch_size))
    return cache_needs(remaining, layout.node_columns(), table.locate, sizes, window)


def report_cache_needs(needs: CacheNeeds, streams: str, cache_limit: int | None) -> None:
    """Log the cache ``needs`` of a node reading ``streams``, warning when ``cache_limit`` is below them."""
    log.info("streaming %s: %s", streams, needs.describe())
    if cache_limit is not None and cache_limit < needs.min_cache_bytes:
        log.warning("cache_limit=%d bytes is below the %d bytes this node's order needs at once: shards "
                    "will be fetched again after eviction (slower; see StreamingDataset.metrics())",
                    cache_limit, needs.min_cache_bytes)


class FetchPlan:
    """Which process of this node fetches which shard, and a thread that fetches this process's share ahead.

    Every process of the node (local ranks x DataLoader workers) walks the node's columns of the remaining
    global batches in the same order, a chunk at a time, and gives the ``k``-th shard it meets first to
    process ``k % participants``. An owner fetches its shards up to ``predownload`` samples ahead of where it
    is; the others wait for them (see :mod:`smalti.streaming.cache`). The first chunk is walked before the
    iteration starts, the rest by the thread, ahead of the reading: memory is one chunk of the order and one
    entry per shard, never the epoch.
    """

    WALK_SAMPLES = WALK_SAMPLES

    def __init__(self, remaining: Remaining | GridRemaining, table: SampleMap, cache: ShardCache,
                 layout: RankLayout, predownload: int, worker_id: int, num_workers: int) -> None:
        self.table, self.cache = table, cache
        self.progress = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.owner: dict[int, int] = {}
        self.participants, self.me = 1, 0
        if predownload <= 0 or len(remaining) == 0:
            return
        self.participants = layout.local_world * num_workers
        self.me = layout.local_rank * num_workers + worker_id
        self._remaining = remaining
        self._cols = layout.node_columns()
        self._chunk = max(1, self.WALK_SAMPLES // max(self._cols[1] - self._cols[0], 1))
        self._seen = np.zeros(len(table), dtype=bool)
        first = self._walk(0)
        lookahead = max(1, math.ceil(predownload / layout.batch_size)) * num_workers
        self._thread = threading.Thread(target=self._run, args=(first, lookahead), daemon=True,
                                        name="smalti-streaming-prefetch")
        self._thread.start()

    def defer(self, shard: int) -> bool:
        """Whether another process of this node fetches ``shard`` (this one then waits for its copy)."""
        return self.participants > 1 and self.owner.get(shard, self.me) != self.me

    def _walk(self, k: int) -> list[tuple[int, int]]:
        """Give owners to the shards first read in remaining steps ``[k, k + chunk)``; ``(step, shard)`` of
        this process's, in the order needed."""
        lo, hi = self._cols
        flat = self._remaining.rows(k, k + self._chunk, lo, hi).reshape(-1)
        valid = np.flatnonzero(flat >= 0)
        shards, _ = self.table.locate(flat[valid])
        unique, first = np.unique(shards, return_index=True)
        new = ~self._seen[unique]
        unique, first = unique[new], first[new]
        self._seen[unique] = True
        by_need = np.argsort(first, kind="stable")
        steps = k + valid[first[by_need]] // (hi - lo)
        mine = []
        for step, shard in zip(steps.tolist(), unique[by_need].tolist()):
            owner = len(self.owner) % self.participants
            self.owner[shard] = owner
            if owner == self.me:
                mine.append((step, shard))
        return mine

    def _run(self, first: list[tuple[int, int]], lookahead: int) -> None:
        todo, k = first, 0
        while True:
            for step, shard in todo:
                while step > self.progress + lookahead:
                    if self._stop.wait(0.005):
                        return
                if self._stop.is_set():
                    return
                cache = self.cache
                if not cache.is_local(shard) and cache.peer_busy(shard):
                    continue  # another process (the warm-up, a peer rank) is making it: make the next one meanwhile
                try:
                    cache.ensure(shard)
                except Exception as exc:  # the reader meets it again, and raises it, when it needs the shard
                    log.debug("prefetch of shard %d failed: %r", shard, exc)
            k += self._chunk
            if k >= len(self._remaining) or self._stop.is_set():
                return
            todo = self._walk(k)

    def finish(self) -> None:
        """The iteration ended normally: let the thread fetch what peers still expect from this process."""
        if self._thread is not None:
            self.progress = 1 << 62
            self._thread.join()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
