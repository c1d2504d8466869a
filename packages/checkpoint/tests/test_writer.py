"""The hashing DCP writer: digests equal a re-read of the files, no zip CRC pass, the switch restored."""

import errno
import hashlib
import os
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils.serialization import config

from smalti.checkpoint.hashing_file import CHUNK_BYTES, HashingFile
from smalti.checkpoint.manifest import hash_file
from smalti.checkpoint.writer import HashingFileSystemWriter


def test_digests_match_the_files_and_torch_save_gets_its_crc_back(tmp_path, monkeypatch):
    state = {f"w{i}": torch.randn(300_000) for i in range(5)} | {"step": 7}
    writer = HashingFileSystemWriter(tmp_path, thread_count=2)
    seen = []
    real_save = torch.save

    def spy(obj, f, *args, **kwargs):
        if isinstance(obj, torch.Tensor):
            seen.append(config.save.compute_crc32)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", spy)
    assert config.save.compute_crc32
    dcp.save(state, storage_writer=writer)
    assert len(seen) == 5 and not any(seen), "tensors were written with the zip CRC pass"
    assert config.save.compute_crc32, "the process-wide zip CRC switch was not restored"
    records = writer.fs.records
    on_disk = sorted(p.name for p in tmp_path.iterdir())
    assert sorted(records) == on_disk and len([n for n in on_disk if n.endswith(".distcp")]) == 2
    for name, record in records.items():
        size, sha = hash_file(tmp_path / name)
        assert (record["size"], record["sha256"]) == (size, sha)
        assert sha == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()

    loaded = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    assert all(torch.equal(loaded[k], state[k]) for k in state if k != "step") and loaded["step"] == 7


@pytest.mark.parametrize("direct", [True, False], ids=["direct-io", "buffered"])
def test_the_pipelined_file_holds_exactly_what_was_written_and_its_digest(tmp_path, direct):
    rng = random.Random(0)
    data = rng.randbytes(2 * CHUNK_BYTES + CHUNK_BYTES // 2 + 123)  # whole buffers, a part and a ragged tail
    path = tmp_path / "f.bin"
    with HashingFile(path, direct=direct) as f:
        at = 0
        while at < len(data):  # small header-like writes and big tensor-like ones, crossing buffer edges
            n = rng.choice([1, 7, 4096, 3 << 20, 9 << 20])
            assert f.tell() == at
            assert f.write(memoryview(data)[at : at + n]) == len(data[at : at + n])
            at += n
    assert path.read_bytes() == data
    assert (f.size, f.sha256) == (len(data), hashlib.sha256(data).hexdigest())


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_failed_write_is_raised_not_swallowed():
    with pytest.raises(OSError) as raised, HashingFile("/dev/full") as f:
        f.write(bytes(3 * CHUNK_BYTES))  # the third buffer waits for the first's write, which failed
    assert raised.value.errno == errno.ENOSPC
    assert f.closed
    f.close()  # closing again is harmless
