"""ReadAhead and its reader: tensors copied straight from the read buffers, each checked file hashed once, in order."""

import os

import pytest

from smalti.checkpoint import CheckpointCorruptError
from smalti.checkpoint.bounce_read import ReadPipeline
from smalti.checkpoint.hashes import ALGORITHMS, new_hasher
from smalti.checkpoint.read_ahead import AheadFile, ReadAhead

CHUNK = 8192


def write(folder, name, size, seed=0, algorithm="xxh3_128"):
    data = os.urandom(size) if seed is None else bytes((i * 131 + seed) % 251 for i in range(size))
    (folder / name).write_bytes(data)
    digest = new_hasher(algorithm)
    digest.update(data)
    return data, AheadFile(name, size, f"{algorithm}:{digest.hexdigest()}")


def read_pieces(ahead, relpath, data, pieces):
    """What the reader does: it takes the bytes of its tensors from the file's stream (the digest is fed every
    byte the stream goes through, gaps included); they are the file's."""
    stream = ahead.stream(relpath)
    for start, end in pieces:
        out = bytearray(end - start)
        assert stream.read_into(start, memoryview(out)) == end - start
        assert bytes(out) == data[start:end]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_byte_is_hashed_once_whether_fed_by_the_reader_or_read_back(tmp_path, algorithm):
    a, file_a = write(tmp_path, "__0_0.distcp", 100_000, seed=1, algorithm=algorithm)
    _, file_b = write(tmp_path, "__0_1.distcp", 20_001, seed=2, algorithm=algorithm)
    ahead = ReadAhead(tmp_path, [file_a, file_b], window_bytes=4 * CHUNK)
    ahead.pipeline.close()  # reads in pieces of 8 KiB, two at a time
    ahead.pipeline = ReadPipeline(buffers=4, chunk_bytes=CHUNK)
    ahead._streams = {
        rel: ahead.pipeline.open(tmp_path / rel, [(0, ahead.files[rel].size + 1)], ahead.check(rel).feed)
        for rel in ahead.order
    }
    hashed = []
    real_update = type(ahead.check("__0_0.distcp").digest).update
    check = ahead.check("__0_0.distcp")

    class Counting:
        def update(self, view):
            hashed.append(len(view))
            real_update(digest, view)

        def hexdigest(self):
            return digest.hexdigest()

    digest, check.digest = check.digest, Counting()
    # pieces with gaps (headers the reader does not load), one asked for again (read from the file once more)
    read_pieces(ahead, "__0_0.distcp", a, [(10, 8192), (9000, 30_000), (20_000, 25_000), (60_000, 100_000)])
    ahead.finish(timeout=30)  # __0_1 is read whole, __0_0's tail checked
    assert sum(hashed) == 100_000  # nothing hashed twice, nothing left out


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_flipped_byte_is_reported_with_its_file_fed_or_read_back(tmp_path, algorithm):
    good_data, good = write(tmp_path, "__0_0.distcp", 30_000, seed=3, algorithm=algorithm)
    data, bad = write(tmp_path, "__1_0.distcp", 30_000, seed=4, algorithm=algorithm)
    flipped = bytearray(data)
    flipped[12_345] ^= 1
    (tmp_path / "__1_0.distcp").write_bytes(bytes(flipped))
    for fed in (False, True):
        ahead = ReadAhead(tmp_path, [good, bad])
        if fed:  # the reader took the bytes of its tensors (the flipped one among them)
            read_pieces(ahead, "__0_0.distcp", good_data, [(0, 30_000)])
            ahead.stream("__0_0.distcp").drain()
            read_pieces(ahead, "__1_0.distcp", bytes(flipped), [(100, 20_000)])
        with pytest.raises(
            CheckpointCorruptError, match=f"has {algorithm} .* but the manifest says"
        ) as caught:
            ahead.finish(timeout=30)
        assert caught.value.path == str(tmp_path / "__1_0.distcp")


def test_a_file_without_an_expected_hash_is_only_measured(tmp_path):
    data, file = write(tmp_path, "__0_0.distcp", 10_000, seed=5)
    (tmp_path / "__0_0.distcp").write_bytes(bytes(b ^ 0xFF for b in data))
    ReadAhead(tmp_path, [AheadFile(file.relpath, file.size, None)]).finish(timeout=30)
    ahead = ReadAhead(tmp_path, [AheadFile(file.relpath, file.size + 1, None)])
    with pytest.raises(CheckpointCorruptError, match="10000 bytes but the manifest says 10001"):
        ahead.finish(timeout=30)


@pytest.mark.parametrize("extra", [-30_000, 7])
def test_a_truncated_or_longer_file_fails_the_check(tmp_path, extra):
    data, file = write(tmp_path, "__0_0.distcp", 50_000, seed=6)
    (tmp_path / "__0_0.distcp").write_bytes(data[: 50_000 + extra] if extra < 0 else data + b"x" * extra)
    with pytest.raises(CheckpointCorruptError, match="bytes but the manifest says 50000"):
        ReadAhead(tmp_path, [file]).finish(timeout=30)


def test_a_missing_file_is_an_error_naming_it(tmp_path):
    ahead = ReadAhead(tmp_path, [AheadFile("__0_0.distcp", 10, None)])
    with pytest.raises(Exception, match="__0_0.distcp"):
        ahead.finish(timeout=30)


