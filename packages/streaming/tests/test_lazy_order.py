"""With the ``blocks`` and ``keyed`` shuffles a rank computes its batches' ids when it needs them: the epoch is never
materialised, any resume position (whole global batches or not) is reached directly, and what the ranks read
is the order ``epoch_order`` describes, exactly once."""

from collections import Counter
from itertools import zip_longest
from types import SimpleNamespace

import numpy as np
import pytest
from torch.utils.data import DataLoader

from smalti.streaming import Stream, StreamingDataLoader, StreamingDataset
from smalti.streaming import dataset as dataset_module
from smalti.streaming.epoch_plan import ROWS_AHEAD_SAMPLES, ArrayOrder, LazyOrder, Remaining, RowsAhead
from smalti.streaming.order_blocks import BlockOrder


def _never(*_args, **_kwargs):
    raise AssertionError("the epoch order was materialised")


def _ranks(data, world, epoch=0, start=None, **options):
    out = []
    for rank in range(world):
        ds = StreamingDataset(local=str(data), batch_size=5, shuffle=True, rank=rank, world_size=world,
                              num_canonical_nodes=3, shuffle_block_size=64, **options)
        ds.set_epoch(epoch)
        if start is not None:
            ds.load_state_dict(ds.state_dict(num_samples=start))
        out.append(ds)
    return out


def _sequence(ds):
    """The epoch's sequence before it is cut into global batches (which the layout does not change)."""
    order = ds._order(0)
    if isinstance(order, ArrayOrder):
        return order.order.tolist()
    blocks = order.blocks
    return blocks._sample_ids(*blocks._decode(np.arange(blocks.num_samples))).tolist()


def _read(datasets):
    """Every rank's batches, put back together rank by rank inside each global batch."""
    per_rank = [[b["id"].tolist() for b in DataLoader(ds, batch_size=ds.batch_size)] for ds in datasets]
    return [i for step in zip_longest(*per_rank, fillvalue=[]) for batch in step for i in batch]


@pytest.mark.parametrize("algo", ["blocks", "keyed"])
def test_reading_never_materialises_the_epoch(make_dataset, tmp_path, monkeypatch, algo):
    data = make_dataset(tmp_path / "data")
    whole = _ranks(data, 2, shuffle_algo=algo)[0].epoch_order(1).tolist()
    monkeypatch.setattr(BlockOrder, "full", _never)
    monkeypatch.setattr(StreamingDataset, "_sequence", _never)
    ds = _ranks(data, 2, epoch=1, shuffle_algo=algo)
    assert isinstance(ds[0]._order(1), LazyOrder)
    assert _read(ds) == whole
    assert sorted(set(whole)) == list(range(1003)) and len(whole) == 1010  # padded to whole global batches
    one = _ranks(data, 1, epoch=1, shuffle_algo=algo)[0]
    loader = StreamingDataLoader(one, batch_size=5, num_workers=0)
    read = [i for b in loader for i in b["id"].tolist()]
    assert sorted(set(read)) == list(range(1003)) and len(read) == 1005


# blocks (lazy), and py1e held as an array: with epoch_size set, mosaicml-streaming's own partition (which
# places its resume itself, see test_mosaic_orders.py) does not apply
@pytest.mark.parametrize("algo,options", [("blocks", {}), ("keyed", {}), ("py1e", {"epoch_size": 1003})],
                         ids=["blocks", "keyed", "py1e"])
@pytest.mark.parametrize("saved_on,resumed_on", [(2, 2), (4, 2), (4, 3), (2, 3), (3, 1)])
def test_resume_on_another_data_parallel_size_reads_the_rest(make_dataset, tmp_path, algo, options, saved_on,
                                                            resumed_on):
    """Global batches ``0..k`` read on ``saved_on`` ranks; the epoch resumed on ``resumed_on`` ranks reads every
    other sample exactly once (plus the padding of its last global batch), and the same layout reads the
    saved order's rest."""
    data = make_dataset(tmp_path / "data")
    for batches in (1, 7, 20):
        saved = _ranks(data, saved_on, shuffle_algo=algo, **options)[0].epoch_order(0)
        at = batches * 5 * saved_on
        rest = _read(_ranks(data, resumed_on, start=at, shuffle_algo=algo, **options))
        left = 1003 - at
        assert 0 <= len(rest) - left < 5 * resumed_on  # only the last global batch is padded
        seq = _sequence(_ranks(data, resumed_on, shuffle_algo=algo, **options)[0])
        assert set(seq[:at]) == set(saved[:at].tolist())  # what was read: the sequence's first samples
        # every sample not read before, once, and the padding of the last batch (the sequence's first samples)
        want = seq[at:] + seq[: len(rest) - left]
        assert Counter(rest) == Counter(want)
        G = 5 * resumed_on  # and each global batch holds the next run of the sequence
        assert all(sorted(rest[k : k + G]) == sorted(want[k : k + G]) for k in range(0, len(rest), G))
        if saved_on == resumed_on:
            assert rest == saved[at:].tolist()


