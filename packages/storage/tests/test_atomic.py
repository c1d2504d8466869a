"""The atomic local write helper: all or nothing, durable, and its temp files are never listed as objects."""

import os

import pytest

from smalti.storage import (
    atomic_copy,
    atomic_write,
    atomic_write_bytes,
    atomic_write_text,
    is_temp_name,
    open_store,
)


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "index.json"
    atomic_write_text(target, "old")
    with pytest.raises(RuntimeError), atomic_write(target, "w") as f:
        f.write("half of the new")
        raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["index.json"]


def test_the_new_content_is_invisible_until_the_block_ends(tmp_path):
    target = tmp_path / "sub" / "shard.bin"
    with atomic_write(target) as f:
        f.write(b"x" * 1000)
        assert not target.exists()  # readers see nothing (or the old file) while it is written
        [temp] = os.listdir(target.parent)
        assert is_temp_name(temp)
    assert target.read_bytes() == b"x" * 1000
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    atomic_copy(target, tmp_path / "copy.bin")
    assert (tmp_path / "copy.bin").read_bytes() == b"new"


def test_the_write_is_synced_before_the_rename(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b))[1])
    atomic_write_bytes(tmp_path / "f", b"data")
    # the file's data, then the rename, then the folder entry
    assert calls == ["fsync", "replace", "fsync"]


def test_temp_files_of_an_interrupted_write_are_not_listed(tmp_path):
    store = open_store(tmp_path)
    store.put_bytes("a/real", b"1")
    (tmp_path / "a" / ".real.smalti-tmp-abc123").write_bytes(b"partial")
    assert [i.key for i in store.list()] == ["a/real"]


def test_files_get_the_permissions_a_plain_write_would(tmp_path):
    (tmp_path / "plain").write_bytes(b"x")
    atomic_write_bytes(tmp_path / "atomic", b"x")
    store = open_store(tmp_path / "s")
    store.put_bytes("k", b"x")
    store.get_file("k", tmp_path / "got")
    plain = (tmp_path / "plain").stat().st_mode & 0o777
    assert plain & 0o044  # readable by others under the usual umask: the check means something
    for name in ("atomic", "s/k", "got"):
        assert (tmp_path / name).stat().st_mode & 0o777 == plain, name
