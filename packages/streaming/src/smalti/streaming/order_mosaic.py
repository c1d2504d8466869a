"""mosaicml-streaming 0.13's epoch orders, reproduced sample for sample (written from its behaviour, no code of its).

A job that moves from mosaicml-streaming to smalti resumes mid-epoch only if both hand every rank the same
samples in the same order. That order is two steps, both pure functions of the settings:

1. a shuffle (:func:`mosaic_shuffle`): a permutation of the epoch's sample positions by one of ``naive``,
   ``py1s``, ``py2s``, ``py1br``, ``py1e``. Each draws from ``default_rng(seed)`` (the run's fixed shard order)
   and ``default_rng(seed + epoch)`` in exactly the sequence the library does; canonical node ``c`` owns the
   positions ``[c * n // ncn, (c + 1) * n // ncn)`` (floor cuts);
2. a partition (:func:`mosaic_partition`): the canonical nodes' position ranges read one sample from each in
   turn, samples dealt to physical nodes, then to each node's ranks, round robin; a rank's samples cut into
   batches that its DataLoader workers take in turn. Short ranges and uneven splits are padded with repeated
   samples the way the library pads them.

:func:`mosaic_rank_order` composes them into what one rank's DataLoader yields, in order.
"""

from __future__ import annotations

import math

import numpy as np

from smalti.streaming.errors import StreamingError

MOSAIC_ALGOS = ("naive", "py1s", "py2s", "py1br", "py1e")


def node_cuts(num_samples: int, num_canonical_nodes: int) -> np.ndarray:
    """The canonical nodes' sample boundaries: node ``c`` owns ``[cuts[c], cuts[c + 1])`` (floor division)."""
    return np.arange(num_canonical_nodes + 1, dtype=np.int64) * num_samples // num_canonical_nodes


def _split_at_nodes(pieces: list[np.ndarray], num_canonical_nodes: int) -> list[list[np.ndarray]]:
    """Deal ``pieces`` (in order) to canonical nodes, cutting a piece that crosses a node's end in two.

    A piece goes whole to the current node while it fits (an empty piece always fits); one that overflows gives
    the node its head and keeps its tail for the next node.
    """
    total = sum(len(p) for p in pieces)
    ends = node_cuts(total, num_canonical_nodes)[1:]
    nodes: list[list[np.ndarray]] = []
    queue, at, filled = list(pieces), 0, 0
    for end in ends:
        node = []
        while at < len(queue):
            piece = queue[at]
            if filled + len(piece) <= end:
                node.append(piece)
                filled += len(piece)
                at += 1
                continue
            if filled < end:
                head = int(end - filled)
                node.append(piece[:head])
                queue[at] = piece[head:]
                filled = int(end)
            break
        nodes.append(node)
    return nodes


def _shard_ranges(sizes: np.ndarray) -> list[np.ndarray]:
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return [np.arange(starts[i], starts[i + 1], dtype=np.int64) for i in range(len(sizes))]


def _in_run_order(items: list, rng: np.random.Generator) -> list:
    return [items[i] for i in rng.permutation(len(items))]


def mosaic_shuffle(shard_sizes: np.ndarray | list[int], algo: str, num_canonical_nodes: int, seed: int, epoch: int,
                   block_size: int = 1 << 18) -> np.ndarray:
    """mosaicml-streaming's permutation of the epoch's sample positions: entry ``i`` is the sample read ``i``-th.

    ``shard_sizes`` are the samples of each shard in dataset order. Positions ``node_cuts(...)[c]`` to
    ``node_cuts(...)[c + 1]`` of the result belong to canonical node ``c``.
    """
    if algo not in MOSAIC_ALGOS:
        raise StreamingError(f"shuffle_algo={algo!r} is not one of mosaicml-streaming's {', '.join(MOSAIC_ALGOS)}")
    if num_canonical_nodes < 1:
        raise StreamingError(f"num_canonical_nodes={num_canonical_nodes} must be a positive number")
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    total = int(sizes.sum())
    if algo == "naive":
        return np.random.default_rng(seed + epoch).permutation(total)
    least = {"py1br": 2, "py1e": 1}.get(algo, 0)  # below, the library's draws of block sizes fail
    if block_size < least:
        raise StreamingError(f"shuffle_block_size={block_size} is too small for {algo}: mosaicml-streaming draws "
                             f"block sizes from [0.75x, 1.25x); use at least {least}")
    run_rng, epoch_rng = np.random.default_rng(seed), np.random.default_rng(seed + epoch)
    if algo == "py2s":
        return _py2s(sizes, num_canonical_nodes, run_rng, epoch_rng)
    nodes = _split_at_nodes(_in_run_order(_shard_ranges(sizes), run_rng), num_canonical_nodes)
    nodes = [_in_run_order(spans, epoch_rng) for spans in nodes]  # every node's span order before any sample's
    if algo == "py1s":
        return _concat([epoch_rng.permutation(span) for spans in nodes for span in spans])
    if algo == "py1br":
        return _py1br(nodes, block_size, epoch_rng)
    return _py1e(nodes, block_size, epoch_rng)


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays).astype(np.int64) if arrays else np.zeros(0, dtype=np.int64)


