"""Curriculum: stream proportions that change inside an epoch (``ba``/``sp``) or at epochs (``ep``), and resume."""

import numpy as np
import pytest
from torch.utils.data import DataLoader

from smalti.streaming import MDSWriter, Stream, StreamingDataset, StreamingError
from smalti.streaming.order import stream_counts


def tagged(path, n, first):
    """An MDS dataset whose ``id`` column runs ``first, first + 1, ...`` so streams can be told apart."""
    with MDSWriter(path, {"id": "int"}, compression="zstd", hashes=["xxh64"], size_limit=600) as writer:
        for i in range(n):
            writer.write({"id": first + i})
    return path


@pytest.fixture
def streams(tmp_path):
    a = tagged(tmp_path / "a", 300, 0)  # ids 0..299
    b = tagged(tmp_path / "b", 100, 1000)  # ids 1000..1099: the "high quality" stream
    return str(a), str(b)


def mixed(streams, schedule, **kw):
    a, b = streams
    kw = {"batch_size": 10, "shuffle": True, "epoch_size": 400, **kw}
    return StreamingDataset(streams=[Stream(local=a, proportion=3), Stream(local=b, proportion=1)],
                            proportion_schedule=schedule, **kw)


def ids(ds, workers=0):
    return [int(i) for batch in DataLoader(ds, batch_size=ds.batch_size, num_workers=workers) for i in batch["id"]]


def from_b(values):
    return int((np.asarray(values) >= 1000).sum())


SWITCH = [{"at": "10ba", "proportions": [1, 3]}]


def test_switch_after_10_global_batches_gives_exact_counts_before_and_after(streams):
    # 2 data-parallel ranks of 5: global batches of 10 samples, so "10ba" is the 100th sample of the epoch.
    per_rank = [ids(mixed(streams, SWITCH, batch_size=5, rank=r, world_size=2)) for r in range(2)]
    batches = [per_rank[0][i : i + 5] + per_rank[1][i : i + 5] for i in range(0, len(per_rank[0]), 5)]
    assert len(batches) == 40
    before = [i for b in batches[:10] for i in b]
    after = [i for b in batches[10:] for i in b]
    assert (len(before) - from_b(before), from_b(before)) == (75, 25)  # 3:1 of 100
    assert (len(after) - from_b(after), from_b(after)) == (75, 225)  # 1:3 of the remaining 300
    assert len(set(before)) == 100  # no sample twice inside the first segment
    assert set(range(1000, 1100)) <= set(after)  # b upsampled 2.25x after the switch: all of it appears


def test_resume_across_the_switch_yields_exactly_the_uninterrupted_tail(streams):
    full = ids(mixed(streams, SWITCH))
    assert from_b(full[:100]) == 25 and from_b(full[100:]) == 225
    for stop in (60, 100, 130):
        ds = mixed(streams, SWITCH)
        it = iter(ds)
        head = [int(next(it)["id"]) for _ in range(stop)]
        state = ds.state_dict()
        resumed = mixed(streams, SWITCH)
        resumed.load_state_dict(state)
        assert head + ids(resumed, workers=2) == full, stop


def test_sample_positions_run_over_epochs_and_epoch_entries_apply_from_their_epoch(streams):
    schedule = [{"at": "460sp", "proportions": [1, 3]}, {"at": "2ep", "proportions": [1, 1]}]
    ds = mixed(streams, schedule)
    epochs = [ds.epoch_order(e) for e in range(3)]
    b_first = ds._shard_starts[len(ds._stream_shards[0])]  # global index of b's first sample
    counts = [[int((o[lo:hi] >= b_first).sum()) for lo, hi in parts]
              for o, parts in zip(epochs, [[(0, 400)], [(0, 60), (60, 400)], [(0, 400)]])]
    # Epoch 0: 3:1. Epoch 1 starts at sample 400, so 460sp switches to 1:3 after 60 samples. Epoch 2: 1:1.
    assert counts == [[100], [15, 255], [200]]
    assert ds.weights_for_epoch(2) == [("proportion", 1.0), ("proportion", 1.0)]


def test_schedule_units_dur_and_tok_are_refused_by_name(streams):
    for bad in ("0.5dur", "2e9tok"):
        with pytest.raises(StreamingError, match=rf"at='{bad}'.*dur|at='{bad}'.*tok"):
            mixed(streams, [{"at": bad, "proportions": [1, 1]}])
    with pytest.raises(StreamingError, match="whole"):
        mixed(streams, [{"at": "1.5ba", "proportions": [1, 1]}])
    with pytest.raises(StreamingError, match="cannot read at='soon'"):
        mixed(streams, [{"at": "soon", "proportions": [1, 1]}])


def test_stream_without_proportion_among_proportions_is_an_error(streams):
    with pytest.raises(StreamingError, match=r"stream b has no proportion"):
        stream_counts([300, 100], [("proportion", 1), ("none", None)], None, 0, ["a", "b"])
    a, b = streams
    with pytest.raises(StreamingError, match=rf"stream {b} has no proportion"):
        StreamingDataset(streams=[Stream(local=a, proportion=1), Stream(local=b)], batch_size=4)


@pytest.mark.parametrize("epoch_size", [7, 401, 999])
def test_repeat_and_choose_scaled_to_exactly_epoch_size(epoch_size):
    weights = [("repeat", 1.5), ("choose", 33), ("none", None)]
    counts = stream_counts([100, 50, 20], weights, epoch_size, 0)
    assert sum(counts) == epoch_size
    unscaled = stream_counts([100, 50, 20], weights, None, 0)
    assert unscaled == [150, 33, 20]
    assert all(abs(c - u * epoch_size / 203) < 1 for c, u in zip(counts, unscaled))


@pytest.mark.parametrize(("method", "unit", "before", "after"),
                         [("per_stream", 10, (8, 2), (6, 24)), ("device_per_stream", 5, (16, 4), (12, 48))])
def test_switch_with_single_stream_batches_is_exact_in_whole_batches(streams, method, unit, before, after):
    a, b = streams
    ds = StreamingDataset(streams=[Stream(local=a, proportion=4), Stream(local=b, proportion=1)], batch_size=5,
                          rank=0, world_size=2, shuffle=True, epoch_size=400, batching_method=method,
                          proportion_schedule=[{"at": "10ba", "proportions": [1, 4]}])
    order = ds.epoch_order(0)
    assert len(order) == 400  # no batch dropped: the switch lands exactly after global batch 10
    b_first = ds._shard_starts[len(ds._stream_shards[0])]
    units = (order.reshape(-1, unit) >= b_first).sum(1)
    assert set(units.tolist()) == {0, unit}  # every batch (or device batch) from one stream
    split = 100 // unit
    assert ((units[:split] == 0).sum(), (units[:split] == unit).sum()) == before
    assert ((units[split:] == 0).sum(), (units[split:] == unit).sum()) == after
