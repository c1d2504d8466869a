"""The hashing DCP writer: digests equal a re-read of the files, no zip CRC pass, the switch restored."""

import hashlib

import torch
import torch.distributed.checkpoint as dcp
from torch.utils.serialization import config

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
