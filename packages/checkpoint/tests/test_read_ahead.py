"""ReadAhead: the background reader a load takes its bytes from, hashing each file once on the way in."""

import os
import time

import pytest

from smalti.checkpoint import CheckpointCorruptError
from smalti.checkpoint.hashes import ALGORITHMS, new_hasher
from smalti.checkpoint.read_ahead import AheadFile, ReadAhead

CHUNK = 8192


def write(folder, name, size, seed=0, algorithm="xxh3_128"):
    data = os.urandom(size) if seed is None else bytes((i * 131 + seed) % 251 for i in range(size))
    (folder / name).write_bytes(data)
    digest = new_hasher(algorithm)
    digest.update(data)
    return data, AheadFile(name, size, f"{algorithm}:{digest.hexdigest()}")


@pytest.mark.parametrize("direct", [True, False])
def test_spans_give_back_the_bytes_of_each_file_across_chunks_and_every_hash_is_checked(tmp_path, direct):
    a, file_a = write(tmp_path, "__0_0.distcp", 100_000, seed=1)
    b, file_b = write(tmp_path, "__0_1.distcp", 20_001, seed=2)
    ahead = ReadAhead(tmp_path, [file_a, file_b], window_bytes=4 * CHUNK, direct=direct, chunk_bytes=CHUNK)
    for start, end in [(0, 10), (10, 8192), (9000, 30_000), (30_000, 30_000), (60_000, 100_000)]:
        span = ahead.span("__0_0.distcp", start, end)
        assert span.read() == a[start:end]
        span.seek(3)
        assert span.read(5) == a[start + 3 : start + 8][: max(0, end - start - 3)]
        ahead.release_before("__0_0.distcp", end)
    ahead.done_with("__0_0.distcp")
    assert ahead.span("__0_1.distcp", 19_000, 20_001).read() == b[19_000:]
    ahead.finish(timeout=30)


def test_the_reader_stays_within_its_window_until_the_loader_takes_bytes(tmp_path):
    data, file = write(tmp_path, "big.distcp", 40 * CHUNK, seed=None)
    ahead = ReadAhead(tmp_path, [file], window_bytes=3 * CHUNK, chunk_bytes=CHUNK)
    time.sleep(0.3)
    assert ahead.bytes_read("big.distcp") == 3 * CHUNK  # it stopped at the window
    # one item larger than the window: the reader goes past the window for the bytes the loader waits for
    assert ahead.span("big.distcp", 5, 30 * CHUNK + 7).read() == data[5 : 30 * CHUNK + 7]
    ahead.finish(timeout=30)
    assert ahead.bytes_read("big.distcp") == 40 * CHUNK


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_flipped_byte_is_reported_with_its_file_even_when_the_loader_needed_none_of_it(tmp_path, algorithm):
    _, good = write(tmp_path, "__0_0.distcp", 30_000, seed=3, algorithm=algorithm)
    data, bad = write(tmp_path, "__1_0.distcp", 30_000, seed=4, algorithm=algorithm)
    flipped = bytearray(data)
    flipped[12_345] ^= 1
    (tmp_path / "__1_0.distcp").write_bytes(bytes(flipped))
    ahead = ReadAhead(tmp_path, [good, bad], chunk_bytes=CHUNK)
    ahead.done_with("__1_0.distcp")
    with pytest.raises(CheckpointCorruptError, match=f"has {algorithm} .* but the manifest says") as caught:
        ahead.finish(timeout=30)
    assert caught.value.path == str(tmp_path / "__1_0.distcp")


def test_a_file_without_an_expected_hash_is_read_but_not_judged(tmp_path):
    data, file = write(tmp_path, "__0_0.distcp", 10_000, seed=5)
    (tmp_path / "__0_0.distcp").write_bytes(bytes(b ^ 0xFF for b in data))
    ahead = ReadAhead(tmp_path, [AheadFile(file.relpath, file.size, None)], chunk_bytes=CHUNK)
    assert ahead.span("__0_0.distcp", 0, 4).read() == bytes(b ^ 0xFF for b in data[:4])
    ahead.finish(timeout=30)


def test_a_truncated_file_fails_the_span_past_its_end_and_the_check(tmp_path):
    data, file = write(tmp_path, "__0_0.distcp", 50_000, seed=6)
    (tmp_path / "__0_0.distcp").write_bytes(data[:20_000])
    ahead = ReadAhead(tmp_path, [file], chunk_bytes=CHUNK)
    assert ahead.span("__0_0.distcp", 0, 20_000).read() == data[:20_000]
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        ahead.span("__0_0.distcp", 19_000, 21_000)
    with pytest.raises(CheckpointCorruptError, match="20000 bytes but the manifest says 50000"):
        ahead.finish(timeout=30)


def test_a_missing_file_is_an_error_naming_it(tmp_path):
    ahead = ReadAhead(tmp_path, [AheadFile("__0_0.distcp", 10, None)], chunk_bytes=CHUNK)
    with pytest.raises(Exception, match="__0_0.distcp"):
        ahead.span("__0_0.distcp", 0, 10)
    with pytest.raises(Exception, match="__0_0.distcp"):
        ahead.finish(timeout=30)


@pytest.mark.parametrize("read_ahead", ["this-rank", "another-rank", None],
                         ids=["read-ahead", "files-another-rank-reads-ahead", "no-read-ahead"])
def test_dcp_loads_copying_contiguous_tensors_in_place_and_others_as_dcp_does(tmp_path, monkeypatch, read_ahead):
    """Through the read-ahead's buffers, and (for files another rank reads ahead and checks, e.g. a DDP
    replica's, or with no read-ahead at all) straight from the file: either way no ``torch.load`` of a tensor
    whose layout allows a copy."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

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
    targets = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"a": [0, 0]} for k, v in saved.items()}
    targets["transposed"] = torch.zeros(200, 300)
    targets["into_a_view"] = holder[:, ::2]  # a target that is not contiguous
    in_place = []
    real = ReadAheadFileSystemReader._copy_in_place
    monkeypatch.setattr(ReadAheadFileSystemReader, "_copy_in_place",
                        staticmethod(lambda item, span, planner: in_place.append((item.dest_index.fqn, real(item, span, planner))) or in_place[-1][1]))
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    files = [AheadFile(p.name, p.stat().st_size) for p in sorted(tmp_path.glob("*.distcp"))]
    ahead = None if read_ahead is None else ReadAhead(tmp_path, files if read_ahead == "this-rank" else [],
                                                        chunk_bytes=1 << 20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(targets, storage_reader=ReadAheadFileSystemReader(tmp_path, ahead), no_dist=True)
    if ahead is not None:
        ahead.finish(timeout=30)
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(targets[key], value), key
        else:
            assert targets[key] == value
    assert torch.equal(holder[:, ::2], saved["into_a_view"])
    # the transposed tensor and the strided target fall back to torch.load; DCP reads nothing for the empty one
    assert dict(in_place) == {"big": True, "view_of_part": True, "transposed": False, "half": True, "scalar": True,
                              "into_a_view": False}
    assert len(loads) == 3  # the two tensors not copied in place, and the blob (a pickle)
