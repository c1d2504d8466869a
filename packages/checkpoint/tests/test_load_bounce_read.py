"""The load's reads: O_DIRECT into reused huge-page buffers (bounce_read), the page cache where O_DIRECT is
refused, any ranges and read sizes, truncated files named, and no buffer kept after a failed load."""

import errno
import fcntl
import os
import random
import time
import warnings

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from smalti.checkpoint import bounce_read as module
from smalti.checkpoint.bounce_read import ReadPipeline
from smalti.checkpoint.hashes import new_hasher
from smalti.checkpoint.read_ahead import AheadFile, ReadAhead, ReadAheadFileSystemReader

CHUNK = 8192
pytestmark = pytest.mark.timeout(60)  # a lost buffer shows as a hang: fail instead


def write(path, size, seed):
    data = random.Random(seed).randbytes(size)
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("buffers,threads", [(2, 1), (4, 2), (3, 3)])
def test_any_ranges_and_reads_give_the_files_bytes_and_feed_each_byte_once(tmp_path, buffers, threads):
    """Unaligned ranges with gaps, a partial last block, reads of every size (some asked for again, some
    outside the ranges): the bytes are the file's; a whole-file stream feeds every byte once, in order."""
    size = 20 * CHUNK + 1234
    data = write(tmp_path / "f.bin", size, seed=buffers)
    rng = random.Random(threads)
    pipeline = ReadPipeline(buffers=buffers, chunk_bytes=CHUNK, io_threads=threads)
    try:
        for ranges in ([(0, size + 1)], [(100, 9000), (40_000, 41_000), (60_001, size)]):
            fed = []
            stream = pipeline.open(
                tmp_path / "f.bin", ranges, lambda at, view, fed=fed: fed.append((at, bytes(view)))
            )
            at = ranges[0][0]
            while at < size:
                n = rng.choice([1, 24, 4096, CHUNK - 3, 3 * CHUNK + 5, 70_000])
                start = max(
                    at - rng.choice([0, 0, 0, 50, CHUNK + 7]), 0
                )  # now and then, bytes asked for again
                out = bytearray(n)
                got = stream.read_into(start, memoryview(out))
                assert got == min(n, size - start) and bytes(out[:got]) == data[start : start + got]
                at = start + max(got, 1)
            stream.drain()
            if ranges == [(0, size + 1)]:
                assert [at for at, _ in fed] == sorted(at for at, _ in fed)
                assert b"".join(piece for _, piece in fed) == data
    finally:
        pipeline.close()


def _refuse_direct(monkeypatch, where):
    """Make the file system refuse O_DIRECT (as tmpfs and some network file systems do): at open or at read."""
    real_open, real_preadv = os.open, os.preadv

    def open_(path, flags, *args, **kwargs):
        if where == "open" and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    def preadv(fd, buffers, offset, *args):
        if where == "read" and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "preadv", preadv)


@pytest.mark.parametrize(
    "where", ["open", "read", None], ids=["refused-at-open", "refused-at-read", "direct"]
)
def test_where_o_direct_is_refused_the_page_cache_reads_the_same_bytes(tmp_path, monkeypatch, where):
    size = 5 * CHUNK + 777
    data = write(tmp_path / "f.bin", size, seed=7)
    digest = new_hasher("xxh3_128")
    digest.update(data)
    if where is not None:
        _refuse_direct(monkeypatch, where)
    jobs = []
    real_job = module._Job
    monkeypatch.setattr(module, "_Job", lambda *a: jobs.append(real_job(*a)) or jobs[-1])
    ahead = ReadAhead(tmp_path, [AheadFile("f.bin", size, f"xxh3_128:{digest.hexdigest()}")])
    out = bytearray(size - 10)
    assert ahead.stream("f.bin").read_into(10, memoryview(out)) == size - 10 and bytes(out) == data[10:]
    ahead.finish(timeout=30)
    assert ahead.check("f.bin").hashed_to == size
    assert jobs[0].direct is (where is None)


def _save(folder, tensors):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(tensors, storage_writer=FileSystemWriter(str(folder)), no_dist=True)
    return sorted(folder.glob("*.distcp"))


def _load(folder, targets, ahead):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(targets, storage_reader=ReadAheadFileSystemReader(folder, ahead), no_dist=True)


