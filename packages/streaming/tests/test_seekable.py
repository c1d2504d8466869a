"""Seekable zstd shards: several frames and a seek table, readable by any zstd decoder, and the first batch
read from the few frames it needs."""

import json
import struct
import threading

import numpy as np
import pytest
import zstandard
from torch.utils.data import DataLoader

from smalti.streaming import MDSWriter, ShardCorruptError, StreamingDataLoader, StreamingDataset, load_index
from smalti.streaming import dataset as dataset_module
from smalti.streaming.cache import ShardCache
from smalti.streaming.hashing import digest
from smalti.streaming.partial import PartialShardReader, read_rows
from smalti.streaming.seekable import SEEKABLE_MAGIC, SKIPPABLE_MAGIC, read_seek_table

COLUMNS = {"id": "int", "tokens": "ndarray:uint16:256"}


def write(path, compression="zstd", frame="2kb", n=400, size_limit="40kb"):
    """Samples of 520 bytes: shards of ~78 samples, frames of ~4 samples."""
    rng = np.random.default_rng(0)
    with MDSWriter(path, COLUMNS, compression=compression, hashes=["sha1", "xxh64"], size_limit=size_limit,
                   zstd_frame_size=frame) as writer:
        for i in range(n):
            writer.write({"id": i, "tokens": rng.integers(0, 700, 256, dtype=np.uint16)})  # compressible
    return path


def raw_shards(path):
    """The raw shards of the same samples, from single-frame zstd shards (mosaicml-streaming's layout)."""
    one = write(path.parent / f"{path.name}-one-frame", frame=None)
    return {e["raw_data"]["basename"]: zstandard.ZstdDecompressor().decompress(
        (one / e["zip_data"]["basename"]).read_bytes()) for e in load_index(one / "index.json")}


def test_multi_frame_shards_decode_with_python_zstd_as_mosaicml_streaming_does(tmp_path):
    """mosaicml-streaming decodes zstd shards with ``zstd.decompress`` (the ``zstd`` package): a multi-frame
    shard with its seek table gives exactly the raw shard, and the index's hashes are the zip's."""
    zstd = pytest.importorskip("zstd")
    data = write(tmp_path / "d")
    raw = raw_shards(tmp_path / "d")
    entries = load_index(data / "index.json")
    assert len(entries) > 3
    for entry in entries:
        packed = (data / entry["zip_data"]["basename"]).read_bytes()
        table = read_seek_table(packed, entry["raw_data"]["bytes"])
        assert table is not None and len(table) > (1 if entry is entries[-1] else 15)  # frames of ~2 KiB
        assert zstd.decompress(packed) == raw[entry["raw_data"]["basename"]]
        assert entry["zip_data"]["bytes"] == len(packed)
        assert entry["zip_data"]["hashes"] == {h: digest(h, packed) for h in ("sha1", "xxh64")}
        assert entry["raw_data"]["hashes"]["sha1"] == digest("sha1", raw[entry["raw_data"]["basename"]])


def test_seek_table_follows_the_seekable_format_and_frames_hold_whole_samples(tmp_path):
    data = write(tmp_path / "d")
    entry = load_index(data / "index.json")[0]
    packed = (data / entry["zip_data"]["basename"]).read_bytes()
    frames, descriptor, magic = struct.unpack("<IBI", packed[-9:])
    assert (magic, descriptor) == (SEEKABLE_MAGIC, 0)
    table_size = 8 + 8 * frames + 9
    skip_magic, body = struct.unpack("<II", packed[-table_size : -table_size + 8])
    assert (skip_magic, body) == (SKIPPABLE_MAGIC, 8 * frames + 9)
    sizes = np.frombuffer(packed[-table_size + 8 : -9], dtype="<u4").reshape(frames, 2)
    assert sizes[:, 0].sum() == len(packed) - table_size and sizes[:, 1].sum() == entry["raw_data"]["bytes"]
    pos = 0
    for compressed, _ in sizes:  # every frame is an ordinary zstd frame on its own
        zstandard.ZstdDecompressor().decompress(packed[pos : pos + compressed])
        pos += compressed
    raw = raw_shards(tmp_path / "d")[entry["raw_data"]["basename"]]
    count = struct.unpack_from("<I", raw)[0]
    offsets = set(np.frombuffer(raw, np.uint32, count + 1, 4).tolist())
    starts = np.concatenate([[0], np.cumsum(sizes[:, 1])])
    assert set(starts[1:].tolist()) <= offsets  # frames end where samples start (or at the shard's end)
    assert starts[1] >= 4 + 4 * (count + 1)  # the first frame holds the header and the sample offsets


