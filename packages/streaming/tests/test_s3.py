"""StreamingDataset against a real S3 endpoint on loopback (moto's server), with faults injected by a proxy."""

import json
import time

import pytest
from torch.utils.data import DataLoader

from smalti.streaming import ShardCorruptError, Stream, StreamingDataset, StreamingError


def ids(ds, **loader_kw):
    return [int(i) for batch in DataLoader(ds, batch_size=ds.batch_size, **loader_kw) for i in batch["id"]]


def local_order(path):
    return ids(StreamingDataset(local=str(path), batch_size=8, shuffle=True))


def largest_shard(path):
    """Bytes of the largest shard with its zip, as the cache limit counts them."""
    entries = json.loads((path / "index.json").read_text())["shards"]
    return max(e["raw_data"]["bytes"] + ((e.get("zip_data") or {}).get("bytes") or 0) for e in entries), len(entries)


def cached_bytes(folder):
    return sum(p.stat().st_size for p in folder.glob("shard.*"))


KW = {"batch_size": 8, "shuffle": True, "shuffle_block_size": 64, "predownload": 0}


def test_s3_remote_with_cache_limit(dataset_dir, upload_dataset, s3_proxy, tmp_path):
    remote = upload_dataset(dataset_dir)
    largest, shards = largest_shard(dataset_dir)
    with pytest.raises(StreamingError, match="cache_limit"):
        StreamingDataset(remote=remote, local=str(tmp_path / "c0"), batch_size=8, cache_limit=largest - 1)
    proxy = s3_proxy()
    limit = 3 * largest
    cache = tmp_path / "cache"
    ds = StreamingDataset(remote=remote, local=str(cache), cache_limit=limit, **KW)
    got, peak = [], 0
    for sample in ds:  # in this process, without prefetching: every yield comes after the eviction
        got.append(int(sample["id"]))
        peak = max(peak, cached_bytes(cache))
    assert peak <= limit
    assert got == ids(StreamingDataset(local=str(dataset_dir), **KW))  # exactly the epoch, evictions or not
    assert len(proxy.gets) == shards
    # the limit holds what this order needs at once, and the cache evicts first the shards it reads no more
    # this epoch: every shard is downloaded once although evictions happen
    assert ds.cache_needs().min_cache_bytes <= limit
    assert sum(proxy.gets.values()) == shards, proxy.gets
    assert ds.metrics() == {"fetches": shards, "refetches": 0}
    assert len(list(cache.glob("shard.*"))) < shards


def test_cache_limit_never_evicts_shards_that_exist_only_locally(dataset_dir, upload_dataset, make_dataset,
                                                                 tmp_path):
    remote = upload_dataset(dataset_dir)
    own = make_dataset(tmp_path / "own", n=300, compression=None)  # no remote: the only copy
    own_shards = {p.name: p.read_bytes() for p in own.glob("shard.*")}
    largest = max(largest_shard(dataset_dir)[0], largest_shard(own)[0])
    cache = tmp_path / "cache"
    ds = StreamingDataset(streams=[Stream(remote=remote, local=str(cache)), Stream(local=str(own))],
                          cache_limit=3 * largest, **KW)
    got = ids(ds)
    assert len(got) == 1303 + (-1303) % 8
    assert {p.name: p.read_bytes() for p in own.glob("shard.*")} == own_shards  # all still there, unchanged
    assert cached_bytes(cache) <= 3 * largest  # while the downloaded ones were evicted to the limit
    assert len(list(cache.glob("shard.*"))) < largest_shard(dataset_dir)[1]


def test_s3_errors_and_slow_responses_still_give_exact_epoch(dataset_dir, upload_dataset, faulty_s3, tmp_path):
    remote = upload_dataset(dataset_dir)
    ds = StreamingDataset(remote=remote, local=str(tmp_path / "cache"), batch_size=8, shuffle=True, download_retry=3)
    got = ids(ds)
    assert faulty_s3.failures > 0
    assert got == local_order(dataset_dir)


def test_stalled_download_times_out_and_is_retried(make_dataset, upload_dataset, s3_proxy, tmp_path):
    data = make_dataset(tmp_path / "data", n=200)
    remote = upload_dataset(data)
    timeout = 1.0
    # The first shard GET hangs for 30 time-outs (or until the proxy stops): only a client that gives up on it
    # and asks again gets the shard while it hangs. No wall-clock bound: load only delays the retry.
    proxy = s3_proxy(stall_every=1000, stall_s=30 * timeout)
    ds = StreamingDataset(remote=remote, local=str(tmp_path / "cache"), batch_size=8, shuffle=True,
                          download_timeout=timeout, download_retry=2)
    got = ids(ds)
    assert got == local_order(data)
    assert proxy.stalls == 1
    (stalled,) = proxy.stalled
    assert proxy.gets[stalled] == 2, proxy.gets  # timed out once, then fetched by the retry
    assert proxy.gets_while_stalled[stalled] == 1  # the retry did not wait for the stalled answer


def test_workers_download_each_shard_once(dataset_dir, upload_dataset, s3_proxy, tmp_path):
    remote = upload_dataset(dataset_dir)
    proxy = s3_proxy()
    cache = tmp_path / "cache"
    cache.mkdir()
    # A download killed in an earlier run left its temporary file behind: it must not stall this one.
    stale = cache / ".shard.00000.mds.zstd.smalti-tmp-abc123"
    stale.write_bytes(b"partial")
    old = time.time() - 3600
    import os

    os.utime(stale, (old, old))
    ds = StreamingDataset(remote=remote, local=str(cache), batch_size=8, shuffle=True, num_canonical_nodes=2)
    got = ids(ds, num_workers=2)
    assert set(got) == set(range(1003)) and len(got) == 1008
    assert len(proxy.gets) == len(list(dataset_dir.glob("shard.*")))
    assert set(proxy.gets.values()) == {1}, proxy.gets  # the two workers split the downloads


def test_corrupt_remote_shard_names_shard_and_stream(dataset_dir, upload_dataset, s3_server, s3_bucket, tmp_path):
    shard = sorted(dataset_dir.glob("shard.*"))[3]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    remote = upload_dataset(dataset_dir)
    ds = StreamingDataset(remote=remote, local=str(tmp_path / "cache"), batch_size=8, download_retry=1)
    with pytest.raises(ShardCorruptError, match=rf"{shard.name}.*{remote}.*xxh64"):
        ids(ds)
    assert not (tmp_path / "cache" / shard.name).exists()  # never visible as if it were good
    assert not (tmp_path / "cache" / shard.name.removesuffix(".zstd")).exists()
