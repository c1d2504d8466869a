"""Direct-I/O saves: every byte goes out of reused huge-page bounce buffers in whole-block ``O_DIRECT`` writes;
the buffers go back to the process-wide pool when a file closes, also after a failed write; a file system that
refuses direct writes gets the same bytes through the page cache."""

import errno
import fcntl
import os
import random

import pytest

from smalti.checkpoint import hashing_file
from smalti.checkpoint.hashing_file import BufferedHashingFile, DirectHashingFile, open_hashing_file
from smalti.checkpoint.io import (
    BLOCK_BYTES,
    BOUNCE_BUFFERS,
    CHUNK_BYTES,
    HUGE_PAGE_BYTES,
    BouncePool,
    buffer_address,
)
from smalti.checkpoint.io import pool as io_pool

pytestmark = pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="needs O_DIRECT")


def is_direct(fd):
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def pieces_of(data, rng):
    """``data`` cut the way torch.save cuts a file: small records between large tensor bytes."""
    at = 0
    while at < len(data):
        n = rng.choice([30, 64, 4095, 5 << 20, 11 << 20])
        yield memoryview(data)[at : at + n]
        at += n


@pytest.fixture
def pwrites(monkeypatch):
    """Every ``os.pwrite`` of the hashing files: (buffer address, length, offset, whether O_DIRECT)."""
    calls = []
    real = os.pwrite

    def spy(fd, data, offset):
        view = memoryview(data)
        calls.append((buffer_address(view), len(view), offset, is_direct(fd)))
        return real(fd, data, offset)

    monkeypatch.setattr(hashing_file.os, "pwrite", spy)
    return calls


def test_every_byte_is_written_from_a_bounce_buffer_in_whole_blocks(tmp_path, pwrites):
    data = random.Random(1).randbytes(3 * CHUNK_BYTES + 12_345)
    with open_hashing_file(tmp_path / "f.bin", direct=True) as f:
        assert isinstance(f, DirectHashingFile)
        buffers = [(buffer_address(b), len(b)) for b in f._buffers]
        for piece in pieces_of(data, random.Random(2)):
            f.write(piece)
    assert (tmp_path / "f.bin").read_bytes() == data
    assert sum(n for _, n, _, _ in pwrites) == len(data)
    assert all(
        any(start <= at and at + n <= start + size for start, size in buffers) for at, n, _, _ in pwrites
    ), "bytes were written from memory outside the bounce buffers"
    assert all(start % HUGE_PAGE_BYTES == 0 for start, _ in buffers)
    *whole, tail = pwrites
    # the disk starts after the first MiB, not after a whole chunk is copied
    assert [n for _, n, _, _ in whole[:5]] == [1 << 20, 2 << 20, 4 << 20, 8 << 20, CHUNK_BYTES]
    assert all(
        direct and n % BLOCK_BYTES == 0 and offset % BLOCK_BYTES == 0 for _, n, offset, direct in whole
    )
    assert not tail[3] and tail[1] < BLOCK_BYTES  # only the last partial block goes through the page cache


def test_bounce_buffers_are_reused_by_the_next_file_and_the_pool_stays_bounded(tmp_path, monkeypatch):
    made = []
    real = io_pool.huge_page_buffer

    def counting(nbytes):
        made.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(io_pool, "huge_page_buffer", counting)
    monkeypatch.setattr(hashing_file, "BOUNCE_POOL", BouncePool(keep=BOUNCE_BUFFERS))
    pool = hashing_file.BOUNCE_POOL
    data = bytes(2 * CHUNK_BYTES + 5)
    with open_hashing_file(tmp_path / "a.bin", direct=True) as f:
        first = {buffer_address(b) for b in f._buffers}
        f.write(data)
    assert len(made) == BOUNCE_BUFFERS and pool.idle == BOUNCE_BUFFERS
    with open_hashing_file(tmp_path / "b.bin", direct=True) as f:
        assert {buffer_address(b) for b in f._buffers} == first
        f.write(data)
    assert len(made) == BOUNCE_BUFFERS, "the second file mapped new buffers instead of reusing the pool's"
    with (
        open_hashing_file(tmp_path / "c.bin", direct=True) as c,
        open_hashing_file(tmp_path / "d.bin", True) as d,
    ):
        c.write(data)
        d.write(data)  # two files at once (DCP's writer threads): the second one's buffers are new
    assert len(made) == 2 * BOUNCE_BUFFERS and pool.idle == BOUNCE_BUFFERS  # the extra ones are let go
    assert (tmp_path / "d.bin").read_bytes() == data


def test_a_failed_write_is_raised_and_the_buffers_still_go_back_to_the_pool(tmp_path, monkeypatch):
    monkeypatch.setattr(hashing_file, "BOUNCE_POOL", BouncePool())
    real = os.pwrite
    calls = []

    def full_disk(fd, data, offset):
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(hashing_file.os, "pwrite", full_disk)
    with pytest.raises(OSError) as raised, open_hashing_file(tmp_path / "f.bin", direct=True) as f:
        f.write(bytes(6 * CHUNK_BYTES))  # a buffer waits for the second write, which failed: raised here
    assert raised.value.errno == errno.ENOSPC
    assert f.closed and hashing_file.BOUNCE_POOL.idle == BOUNCE_BUFFERS


def test_a_file_system_refusing_direct_writes_gets_the_same_bytes_through_the_page_cache(
    tmp_path, monkeypatch
):
    """Some file systems accept the ``O_DIRECT`` open but refuse the writes (EINVAL); others refuse the open."""
    real = os.pwrite

    def refuse_direct(fd, data, offset):
        if is_direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(hashing_file.os, "pwrite", refuse_direct)
    data = random.Random(3).randbytes(CHUNK_BYTES + 777)
    with open_hashing_file(tmp_path / "f.bin", direct=True) as f:
        assert isinstance(f, DirectHashingFile)
        for piece in pieces_of(data, random.Random(4)):
            f.write(piece)
    assert (tmp_path / "f.bin").read_bytes() == data and f.size == len(data)

    real_open = os.open

    def refuse_direct_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(hashing_file.os, "open", refuse_direct_open)
    with open_hashing_file(tmp_path / "g.bin", direct=True) as g:
        assert isinstance(g, BufferedHashingFile)
        g.write(data)
    assert (tmp_path / "g.bin").read_bytes() == data and g.digest == f.digest
