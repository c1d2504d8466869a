"""The warm-up: a dataset starts fetching its first batches' shards, and reading its first batch's rows, at
construction, in background threads, so that they overlap whatever comes before the first batch."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from smalti.streaming import compression as comp
from smalti.streaming.cache import ShardCache
from smalti.streaming.epoch_plan import GridRemaining, Remaining
from smalti.streaming.layout import RankLayout
from smalti.streaming.partial import read_rows
from smalti.streaming.sample_map import SampleMap
from smalti.streaming.stream import Stream

log = logging.getLogger(__name__)

WARM_UP_STEPS = 2  # global batches whose shards the dataset starts fetching at construction: all of the
WARM_UP_SHARDS = 4  # first's, the next's up to this many in all; in the order needed, one thread per core


def first_batch_ids(remaining: Remaining | GridRemaining, layout: RankLayout) -> np.ndarray | None:
    """The sample ids of this rank's first batch in ``remaining`` (``None``: nothing remains). ``-1`` (the
    padding of a resumed epoch's last batch) is left out, as the dataset's iteration does."""
    if not len(remaining):
        return None
    row = remaining.rows(0, 1, *layout.rank_columns())[0]
    return row[row >= 0]


def first_needed_shards(remaining: Remaining | GridRemaining, layout: RankLayout, table: SampleMap,
                        steps: int) -> list[int]:
    """The shards this node's first ``steps`` global batches of ``remaining`` read, in the order needed."""
    flat = remaining.rows(0, steps, *layout.node_columns()).reshape(-1)
    shards, _ = table.locate(flat[flat >= 0])
    return list(dict.fromkeys(shards.tolist()))


