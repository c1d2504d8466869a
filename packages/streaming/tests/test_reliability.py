"""Faults and hostile inputs: damaged cache copies, names that leave their folder, decompression bombs,
pickles, and a verify that checked nothing. Each test names the guarantee it proves (see the README)."""

import json
import os
import re
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from smalti.streaming import (
    MDSWriter,
    ShardCorruptError,
    ShardReader,
    StreamingDataset,
    StreamingError,
    UnsafePathError,
    load_index,
    merge_index,
    read_shard_samples,
)
from smalti.streaming import compression as comp
from smalti.streaming.cli import main as cli


def write(path, n=200, compression="zstd", hashes=("xxh64",), size_limit=2000):
    with MDSWriter(path, {"id": "int", "x": "ndarray:float32:4"}, compression=compression, hashes=list(hashes),
                   size_limit=size_limit) as writer:
        for i in range(n):
            writer.write({"id": i, "x": np.full(4, i, np.float32)})
    return path


def samples(ds):
    return [(int(s["id"]), s["x"].tolist()) for s in (ds[i] for i in range(ds.num_samples))]


EXPECTED = [(i, [float(i)] * 4) for i in range(200)]


def flip_sample_byte(raw, entry, sample=0):
    """Flip a byte inside sample ``sample``'s ``x`` values (its last byte), as bit rot on disk would."""
    data = bytearray(raw.read_bytes())
    end = int(np.frombuffer(data, np.uint32, count=entry["samples"] + 1, offset=4)[sample + 1])
    data[end - 1] ^= 0x40
    raw.write_bytes(bytes(data))


# ---------------------------------------------------------------- 1. decompressed cache copies are checked


def test_flipped_byte_in_decompressed_copy_is_never_served_local(tmp_path):
    data = write(tmp_path / "data", compression="zstd")
    assert samples(StreamingDataset(local=str(data), batch_size=8)) == EXPECTED  # decompresses beside the zips
    entry = load_index(data / "index.json")[1]
    raw = data / entry["raw_data"]["basename"]
    good = raw.read_bytes()
    flip_sample_byte(raw, entry)
    # A new dataset (a new run or process) checks the copy when it first opens it and decompresses it again.
    assert samples(StreamingDataset(local=str(data), batch_size=8)) == EXPECTED
    assert raw.read_bytes() == good
    flip_sample_byte(raw, entry)
    assert [(int(s["id"]), s["x"].tolist()) for s in read_shard_samples(data)] == EXPECTED
    assert raw.read_bytes() == good


def test_copy_records_work_without_xattrs(tmp_path, monkeypatch):
    """On filesystems without user extended attributes the record is a hidden file beside the copy."""

    def unsupported(*args):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(os, "setxattr", unsupported)
    monkeypatch.setattr(os, "getxattr", unsupported)
    data = write(tmp_path / "data", compression="zstd")
    assert samples(StreamingDataset(local=str(data), batch_size=8)) == EXPECTED
    entry = load_index(data / "index.json")[1]
    raw = data / entry["raw_data"]["basename"]
    assert (data / f".{raw.name}.xxh3_128").exists()
    flip_sample_byte(raw, entry)
    assert samples(StreamingDataset(local=str(data), batch_size=8)) == EXPECTED


@pytest.mark.parametrize("compression", ["zstd", "gz", None])
def test_flipped_byte_in_remote_cache_copy_is_fetched_again(compression, tmp_path, upload_dataset, s3_proxy):
    data = write(tmp_path / "data", compression=compression)
    remote = upload_dataset(data)
    cache = tmp_path / "cache"
    assert samples(StreamingDataset(remote=remote, local=str(cache), batch_size=8)) == EXPECTED
    entry = load_index(data / "index.json")[2]
    raw = cache / entry["raw_data"]["basename"]
    assert not list(cache.glob("*.zstd")) and not list(cache.glob("*.gz"))  # zips are gone: only the copy
    flip_sample_byte(raw, entry)
    proxy = s3_proxy()
    assert samples(StreamingDataset(remote=remote, local=str(cache), batch_size=8)) == EXPECTED
    fetched = (entry["zip_data"] or entry["raw_data"])["basename"]
    assert [path.rsplit("/", 1)[-1] for path in proxy.gets] == [fetched]  # only the damaged shard again


