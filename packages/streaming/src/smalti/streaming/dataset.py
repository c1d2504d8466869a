"""``Stream`` and ``StreamingDataset``: MDS data from local disk or remote storage, shuffled, split and resumable."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from smalti.storage import is_temp_name
from smalti.streaming import compression as comp
from smalti.streaming.bundles import BUNDLE_SAMPLES, Bundle, _bundles
from smalti.streaming.cache import ShardCache
from smalti.streaming.epoch_plan import ArrayOrder, EpochOrder, GridRemaining, LazyOrder, Remaining
from smalti.streaming.errors import StreamingError
from smalti.streaming.fetch_plan import CacheNeeds, FetchPlan, cache_needs
from smalti.streaming.index_trust import (
    check_local_lengths,
    remote_table,
    secure_stream_folder,
    sync_index,
)
from smalti.streaming.mds import INDEX, check_columns, parse_size, read_index
from smalti.streaming.order import (
    DEFAULT_SHUFFLE,
    LAZY_SHUFFLES,
    LEGACY_SHUFFLE,
    SHUFFLES,
    default_block_size,
    lazy_order,
    select_samples,
    sequential_order,
    shuffle_order,
    split_selection,
    stream_counts,
)
from smalti.streaming.order_blocks import BlockOrder
from smalti.streaming.order_mosaic import MOSAIC_ALGOS, mosaic_work
from smalti.streaming.partial import read_rows
from smalti.streaming.shard_table import ShardList, ShardTable
from smalti.streaming.storage import Fetcher
from smalti.streaming.stream import Stream, parse_schedule_time

log = logging.getLogger(__name__)

BATCHING_METHODS = ("random", "stratified", "per_stream", "device_per_stream")
PARTITION_ALGOS = ("orig", "relaxed")
WARM_UP_STEPS = 2  # global batches whose shards the dataset starts fetching at construction: all of the
WARM_UP_SHARDS = 4  # first's, the next's up to this many in all; in the order needed, one thread per core
STALE_TMP_S = 15 * 60  # a download's temporary file untouched this long belongs to a dead process
_SEGMENT_SEED = 1_000_003  # seed offset between the segments of an epoch with a mid-epoch curriculum change


@functools.lru_cache(maxsize=64)
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _world() -> tuple[int, int, int, int]:
    """``(rank, world size, local rank, local world size)`` from the process group or torchrun's environment."""
    import torch.distributed as dist

    env = os.environ
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    return rank, world, int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1))


