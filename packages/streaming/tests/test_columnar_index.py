"""index.npz, the columnar copy of index.json: equal to it, written atomically, read only while it matches."""

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from smalti.streaming import MDSWriter, StreamingDataset, StreamingError, UnsafePathError
from smalti.streaming import mds as mds_module
from smalti.streaming.cli import main as cli
from smalti.streaming.mds import load_index, merge_index, read_index
from smalti.streaming.shard_table import INDEX_NPZ, ShardTable, json_digest

FIXTURES = Path(__file__).parent / "fixtures"
KINDS = sorted(p.name for p in FIXTURES.iterdir() if (p / "index.json").exists())


@pytest.fixture(autouse=True)
def columns_at_any_size(monkeypatch):
    """These small indexes are read through index.npz as a million-shard one is."""
    monkeypatch.setattr(mds_module, "COLUMNAR_MIN_BYTES", 0)


def no_json(monkeypatch):
    """Make parsing index.json fail, so a read that succeeds came from index.npz."""
    def refuse(path):
        raise AssertionError(f"parsed {path}")

    monkeypatch.setattr(mds_module, "_parse_index", refuse)


def ids(ds):
    return [int(s["id"]) for s in ds]


@pytest.mark.parametrize("kind", KINDS)
def test_fixture_round_trip(kind, tmp_path, monkeypatch):
    """Every fixture written by mosaicml-streaming: `smalti-streaming index` writes index.npz, whose entries
    equal index.json's (which it leaves byte for byte as it was)."""
    root = shutil.copytree(FIXTURES / kind, tmp_path / kind)
    before = (root / "index.json").read_bytes()
    assert not (root / INDEX_NPZ).exists()
    assert cli(["index", str(root)]) == 0
    assert (root / "index.json").read_bytes() == before
    expected = load_index(root / "index.json")
    no_json(monkeypatch)
    table = read_index(root / "index.json")
    assert isinstance(table, ShardTable)
    assert list(table) == expected and [table[i] for i in range(len(table))] == expected
    assert table.samples.tolist() == [e["samples"] for e in expected]


def test_writer_and_dataset_use_the_columnar_index(tmp_path, make_dataset, monkeypatch, caplog):
    root = make_dataset(tmp_path / "data", n=300, size_limit=400)
    assert (root / INDEX_NPZ).exists()
    want = ids(StreamingDataset(local=str(root), batch_size=8, shuffle=True))
    no_json(monkeypatch)
    with caplog.at_level(logging.INFO, logger="smalti.streaming"):
        ds = StreamingDataset(local=str(root), batch_size=8, shuffle=True)
    assert isinstance(ds._shards.tables[0], ShardTable)
    assert ids(ds) == want and set(want) == set(range(300))
    assert "parsing" not in caplog.text


def test_merge_index_writes_a_matching_columnar_index(tmp_path, make_dataset, monkeypatch):
    for part in ("a", "b"):
        make_dataset(tmp_path / "root" / part, n=50, size_limit=300)
    merge_index(tmp_path / "root")
    expected = load_index(tmp_path / "root" / "index.json")
    no_json(monkeypatch)
    assert list(read_index(tmp_path / "root" / "index.json")) == expected
    assert expected[-1]["raw_data"]["basename"].startswith("b/")


def test_stale_columnar_index_is_ignored(tmp_path, make_dataset, caplog):
    """index.json changed (same size: one hash digit) after index.npz was written: the JSON's entries are read."""
    root = make_dataset(tmp_path / "data", n=100, size_limit=400)
    index = json.loads((root / "index.json").read_text())
    old = index["shards"][1]["raw_data"]["hashes"]["xxh64"]
    new = old[:-1] + ("0" if old[-1] != "0" else "1")
    index["shards"][1]["raw_data"]["hashes"]["xxh64"] = new
    data = json.dumps(index, sort_keys=True).encode()
    assert len(data) == (root / "index.json").stat().st_size
    (root / "index.json").write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="smalti.streaming"):
        got = read_index(root / "index.json")
    assert got[1]["raw_data"]["hashes"]["xxh64"] == new
    assert "stale" in caplog.text and INDEX_NPZ in caplog.text


@pytest.mark.parametrize("damage", ["truncated", "flipped", "garbage"])
def test_corrupt_columnar_index_is_ignored_with_a_warning(damage, tmp_path, make_dataset, caplog):
    root = make_dataset(tmp_path / "data", n=100, size_limit=400)
    npz = root / INDEX_NPZ
    data = bytearray(npz.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "flipped":  # a byte of the samples column's data: the zip member's CRC catches it
        with np.load(npz) as arrays:
            needle = arrays["samples"].tobytes()
        at = bytes(data).index(needle)
        data[at] ^= 0x10
    else:
        data = bytearray(b"not a zip at all")
    npz.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="smalti.streaming"):
        got = read_index(root / "index.json")
    assert list(got) == load_index(root / "index.json")
    assert str(npz) in caplog.text and "ignored" in caplog.text


