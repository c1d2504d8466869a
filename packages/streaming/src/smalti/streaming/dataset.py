"""``StreamingDataset``: MDS data from local disk or remote storage, shuffled, split and resumable.

The class composes one part per concern (see the package README's module map): the rank's place
(:mod:`~smalti.streaming.layout`), the shards (:mod:`~smalti.streaming.sample_map`), the epoch plan
(:mod:`~smalti.streaming.epoch_orders`), the fetch plan and warm-up (:mod:`~smalti.streaming.fetch_plan`,
:mod:`~smalti.streaming.warm_up`), sample and batch reading (:mod:`~smalti.streaming.batch_reading`) and
the checkpointable state (:mod:`~smalti.streaming.resume_state`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from smalti.streaming.batch_reading import BatchReader, bypasses_batch_path, split_batch
from smalti.streaming.bundles import BUNDLE_SAMPLES, Bundle, _bundles
from smalti.streaming.cache import ShardCache
from smalti.streaming.epoch_orders import BATCHING_METHODS, PARTITION_ALGOS, EpochOrders
from smalti.streaming.epoch_plan import GridRemaining, Remaining, RowsAhead
from smalti.streaming.errors import StreamingError
from smalti.streaming.fetch_plan import CacheNeeds, FetchPlan, node_cache_needs, report_cache_needs
from smalti.streaming.index_trust import check_local_lengths, remote_table, secure_stream_folder, sync_index
from smalti.streaming.layout import RankLayout
from smalti.streaming.mds import INDEX, check_columns, parse_size, read_index
from smalti.streaming.resume_state import Resume, resume_start, resumed_orders, saved_state
from smalti.streaming.sample_map import SampleMap
from smalti.streaming.shard_table import ShardList, ShardTable
from smalti.streaming.storage import Fetcher
from smalti.streaming.stream import Stream, given_streams
from smalti.streaming.warm_up import WarmUp, first_batch_ids, first_needed_shards

__all__ = ["BATCHING_METHODS", "PARTITION_ALGOS", "Bundle", "Stream", "StreamingDataset", "_bundles"]

log = logging.getLogger(__name__)


def _part(part: str, *names: str) -> tuple[property, ...]:
    """Read-only attributes of the dataset that are ``names`` of its part ``part``."""
    return tuple(property(lambda self, n=name: getattr(getattr(self, part), n)) for name in names)


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

    rank, world_size, local_world, local_rank, physical_nodes, replication, dp_world, dp_rank = _part(
        "layout", "rank", "world_size", "local_world", "local_rank", "physical_nodes", "replication", "dp_world",
        "dp_rank")
    (shuffle, shuffle_algo, shuffle_seed, shuffle_block_size, num_canonical_nodes, partition_algo, batching_method,
     epoch_size, proportion_schedule) = _part(
        "orders", "shuffle", "shuffle_algo", "shuffle_seed", "shuffle_block_size", "num_canonical_nodes",
        "partition_algo", "batching_method", "epoch_size", "proportion_schedule")
    _order, _compute_order, _sequence = _part("orders", "order", "full_order", "sequence")  # the parts' methods,
    (_locate,), (_node_columns,) = _part("table", "locate"), _part("layout", "node_columns")  # as tests reach them

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
        self.streams = streams = given_streams(streams, remote, local, split)
        # Ranks are numbered node by node; the processes of one node share its cache directory and split the
        # downloads (see smalti.streaming.cache).
        self.layout = RankLayout.resolve(rank, world_size, local_world_size, replication, batch_size)
        self.predownload = 8 * self.batch_size if predownload is None else predownload
        self.download_retry, self.download_timeout = download_retry, download_timeout
        self._fetcher = Fetcher(download_retry, download_timeout)
        self.validate_hash, self.allow_unsafe_types = validate_hash, allow_unsafe_types
        self.epoch = 0
        self._resume: Resume | None = None  # (epoch, global samples already consumed in it)
        self._consumed = 0  # samples this process handed out in the current epoch (this rank's share)
        self._counted_by_loader = False
        shards = ShardList([self._load_stream_index(stream) for stream in streams])  # (stream, entry) on use
        self.table = SampleMap(shards, [shards.stream_ids(si) for si in range(len(streams))], shards.samples,
                               shards.raw_bytes, shards.zip_bytes)
        self._shards, self._shard_starts = self.table.shards, self.table.starts
        self._stream_shards = self.table.stream_shards
        self.num_samples = self.table.num_samples
        if self.num_samples == 0:
            raise StreamingError(f"streams {[s.name for s in streams]} hold no samples")
        self.orders = EpochOrders.configure(
            self.table, streams, self.layout, shuffle=shuffle, shuffle_algo=shuffle_algo, shuffle_seed=shuffle_seed,
            shuffle_block_size=shuffle_block_size, num_canonical_nodes=num_canonical_nodes,
            partition_algo=partition_algo, batching_method=batching_method, epoch_size=epoch_size,
            proportion_schedule=proportion_schedule)
        self.cache_limit = parse_size(cache_limit, "cache_limit") if cache_limit is not None else None
        if self.cache_limit is not None:
            largest = int((self.table.raw_bytes + self.table.zip_bytes).max())
            if self.cache_limit < largest:
                raise StreamingError(f"cache_limit={self.cache_limit} bytes is smaller than the largest shard "
                                     f"({largest} bytes with its zip); raise cache_limit")
        self.cache = ShardCache(streams, self.table.shards, self.cache_limit, self._fetcher, validate_hash,
                                allow_unsafe_types=allow_unsafe_types)
        self.cache.remove_stale_downloads()
        self.reader = BatchReader(self.table, self.cache)
        self._needs: tuple[tuple[int, int], CacheNeeds] | None = None
        self.warm = WarmUp(self.table, streams, self.cache, self.cache_limit, validate_hash, allow_unsafe_types)
        if self.predownload > 0:
            self.warm.start(self._remaining(self.epoch), self.layout)
        if self.cache_limit is not None:
            self._report_cache_needs()

    @property
    def batch_size(self) -> int:
        """Samples per rank of every global batch (settable before iterating, as smalti-core's loader does)."""
        return self.layout.batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self.layout = RankLayout.resolve(self.rank, self.world_size, self.local_world, self.replication, value)
        self.orders = self.orders.replace(layout=self.layout)

    # ------------------------------------------------------------------ the epoch plan

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from the next iteration on."""
        if epoch != self.epoch:
            self._consumed = 0
        self.epoch = epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The global sample order of ``epoch``, padded to whole global batches (a pure function of the settings).

        Materialised, so memory grows with the samples: for inspection and small datasets. Iteration never
        calls it; with the ``blocks`` shuffle it computes each batch's ids when it needs them.
        """
        return self.orders.order(epoch).full()

    def weights_for_epoch(self, epoch: int) -> list[tuple[str, float | int | None]]:
        """The streams' weights at the start of ``epoch``: their own, or the latest ``proportion_schedule`` entry."""
        return self.orders.segments(epoch)[1][0][1]

    def mosaic_layout(self) -> bool:
        """Whether mosaicml-streaming's partition deals the samples to ranks, as well as its shuffle orders them.

        So for its shuffles (``naive``, ``py1s``, ``py2s``, ``py1br``, ``py1e``) over streams read whole
        (no ``proportion``/``repeat``/``choose``, ``epoch_size`` or schedule) with ``random`` batching and no
        replication: every rank then yields what it would under mosaicml-streaming 0.13 (see
        :mod:`smalti.streaming.order_mosaic`).
        """
        return self.orders.mosaic_layout()

    def __len__(self) -> int:
        """Samples this rank yields per epoch (including the padding of the last global batch)."""
        return self.orders.rank_samples(self.epoch)

    def _remaining(self, epoch: int) -> Remaining | GridRemaining:
        """The epoch's global batches still to come after the resume position."""
        return self.orders.remaining(epoch, resume_start(self._resume, epoch))

    # ------------------------------------------------------------------ the fetch plan and the warm-up

    def cache_needs(self, epoch: int | None = None) -> CacheNeeds:
        """What this node's share of epoch ``epoch`` (default: the current one, from the resume position) asks
        of the shard cache: the smallest ``cache_limit`` that fetches every shard once, and the order's
        locality (distinct shards per window of global batches). Measured on the order, a chunk at a time;
        past ``fetch_plan.NEEDS_WALK_SAMPLES`` node samples, on the epoch's beginning."""
        epoch = self.epoch if epoch is None else epoch
        key = (epoch, resume_start(self._resume, epoch))
        if self._needs is None or self._needs[0] != key:
            needs = node_cache_needs(self._remaining(epoch), self.table, self.streams, self.layout, self.predownload)
            self._needs = (key, needs)
        return self._needs[1]

    def _report_cache_needs(self) -> None:
        """Say (once per node) the cache this layout and order need, warning when ``cache_limit`` is below it."""
        try:
            needs = self.cache_needs()
        except Exception as exc:  # the iteration meets (and reports) any problem with the order itself
            log.debug("cache needs not measured: %r", exc)
            return
        if self.local_rank == 0:
            report_cache_needs(needs, ", ".join(s.name for s in self.streams), self.cache_limit)

    def metrics(self) -> dict[str, int]:
        """Counters of this rank's shard cache (its main process and DataLoader workers): ``fetches`` (copies
        made) and ``refetches`` (of shards evicted before this rank read them for the last time this epoch)."""
        return self.cache.counts()

    def _first_needed_shards(self, steps: int) -> list[int]:
        return first_needed_shards(self._remaining(self.epoch), self.layout, self.table, steps)

    def _warm_up_shards(self) -> list[int]:
        return self.warm.shards(self._remaining(self.epoch), self.layout)

    def _first_batch_ids(self) -> np.ndarray | None:
        """The sample ids of this rank's first batch in what remains of the current epoch (``None``: nothing)."""
        return first_batch_ids(self._remaining(self.epoch), self.layout)

    @property
    def _first_rows(self) -> dict[int, Any]:
        return self.warm.first_rows

    def _first_batch(self, ids: np.ndarray) -> dict[str, Any] | None:
        """The batch of samples ``ids`` (this process's first of the epoch) made here, column by column, from
        the rows the warm-up read ahead where it did and from whole shards elsewhere; ``None`` when the
        shards are not columnar."""
        return self._columnar_batch(ids, None, readers=self.warm.take_readers(ids))

    # ------------------------------------------------------------------ iteration

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
        c0, c1 = self.layout.rank_columns()
        cache = self.cache
        cache.epoch, cache.step = epoch, 0
        if self.cache_limit is not None:
            try:
                needs = self.cache_needs(epoch)
                cache.last_use, cache.window = (needs.last_use if needs.complete else None), needs.window_steps
            except Exception as exc:  # reading below meets it and reports it
                log.debug("cache needs not measured: %r", exc)
        plan = FetchPlan(remaining, self.table, cache, self.layout, self.predownload, worker_id, num_workers)
        if worker is None:
            self._consumed = 0
        else:
            self.warm.forget()  # the main process's rows read ahead, inherited by a forked worker
        ahead = RowsAhead(remaining, c0, c1)
        try:
            for lo, hi in _bundles(len(remaining), worker_id, num_workers,
                                   max(1, BUNDLE_SAMPLES // self.batch_size) if bundled else 1):
                batches = [row if row[-1] >= 0 else row[row >= 0] for row in ahead.rows(lo, hi)]
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
                batch = self._make_batch(ids, plan, collate_fn)
                if not self._counted_by_loader:
                    self._consumed += len(ids)
                yield batch

    def _end_epoch(self, epoch: int) -> None:
        self.epoch = epoch + 1
        self._consumed = 0
        if self._resume and self._resume[0] <= epoch:
            self._resume = None

    def smalti_dataloader(self, **loader_kwargs: Any) -> Any:
        """A :class:`~smalti.streaming.StreamingDataLoader` over this dataset with ``loader_kwargs``.

        smalti-core's ``build_dataloader`` calls it (a duck-typed hook, so core does not import this package):
        the trainer then gets whole batches made in the workers and a loader whose ``state_dict`` is exact.
        """
        from smalti.streaming.loader import StreamingDataLoader

        return StreamingDataLoader(self, **loader_kwargs)

    # ------------------------------------------------------------------ sample and batch reading

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Sample ``index`` of the whole dataset (all streams, in shard order)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is out of range for {self.num_samples} samples")
        shards, offsets = self.table.locate(np.array([index]))
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

    def transforms_samples(self) -> bool:
        """Whether this subclass changes samples in a way the batch path cannot follow: ``__getitem__``/
        ``__iter__`` overridden (as LLM Foundry's text datasets do), or :meth:`transform_sample` without
        :meth:`transform_batch`. Whole batches read straight from the shards would skip that, so
        :class:`~smalti.streaming.StreamingDataLoader` takes the per-sample path for it."""
        return bypasses_batch_path(type(self), StreamingDataset)

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
        return [self.transform_batch(part) for part in split_batch(batch, [len(r) for r in bundle.refs])]

    def _gather(self, ids: np.ndarray, plan: FetchPlan | None = None) -> list[Any]:
        return self.reader.gather(ids, plan, self.transform_sample)

    def _collate_columns(self, ids: np.ndarray, plan: FetchPlan | None, vouched: bool = False,
                         readers: dict[int, Any] | None = None) -> dict[str, Any] | None:
        return self.reader.collate_columns(ids, plan, vouched, readers)

    def _columnar_batch(self, ids: np.ndarray, plan: FetchPlan | None,
                        readers: dict[int, Any] | None = None) -> Any | None:
        """The batch of samples ``ids`` made column by column and through :meth:`transform_batch`; ``None``
        when the shards are not columnar."""
        batch = self._collate_columns(ids, plan, readers=readers)
        return None if batch is None else self.transform_batch(batch)

    def _make_batch(self, ids: np.ndarray, plan: FetchPlan | None,
                    collate_fn: Callable[[list[Any]], Any] | None = None) -> Any:
        """The batch of samples ``ids``: column by column with the default collation and columnar shards,
        else ``collate_fn`` (default: ``default_collate``) of the samples."""
        batch = self._columnar_batch(ids, plan) if collate_fn is None else None
        return (collate_fn or default_collate)(self._gather(ids, plan)) if batch is None else batch

    def _bundle(self, batches: list[np.ndarray], plan: FetchPlan | None) -> Bundle:
        """A worker's :class:`Bundle` of ``batches`` (sample ids): references once their shards are local,
        checked and columnar; else the batches collated here."""
        return self.reader.bundle(batches, plan, self._make_batch)

    # ------------------------------------------------------------------ the checkpointable state

    def state_dict(self, num_samples: int | None = None, from_beginning: bool = True) -> dict[str, Any]:
        """Where the epoch is, for :meth:`load_state_dict`.

        ``num_samples`` is the global sample count consumed in this epoch (over all data-parallel ranks,
        replicas counted once), from the epoch's beginning or, with ``from_beginning=False``, from the last
        resumption point. Without it, the samples this process handed out so far are used (times the
        data-parallel ranks): exact when iterating in-process or through ``StreamingDataLoader``.
        """
        resumed = resume_start(self._resume, self.epoch)
        if num_samples is None:
            if self._consumed == 0 and not self._counted_by_loader:
                log.debug("state_dict() without num_samples counts only samples iterated in this process; "
                          "with DataLoader workers use StreamingDataLoader or pass num_samples")
            num_samples = resumed + self._consumed * self.dp_world
        elif not from_beginning:
            num_samples += resumed
        return saved_state(self.orders, self.epoch, num_samples)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``: the next iteration of that epoch starts after ``sample_in_epoch`` global samples.

        Without an explicit ``num_canonical_nodes``, the checkpoint's is adopted (as mosaicml-streaming does),
        so a run resumed on another node count keeps its sample order.
        """
        self.orders = resumed_orders(self.orders, state)
        self.epoch = int(state["epoch"])
        self._consumed = 0
        self._resume = (self.epoch, int(state["sample_in_epoch"]))

    # ------------------------------------------------------------------ index

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