def _py2s(sizes: np.ndarray, ncn: int, run_rng: np.random.Generator, epoch_rng: np.random.Generator) -> np.ndarray:
    shards = _in_run_order(_shard_ranges(sizes), run_rng)
    shards = [run_rng.permutation(shard) for shard in shards]
    nodes = _split_at_nodes(shards, ncn)
    out = []
    for pieces in nodes:
        pieces = _in_run_order(pieces, epoch_rng)
        out += [epoch_rng.permutation(piece) for piece in pieces]
    return _concat(out)


def _py1br(nodes: list[list[np.ndarray]], block_size: int, rng: np.random.Generator) -> np.ndarray:
    """Each node's samples (spans in epoch order) shuffled inside random, staggered, overlapping windows."""
    low, high = int(0.75 * block_size), int(1.25 * block_size)
    staggers = rng.integers(0, low, (len(nodes),))
    out = []
    for spans, stagger in zip(nodes, staggers):
        ids = _concat(spans)
        end = 0
        windows = []
        while end < len(ids):
            size = rng.integers(low, high)
            lo, hi = max(end - stagger, 0), min(end + size - stagger, len(ids))
            windows.append((lo, hi))
            end += hi - lo
        for lo, hi in windows:
            ids[lo:hi] = rng.permutation(ids[lo:hi])
        out.append(ids)
    return _concat(out)


def _py1e(nodes: list[list[np.ndarray]], block_size: int, rng: np.random.Generator) -> np.ndarray:
    """Each span's samples shuffled, then moved by a uniform random shift bounded by a random block around it."""
    low, high = int(0.75 * block_size), int(1.25 * block_size)
    out = []
    for c, spans in enumerate(nodes):
        count = sum(len(s) for s in spans)
        if count == 0:
            raise StreamingError(f"canonical node {c} gets no samples: the dataset has fewer samples than "
                                 f"num_canonical_nodes={len(nodes)}; lower num_canonical_nodes")
        ids = _concat([rng.permutation(span) for span in spans])
        positions = np.arange(count, dtype=np.float64)
        offset = 0
        for span in spans:
            reach = max((rng.integers(low, high) - len(span)) / 2, 0)
            lo, hi = max(-reach, -offset), min(reach, count - offset - len(span))
            positions[offset : offset + len(span)] += rng.uniform(lo, hi, len(span))
            offset += len(span)
        out.append(ids[np.argsort(positions)])  # the library's (unstable) sort: positions are distinct anyway
    return _concat(out)


def check_node_ratio(num_canonical_nodes: int, num_nodes: int) -> None:
    """mosaicml-streaming's ``orig`` partition needs either node count to divide the other."""
    big, small = max(num_canonical_nodes, num_nodes), min(num_canonical_nodes, num_nodes)
    if big % small:
        raise StreamingError(f"num_canonical_nodes={num_canonical_nodes} and the physical node count {num_nodes} "
                             "must divide one another for mosaicml-streaming's order (partition_algo='orig'); "
                             "change num_canonical_nodes")


