"""Datasets, caches and indexes written by someone else (smalti issue 41, items 2 and 4): declared sizes and
counts are bounded by what the shard can hold before anything is allocated or written, caches refuse links and
other users' folders, and a cached index never stands in for the remote's."""

from __future__ import annotations

import json
import os
import struct
import tempfile
import threading
import time

import numpy as np
import pytest

from smalti.streaming import (
    MDSWriter,
    ShardCorruptError,
    StreamingDataset,
    StreamingError,
    UnsafePathError,
)


def tamper(folder, **changes):
    """Set keys of shard 0's entry in ``folder/index.json`` (``raw_data__bytes=...`` reaches into sub-dicts)."""
    index = json.loads((folder / "index.json").read_text())
    entry = index["shards"][0]
    for key, value in changes.items():
        target = entry
        *parents, last = key.split("__")
        for parent in parents:
            target = target[parent]
        target[last] = value
    (folder / "index.json").write_text(json.dumps(index))


def listing(folder):
    return sorted(p.name for p in folder.iterdir())


# ---------------------------------------------------------------------------------- declared sizes (item 2)

def test_declared_raw_size_past_the_shard_limits_is_refused_before_decompressing(make_dataset, tmp_path):
    folder = make_dataset(tmp_path / "d", n=10, compression="zstd")
    before = listing(folder)
    tamper(folder, raw_data__bytes=2**50)
    with pytest.raises(StreamingError, match=r"index.json: shard 0 raw_data.bytes=1125899906842624 .*32-bit"):
        StreamingDataset(local=str(folder), batch_size=2)
    tamper(folder, raw_data__bytes=3000)  # within 32 bits, past the shard's own size_limit (2000)
    with pytest.raises(StreamingError, match=r"shard 0 declares raw_data.bytes=3000 for 10 samples, more than its "
                                             r"size_limit=2000"):
        StreamingDataset(local=str(folder), batch_size=2)
    assert listing(folder) == before  # nothing was decompressed into the folder


def test_declared_compression_ratio_is_bounded(tmp_path):
    folder = tmp_path / "zeros"
    with MDSWriter(folder, {"x": "bytes"}, compression="zstd", size_limit=None) as writer:
        writer.write({"x": np.random.default_rng(0).integers(0, 16, 256 << 10, np.uint8).tobytes()})
    entry = json.loads((folder / "index.json").read_text())["shards"][0]
    packed = entry["zip_data"]["bytes"]
    assert entry["raw_data"]["bytes"] / packed < 2048  # the real ratio, well inside the bound
    before = listing(folder)
    tamper(folder, raw_data__bytes=(1 << 32) - 1)  # a crafted run of zeros could reach it; nothing real does
    started = time.monotonic()
    with pytest.raises(StreamingError, match=f"its {packed}-byte zip decompresses to 4294967295 bytes, more than "
                                             "MAX_COMPRESSION_RATIO=2048"):
        StreamingDataset(local=str(folder), batch_size=1)
    assert time.monotonic() - started < 2
    assert listing(folder) == before


def test_declared_sample_count_is_bounded_by_the_shard_bytes(make_dataset, tmp_path):
    folder = make_dataset(tmp_path / "d", n=10, compression=None)
    tamper(folder, samples=30_000_000)
    started = time.monotonic()
    with pytest.raises(StreamingError, match=r"shard 0 declares 30000000 samples in raw_data.bytes=\d+, but each "
                                             r"sample takes at least 28 bytes"):
        StreamingDataset(local=str(folder), batch_size=2)
    assert time.monotonic() - started < 2  # refused from the index: no order of 3e7 samples was built


def test_a_local_shard_must_be_the_size_its_index_declares(make_dataset, tmp_path):
    folder = make_dataset(tmp_path / "d", n=10, compression=None)
    tamper(folder, samples=20_000, size_limit=None, raw_data__bytes=1_000_000)  # consistent, but not the file
    with pytest.raises(ShardCorruptError, match=r"index.json: shard 0 file .*shard.00000.mds is \d+ bytes, the "
                                                r"index declares 1000000"):
        StreamingDataset(local=str(folder), batch_size=2)


@pytest.mark.parametrize(("width", "height", "mode", "message"), [
    (10000, 10000, "L", r"declares a 10000x10000 L image \(100000000 bytes\) but holds 0 bytes"),
    (20000, 20000, "L", r"declares 20000x20000 = 400000000 pixels, more than the limit"),
    (60000, 60000, "RGBA", r"declares 60000x60000 = 3600000000 pixels, more than the limit"),
])
def test_pil_sizes_are_checked_against_the_bytes_before_allocating(tmp_path, width, height, mode, message):
    pytest.importorskip("PIL")
    folder = tmp_path / "pil"
    with MDSWriter(folder, {"img": "pil"}) as writer:  # bytes are stored as given: a 13-byte hostile value
        writer.write({"img": struct.pack("<III", width, height, len(mode)) + mode.encode()})
    ds = StreamingDataset(local=str(folder), batch_size=1)
    with pytest.raises(ShardCorruptError, match=f"shard .*shard.00000.mds of stream .*: sample 0 column 'img': "
                                                f"a pil value {message}"):
        ds[0]


# ------------------------------------------------------------------------------ links and caches (item 4)

@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The temp folder (where default caches go) moved into the test's own folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    (tmp_path / "tmp").mkdir()
    return tmp_path / "tmp"


