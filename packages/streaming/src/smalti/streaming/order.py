"""The epoch's sample order: shuffles over shards and canonical nodes, then the split over ranks and workers.

Everything here is a pure NumPy function of (seed, epoch, shard layout, canonical nodes), so every rank and
worker computes the same global order on its own: no shared memory, no lock files.

The global order is cut into global batches of ``batch_size * data-parallel ranks`` samples; data-parallel
rank ``r`` takes the ``r``-th slice of ``batch_size`` of each global batch, and DataLoader worker ``w`` of
``W`` takes that rank's batches ``w, w + W, ...`` (which the DataLoader yields back in order). The global
batches therefore depend only on the seed, the canonical nodes and the global batch size, never on how many
nodes, ranks per node or workers share them. The order is padded with its own first samples to a whole
number of global batches: that is the only repetition within an epoch.

Inside each global batch, samples are grouped by canonical node. Ranks are numbered node by node, so when
the physical node count divides the canonical node count, a physical node reads only the shards of its own
canonical nodes: its cache and its downloads stay a fraction of the dataset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.random  # noqa: F401  (NumPy loads it lazily: here, on import, not while the first order is computed)

from smalti.streaming.errors import StreamingError
from smalti.streaming.order_mosaic import MOSAIC_ALGOS, mosaic_shuffle, node_cuts

if TYPE_CHECKING:
    from smalti.streaming.order_blocks import BlockOrder

MOSAIC_SHUFFLES = MOSAIC_ALGOS  # mosaicml-streaming 0.13's, its orders exactly (see order_mosaic)
LAZY_SHUFFLES = ("blocks", "keyed")  # computed batch by batch (order_blocks, order_keyed)
SHUFFLES = (*MOSAIC_SHUFFLES, *LAZY_SHUFFLES)
DEFAULT_SHUFFLE = "keyed"  # for new runs; a checkpoint keeps the algorithm it was taken with
LEGACY_SHUFFLE = "py1e"  # what a checkpoint that names no algorithm was taken with (the default until then)


def default_block_size(num_canonical_nodes: int) -> int:
    """mosaicml-streaming's default shuffle block: ``max(4_000_000 // NCN, 1 << 18)`` samples."""
    return max(4_000_000 // max(num_canonical_nodes, 1), 1 << 18)


def shuffle_order(shards: list[np.ndarray], algo: str, seed: int, epoch: int, num_canonical_nodes: int,
                  block_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle the sample ids of ``shards`` (one id array per shard, in shard order) for ``epoch``.

    mosaicml-streaming's algorithms give its shuffle exactly (:func:`~smalti.streaming.order_mosaic.mosaic_shuffle`
    over the shards' sizes, applied to their ids): ``naive`` permutes globally; the others keep shards
    together, cut the run's fixed shard order into ``num_canonical_nodes`` pieces and shuffle inside each
    piece every epoch. The pieces are then interleaved sample by sample. Returns the order and each entry's
    canonical node. ``blocks`` and ``keyed`` are :func:`lazy_order`'s orders over the same samples (the
    shards' arrays in the given order), materialised.
    """
    if algo not in SHUFFLES:
        raise StreamingError(f"shuffle_algo={algo!r} is not one of {', '.join(SHUFFLES)}")
    if not shards:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if algo in LAZY_SHUFFLES:
        return _lazy_order_arrays(shards, algo, seed, epoch, num_canonical_nodes, block_size)
    ids = np.concatenate(shards).astype(np.int64)
    sizes = np.array([len(s) for s in shards], dtype=np.int64)
    block = block_size or default_block_size(num_canonical_nodes)
    ids = ids[mosaic_shuffle(sizes, algo, num_canonical_nodes, seed, epoch, block)]
    if algo == "naive":
        return ids, np.zeros(len(ids), dtype=np.int64)
    cuts = node_cuts(len(ids), num_canonical_nodes)
    return interleave([ids[lo:hi] for lo, hi in zip(cuts[:-1], cuts[1:])])


def lazy_order(algo: str, shard_sizes: np.ndarray, *, seed: int, epoch: int, num_canonical_nodes: int,
               global_batch: int, block_size: int | None = None,
               shard_first_ids: np.ndarray | None = None) -> BlockOrder:
    """The order of ``algo`` (one of :data:`LAZY_SHUFFLES`) that computes any global batch when asked: a
    :class:`~smalti.streaming.order_blocks.BlockOrder` or :class:`~smalti.streaming.order_keyed.KeyedOrder`."""
    from smalti.streaming.order_blocks import BlockOrder
    from smalti.streaming.order_keyed import KeyedOrder

    if algo not in LAZY_SHUFFLES:
        raise StreamingError(f"shuffle_algo={algo!r} has no lazy order; use one of {', '.join(LAZY_SHUFFLES)}")
    cls = KeyedOrder if algo == "keyed" else BlockOrder
    return cls(shard_sizes, seed=seed, epoch=epoch, num_canonical_nodes=num_canonical_nodes,
               global_batch=global_batch, block_size=block_size, shard_first_ids=shard_first_ids)


def _lazy_order_arrays(shards: list[np.ndarray], algo: str, seed: int, epoch: int, num_canonical_nodes: int,
                       block_size: int | None) -> tuple[np.ndarray, np.ndarray]:
    """A lazy order of ``shards`` as arrays, unpadded and interleaved (the dataset pads and groups it)."""
    sizes = np.array([len(s) for s in shards], dtype=np.int64)
    blocks = lazy_order(algo, sizes, seed=seed, epoch=epoch, num_canonical_nodes=num_canonical_nodes,
                        global_batch=1, block_size=block_size)
    flat = np.concatenate(shards).astype(np.int64)
    return interleave([flat[blocks.node_order(c)] for c in range(num_canonical_nodes)])


def interleave(nodes: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Take one sample from each canonical node in turn; return the order and each entry's node."""
    if not nodes:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    longest = max(len(n) for n in nodes)
    grid = np.full((len(nodes), longest), -1, dtype=np.int64)
    for i, n in enumerate(nodes):
        grid[i, : len(n)] = n
    labels = np.broadcast_to(np.arange(len(nodes))[:, None], grid.shape).T.reshape(-1)
    flat = grid.T.reshape(-1)
    keep = flat >= 0
    return flat[keep], labels[keep]


def sequential_order(shards: list[np.ndarray], num_canonical_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """The unshuffled order: the samples cut into ``num_canonical_nodes`` contiguous pieces, interleaved."""
    if not shards:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    flat = np.concatenate(shards).astype(np.int64)
    cuts = np.linspace(0, len(flat), num_canonical_nodes + 1).round().astype(np.int64)
    return interleave([flat[lo:hi] for lo, hi in zip(cuts[:-1], cuts[1:])])


def pad_to_batches(order: np.ndarray, global_batch: int) -> np.ndarray:
    """Repeat the order's first samples so its length is a multiple of ``global_batch``."""
    if len(order) == 0:
        return order
    missing = (-len(order)) % global_batch
    if missing:
        order = np.concatenate([order, np.resize(order, missing)])
    return order


def group_by_node(order: np.ndarray, nodes: np.ndarray, global_batch: int) -> np.ndarray:
    """Within each global batch of ``order``, put the samples of canonical node 0 first, then node 1, ..."""
    if len(order) == 0:
        return order
    key = np.arange(len(order)) // global_batch * (int(nodes.max()) + 1) + nodes
    return order[np.argsort(key, kind="stable")]


def rank_batches(order: np.ndarray, batch_size: int, dp_rank: int, dp_world: int, worker: int = 0,
                 num_workers: int = 1) -> list[np.ndarray]:
    """The batches of ``order`` (already padded) that data-parallel rank ``dp_rank``'s worker ``worker`` yields."""
    global_batch = batch_size * dp_world
    grid = order.reshape(-1, global_batch)[:, dp_rank * batch_size : (dp_rank + 1) * batch_size]
    return list(grid[worker::num_workers])


def stream_counts(sizes: list[int], weights: list[tuple[str, float | int | None]], epoch_size: int | None,
                  seed: int, names: list[str] | None = None) -> list[int]:
    """Samples to take from each stream this epoch from its ``proportion``, ``repeat`` or ``choose``.

    Proportions are relative and scaled to ``epoch_size`` (default: the total); leftovers from rounding go
    to streams picked with ``seed``. If one stream has a proportion, every stream needs one. ``repeat`` and
    ``choose`` are absolute (a stream with neither is read once); with ``epoch_size`` they are scaled to
    exactly ``epoch_size`` samples, the rounding remainder going to the largest fractional parts.
    """
    kinds = {kind for kind, value in weights if value is not None}
    if "proportion" in kinds and kinds - {"proportion"}:
        raise StreamingError("streams mix proportion with repeat/choose; use relative or absolute weights, not both")
    if "proportion" in kinds:
        unweighted = [i for i, (_, value) in enumerate(weights) if value is None]
        if unweighted:
            shown = ", ".join(names[i] if names else f"#{i}" for i in unweighted)
            raise StreamingError(f"stream {shown} has no proportion while other streams have one; give every "
                                 "stream a proportion (it would otherwise get no samples)")
        props = np.array([v for _, v in weights], dtype=np.float64)
        total = epoch_size or sum(sizes)
        exact = props / props.sum() * total
        counts = np.floor(exact).astype(np.int64)
        short = total - counts.sum()
        if short:
            rng = np.random.default_rng(seed)
            for i in rng.choice(len(counts), size=short, p=props / props.sum()):
                counts[i] += 1
        return counts.tolist()
    counts = []
    for size, (kind, value) in zip(sizes, weights):
        if kind == "repeat" and value is not None:
            counts.append(int(round(size * value)))
        elif kind == "choose" and value is not None:
            counts.append(int(value))
        else:
            counts.append(size)
    if epoch_size is not None and sum(counts):
        exact = np.array(counts, dtype=np.float64) * (epoch_size / sum(counts))
        scaled = np.floor(exact).astype(np.int64)
        short = int(epoch_size - scaled.sum())
        for i in np.argsort(-(exact - scaled), kind="stable")[:short]:
            scaled[i] += 1
        counts = scaled.tolist()
    return counts


def split_selection(pieces: list[np.ndarray], counts: list[int], seed: int) -> list[list[np.ndarray]]:
    """Cut a stream's selected samples (per-shard arrays) into consecutive parts of ``counts`` samples.

    The pieces are put in a ``seed``-random order first, so every part gets a random run of whole shards
    (cut at the part boundaries) rather than always the same end of the stream.
    """
    order = [pieces[i] for i in np.random.default_rng(seed).permutation(len(pieces))]
    parts: list[list[np.ndarray]] = [[] for _ in counts]
    part, room = 0, counts[0] if counts else 0
    for piece in order:
        while len(piece):
            while room == 0 and part + 1 < len(counts):
                part += 1
                room = counts[part]
            take = piece[:room] if room else piece
            parts[part].append(take)
            room -= min(room, len(take))
            piece = piece[len(take):]
    return parts


def select_samples(shards: list[np.ndarray], count: int, seed: int, epoch: int) -> list[np.ndarray]:
    """``count`` samples of a stream as per-shard id arrays: whole copies, then a seeded random remainder."""
    total = sum(len(s) for s in shards)
    if total == 0 or count == 0:
        return []
    full, rest = divmod(count, total)
    out = [s for _ in range(full) for s in shards]
    if rest:
        flat = np.concatenate(shards)
        chosen = np.sort(np.random.default_rng(seed + epoch).choice(total, rest, replace=False))
        picked = flat[chosen]
        bounds = np.cumsum([len(s) for s in shards])[:-1]
        out += [p for p in np.split(picked, np.searchsorted(chosen, bounds)) if len(p)]
    return out
