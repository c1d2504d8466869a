"""The dataset starts fetching the first batches' shards at construction; the order and the epoch are unchanged."""

import threading

from torch.utils.data import DataLoader

from smalti.streaming import StreamingDataLoader, StreamingDataset


def warm_up_threads():
    return [t for t in threading.enumerate() if t.name.startswith("smalti-streaming-warm-up-")]


def ids(loader):
    return [int(i) for batch in loader for i in batch["id"]]


def test_construction_fetches_the_first_shards_and_changes_no_order(make_dataset, tmp_path):
    data = make_dataset(tmp_path / "d", n=300, size_limit=1000)
    kw = {"batch_size": 8, "shuffle": True, "num_canonical_nodes": 1}
    expected = ids(DataLoader(StreamingDataset(local=str(data), predownload=0, **kw), batch_size=8))
    for raw in data.glob("shard.*.mds"):
        raw.unlink()  # back to zips only
    ds = StreamingDataset(local=str(data), **kw)
    for thread in warm_up_threads():
        thread.join(10)
    first = ds._warm_up_shards()
    assert first and all(ds.cache.is_local(s) for s in first)  # decompressed before any iteration
    assert not list(data.glob(".*smalti-tmp-*"))  # claims released
    assert ids(StreamingDataLoader(ds, batch_size=8, num_workers=2)) == expected


def test_workers_started_during_the_warm_up_get_the_same_epoch(make_dataset, tmp_path):
    data = make_dataset(tmp_path / "d", n=300, size_limit=1000)
    kw = {"batch_size": 8, "shuffle": True, "num_canonical_nodes": 1}
    expected = ids(DataLoader(StreamingDataset(local=str(data), predownload=0, **kw), batch_size=8))
    for raw in data.glob("shard.*.mds"):
        raw.unlink()
    got = ids(StreamingDataLoader(StreamingDataset(local=str(data), **kw), batch_size=8, num_workers=2))
    assert got == expected


def test_the_warm_up_makes_shards_in_the_order_needed_one_thread_per_core(make_dataset, tmp_path, monkeypatch):
    import os

    from smalti.streaming.cache import ShardCache

    data = make_dataset(tmp_path / "d", n=300, size_limit=1000)
    made = []
    ensure = ShardCache.ensure

    def record(self, shard, *args):
        made.append((shard, threading.current_thread().name))
        return ensure(self, shard, *args)

    monkeypatch.setattr(ShardCache, "ensure", record)
    started = []
    start = threading.Thread.start

    def count(thread):
        if thread.name.startswith("smalti-streaming-warm-up-"):
            started.append(thread)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", count)
    for cores in (1, 8):  # one thread per core, no more than shards
        made.clear()
        started.clear()
        for raw in data.glob("shard.*.mds"):
            raw.unlink()
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: set(range(cores)))
        ds = StreamingDataset(local=str(data), batch_size=8, shuffle=True, num_canonical_nodes=1)
        for thread in started:
            thread.join(10)
        first = ds._warm_up_shards()
        threads = min(cores, len(first))
        assert len(first) >= 4 and len(started) == threads
        assert sorted(shard for shard, _ in made) == sorted(first)
        if threads == 1:
            assert [shard for shard, _ in made] == first  # the first batch's shards first
        assert not list(data.glob(".*smalti-tmp-*"))  # claims released


def test_the_warm_up_makes_every_shard_of_the_first_batch_within_half_the_cache_limit(make_dataset, tmp_path):
    data = make_dataset(tmp_path / "d", n=600, size_limit=1000)  # ~20 samples per shard
    kw = {"batch_size": 64, "shuffle": True, "shuffle_algo": "naive", "num_canonical_nodes": 1}
    for raw in data.glob("shard.*.mds"):
        raw.unlink()
    ds = StreamingDataset(local=str(data), **kw)
    for thread in warm_up_threads():
        thread.join(10)
    first = ds._first_needed_shards(1)
    assert len(first) > 4  # more than the warm-up's cap of later batches' shards
    assert all(ds.cache.is_local(s) for s in first)
    # a remote stream under a cache_limit: the warm-up fetches no more than half of it (at least one shard)
    remote = StreamingDataset(remote=str(data), local=str(tmp_path / "cache"), cache_limit=4000, **kw)
    for thread in warm_up_threads():
        thread.join(10)
    made = [s for s in range(len(remote._shards)) if remote.cache.is_local(s)]
    sizes = {s: e["raw_data"]["bytes"] + e["zip_data"]["bytes"] for s, (_, e) in enumerate(remote._shards)}
    assert made and (len(made) == 1 or sum(sizes[s] for s in made) <= 2000)
    assert set(made) <= set(remote._first_needed_shards(1))