def test_half_written_columnar_index_is_never_visible(tmp_path, make_dataset, monkeypatch):
    """A writer killed while writing index.npz leaves no index.npz (nor a temp file a reader would take)."""
    root = make_dataset(tmp_path / "data", n=100, size_limit=400)
    (root / INDEX_NPZ).unlink()
    real = np.savez

    def dies_half_way(f, **arrays):
        real(f, **arrays)
        f.truncate(f.tell() // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        cli(["index", str(root)])
    assert sorted(p.name for p in root.iterdir() if "index" in p.name) == ["index.json"]


def _forge(root, **change):
    """Rewrite root's index.npz with some columns changed but still recording index.json's hash."""
    table = read_index(root / "index.json")
    for key, value in change.items():
        table._columns[key] = value
    data = (root / "index.json").read_bytes()
    table.save(root / INDEX_NPZ, len(data), json_digest(data))


def test_hostile_columnar_index_is_refused_naming_it(tmp_path, make_dataset):
    """An index.npz that matches index.json's hash but lies (written by hand) gets the checks index.json gets."""
    root = make_dataset(tmp_path / "data", n=100, size_limit=400)
    table = read_index(root / "index.json")
    blob = bytearray(table._columns["raw_names"].tobytes())
    blob[: len("shard.00000.mds")] = b"../../etc/pass"[: len("shard.00000.mds")].ljust(len("shard.00000.mds"), b"x")
    _forge(root, raw_names=np.frombuffer(bytes(blob), dtype=np.uint8))
    with pytest.raises(UnsafePathError, match=rf"{INDEX_NPZ}: shard 0 raw_data.basename"):
        read_index(root / "index.json")
    root = make_dataset(tmp_path / "data2", n=100, size_limit=400)
    samples = read_index(root / "index.json").samples.copy()
    samples[3] = 10**9
    _forge(root, samples=samples)
    with pytest.raises(StreamingError, match=rf"{INDEX_NPZ}: shard 3 declares 1000000000 samples"):
        StreamingDataset(local=str(root), batch_size=8)


def test_entries_without_an_exact_columnar_form_stay_json(tmp_path, make_dataset, caplog):
    """An entry with an extra key in raw_data (another tool's) gets no index.npz; readers parse the JSON."""
    root = make_dataset(tmp_path / "data", n=50, size_limit=400)
    index = json.loads((root / "index.json").read_text())
    index["shards"][0]["raw_data"]["note"] = "x"
    (root / "index.json").write_text(json.dumps(index))
    with caplog.at_level(logging.INFO, logger="smalti.streaming"):
        assert cli(["index", str(root)]) == 1
    assert not (root / INDEX_NPZ).exists()
    assert read_index(root / "index.json") == index["shards"]


def test_remote_columnar_index_and_its_absence(tmp_path, make_dataset, upload_dataset, caplog):
    root = make_dataset(tmp_path / "data", n=200, size_limit=400)
    want = ids(StreamingDataset(local=str(root), batch_size=8, shuffle=True))
    with_npz = upload_dataset(root, "with")
    (root / INDEX_NPZ).unlink()
    without = upload_dataset(root, "without")
    with caplog.at_level(logging.INFO, logger="smalti.streaming"):
        ds = StreamingDataset(remote=with_npz, local=str(tmp_path / "c1"), batch_size=8, shuffle=True)
    assert isinstance(ds._shards.tables[0], ShardTable) and "parsing" not in caplog.text
    assert ids(ds) == want
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="smalti.streaming"):
        ds = StreamingDataset(remote=without, local=str(tmp_path / "c2"), batch_size=8, shuffle=True)
    assert "no columnar index" in caplog.text
    assert ids(ds) == want


def test_remote_writer_uploads_the_columnar_index(tmp_path, s3_server, s3_bucket):
    out = f"s3://{s3_bucket}/written"
    with MDSWriter(out, {"id": "int"}, hashes=["xxh64"], size_limit=200) as writer:
        for i in range(60):
            writer.write({"id": i})
    client = s3_server.client()
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="written/")["Contents"]}
    assert {"written/index.json", f"written/{INDEX_NPZ}"} <= keys
    ds = StreamingDataset(remote=out, local=str(tmp_path / "cache"), batch_size=4)
    assert isinstance(ds._shards.tables[0], ShardTable)
    assert sorted(ids(ds)) == list(range(60))


def test_columnar_size_check_agrees_with_the_entry_check():
    """ShardTable.declared_sizes_ok and check_declared_sizes give one verdict per shard, over sizes at and past
    every bound (32-bit raw sizes, size_limit, samples that cannot fit, zip ratios, bad column_sizes)."""
    from itertools import product

    from smalti.streaming.declared_sizes import MAX_SHARD_BYTES, check_declared_sizes, declared_sizes_ok

    entries, expected = [], []
    for samples, raw, packed, column_sizes, limit in product(
            (0, 1, 2, 70, 10**6, 2**40), (0, 8, 300, 2000, 3000, (1 << 20) + 1, MAX_SHARD_BYTES, 2**50),
            (None, 0, 1, 2**11, MAX_SHARD_BYTES + 1), ([4, None], [], [2**40], ["x"]), (None, 0, 2000)):
        entry = {"format": "mds", "version": 2, "column_sizes": column_sizes, "size_limit": limit,
                 "samples": samples, "raw_data": {"basename": f"s{len(entries)}.mds", "bytes": raw, "hashes": {}},
                 "zip_data": None if packed is None else {"basename": f"s{len(entries)}.mds.zstd", "bytes": packed,
                                                          "hashes": {}}}
        try:
            check_declared_sizes(entry, "index.json", len(entries))
            expected.append(True)
        except StreamingError:
            expected.append(False)
        entries.append(entry)
    assert 0 < sum(expected) < len(expected)
    table = ShardTable.from_entries(entries, "index.json")
    assert len(table.configs) > 1
    assert table.declared_sizes_ok().tolist() == expected
    # hostile columns (an index.npz written by hand) may hold what no JSON entry passes through from_entries
    samples = np.array([-1, 2**62, 3, 3])
    raw = np.array([100, 100, -5, 2**62])
    assert not declared_sizes_ok(samples, raw, np.array([1, 1, 1, 2**62]), [4], None).any()
