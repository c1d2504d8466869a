"""The one atomic local write: temp name in the same folder, write, flush, fsync, ``os.replace``, fsync the folder.

A reader sees either the old file or the complete new one, never a part, and after a crash (power loss
included, once the call has returned) the new file is there. Temp names start with ``.`` and contain
``.smalti-tmp-`` so listings can skip them (:func:`is_temp_name`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

TEMP_MARKER = ".smalti-tmp-"
# mkstemp creates 0600 files; an atomic write should leave the permissions a plain open() would
_UMASK = os.umask(0o022)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK


def is_temp_name(name: str) -> bool:
    """Whether ``name`` (a file name) is a temp file of :func:`atomic_write` still being written or left by a crash."""
    return name.startswith(".") and TEMP_MARKER in name


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync folder ``path`` so a rename or new entry in it survives a crash (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the rename is as durable as they allow
    finally:
        os.close(fd)


def temp_path(path: str | os.PathLike[str]) -> Path:
    """Create and return an empty, unique temp file beside ``path`` (same folder, so the final rename is atomic)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}{TEMP_MARKER}", dir=target.parent)
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    return Path(name)


def commit_temp(tmp: str | os.PathLike[str], path: str | os.PathLike[str], fsync: bool = True) -> None:
    """fsync ``tmp``, rename it over ``path`` and fsync the folder: the last step of every atomic write."""
    if fsync:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(Path(path).parent)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "wb", fsync: bool = True, **open_kwargs: Any) -> Iterator[IO[Any]]:
    """Open a temp file beside ``path`` for writing; on a clean exit it replaces ``path``, on an error it is removed.

    ``mode`` is ``"wb"`` or ``"w"`` (text; ``encoding`` etc. pass through). ``fsync=False`` keeps the rename
    atomic but skips the durability syncs (for scratch files that a crash may lose).

        with atomic_write(folder / "index.json", "w") as f:
            json.dump(index, f)
    """
    if mode not in ("w", "wb", "wt"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', not {mode!r}")
    tmp = temp_path(path)
    try:
        with open(tmp, mode, **open_kwargs) as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        commit_temp(tmp, path, fsync=False)
        if fsync:
            fsync_dir(Path(path).parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`)."""
    with atomic_write(path, "wb", fsync=fsync) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8", fsync: bool = True) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_write`)."""
    with atomic_write(path, "w", fsync=fsync, encoding=encoding) as f:
        f.write(text)


def atomic_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str], fsync: bool = True) -> None:
    """Copy file ``src`` to ``dst`` atomically (see :func:`atomic_write`)."""
    import shutil

    with open(src, "rb") as source, atomic_write(dst, "wb", fsync=fsync) as f:
        shutil.copyfileobj(source, f, length=1 << 20)
