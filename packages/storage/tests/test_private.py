"""Per-user cache folders and opens that follow no link (smalti.storage.private)."""

from __future__ import annotations

import os

import pytest

from smalti.storage import (
    UnsafeLocalPathError,
    check_no_links,
    check_private_dir,
    open_beneath,
    user_cache_dir,
)


def test_user_cache_dir_is_per_user_and_private(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    cache = user_cache_dir("checkpoint")
    assert cache == tmp_path / f"smalti-{os.getuid()}" / "checkpoint"
    for folder in (cache, cache.parent):
        assert os.stat(folder).st_mode & 0o777 == 0o700 and os.stat(folder).st_uid == os.getuid()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir("streaming") == tmp_path / "xdg" / "smalti" / "streaming"


def test_a_planted_cache_root_is_refused(tmp_path, monkeypatch):
    """Another user (here: a link, or a folder others may write) got to the predictable name first."""
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    root = tmp_path / f"smalti-{os.getuid()}"
    (tmp_path / "elsewhere").mkdir()
    root.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeLocalPathError, match=rf"{root} is a symbolic link"):
        user_cache_dir("checkpoint")
    assert not (tmp_path / "elsewhere" / "checkpoint").exists()
    root.unlink()
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeLocalPathError, match=r"may be written by other users \(mode 777\)"):
        user_cache_dir("checkpoint")
    os.chmod(root, 0o700)
    assert check_private_dir(root) == root


def test_links_below_a_folder_are_refused(tmp_path):
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "f").write_bytes(b"secret")
    folder = tmp_path / "ckpt"
    (folder / "real").mkdir(parents=True)
    (folder / "real" / "f").write_bytes(b"ok")
    (folder / "linked_dir").symlink_to(outside / "sub")
    (folder / "real" / "linked_file").symlink_to(outside / "sub" / "f")
    assert check_no_links(folder, "real/f") == folder / "real" / "f"
    fd = open_beneath(folder, "real/f")
    assert os.read(fd, 10) == b"ok"
    os.close(fd)
    for rel in ("linked_dir/f", "real/linked_file"):
        link = rel.rsplit("/", 1)[0] if rel.startswith("linked_dir") else rel
        with pytest.raises(UnsafeLocalPathError, match=rf"{folder / link} is a symbolic link \(manifest\)"):
            check_no_links(folder, rel, "manifest")
        with pytest.raises(UnsafeLocalPathError, match=rf"{folder / link} is a symbolic link"):
            open_beneath(folder, rel)
    # a write through a planted link never reaches its target
    with pytest.raises(UnsafeLocalPathError):
        open_beneath(folder, "real/linked_file", os.O_WRONLY | os.O_TRUNC)
    assert (outside / "sub" / "f").read_bytes() == b"secret"