class StreamingDataset(IterableDataset):
    """Streams samples from MDS shards; also supports ``len()`` (this rank's samples per epoch) and ``ds[i]``.

    Each rank reads ``batch_size`` samples of every global batch; the global batches depend only on the
    seed, ``num_canonical_nodes`` and ``batch_size * data-parallel ranks`` (see :mod:`smalti.streaming.order`),
    except under mosaicml-streaming's algorithms, which give every rank that library's order (see
    :meth:`mosaic_layout`).
    ``rank``/``world_size`` default to the process group or torchrun's environment, ``local_world_size`` (ranks
    per node) to ``LOCAL_WORLD_SIZE``. ``shuffle_algo`` defaults to ``keyed`` (see
    :mod:`smalti.streaming.order_keyed`), or the checkpoint's on resume. ``num_canonical_nodes`` defaults to the node count (64x for
    ``py1s``/``py2s``) and is kept from a checkpoint; ``partition_algo="orig"`` requires the node count to
    divide it or be a multiple of it, ``"relaxed"`` (default) does not. ``proportion_schedule`` entries
    (``{"at": "100ba" | "3200sp" | "2ep", "proportions": [...]}``) change the stream mix, mid-epoch
    included (see the README). Call :meth:`set_epoch`
    before each epoch (smalti's trainer does; iterating in-process or through
    :class:`~smalti.streaming.StreamingDataLoader` also advances it). :meth:`state_dict` /
    :meth:`load_state_dict` resume mid-epoch without replaying it.
    """

    #: ``state_dict()`` is a position in the epoch's global order: a checkpoint resumes on any data-parallel
    #: size (smalti-core's ``GLOBAL_POSITION`` protocol)
    position_is_global = True

    def __init__(
        self,
        *,
        streams: list[Stream] | None = None,
        remote: str | None = None,
        local: str | None = None,
        split: str | None = None,
        batch_size: int | None = None,
        shuffle: bool = False,
        shuffle_algo: str | None = None,
        shuffle_seed: int = 9176,
        shuffle_block_size: int | None = None,
        num_canonical_nodes: int | None = None,
        partition_algo: str = "relaxed",
        batching_method: str = "random",
        epoch_size: int | None = None,
        cache_limit: int | str | None = None,
        predownload: int | None = None,
        replication: int | None = None,
        download_retry: int = 2,
        download_timeout: float = 60.0,
        validate_hash: bool = True,
        allow_unsafe_types: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        local_world_size: int | None = None,
        proportion_schedule: list[dict[str, Any]] | None = None,
    ) -> None:
        if streams is None:
            if remote is None and local is None:
                raise StreamingError("give streams=[Stream(...)] or remote/local")
            streams = [Stream(remote=remote, local=local, split=split)]
        elif remote is not None or local is not None:
            raise StreamingError("give either streams or remote/local, not both")
        streams = [Stream(**dict(s)) if isinstance(s, Mapping) else s for s in streams]  # mappings from YAML
        if batching_method not in BATCHING_METHODS:
            raise StreamingError(f"batching_method={batching_method!r} is not one of {', '.join(BATCHING_METHODS)}")
        if partition_algo not in PARTITION_ALGOS:
            raise StreamingError(f"partition_algo={partition_algo!r} is not one of {', '.join(PARTITION_ALGOS)}")
        self._algo_given = shuffle_algo is not None
        shuffle_algo = DEFAULT_SHUFFLE if shuffle_algo is None else shuffle_algo
        if shuffle_algo not in SHUFFLES:
            raise StreamingError(f"shuffle_algo={shuffle_algo!r} is not one of {', '.join(SHUFFLES)}")
        self.streams = streams
        env_rank, env_world, _, env_local_world = _world()
        explicit = rank is not None or world_size is not None
        self.rank = env_rank if rank is None else rank
        self.world_size = env_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise StreamingError(f"rank={self.rank} is not in a world of {self.world_size}")
        # Ranks are numbered node by node; the processes of one node share its cache directory and split the
        # downloads (see smalti.streaming.cache).
        if local_world_size is None:
            local_world_size = env_local_world
            if explicit and (self.world_size % local_world_size or local_world_size > self.world_size):
                local_world_size = 1  # the environment describes another world than the one given here
        if local_world_size < 1 or self.world_size % local_world_size:
            raise StreamingError(f"local_world_size={local_world_size} (ranks per node) must divide the world "
                                 f"size {self.world_size}")
        self.local_world = local_world_size
        self.local_rank = self.rank % self.local_world
        self.physical_nodes = self.world_size // self.local_world
        self.replication = replication or 1
        if self.world_size % self.replication:
            raise StreamingError(f"replication={self.replication} must divide the world size {self.world_size}")
        self.dp_world = self.world_size // self.replication
        self.dp_rank = self.rank // self.replication
        if batch_size is not None and batch_size < 1:
            raise StreamingError(f"batch_size={batch_size} must be a positive number of samples per rank")
        self.batch_size = batch_size or 1
        self.shuffle, self.shuffle_algo, self.shuffle_seed = shuffle, shuffle_algo, shuffle_seed
        self.shuffle_block_size = shuffle_block_size
        self.partition_algo = partition_algo
        self._ncn_given = num_canonical_nodes is not None
        if num_canonical_nodes is None:  # mosaicml-streaming's default: the first run's node count (x64 for py*s)
            num_canonical_nodes = self.physical_nodes * (64 if shuffle_algo in ("py1s", "py2s") else 1)
        if num_canonical_nodes < 1:
            raise StreamingError(f"num_canonical_nodes={num_canonical_nodes} must be a positive number")
        self.num_canonical_nodes = num_canonical_nodes
        self._check_partition()
        self.batching_method = batching_method
        self.epoch_size = epoch_size
        self.predownload = 8 * self.batch_size if predownload is None else predownload
        self.download_retry, self.download_timeout = download_retry, download_timeout
        self._fetcher = Fetcher(download_retry, download_timeout)
        self.validate_hash = validate_hash
        self.allow_unsafe_types = allow_unsafe_types
        self.proportion_schedule = self._check_schedule(proportion_schedule or [], len(streams))
        self._stream_names = [s.name for s in streams]
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, global samples already consumed in it)
        self._consumed = 0  # samples this process handed out in the current epoch (this rank's share)
        self._counted_by_loader = False
        self._order_cache: dict[tuple[Any, ...], EpochOrder | np.ndarray] = {}  # orders; mosaic grids
        self._initial_nodes: int | None = None  # the first run's node count, once resumed on another
        self._first_rows: dict[int, Future] = {}  # shard -> rows of the first batch read ahead (see _warm_up)
        self._first_rows_ids: np.ndarray | None = None
        shards = ShardList([self._load_stream_index(stream) for stream in streams])  # (stream, entry) on use
        self._stream_shards = [shards.stream_ids(si) for si in range(len(streams))]
        self._shards = shards
        self._shard_starts = np.concatenate([[0], np.cumsum(shards.samples)])
        self.num_samples = int(self._shard_starts[-1])
        if self.num_samples == 0:
            raise StreamingError(f"streams {[s.name for s in streams]} hold no samples")
        self._stream_sizes = [int(shards.samples[ids.start : ids.stop].sum()) for ids in self._stream_shards]
        self._epoch_plan(0)  # bad weights (a stream without a proportion among proportions) fail here
        self.cache_limit = parse_size(cache_limit, "cache_limit") if cache_limit is not None else None
        if self.cache_limit is not None:
            largest = int((shards.raw_bytes + shards.zip_bytes).max())
            if self.cache_limit < largest:
                raise StreamingError(f"cache_limit={self.cache_limit} bytes is smaller than the largest shard "
                                     f"({largest} bytes with its zip); raise cache_limit")
        self.cache = ShardCache(streams, shards, self.cache_limit, self._fetcher, validate_hash,
                                allow_unsafe_types=allow_unsafe_types)
        self._remove_stale_downloads()
        self._needs: tuple[tuple[int, int], CacheNeeds] | None = None
        self._warm_up()
        if self.cache_limit is not None:
            self._report_cache_needs()

    def cache_needs(self, epoch: int | None = None) -> CacheNeeds:
        """What this node's share of epoch ``epoch`` (default: the current one, from the resume position) asks
        of the shard cache: the smallest ``cache_limit`` that fetches every shard once, and the order's
        locality (distinct shards per window of global batches). Measured on the order, a chunk at a time;
        past ``fetch_plan.NEEDS_WALK_SAMPLES`` node samples, on the epoch's beginning."""
        epoch = self.epoch if epoch is None else epoch
        start = self._resume[1] if self._resume and self._resume[0] == epoch else 0
        if self._needs is not None and self._needs[0] == (epoch, start):
            return self._needs[1]
        remote = np.array([s.remote is not None for s in self.streams], dtype=bool)
        sizes = np.where(remote[self._shards.stream], self._shards.raw_bytes, 0)  # local-only: never evicted
        window = max(1, -(-self.predownload // self.batch_size))
        needs = cache_needs(self._remaining(epoch), self._node_columns(), self._locate, sizes, window)
        self._needs = ((epoch, start), needs)
        return needs

    def _report_cache_needs(self) -> None:
        """Say (once per node) the cache this layout and order need, warning when ``cache_limit`` is below it."""
        try:
            needs = self.cache_needs()
        except Exception as exc:  # the iteration meets (and reports) any problem with the order itself
            log.debug("cache needs not measured: %r", exc)
            return
        if self.local_rank == 0:
            log.info("streaming %s: %s", ", ".join(self._stream_names), needs.describe())
            if self.cache_limit is not None and self.cache_limit < needs.min_cache_bytes:
                log.warning("cache_limit=%d bytes is below the %d bytes this node's order needs at once: shards "
                            "will be fetched again after eviction (slower; see StreamingDataset.metrics())",
                            self.cache_limit, needs.min_cache_bytes)

    def metrics(self) -> dict[str, int]:
        """Counters of this rank's shard cache (its main process and DataLoader workers): ``fetches`` (copies
        made) and ``refetches`` (of shards evicted before this rank read them for the last time this epoch)."""
        return self.cache.counts()

    def _first_needed_shards(self, steps: int) -> list[int]:
        """The shards this node's first ``steps`` global batches of the current epoch read, in the order needed."""
        lo, hi = self._node_columns()
        flat = self._remaining(self.epoch).rows(0, steps, lo, hi).reshape(-1)
        shards, _ = self._locate(flat[flat >= 0])
        return list(dict.fromkeys(shards.tolist()))

    def _warm_up_shards(self) -> list[int]:
        """The shards the warm-up makes, in the order needed: every shard this node's first global batch reads
        (the first batch waits for all of them: a shuffle over blocks of many shards spreads it over all of
        them), then the next batches' up to :data:`WARM_UP_SHARDS` in all; no more than half ``cache_limit``."""
        first = self._first_needed_shards(1)
        shards = self._first_needed_shards(WARM_UP_STEPS)[: max(len(first), WARM_UP_SHARDS)]
        if self.cache_limit is None:
            return shards
        room, kept = self.cache_limit // 2, []
        for shard in shards:
            entry = self._shards[shard][1]
            room -= entry["raw_data"]["bytes"] + ((entry.get("zip_data") or {}).get("bytes") or 0)
            if kept and room < 0:
                break
            kept.append(shard)
        return kept

    def _warm_up(self) -> None:
        """Start fetching the shards the first batches need now, in background threads of this process.

        The download and decompression then overlap whatever comes before the first batch (building the
        model, starting DataLoader workers, computing the order in them). The node's local ranks split these
        shards; a process that needs one while another is making it waits for that copy instead of making
        its own (see ``ShardCache.ensure``). Shards already local and uncompressed need nothing. The shards
        are made in the order the batches need them, as many at once as this rank has cores: the first
        batch's shards are not slowed down by later ones competing for the same cores.

        Before any whole shard, the threads read this rank's first batch from the shards' seekable zstd zips
        (see :meth:`_plan_first_rows`), for :class:`~smalti.streaming.StreamingDataLoader` to make that batch
        without waiting for whole shards.
        """
        if self.predownload <= 0:
            return
        try:
            shards = self._warm_up_shards()
        except Exception as exc:  # the iteration meets (and reports) any problem with the order itself
            log.debug("no warm-up: %r", exc)
            return
        mine = [s for i, s in enumerate(shards) if i % self.local_world == self.local_rank and not
                self.cache.is_local(s)]
        if not mine:
            return
        # Import what a fetch imports here, not in the threads: a DataLoader worker forked while a thread
        # imports a module would find that module's import lock held forever.
        import xxhash  # noqa: F401

        for shard in mine:
            comp.preload(self._shards[shard][1].get("compression"))
        try:
            rows = self._plan_first_rows(set(mine))
        except Exception as exc:  # the first batch is then made from whole shards, which reports any problem
            log.debug("no rows read ahead: %r", exc)
            self._first_rows, rows = {}, []
        # claimed before any DataLoader worker exists, so every worker sees the claims
        todo: list[tuple[str, int, Any]] = [("whole", shard, self.cache.claim(shard)) for shard in mine]
        todo = [("rows", shard, task) for shard, task in rows] + todo
        todo.reverse()  # popped from the end: first needed, first made
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        for k in range(max(1, min(max(len(mine), len(rows)), cores // self.local_world))):
            threading.Thread(target=self._warm_some, args=(todo,), daemon=True,
                             name=f"smalti-streaming-warm-up-{k}").start()

    def _first_batch_ids(self) -> np.ndarray | None:
        """The sample ids of this rank's first batch in what remains of the current epoch (``None``: nothing
        remains). ``-1`` (the padding of a resumed epoch's last batch) is left out, as :meth:`_steps` does."""
        remaining = self._remaining(self.epoch)
        if not len(remaining):
            return None
        row = remaining.rows(0, 1, self.dp_rank * self.batch_size, (self.dp_rank + 1) * self.batch_size)[0]
        return row[row >= 0]

    def _node_columns(self) -> tuple[int, int]:
        """The columns ``[lo, hi)`` of every global batch that the ranks of this rank's physical node read."""
        b = self.batch_size
        first_rank = self.rank // self.local_world * self.local_world
        lo = first_rank // self.replication
        hi = (first_rank + self.local_world - 1) // self.replication + 1
        return lo * b, hi * b

    def _plan_first_rows(self, mine: set[int]) -> list[tuple[int, tuple[np.ndarray, bool, Future]]]:
        """``(shard, (rows, download, future))`` for each shard of this rank's first batch whose rows the
        warm-up reads from the zip: zstd shards not local yet, whose zip is here or is this process's to
        download. The futures (in ``self._first_rows``) receive a ``PartialShardReader``, or ``None`` when
        the zip has no seek table or anything fails (the batch is then made from whole shards, which meets
        and reports the failure)."""
        self._first_rows, self._first_rows_ids = {}, None
        ids = self._first_batch_ids()
        if ids is None:
            return []
        plan = []
        for shard, _, offs in self._groups(ids):
            si, entry = self._shards[shard]
            if not entry.get("zip_data") or (comp.parse(entry.get("compression")) or ("",))[0] != "zstd" or \
                    self.cache.is_local(shard):
                continue
            local = (self.streams[si].local_dir() / entry["zip_data"]["basename"]).exists()
            if local or shard in mine:
                self._first_rows[shard] = Future()
                plan.append((shard, (offs, not local, self._first_rows[shard])))
        self._first_rows_ids = ids
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
                self._first_rows.pop(shard, None)  # the whole copy is there: rows read ahead are not needed

    def _read_first_rows(self, shard: int, rows: np.ndarray, download: bool, future: Future) -> None:
        reader = None
        try:
            found = self.cache.local_zip(shard, download)
            if found is not None:
                si, entry = self._shards[shard]
                check = self.validate_hash and not found[1]
                reader = read_rows(found[0], entry, rows, self.streams[si].name, check, self.allow_unsafe_types)
                if reader is not None and check:
                    self.cache.zip_checked(shard)
        except Exception as exc:  # the whole shard's fetch meets it again and reports it
            log.debug("reading the first batch's rows of shard %d ahead failed: %r", shard, exc)
        finally:
            future.set_result(reader)

    def _rows_ahead(self, ids: np.ndarray) -> bool:
        """Whether the warm-up is reading the rows of batch ``ids`` from seekable zips (see :meth:`_first_batch`)."""
        return bool(self._first_rows) and self._first_rows_ids is not None and \
            np.array_equal(ids, self._first_rows_ids)

    def _first_batch(self, ids: np.ndarray) -> dict[str, Any] | None:
        """The batch of samples ``ids`` (this process's first of the epoch) made here, column by column, from
        the rows the warm-up read ahead where it did and from whole shards elsewhere; ``None`` when the
        shards are not columnar. The rows read ahead are used once, then dropped."""
        use = self._rows_ahead(ids)
        ahead, self._first_rows = self._first_rows, {}
        readers = {}
        if use:
            for shard, future in list(ahead.items()):  # a warm-up thread may still pop from it
                reader = future.result()
                if reader is not None:
                    readers[shard] = reader
        return self._columnar_batch(ids, None, readers=readers)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_first_rows"] = {}  # futures and readers of this process (a spawned DataLoader worker)
        return state

    def _check_partition(self, ncn: int | None = None) -> None:
        ncn, nodes = ncn or self.num_canonical_nodes, self.physical_nodes
        if self.partition_algo == "orig" and ncn % nodes and nodes % ncn:
            raise StreamingError(
                f"partition_algo='orig' needs the node count ({nodes} = world size {self.world_size} / "
                f"{self.local_world} ranks per node) to divide num_canonical_nodes={ncn} or be a multiple of it; "
                "change num_canonical_nodes or use partition_algo='relaxed'"
            )

    def _remove_stale_downloads(self) -> None:
        """Delete temporary download files that a killed process left behind (untouched for ``STALE_TMP_S``)."""
        dirs = {s.local_dir() / folder for si, s in enumerate(self.streams) for folder in self._shards.raw_folders(si)}
        dirs |= {s.local_dir() for s in self.streams}
        cutoff = time.time() - STALE_TMP_S
        for folder in dirs:
            if not folder.is_dir():
                continue
            for tmp in folder.glob(".*"):
                if not (is_temp_name(tmp.name) or tmp.name.endswith(".tmp")):  # .tmp: left by older versions
                    continue
                try:
                    if tmp.stat().st_mtime < cutoff:
                        tmp.unlink()
                        log.debug("removed stale temporary download %s", tmp)
                except FileNotFoundError:
                    pass

    @staticmethod
    def _check_schedule(schedule: list[dict[str, Any]], num_streams: int) -> list[tuple[int, str, list[float]]]:
        """``[{"at": "100ba", "proportions": [1, 3]}, ...]`` -> ``(value, unit, proportions)`` in the given order."""
        out = []
        for item in schedule:
            if not isinstance(item, Mapping) or "at" not in item:
                raise StreamingError(f"proportion_schedule: each entry needs 'at' and 'proportions', got {item!r}")
            value, unit = parse_schedule_time(item["at"])
            props = [float(p) for p in item.get("proportions") or []]
            if len(props) != num_streams or min(props, default=0) < 0 or not sum(props):
                raise StreamingError(f"proportion_schedule at {item['at']}: give {num_streams} non-negative "
                                     f"proportions (not all zero), got {item.get('proportions')}")
            out.append((value, unit, props))
        return out

    def _epoch_plan(self, epoch: int) -> tuple[int, list[tuple[int, list[tuple[str, float | int | None]]]]]:
        """Epoch ``epoch``'s sample count before padding, and its segments ``(first offset, stream weights)``.

        A schedule entry takes effect at a global sample position: ``Nep`` at the start of epoch N, ``Xba``
        after X global batches, ``Ysp`` after Y samples. Epochs are laid end to end at their padded lengths
        (whole global batches), each as long as the weights at its start make it. An entry that falls inside
        an epoch starts a new segment there.
        """
        global_batch = self.batch_size * self.dp_world
        base = [s.weight for s in self.streams]
        starts: list[int] = []
        start = 0
        for e in range(epoch + 1):
            starts.append(start)
            points = []
            for i, (value, unit, props) in enumerate(self.proportion_schedule):
                if unit == "ep":
                    if value <= e:
                        points.append((starts[value], i, props))
                else:
                    points.append((value * global_batch if unit == "ba" else value, i, props))
            points.sort(key=lambda p: (p[0], p[1]))
            weights = base
            for pos, _, props in points:
                if pos <= start:
                    weights = [("proportion", p) for p in props]
            total = int(sum(stream_counts(self._stream_sizes, weights, self.epoch_size, 0, self._stream_names)))
            segments = [(0, weights)]
            for pos, _, props in points:
                if start < pos < start + total:
                    seg = (pos - start, [("proportion", p) for p in props])
                    if segments[-1][0] == seg[0]:
                        segments[-1] = seg
                    else:
                        segments.append(seg)
            if e == epoch:
                return total, segments
            start += -(-total // global_batch) * global_batch
        raise AssertionError("unreachable")

    def weights_for_epoch(self, epoch: int) -> list[tuple[str, float | int | None]]:
        """The streams' weights at the start of ``epoch``: their own, or the latest ``proportion_schedule`` entry."""
        return self._epoch_plan(epoch)[1][0][1]

    # ------------------------------------------------------------------ index and shards

    def _load_stream_index(self, stream: Stream) -> Sequence[dict[str, Any]]:
        """The shard entries of ``stream``'s index, checked; with a remote, the remote's index is fetched and the
        local copy made equal to it (a cached index is never trusted over the remote's). Read from the
        ``index.npz`` beside it when that matches it (see :mod:`smalti.streaming.shard_table`)."""
        local = stream.local_dir() / INDEX
        remote = stream.remote_root()
        secure_stream_folder(stream)
        index_bytes, npz = None, True
        if remote is not None:
            index_bytes = self._fetcher.get_bytes(remote, INDEX)
            sync_index(stream, index_bytes)
            npz = remote_table(self._fetcher, remote, stream.name)
        if not local.exists():
            raise StreamingError(f"stream {stream.name}: no {INDEX} at {local} and no remote to fetch it from")
        entries = read_index(local, index_bytes, npz)
        for entry in entries.configs_as_entries() if isinstance(entries, ShardTable) else entries:
            check_columns(entry, self.allow_unsafe_types, f"stream {stream.name} ({local})")
        if remote is None:
            check_local_lengths(stream.local_dir(), entries, local)
        return entries

    def _locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shard and offset in it of each global sample id."""
        shards = np.searchsorted(self._shard_starts, samples, side="right") - 1
        return shards, samples - self._shard_starts[shards]

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Sample ``index`` of the whole dataset (all streams, in shard order)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is out of range for {self.num_samples} samples")
        shards, offsets = self._locate(np.array([index]))
        return self.transform_sample(self.cache.reader(int(shards[0]))[int(offsets[0])])

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Samples ``indices`` in that order, equal to ``[ds[i] for i in indices]``, fetched shard by shard.

        Torch's map-style fetchers (a ``Subset`` of this dataset, for one) call it with a whole batch.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        bad = idx[(idx < 0) | (idx >= self.num_samples)]
        if len(bad):
            raise IndexError(f"sample {int(bad[0])} is out of range for {self.num_samples} samples")
        return self._gather(idx)

    def _groups(self, ids: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``(shard, positions in ids, offsets in the shard)`` for each shard ``ids`` touch, in first-use order."""
        if not len(ids):
            return []
        shards, offsets = self._locate(ids)
        first_shard = shards[0]
        if shards[-1] == first_shard and (shards == first_shard).all():
            return [(int(first_shard), np.arange(len(ids)), offsets)]
        unique, first, inverse = np.unique(shards, return_index=True, return_inverse=True)
        by_shard = np.argsort(inverse, kind="stable")  # positions grouped by shard, in order within each
        ends = np.cumsum(np.bincount(inverse.reshape(-1), minlength=len(unique)))
        starts = ends - np.bincount(inverse.reshape(-1), minlength=len(unique))
        out = []
        for k in np.argsort(first, kind="stable").tolist():
            pos = by_shard[starts[k] : ends[k]]
            out.append((int(unique[k]), pos, offsets[pos]))
        return out

    def _gather(self, ids: np.ndarray, plan: FetchPlan | None = None) -> list[Any]:
        """The samples of global ids ``ids``, in order (one reader call per shard), each through
        :meth:`transform_sample`."""
        out: list[Any] = [None] * len(ids)
        transform = self.transform_sample
        for shard, pos, offs in self._groups(ids):
            reader = self.cache.reader(shard, plan.defer(shard) if plan is not None else False)
            for p, sample in zip(pos.tolist(), reader.gather(offs)):
                out[p] = transform(sample)
        return out

    def transform_sample(self, sample: dict[str, Any]) -> Any:
        """What a sample read from the shards becomes (default: itself). A subclass that changes samples
        overrides this and, to keep the fast batch path, :meth:`transform_batch` with the same conversion
        applied to a whole batch; overriding only this one sends batches sample by sample."""
        return sample

    def transform_batch(self, batch: dict[str, torch.Tensor]) -> Any:
        """What a batch of columnar samples (``default_collate`` of the raw samples: one tensor per column,
        made in one copy per column) becomes (default: itself). Must equal ``default_collate`` of the
        samples through :meth:`transform_sample`; the fast batch path calls it once per batch, in the
        process that makes the batch."""
        return batch

    def _columnar_batch(self, ids: np.ndarray, plan: FetchPlan | None,
                        readers: dict[int, Any] | None = None) -> Any | None:
        """The batch of samples ``ids`` made column by column and through :meth:`transform_batch`; ``None``
        when the shards are not columnar."""
        batch = self._collate_columns(ids, plan, readers=readers)
        return None if batch is None else self.transform_batch(batch)

    def _columns(self, ids: np.ndarray, plan: FetchPlan | None, vouched: bool = False,
                 readers: dict[int, Any] | None = None) -> tuple[Any, ...] | None:
        """``(groups, column views per group, layout)`` of samples ``ids``; ``None`` when a shard is not
        columnar (see ``ShardReader.column_views``), the shards' columns differ, or a column is a uint64
        scalar (``default_collate`` refuses those: the per-sample path lets it say so). ``readers``: partial
        readers to use instead of the cache's for some shards (their rows are loaded here)."""
        groups = self._groups(ids)
        views, layout = [], None
        for shard, _, offs in groups:
            reader = readers.get(shard) if readers else None
            if reader is not None:
                reader.load_rows(offs)
            else:
                reader = self.cache.reader(shard, plan.defer(shard) if plan is not None else False,
                                           vouched=vouched)
            v = reader.column_views()
            if v is None or (layout is not None and reader.column_layout != layout):
                return None
            layout = reader.column_layout
            views.append(v)
        if any(dtype == np.uint64 and not shape for _, dtype, shape in layout):
            return None
        return groups, views, layout

    def _bundle(self, batches: list[np.ndarray], plan: FetchPlan | None) -> Bundle:
        """A worker's :class:`Bundle` of ``batches`` (sample ids): references once their shards are local,
        checked and columnar; else the batches collated here."""
        if not batches:
            return Bundle(refs=[])
        if self._columns(np.concatenate(batches), plan) is not None:
            return Bundle(refs=batches)
        out = []
        for ids in batches:
            batch = self._columnar_batch(ids, plan)
            out.append(default_collate(self._gather(ids, plan)) if batch is None else batch)
        return Bundle(batches=out)

    def resolve(self, bundle: Bundle) -> list[dict[str, Any]]:
        """The batches of a worker's :class:`Bundle`, references gathered here from this node's shard copies.

        The worker that made the references has just fetched and checked those copies, so they are opened
        without hashing them again (a copy made again since, after an eviction, is checked as usual). The
        bundle is gathered in one pass; each batch's tensors are consecutive rows of one allocation.
        """
        if bundle.refs is None:
            return bundle.batches or []
        if not bundle.refs:
            return []
        ids = np.concatenate(bundle.refs)
        batch = self._collate_columns(ids, None, vouched=True)
        if batch is None:
            raise StreamingError(f"a worker's batch of samples {ids[:4].tolist()}... is in shards that are not "
                                 "columnar here: the dataset changed under the loader")
        sizes = [len(r) for r in bundle.refs]
        if len(sizes) == 1:
            return [self.transform_batch(batch)]
        parts = {name: torch.split(t, sizes) for name, t in batch.items()}
        return [self.transform_batch({name: p[i] for name, p in parts.items()}) for i in range(len(sizes))]

    def _collate_columns(self, ids: np.ndarray, plan: FetchPlan | None, vouched: bool = False,
                         readers: dict[int, Any] | None = None) -> dict[str, Any] | None:
        """The batch ``default_collate`` would make of samples ``ids``, built column by column; ``None`` when
        the shards are not columnar (see :meth:`_columns`).

        Each column is gathered straight into one tensor (in shared memory inside a DataLoader worker, as
        ``default_collate`` does).
        """
        found = self._columns(ids, plan, vouched, readers)
        if found is None:
            return None
        groups, views, layout = found
        shared = get_worker_info() is not None
        batch = {}
        for name, dtype, shape in layout:
            out = torch.empty((len(ids), *shape), dtype=_torch_dtype(dtype))
            if shared:
                out.share_memory_()
            dst = out.numpy()
            if len(groups) == 1:
                np.take(views[0][name], groups[0][2], axis=0, out=dst)
            else:
                for (_, pos, offs), v in zip(groups, views):
                    dst[pos] = v[name][offs]
            batch[name] = out
        return batch

    # ------------------------------------------------------------------ epochs

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from the next iteration on."""
        if epoch != self.epoch:
            self._consumed = 0
        self.epoch = epoch

    def _shard_ids(self, shards: list[int]) -> list[np.ndarray]:
        return [np.arange(self._shard_starts[s], self._shard_starts[s + 1]) for s in shards]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The global sample order of ``epoch``, padded to whole global batches (a pure function of the settings).

        Materialised, so memory grows with the samples: for inspection and small datasets. Iteration never
        calls it; with the ``blocks`` shuffle it computes each batch's ids when it needs them.
        """
        return self._order(epoch).full()

    def _order(self, epoch: int) -> EpochOrder:
        """Epoch ``epoch``'s order, computed once per setting (the last one is kept)."""
        global_batch = self.batch_size * self.dp_world
        key = (epoch, global_batch, self.batching_method, self.shuffle, self.shuffle_algo, self.shuffle_seed,
               self.shuffle_block_size, self.num_canonical_nodes, self.epoch_size, repr(self.proportion_schedule))
        order = self._order_cache.get(key)
        if order is None:
            blocks = self._block_order(epoch, global_batch)
            order = LazyOrder(blocks) if blocks is not None else \
                ArrayOrder(*self._sequence(epoch, global_batch), global_batch)
            self._order_cache = {key: order}
        return order

    def _block_order(self, epoch: int, global_batch: int) -> BlockOrder | None:
        """The epoch's ``blocks`` or ``keyed`` order (:func:`lazy_order`), when it can be computed lazily: one stream
        mix for the whole epoch, every stream read a whole number of times, one sequence for all streams
        (``random`` batching or one stream). It equals the order :meth:`_compute_order` materialises."""
        if not (self.shuffle and self.shuffle_algo in LAZY_SHUFFLES):
            return None
        if not (self.batching_method == "random" or len(self.streams) == 1):
            return None
        _, segments = self._epoch_plan(epoch)
        if len(segments) != 1:
            return None
        counts = stream_counts(self._stream_sizes, segments[0][1], self.epoch_size, self.shuffle_seed + epoch,
                               self._stream_names)
        if any(size and count % size or not size and count for count, size in zip(counts, self._stream_sizes)):
            return None  # a part of a stream is chosen at random: select_samples picks it sample by sample
        starts = self._shard_starts
        picked = [np.tile(np.asarray(ids, dtype=np.int64), count // size)
                  for ids, count, size in zip(self._stream_shards, counts, self._stream_sizes) if size]
        shards = np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)
        if not len(shards):
            return None
        return lazy_order(self.shuffle_algo, starts[shards + 1] - starts[shards], seed=self.shuffle_seed,
                          epoch=epoch, num_canonical_nodes=self.num_canonical_nodes, global_batch=global_batch,
                          block_size=self.shuffle_block_size, shard_first_ids=starts[shards])

    def _compute_order(self, epoch: int, global_batch: int) -> np.ndarray:
        """The epoch's whole order as one array (every shuffle, curriculum and batching method)."""
        return ArrayOrder(*self._sequence(epoch, global_batch), global_batch).full()

    def _sequence(self, epoch: int, global_batch: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The epoch's samples in order before padding and grouping, with each one's canonical node; for the
        batching methods that keep streams apart, whole global batches as they are read and no nodes."""
        total, segments = self._epoch_plan(epoch)
        names = self._stream_names
        if len(segments) == 1:
            seg_counts = [stream_counts(self._stream_sizes, segments[0][1], self.epoch_size,
                                        self.shuffle_seed + epoch, names)]
        else:
            ends = [offset for offset, _ in segments[1:]] + [total]
            seg_counts = [self._segment_counts(weights, end - offset, global_batch,
                                               self.shuffle_seed + epoch + _SEGMENT_SEED * k)
                          for k, ((offset, weights), end) in enumerate(zip(segments, ends))]
        # Each stream's samples for the whole epoch, then cut into the segments' shares (whole shard runs).
        per_segment: list[list[list[np.ndarray]]] = [[] for _ in seg_counts]
        for si, ids in enumerate(self._stream_shards):
            counts = [c[si] for c in seg_counts]
            chosen = select_samples(self._shard_ids(ids), sum(counts), self.shuffle_seed + 1000 * si, epoch)
            parts = [chosen] if len(counts) == 1 else split_selection(
                chosen, counts, self.shuffle_seed + epoch + 1000 * si + _SEGMENT_SEED)
            for k, part in enumerate(parts):
                per_segment[k].append(part)
        random = self.batching_method == "random" or len(self.streams) == 1
        orders, nodes = [], []
        for k, per_stream in enumerate(per_segment):
            order, node = self._arrange(per_stream, epoch, global_batch, self.shuffle_seed + _SEGMENT_SEED * k)
            orders.append(order)
            nodes.append(node)
        order = np.concatenate(orders) if orders else np.zeros(0, dtype=np.int64)
        if not random:
            return order, None
        return order, np.concatenate(nodes)

    def _segment_counts(self, weights: list[tuple[str, float | int | None]], size: int, global_batch: int,
                        seed: int) -> list[int]:
        """Per-stream samples of a ``size``-sample segment of a curriculum epoch.

        The batching methods that keep streams apart in whole units (global batches for ``per_stream``, device
        batches for ``device_per_stream``, every global batch's per-stream share for ``stratified``) get counts
        in whole units, so a segment that is whole global batches long is used entirely and the next segment
        starts exactly where the schedule says.
        """
        sizes, names = self._stream_sizes, self._stream_names
        method = self.batching_method if len(self.streams) > 1 else "random"
        if method == "stratified":
            per_batch = stream_counts(sizes, weights, global_batch, seed, names)
            return [c * (size // global_batch) for c in per_batch]
        unit = {"per_stream": global_batch, "device_per_stream": self.batch_size}.get(method)
        if unit is None:
            return stream_counts(sizes, weights, size, seed, names)
        if size < unit:
            return [0] * len(sizes)
        return [c * unit for c in stream_counts(sizes, weights, size // unit, seed, names)]

    def _arrange(self, per_stream: list[list[np.ndarray]], epoch: int, global_batch: int,
                 seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Order one segment's samples (per stream, per shard) by the shuffle and the batching method.

        ``random``: the shuffled order and each entry's canonical node, unpadded. The other methods: whole
        global batches (an incomplete last one is dropped) and no node labels.
        """

        def order_of(shards: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
            if not self.shuffle:
                return sequential_order(shards, self.num_canonical_nodes)
            return shuffle_order(shards, self.shuffle_algo, seed, epoch, self.num_canonical_nodes,
                                 self.shuffle_block_size)

        empty = np.zeros(0, dtype=np.int64)
        if self.batching_method == "random" or len(self.streams) == 1:
            return order_of([s for shards in per_stream for s in shards])
        orders = [order_of(shards)[0] for shards in per_stream]
        rng = np.random.default_rng(seed + epoch)
        if self.batching_method == "stratified":
            share = np.array([len(o) for o in orders], dtype=np.float64)
            if not share.sum():
                return empty, empty
            per_batch = np.floor(share / share.sum() * global_batch).astype(int)
            for i in np.argsort(-(share / share.sum() * global_batch - per_batch))[: global_batch - per_batch.sum()]:
                per_batch[i] += 1
            n_batches = min(len(o) // c for o, c in zip(orders, per_batch) if c) if per_batch.any() else 0
            batches = [np.concatenate([o[b * c : (b + 1) * c] for o, c in zip(orders, per_batch)])
                       for b in range(n_batches)]
            return (np.concatenate(batches) if batches else empty), empty
        chunk = global_batch if self.batching_method == "per_stream" else self.batch_size
        chunks = [o[i : i + chunk] for o in orders for i in range(0, len(o) - chunk + 1, chunk)]
        chunks = [chunks[i] for i in rng.permutation(len(chunks))]
        usable = len(chunks) - len(chunks) % (global_batch // chunk)
        return (np.concatenate(chunks[:usable]) if usable else empty), empty

    def mosaic_layout(self) -> bool:
        """Whether mosaicml-streaming's partition deals the samples to ranks, as well as its shuffle orders them.

        So for its shuffles (``naive``, ``py1s``, ``py2s``, ``py1br``, ``py1e``) over streams read whole
        (no ``proportion``/``repeat``/``choose``, ``epoch_size`` or schedule) with ``random`` batching and no
        replication: every rank then yields what it would under mosaicml-streaming 0.13 (see
        :mod:`smalti.streaming.order_mosaic`).
        """
        return (self.shuffle_algo in MOSAIC_ALGOS and self.replication == 1 and self.epoch_size is None
                and not self.proportion_schedule and all(s.weight[1] is None for s in self.streams)
                and (self.batching_method == "random" or len(self.streams) == 1))

    def _mosaic_grid(self, epoch: int, drop: int) -> np.ndarray:
        """mosaicml-streaming's arrangement as global batch rows: rank ``r``'s batch ``k`` in row ``k``'s ``r``-th
        slice of ``batch_size`` (``-1`` pads a partial last batch)."""
        key = ("mosaic", epoch, drop, self.physical_nodes, self.local_world, self.batch_size, self.shuffle,
               self.shuffle_algo, self.shuffle_seed, self.shuffle_block_size, self.num_canonical_nodes,
               self._initial_nodes)
        grid = self._order_cache.get(key)
        if grid is None:
            sizes = np.diff(self._shard_starts)
            block = self.shuffle_block_size or default_block_size(self.num_canonical_nodes)
            work = mosaic_work(sizes, shuffle=self.shuffle, algo=self.shuffle_algo, seed=self.shuffle_seed,
                               epoch=epoch, num_canonical_nodes=self.num_canonical_nodes, block_size=block,
                               num_nodes=self.physical_nodes, ranks_per_node=self.local_world, workers_per_rank=1,
                               batch_size=self.batch_size, drop_first=drop, initial_nodes=self._initial_nodes)
            grid = work[:, :, 0].reshape(self.world_size, -1, self.batch_size).transpose(1, 0, 2)
            grid = grid.reshape(-1, self.world_size * self.batch_size)
            grid.setflags(write=False)
            self._order_cache[key] = grid
        return grid

    def _remaining(self, epoch: int) -> Remaining | GridRemaining:
        """The epoch's global batches still to come after the resume position (see :class:`Remaining`)."""
        start = self._resume[1] if self._resume and self._resume[0] == epoch else 0
        if self.mosaic_layout():
            return GridRemaining(self._mosaic_grid(epoch, start))
        return Remaining(self._order(epoch), start)

    def __len__(self) -> int:
        """Samples this rank yields per epoch (including the padding of the last global batch)."""
        if self.mosaic_layout():
            b = self.batch_size
            return int((self._mosaic_grid(self.epoch, 0)[:, self.rank * b : (self.rank + 1) * b] >= 0).sum())
        return self._order(self.epoch).size // self.dp_world

    def _steps(self, bundled: bool = False) -> Iterator[tuple[FetchPlan, list[np.ndarray]]]:
        """This process's share of the epoch: ``(plan, [global ids of this rank's batch, ...])`` per bundle of
        global batch steps (see :func:`_bundles`; one step per bundle unless ``bundled``).

        A DataLoader worker takes every ``num_workers``-th bundle, starting with its ``worker_id``-th. A
        bundled step without samples (past a resumed epoch's end) comes as an empty array; others are left out.
        """
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker else (0, 1)
        epoch = self.epoch
        remaining = self._remaining(epoch)
        b = self.batch_size
        c0, c1 = self.dp_rank * b, (self.dp_rank + 1) * b
        cache = self.cache
        cache.epoch, cache.step = epoch, 0
        if self.cache_limit is not None:
            try:
                needs = self.cache_needs(epoch)
                cache.last_use, cache.window = (needs.last_use if needs.complete else None), needs.window_steps
            except Exception as exc:  # reading below meets it and reports it
                log.debug("cache needs not measured: %r", exc)
        plan = FetchPlan(self, remaining, worker_id, num_workers)
        if worker is None:
            self._consumed = 0
        else:
            self._first_rows = {}  # the main process's rows read ahead, inherited by a forked worker
        try:
            for lo, hi in _bundles(len(remaining), worker_id, num_workers,
                                   max(1, BUNDLE_SAMPLES // b) if bundled else 1):
                batches = [row if row[-1] >= 0 else row[row >= 0] for row in remaining.rows(lo, hi, c0, c1)]
                if not bundled:
                    batches = [ids for ids in batches if len(ids)]
                    if not batches:
                        continue
                plan.progress = cache.step = lo
                yield plan, batches
            plan.finish()
        finally:
            plan.stop()
        if worker is None and self.epoch == epoch:
            self._end_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for plan, batches in self._steps():
            for ids in batches:
                for item in self._gather(ids, plan):
                    if not self._counted_by_loader:
                        self._consumed += 1
                    yield item

    def iter_batches(self, collate_fn: Callable[[list[Any]], Any] | None = None,
                     drop_last: bool = False, bundles: bool = False) -> Iterator[Any]:
        """This process's batches, each ``collate_fn`` (default: torch's ``default_collate``) of ``batch_size``
        samples: exactly what ``DataLoader(ds, batch_size=ds.batch_size, collate_fn=..., drop_last=...)`` yields.

        With the default collation and columnar shards (fixed-size numbers and arrays), each column is
        gathered into its tensor in one copy, with no per-sample objects. :class:`StreamingDataLoader` uses
        this when its ``batch_size`` is the dataset's; it also counts what it yields for :meth:`state_dict`.
        With ``bundles`` (default collation only), consecutive batches come as one :class:`Bundle`, columnar
        ones as references that :meth:`resolve` turns into the batches in any process of this node; every
        bundle is yielded, even one left empty.
        """
        for plan, batches in self._steps(bundles):
            batches = [ids for ids in batches if len(ids) == self.batch_size or (len(ids) and not drop_last)]
            if bundles:
                if not self._counted_by_loader:
                    self._consumed += sum(len(ids) for ids in batches)
                yield self._bundle(batches, plan)
                continue
            for ids in batches:
                batch = self._columnar_batch(ids, plan) if collate_fn is None else None
                if batch is None:
                    batch = (collate_fn or default_collate)(self._gather(ids, plan))
                if not self._counted_by_loader:
                    self._consumed += len(ids)
                yield batch

    def _end_epoch(self, epoch: int) -> None:
        self.epoch = epoch + 1
        self._consumed = 0
        if self._resume and self._resume[0] <= epoch:
            self._resume = None

    def transforms_samples(self) -> bool:
        """Whether this subclass changes samples in a way the batch path cannot follow: ``__getitem__``/
        ``__iter__`` overridden (as LLM Foundry's text datasets do), or :meth:`transform_sample` without
        :meth:`transform_batch`. Whole batches read straight from the shards would skip that, so
        :class:`~smalti.streaming.StreamingDataLoader` takes the per-sample path for it."""
        cls = type(self)

        def overridden(name: str) -> bool:
            return getattr(cls, name) is not getattr(StreamingDataset, name)

        return any(overridden(name) for name in ("__getitem__", "__getitems__", "__iter__")) or \
            (overridden("transform_sample") and not overridden("transform_batch"))

    def smalti_dataloader(self, **loader_kwargs: Any) -> Any:
        """A :class:`~smalti.streaming.StreamingDataLoader` over this dataset with ``loader_kwargs``.

        smalti-core's ``build_dataloader`` calls it (a duck-typed hook, so core does not import this package):
        the trainer then gets whole batches made in the workers and a loader whose ``state_dict`` is exact.
        """
        from smalti.streaming.loader import StreamingDataLoader

        return StreamingDataLoader(self, **loader_kwargs)

    # ------------------------------------------------------------------ resumption

    def state_dict(self, num_samples: int | None = None, from_beginning: bool = True) -> dict[str, Any]:
        """Where the epoch is, for :meth:`load_state_dict`.

        ``num_samples`` is the global sample count consumed in this epoch (over all data-parallel ranks,
        replicas counted once), from the epoch's beginning or, with ``from_beginning=False``, from the last
        resumption point. Without it, the samples this process handed out so far are used (times the
        data-parallel ranks): exact when iterating in-process or through ``StreamingDataLoader``.
        """
        resumed = self._resume[1] if self._resume and self._resume[0] == self.epoch else 0
        if num_samples is None:
            if self._consumed == 0 and not self._counted_by_loader:
                log.debug("state_dict() without num_samples counts only samples iterated in this process; "
                          "with DataLoader workers use StreamingDataLoader or pass num_samples")
            num_samples = resumed + self._consumed * self.dp_world
        elif not from_beginning:
            num_samples += resumed
        return {"epoch": self.epoch, "sample_in_epoch": int(num_samples),
                "num_canonical_nodes": self.num_canonical_nodes, "shuffle_seed": self.shuffle_seed,
                "partition_algo": self.partition_algo, "physical_nodes": self.physical_nodes,
                **({"initial_physical_nodes": self._initial_nodes} if self._initial_nodes else {}),
                "shuffle_algo": self.shuffle_algo}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``: the next iteration of that epoch starts after ``sample_in_epoch`` global samples.

        Without an explicit ``num_canonical_nodes``, the checkpoint's is adopted (as mosaicml-streaming does),
        so a run resumed on another node count keeps its sample order.
        """
        ncn = state.get("num_canonical_nodes")
        if ncn is not None and not self._ncn_given and ncn != self.num_canonical_nodes:
            self._check_partition(int(ncn))
            self.num_canonical_nodes = int(ncn)
            self._order_cache = {}
        if state.get("num_canonical_nodes", self.num_canonical_nodes) != self.num_canonical_nodes or \
                state.get("shuffle_seed", self.shuffle_seed) != self.shuffle_seed:
            raise StreamingError(
                f"checkpoint was taken with num_canonical_nodes={state.get('num_canonical_nodes')} and "
                f"shuffle_seed={state.get('shuffle_seed')}; this dataset has {self.num_canonical_nodes} and "
                f"{self.shuffle_seed}: the sample order would differ"
            )
        self._adopt_shuffle_algo(state)
        first_nodes = state.get("initial_physical_nodes", state.get("physical_nodes"))
        if self.partition_algo == "relaxed" and first_nodes not in (None, self.physical_nodes):
            self._initial_nodes = int(first_nodes)
        self.epoch = int(state["epoch"])
        self._consumed = 0
        self._resume = (self.epoch, int(state["sample_in_epoch"]))


    def _adopt_shuffle_algo(self, state: dict[str, Any]) -> None:
        """Keep the checkpoint's shuffle algorithm unless one was given; a given one that differs from the
        checkpoint's is refused. A smalti state that names none (it has ``partition_algo``) was taken with
        ``py1e``, the default until ``blocks``; a hand-made one without either keeps this dataset's algorithm."""
        saved = state.get("shuffle_algo")
        if saved is None and "partition_algo" in state:
            saved = LEGACY_SHUFFLE
        if self._algo_given:
            if saved is not None and saved != self.shuffle_algo:
                raise StreamingError(f"checkpoint was taken with shuffle_algo={saved!r}; this dataset has "
                                     f"{self.shuffle_algo!r}: the sample order would differ (drop shuffle_algo "
                                     "to keep the checkpoint's)")
            return
        if saved is None:
            return
        if saved not in SHUFFLES:
            raise StreamingError(f"checkpoint names shuffle_algo={saved!r}, not one of {', '.join(SHUFFLES)}")
        if saved != self.shuffle_algo:
            self.shuffle_algo = saved
            self._order_cache = {}
