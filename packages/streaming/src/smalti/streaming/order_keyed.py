"""The ``keyed`` epoch order: :mod:`~smalti.streaming.order_blocks`'s design with no permutation of the shards.

``blocks`` draws two permutations of every shard before the first batch (the run's shard order, then each
epoch's span order inside every canonical node's piece): O(shards) work and memory in every process, about
55 ms of CPU at 610,000 shards. :class:`KeyedOrder` replaces both by keyed bijections (the Feistel networks
with cycle walking of :func:`~smalti.streaming.order_blocks.permute_within`) evaluated only where a rank
reads, over *chunks* of shards so that the few tables left are small:

1. Shards are grouped in ``Q`` chunks of at most ``chunk_shards`` shards, strided over the index (chunk ``q``
   holds shards ``q, q + Q, q + 2Q, ...``: each chunk samples the whole dataset, even one written sorted by
   source). The default ``chunk_shards`` is ``min(64, max(1, shards // 4096))``: chunks are single shards
   until the index has 8,192 of them, and there are always at least 4,096 chunks beyond that.
2. The run's chunk order is a bijection of ``[0, Q)`` keyed by the seed; it is cut into ``num_canonical_nodes``
   pieces of (nearly) equal sample counts, as ``blocks`` cuts its shard order (a chunk cut by a piece
   border becomes two *parts*, one on each side).
3. Each epoch, a node's parts are put in an order by a bijection keyed by (seed, epoch, node), and inside a
   part its shards by one keyed by (seed, epoch, chunk); tables of a node's parts are built the first time
   the node is read (O(parts of the node)), a part's shards only while a block that covers them is computed.
4. As for ``blocks``: each node's sample sequence is cut into blocks of ``block_size`` samples permuted by a
   keyed Feistel bijection, the nodes are interleaved one sample each in turn, padded to whole global batches
   and grouped by canonical node inside each global batch (:class:`~smalti.streaming.order_blocks.BlockOrder`
   does all of this; only how a node position maps to a sample id differs).

Building the order costs one strided pass over the shard sizes (the chunks' sample counts) and bijections
over the ``Q`` chunks; any position of the epoch is then reached without replaying anything.
"""

from __future__ import annotations

import numpy as np

from smalti.streaming.errors import StreamingError
from smalti.streaming.order_blocks import BlockOrder, permute_keyed, permute_within, splitmix

_RUN_SALT, _EPOCH_SALT, _BLOCK_SALT = 0x6B65796564, 0x65706F6368, 0x626C6F636B
_NODE_MUL, _PART_MUL = 0xD6E8FEB86659FD93, 0xA0761D6478BD642F
_M64 = (1 << 64) - 1
_PARTS_PER_PASS = 1024  # parts whose shard tables are built in one vectorised pass (bounds the temporaries)
_SPAN_CACHE = 4096  # parts whose span tables are kept (at most 65 spans each: about 4 MB)
_FEW_PARTS = 8  # parts computed one at a time rather than in one vectorised pass


def _hash(*values: int) -> int:
    """A 64-bit key mixed from ``values`` (splitmix64's finaliser, chained)."""
    key = 0
    for value in values:
        key = int(splitmix(np.array([(key ^ value) & _M64], dtype=np.uint64))[0])
    return key