def test_only_a_whole_pick_of_every_stream_is_lazy(make_dataset, tmp_path):
    """Streams read whole (or a whole number of times) get the lazy order, equal to the materialised one; a
    random part of a stream, a mid-epoch curriculum and the old shuffles keep the array."""
    a, b = make_dataset(tmp_path / "a"), make_dataset(tmp_path / "b", n=301, size_limit=700)

    def order(**options):
        ds = StreamingDataset(batch_size=7, shuffle=True, num_canonical_nodes=3, predownload=0, **options)
        return ds, ds._order(1)

    for options in (dict(streams=[Stream(local=str(a)), Stream(local=str(b), repeat=2)]),
                    dict(local=str(a), epoch_size=2006)):
        ds, lazy = order(**options)
        assert isinstance(lazy, LazyOrder), options
        assert np.array_equal(lazy.full(), ds._compute_order(1, 7)), options
    for options in (dict(streams=[Stream(local=str(a)), Stream(local=str(b), choose=100)]),
                    dict(local=str(a), epoch_size=500),
                    dict(local=str(a), shuffle_algo="py1e"),
                    dict(streams=[Stream(local=str(a)), Stream(local=str(b))],
                         proportion_schedule=[{"at": "10ba", "proportions": [1, 1]}])):
        assert isinstance(order(**options)[1], ArrayOrder), options


@pytest.mark.parametrize("algo,start", [("keyed", 0), ("keyed", 7), ("py1e", 0)])
def test_rows_ahead_gives_the_rows_asked_one_by_one(make_dataset, tmp_path, algo, start):
    data = make_dataset(tmp_path / "data")
    ds = _ranks(data, 3, start=start, shuffle_algo=algo)[1]
    remaining = ds._remaining(0)
    c0, c1 = ds.layout.rank_columns()
    ahead = RowsAhead(remaining, c0, c1, samples=40)  # windows of 8 steps of 5 samples
    ranges = [(0, 1), (2, 3), (3, 5), (9, 13), (13, 30), (31, 32), (5, 6), (len(remaining) - 2, len(remaining) + 4)]
    for lo, hi in ranges:
        assert np.array_equal(ahead.rows(lo, hi), remaining.rows(lo, hi, c0, c1)), (lo, hi)


@pytest.mark.parametrize("worker", [None, (1, 2)])
def test_iteration_asks_the_order_a_window_at_a_time_not_per_batch(make_dataset, tmp_path, monkeypatch, worker):
    """A ``keyed`` order has a fixed cost per call: asked once per batch, it made reading several times slower."""
    data = make_dataset(tmp_path / "data", n=3000)
    calls = []
    rows = Remaining.rows

    def counted(self, k0, k1, c0=0, c1=None):
        calls.append(k1 - k0)
        return rows(self, k0, k1, c0, c1)

    ds = StreamingDataset(local=str(data), batch_size=4, shuffle=True, shuffle_algo="keyed", predownload=0)
    batches = ds.epoch_order(0).reshape(-1, 4)
    wid, workers = worker or (0, 1)
    if worker:  # this process as DataLoader worker 1 of 2: every other batch, from the second
        monkeypatch.setattr(dataset_module, "get_worker_info", lambda: SimpleNamespace(id=wid, num_workers=workers))
    monkeypatch.setattr(Remaining, "rows", counted)
    read = [sample["id"] for sample in ds]
    assert read == batches[wid::workers].reshape(-1).tolist()
    windows = -(-len(batches) // (ROWS_AHEAD_SAMPLES // 4))
    assert len(calls) <= windows + 1, len(calls)  # per batch, it was len(batches) / workers calls