def test_default_cache_is_per_user_and_private(make_dataset, upload_dataset, private_tmp, tmp_path):
    remote = upload_dataset(make_dataset(tmp_path / "d", n=10))
    ds = StreamingDataset(remote=remote, batch_size=2)
    root = private_tmp / f"smalti-{os.getuid()}" / "streaming"
    local = ds.streams[0].local_dir()
    assert local.parent == root and int(ds[0]["id"]) == 0
    assert (root.stat().st_mode & 0o777, local.stat().st_mode & 0o777) == (0o700, 0o700)
    root.chmod(0o777)
    with pytest.raises(UnsafePathError, match=f"{root} may be written by other users \\(mode 777\\)"):
        StreamingDataset(remote=remote, batch_size=2)
    root.chmod(0o700)
    if os.getuid() == 0:  # only root can give a folder away: the folder of another user is refused
        os.chown(root, 65534, -1)
        with pytest.raises(UnsafePathError, match=f"{root} is owned by uid 65534"):
            StreamingDataset(remote=remote, batch_size=2)
        os.chown(root, 0, -1)
    # the first dataset's warm-up threads fetch its shards in the background: let them finish before the cache
    # is moved, or a late one writes into the link planted below (the path is re-resolved at each write)
    for thread in threading.enumerate():
        if thread.name.startswith("smalti-streaming-warm-up"):
            thread.join(timeout=60)
    other = tmp_path / "elsewhere"
    other.mkdir()
    root.rename(tmp_path / "moved")
    root.symlink_to(other)  # a default cache planted as a link to somewhere else
    with pytest.raises(UnsafePathError, match=f"{root} is a symbolic link"):
        StreamingDataset(remote=remote, batch_size=2)
    assert listing(other) == []


def _ids(ds):
    return sorted(int(ds[i]["id"]) for i in range(ds.num_samples))


def test_a_planted_cache_is_not_served_in_place_of_the_remote(make_dataset, upload_dataset, tmp_path):
    remote = upload_dataset(make_dataset(tmp_path / "real", n=10))
    cache = tmp_path / "cache"
    with MDSWriter(cache, {"id": "int", "x": "ndarray:float32:4"}, compression="zstd", hashes=["xxh64"],
                   size_limit=2000) as writer:  # a whole dataset of its own, index and shards, in the cache
        for i in range(10):
            writer.write({"id": 1000 + i, "x": np.zeros(4, np.float32)})
    ds = StreamingDataset(remote=remote, local=str(cache), batch_size=2)
    assert _ids(ds) == list(range(10))
    assert (cache / "index.json").read_bytes() == (tmp_path / "real" / "index.json").read_bytes()


def test_links_in_a_cache_are_refused(make_dataset, upload_dataset, tmp_path):
    remote = upload_dataset(make_dataset(tmp_path / "real", n=10))
    victim = tmp_path / "victim"
    victim.mkdir()
    cache = tmp_path / "cache"
    cache.mkdir()
    # the claim a process marks a shard with, planted as a link: touching it would create a file elsewhere
    (cache / f".shard.00000.mds.smalti-tmp-claim-{os.getpid()}").symlink_to(victim / "created")
    with pytest.raises(UnsafePathError, match=f"claim-{os.getpid()} is a symbolic link"):
        StreamingDataset(remote=remote, local=str(cache), batch_size=2)
    assert listing(victim) == []
    (cache / f".shard.00000.mds.smalti-tmp-claim-{os.getpid()}").unlink()
    (victim / "data").write_bytes(b"secret")
    (cache / "shard.00000.mds").symlink_to(victim / "data")  # a shard copy planted as a link
    ds = StreamingDataset(remote=remote, local=str(cache), batch_size=2, predownload=0)
    with pytest.raises(UnsafePathError, match=r"shard.00000.mds is a symbolic link"):
        ds[0]
    assert (victim / "data").read_bytes() == b"secret"
    split = tmp_path / "split-cache"
    split.mkdir()
    (split / "train").symlink_to(victim)  # the split folder a link: index and shards would land in victim
    with pytest.raises(UnsafePathError, match=r"split-cache/train is a symbolic link"):
        StreamingDataset(remote=remote.rsplit("/", 1)[0], local=str(split), split="train", batch_size=2)
    assert listing(victim) == ["data"]


def test_a_shared_cache_checks_copies_against_the_index_not_their_records(make_dataset, upload_dataset, tmp_path):
    from smalti.streaming.mds import file_digest, record_copy

    remote = upload_dataset(make_dataset(tmp_path / "real", n=10))  # its index lists xxh64 hashes
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o777)  # a team cache any user may write to
    ds = StreamingDataset(remote=remote, local=str(cache), batch_size=2)
    assert _ids(ds) == list(range(10))
    raw = cache / "shard.00000.mds"
    data = bytearray(raw.read_bytes())
    (first,) = struct.unpack_from("<I", data, 4)
    struct.pack_into("<q", data, first, 777)  # sample 0's id, same size ...
    raw.write_bytes(bytes(data))
    record_copy(raw, file_digest(raw))  # ... and a record forged to match it
    assert _ids(StreamingDataset(remote=remote, local=str(cache), batch_size=2)) == list(range(10))


def test_a_remote_shard_larger_than_its_index_entry_is_refused_before_download(tmp_path, make_dataset):
    from smalti.streaming.errors import DownloadError

    remote = make_dataset(tmp_path / "remote", n=100, size_limit=1000, compression=None)
    shard = remote / "shard.00000.mds"
    declared = shard.stat().st_size
    with open(shard, "ab") as f:  # replaced by a bigger object (or one growing without end): never downloaded
        f.write(b"\0" * (1 << 20))
    ds = StreamingDataset(remote=str(remote), local=str(tmp_path / "cache"), batch_size=4, predownload=0,
                          validate_hash=False)  # without hash checks its extra bytes would go unnoticed
    with pytest.raises(DownloadError, match=f"more than the {declared} expected"):
        ds[0]
    assert not list((tmp_path / "cache").glob("shard.00000.mds*"))
    assert ds[len(ds) - 1]["id"] == len(ds) - 1  # the other shards read on