class WarmUp:
    """Fetches the shards the first batches need, in the order needed, and reads the first batch's rows from
    the shards' seekable zstd zips before any whole shard is made.

    The node's local ranks split the shards; a process that needs one while another is making it waits for
    that copy instead of making its own (see ``ShardCache.ensure``). Shards already local and uncompressed
    need nothing. As many shards are made at once as this rank has cores, first needed first: the first
    batch's shards are not slowed down by later ones competing for the same cores. ``first_rows`` maps a
    shard to the future of its first-batch rows (a ``PartialShardReader``, or ``None`` when the zip has no
    seek table or anything failed: the batch is then made from whole shards, which meets and reports it).
    """

    def __init__(self, table: SampleMap, streams: Sequence[Stream], cache: ShardCache, cache_limit: int | None,
                 validate_hash: bool, allow_unsafe_types: bool) -> None:
        self.table, self.streams, self.cache = table, streams, cache
        self.cache_limit, self.validate_hash, self.allow_unsafe_types = cache_limit, validate_hash, allow_unsafe_types
        self.first_rows: dict[int, Future] = {}  # shard -> rows of the first batch read ahead
        self.first_rows_ids: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["first_rows"] = {}  # futures and readers of this process (a spawned DataLoader worker)
        return state

    def forget(self) -> None:
        """Drop the rows read ahead (a forked DataLoader worker inherits the main process's)."""
        self.first_rows = {}

    def shards(self, remaining: Remaining | GridRemaining, layout: RankLayout) -> list[int]:
        """The shards the warm-up makes, in the order needed: every shard this node's first global batch reads
        (the first batch waits for all of them: a shuffle over blocks of many shards spreads it over all of
        them), then the next batches' up to :data:`WARM_UP_SHARDS` in all; no more than half ``cache_limit``."""
        first = first_needed_shards(remaining, layout, self.table, 1)
        shards = first_needed_shards(remaining, layout, self.table, WARM_UP_STEPS)
        shards = shards[: max(len(first), WARM_UP_SHARDS)]
        if self.cache_limit is None:
            return shards
        room, kept = self.cache_limit // 2, []
        for shard in shards:
            room -= int(self.table.raw_bytes[shard] + self.table.zip_bytes[shard])
            if kept and room < 0:
                break
            kept.append(shard)
        return kept

    def start(self, remaining: Remaining | GridRemaining, layout: RankLayout) -> None:
        """Start the threads on this process's share (rank ``layout``) of the warm-up shards of ``remaining``."""
        try:
            shards = self.shards(remaining, layout)
        except Exception as exc:  # the iteration meets (and reports) any problem with the order itself
            log.debug("no warm-up: %r", exc)
            return
        mine = [s for i, s in enumerate(shards) if i % layout.local_world == layout.local_rank and not
                self.cache.is_local(s)]
        if not mine:
            return
        # Import what a fetch imports here, not in the threads: a DataLoader worker forked while a thread
        # imports a module would find that module's import lock held forever.
        import xxhash  # noqa: F401

        for shard in mine:
            comp.preload(self.table.shards[shard][1].get("compression"))
        try:
            rows = self._plan_first_rows(remaining, layout, set(mine))
        except Exception as exc:  # the first batch is then made from whole shards, which reports any problem
            log.debug("no rows read ahead: %r", exc)
            self.first_rows, rows = {}, []
        # claimed before any DataLoader worker exists, so every worker sees the claims
        todo: list[tuple[str, int, Any]] = [("whole", shard, self.cache.claim(shard)) for shard in mine]
        todo = [("rows", shard, task) for shard, task in rows] + todo
        todo.reverse()  # popped from the end: first needed, first made
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        for k in range(max(1, min(max(len(mine), len(rows)), cores // layout.local_world))):
            threading.Thread(target=self._warm_some, args=(todo,), daemon=True,
                             name=f"smalti-streaming-warm-up-{k}").start()

    def _plan_first_rows(self, remaining: Remaining | GridRemaining, layout: RankLayout,
                         mine: set[int]) -> list[tuple[int, tuple[np.ndarray, bool, Future]]]:
        """``(shard, (rows, download, future))`` for each shard of this rank's first batch whose rows the
        warm-up reads from the zip: zstd shards not local yet, whose zip is here or is this process's to
        download. The futures go to ``first_rows``."""
        self.first_rows, self.first_rows_ids = {}, None
        ids = first_batch_ids(remaining, layout)
        if ids is None:
            return []
        plan = []
        for shard, _, offs in self.table.groups(ids):
            si, entry = self.table.shards[shard]
            if not entry.get("zip_data") or (comp.parse(entry.get("compression")) or ("",))[0] != "zstd" or \
                    self.cache.is_local(shard):
                continue
            local = (self.streams[si].local_dir() / entry["zip_data"]["basename"]).exists()
            if local or shard in mine:
                self.first_rows[shard] = Future()
                plan.append((shard, (offs, not local, self.first_rows[shard])))
        self.first_rows_ids = ids
        return plan

    def _warm_some(self, todo: list[tuple[str, int, Any]]) -> None:
        while True:
            try:
                kind, shard, task = todo.pop()  # list.pop is atomic: each task goes to one thread
            except IndexError:
                return
            if kind == "rows":
                self._read_first_rows(shard, *task)
                continue
            mark = task
            try:
                if mark is not None:
                    mark.touch()  # starting now: peers waiting on it see progress from here
                self.cache.ensure(shard)
            except Exception as exc:  # the reader meets it again, and raises it, when it needs the shard
                log.debug("warm-up fetch of shard %d failed: %r", shard, exc)
            finally:
                self.cache.release(mark)
                self.first_rows.pop(shard, None)  # the whole copy is there: rows read ahead are not needed

    def _read_first_rows(self, shard: int, rows: np.ndarray, download: bool, future: Future) -> None:
        reader = None
        try:
            found = self.cache.local_zip(shard, download)
            if found is not None:
                si, entry = self.table.shards[shard]
                check = self.validate_hash and not found[1]
                reader = read_rows(found[0], entry, rows, self.streams[si].name, check, self.allow_unsafe_types)
                if reader is not None and check:
                    self.cache.zip_checked(shard)
        except Exception as exc:  # the whole shard's fetch meets it again and reports it
            log.debug("reading the first batch's rows of shard %d ahead failed: %r", shard, exc)
        finally:
            future.set_result(reader)

    def take_readers(self, ids: np.ndarray) -> dict[int, Any]:
        """The partial readers of the rows read ahead when ``ids`` is the batch they were read for; the rows
        read ahead are used once, then dropped."""
        use = bool(self.first_rows) and self.first_rows_ids is not None and np.array_equal(ids, self.first_rows_ids)
        ahead, self.first_rows = self.first_rows, {}
        readers = {}
        if use:
            for shard, future in list(ahead.items()):  # a warm-up thread may still pop from it
                reader = future.result()
                if reader is not None:
                    readers[shard] = reader
        return readers
