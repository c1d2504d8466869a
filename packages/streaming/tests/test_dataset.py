"""StreamingDataset: deterministic global batches on any topology, exact epochs, resumption, mixing, S3, cache."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from smalti.streaming import Stream, StreamingDataset, StreamingError
from smalti.streaming.order import MOSAIC_SHUFFLES, SHUFFLES


def ids(ds, **loader_kw):
    return [int(i) for batch in DataLoader(ds, batch_size=ds.batch_size, **loader_kw) for i in batch["id"]]


@pytest.mark.parametrize("algo", SHUFFLES)
def test_every_shuffle_reads_each_sample_once_per_epoch_over_two_ranks(dataset_dir, algo):
    def read(rank, epoch=0):
        ds = StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True, shuffle_algo=algo,
                              num_canonical_nodes=4, shuffle_block_size=64, rank=rank, world_size=2)
        ds.set_epoch(epoch)
        return ids(ds)

    first = read(0) + read(1)
    padding = 1 if algo in MOSAIC_SHUFFLES else 5  # mosaicml-streaming's pads to whole ranks, smalti's to batches
    assert len(first) == 1003 + padding and set(first) == set(range(1003))
    assert first[:504] != sorted(first[:504])  # shuffled
    second = read(0, 1) + read(1, 1)
    assert set(second) == set(range(1003)) and second != first


def test_real_workers_yield_the_same_order(dataset_dir):
    one = ids(StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True, num_canonical_nodes=2))
    three = ids(StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True, num_canonical_nodes=2),
                num_workers=3)
    assert one == three


def test_every_sample_once_per_epoch_plus_padding_and_epochs_differ(dataset_dir):
    ds = StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True, world_size=2, rank=0)
    other = StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True, world_size=2, rank=1)
    first = ids(ds) + ids(other)
    assert len(first) == 1008 and set(first) == set(range(1003))  # 5 samples of padding to whole global batches
    assert len(ds) == 504
    ds.set_epoch(1)
    assert ids(ds) != first[:504]


def test_resume_mid_epoch_yields_exactly_the_tail(dataset_dir):
    full = ids(StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True))
    ds = StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True)
    ds.load_state_dict({"epoch": 0, "sample_in_epoch": 400, "num_canonical_nodes": 1, "shuffle_seed": 9176,
                        "shuffle_algo": "keyed"})
    assert ids(ds) == full[400:]


def test_a_checkpoint_keeps_its_shuffle_algorithm(dataset_dir):
    """New runs shuffle with keyed; a smalti state that names no algorithm (taken before blocks) resumes
    py1e's order, one that names one (blocks, from before keyed) resumes it; a different given one is refused."""
    new = StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True)
    assert new.shuffle_algo == "keyed" and new.state_dict()["shuffle_algo"] == "keyed"
    py1e = ids(StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True, shuffle_algo="py1e"))
    blocks = ids(StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True, shuffle_algo="blocks"))
    keyed = ids(new)  # (reading an epoch moves the dataset to the next)
    assert keyed != py1e and keyed != blocks
    handmade = StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True)
    handmade.load_state_dict({"epoch": 0, "sample_in_epoch": 400})
    assert handmade.shuffle_algo == "keyed"
    assert ids(handmade) == ids(StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True))[400:]
    for state, algo, expected in (({"partition_algo": "relaxed"}, "py1e", py1e),
                                  ({"shuffle_algo": "py1e"}, "py1e", py1e),
                                  ({"partition_algo": "relaxed", "shuffle_algo": "blocks"}, "blocks", blocks)):
        ds = StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True)
        ds.load_state_dict({"epoch": 0, "sample_in_epoch": 400, "num_canonical_nodes": 1, **state})
        assert ds.shuffle_algo == algo and ids(ds) == expected[400:]
    given = StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True, shuffle_algo="blocks")
    with pytest.raises(StreamingError, match="shuffle_algo='py1e'"):
        given.load_state_dict({"epoch": 0, "sample_in_epoch": 8, "num_canonical_nodes": 1, "shuffle_algo": "py1e"})


def test_state_dict_counts_yielded_samples(dataset_dir):
    ds = StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True, num_canonical_nodes=1)
    it = iter(ds)
    for _ in range(24):
        next(it)
    assert ds.state_dict() == {"epoch": 0, "sample_in_epoch": 24, "num_canonical_nodes": 1, "shuffle_seed": 9176,
                               "partition_algo": "relaxed", "physical_nodes": 1, "shuffle_algo": "keyed"}
    with pytest.raises(StreamingError, match="num_canonical_nodes"):
        ds.load_state_dict({"epoch": 0, "sample_in_epoch": 8, "num_canonical_nodes": 4, "shuffle_seed": 9176})


