"""The lazy epoch orders (``blocks``, ``keyed``): exactly once, layout independence, node-local reads, O(1)
positions, and every algorithm's orders pinned."""

from __future__ import annotations

import hashlib
from functools import partial

import numpy as np
import pytest

from smalti.streaming.errors import StreamingError
from smalti.streaming.order import SHUFFLES, group_by_node, interleave, pad_to_batches, shuffle_order
from smalti.streaming.order_blocks import BlockOrder, _SpanLookup, permute_keyed, permute_within
from smalti.streaming.order_keyed import KeyedOrder, default_chunk_shards

SHARD = 16_384
# the lazy orders; keyed with chunks of several shards too (by default a chunk is one shard below 8,192 shards)
ORDERS = {"blocks": BlockOrder, "keyed": KeyedOrder, "keyed_chunks": partial(KeyedOrder, chunk_shards=3)}
BIG_ORDERS = ("blocks", "keyed")  # at 1e10 keyed's default chunks hold 64 shards


def _virtual(samples: int, shard: int = SHARD) -> np.ndarray:
    count = -(-samples // shard)
    sizes = np.full(count, shard, dtype=np.int64)
    sizes[-1] = samples - shard * (count - 1)
    return sizes


def _reference(bo: BlockOrder) -> np.ndarray:
    """The order built the slow way: every node's whole sequence, interleaved, padded, grouped by node."""
    seqs = [bo.node_order(c) for c in range(bo.num_nodes)]
    order, labels = interleave(seqs)
    G = bo.global_batch
    return group_by_node(pad_to_batches(order, G), pad_to_batches(labels, G), G)


@pytest.mark.parametrize("algo", sorted(ORDERS))
def test_exactly_once_and_equal_to_the_materialised_order(algo: str) -> None:
    rng = np.random.default_rng(1)
    for trial in range(25):
        sizes = rng.integers(0, 200, rng.integers(1, 40))
        sizes[0] += 1
        C, G = int(rng.integers(1, 9)), int(rng.integers(1, 50))
        block = int(rng.choice([1, 3, 16, 100, 256, 1 << 18]))
        bo = ORDERS[algo](sizes, seed=5, epoch=trial, num_canonical_nodes=C, global_batch=G, block_size=block)
        full = bo.full()
        n = int(sizes.sum())
        assert len(full) == bo.padded_size == -(-n // G) * G
        counts = np.bincount(full, minlength=n)
        assert len(counts) == n and counts.min() == 1, trial  # every sample, nothing else
        assert counts.max() <= 1 + (bo.padded_size - n) // n + 1 and counts.sum() - n == bo.padded_size - n
        assert np.array_equal(full, _reference(bo)), trial
        for _ in range(5):  # any position directly
            lo = int(rng.integers(0, bo.padded_size))
            hi = int(rng.integers(lo, bo.padded_size + 1))
            assert np.array_equal(bo.ids(lo, hi), full[lo:hi])


@pytest.mark.parametrize("algo", sorted(ORDERS))
@pytest.mark.parametrize("ncn", [8, 3])
@pytest.mark.parametrize("nodes,ranks_per_node,workers", [(1, 1, 1), (1, 4, 2), (2, 2, 1), (2, 1, 3),
                                                          (4, 2, 2), (8, 1, 1)])
def test_global_batches_do_not_depend_on_the_layout(nodes: int, ranks_per_node: int, workers: int,
                                                    ncn: int, algo: str) -> None:
    """Ranks' columns and workers' batches put back together give the same global batches on any layout
    (with 3 canonical nodes, rank columns cut the nodes' runs of a batch in the middle)."""
    sizes = _virtual(10_000, 250)
    G = 64
    ref = ORDERS[algo](sizes, seed=3, epoch=1, num_canonical_nodes=ncn, global_batch=G, block_size=512).full()
    bo = ORDERS[algo](sizes, seed=3, epoch=1, num_canonical_nodes=ncn, global_batch=G, block_size=512)
    world = nodes * ranks_per_node
    b = G // world
    rebuilt = np.full((bo.num_batches, G), -1, dtype=np.int64)
    for rank in range(world):
        for worker in range(workers):  # worker w makes the rank's batches w, w + W, ...
            for k in range(worker, bo.num_batches, workers):
                rebuilt[k, rank * b : (rank + 1) * b] = bo.grid(k, k + 1, rank * b, (rank + 1) * b)[0]
        streamed = np.concatenate(list(bo.iter_rank(rank, b, chunk_samples=999)))
        assert np.array_equal(streamed, ref.reshape(-1, G)[:, rank * b : (rank + 1) * b])
    assert np.array_equal(rebuilt.reshape(-1), ref)


@pytest.mark.parametrize("algo", sorted(ORDERS))
@pytest.mark.parametrize("physical_nodes", [1, 2, 4, 8])
def test_a_physical_node_reads_only_its_canonical_nodes_shards(physical_nodes: int, algo: str) -> None:
    sizes = _virtual(100_000, 1000)
    C, G = 8, 64
    bo = ORDERS[algo](sizes, seed=11, epoch=2, num_canonical_nodes=C, global_batch=G, block_size=2048)
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    node_shards = [set(shard_of[bo.node_order(c)].tolist()) for c in range(C)]
    # a shard belongs to one canonical node, but for one cut at each border between two nodes
    assert sum(len(node_shards[c] & node_shards[d]) for c in range(C) for d in range(c + 1, C)) <= C - 1
    assert set().union(*node_shards) == set(range(len(sizes)))
    grid = bo.full().reshape(-1, G)[:-1]  # the padded last batch repeats the epoch's first samples
    width = G // physical_nodes
    for p in range(physical_nodes):
        mine = set().union(*node_shards[p * C // physical_nodes : (p + 1) * C // physical_nodes])
        read = set(shard_of[grid[:, p * width : (p + 1) * width].reshape(-1)].tolist())
        assert read <= mine, p


@pytest.mark.parametrize("algo", sorted(ORDERS))
def test_seed_and_epoch_change_the_order_and_equal_arguments_repeat_it(algo: str) -> None:
    make = ORDERS[algo]
    sizes = _virtual(20_000, 500)
    kw = dict(num_canonical_nodes=4, global_batch=32, block_size=1024)
    a = make(sizes, seed=1, epoch=0, **kw).full()
    assert np.array_equal(a, make(sizes, seed=1, epoch=0, **kw).full())
    assert not np.array_equal(a, make(sizes, seed=2, epoch=0, **kw).full())
    assert not np.array_equal(a, make(sizes, seed=1, epoch=1, **kw).full())
    assert not np.array_equal(a[:32], make(sizes, seed=2, epoch=0, **kw).full()[:32])
    # one shard on one node: only the permutation inside blocks is left to change
    one = dict(num_canonical_nodes=1, global_batch=8, block_size=4096)
    b = make([5000], seed=1, epoch=0, **one).full()
    assert not np.array_equal(b, make([5000], seed=2, epoch=0, **one).full())
    assert not np.array_equal(b, make([5000], seed=1, epoch=1, **one).full())


@pytest.mark.parametrize("algo", sorted(ORDERS))
def test_shuffle_is_at_least_as_local_and_as_mixed_as_py1e(algo: str) -> None:
    """Consecutive samples of a node land as far apart as py1e's, and no more shards are open at once."""
    sizes = _virtual(400_000, 4000)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    shards = [np.arange(starts[i], starts[i + 1]) for i in range(len(sizes))]
    block = 1 << 14
    old, _ = shuffle_order(shards, "py1e", 7, 0, 1, block)
    new = ORDERS[algo](sizes, seed=7, epoch=0, num_canonical_nodes=1, global_batch=1, block_size=block).full()
    assert np.median(np.abs(np.diff(new))) >= 0.9 * np.median(np.abs(np.diff(old)))
    window = 4096

    def open_shards(order: np.ndarray) -> float:
        shard = np.searchsorted(starts, order, side="right") - 1
        return float(np.mean([len(np.unique(shard[i : i + window])) for i in range(0, len(order), window)]))

    assert open_shards(new) <= 1.5 * open_shards(old)


@pytest.mark.parametrize("algo", BIG_ORDERS)
def test_slices_of_a_ten_billion_sample_index(algo: str) -> None:
    sizes = _virtual(10**10)
    G, b = 256, 32
    bo = ORDERS[algo](sizes, seed=9176, epoch=3, num_canonical_nodes=8, global_batch=G)
    assert bo.num_samples == 10**10
    rng = np.random.default_rng(0)
    for k in [0, 1, *rng.integers(0, bo.num_batches - 8, 3).tolist(), bo.num_batches - 2]:
        window = bo.grid(k, k + 2)
        assert window.min() >= 0 and window.max() < 10**10
        assert len(np.unique(window)) == window.size  # nothing twice
        assert np.array_equal(window.reshape(-1), bo.ids(k * G, (k + 2) * G))  # O(1) position
        ranks = np.concatenate([bo.grid(k, k + 2, r * b, (r + 1) * b) for r in range(G // b)], axis=1)
        assert np.array_equal(ranks, window)  # the same batches on any rank count
        # node c's columns hold node c's consecutive rows
        taken = bo._taken(np.array([k * G]))[0]
        col = 0
        for c in range(8):
            run = bo.node_rows(c, int(taken[c]), int(taken[c]) + G // 8)
            assert np.array_equal(window[0, col : col + len(run)], run)
            col += len(run)
    # a whole block of a node is one contiguous run of the node's epoch sequence, permuted
    block = bo.node_rows(5, 3 * bo.block, 4 * bo.block)
    assert len(np.unique(block)) == bo.block and (np.diff(np.sort(block)) >= 1).all()


def test_permute_within_is_a_bijection_for_every_size() -> None:
    for size in [1, 2, 3, 5, 17, 100, 4096, 5000]:
        keys = np.full(size, 123, dtype=np.uint64)
        assert np.array_equal(np.sort(permute_within(np.arange(size), size, keys)), np.arange(size))
        assert np.array_equal(np.sort(permute_within(np.arange(size), np.full(size, size), keys)), np.arange(size))


def test_span_lookup_equals_a_binary_search_with_narrow_spans() -> None:
    """A block's span lookup (buckets and steps) finds what searchsorted finds, also where borders are a sample
    apart (buckets then hold several of them) and for blocks that are not powers of two."""
    rng = np.random.default_rng(4)
    for size, count in [(262_144, 17), (262_144, 300), (1000, 999), (5, 2), (70_000, 3)]:
        borders = np.sort(rng.choice(np.arange(1, size), count, replace=False))
        borders[: count // 3] = np.arange(1, count // 3 + 1)  # a run of one-sample spans
        borders = np.unique(borders)
        pos = rng.integers(0, size, 5000)
        pos[:3] = [0, size - 1, int(borders[0])]
        found = _SpanLookup(borders, size).spans(pos, np.empty(len(pos), np.int64), np.empty(len(pos), np.int64))
        assert np.array_equal(found, np.searchsorted(borders, pos, side="right"))


def test_permute_keyed_equals_permute_within_with_one_key() -> None:
    for size in [1, 3, 17, 64, 5000]:
        key = 0xFEDCBA9876543210 + size
        assert np.array_equal(permute_keyed(np.arange(size), size, key),
                              permute_within(np.arange(size), size, np.full(size, key, dtype=np.uint64)))


def test_keyed_permutations_are_bijections() -> None:
    """The run's chunk order, every node's part order and every part's shard order are permutations (a
    cycle walk that stops one step early, or a Feistel round that is not invertible, repeats an entry)."""
    for shards, g in [(1, 1), (7, 1), (97, 4), (200, 3), (4096 * 3 + 5, None), (64 * 64, 64)]:
        sizes = np.random.default_rng(shards).integers(1, 50, shards)
        ko = KeyedOrder(sizes, seed=17, epoch=2, num_canonical_nodes=5, global_batch=8, chunk_shards=g)
        assert np.array_equal(np.sort(ko._run_chunk), np.arange(ko._q)), shards
        assert ko._g == (g or default_chunk_shards(shards))
        spans = 0
        for c in range(ko.num_nodes):
            parts = ko._node(c)
            assert np.array_equal(np.sort(parts.order), np.arange(len(parts.order))), (shards, c)
            span_pos, span_off = ko._part_spans(c, np.arange(len(parts.order)))
            assert np.array_equal(np.diff(span_pos) > 0, np.ones(len(span_pos) - 1, bool))  # in order, none empty
            spans += len(span_pos)
        # every shard is one span, or two where a piece border cuts it
        assert shards <= spans <= shards + ko.num_nodes - 1


@pytest.mark.parametrize("make", [BlockOrder, KeyedOrder])
def test_bad_arguments_are_refused(make) -> None:
    with pytest.raises(StreamingError, match="num_canonical_nodes"):
        make([10], seed=0, epoch=0, num_canonical_nodes=0, global_batch=1)
    with pytest.raises(StreamingError, match="shuffle_block_size"):
        make([10], seed=0, epoch=0, num_canonical_nodes=1, global_batch=1, block_size=0)
    with pytest.raises(StreamingError, match="global_batch"):
        make([10], seed=0, epoch=0, num_canonical_nodes=1, global_batch=0)


def test_keyed_refuses_a_bad_chunk_width_and_first_ids() -> None:
    with pytest.raises(StreamingError, match="chunk_shards=0"):
        KeyedOrder([10, 10], seed=0, epoch=0, num_canonical_nodes=1, global_batch=1, chunk_shards=0)
    with pytest.raises(StreamingError, match="shard_first_ids has 1 entries for 2 shards"):
        KeyedOrder([10, 10], seed=0, epoch=0, num_canonical_nodes=1, global_batch=1, shard_first_ids=[0])


# sha256 (first 16 hex) of shuffle_order's (order, nodes) since it gives mosaicml-streaming 0.13's shuffles
# (checked against the library's recorded orders in test_mosaic_orders.py)
PINNED = {
    ("naive", 1): "7802074b51261aff", ("naive", 3): "7802074b51261aff", ("naive", 8): "7802074b51261aff",
    ("py1s", 1): "778f517fc9505a45", ("py1s", 3): "60de6a9503167b44", ("py1s", 8): "185225fda6cdf5cf",
    ("py2s", 1): "6fce969ceba3672c", ("py2s", 3): "412266628d927f46", ("py2s", 8): "e50223a8b5c763f7",
    ("py1br", 1): "23dade4f62d4435a", ("py1br", 3): "ec57d3855c26494c", ("py1br", 8): "5de40b6c4ccb7ca0",
    ("py1e", 1): "5273b70e5f9ba039", ("py1e", 3): "8fe98fb4c136eae8", ("py1e", 8): "80f50b5fdc63759a",
}


@pytest.mark.parametrize("algo,ncn", sorted(PINNED))
def test_mosaic_shuffles_keep_their_orders(algo: str, ncn: int) -> None:
    assert algo in SHUFFLES
    sizes = np.random.default_rng(0).integers(1, 300, 57)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    shards = [np.arange(starts[i], starts[i + 1]) for i in range(len(sizes))]
    order, nodes = shuffle_order(shards, algo, 17, 2, ncn, block_size=500)
    digest = hashlib.sha256(order.astype("<i8").tobytes() + nodes.astype("<i8").tobytes()).hexdigest()[:16]
    assert digest == PINNED[algo, ncn]


def _digests(make=BlockOrder, small=None) -> dict[str, str]:
    """Digests of a lazy order over cases that take every path: full and short blocks, a block size that
    is no power of two, uneven shards with shard_first_ids, a resume off the batch grid, a 1e10 slice."""
    sizes = np.random.default_rng(4).integers(0, 3000, 97)
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]]) * 3 + 11
    out = {}
    cases = {"uneven": dict(sizes=sizes, C=5, G=96, block=1024, first=first),
             "odd_block": dict(sizes=sizes, C=3, G=77, block=1000, first=None),
             "one_node": dict(sizes=sizes[:9], C=1, G=1, block=1 << 18, first=None)}
    for name, c in cases.items():
        bo = (small or make)(c["sizes"], seed=23, epoch=4, num_canonical_nodes=c["C"], global_batch=c["G"],
                        block_size=c["block"], shard_first_ids=c["first"])
        parts = [bo.full(), bo.shifted_grid(12345, 0, 7, c["G"] // 4, c["G"] - c["G"] // 5).reshape(-1)]
        rank, per_rank = (1, c["G"] // 8) if c["G"] >= 8 else (0, c["G"])
        parts += list(bo.iter_rank(rank, per_rank, start_batch=5, chunk_samples=500))
        out[name] = hashlib.sha256(np.concatenate([p.reshape(-1) for p in parts]).astype("<i8").tobytes()).hexdigest()[:16]
    big = make(_virtual(10**10), seed=9176, epoch=3, num_canonical_nodes=8, global_batch=2048)
    k = 7_777_777_777 // 2048
    parts = [big.grid(0, 2), big.grid(k, k + 3, 32, 64), big.grid(big.num_batches - 2, big.num_batches),
             big.node_rows(6, 10**9, 10**9 + 300_000)]
    out["1e10"] = hashlib.sha256(np.concatenate([p.reshape(-1) for p in parts]).astype("<i8").tobytes()).hexdigest()[:16]
    return out


# the blocks orders as first released: a faster implementation must give them bit for bit (checkpoints
# taken with blocks resume into the same order)
PINNED_BLOCKS = {"uneven": "34edc0036ec97a2e", "odd_block": "e9be58b593db5711", "one_node": "1a99a2eacacd8a62",
                 "1e10": "97726bef81f6a512"}


def test_blocks_orders_are_pinned() -> None:
    assert _digests(BlockOrder) == PINNED_BLOCKS


# the keyed orders as first released (chunks of 3 shards at small sizes, to take the chunked path there too)
PINNED_KEYED = {"uneven": "b5e1665a3d8b2f5d", "odd_block": "68aa4d43a5964405", "one_node": "e448d6307e5a1c42",
                "1e10": "4fcbb385c86047f6"}


def test_keyed_orders_are_pinned() -> None:
    assert _digests(KeyedOrder, partial(KeyedOrder, chunk_shards=3)) == PINNED_KEYED