@pytest.mark.parametrize(
    "read_ahead",
    ["this-rank", "another-rank", None],
    ids=["checked-here", "files-another-rank-checks", "no-check"],
)
def test_dcp_loads_copying_contiguous_tensors_in_place_and_others_as_dcp_does(
    tmp_path, monkeypatch, read_ahead
):
    """Straight from the file, whether this rank checks the file's digest or another rank does (e.g. a DDP
    replica's) or nobody: no ``torch.load`` of a tensor whose layout allows reading it in place."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from smalti.checkpoint.bounce_read import FileStream
    from smalti.checkpoint.read_ahead import ReadAheadFileSystemReader

    torch.manual_seed(0)
    base = torch.randn(300, 200)
    saved = {
        "big": torch.randn(3_000_000),  # spans several 1 MiB chunks
        "view_of_part": base[10:20],  # a view: torch.save keeps the whole storage and an offset
        "transposed": base.t(),  # not contiguous: torch.load reads it
        "half": torch.randn(64, 3).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "into_a_view": torch.randn(8, 8),
        "blob": {"a": [1, 2]},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, storage_writer=FileSystemWriter(str(tmp_path)), no_dist=True)
    holder = torch.zeros(8, 16)
    targets = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"a": [0, 0]} for k, v in saved.items()
    }
    targets["transposed"] = torch.zeros(200, 300)
    targets["into_a_view"] = holder[:, ::2]  # a target that is not contiguous
    in_place = []
    real = ReadAheadFileSystemReader._copy_in_place
    monkeypatch.setattr(
        ReadAheadFileSystemReader,
        "_copy_in_place",
        staticmethod(
            lambda item, span, planner: (
                in_place.append((item.dest_index.fqn, real(item, span, planner))) or in_place[-1][1]
            )
        ),
    )
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    files = [AheadFile(p.name, p.stat().st_size) for p in sorted(tmp_path.glob("*.distcp"))]
    if read_ahead == "this-rank":  # the digest this rank checks while it loads
        digest = new_hasher("xxh3_128")
        digest.update((tmp_path / files[0].relpath).read_bytes())
        files[0].hash = f"xxh3_128:{digest.hexdigest()}"
    ahead = None if read_ahead is None else ReadAhead(tmp_path, files if read_ahead == "this-rank" else [])
    read_back = []  # bytes read from the file a second time (asked for after the stream had let go of them)
    real_pread = FileStream._pread
    monkeypatch.setattr(
        FileStream, "_pread", lambda s, at, view: read_back.append(len(view)) or real_pread(s, at, view)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(targets, storage_reader=ReadAheadFileSystemReader(tmp_path, ahead), no_dist=True)
    if read_ahead == "this-rank":  # every byte hashed before DCP handed the tensors on
        assert ahead.check(files[0].relpath).hashed_to == files[0].size
    if ahead is not None:
        ahead.finish(timeout=30)
    assert sum(read_back) == 0 and files[0].size > 12_000_000  # each byte read once, front to back
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(targets[key], value), key
        else:
            assert targets[key] == value
    assert torch.equal(holder[:, ::2], saved["into_a_view"])
    # the transposed tensor and the strided target fall back to torch.load; DCP reads nothing for the empty one
    assert dict(in_place) == {
        "big": True,
        "view_of_part": True,
        "transposed": False,
        "half": True,
        "scalar": True,
        "into_a_view": False,
    }
    assert len(loads) == 3  # the two tensors not copied in place, and the blob (a pickle)


@pytest.mark.parametrize("head_bytes", [None, 100], ids=["from-the-start", "head-too-short"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct-io", "buffered"])
def test_tensors_are_located_from_the_items_start_or_else_by_the_zip_directory(
    tmp_path, monkeypatch, direct, head_bytes
):
    """Each item's tensor record is found by walking its archive from the start (so the file is read front to
    back, never the zip directory at an item's end before its data); where that walk cannot finish (here: a
    head too short to hold the pickle) the directory is read, with the same result."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from smalti.checkpoint import read_ahead as module
    from smalti.checkpoint.read_ahead import ReadAheadFileSystemReader
    from smalti.checkpoint.writer import HashingFileSystemWriter

    torch.manual_seed(0)
    base = torch.randn(300, 200)
    saved = {
        "big": torch.randn(3_000_000),
        "view_of_part": base[10:20],
        "half": torch.randn(64, 3).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "n": 4,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, storage_writer=HashingFileSystemWriter(tmp_path, direct_io=direct), no_dist=True)
    if head_bytes is not None:
        monkeypatch.setattr(module, "HEAD_BYTES", head_bytes)
    by_directory = []
    real = module._locate_by_directory
    monkeypatch.setattr(module, "_locate_by_directory", lambda span: by_directory.append(1) or real(span))
    targets = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in saved.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(targets, storage_reader=ReadAheadFileSystemReader(tmp_path, None), no_dist=True)
    assert all(torch.equal(targets[k], v) for k, v in saved.items() if k != "n") and targets["n"] == 4
    assert len(by_directory) == (0 if head_bytes is None else 4)
