"""StreamingDataset's parts (epoch plan, checkpointable state, layout) behave as one dataset: the plan is
rebuilt when the batch size changes, a refused checkpoint changes nothing, and the lazy order is never
materialised by the plan itself."""

import numpy as np
import pytest
from torch.utils.data import DataLoader

from smalti.streaming import StreamingDataset, StreamingError
from smalti.streaming.epoch_orders import EpochOrders
from smalti.streaming.order import LAZY_SHUFFLES
from smalti.streaming.order_blocks import BlockOrder  # KeyedOrder's base: its full() too
from smalti.streaming.resume_state import resumed_orders


def _never(*_args, **_kwargs):
    raise AssertionError("the epoch order was materialised")


def _ids(ds):
    return [i for b in DataLoader(ds, batch_size=ds.batch_size) for i in b["id"].tolist()]


@pytest.mark.parametrize("algo", LAZY_SHUFFLES)
def test_the_epoch_plan_reads_a_lazy_order_without_materialising_it(make_dataset, tmp_path, monkeypatch, algo):
    data = make_dataset(tmp_path / "d", n=300)
    kw = dict(local=str(data), batch_size=6, shuffle=True, shuffle_algo=algo, num_canonical_nodes=2,
              shuffle_block_size=50, rank=1, world_size=2, predownload=0)
    whole = StreamingDataset(**kw).epoch_order(0).reshape(-1, 12)[:, 6:].reshape(-1).tolist()
    monkeypatch.setattr(EpochOrders, "sequence", _never)
    monkeypatch.setattr(BlockOrder, "full", _never)
    assert _ids(StreamingDataset(**kw)) == whole


def test_setting_the_batch_size_rebuilds_the_plan(make_dataset, tmp_path):
    """smalti-core's loader sets ``batch_size`` after construction: the global batches, the rank's columns
    and ``len()`` follow, as for a dataset built with that batch size."""
    data = make_dataset(tmp_path / "d", n=300)
    kw = dict(local=str(data), shuffle=True, num_canonical_nodes=2, rank=1, world_size=2, predownload=0)
    later = StreamingDataset(batch_size=3, **kw)
    assert len(later) == 150
    later.batch_size = 8
    built = StreamingDataset(batch_size=8, **kw)
    assert later.orders.layout.global_batch == 16 and len(later) == len(built) == 152
    assert np.array_equal(later.epoch_order(0), built.epoch_order(0))
    assert _ids(later) == _ids(built)
    with pytest.raises(StreamingError, match="batch_size=0"):
        later.batch_size = 0


def test_a_refused_checkpoint_changes_nothing(make_dataset, tmp_path):
    """A checkpoint whose seed differs is refused before any setting (canonical nodes included) is adopted."""
    data = make_dataset(tmp_path / "d", n=300)
    ds = StreamingDataset(local=str(data), batch_size=4, shuffle=True, predownload=0)
    before = ds.epoch_order(0)
    state = ds.state_dict(num_samples=40)
    with pytest.raises(StreamingError, match="shuffle_seed=1"):
        ds.load_state_dict({**state, "num_canonical_nodes": 3, "shuffle_seed": 1})
    assert ds.num_canonical_nodes == 1 and np.array_equal(ds.epoch_order(0), before)
    assert resumed_orders(ds.orders, state) is ds.orders  # nothing to change: the computed orders are kept
    ds.load_state_dict({**state, "num_canonical_nodes": 3})
    assert ds.num_canonical_nodes == 3 and ds.state_dict()["sample_in_epoch"] == 40