def test_single_frame_option_writes_mosaicml_streaming_layout(tmp_path):
    data = write(tmp_path / "d", frame=None)
    for entry in load_index(data / "index.json"):
        packed = (data / entry["zip_data"]["basename"]).read_bytes()
        assert read_seek_table(packed, entry["raw_data"]["bytes"]) is None
        assert read_rows(data / entry["zip_data"]["basename"], entry, [0]) is None  # read whole, as before
        one = zstandard.ZstdDecompressor().decompressobj()
        one.decompress(packed)
        assert one.eof and not one.unused_data  # one frame, nothing after it


def test_rows_read_from_the_frames_they_are_in(tmp_path):
    data = write(tmp_path / "d")
    entries = load_index(data / "index.json")
    entry, first_id = entries[1], entries[0]["samples"]
    raw = raw_shards(tmp_path / "d")[entry["raw_data"]["basename"]]
    rows = [3, 40, 41, 70]
    reader = read_rows(data / entry["zip_data"]["basename"], entry, rows)
    assert reader is not None
    assert reader.sparse.decompressed < len(raw) / 3  # the header's frame and three others, not the shard
    for row in rows:
        begin, end = struct.unpack_from("<2I", raw, 4 + 4 * row)
        assert reader.raw_sample(row) == raw[begin:end]
    assert [int(s["id"]) for s in reader.gather([41, 3])] == [first_id + 41, first_id + 3]
    assert int(reader[60]["id"]) == first_id + 60  # a row not asked for is loaded when read


def test_damaged_frame_is_refused_not_served(tmp_path):
    data = write(tmp_path / "d")
    entry = load_index(data / "index.json")[0]
    path = data / entry["zip_data"]["basename"]
    packed = bytearray(path.read_bytes())
    table = read_seek_table(bytes(packed), entry["raw_data"]["bytes"])
    middle = int(table.packed[3]) + 8  # inside frame 3
    packed[middle] ^= 0xFF
    path.write_bytes(packed)
    with pytest.raises(ShardCorruptError, match="sha1"):  # checked against the index first
        read_rows(path, entry, [20])
    frame = table.frames(*struct.unpack_from("<2I", raw_shards(tmp_path / "d")["shard.00000.mds"], 4 + 4 * 20))
    assert list(frame) == [5]  # sample 20 is elsewhere: without the check, frame 3's damage surfaces...
    reader = read_rows(path, entry, [20], validate_hash=False)
    with pytest.raises(ShardCorruptError, match="does not decompress"):
        reader.gather(list(range(entry["samples"])))  # ...when a row in it is read


def test_seek_table_that_does_not_add_up_is_ignored(tmp_path):
    data = write(tmp_path / "d")
    entries = load_index(data / "index.json")
    entry = entries[0]
    path = data / entry["zip_data"]["basename"]
    packed = bytearray(path.read_bytes())
    frames = struct.unpack("<I", packed[-9:-5])[0]
    struct.pack_into("<I", packed, len(packed) - 9 - 8 * frames + 4, 1)  # frame 0's raw size
    assert read_seek_table(bytes(packed), entry["raw_data"]["bytes"]) is None
    path.write_bytes(packed)
    entry["zip_data"]["hashes"] = {h: digest(h, bytes(packed)) for h in entry["zip_data"]["hashes"]}
    (data / "index.json").write_text(json.dumps({"shards": entries, "version": 2}))
    got = [int(s["id"]) for s in StreamingDataset(local=str(data), batch_size=8)]
    assert got == list(range(400))  # decompressed whole: every zstd decoder skips the table