def test_replication_gives_groups_identical_samples(dataset_dir):
    got = [ids(StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True, replication=2, rank=r,
                                world_size=4)) for r in range(4)]
    assert got[0] == got[1] and got[2] == got[3] and got[0] != got[2]
    assert set(got[0]) | set(got[2]) == set(range(1003))


def test_stream_mixing_counts(tmp_path, make_dataset):
    write_dataset = make_dataset

    a = write_dataset(tmp_path / "a", n=300)
    b = write_dataset(tmp_path / "b", n=100)
    offset = 300  # b's ids appear after a's in the global sample space
    ds = StreamingDataset(streams=[Stream(local=str(a), proportion=1), Stream(local=str(b), proportion=3)],
                          batch_size=10, shuffle=True, epoch_size=400)
    got = ds.epoch_order(0)
    from_b = int((got >= offset).sum())
    assert len(got) == 400 and from_b == 300  # proportions 1:3 of 400, b upsampled 3x
    ds = StreamingDataset(streams=[Stream(local=str(a), choose=50), Stream(local=str(b), repeat=2)], batch_size=10)
    got = ds.epoch_order(0)
    assert int((got < offset).sum()) == 50 and int((got >= offset).sum()) == 200


@pytest.mark.parametrize("method", ["stratified", "per_stream", "device_per_stream"])
def test_batching_methods_exact_counts(tmp_path, method, make_dataset):
    a = make_dataset(tmp_path / "a", n=300)
    b = make_dataset(tmp_path / "b", n=100)
    ds = StreamingDataset(streams=[Stream(local=str(a)), Stream(local=str(b))], batch_size=4, world_size=2, rank=0,
                          shuffle=True, batching_method=method)
    order = ds.epoch_order(0)
    batches = order.reshape(-1, 8)  # global batches: 2 ranks x 4
    from_b = (batches >= 300).sum(1)
    if method == "stratified":
        # 6 from a and 2 from b in every global batch, until a stream runs out: 50 batches, every sample once.
        assert len(batches) == 50 and from_b.tolist() == [2] * 50
        assert sorted(order.tolist()) == list(range(400))
        return
    if method == "per_stream":
        # Whole global batches from one stream: 300 // 8 = 37 from a, 100 // 8 = 12 from b.
        assert sorted(from_b.tolist()) == [0] * 37 + [8] * 12
        assert np.flatnonzero(from_b == 8).tolist() != list(range(37, 49))  # the batches of streams are shuffled
    else:
        # Each device batch from one stream: 300 // 4 = 75 from a, 100 // 4 = 25 from b (100 = 50 global).
        per_device = (order.reshape(-1, 4) >= 300).sum(1)
        assert sorted(per_device.tolist()) == [0] * 75 + [4] * 25
        assert len(batches) == 50 and 4 in from_b.tolist()  # a global batch can mix the streams
    assert len(set(order.tolist())) == len(order)  # no sample twice

    def rank_ids(rank):
        ds = StreamingDataset(streams=[Stream(local=str(a)), Stream(local=str(b))], batch_size=4, world_size=2,
                              rank=rank, shuffle=True, batching_method=method)
        return [batch["id"].tolist() for batch in DataLoader(ds, batch_size=4)]

    # What the ranks really read: every device batch from one stream (ids of b are < 100, of a up to 299).
    expected = [[int(i) - (300 if i >= 300 else 0) for i in row] for row in order.reshape(-1, 4)]
    assert [x for pair in zip(rank_ids(0), rank_ids(1)) for x in pair] == expected


def test_getitem_and_two_datasets_in_one_process(dataset_dir, tmp_path, make_dataset):
    other = make_dataset(tmp_path / "other", n=10, compression=None)
    a = StreamingDataset(local=str(dataset_dir), batch_size=4)
    b = StreamingDataset(local=str(other), batch_size=4)
    assert a[500]["id"] == 500 and b[3]["id"] == 3
    assert torch.equal(torch.as_tensor(a[7]["x"]), torch.full((4,), 7.0))
    with pytest.raises(IndexError):
        b[10]


def test_curriculum_changes_proportions_at_an_epoch(tmp_path, make_dataset):
    a = make_dataset(tmp_path / "a", n=300)
    b = make_dataset(tmp_path / "b", n=100)
    ds = StreamingDataset(streams=[Stream(local=str(a), proportion=3), Stream(local=str(b), proportion=1)],
                          batch_size=10, shuffle=True, epoch_size=400,
                          proportion_schedule=[{"at": "2ep", "proportions": [1, 3]}])
    from_b = [int((ds.epoch_order(e) >= 300).sum()) for e in range(3)]
    assert from_b == [100, 100, 300]  # high-quality stream b upsampled from epoch 2 on
    with pytest.raises(StreamingError, match="0.5dur"):
        StreamingDataset(streams=[Stream(local=str(a)), Stream(local=str(b))], proportion_schedule=[{"at": "0.5dur"}])


