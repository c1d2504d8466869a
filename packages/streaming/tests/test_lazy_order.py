"""With the ``blocks`` and ``keyed`` shuffles a rank computes its batches' ids when it needs them: the epoch is never
materialised, any resume position (whole global batches or not) is reached directly, and what the ranks read
is the order ``epoch_order`` describes, exactly once."""

from collections import Counter
from itertools import zip_longest

import numpy as np
import pytest
from torch.utils.data import DataLoader

from smalti.streaming import Stream, StreamingDataLoader, StreamingDataset
from smalti.streaming.epoch_plan import ArrayOrder, LazyOrder
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
