"""The epoch plan of a dataset: which samples each epoch reads, in which order, and how ranks split them.

:class:`EpochOrders` holds the settings that decide an epoch's order (shuffle, seed, canonical nodes,
batching method, ``epoch_size``, the stream mix and its ``proportion_schedule``) and answers, for any epoch
and resume position, the global batches still to come (:class:`~smalti.streaming.epoch_plan.Remaining`)
and this rank's columns of them. It is a value: a checkpoint that changes a setting gets a new one
(:meth:`EpochOrders.replace`), so the orders computed for the old settings go with the old value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from smalti.streaming.epoch_plan import ArrayOrder, EpochOrder, GridRemaining, LazyOrder, Remaining
from smalti.streaming.errors import StreamingError
from smalti.streaming.layout import RankLayout
from smalti.streaming.order import (
    DEFAULT_SHUFFLE,
    LAZY_SHUFFLES,
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
from smalti.streaming.sample_map import SampleMap
from smalti.streaming.stream import Stream, parse_schedule_time

BATCHING_METHODS = ("random", "stratified", "per_stream", "device_per_stream")
PARTITION_ALGOS = ("orig", "relaxed")
_SEGMENT_SEED = 1_000_003  # seed offset between the segments of an epoch with a mid-epoch curriculum change

Weights = list[tuple[str, float | int | None]]
Schedule = list[tuple[int, str, list[float]]]


def parse_schedule(schedule: Sequence[Any], num_streams: int) -> Schedule:
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


@dataclass(eq=False)
class EpochOrders:
    """Every epoch's order for one dataset and rank layout, computed once per epoch and setting."""

    table: SampleMap
    streams: list[Stream]
    layout: RankLayout
    shuffle: bool
    shuffle_algo: str
    shuffle_seed: int
    shuffle_block_size: int | None
    num_canonical_nodes: int
    partition_algo: str
    batching_method: str
    epoch_size: int | None
    proportion_schedule: Schedule
    algo_given: bool = True  # set by the user (else the default, or a checkpoint's)
    ncn_given: bool = True
    initial_nodes: int | None = None  # the first run's node count, once resumed on another
    _cache: dict[tuple[Any, ...], EpochOrder | np.ndarray] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def configure(cls, table: SampleMap, streams: list[Stream], layout: RankLayout, *, shuffle: bool,
                  shuffle_algo: str | None, shuffle_seed: int, shuffle_block_size: int | None,
                  num_canonical_nodes: int | None, partition_algo: str, batching_method: str,
                  epoch_size: int | None, proportion_schedule: Sequence[Any] | None) -> EpochOrders:
        """The orders for the dataset's arguments, each checked (the error names the argument at fault);
        ``None`` takes the default: ``blocks`` and, as in mosaicml-streaming, the node count (x64 for
        ``py1s``/``py2s``) canonical nodes."""
        if batching_method not in BATCHING_METHODS:
            raise StreamingError(f"batching_method={batching_method!r} is not one of {', '.join(BATCHING_METHODS)}")
        if partition_algo not in PARTITION_ALGOS:
            raise StreamingError(f"partition_algo={partition_algo!r} is not one of {', '.join(PARTITION_ALGOS)}")
        algo = DEFAULT_SHUFFLE if shuffle_algo is None else shuffle_algo
        if algo not in SHUFFLES:
            raise StreamingError(f"shuffle_algo={algo!r} is not one of {', '.join(SHUFFLES)}")
        ncn = num_canonical_nodes
        if ncn is None:
            ncn = layout.physical_nodes * (64 if algo in ("py1s", "py2s") else 1)
        if ncn < 1:
            raise StreamingError(f"num_canonical_nodes={ncn} must be a positive number")
        orders = cls(table, streams, layout, shuffle, algo, shuffle_seed, shuffle_block_size, ncn, partition_algo,
                     batching_method, epoch_size, parse_schedule(proportion_schedule or [], len(streams)),
                     algo_given=shuffle_algo is not None, ncn_given=num_canonical_nodes is not None)
        orders.segments(0)  # bad weights (a stream without a proportion among proportions) fail here
        return orders

    def __post_init__(self) -> None:
        nodes, ncn = self.layout.physical_nodes, self.num_canonical_nodes
        if self.partition_algo == "orig" and ncn % nodes and nodes % ncn:
            raise StreamingError(
                f"partition_algo='orig' needs the node count ({nodes} = world size {self.layout.world_size} / "
                f"{self.layout.local_world} ranks per node) to divide num_canonical_nodes={ncn} or be a multiple "
                "of it; change num_canonical_nodes or use partition_algo='relaxed'"
            )

    def replace(self, **changes: Any) -> EpochOrders:
        """These orders with ``changes`` (checked again), computing their orders afresh."""
        return dataclasses.replace(self, **changes)

    @property
    def stream_names(self) -> list[str]:
        return [s.name for s in self.streams]

    # ------------------------------------------------------------------ what an epoch holds

    def segments(self, epoch: int) -> tuple[int, list[tuple[int, Weights]]]:
        """Epoch ``epoch``'s sample count before padding, and its segments ``(first offset, stream weights)``.

        A schedule entry takes effect at a global sample position: ``Nep`` at the start of epoch N, ``Xba``
        after X global batches, ``Ysp`` after Y samples. Epochs are laid end to end at their padded lengths
        (whole global batches), each as long as the weights at its start make it. An entry that falls inside
        an epoch starts a new segment there.
        """
        global_batch = self.layout.global_batch
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
            total = int(sum(stream_counts(self.table.stream_sizes, weights, self.epoch_size, 0, self.stream_names)))
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

    # ------------------------------------------------------------------ the order and its rows

    def mosaic_layout(self) -> bool:
        """Whether mosaicml-streaming's partition deals the samples to ranks, as well as its shuffle orders them
        (see :meth:`StreamingDataset.mosaic_layout <smalti.streaming.StreamingDataset.mosaic_layout>`)."""
        return (self.shuffle_algo in MOSAIC_ALGOS and self.layout.replication == 1 and self.epoch_size is None
                and not self.proportion_schedule and all(s.weight[1] is None for s in self.streams)
                and (self.batching_method == "random" or len(self.streams) == 1))

    def remaining(self, epoch: int, start: int) -> Remaining | GridRemaining:
        """Epoch ``epoch``'s global batches still to come after its first ``start`` global samples."""
        if self.mosaic_layout():
            return GridRemaining(self.mosaic_grid(epoch, start))
        return Remaining(self.order(epoch), start)

    def rank_samples(self, epoch: int) -> int:
        """Samples this rank yields in epoch ``epoch`` (including the padding of the last global batch)."""
        if self.mosaic_layout():
            lo, hi = self.layout.rank_columns()
            return int((self.mosaic_grid(epoch, 0)[:, lo:hi] >= 0).sum())
        return self.order(epoch).size // self.layout.dp_world

    def mosaic_grid(self, epoch: int, drop: int) -> np.ndarray:
        """mosaicml-streaming's arrangement as global batch rows: rank ``r``'s batch ``k`` in row ``k``'s ``r``-th
        slice of ``batch_size`` (``-1`` pads a partial last batch)."""
        lay = self.layout
        key = ("mosaic", epoch, drop, lay.physical_nodes, lay.local_world, lay.batch_size)
        grid = self._cache.get(key)
        if grid is None:
            work = mosaic_work(np.diff(self.table.starts), shuffle=self.shuffle, algo=self.shuffle_algo,
                               seed=self.shuffle_seed, epoch=epoch, num_canonical_nodes=self.num_canonical_nodes,
                               block_size=self.shuffle_block_size or default_block_size(self.num_canonical_nodes),
                               num_nodes=lay.physical_nodes, ranks_per_node=lay.local_world, workers_per_rank=1,
                               batch_size=lay.batch_size, drop_first=drop, initial_nodes=self.initial_nodes)
            grid = work[:, :, 0].reshape(lay.world_size, -1, lay.batch_size).transpose(1, 0, 2)
            grid = grid.reshape(-1, lay.world_size * lay.batch_size)
            grid.setflags(write=False)
            self._cache[key] = grid
        return grid

    def order(self, epoch: int) -> EpochOrder:
        """Epoch ``epoch``'s order, computed once (the last epoch's is kept)."""
        global_batch = self.layout.global_batch
        key = (epoch, global_batch)
        order = self._cache.get(key)
        if order is None:
            blocks = self.block_order(epoch, global_batch)
            order = LazyOrder(blocks) if blocks is not None else \
                ArrayOrder(*self.sequence(epoch, global_batch), global_batch)
            self._cache = {k: v for k, v in self._cache.items() if k[0] == "mosaic"}
            self._cache[key] = order
        return order

    def block_order(self, epoch: int, global_batch: int) -> BlockOrder | None:
        """The epoch's ``blocks`` or ``keyed`` order (:func:`~smalti.streaming.order.lazy_order`), when it can
        be computed lazily: one stream mix for the whole epoch, every stream read a whole number of times, one
        sequence for all streams (``random`` batching or one stream). It equals the order :meth:`full_order`
        materialises."""
        if not (self.shuffle and self.shuffle_algo in LAZY_SHUFFLES):
            return None
        if not (self.batching_method == "random" or len(self.streams) == 1):
            return None
        _, segments = self.segments(epoch)
        if len(segments) != 1:
            return None
        sizes = self.table.stream_sizes
        counts = stream_counts(sizes, segments[0][1], self.epoch_size, self.shuffle_seed + epoch, self.stream_names)
        if any(size and count % size or not size and count for count, size in zip(counts, sizes)):
            return None  # a part of a stream is chosen at random: select_samples picks it sample by sample
        starts = self.table.starts
        picked = [np.tile(np.asarray(ids, dtype=np.int64), count // size)
                  for ids, count, size in zip(self.table.stream_shards, counts, sizes) if size]
        shards = np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)
        if not len(shards):
            return None
        return lazy_order(self.shuffle_algo, starts[shards + 1] - starts[shards], seed=self.shuffle_seed,
                          epoch=epoch, num_canonical_nodes=self.num_canonical_nodes, global_batch=global_batch,
                          block_size=self.shuffle_block_size, shard_first_ids=starts[shards])

    def full_order(self, epoch: int, global_batch: int) -> np.ndarray:
        """The epoch's whole order as one array (every shuffle, curriculum and batching method)."""
        return ArrayOrder(*self.sequence(epoch, global_batch), global_batch).full()

    def sequence(self, epoch: int, global_batch: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The epoch's samples in order before padding and grouping, with each one's canonical node; for the
        batching methods that keep streams apart, whole global batches as they are read and no nodes."""
        total, segments = self.segments(epoch)
        names, seed = self.stream_names, self.shuffle_seed
        if len(segments) == 1:
            seg_counts = [stream_counts(self.table.stream_sizes, segments[0][1], self.epoch_size, seed + epoch,
                                        names)]
        else:
            ends = [offset for offset, _ in segments[1:]] + [total]
            seg_counts = [self._segment_counts(weights, end - offset, global_batch, seed + epoch + _SEGMENT_SEED * k)
                          for k, ((offset, weights), end) in enumerate(zip(segments, ends))]
        # Each stream's samples for the whole epoch, then cut into the segments' shares (whole shard runs).
        per_segment: list[list[list[np.ndarray]]] = [[] for _ in seg_counts]
        for si, ids in enumerate(self.table.stream_shards):
            counts = [c[si] for c in seg_counts]
            chosen = select_samples(self.table.shard_ids(ids), sum(counts), seed + 1000 * si, epoch)
            parts = [chosen] if len(counts) == 1 else split_selection(
                chosen, counts, seed + epoch + 1000 * si + _SEGMENT_SEED)
            for k, part in enumerate(parts):
                per_segment[k].append(part)
        orders, nodes = [], []
        for k, per_stream in enumerate(per_segment):
            order, node = self._arrange(per_stream, epoch, global_batch, seed + _SEGMENT_SEED * k)
            orders.append(order)
            nodes.append(node)
        order = np.concatenate(orders) if orders else np.zeros(0, dtype=np.int64)
        if not (self.batching_method == "random" or len(self.streams) == 1):
            return order, None
        return order, np.concatenate(nodes)

    def _segment_counts(self, weights: Weights, size: int, global_batch: int, seed: int) -> list[int]:
        """Per-stream samples of a ``size``-sample segment of a curriculum epoch.

        The batching methods that keep streams apart in whole units (global batches for ``per_stream``, device
        batches for ``device_per_stream``, every global batch's per-stream share for ``stratified``) get counts
        in whole units, so a segment that is whole global batches long is used entirely and the next segment
        starts exactly where the schedule says.
        """
        sizes, names = self.table.stream_sizes, self.stream_names
        method = self.batching_method if len(self.streams) > 1 else "random"
        if method == "stratified":
            per_batch = stream_counts(sizes, weights, global_batch, seed, names)
            return [c * (size // global_batch) for c in per_batch]
        unit = {"per_stream": global_batch, "device_per_stream": self.layout.batch_size}.get(method)
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
        chunk = global_batch if self.batching_method == "per_stream" else self.layout.batch_size
        chunks = [o[i : i + chunk] for o in orders for i in range(0, len(o) - chunk + 1, chunk)]
        chunks = [chunks[i] for i in rng.permutation(len(chunks))]
        usable = len(chunks) - len(chunks) % (global_batch // chunk)
        return (np.concatenate(chunks[:usable]) if usable else empty), empty
