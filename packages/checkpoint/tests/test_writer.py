"""The hashing DCP writer: digests equal a re-read of the files, no zip CRC pass, the switch restored; the
files are DCP's own bytes; buffered large writes reach the kernel from the caller's own memory."""

import errno
import hashlib
import os
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils.serialization import config

from smalti.checkpoint import writer as writer_module
from smalti.checkpoint.hashes import ALGORITHMS
from smalti.checkpoint.hashing_file import BufferedHashingFile, open_hashing_file
from smalti.checkpoint.io import CHUNK_BYTES
from smalti.checkpoint.manifest import hash_file
from smalti.checkpoint.writer import HashingFileSystemWriter


def reference_digest(algorithm, data):
    """The digest by the algorithm's own package, over the whole bytes at once."""
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128(data).hexdigest()
    if algorithm == "blake3":
        import blake3

        return blake3.blake3(data).hexdigest()
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct-io"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_digests_match_the_files_and_torch_save_gets_its_crc_back(tmp_path, monkeypatch, algorithm, direct):
    """Also: DCP's own reader (``checkpoint_id``: its ``FileSystemReader``) loads what either way wrote."""
    state = {f"w{i}": torch.randn(300_000) for i in range(5)} | {"step": 7}
    writer = HashingFileSystemWriter(tmp_path, thread_count=2, direct_io=direct, algorithm=algorithm)
    seen = []
    real_save = writer_module.save_tensor  # writes what torch.save would, under torch.save's settings

    def spy(tensor, f):
        seen.append(config.save.compute_crc32)
        return real_save(tensor, f)

    monkeypatch.setattr(writer_module, "save_tensor", spy)
    assert config.save.compute_crc32
    dcp.save(state, storage_writer=writer)
    assert len(seen) == 5 and not any(seen), "tensors were written with the zip CRC pass"
    assert config.save.compute_crc32, "the process-wide zip CRC switch was not restored"
    records = writer.fs.records
    on_disk = sorted(p.name for p in tmp_path.iterdir())
    assert sorted(records) == on_disk and len([n for n in on_disk if n.endswith(".distcp")]) == 2
    for name, record in records.items():
        size, hexdigest = hash_file(tmp_path / name, algorithm)
        assert (record["size"], record["hash"]) == (size, f"{algorithm}:{hexdigest}")
        assert hexdigest == reference_digest(algorithm, (tmp_path / name).read_bytes())

    loaded = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    assert all(torch.equal(loaded[k], state[k]) for k in state if k != "step") and loaded["step"] == 7


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("direct", [True, False], ids=["direct-io", "buffered"])
def test_the_hashing_file_holds_exactly_what_was_written_and_its_digest(tmp_path, direct, algorithm):
    rng = random.Random(0)
    data = rng.randbytes(2 * CHUNK_BYTES + CHUNK_BYTES // 2 + 123)  # whole buffers, a part and a ragged tail
    path = tmp_path / "f.bin"
    with open_hashing_file(path, direct, algorithm) as f:
        at = 0
        while at < len(data):  # small header-like writes and big tensor-like ones, crossing buffer edges
            n = rng.choice([1, 7, 4096, 3 << 20, 9 << 20])
            assert f.tell() == at
            assert f.write(memoryview(data)[at : at + n]) == len(data[at : at + n])
            at += n
    assert path.read_bytes() == data
    assert (f.size, f.digest) == (len(data), f"{algorithm}:{reference_digest(algorithm, data)}")


def test_large_writes_go_to_the_kernel_from_the_callers_memory_and_small_ones_are_gathered(tmp_path, monkeypatch):
    """What makes a page-cache save as fast as a raw write of the same bytes: no copy of a tensor's bytes into
    buffers of ours before the kernel's own copy, and few system calls for the small records between them."""
    import smalti.checkpoint.hashing_file as hashing_file

    big = torch.randn(3 * CHUNK_BYTES // 4 + 5)  # 3 chunks and a bit: written in chunk-sized pieces
    address = big.untyped_storage().data_ptr()
    calls = []
    real_write = os.write

    def spy(fd, data):
        view = memoryview(data)
        calls.append((torch.frombuffer(view, dtype=torch.uint8).data_ptr() if len(view) else 0, len(view)))
        return real_write(fd, data)

    monkeypatch.setattr(hashing_file.os, "write", spy)
    with open_hashing_file(tmp_path / "f.bin", direct=False) as f:
        assert isinstance(f, BufferedHashingFile)
        for _ in range(100):
            f.write(b"header")
        f.write(memoryview(big.numpy()).cast("B"))
        f.write(b"trailer")
    assert calls[0] == (calls[0][0], 600)  # the 100 small writes in one call
    pieces = calls[1:-1]  # the tensor's own memory, front to back, in pieces of at most a chunk
    assert sum(n for _, n in pieces) == big.nbytes and max(n for _, n in pieces) <= CHUNK_BYTES
    assert [at for at, _ in pieces] == [address + sum(n for _, n in pieces[:i]) for i in range(len(pieces))]
    assert (tmp_path / "f.bin").read_bytes() == b"header" * 100 + big.numpy().tobytes() + b"trailer"


@pytest.mark.parametrize("direct", [True, False], ids=["direct-io", "buffered"])
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_failed_write_is_raised_not_swallowed(direct):
    with pytest.raises(OSError) as raised, open_hashing_file("/dev/full", direct) as f:
        f.write(bytes(3 * CHUNK_BYTES))  # direct: the third buffer waits for the first's write, which failed
    assert raised.value.errno == errno.ENOSPC
    assert f.closed
    f.close()  # closing again is harmless


@pytest.mark.parametrize("direct", [True, False], ids=["direct-io", "buffered"])
def test_the_data_files_are_byte_for_byte_those_of_dcps_own_writer(tmp_path, direct):
    """Only the file object differs from DCP's ``FileSystemWriter`` (no padding, no layout of our own): with
    the zip CRC off in both, each data file holds exactly DCP's bytes, DCP's own reader loads it, and its
    recorded digest is that of those bytes."""
    from torch.distributed.checkpoint import FileSystemWriter

    from smalti.checkpoint.writer import _torch_save_settings

    torch.manual_seed(0)
    state = {"big": [torch.randn(n) for n in (1 << 20, (3 << 20) + 5, 300_001)], "small": torch.randn(100), "n": 3}
    ours, theirs = tmp_path / "ours", tmp_path / "dcp"
    writer = HashingFileSystemWriter(ours, direct_io=direct)
    dcp.save(state, storage_writer=writer)
    with _torch_save_settings():  # DCP writes in this thread (one writer thread): the same torch.save settings
        dcp.save(state, storage_writer=FileSystemWriter(str(theirs)))
    data_files = sorted(p.name for p in theirs.iterdir() if p.suffix == ".distcp")
    assert data_files == sorted(p.name for p in ours.iterdir() if p.suffix == ".distcp") == ["__0_0.distcp"]
    assert (ours / "__0_0.distcp").stat().st_size > 17 << 20
    for name in data_files:
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    loaded = {"big": [torch.zeros_like(t) for t in state["big"]], "small": torch.zeros(100), "n": 0}
    dcp.load(loaded, checkpoint_id=str(ours))
    assert all(torch.equal(a, b) for a, b in zip(loaded["big"], state["big"]))
    assert torch.equal(loaded["small"], state["small"]) and loaded["n"] == 3
    for name, record in writer.fs.records.items():
        assert record["hash"] == f"xxh3_128:{reference_digest('xxh3_128', (ours / name).read_bytes())}"


@pytest.mark.parametrize("direct", [True, False], ids=["direct-io", "buffered"])
def test_each_small_entry_reaches_the_file_in_one_write(tmp_path, monkeypatch, direct):
    """A checkpoint of many small tensors (LoRA adapters and their AdamW state) costs per entry, not per byte:
    ``torch.save`` makes ~39 small writes per tensor, which the writer gathers into one write per entry; the
    large tensor's record is not gathered (no copy of its data). Plain DCP reads the result, no transform is
    recorded, and the digests are those of the files."""
    from smalti.checkpoint import hashing_file

    writes = []
    for cls in (hashing_file.BufferedHashingFile, hashing_file.DirectHashingFile):
        real = cls.write

        def counted(self, data, real=real):
            writes.append(memoryview(data).nbytes)
            return real(self, data)

        monkeypatch.setattr(cls, "write", counted)
    torch.manual_seed(0)
    small = {f"layer{i}": {"A": torch.randn(16, 8), "B": torch.randn(8, 16), "step": torch.tensor(3.0)}
             for i in range(100)}
    state = {"model": small, "big": torch.randn(300_000), "n": 5}
    writer = HashingFileSystemWriter(tmp_path, direct_io=direct)
    dcp.save(state, storage_writer=writer)
    entries = 3 * len(small)
    big_writes = [n for n in writes if n >= 300_000 * 4]
    assert big_writes == [300_000 * 4], "the large tensor's data was copied into a gathered record"
    # one write per small entry, ~39 for the large tensor, a few for the byte entry and the metadata file
    assert len(writes) <= entries + 60, f"{len(writes)} writes for {entries} small entries"
    loaded = {"model": {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in small.items()},
              "big": torch.zeros(300_000), "n": 0}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(tmp_path)))
    assert all(torch.equal(loaded["model"][k][n], t) for k, v in small.items() for n, t in v.items())
    assert torch.equal(loaded["big"], state["big"]) and loaded["n"] == 5
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert all(info.transform_descriptors is None for info in metadata.storage_data.values())
    for name, record in writer.fs.records.items():
        assert record["hash"] == f"xxh3_128:{reference_digest('xxh3_128', (tmp_path / name).read_bytes())}"


def test_tensors_held_on_a_device_take_dcps_own_write_loop(tmp_path, monkeypatch):
    """A synchronous save from a GPU keeps DCP's loop, which copies the next tensor to the host while it writes
    the current one; the per-entry loop above would copy them one at a time. (The meta device stands in for a
    GPU: any tensor not on the CPU counts.)"""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", lambda self, plan, planner: ("dcp's loop", plan))
    tensors = {"w": torch.zeros(4), "v": torch.empty(4, device="meta")}

    class Planner:
        def resolve_data(self, item):
            return tensors[item.index.fqn]

    plan = SavePlan([WriteItem(index=MetadataIndex(name), type=WriteItemType.TENSOR) for name in tensors])
    assert HashingFileSystemWriter(tmp_path).write_data(plan, Planner()) == ("dcp's loop", plan)
