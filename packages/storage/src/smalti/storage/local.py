"""Local (or shared-filesystem) folders: plain paths and ``file://`` URLs."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from smalti.storage.atomic import atomic_copy, atomic_write_bytes, is_temp_name
from smalti.storage.base import BaseStore, ObjectInfo
from smalti.storage.errors import ObjectNotFoundError, PermissionDeniedError, StorageError
from smalti.storage.retry import RetryPolicy, _brief


class LocalStore(BaseStore):
    """Objects are files under a root folder; keys are paths relative to it.

    Every write goes through the atomic-write helper (temp name, fsync, rename, fsync the folder), so a put is
    atomic per file as on the object stores; a local folder adds no rename of folders, so the manifest-last
    rule applies here too. Errors are not retried (a local file system has no brown-outs worth waiting for).
    """

    scheme = "file"
    commit_semantics = "put is atomic per file (temp name, fsync, rename); the manifest written last is the commit"

    def __init__(self, root: str | os.PathLike[str], retry: RetryPolicy | None = None,
                 read_timeout_s: float | None = None, **options: int) -> None:
        # read_timeout_s is accepted as every backend accepts it; a local read has no network to stall on
        root_str = os.fspath(root)
        if root_str.startswith("file://"):
            root_str = root_str[len("file://") :]
        self.root = Path(root_str or ".")
        super().__init__(str(self.root), "", "", retry=retry or RetryPolicy(budget_s=0), **options)

    def url_of(self, key: str) -> str:
        full = self._full(key)
        return str(self.root / full) if full else str(self.root)

    def path(self, key: str) -> Path:
        """The local path of ``key``."""
        return self.root / self._full(key)

    def _is_transient(self, exc: BaseException) -> bool:
        return False

    def _translate(self, exc: Exception, url: str, key: str) -> StorageError:
        if isinstance(exc, FileNotFoundError):
            return ObjectNotFoundError(f"{url} does not exist", url)
        if isinstance(exc, PermissionError):
            return PermissionDeniedError(f"{url}: permission denied ({exc.strerror})", url)
        return StorageError(f"{url}: {_brief(exc)}", url)

    def _stat(self, full_key: str) -> ObjectInfo:
        st = (self.root / full_key).stat()
        if not os.path.isfile(self.root / full_key):
            raise FileNotFoundError(f"{self.root / full_key} is a folder, not a file")
        return ObjectInfo(full_key, st.st_size, f"{st.st_mtime_ns:x}-{st.st_size:x}", st.st_mtime)

    def _get_range(self, full_key: str, start: int, end: int | None) -> bytes:
        with open(self.root / full_key, "rb") as f:
            f.seek(start)
            return f.read() if end is None else f.read(end - start)

    def _download_into(self, full_key: str, f: IO[bytes]) -> None:
        with open(self.root / full_key, "rb") as src:
            shutil.copyfileobj(src, f, length=1 << 20)

    def _put_bytes(self, full_key: str, data: bytes) -> None:
        atomic_write_bytes(self.root / full_key, data)

    def _put_multipart(self, local: Path, full_key: str, key: str, size: int) -> None:
        self._call("upload", key, lambda: atomic_copy(local, self.root / full_key))

    def _get_versioned(self, full_key: str) -> tuple[bytes, str] | None:
        try:
            data = (self.root / full_key).read_bytes()
        except FileNotFoundError:
            return None
        return data, _content_token(data)

    def _put_if(self, full_key: str, data: bytes, token: str | None) -> bool:
        # the token is the content's digest, compared under an exclusive lock on the folder, which every
        # conditional writer on this file system takes (flock: processes of one host, and NFS clients)
        path = self.root / full_key
        path.parent.mkdir(parents=True, exist_ok=True)
        with _folder_lock(path.parent):
            try:
                current: str | None = _content_token(path.read_bytes())
            except FileNotFoundError:
                current = None
            if current != token:
                return False
            atomic_write_bytes(path, data)
            return True

    def _list(self, full_prefix: str) -> list[ObjectInfo]:
        # walk only the folder the prefix names (or the one holding its last, partial segment)
        folder = self.root / full_prefix if full_prefix.endswith("/") or not full_prefix else (self.root / full_prefix).parent
        out = []
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames.sort()
            for name in filenames:
                if is_temp_name(name):
                    continue
                path = Path(dirpath) / name
                rel = path.relative_to(self.root).as_posix()
                if rel.startswith(full_prefix):
                    st = path.stat()
                    out.append(ObjectInfo(rel, st.st_size, f"{st.st_mtime_ns:x}-{st.st_size:x}", st.st_mtime))
        return out

    def _delete(self, full_key: str) -> None:
        path = self.root / full_key
        path.unlink(missing_ok=True)
        # drop folders the delete emptied, up to the root, so a deleted checkpoint leaves no shell behind
        parent = path.parent
        while parent != self.root and self.root in parent.parents:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent


def _content_token(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