def test_each_process_checks_copies_it_opens(tmp_path):
    """DataLoader workers do not inherit the parent's "already checked" marks."""
    from torch.utils.data import DataLoader

    data = write(tmp_path / "data", compression="zstd")
    ds = StreamingDataset(local=str(data), batch_size=8)
    assert samples(ds) == EXPECTED
    entry = load_index(data / "index.json")[0]
    flip_sample_byte(data / entry["raw_data"]["basename"], entry)
    got = [(int(i), x.tolist()) for batch in DataLoader(ds, batch_size=8, num_workers=1)
           for i, x in zip(batch["id"], batch["x"])]
    assert sorted(got) == EXPECTED
    assert samples(StreamingDataset(local=str(data), batch_size=8)) == EXPECTED


# ---------------------------------------------------------------- 3. names read from files stay in their folder


def craft(data, key, name, shard=0):
    index = json.loads((data / "index.json").read_text())
    index["shards"][shard][key]["basename"] = name
    (data / "index.json").write_text(json.dumps(index))


ESCAPES = [("raw_data", "../../x.mds"), ("zip_data", "../../x.mds.zstd"), ("raw_data", "/tmp/smalti-x.mds"),
           ("zip_data", "sub/../../x.mds.zstd")]


@pytest.mark.parametrize(("key", "name"), ESCAPES)
def test_local_index_with_escaping_basename_is_refused(key, name, tmp_path, capsys):
    data = write(tmp_path / "a" / "b" / "data")
    craft(data, key, name, shard=1)
    message = re.escape(f"{data / 'index.json'}: shard 1 {key}.basename is '{name}'")
    for read in (lambda: StreamingDataset(local=str(data), batch_size=8), lambda: list(read_shard_samples(data))):
        with pytest.raises(UnsafePathError, match=message):
            read()
    assert cli(["verify", str(data)]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert isinstance(UnsafePathError("x"), StreamingError)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b"]


@pytest.mark.parametrize(("key", "name"), ESCAPES[:2])
def test_remote_index_with_escaping_basename_writes_and_deletes_nothing_outside(key, name, tmp_path,
                                                                              upload_dataset, s3_server, s3_bucket):
    data = write(tmp_path / "data")
    craft(data, key, name)
    remote = upload_dataset(data)
    s3_server.client().put_object(Bucket=s3_bucket, Key="x.mds", Body=b"payload")  # what ds/../../x.mds reaches
    outside = tmp_path / "a" / "x.mds"
    outside.parent.mkdir()
    victim = tmp_path / "a" / "keep.txt"
    victim.write_text("keep")
    cache = tmp_path / "a" / "b" / "cache"
    with pytest.raises(UnsafePathError, match=rf"{cache / 'index.json'}: shard 0 {key}.basename"):
        StreamingDataset(remote=remote, local=str(cache), batch_size=8, cache_limit=10_000)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b", "keep.txt"]
    assert victim.read_text() == "keep"


def test_merge_index_refuses_escaping_sub_index_entries(tmp_path):
    write(tmp_path / "p0")
    write(tmp_path / "p1")
    craft(tmp_path / "p1", "raw_data", "../../../x.mds")
    with pytest.raises(UnsafePathError, match=r"p1/index.json: shard 0 raw_data.basename"):
        merge_index(tmp_path)
    with pytest.raises(UnsafePathError, match=r"sub-index folder"):
        merge_index(tmp_path / "p0", ["../p1"])
    assert not (tmp_path / "index.json").exists()


# ---------------------------------------------------------------- 4. decompression stops at the declared size


def bomb(path, compression):
    """A real one-shard dataset whose zip is replaced by 8 MiB of compressed zeros (index unchanged otherwise)."""
    data = write(path, n=10, compression=compression, hashes=(), size_limit=1 << 20)
    index = json.loads((data / "index.json").read_text())
    (entry,) = index["shards"]
    packed = comp.compress(compression + (":5" if compression == "br" else ""), bytes(8 << 20))
    (data / entry["zip_data"]["basename"]).write_bytes(packed)
    entry["zip_data"]["bytes"] = len(packed)
    (data / "index.json").write_text(json.dumps(index))
    return data, entry


CODECS = ["zstd", "gz", "bz2", "br", "snappy"]


@pytest.mark.parametrize("compression", CODECS)
def test_decompression_bomb_is_refused_before_writing_past_declared_size(compression, tmp_path):
    data, entry = bomb(tmp_path / "data", compression)
    declared = entry["raw_data"]["bytes"]
    # In a child whose files cannot grow past the declared size plus one chunk: a write past it would fail
    # there with EFBIG instead of the refusal.
    script = textwrap.dedent(f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({declared + comp.CHUNK}, resource.RLIM_INFINITY))
        from smalti.streaming import read_shard_samples
        try:
            list(read_shard_samples({str(data)!r}))
        except Exception as exc:
            print(type(exc).__name__, exc)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    zip_name = entry["zip_data"]["basename"]
    assert out.stdout.startswith("ShardCorruptError"), out.stdout
    assert f"{zip_name} of stream" in out.stdout and f"more than the {declared} bytes" in out.stdout
    assert sorted(p.name for p in data.iterdir()) == ["index.json", "index.npz", zip_name]  # no raw copy, no temp file


def test_streaming_dataset_refuses_bomb_naming_shard(tmp_path):
    data, entry = bomb(tmp_path / "data", "zstd")
    ds = StreamingDataset(local=str(data), batch_size=2)
    with pytest.raises(ShardCorruptError, match=rf"{entry['zip_data']['basename']} of stream .*data.*more than "
                                                rf"the {entry['raw_data']['bytes']} bytes"):
        ds[0]
    for thread in threading.enumerate():  # the warm-up met the same bomb; let it release its claim
        if thread.name.startswith("smalti-streaming-warm-up-"):
            thread.join(10)
    assert sorted(p.name for p in data.iterdir()) == ["index.json", "index.npz", entry["zip_data"]["basename"]]


# ---------------------------------------------------------------- 5. pkl columns need the opt-in everywhere


class _Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickling creates the file: the stand-in for running someone else's code
        return (open, (self.path, "w"))


def test_pickle_columns_need_allow_unsafe_types_on_every_read_path(tmp_path):
    marker = tmp_path / "marker"
    data = tmp_path / "pkl"
    with MDSWriter(data, {"obj": "pkl", "id": "int"}, allow_unsafe_types=True) as writer:
        writer.write({"obj": _Marker(str(marker)), "id": 0})
    entry = load_index(data / "index.json")[0]
    raw = data / entry["raw_data"]["basename"]
    refusals = [lambda: list(read_shard_samples(data)), lambda: ShardReader(raw, entry)[0],
                lambda: StreamingDataset(local=str(data), batch_size=1)[0]]
    for read in refusals:
        with pytest.raises(StreamingError, match="'obj'.*allow_unsafe_types"):
            read()
    assert not marker.exists()
    (sample,) = read_shard_samples(data, allow_unsafe_types=True)
    sample["obj"].close()
    assert marker.exists()
    marker.unlink()
    ShardReader(raw, entry, allow_unsafe_types=True)[0]["obj"].close()
    assert marker.exists()


# ---------------------------------------------------------------- 6. verify says when nothing was verified


def test_verify_without_hashes_says_nothing_was_verified(tmp_path, capsys):
    plain = write(tmp_path / "plain", compression=None, hashes=())
    assert cli(["verify", str(plain)]) == 3
    out = capsys.readouterr().out
    assert "NOT VERIFIED" in out and "have no hashes" in out and "OK" not in out
    assert cli(["verify", str(plain), "--allow-unhashed"]) == 0
    assert "checked by size only" in capsys.readouterr().out
    hashed = write(tmp_path / "hashed", compression="zstd", hashes=("xxh64",))
    assert cli(["verify", str(hashed), "--decompress"]) == 0
    assert "OK: " in capsys.readouterr().out
    shard = sorted(plain.glob("shard.*"))[0]
    shard.write_bytes(shard.read_bytes()[:-1])
    assert cli(["verify", str(plain), "--allow-unhashed"]) == 1
    assert f"BAD {shard.name}" in capsys.readouterr().out
