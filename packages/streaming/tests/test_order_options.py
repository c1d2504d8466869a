"""Options that only change WHICH samples are read, and in what order, do change it, and only when changed.

The other order tests compare two runs with the same settings, so an option that was ignored (the shuffle always
with the default seed, say) would pass them. These read what the ranks really yield with two values of each option
(``shuffle_seed``, ``shuffle_block_size``, stream weights, ``batching_method``) and with one value twice, over
epochs, a mid-epoch resume, and one or two nodes.
"""

import pytest
from torch.utils.data import DataLoader

from smalti.streaming import Stream, StreamingDataset
from smalti.streaming.order import SHUFFLES

# (world_size, local_world_size, num_canonical_nodes): one node; two nodes of one rank each.
TOPOLOGIES = [(1, 1, 1), (2, 1, 4)]
RESUME_AT = 160  # samples of the epoch already read (whole global batches on both topologies)


def read(topology, epoch=0, resume=None, **options):
    """Every rank's samples of ``epoch`` as one global order (rank by rank within each global batch)."""
    world, local_world, canonical = topology
    per_rank = []
    for rank in range(world):
        ds = StreamingDataset(batch_size=8, shuffle=True, rank=rank, world_size=world, local_world_size=local_world,
                              num_canonical_nodes=canonical, **options)
        ds.set_epoch(epoch)
        if resume is not None:
            ds.load_state_dict({"epoch": epoch, "sample_in_epoch": resume, "num_canonical_nodes": canonical,
                                "shuffle_seed": options.get("shuffle_seed", 9176)})
        per_rank.append([batch["id"].tolist() for batch in DataLoader(ds, batch_size=8)])
    return [i for step in zip(*per_rank) for batch in step for i in batch]


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=["1node", "2nodes"])
@pytest.mark.parametrize("algo", SHUFFLES)
def test_the_shuffle_seed_decides_the_order_in_every_epoch_resume_and_node_count(dataset_dir, algo, topology):
    def order(seed, epoch=0, resume=None):
        return read(topology, epoch, resume, local=str(dataset_dir), shuffle_algo=algo, shuffle_seed=seed,
                    shuffle_block_size=64)

    for epoch in (0, 1):
        first, again, other = order(1, epoch), order(1, epoch), order(2, epoch)
        assert first == again  # one seed: one order
        assert set(first) == set(other) == set(range(1003))  # every sample (the padding repeats a few) ...
        assert first != other, f"shuffle_seed=1 and 2 read epoch {epoch} in the same order"  # ... another order
    tail_one, tail_two = order(1, 1, RESUME_AT), order(2, 1, RESUME_AT)
    assert tail_one == order(1, 1)[RESUME_AT:] and tail_two == order(2, 1)[RESUME_AT:]
    assert tail_one != tail_two


@pytest.mark.parametrize("algo", ["py1br", "py1e", "blocks", "keyed"])
def test_the_shuffle_block_size_changes_the_order(dataset_dir, algo):
    topology = (2, 1, 4)

    def order(block):
        return read(topology, local=str(dataset_dir), shuffle_algo=algo, shuffle_block_size=block)

    assert order(32) == order(32)
    assert order(32) != order(256)


def test_stream_weights_choose_which_samples_and_the_seed_which_subset(tmp_path, make_dataset):
    a = str(make_dataset(tmp_path / "a", n=300))
    b = str(make_dataset(tmp_path / "b", n=100))
    topology = (2, 1, 2)

    def from_b(weights, seed=9176, epoch=0):
        streams = [Stream(local=a, proportion=weights[0]), Stream(local=b, proportion=weights[1])]
        ds = StreamingDataset(streams=streams, batch_size=8, shuffle=True, epoch_size=400, shuffle_seed=seed)
        ds.set_epoch(epoch)
        return int((ds.epoch_order(epoch) >= 300).sum())

    assert from_b((1, 3)) == 300 and from_b((3, 1)) == 100  # the weights decide how much each stream gives

    def chosen(seed, epoch=0):
        streams = [Stream(local=a, choose=50), Stream(local=b)]
        return sorted(set(read(topology, epoch, streams=streams, shuffle_seed=seed, epoch_size=None)))

    assert chosen(1) == chosen(1)
    assert chosen(1) != chosen(2)  # which 50 of a's 300 samples: the seed decides
    assert chosen(1, epoch=0) != chosen(1, epoch=1)  # and each epoch draws again


@pytest.mark.parametrize("method", ["stratified", "per_stream", "device_per_stream"])
def test_the_batching_method_and_the_seed_change_which_batches(tmp_path, make_dataset, method):
    a = str(make_dataset(tmp_path / "a", n=300))
    b = str(make_dataset(tmp_path / "b", n=100))
    topology = (2, 1, 2)

    def order(batching, seed=9176):
        return read(topology, streams=[Stream(local=a), Stream(local=b)], batching_method=batching,
                    shuffle_seed=seed)

    assert order(method) == order(method)
    assert order(method) != order("random")
    assert order(method, seed=1) != order(method, seed=2)
