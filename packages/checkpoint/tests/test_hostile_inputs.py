"""Checkpoints and caches crafted by someone with write access to a shared folder (issue 41): links out of
the checkpoint's folder, a planted default cache, and sizes that would make a load allocate or write more
than the files hold. Each is refused, naming the file, before anything is read, allocated or written."""

import dataclasses
import functools
import io
import os
import pickle
import re
import shutil
import tracemalloc

import pytest
import torch
import zstandard
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from smalti.checkpoint import CheckpointCorruptError, Checkpointer, CheckpointError
from smalti.checkpoint.errors import UnsafePathError
from smalti.checkpoint.limits import EntryTooLargeError
from smalti.checkpoint.manifest import read_manifest, verify_folder
from smalti.checkpoint.resume import default_cache_dir
from smalti.checkpoint.safe_load import read_dcp_metadata
from smalti.checkpoint.storage import open_store
from smalti.core import Trainer
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.testing.hostile_checkpoints import reseal


def make_trainer(duration, checkpointer=None):
    torch.manual_seed(0)
    return Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(96), 16, seed=5), duration,
                   optimizers=functools.partial(torch.optim.AdamW, lr=1e-2),
                   callbacks={"checkpoint": checkpointer} if checkpointer else None)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved") / "run"
    make_trainer("2ba", Checkpointer(str(folder), save_interval="2ba")).fit()
    return folder / "ep0-ba2"


