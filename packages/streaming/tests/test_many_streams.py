"""Mixing 1,000 streams: the dataset and its epoch are built in time and memory O(streams + shards)."""

import os
import time
import tracemalloc

import numpy as np
import pytest

from smalti.streaming import MDSWriter, Stream, StreamingDataset
from smalti.streaming.order import stream_counts

SAMPLES = 8  # per stream, in a few shards


@pytest.fixture(scope="module")
def streams_dir(tmp_path_factory):
    """1,000 stream folders: one small dataset written once, its files hard-linked into each folder."""
    root = tmp_path_factory.mktemp("streams")
    with MDSWriter(root / "source", {"id": "int"}, hashes=["xxh64"], size_limit=210) as writer:
        for i in range(SAMPLES):
            writer.write({"id": i})
    files = sorted(p.name for p in (root / "source").iterdir())
    assert len(files) > 3  # shards, index.json, index.npz
    for s in range(1000):
        os.mkdir(root / f"s{s}")
        for name in files:
            os.link(root / "source" / name, root / f"s{s}" / name)
    return root


def weight(s):
    return 1 + s % 4


def build(root, n):
    """A dataset mixing the first ``n`` streams by proportion, and its epoch-0 order: (order, CPU s, peak B)."""
    tracemalloc.start()
    start = time.process_time()
    ds = StreamingDataset(streams=[Stream(local=str(root / f"s{s}"), proportion=weight(s)) for s in range(n)],
                          batch_size=16, shuffle=True, shuffle_seed=3, predownload=0)
    order = ds.epoch_order(0)
    seconds = time.process_time() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return ds, order, seconds, peak


def test_a_thousand_streams_mix_by_weight_in_linear_time(streams_dir):
    build(streams_dir, 10)  # imports and first-use costs out of the way
    small, _, small_s, small_peak = build(streams_dir, 100)
    ds, order, big_s, big_peak = build(streams_dir, 1000)
    # Python per pair of streams (or per shard of every stream, per stream) would make 10x the streams cost
    # about 100x; measured: 11-13x the CPU time and 10x the peak memory
    assert big_s < 20 * small_s, (small_s, big_s)
    assert big_peak < 20 * small_peak, (small_peak, big_peak)
    assert len(ds._shards) == 1000 * (len(os.listdir(streams_dir / 's0')) - 2) and ds.num_samples == 8000
    # every stream gets the samples its weight asks for: the counts stream_counts gives, at least the whole
    # part of its exact share, plus rounding leftovers (drawn by weight, so a stream may get a few)
    taken = order[order >= 0]
    per_stream = np.bincount(taken // SAMPLES, minlength=1000)  # stream s holds ids 8s..8s+7
    weights = np.array([weight(s) for s in range(1000)], dtype=np.float64)
    exact = weights / weights.sum() * 8000
    expected = stream_counts([SAMPLES] * 1000, [("proportion", w) for w in weights.tolist()], None, 3,
                             [f"s{s}" for s in range(1000)])
    assert per_stream.tolist() == expected
    assert (per_stream >= np.floor(exact)).all() and np.abs(per_stream - exact).mean() < 1
    assert per_stream.sum() == 8000
    # and the heavy streams really are read more: weight 4 about four times weight 1
    assert per_stream[weights == 4].sum() / per_stream[weights == 1].sum() == pytest.approx(4, rel=0.05)