def _canonical_rows(num_samples: int, ncn: int, num_nodes: int) -> np.ndarray:
    """Sample positions per canonical node, one row each, padded to equal length with repeated positions."""
    per_node = -(-num_samples // ncn)
    ratio = num_nodes // ncn if ncn < num_nodes else 0
    padding = (-per_node) % ratio if ratio else 0
    width = per_node + padding
    if num_samples > ncn or (num_samples == ncn and ncn >= num_nodes):
        cuts = node_cuts(num_samples, ncn)
        rows = cuts[:-1, None] + np.arange(width, dtype=np.int64)[None, :]
        rows[:, per_node - 1] -= (cuts[1:] - cuts[:-1]) < per_node  # a short row repeats its last sample
        if padding:
            src = width - padding - ratio + 1  # the padding repeats the samples just before the row's last ones
            rows[:, width - padding :] = rows[:, src - padding : src]
        return rows
    needed = ncn * width  # fewer samples than canonical nodes: the samples repeated in turn
    return np.resize(np.arange(num_samples, dtype=np.int64), needed).reshape(ncn, width)


def mosaic_partition(num_samples: int, num_canonical_nodes: int, num_nodes: int, ranks_per_node: int,
                     workers_per_rank: int, batch_size: int, drop_first: int = 0,
                     initial_nodes: int | None = None) -> np.ndarray:
    """mosaicml-streaming's ``get_partitions`` (``relaxed``, which is ``orig`` unless the node count changed).

    Returns sample positions shaped ``(nodes, ranks per node, workers per rank, batches per worker, batch
    size)``; ``-1`` pads. ``drop_first`` samples (resumption) are skipped, rounded down to whole node rounds.
    """
    for name, value in (("num_canonical_nodes", num_canonical_nodes), ("nodes", num_nodes),
                        ("ranks_per_node", ranks_per_node), ("workers_per_rank", workers_per_rank),
                        ("batch_size", batch_size)):
        if value < 1:
            raise StreamingError(f"{name}={value} must be a positive number")
    if initial_nodes is not None and max(num_canonical_nodes, num_nodes) % min(num_canonical_nodes, num_nodes):
        global_batch = num_nodes * ranks_per_node * batch_size
        if global_batch % (initial_nodes * ranks_per_node):
            raise StreamingError(f"the global batch {global_batch} must stay divisible by the first run's "
                                 f"{initial_nodes * ranks_per_node} ranks to resume on another node count")
        first = mosaic_partition(num_samples, num_canonical_nodes, initial_nodes, ranks_per_node, workers_per_rank,
                                 global_batch // (initial_nodes * ranks_per_node), drop_first)
        steps = first.transpose(3, 2, 0, 1, 4).reshape(-1, workers_per_rank, num_nodes, ranks_per_node, batch_size)
        return steps.transpose(2, 3, 1, 0, 4)
    check_node_ratio(num_canonical_nodes, num_nodes)
    drop_first -= drop_first % num_nodes
    flat = _canonical_rows(num_samples, num_canonical_nodes, num_nodes).T.reshape(-1)[drop_first:]
    per_node = flat.reshape(-1, num_nodes).T
    short = (-per_node.shape[1]) % ranks_per_node
    if short:
        have = per_node.shape[1]
        if ranks_per_node + short - 1 <= have:
            extra = per_node[:, have - ranks_per_node - short + 1 : have - ranks_per_node + 1]
        else:
            extra = np.concatenate([np.tile(per_node, short // have), per_node[:, : short % have]], 1)
        per_node = np.concatenate([per_node, extra], 1)
    per_rank = per_node.reshape(num_nodes, -1, ranks_per_node).transpose(0, 2, 1)
    unit = workers_per_rank * batch_size
    length = math.ceil(per_rank.shape[2] / unit) * unit
    padded = np.full((num_nodes, ranks_per_node, length), -1, dtype=np.int64)
    padded[:, :, : per_rank.shape[2]] = per_rank
    return padded.reshape(num_nodes, ranks_per_node, -1, workers_per_rank, batch_size).transpose(0, 1, 3, 2, 4)


def mosaic_work(shard_sizes: np.ndarray | list[int], *, shuffle: bool, algo: str, seed: int, epoch: int,
                num_canonical_nodes: int, block_size: int, num_nodes: int, ranks_per_node: int,
                workers_per_rank: int, batch_size: int, drop_first: int = 0,
                initial_nodes: int | None = None) -> np.ndarray:
    """The epoch's sample ids per node, rank, worker, batch (``-1`` pads), as mosaicml-streaming's ``random``
    batching of a dataset read whole (no stream weights, no ``epoch_size``) arranges them."""
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    work = mosaic_partition(int(sizes.sum()), num_canonical_nodes, num_nodes, ranks_per_node, workers_per_rank,
                            batch_size, drop_first, initial_nodes)
    if not shuffle:
        return work
    order = mosaic_shuffle(sizes, algo, num_canonical_nodes, seed, epoch, block_size)
    return np.where(work >= 0, order[np.maximum(work, 0)], -1)


def mosaic_rank_order(work: np.ndarray, node: int, local_rank: int) -> np.ndarray:
    """What rank ``local_rank`` of node ``node`` yields, in order: its workers' batches taken in turn."""
    batches = work[node, local_rank].transpose(1, 0, 2).reshape(-1)  # batch 0 of worker 0, of worker 1, ...
    return batches[batches >= 0]