@pytest.fixture
def ckpt(saved, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    return folder


def link_out(folder, rel, outside):
    """Move ``rel`` out of the checkpoint and leave a link to it: the bytes (and so the manifest) still match."""
    outside.mkdir(exist_ok=True)
    target = outside / rel.replace("/", "_")
    shutil.move(folder / rel, target)
    (folder / rel).symlink_to(target, target_is_directory=target.is_dir())


# ------------------------------------------------------------------ item 4: links and shared caches

@pytest.mark.parametrize("rel", ["__0_0.distcp", "extra", ".metadata"])
def test_a_file_or_folder_linked_out_of_the_checkpoint_is_refused_by_verify_and_load(ckpt, tmp_path, rel):
    link_out(ckpt, rel, tmp_path / "outside")
    for level in ("manifest", "full"):
        with pytest.raises(UnsafePathError, match=rf"{ckpt / rel} is a symbolic link"):
            verify_folder(ckpt, level)
    with pytest.raises(UnsafePathError, match=rf"{ckpt / rel} is a symbolic link"):
        make_trainer("4ba", Checkpointer(load_path=str(ckpt)))
    # even unverified, a load reads no file through a link (O_NOFOLLOW on every open)
    with pytest.raises(Exception, match=rf"{ckpt / rel} is a symbolic link"):
        make_trainer("4ba", Checkpointer(load_path=str(ckpt), verify="none"))


def test_the_default_cache_is_per_user_and_a_planted_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    cache = default_cache_dir("s3://bucket/run")
    root = tmp_path / f"smalti-{os.getuid()}"
    assert cache.parent == root / "checkpoint" and cache.is_dir()
    for folder in (root, root / "checkpoint", cache):
        assert os.stat(folder).st_mode & 0o777 == 0o700 and os.stat(folder).st_uid == os.getuid()
    # another user got there first: a link to where they want our downloads written
    shutil.rmtree(root)
    (tmp_path / "theirs").mkdir()
    root.symlink_to(tmp_path / "theirs")
    with pytest.raises(CheckpointError, match=rf"{root} is a symbolic link.*refused"):
        default_cache_dir("s3://bucket/run")
    assert list((tmp_path / "theirs").iterdir()) == []


def test_a_download_never_writes_through_a_link_planted_in_its_cache(saved, tmp_path):
    store = open_store(str(saved.parent))
    manifest = read_manifest(saved)
    dest = tmp_path / "cache" / saved.name
    dest.mkdir(parents=True)
    (tmp_path / "victim").mkdir()
    (dest / "extra").symlink_to(tmp_path / "victim", target_is_directory=True)
    with pytest.raises(UnsafePathError, match=rf"{dest / 'extra'} is a symbolic link \(in the download cache\)"):
        store.download_checkpoint(saved.name, dest, manifest)
    assert list((tmp_path / "victim").iterdir()) == []


def test_a_file_larger_than_its_manifest_says_is_not_downloaded(saved, tmp_path):
    remote = tmp_path / "remote"
    shutil.copytree(saved, remote / saved.name)
    manifest = read_manifest(saved)
    rel = max(manifest["files"], key=lambda r: manifest["files"][r]["size"])
    with open(remote / saved.name / rel, "ab") as f:
        f.write(bytes(1 << 20))  # a MiB more than listed: the manifest is not resealed
    dest = tmp_path / "cache" / saved.name
    with pytest.raises(CheckpointCorruptError, match=rf"{rel} is larger than the {manifest['files'][rel]['size']} "
                                                     "bytes its manifest lists; not downloaded"):
        open_store(str(remote)).download_checkpoint(saved.name, dest, manifest)
    assert not (dest / rel).exists()


def test_a_checkpoint_without_links_still_verifies_and_loads(ckpt):
    assert verify_folder(ckpt, "full")["files"]
    with make_trainer("4ba", Checkpointer(load_path=str(ckpt))) as loaded:
        assert loaded.state.timestamp.batch == 2


# ------------------------------------------------------------------ item 2: sizes taken on trust

def zeros_zstd(nbytes, declare):
    """``nbytes`` zeros as one zstd stream written as torch's ``stream.zstd/1`` writes it (no declared content
    size), or declaring its size in the frame header: a few kB either way."""
    out = io.BytesIO()
    options = {"size": nbytes} if declare else {}
    with zstandard.ZstdCompressor().stream_writer(out, closefd=False, **options) as writer:
        block = bytes(1 << 20)
        for _ in range(nbytes >> 20):
            writer.write(block)
    return out.getvalue()


def replace_entry(folder, data, **changes):
    """Point the first tensor entry of DCP's metadata at ``data`` appended to its data file (or, with
    ``data=None``, only change its fields); return the entry's name."""
    metadata = read_dcp_metadata(folder / ".metadata")
    index = next(i for i in metadata.storage_data if isinstance(metadata.state_dict_metadata[i.fqn], TensorStorageMetadata))
    info = metadata.storage_data[index]
    if data is not None:
        path = folder / info.relative_path
        changes = {"offset": path.stat().st_size, "length": len(data), **changes}
        with open(path, "ab") as f:
            f.write(data)
    metadata.storage_data[index] = dataclasses.replace(info, **changes)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(folder)
    return index.fqn


@pytest.mark.parametrize("declare", [False, True], ids=["undeclared", "declared"])
def test_a_compression_bomb_is_refused_by_verify_and_load_before_it_inflates(ckpt, declare):
    """256 MiB of zeros in 10 kB of zstd where a small tensor chunk belongs (torch's own transform format)."""
    bomb = zeros_zstd(256 << 20, declare)
    assert len(bomb) < 64 << 10
    fqn = replace_entry(ckpt, bomb, transform_descriptors=["stream.zstd/1"])
    said = r"declares \d+ bytes once decompressed; it can hold at most \d+" if declare else \
        r"decompresses to more than \d+ bytes"
    pattern = rf"'{re.escape(fqn)}' of {ckpt}/__0_0.distcp {said}"
    tracemalloc.start()
    try:
        with pytest.raises(EntryTooLargeError, match=pattern):
            verify_folder(ckpt, "full")
        with pytest.raises(EntryTooLargeError, match=pattern):
            make_trainer("4ba", Checkpointer(load_path=str(ckpt)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"{peak >> 20} MiB allocated: the entry was inflated"


@pytest.mark.parametrize("changes", [{"length": -5}, {"offset": -1}, {"offset": 10**12, "length": 10},
                                     {"length": 10**15}, {"transform_descriptors": ["rot13/1"]}],
                         ids=["negative length", "negative offset", "past the end", "huge length", "unknown transform"])
def test_offsets_and_lengths_outside_the_file_are_refused_before_reading(ckpt, changes):
    fqn = replace_entry(ckpt, None, **changes)
    for check in (lambda: verify_folder(ckpt, "full"),
                  lambda: make_trainer("4ba", Checkpointer(load_path=str(ckpt), verify="none"))):
        with pytest.raises(EntryTooLargeError, match=rf"'{re.escape(fqn)}' of .*(declares|past the end|transforms)"):
            check()


def test_an_honest_compressed_entry_verifies_and_loads(ckpt):
    """torch's zstd transform is still read: the bound is what the chunk's shape and dtype can hold."""
    metadata = read_dcp_metadata(ckpt / ".metadata")
    index = next(i for i in metadata.storage_data if isinstance(metadata.state_dict_metadata[i.fqn], TensorStorageMetadata))
    info = metadata.storage_data[index]
    with open(ckpt / info.relative_path, "rb") as f:
        f.seek(info.offset)
        tensor = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
    record = io.BytesIO()
    torch.save(tensor, record)
    fqn = replace_entry(ckpt, zstandard.ZstdCompressor().compress(record.getvalue()), transform_descriptors=["stream.zstd/1"])
    verify_folder(ckpt, "full")
    with make_trainer("4ba", Checkpointer(load_path=str(ckpt))) as loaded:
        name = fqn.removeprefix("model.")
        assert torch.equal(dict(loaded.state.model.named_parameters())[name].detach(), tensor)