def test_a_file_truncated_in_a_tensor_another_rank_checks_fails_the_load_naming_it(tmp_path):
    torch.manual_seed(0)
    saved = {"a": torch.randn(50_000), "b": torch.randn(50_000)}
    (file,) = _save(tmp_path, saved)
    file.write_bytes(file.read_bytes()[: file.stat().st_size * 3 // 4])  # inside "b"'s bytes
    with pytest.raises(CheckpointException) as caught:
        _load(tmp_path, {k: torch.zeros_like(v) for k, v in saved.items()}, None)
    assert "truncated" in str(caught.value) and str(file) in str(caught.value)


def test_after_a_failed_load_the_checked_files_still_get_their_verdict_and_no_buffer_is_lost(tmp_path):
    """A file another rank checks fails to parse at its start: the load fails there, with more of that file in
    flight; its read buffers go back, and this rank's own files are read to their end and checked, with a
    small pipeline that would hang if a buffer were kept."""
    torch.manual_seed(0)
    mine = tmp_path / "mine"
    mine.mkdir()
    (checked,) = _save(mine, {"w": torch.randn(30_000)})
    data = checked.read_bytes()
    digest = new_hasher("xxh3_128")
    digest.update(data)
    (other,) = _save(tmp_path, {"w": torch.randn(30_000), "v": torch.randn(30_000)})
    (tmp_path / "mine.distcp").write_bytes(data)  # this rank's to check, not loaded here: only hashed
    with open(other, "r+b") as f:
        f.write(b"\0" * 256)  # the first item's zip header and pickle
    ahead = ReadAhead(tmp_path, [AheadFile("mine.distcp", len(data), f"xxh3_128:{digest.hexdigest()}")])
    ahead.pipeline.close()
    ahead.pipeline = ReadPipeline(buffers=2, chunk_bytes=CHUNK, io_threads=2)
    ahead._streams = {
        "mine.distcp": ahead.pipeline.open(
            tmp_path / "mine.distcp", [(0, len(data) + 1)], ahead.check("mine.distcp").feed
        )
    }
    with pytest.raises(CheckpointException):
        _load(tmp_path, {"w": torch.zeros(30_000), "v": torch.zeros(30_000)}, ahead)
    deadline = time.monotonic() + 10
    while len(ahead.pipeline._free) < 2 and time.monotonic() < deadline:  # a read in flight may still end
        time.sleep(0.01)
    assert len(ahead.pipeline._free) == 2  # the failed file's buffers are back
    assert ahead.check("mine.distcp").hashed_to == len(data)  # read to its end before the failing file
    ahead.finish(timeout=30)


def test_a_load_borrows_the_saves_buffers_and_gives_them_back(tmp_path, monkeypatch):
    """Reads of the pool's size take their huge-page buffers from the pool the saves fill and return them at
    close, so a load after a save (or a second load) maps no new memory."""
    from smalti.checkpoint.io import BOUNCE_POOL, CHUNK_BYTES

    data = write(tmp_path / "f.bin", 3 * CHUNK_BYTES + 4321, seed=7)
    BOUNCE_POOL.clear()

    def read_all() -> bytes:
        pipeline = ReadPipeline(buffers=2, io_threads=2)
        try:
            stream = pipeline.open(tmp_path / "f.bin", [(0, len(data))])
            out = bytearray(len(data))
            assert stream.read_into(0, memoryview(out)) == len(data)
            stream.drain()
        finally:
            pipeline.close()
        return bytes(out)

    assert read_all() == data  # the first load maps its buffers
    assert BOUNCE_POOL.idle == 2

    def no_new_memory(nbytes):
        raise AssertionError("a buffer was mapped although the pool had two")

    monkeypatch.setattr("smalti.checkpoint.io.pool.huge_page_buffer", no_new_memory)
    monkeypatch.setattr(module, "huge_page_buffer", no_new_memory)
    assert read_all() == data
    assert BOUNCE_POOL.idle == 2
    BOUNCE_POOL.clear()


@pytest.mark.timeout(20)
def test_an_unexpected_error_on_an_io_thread_fails_the_read_naming_the_file(tmp_path, monkeypatch):
    """Not only disk errors: whatever goes wrong on an I/O thread reaches the reader at once (a thread that died
    would leave the load waiting forever)."""
    write(tmp_path / "f.bin", 5 * CHUNK, seed=3)

    def broken(nbytes):
        raise RuntimeError("no buffer today")

    monkeypatch.setattr(module, "huge_page_buffer", broken)
    pipeline = ReadPipeline(buffers=2, chunk_bytes=CHUNK, io_threads=2)
    try:
        stream = pipeline.open(tmp_path / "f.bin", [(0, 5 * CHUNK)])
        with pytest.raises(Exception, match=r"f\.bin.*no buffer today"):
            stream.read_into(0, memoryview(bytearray(CHUNK)))
    finally:
        pipeline.close()
