"""MDS compatibility with mosaicml-streaming 0.13.0's golden files, and clear errors on bad shards."""

import decimal
import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from smalti.streaming import MDSWriter, ShardCorruptError, StreamingError, load_index, read_shard_samples

FIXTURES = Path(__file__).parent / "fixtures"
SETTINGS = {
    "plain": (None, []),
    "zstd7_sha1_xxh3": ("zstd:7", ["sha1", "xxh3_64"]),
    "gz": ("gz", ["md5"]),
    "bz2": ("bz2:3", ["xxh64"]),
    "br": ("br", []),
    "snappy": ("snappy", ["sha256"]),
    "tokens_zstd": ("zstd", ["sha1"]),
}


def as_json(value):
    if isinstance(value, np.ndarray):
        return {"ndarray": {"dtype": str(value.dtype), "shape": list(value.shape), "data": value.reshape(-1).tolist()}}
    if isinstance(value, np.generic):
        return {"scalar": {"dtype": str(value.dtype), "value": value.item()}}
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    if isinstance(value, decimal.Decimal):
        return {"decimal": str(value)}
    return value


@pytest.fixture
def golden(tmp_path):
    def copy(name):
        shutil.copytree(FIXTURES / name, tmp_path / name)  # reading decompresses next to the shards
        return tmp_path / name

    return copy


@pytest.mark.parametrize("name", [n for n in SETTINGS if n != "tokens_zstd"])
def test_reader_decodes_golden_samples(golden, name):
    expected = [json.loads(line) for line in (FIXTURES / "expected_samples.jsonl").read_text().splitlines()]
    got = [{k: as_json(v) for k, v in s.items()} for s in read_shard_samples(golden(name))]
    assert got == expected


@pytest.mark.parametrize("name", list(SETTINGS))
def test_writer_is_byte_identical(golden, name, tmp_path):
    src = golden(name)
    entries = load_index(src / "index.json")
    compression, hashes = SETTINGS[name]
    out = tmp_path / "out"
    with MDSWriter(out, dict(zip(entries[0]["column_names"], entries[0]["column_encodings"])),
                   compression=compression, hashes=hashes, size_limit=entries[0]["size_limit"]) as writer:
        for sample in read_shard_samples(src):
            writer.write(sample)
    shards = sorted(p.name for p in (FIXTURES / name).glob("shard.*"))
    assert shards == sorted(p.name for p in out.glob("shard.*"))
    for shard in shards:
        ours, theirs = (out / shard).read_bytes(), (FIXTURES / name / shard).read_bytes()
        if name == "gz":  # gzip headers carry a timestamp
            ours, theirs = gzip.decompress(ours), gzip.decompress(theirs)
        assert ours == theirs, shard
    if name != "gz":
        assert (out / "index.json").read_bytes() == (FIXTURES / name / "index.json").read_bytes()


def test_pickle_is_refused_unless_allowed(tmp_path):
    with pytest.raises(StreamingError, match="'obj'.*allow_unsafe_types"):
        MDSWriter(tmp_path / "a", {"obj": "pkl"})
    with MDSWriter(tmp_path / "b", {"obj": "pkl"}, allow_unsafe_types=True) as w:
        w.write({"obj": {"a": (1, 2)}})
    assert list(read_shard_samples(tmp_path / "b")) == [{"obj": {"a": (1, 2)}}]


def test_flipped_byte_names_shard_and_stream(golden):
    root = golden("snappy")
    shard = root / "shard.00003.mds.snappy"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardCorruptError, match=r"shard .*shard\.00003\.mds\.snappy.*sha256"):
        list(read_shard_samples(root))


def test_truncated_shard_is_detected(golden):
    root = golden("plain")
    shard = root / "shard.00002.mds"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ShardCorruptError, match=r"shard\.00002\.mds.*truncated"):
        list(read_shard_samples(root, validate_hash=False))


def test_index_is_written_last_and_atomically(tmp_path):
    out = tmp_path / "ds"
    writer = MDSWriter(out, {"id": "int"}, size_limit=64)
    for i in range(20):
        writer.write({"id": i})
    assert not (out / "index.json").exists()  # an interrupted writer leaves no index: not a dataset
    writer.finish()
    assert [s["id"] for s in read_shard_samples(out)] == list(range(20))
    assert not list(out.glob("*.tmp"))


def test_oversized_first_sample_gives_empty_first_shard(tmp_path):
    with MDSWriter(tmp_path / "ds", {"blob": "bytes"}, size_limit=100) as writer:
        writer.write({"blob": b"x" * 500})
    entries = load_index(tmp_path / "ds" / "index.json")
    assert [e["samples"] for e in entries] == [0, 1]


def test_merge_index_keeps_subdirectory_basenames(tmp_path):
    from smalti.streaming import merge_index

    for part in ("p0", "p1"):
        with MDSWriter(tmp_path / part, {"id": "int"}) as writer:
            for i in range(3):
                writer.write({"id": i + (10 if part == "p1" else 0)})
    merge_index(tmp_path)
    entries = load_index(tmp_path / "index.json")
    assert [e["raw_data"]["basename"] for e in entries] == ["p0/shard.00000.mds", "p1/shard.00000.mds"]
    assert [s["id"] for s in read_shard_samples(tmp_path)] == [0, 1, 2, 10, 11, 12]