def default_chunk_shards(shards: int) -> int:
    """Shards per chunk: one until the index has 8,192 shards, then ``shards // 4096`` up to 64."""
    return min(64, max(1, shards // 4096))


class _NodeParts:
    """One canonical node's parts this epoch: ``order[j]`` is the part at epoch place ``j`` (part ``k`` is
    the run's chunk ``p0 + k``), ``pos`` each place's first epoch sequence position (and the node's end),
    ``lo``/``length`` each part's samples inside its chunk."""

    __slots__ = ("p0", "order", "pos", "lo", "length")

    def __init__(self, p0: int, order: np.ndarray, pos: np.ndarray, lo: np.ndarray, length: np.ndarray) -> None:
        self.p0, self.order, self.pos, self.lo, self.length = p0, order, pos, lo, length


class KeyedOrder(BlockOrder):
    """One epoch's ``keyed`` order over shards of ``shard_sizes`` samples (see the module docstring).

    The same interface and promises as :class:`~smalti.streaming.order_blocks.BlockOrder`; ``chunk_shards``
    overrides the chunk width (tests use it to exercise chunks of several shards at small sizes).
    """

    def __init__(self, shard_sizes: np.ndarray, *, seed: int, epoch: int, num_canonical_nodes: int,
                 global_batch: int, block_size: int | None = None, shard_first_ids: np.ndarray | None = None,
                 chunk_shards: int | None = None) -> None:
        sizes = self._setup(shard_sizes, seed, epoch, num_canonical_nodes, global_batch, block_size)
        count = len(sizes)
        if shard_first_ids is None:
            first = np.empty(count, dtype=np.int64)
            first[:1] = 0
            np.cumsum(sizes[:-1], out=first[1:])
        else:
            first = np.asarray(shard_first_ids, dtype=np.int64)
            if len(first) != count:
                raise StreamingError(f"shard_first_ids has {len(first)} entries for {count} shards")
        if chunk_shards is not None and chunk_shards < 1:
            raise StreamingError(f"chunk_shards={chunk_shards} must be a positive number of shards")
        g = int(chunk_shards or default_chunk_shards(count))
        q_count = -(-count // g)
        self._sizes, self._first, self._g, self._q = sizes, first, g, q_count
        chunk_len = np.zeros(q_count, dtype=np.int64)
        for i in range(g):  # chunk q holds shards q, q + Q, ...: one strided pass, no copy
            row = sizes[i * q_count : (i + 1) * q_count]
            chunk_len[: len(row)] += row
        seed_u = self.seed % (1 << 64)
        run_key = np.full(q_count, _hash(seed_u, _RUN_SALT), dtype=np.uint64)
        self._run_chunk = permute_within(np.arange(q_count, dtype=np.int64), q_count, run_key) if q_count else \
            np.zeros(0, dtype=np.int64)
        self._run_starts = np.zeros(q_count + 1, dtype=np.int64)
        np.cumsum(chunk_len[self._run_chunk], out=self._run_starts[1:])
        cuts = np.linspace(0, self.num_samples, num_canonical_nodes + 1).round().astype(np.int64)
        self._cuts = cuts
        self._lengths = np.diff(cuts)  # samples per canonical node
        self._node_start = cuts[:-1]
        self._epoch_key = _hash(seed_u, _EPOCH_SALT, self.epoch % (1 << 64))
        self._key = _hash(self._epoch_key, _BLOCK_SALT)  # the blocks' Feistel keys (BlockOrder._block_keys)
        self._nodes: dict[int, _NodeParts] = {}
        self._spans: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._build_interleave()

    # ---------------------------------------------------------------- a node's parts, built on first use

    def _node(self, node: int) -> _NodeParts:
        parts = self._nodes.get(node)
        if parts is not None:
            return parts
        lo_cut, hi_cut = int(self._cuts[node]), int(self._cuts[node + 1])
        starts = self._run_starts
        p0 = max(int(np.searchsorted(starts, lo_cut, side="right")) - 1, 0)
        p1 = max(int(np.searchsorted(starts, hi_cut, side="left")), p0) if hi_cut > lo_cut else p0
        lo = np.maximum(starts[p0:p1], lo_cut)
        length = np.minimum(starts[p0 + 1 : p1 + 1], hi_cut) - lo
        lo -= starts[p0:p1]  # where the part begins inside its chunk
        count = p1 - p0
        key = np.full(count, _hash(self._epoch_key, (node * _NODE_MUL) & _M64), dtype=np.uint64)
        order = permute_within(np.arange(count, dtype=np.int64), count, key)
        pos = np.empty(count + 1, dtype=np.int64)
        pos[0] = lo_cut
        np.cumsum(length[order], out=pos[1:])
        pos[1:] += lo_cut
        parts = self._nodes[node] = _NodeParts(p0, order, pos, lo, length)
        return parts

    def _part_spans(self, node: int, places: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The non-empty spans of the parts at epoch places ``places`` (increasing) of ``node``, in epoch
        order: each one's first epoch sequence position and its id offset. Parts asked again (a rank's next
        blocks mostly fall in the parts of its last ones) come from a bounded cache."""
        cache = self._spans
        if len(places) > _SPAN_CACHE // 4:
            return self._build_part_spans(node, places)
        if len(places) <= _FEW_PARTS:  # a block's parts: one by one, with scalar keys
            tables = [self._place_spans(node, j) for j in places.tolist()]
            if len(tables) == 1:
                return tables[0]
            return np.concatenate([p for p, _ in tables]), np.concatenate([o for _, o in tables])
        missing = [j for j in places.tolist() if (node, j) not in cache]
        if missing:
            if len(cache) + len(missing) > _SPAN_CACHE:
                cache.clear()
            span_pos, span_off = self._build_part_spans(node, np.array(missing, dtype=np.int64))
            cut = np.searchsorted(span_pos, self._node(node).pos[missing[1:]])
            for j, pos, off in zip(missing, np.split(span_pos, cut), np.split(span_off, cut)):
                cache[node, j] = (pos, off)
        if len(places) == 1:
            return cache[node, int(places[0])]
        tables = [cache[node, j] for j in places.tolist()]
        return np.concatenate([p for p, _ in tables]), np.concatenate([o for _, o in tables])

    def _build_part_spans(self, node: int, places: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_part_spans`, computed (in passes of at most ``_PARTS_PER_PASS`` parts)."""
        if len(places) > _PARTS_PER_PASS:
            pieces = [self._build_part_spans(node, places[i : i + _PARTS_PER_PASS])
                      for i in range(0, len(places), _PARTS_PER_PASS)]
            return np.concatenate([p for p, _ in pieces]), np.concatenate([o for _, o in pieces])
        parts = self._node(node)
        k = parts.order[places]
        chunk = self._run_chunk[parts.p0 + k]
        lo = parts.lo[k][:, None]
        hi = lo + parts.length[k][:, None]
        g, count = self._g, len(self._sizes)
        members = chunk[:, None] + np.arange(g, dtype=np.int64)[None, :] * self._q
        valid = members < count
        members = np.where(valid, members, 0)
        size = np.where(valid, self._sizes[members], 0)
        end = np.cumsum(size, axis=1)
        start = end - size  # each shard's place inside the chunk
        a, b = np.clip(start, lo, hi), np.clip(end, lo, hi)
        length, first = b - a, self._first[members] + (a - start)
        if g > 1:  # this epoch's order of the part's shards
            keys = (self._epoch_key ^ ((chunk.astype(np.uint64) + np.uint64(1)) * np.uint64(_PART_MUL)))
            keys = splitmix(keys)
            slot = permute_within(np.tile(np.arange(g, dtype=np.int64), len(chunk)), g, np.repeat(keys, g))
            slot = slot.reshape(len(chunk), g)
            length = np.take_along_axis(length, slot, axis=1)
            first = np.take_along_axis(first, slot, axis=1)
        span_pos = np.cumsum(length, axis=1) - length + parts.pos[places][:, None]
        keep = length > 0
        span_pos = span_pos[keep]
        return span_pos, first[keep] - span_pos

    def _place_spans(self, node: int, j: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_part_spans` of the one part at epoch place ``j`` of ``node``, from the cache or computed
        with scalar keys (the part's chunk is one number, its shard order one small bijection)."""
        cached = self._spans.get((node, j))
        if cached is not None:
            return cached
        parts = self._node(node)
        k = int(parts.order[j])
        chunk = int(self._run_chunk[parts.p0 + k])
        lo = int(parts.lo[k])
        hi = lo + int(parts.length[k])
        g = self._g
        size, first = np.zeros(g, dtype=np.int64), np.zeros(g, dtype=np.int64)
        members = self._sizes[chunk :: self._q]  # the chunk's shards: chunk, chunk + Q, ... (at most g)
        size[: len(members)] = members
        first[: len(members)] = self._first[chunk :: self._q]
        end = np.cumsum(size)
        start = end - size  # each shard's place inside the chunk
        a = np.clip(start, lo, hi)
        length = np.clip(end, lo, hi) - a
        first += a - start
        if g > 1:  # this epoch's order of the part's shards
            slot = permute_keyed(np.arange(g, dtype=np.int64), g, _hash(self._epoch_key ^ (((chunk + 1) * _PART_MUL) & _M64)))
            length, first = length[slot], first[slot]
        span_pos = np.cumsum(length)
        span_pos -= length
        span_pos += parts.pos[j]
        keep = length > 0
        span_pos = span_pos[keep]
        table = span_pos, first[keep] - span_pos
        if len(self._spans) >= _SPAN_CACHE:
            self._spans.clear()
        self._spans[node, j] = table
        return table

    def _block_spans(self, node: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        parts = self._node(node)
        # places [j0, j1) hold positions [start, end); searching start + 1 finds the place after start's
        j0, j1 = np.searchsorted(parts.pos, (start + 1, end)).tolist()
        j0 -= 1
        if j1 - j0 == 1:
            span_pos, span_off = self._place_spans(node, j0)
        else:
            span_pos, span_off = self._part_spans(node, np.arange(j0, j1, dtype=np.int64))
        s0, s1 = np.searchsorted(span_pos, (start + 1, end)).tolist()
        return span_pos[s0 - 1 : s1], span_off[s0 - 1 : s1]

    def _offsets_at(self, node: int, pos: np.ndarray) -> np.ndarray:
        parts = self._node(node)
        places = np.unique(np.searchsorted(parts.pos, pos, side="right") - 1)
        span_pos, span_off = self._part_spans(node, places)
        return span_off[np.searchsorted(span_pos, pos, side="right") - 1]