def test_leaves_no_shared_memory_or_lock_files(dataset_dir, tmp_path):
    import glob
    import tempfile

    def leftovers():
        return set(glob.glob("/dev/shm/*")) | set(glob.glob(f"{tempfile.gettempdir()}/*lock*"))

    before = leftovers()
    ds = StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True)
    assert len(ids(ds, num_workers=2)) == 1008
    assert leftovers() == before
    assert not list(dataset_dir.glob("*.tmp"))


def test_physical_nodes_read_only_their_canonical_nodes_shards(dataset_dir):
    """2 nodes x 2 ranks, 4 canonical nodes: each node's ranks touch about half of the shards."""
    ds = StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True, num_canonical_nodes=4,
                          shuffle_block_size=64, rank=0, world_size=4)
    order = ds.epoch_order(0)
    shard_of = np.searchsorted(ds._shard_starts, order, side="right") - 1
    per_rank = shard_of.reshape(-1, 4, 8)  # (global batch, rank, sample)
    node0, node1 = set(per_rank[:, :2].ravel().tolist()), set(per_rank[:, 2:].ravel().tolist())
    total = len(ds._shards)
    # Shards cut by a canonical-node boundary, and the padding's first samples, are read by both nodes.
    assert len(node0 & node1) <= 3
    assert len(node0) <= total // 2 + 3 and len(node1) <= total // 2 + 3


def test_resume_at_any_offset_single_rank(dataset_dir):
    full = ids(StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True))
    ds = StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True)
    ds.load_state_dict({"epoch": 0, "sample_in_epoch": 403})
    assert ids(ds) == full[403:]


def test_resume_mid_epoch_over_ranks_and_workers(dataset_dir):
    def run(rank, state=None, workers=2):
        ds = StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True, num_canonical_nodes=2,
                              rank=rank, world_size=2)
        if state:
            ds.load_state_dict(state)
        return ids(ds, num_workers=workers)

    full = [run(r, workers=1) for r in range(2)]
    state = {"epoch": 0, "sample_in_epoch": 160, "num_canonical_nodes": 2, "shuffle_seed": 9176}
    tails = [run(r, state) for r in range(2)]
    assert tails == [full[0][80:], full[1][80:]]


def test_streaming_dataloader_state_with_workers_and_next_epoch(dataset_dir):
    from smalti.streaming import StreamingDataLoader

    ds = StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True)
    loader = StreamingDataLoader(ds, batch_size=8, num_workers=2)
    seen = []
    for step, batch in enumerate(loader):
        seen += batch["id"].tolist()
        if step == 9:
            break
    assert loader.state_dict()["sample_in_epoch"] == 80 == ds.state_dict()["sample_in_epoch"]
    state = loader.state_dict()
    resumed = StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True)
    resumed_loader = StreamingDataLoader(resumed, batch_size=8, num_workers=2)
    resumed_loader.load_state_dict(state)
    rest = [i for batch in resumed_loader for i in batch["id"].tolist()]
    assert seen + rest == ids(StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True))
    assert resumed_loader.state_dict() == {"epoch": 1, "sample_in_epoch": 0, "num_canonical_nodes": 1,
                                           "shuffle_seed": 9176, "partition_algo": "relaxed", "physical_nodes": 1,
                                           "shuffle_algo": "keyed"}
    second = [i for batch in resumed_loader for i in batch["id"].tolist()]
    assert sorted(set(second)) == list(range(1003)) and second != seen + rest
    with pytest.raises(StreamingError, match="persistent_workers"):
        StreamingDataLoader(ds, batch_size=8, num_workers=1, persistent_workers=True)


def test_in_process_epoch_end_moves_state_to_next_epoch(dataset_dir):
    ds = StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle=True)
    first = ids(ds)
    assert ds.state_dict()["epoch"] == 1 and ds.state_dict()["sample_in_epoch"] == 0
    assert ids(ds) != first


def test_corrupt_local_shard_names_shard_and_stream(tmp_path, make_dataset):
    data = make_dataset(tmp_path / "plain", n=200, compression=None)
    shard = sorted(data.glob("shard.*"))[2]
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x01  # a flipped bit in a value: sizes still match, only the hash can tell
    shard.write_bytes(bytes(raw))
    from smalti.streaming import ShardCorruptError

    with pytest.raises(ShardCorruptError, match=rf"{shard.name} of stream {data}.*xxh64"):
        ids(StreamingDataset(local=str(data), batch_size=8))


