"""MDS compatibility with mosaicml-streaming 0.13.0's golden files, and clear errors on bad shards."""

import decimal
import gzip
import json
import shutil
import struct
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
    """With single-frame zstd shards (``zstd_frame_size=None``), every file is mosaicml-streaming's, byte for
    byte (the default, seekable zstd shards hold the same raw bytes: test_seekable.py)."""
    src = golden(name)
    entries = load_index(src / "index.json")
    compression, hashes = SETTINGS[name]
    out = tmp_path / "out"
    with MDSWriter(out, dict(zip(entries[0]["column_names"], entries[0]["column_encodings"])),
                   compression=compression, hashes=hashes, size_limit=entries[0]["size_limit"],
                   zstd_frame_size=None) as writer:
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
    assert list(read_shard_samples(tmp_path / "b", allow_unsafe_types=True)) == [{"obj": {"a": (1, 2)}}]


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


def test_image_encodings_round_trip_in_mosaic_layout(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    from smalti.streaming.encodings import encode

    pixels = np.arange(5 * 3 * 3, dtype=np.uint8).reshape(3, 5, 3) * 5
    img = Image.fromarray(pixels, "RGB")
    img.save(tmp_path / "photo.jpg", quality=90)
    photo = Image.open(tmp_path / "photo.jpg")
    jpeg_bytes = (tmp_path / "photo.jpg").read_bytes()
    columns = {"p": "pil", "j": "jpeg", "n": "png", "lp": "list[pil]", "lj": "list[jpeg]", "ln": "list[png]",
               "ja": "jpeg_array"}
    with MDSWriter(tmp_path / "img", columns) as writer:
        writer.write({"p": img, "j": photo, "n": img, "lp": [img, img], "lj": [photo], "ln": [img, img, img],
                      "ja": [jpeg_bytes, jpeg_bytes]})
    (sample,) = read_shard_samples(tmp_path / "img")
    for key in ("p", "n"):
        assert np.array_equal(np.asarray(sample[key]), pixels)
    assert [np.array_equal(np.asarray(i), pixels) for i in sample["lp"] + sample["ln"]] == [True] * 5
    assert np.array_equal(np.asarray(sample["j"]), np.asarray(photo))  # the file's own bytes, not re-encoded
    assert [i.size for i in sample["lj"] + sample["ja"]] == [(5, 3)] * 3
    assert encode("pil", img)[:15] == struct.pack("<III", 5, 3, 3) + b"RGB"
    assert encode("jpeg", photo) == jpeg_bytes
    assert encode("list[png]", [img, img])[:8] == struct.pack("<II", 0, 2)
    assert encode("jpeg_array", [jpeg_bytes]) == struct.pack("<II", 1, len(jpeg_bytes)) + jpeg_bytes


def test_bad_writer_arguments_name_the_value(tmp_path):
    with pytest.raises(StreamingError, match="level 30 is not valid for zstd"):
        MDSWriter(tmp_path / "a", {"x": "int"}, compression="zstd:30")
    with pytest.raises(StreamingError, match="'lz4'"):
        MDSWriter(tmp_path / "b", {"x": "int"}, compression="lz4")
    with pytest.raises(StreamingError, match="unique and sorted"):
        MDSWriter(tmp_path / "c", {"x": "int"}, hashes=["sha1", "md5"])
    with pytest.raises(StreamingError, match="'nope' is not supported"):
        MDSWriter(tmp_path / "d", {"x": "int"}, hashes=["nope"])
    with pytest.raises(StreamingError, match="unknown encoding 'float128'"):
        MDSWriter(tmp_path / "e", {"x": "float128"})
    with MDSWriter(tmp_path / "f", {"x": "ndarray:uint16:4"}) as writer:
        with pytest.raises(StreamingError, match="dtype int64 given"):
            writer.write({"x": np.arange(4)})
        with pytest.raises(StreamingError, match="missing column 'x'"):
            writer.write({"y": 1})
        writer.write({"x": [1, 2, 3, 4]})
    assert read_shard_samples(tmp_path / "f").__next__()["x"].tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("compression", ["zstd:1", "zstd:19", "gz:1", "bz2:1", "br:0", "br:5", "snappy"])
def test_compression_levels_round_trip(tmp_path, compression):
    with MDSWriter(tmp_path / "ds", {"t": "str"}, compression=compression, hashes=["xxh128"], size_limit=300) as w:
        for i in range(40):
            w.write({"t": f"row {i} " * 5})
    entries = load_index(tmp_path / "ds" / "index.json")
    assert len(entries) > 1 and all(e["compression"] == compression for e in entries)
    assert [s["t"] for s in read_shard_samples(tmp_path / "ds")] == [f"row {i} " * 5 for i in range(40)]