@pytest.mark.parametrize("frame", ["2kb", None])
def test_loader_makes_the_first_batch_from_rows_read_ahead(tmp_path, monkeypatch, frame):
    """The warm-up reads the first batch's rows from the seekable zips; the loader makes that batch from
    them, and every batch equals a plain DataLoader's. Single-frame shards: made from whole shards."""
    data = write(tmp_path / "d", frame=frame, n=600)
    plain = list(DataLoader(StreamingDataset(local=str(data), batch_size=16, shuffle=True), batch_size=16))
    for raw in data.glob("shard.*.mds"):
        raw.unlink()  # back to zips only
    used, made = [], threading.Event()
    first_batch, ensure = dataset_module.StreamingDataset._first_batch, ShardCache.ensure

    def record(self, ids):
        used.append({shard: f.result() for shard, f in self._first_rows.items()})
        try:
            return first_batch(self, ids)
        finally:
            made.set()

    def ensure_after_first_batch(self, shard, *args, **kwargs):  # the warm-up's whole shards come later here
        if threading.current_thread().name.startswith("smalti-streaming-warm-up"):
            made.wait(30)
        return ensure(self, shard, *args, **kwargs)

    monkeypatch.setattr(dataset_module.StreamingDataset, "_first_batch", record)
    monkeypatch.setattr(ShardCache, "ensure", ensure_after_first_batch)
    partial_views, views = [], PartialShardReader.column_views

    def count_views(self):
        partial_views.append(self.entry["raw_data"]["basename"])
        return views(self)

    monkeypatch.setattr(PartialShardReader, "column_views", count_views)
    ds = StreamingDataset(local=str(data), batch_size=16, shuffle=True)
    got = list(StreamingDataLoader(ds, batch_size=16, num_workers=2))
    assert len(got) == len(plain) > 30
    for a, b in zip(got, plain, strict=True):
        assert a["id"].tolist() == b["id"].tolist() and np.array_equal(a["tokens"], b["tokens"])
    shards = {int(s) for s in np.unique(ds._locate(plain[0]["id"].numpy())[0])}
    assert len(used) == 1
    if frame:
        assert set(used[0]) == shards and all(r is not None for r in used[0].values())
        assert all(r.sparse.decompressed < r.entry["raw_data"]["bytes"] for r in used[0].values())
        assert len(partial_views) == len(shards)  # the first batch was made from them
    else:
        assert all(r is None for r in used[0].values()) and not partial_views
    assert sorted(p.name for p in data.glob("shard.*.mds")) == [f"shard.{i:05}.mds" for i in range(8)]


def test_first_batch_of_a_damaged_seekable_shard_raises_naming_it(tmp_path):
    data = write(tmp_path / "d", n=600)
    for raw in data.glob("shard.*.mds"):
        raw.unlink()
    probe = StreamingDataset(local=str(data), batch_size=16, shuffle=True, predownload=0)  # no warm-up
    shard = int(probe._locate(probe._remaining(0).rows(0, 1, 0, 1)[0])[0][0])
    path = data / f"shard.{shard:05}.mds.zstd"
    packed = bytearray(path.read_bytes())
    packed[len(packed) // 2] ^= 0xFF
    path.write_bytes(packed)
    with pytest.raises(ShardCorruptError, match=f"shard.{shard:05}.mds.zstd"):
        list(StreamingDataLoader(StreamingDataset(local=str(data), batch_size=16, shuffle=True), batch_size=16,
                                 num_workers=2))


def test_cli_and_write_parallel_pass_the_frame_size_on(tmp_path):
    from smalti.streaming import write_parallel
    from smalti.streaming.cli import main

    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i} " * 20, "n": i}) + "\n" for i in range(200)))

    def frames(data):
        return [len(t) if (t := read_seek_table((data / e["zip_data"]["basename"]).read_bytes(),
                                                e["raw_data"]["bytes"])) else 0
                for e in load_index(data / "index.json")]

    assert main(["convert", str(src), str(tmp_path / "a"), "--zstd-frame-size", "1kb"]) == 0
    assert main(["convert", str(src), str(tmp_path / "b")]) == 0
    assert main(["convert", str(src), str(tmp_path / "c"), "--zstd-frame-size", "none"]) == 0
    assert min(frames(tmp_path / "a")) > 10 and frames(tmp_path / "b") == [1] and frames(tmp_path / "c") == [0]
    out = write_parallel(_sample, range(100), tmp_path / "p", {"n": "int", "x": "bytes"}, num_workers=1,
                         compression="zstd", zstd_frame_size="2kb")
    assert min(frames(out)) > 5


def _sample(i):
    return {"n": i, "x": bytes(100)}
