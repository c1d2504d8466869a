"""The ``blocks`` epoch order: any batch of the epoch computed directly, in memory that grows with shards only.

mosaicml-streaming's shuffles (:mod:`smalti.streaming.order`) build the whole epoch as arrays of every sample
id (memory and time for every sample: tens of GB and minutes at 1e9 samples, on every rank, every epoch and
every resume; figures in the README's "The blocks order at pretraining scale"). :class:`BlockOrder` keeps
only per-span tables (a span is a shard, or the part of one on one canonical node) and computes the ids of
global batches ``[k0, k1)``, or one rank's columns of them, when they are needed:

1. Shards are put in a ``seed``-random order once per run and the sample sequence is cut into
   ``num_canonical_nodes`` contiguous pieces of (nearly) equal sample counts; a shard cut by a piece border
   becomes two spans. Each epoch permutes the spans inside every piece (``seed``, ``epoch``).
2. Each piece's sample sequence is cut into blocks of ``block_size`` samples (default ``1 << 18``, a power
   of four so a full block needs no cycle walking) and every block is permuted by a keyed bijection: a
   four-round balanced Feistel network over ``4**h >= len(block)`` values keyed by (seed, epoch, node,
   block), cycle-walking back into the block when it lands outside.
3. The pieces are interleaved one sample each in turn (a piece that runs out drops out), padded with the
   interleave's first samples to whole global batches, and inside each global batch the samples are grouped
   by canonical node, as :mod:`smalti.streaming.order` does for the other shuffles, so global batches do not
   depend on the node, rank or worker counts and a physical node reads only its canonical nodes' shards.

How many samples of each piece the first ``x`` interleave positions hold is a closed form of ``x`` (see
:meth:`BlockOrder._taken`), so a global batch is, per canonical node, one run of that node's sequence: any
position is reached in O(num_canonical_nodes) without replaying the epoch.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from smalti.streaming.errors import StreamingError

DEFAULT_BLOCK = 1 << 18
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_ROUNDS = 4
_ROUND_KEYS = [np.uint64((i + 1) * 0x9E3779B97F4A7C15 % (1 << 64)) for i in range(_ROUNDS)]
_M64 = (1 << 64) - 1
_CHUNK = 1 << 16  # samples decoded per vectorised pass: small enough for the CPU cache
_BUCKET_BITS = 12  # at most 4,096 buckets in a block's span lookup
_SIGN = np.int64(63)
_PLANS = 64  # blocks whose plans a BlockOrder keeps (a rank's next batches mostly fall in its last blocks)


def splitmix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise on uint64 (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _half_bits(n: np.ndarray) -> np.ndarray:
    """Per entry, the smallest ``h >= 1`` with ``4**h >= n``."""
    bits = np.ceil(np.log2(np.maximum(n, 2).astype(np.float64))).astype(np.int64)
    return np.maximum((bits + 1) // 2, 1)


def _feistel(v: np.ndarray, h: np.ndarray | np.uint64, keys: np.ndarray) -> np.ndarray:
    """A balanced Feistel network over ``2h``-bit values: a keyed permutation of ``[0, 4**h)``."""
    mask = (np.uint64(1) << h) - np.uint64(1)
    shift = np.uint64(64) - h
    left, right = v >> h, v & mask
    f = np.empty_like(v)
    for round_key in _ROUND_KEYS:
        np.add(keys, round_key, out=f)
        f ^= right
        f *= _GOLDEN
        f >>= shift
        f ^= left
        spare = left  # free once the halves swap: the next round's buffer
        left, right = right, f
        f = spare
    left <<= h
    left |= right
    return left


def _feistel_scalar(v: np.ndarray, h: int, round_keys: list[np.uint64]) -> np.ndarray:
    """:func:`_feistel` with one key for all values (its round keys given): a new array."""
    hu = np.uint64(h)
    shift = np.uint64(64 - h)
    left = v >> hu
    right = v & np.uint64((1 << h) - 1)
    f = np.empty_like(v)
    for round_key in round_keys:
        np.bitwise_xor(right, round_key, out=f)
        f *= _GOLDEN
        f >>= shift
        f ^= left
        left, right, f = right, f, left
    left <<= hu
    left |= right
    return left


_IOTA = np.arange(_CHUNK, dtype=np.int64)
_IOTA.flags.writeable = False


def _iota(n: int) -> np.ndarray:
    """``np.arange(n)`` as a read-only view of a kept array while ``n`` is at most ``16 * _CHUNK``."""
    global _IOTA
    iota = _IOTA
    if n > len(iota):
        if n > 16 * _CHUNK:
            return np.arange(n, dtype=np.int64)
        iota = np.arange(max(n, 2 * len(iota)), dtype=np.int64)
        iota.flags.writeable = False
        _IOTA = iota
    return iota[:n]


def _feistel_into(v: np.ndarray, h: int, round_keys: list[np.uint64], left: np.ndarray, f: np.ndarray) -> None:
    """:func:`_feistel_scalar` in place on ``v`` (uint64), with two scratch arrays of its length: no array is
    allocated (each pass of NumPy costs about as much as a new array's page faults would)."""
    hu = np.uint64(h)
    shift = np.uint64(64 - h)
    np.right_shift(v, hu, out=left)
    np.bitwise_and(v, np.uint64((1 << h) - 1), out=v)
    right = v
    for round_key in round_keys:
        np.bitwise_xor(right, round_key, out=f)
        np.multiply(f, _GOLDEN, out=f)
        np.right_shift(f, shift, out=f)
        np.bitwise_xor(f, left, out=f)
        left, right, f = right, f, left
    np.left_shift(left, hu, out=left)
    np.bitwise_or(left, right, out=v)


class _SpanLookup:
    """Which span each position of a block is in: for positions in ``[0, size)``, how many of the increasing
    ``borders`` (the spans' starts inside the block, the first span's excluded) each is at or past.

    Positions are put in buckets of ``2**shift``; a table gives the borders before each bucket, and one
    step per border a bucket can hold adds those the position is past (a binary search per sample costs
    about five times as much). Buckets no wider than the narrowest gap between borders hold one border at
    most; a block with a very narrow span gets at most ``2**_BUCKET_BITS`` buckets and a few more steps.
    """

    __slots__ = ("shift", "table", "last", "steps")

    def __init__(self, borders: np.ndarray, size: int) -> None:
        n = len(borders)
        narrowest = int((borders[1:] - borders[:-1]).min()) if n > 1 else size
        shift = max(narrowest.bit_length() - 1, (max(size, 1) - 1).bit_length() - _BUCKET_BITS, 0)
        buckets = ((size - 1) >> shift) + 1
        table = np.empty(buckets + 1, dtype=np.int64)  # and the borders' count, the last bucket's end
        table[:-1] = borders.searchsorted(np.arange(0, size, 1 << shift, dtype=np.int64), side="right")
        table[-1] = n
        self.steps = int((table[1:] - table[:-1]).max())  # the most borders one bucket holds
        self.shift, self.table = np.int64(shift), table
        # the last position before each span's next border (past the last border: never reached)
        self.last = np.empty(n + 1, dtype=np.int64)
        np.subtract(borders, 1, out=self.last[:n])
        self.last[n] = np.iinfo(np.int64).max - 1

    def spans(self, pos: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> np.ndarray:
        """Each position's span into ``out`` (int64, the length of ``pos``; ``scratch`` likewise)."""
        np.right_shift(pos, self.shift, out=scratch)
        np.take(self.table, scratch, out=out, mode="clip")  # "clip": indices are in range, and "raise" copies
        for _ in range(self.steps):
            np.take(self.last, out, out=scratch, mode="clip")
            np.subtract(scratch, pos, out=scratch)  # negative where pos is at or past the next border
            np.right_shift(scratch, _SIGN, out=scratch)  # ... then -1, else 0
            np.subtract(out, scratch, out=out)
        return out


class _BlockPlan:
    """What computing canonical node rows inside one block needs, made once per block: its size, the
    Feistel network's half width ``h`` and round keys, the id offset of each span it covers (a sample's id
    is its position in the block plus its span's offset) and the lookup of those spans."""

    __slots__ = ("size", "h", "keys", "walk", "offsets", "lookup")

    def __init__(self, size: int, keys: list[np.uint64], offsets: np.ndarray, borders: np.ndarray) -> None:
        self.size, self.keys, self.offsets = size, keys, offsets
        self.h = max(((max(size, 2) - 1).bit_length() + 1) // 2, 1)  # 4**h >= size, as _half_bits
        self.walk = size < 1 << (2 * self.h)  # cycle-walk back into a block shorter than 4**h
        self.lookup = _SpanLookup(borders, size) if len(offsets) > 1 else None

    def ids(self, dest: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        """Offsets in the block (``dest``, int64) -> sample ids, in place; ``a``, ``b`` are int64 scratch."""
        v = dest.view(np.uint64)
        _feistel_into(v, self.h, self.keys, a.view(np.uint64), b.view(np.uint64))
        if self.walk:
            size = np.uint64(self.size)
            outside = np.flatnonzero(v >= size)
            while len(outside):
                w = _feistel_scalar(v[outside], self.h, self.keys)
                v[outside] = w
                outside = outside[w >= size]
        if self.lookup is None:
            dest += self.offsets[0]
        else:
            np.take(self.offsets, self.lookup.spans(dest, a, b), out=b, mode="clip")
            dest += b


def permute_within(offsets: np.ndarray, sizes: np.ndarray | int, keys: np.ndarray) -> np.ndarray:
    """A keyed bijection of ``[0, sizes[i])`` applied to ``offsets[i]``: each key gives another permutation.

    A balanced Feistel network over ``2h``-bit values (``4**h >= size``) is a permutation of ``[0, 4**h)``;
    applying it again to values that land at or beyond ``size`` (cycle walking) makes it one of ``[0, size)``.
    ``sizes`` may be one number for all.
    """
    if np.ndim(sizes) == 0:
        h: np.ndarray | np.uint64 = np.uint64(_half_bits(np.array([sizes]))[0])
        size_u: np.ndarray | np.uint64 = np.uint64(sizes)
    else:
        h, size_u = _half_bits(sizes).astype(np.uint64), np.asarray(sizes).astype(np.uint64)
    out = _feistel(offsets.astype(np.uint64), h, keys)
    outside = np.flatnonzero(out >= size_u)
    while len(outside):
        hh = h if np.ndim(h) == 0 else h[outside]
        lim = size_u if np.ndim(size_u) == 0 else size_u[outside]
        v = _feistel(out[outside], hh, keys[outside])
        out[outside] = v
        outside = outside[v >= lim]
    return out.view(np.int64)


def permute_keyed(offsets: np.ndarray, size: int, key: int) -> np.ndarray:
    """:func:`permute_within` with one ``size`` and one ``key`` for all ``offsets``: the same values, with the
    round keys made once as scalars."""
    h = max(((max(size, 2) - 1).bit_length() + 1) // 2, 1)
    round_keys = [np.uint64((key + int(rk)) & _M64) for rk in _ROUND_KEYS]
    out = _feistel_scalar(offsets.astype(np.uint64), h, round_keys)
    if size < 1 << (2 * h):
        outside = np.flatnonzero(out >= np.uint64(size))
        while len(outside):
            v = _feistel_scalar(out[outside], h, round_keys)
            out[outside] = v
            outside = outside[v >= np.uint64(size)]
    return out.view(np.int64)


class BlockOrder:
    """One epoch's order over shards of ``shard_sizes`` samples (see the module docstring).

    ``shard_first_ids`` are each shard's first global sample id (default: the cumulative sizes), so a
    stream's shards can keep the ids they have in a multi-stream dataset. Memory is O(shards + nodes);
    :meth:`grid` and :meth:`ids` cost O(samples asked + nodes).
    """

    def __init__(self, shard_sizes: np.ndarray, *, seed: int, epoch: int, num_canonical_nodes: int,
                 global_batch: int, block_size: int | None = None,
                 shard_first_ids: np.ndarray | None = None) -> None:
        sizes = self._setup(shard_sizes, seed, epoch, num_canonical_nodes, global_batch, block_size)
        n = self.num_samples
        seed_u = self.seed % (1 << 64)
        run_rng = np.random.default_rng([seed_u, 0x5B10C5])
        epoch_rng = np.random.default_rng([seed_u, self.epoch % (1 << 64), 0x5B10C5])
        # Temporaries are dropped as soon as they are used and shard indices are int32: the peak memory of
        # these tables is what a process pays at 1e6 shards. (Shuffling an int32 arange draws the same
        # numbers as permutation(count), so the orders are unchanged.)
        index_type = np.int32 if len(sizes) < 1 << 31 else np.int64
        # 1. shards in a run order, cut into pieces of equal sample counts; a cut shard becomes two spans
        perm = run_rng.permutation(np.arange(len(sizes), dtype=index_type))
        if shard_first_ids is None:
            first = np.empty(len(sizes), dtype=np.int64)
            first[:1] = 0
            np.cumsum(sizes[:-1], out=first[1:])
        else:
            first = np.asarray(shard_first_ids, dtype=np.int64)
        run_sizes, run_first = sizes[perm], first[perm]
        del first, perm
        run_starts = np.empty(len(sizes) + 1, dtype=np.int64)
        run_starts[0] = 0
        np.cumsum(run_sizes, out=run_starts[1:])
        cuts = np.linspace(0, n, num_canonical_nodes + 1).round().astype(np.int64)
        # spans: the non-empty shards in run order, split where a piece border falls inside one
        nonempty = run_sizes > 0
        if nonempty.all():
            span_lo, span_first, span_len = run_starts[:-1], run_first, run_sizes
        else:
            keep = np.flatnonzero(nonempty)
            span_lo, span_first, span_len = run_starts[keep], run_first[keep], run_sizes[keep]
        del nonempty, run_sizes, run_first  # the span tables hold them (or copies) from here
        inner = cuts[1:-1]
        at = np.searchsorted(span_lo, inner, side="right")
        split = np.flatnonzero((at > 0) & (span_lo[np.maximum(at - 1, 0)] != inner))
        split = split[np.concatenate([[True], inner[split][1:] != inner[split][:-1]])] if len(split) else split
        if len(split):
            where, lo = at[split], inner[split]
            shard_lo = span_lo[where - 1]
            ends = shard_lo + span_len[where - 1]
            # a span runs from its border to the next border or its shard's end (one shard may hold several)
            tail = np.minimum(ends, np.append(lo[1:], ends[-1:])) - lo
            head = lo - np.maximum(shard_lo, np.concatenate([[-1], lo[:-1]]))
            span_first = np.insert(span_first, where, span_first[where - 1] + (lo - shard_lo))
            span_len = np.insert(span_len, where, tail)
            span_lo = np.insert(span_lo, where, lo)
            span_len[where + np.arange(len(where)) - 1] = head  # the span just before each border ends there
        # ... and each epoch the spans of every piece in a new order
        node_bounds = np.searchsorted(span_lo, cuts)
        count = len(span_lo)
        del span_lo, run_starts
        order = np.empty(count, dtype=index_type)
        for lo, hi in zip(node_bounds[:-1].tolist(), node_bounds[1:].tolist()):
            order[lo:hi] = epoch_rng.permutation(np.arange(hi - lo, dtype=index_type))
            order[lo:hi] += lo
        self._pos = np.empty(len(order) + 1, dtype=np.int64)  # epoch sequence position of each span
        self._pos[0] = 0
        np.take(span_len, order, out=self._pos[1:])
        del span_len
        np.cumsum(self._pos[1:], out=self._pos[1:])
        self._off = span_first[order]  # a sample's id is its epoch position plus its span's offset
        del span_first, order
        self._off -= self._pos[:-1]
        self._lengths = np.diff(cuts)  # samples per canonical node
        self._node_start = cuts[:-1]
        self._key = int(splitmix(np.array([seed_u ^ int(splitmix(np.array([self.epoch % (1 << 64)], np.uint64))[0])],
                                      np.uint64))[0])
        self._build_interleave()

    def _setup(self, shard_sizes: np.ndarray, seed: int, epoch: int, num_canonical_nodes: int, global_batch: int,
               block_size: int | None) -> np.ndarray:
        """Check the arguments and set what every order of this kind has; returns the sizes as int64."""
        sizes = np.asarray(shard_sizes, dtype=np.int64)
        if num_canonical_nodes < 1:
            raise StreamingError(f"num_canonical_nodes={num_canonical_nodes} must be a positive number")
        if global_batch < 1:
            raise StreamingError(f"global_batch={global_batch} must be a positive number of samples")
        if block_size is not None and block_size < 1:
            raise StreamingError(f"shuffle_block_size={block_size} must be a positive number of samples")
        if (sizes < 0).any():
            raise StreamingError("shard sizes must not be negative")
        self.seed, self.epoch = int(seed), int(epoch)
        self.num_nodes = num_canonical_nodes
        self.global_batch = global_batch
        self.block = int(block_size or DEFAULT_BLOCK)
        self.num_samples = int(sizes.sum())
        self.num_batches = -(-self.num_samples // global_batch)
        self.padded_size = self.num_batches * global_batch
        self._plans: dict[tuple[int, int], _BlockPlan] = {}
        return sizes

    def _block_spans(self, node: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The spans that epoch sequence positions ``[start, end)`` of canonical node ``node`` cover, in order:
        each one's first position and its id offset (a sample's id is its position plus the offset)."""
        s0 = int(np.searchsorted(self._pos, start, side="right")) - 1
        s1 = int(np.searchsorted(self._pos, end, side="left"))
        return self._pos[s0:s1], self._off[s0:s1]

    def _offsets_at(self, node: int, pos: np.ndarray) -> np.ndarray:
        """The id offsets of canonical node ``node``'s epoch sequence positions ``pos``."""
        return self._off[np.searchsorted(self._pos, pos, side="right") - 1]

    # ---------------------------------------------------------------- epoch sequence position -> sample id

    def _block_keys(self, node: int, block: int) -> list[np.uint64]:
        """The Feistel round keys of canonical node ``node``'s block ``block``."""
        k = ((((node << 40) | block) ^ self._key) * int(_MIX1)) & _M64
        k ^= k >> 29
        return [np.uint64((k + int(rk)) & _M64) for rk in _ROUND_KEYS]

    def _block_plan(self, node: int, block: int) -> _BlockPlan:
        """Canonical node ``node``'s block ``block``: its keys and spans, from a small cache (a rank's next
        batches mostly fall in the blocks of its last ones)."""
        plans = self._plans
        plan = plans.get((node, block))
        if plan is None:
            size = min(self.block, int(self._lengths[node]) - block * self.block)
            start = int(self._node_start[node]) + block * self.block
            span_pos, span_off = self._block_spans(node, start, start + size)
            if len(plans) >= _PLANS:
                del plans[next(iter(plans))]  # the oldest
            plan = plans[node, block] = _BlockPlan(size, self._block_keys(node, block), span_off + start,
                                                   span_pos[1:] - start)
        return plan

    def _node_ids(self, node: int, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Sample ids at ``rows`` (nondecreasing) of canonical node ``node``'s shuffled sequence (into
        ``out`` when given).

        Rows are taken a block at a time: the block's keys are scalars and the spans it covers a short table
        of borders, so a sample costs a few vectorised passes over small arrays, written in place.
        """
        n = len(rows)
        out = np.empty(n, dtype=np.int64) if out is None else out
        if not n:
            return out
        B = self.block
        first_block, last_block = int(rows[0]) // B, int(rows[-1]) // B
        if (last_block - first_block + 1) * 64 > n:  # few rows per block: per-sample keys are cheaper
            out[:] = self._node_ids_per_sample(node, rows)
            return out
        if last_block == first_block:
            bounds = [0, n]
        else:
            cut = np.searchsorted(rows, np.arange(first_block + 1, last_block + 1, dtype=np.int64) * B)
            bounds = [0, *cut.tolist(), n]
        scratch = np.empty((2, max(b - a for a, b in zip(bounds[:-1], bounds[1:]))), dtype=np.int64)
        for block, lo, hi in zip(range(first_block, last_block + 1), bounds[:-1], bounds[1:]):
            if hi == lo:
                continue
            plan = self._block_plan(node, block)
            dest = out[lo:hi]
            np.subtract(rows[lo:hi], block * B, out=dest)
            plan.ids(dest, scratch[0, : hi - lo], scratch[1, : hi - lo])
        return out

    def _node_ids_per_sample(self, node: int, rows: np.ndarray) -> np.ndarray:
        """:meth:`_node_ids` with a key per sample, for rows spread over many small blocks."""
        block, offset = np.divmod(rows, self.block)
        keys = ((node << 40) | block).view(np.uint64)
        keys ^= np.uint64(self._key)
        keys *= _MIX1
        keys ^= keys >> np.uint64(29)
        sizes = np.minimum(self.block, int(self._lengths[node]) - block * self.block)
        pos = permute_within(offset, sizes, keys)
        pos += int(self._node_start[node])
        pos += block * self.block
        pos += self._offsets_at(node, pos)
        return pos

    def _sample_ids(self, node: np.ndarray, row: np.ndarray) -> np.ndarray:
        """The sample at row ``row`` of canonical node ``node``'s shuffled sequence, element-wise."""
        out = np.empty(len(row), dtype=np.int64)
        by = np.lexsort((row, node))
        node_s = node[by]
        edges = np.flatnonzero(np.diff(node_s)) + 1
        for lo, hi in zip([0, *edges.tolist()], [*edges.tolist(), len(by)]):
            if hi > lo:
                out[by[lo:hi]] = self._node_ids(int(node_s[lo]), row[by[lo:hi]])
        return out

    # ---------------------------------------------------------------- interleave of the canonical nodes

    def _build_interleave(self) -> None:
        """Phases of the interleave: between two distinct node lengths, the same nodes take turns."""
        lengths = self._lengths
        self._levels = np.unique(np.concatenate([[0], lengths]))
        levels = self._levels[:-1]
        self._phase_start = np.array([np.minimum(lengths, lv).sum() for lv in levels], dtype=np.int64)
        alive = lengths[None, :] > levels[:, None]  # (phases, nodes)
        self._alive_count = alive.sum(axis=1)
        self._alive_rank = np.cumsum(alive, axis=1) - alive  # rank of a node among the alive ones
        self._alive_nodes = np.zeros_like(alive, dtype=np.int64)
        for j in range(len(levels)):
            live = np.flatnonzero(alive[j])
            self._alive_nodes[j, : len(live)] = live

    def _phase(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        j = np.minimum(np.searchsorted(self._phase_start, x, side="right") - 1, len(self._phase_start) - 1)
        step, rem = np.divmod(x - self._phase_start[j], self._alive_count[j])
        return j, self._levels[j] + step, rem

    def _taken(self, x: np.ndarray) -> np.ndarray:
        """``(len(x), nodes)``: how many samples of each node the first ``x`` interleave positions hold."""
        j, row, rem = self._phase(x)
        row, rem = row[:, None], rem[:, None]
        lengths = self._lengths[None, :]
        return np.minimum(lengths, row) + ((lengths > row) & (self._alive_rank[j] < rem))

    def _decode(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Interleave positions -> (node, row)."""
        j, row, rem = self._phase(g)
        return self._alive_nodes[j, rem], row

    # ---------------------------------------------------------------- batches

    def _grid_ids(self, k0: int, k1: int, c0: int, c1: int) -> np.ndarray:
        """Ids of columns ``[c0, c1)`` of global batches ``[k0, k1)``, all full (no padding), flat.

        Inside a global batch each node's samples are one run of its rows; columns ``[c0, c1)`` cut a
        piece out of some of these runs. A node's pieces, batch after batch, are increasing rows of its
        sequence, computed together and put in place.
        """
        G = self.global_batch
        taken = self._taken(np.arange(k0, k1 + 1, dtype=np.int64) * G)  # (K + 1, nodes)
        counts = np.diff(taken, axis=0)
        inside = np.cumsum(counts, axis=1) - counts  # where each node's run starts inside its batch
        lo = np.maximum(inside, c0)
        piece = np.maximum(np.minimum(inside + counts, c1) - lo, 0)
        first_row = taken[:-1] + (lo - inside)
        out_start = (np.cumsum(piece.ravel()) - piece.ravel()).reshape(piece.shape)
        out = np.empty(int(piece.sum()), dtype=np.int64)
        nodes = np.flatnonzero(piece.any(axis=0))
        for c in nodes.tolist():
            have = np.flatnonzero(piece[:, c])
            runs = piece[have, c]
            run_at = np.cumsum(runs) - runs
            rows = np.repeat(first_row[have, c] - run_at, runs)
            rows += _iota(len(rows))
            if len(nodes) == 1:  # one node's columns: its pieces are the output, in order
                self._node_ids(c, rows, out)
            else:
                ids = self._node_ids(c, rows)
                dest = np.repeat(out_start[have, c] - run_at, runs)
                dest += np.arange(len(dest), dtype=np.int64)
                out[dest] = ids
        return out

    def _last_rows(self, c0: int, c1: int) -> tuple[np.ndarray, np.ndarray]:
        """(node, row) of columns ``[c0, c1)`` of the last global batch, padded with the epoch's first samples."""
        G, n = self.global_batch, self.num_samples
        g = np.arange((self.num_batches - 1) * G, self.num_batches * G, dtype=np.int64) % n
        node, row = self._decode(g)
        by_node = np.argsort(node, kind="stable")[c0:c1]
        return node[by_node], row[by_node]

    def grid(self, k0: int, k1: int, c0: int = 0, c1: int | None = None) -> np.ndarray:
        """Sample ids of columns ``[c0, c1)`` of global batches ``[k0, k1)``, one row per batch.

        Data-parallel rank ``r`` with ``batch_size`` samples per rank reads columns
        ``[r * batch_size, (r + 1) * batch_size)``.
        """
        c1 = self.global_batch if c1 is None else c1
        k0, k1 = max(k0, 0), min(k1, self.num_batches)
        if not (0 <= c0 <= c1 <= self.global_batch):
            raise StreamingError(f"columns [{c0}, {c1}) are not inside a global batch of {self.global_batch}")
        if k1 <= k0 or c1 == c0:
            return np.zeros((max(k1 - k0, 0), c1 - c0), dtype=np.int64)
        padded = self.padded_size != self.num_samples
        full_end = k1 - 1 if padded and k1 == self.num_batches else k1
        parts = []
        if full_end > k0:
            parts.append(self._grid_ids(k0, full_end, c0, c1))
        if full_end < k1:
            parts.append(self._sample_ids(*self._last_rows(c0, c1)))
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)).reshape(k1 - k0, c1 - c0)

    def shifted_grid(self, start: int, k0: int, k1: int, c0: int, c1: int) -> np.ndarray:
        """Like :meth:`grid`, for global batches that begin ``start`` interleave positions into the epoch (a
        resume position that is no whole number of this layout's global batches). Past the end, the
        interleave's first samples pad up to :attr:`padded_size`; past that, ``-1`` fills the last batch.
        Costs O(global batch) per batch, not O(columns)."""
        G, n, C = self.global_batch, self.num_samples, self.num_nodes
        g = np.arange(start + k0 * G, start + k1 * G, dtype=np.int64)
        node, row = self._decode(g % n)
        inside = g < self.padded_size
        key = (g - start) // G * (C + 1) + np.where(inside, node, C)
        by_node = np.argsort(key, kind="stable").reshape(-1, G)[:, c0:c1].reshape(-1)
        out = np.full(len(by_node), -1, dtype=np.int64)
        keep = inside[by_node]
        out[keep] = self._sample_ids(node[by_node][keep], row[by_node][keep])
        return out.reshape(k1 - k0, c1 - c0)

    def ids(self, lo: int, hi: int) -> np.ndarray:
        """Sample ids of global positions ``[lo, hi)`` of the padded, node-grouped epoch order."""
        lo, hi = max(lo, 0), min(hi, self.padded_size)
        if hi <= lo:
            return np.zeros(0, dtype=np.int64)
        G = self.global_batch
        k0, k1 = lo // G, -(-hi // G)
        return self.grid(k0, k1).reshape(-1)[lo - k0 * G : hi - k0 * G]

    def iter_rank(self, rank: int, batch_size: int, start_batch: int = 0,
                  chunk_samples: int = _CHUNK) -> Iterator[np.ndarray]:
        """Rank ``rank``'s columns of global batches ``start_batch, ...`` as arrays of many batches each."""
        per = max(1, chunk_samples // batch_size)
        for k in range(start_batch, self.num_batches, per):
            yield self.grid(k, min(k + per, self.num_batches), rank * batch_size, (rank + 1) * batch_size)

    def node_order(self, node: int) -> np.ndarray:
        """Canonical node ``node``'s shuffled sequence of sample ids, whole (made in cache-sized pieces)."""
        length = int(self._lengths[node])
        out = np.empty(length, dtype=np.int64)
        for lo in range(0, length, 16 * _CHUNK):
            out[lo : lo + 16 * _CHUNK] = self.node_rows(node, lo, lo + 16 * _CHUNK)
        return out

    def node_rows(self, node: int, lo: int, hi: int) -> np.ndarray:
        """Rows ``[lo, hi)`` of canonical node ``node``'s shuffled sequence."""
        rows = np.arange(max(lo, 0), min(hi, int(self._lengths[node])), dtype=np.int64)
        return self._node_ids(node, rows)

    def full(self) -> np.ndarray:
        """The whole padded epoch order as one array (small datasets, tests)."""
        return self.ids(0, self.padded_size)