def test_partition_algo_orig_needs_node_count_and_canonical_nodes_to_divide(dataset_dir):
    def make(world, local_world, algo, ncn=None):
        return StreamingDataset(local=str(dataset_dir), batch_size=8, world_size=world, rank=0,
                                local_world_size=local_world, partition_algo=algo, num_canonical_nodes=ncn)

    with pytest.raises(StreamingError, match=r"partition_algo='orig'.*node count \(3 .*num_canonical_nodes=2"):
        make(3, 1, "orig", 2)
    assert make(3, 1, "relaxed", 2).num_canonical_nodes == 2  # relaxed takes any node count
    assert make(4, 2, "orig", 4).physical_nodes == 2  # 2 nodes divide 4 canonical nodes
    assert make(4, 1, "orig", 2).physical_nodes == 4  # 4 nodes are a multiple of 2
    with pytest.raises(StreamingError, match="partition_algo='fancy' is not one of orig, relaxed"):
        make(1, 1, "fancy")
    with pytest.raises(StreamingError, match="local_world_size=3 .* must divide the world size 4"):
        make(4, 3, "relaxed")
    state = make(4, 2, "orig").state_dict()
    assert (state["partition_algo"], state["physical_nodes"], state["num_canonical_nodes"]) == ("orig", 2, 2)
    # Resuming an orig run on 3 nodes with the checkpoint's 2 canonical nodes breaks the rule: said so.
    three = make(3, 1, "orig")
    with pytest.raises(StreamingError, match="partition_algo='orig'"):
        three.load_state_dict(state)
    assert three.num_canonical_nodes == 3 and three.state_dict()["sample_in_epoch"] == 0  # left as it was


def test_default_canonical_nodes_follow_the_first_run_and_survive_a_resume_on_another_layout(dataset_dir):
    def make(world, local_world, rank, batch_size, **kw):
        return StreamingDataset(local=str(dataset_dir), batch_size=batch_size, shuffle=True, world_size=world,
                                rank=rank, local_world_size=local_world, **kw)

    assert make(4, 2, 0, 8).num_canonical_nodes == 2  # the node count, as mosaicml-streaming does
    assert make(4, 2, 0, 8, shuffle_algo="py1s").num_canonical_nodes == 128  # 64x for py1s/py2s
    # First run: 2 nodes of 1 rank, batches of 8 (global 16). Its checkpoint after 10 global batches...
    first = [ids(make(2, 1, r, 8)) for r in range(2)]
    full = [sorted(first[0][i : i + 8] + first[1][i : i + 8]) for i in range(0, len(first[0]), 8)]
    state = make(2, 1, 0, 8).state_dict(num_samples=160)
    assert state["num_canonical_nodes"] == 2
    # ...resumed on 1 node of 4 ranks with batches of 4 (still 16 global): the same remaining global batches.
    resumed = []
    for r in range(4):
        ds = make(4, 4, r, 4)
        assert ds.num_canonical_nodes == 1
        ds.load_state_dict(state)
        resumed.append(ids(ds))
    tail = [sorted(sum((resumed[r][i : i + 4] for r in range(4)), [])) for i in range(0, len(resumed[0]), 4)]
    assert tail == full[10:]
    # An explicit, different value is a mismatch, not something to adopt.
    with pytest.raises(StreamingError, match="num_canonical_nodes"):
        make(4, 4, 0, 4, num_canonical_nodes=1).load_state_dict(state)


def test_shuffle_algo_is_checked_when_the_dataset_is_made(dataset_dir):
    with pytest.raises(StreamingError, match="shuffle_algo='py1b' is not one of naive, py1s, py2s, py1br, py1e"):
        StreamingDataset(local=str(dataset_dir), batch_size=8, shuffle_algo="py1b")


def test_stale_temporary_downloads_are_removed_and_fresh_ones_kept(dataset_dir, tmp_path):
    import os
    import shutil
    import time

    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(dataset_dir / "index.json", cache / "index.json")
    stale = cache / ".shard.00001.mds.zstd.smalti-tmp-k1lled"  # left by a SIGKILLed download an hour ago
    legacy = cache / ".shard.00003.mds.zstd.k1lled.tmp"  # the same, by an older smalti-streaming
    fresh = cache / ".shard.00002.mds.zstd.smalti-tmp-runn1ng"  # another process is downloading it right now
    unrelated = cache / "notes.tmp"
    for path in (stale, legacy, fresh, unrelated):
        path.write_bytes(b"partial")
    old = time.time() - 3600
    for path in (stale, legacy, unrelated):
        os.utime(path, (old, old))
    ds = StreamingDataset(remote=str(dataset_dir), local=str(cache), batch_size=8)
    assert not stale.exists() and not legacy.exists() and fresh.exists() and unrelated.exists()
    assert sorted(ids(ds)) == sorted(list(range(1003)) + list(range(5)))
