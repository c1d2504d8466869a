"""The fetch plan: which process of a node fetches which shard of the epoch, and when."""

from __future__ import annotations

import logging
import math
import threading
from typing import TYPE_CHECKING

import numpy as np

from smalti.streaming.epoch_plan import GridRemaining, Remaining

if TYPE_CHECKING:
    from smalti.streaming.dataset import StreamingDataset

log = logging.getLogger(__name__)


class FetchPlan:
    """Which process of this node fetches which shard, and a thread that fetches this process's share ahead.

    Every process of the node (local ranks x DataLoader workers) walks the node's columns of the remaining
    global batches in the same order, a chunk at a time, and gives the ``k``-th shard it meets first to
    process ``k % participants``. An owner fetches its shards up to ``predownload`` samples ahead of where it
    is; the others wait for them (see :mod:`smalti.streaming.cache`). The first chunk is walked before the
    iteration starts, the rest by the thread, ahead of the reading: memory is one chunk of the order and one
    entry per shard, never the epoch.
    """

    WALK_SAMPLES = 1 << 16  # node columns computed per step of the walk

    def __init__(self, ds: StreamingDataset, remaining: Remaining | GridRemaining, worker_id: int,
                 num_workers: int) -> None:
        self.ds = ds
        self.progress = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.owner: dict[int, int] = {}
        self.participants, self.me = 1, 0
        if ds.predownload <= 0 or len(remaining) == 0:
            return
        self.participants = ds.local_world * num_workers
        self.me = ds.local_rank * num_workers + worker_id
        self._remaining = remaining
        self._cols = ds._node_columns()
        self._chunk = max(1, self.WALK_SAMPLES // max(self._cols[1] - self._cols[0], 1))
        self._seen = np.zeros(len(ds._shards), dtype=bool)
        first = self._walk(0)
        lookahead = max(1, math.ceil(ds.predownload / ds.batch_size)) * num_workers
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
        shards, _ = self.ds._locate(flat[valid])
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
                cache = self.ds.cache
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
