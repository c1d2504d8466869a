"""The :class:`ObjectStore` Protocol and :class:`BaseStore`, the shared half of every built-in backend.

A store is rooted at a URL (``s3://bucket/prefix``, ``/local/folder``); every method takes a *key* relative to
that root, ``/``-separated (``"ep1-ba2/model.distcp"``). Keys may not be absolute or contain ``..``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from smalti.storage.atomic import commit_temp, temp_path
from smalti.storage.errors import ObjectNotFoundError, ObjectTooLargeError, StorageError
from smalti.storage.retry import RetryPolicy, _brief

MiB = 1 << 20
DEFAULT_PART_SIZE = 64 * MiB


@dataclass(frozen=True)
class ObjectInfo:
    """What :meth:`ObjectStore.stat` and :meth:`ObjectStore.list` report about one object.

    ``key`` is relative to the store's root; ``etag`` changes whenever the content does (S3/Azure ETag, GCS
    md5/etag, local mtime+size); ``version`` is GCS's generation where there is one; ``mtime`` is seconds
    since the epoch.
    """

    key: str
    size: int
    etag: str | None = None
    mtime: float | None = None
    version: str | None = None


@runtime_checkable
class ObjectStore(Protocol):
    """What smalti asks of object storage. Every built-in backend implements it; so may a plugin's.

    Commit semantics every backend guarantees: a put (:meth:`put_bytes`, :meth:`put_file`, multipart
    included) is atomic per object: readers see the old object, no object, or the complete new one, never a
    part. There is no multi-object transaction: write the parts first and a small manifest (or index) *last*;
    the manifest's put is the commit, and readers trust only what a manifest lists. Deleting is the reverse:
    the manifest first. :meth:`get_file` is atomic on the local side (temp name, fsync, rename).
    """

    url: str
    scheme: str
    commit_semantics: str

    def url_of(self, key: str) -> str:
        """The full URL of ``key`` (for messages and for handing to another process)."""
        ...

    def stat(self, key: str) -> ObjectInfo:
        """Size, etag and mtime of ``key``; :class:`ObjectNotFoundError` when it does not exist."""
        ...

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists (a missing bucket is still an error)."""
        ...

    def get_bytes(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``key`` (``end=None``: to the end)."""
        ...

    def get_file(
        self, key: str, local: str | os.PathLike[str], check: Callable[[Path], None] | None = None,
        check_attempts: int = 1, max_bytes: int | None = None,
    ) -> Path:
        """Download ``key`` to ``local`` atomically; ``check(tmp)`` may reject the complete temp file first.

        When ``check`` raises, the object is downloaded again, up to ``check_attempts`` downloads in all
        (a transfer corrupted on the way), and the last error is raised; nothing is left at ``local``.
        ``max_bytes`` (the size an index or manifest declares): a larger object raises
        :class:`ObjectTooLargeError` before its download, or at the first byte past it if it grew meanwhile.
        """
        ...

    def put_bytes(self, key: str, data: bytes) -> None:
        """Store ``data`` as ``key`` (atomic per object)."""
        ...

    def put_file(self, local: str | os.PathLike[str], key: str) -> None:
        """Upload file ``local`` as ``key``, in parts above the multipart threshold (atomic per object)."""
        ...

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (recursive), with sizes, sorted by key."""
        ...

    def delete(self, key: str) -> None:
        """Delete ``key``; deleting what is not there is not an error."""
        ...

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete each of ``keys`` (missing ones are skipped)."""
        ...

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        """``(content, version token)`` of ``key`` for a later :meth:`put_if`; None when it does not exist."""
        ...

    def put_if(self, key: str, data: bytes, token: str | None) -> bool:
        """Store ``data`` as ``key`` only if it is still at ``token`` (None: only if it does not exist yet).

        True when written; False when another writer changed (or created) the object first: read it again
        with :meth:`get_versioned`, redo the change and try again. This is what a small shared file (a
        cordon list, a lease) needs when several machines update it at once.
        """
        ...


def check_key(key: str, root: str) -> str:
    """``key`` normalised (no leading ``./``); refuses absolute keys and ``..`` segments, naming the store."""
    if key.startswith("/") or "\\" in key:
        raise StorageError(f"key {key!r} under {root} must be relative and '/'-separated", root)
    parts = [p for p in key.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise StorageError(f"key {key!r} under {root} leaves its folder ('..' is not allowed in a key)", root)
    return "/".join(parts) + ("/" if key.endswith("/") and parts else "")


class PerProcess:
    """A value made on first use in each process and shared by its threads: a client library's connection
    pool must not cross a fork (a DataLoader worker makes its own)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._values: dict[int, Any] = {}
        self._lock = threading.Lock()

    def get(self) -> Any:
        """This process's value, made now if it has none."""
        pid = os.getpid()
        value = self._values.get(pid)
        if value is None:
            with self._lock:
                value = self._values.get(pid)
                if value is None:
                    value = self._values[pid] = self._make()
        return value


class BaseStore:
    """Shared plumbing: keys under a root prefix, the retry policy around every call, atomic ``get_file``.

    A backend implements the ``_``-prefixed primitives on *full* object keys and says which exceptions are
    transient (:meth:`_is_transient`) and what a final one means (:meth:`_translate`).
    """

    scheme = ""
    commit_semantics = ""

    def __init__(
        self,
        url: str,
        bucket: str,
        prefix: str,
        retry: RetryPolicy | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        multipart_threshold: int | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.retry = retry or RetryPolicy()
        self.part_size = int(part_size)
        self.multipart_threshold = int(multipart_threshold if multipart_threshold is not None else part_size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # ---------------------------------------------------------------- keys and calls

    def _full(self, key: str) -> str:
        key = check_key(key, self.url)
        return f"{self.prefix}/{key}" if self.prefix and key else (self.prefix + "/" if self.prefix else key)

    def _rel(self, full_key: str) -> str:
        return full_key[len(self.prefix) + 1 :] if self.prefix else full_key

    def url_of(self, key: str) -> str:
        key = check_key(key, self.url)
        return f"{self.url}/{key}" if key else self.url

    def _call(self, what: str, key: str, fn: Callable[[], object]) -> object:
        url = self.url_of(key)
        try:
            return self.retry.call(fn, self._is_transient, f"{what} {url}", url)
        except StorageError:
            raise
        except Exception as exc:
            error = self._translate(exc, url, key)
            if type(error) is StorageError:
                raise error from exc
            # a named cause (missing bucket, credentials, ...) says all a user needs: no client traceback
            error.cause = exc
            raise error from None

    def _is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, (ConnectionError, TimeoutError))

    def _translate(self, exc: Exception, url: str, key: str) -> StorageError:
        return StorageError(f"{url}: {_brief(exc)}", url)

    # ---------------------------------------------------------------- the Protocol

    def stat(self, key: str) -> ObjectInfo:
        full = self._full(key)
        info = self._call("stat", key, lambda: self._stat(full))
        assert isinstance(info, ObjectInfo)
        return ObjectInfo(self._rel(info.key), info.size, info.etag, info.mtime, info.version)

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
        except ObjectNotFoundError:
            return False
        return True

    def get_bytes(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        if start < 0 or (end is not None and end < start):
            raise StorageError(f"bad byte range [{start}, {end}) for {self.url_of(key)}", self.url_of(key))
        if end is not None and end == start:
            return b""
        full = self._full(key)
        data = self._call("read", key, lambda: self._get_range(full, start, end))
        assert isinstance(data, bytes)
        return data

    def get_file(
        self, key: str, local: str | os.PathLike[str], check: Callable[[Path], None] | None = None,
        check_attempts: int = 1, max_bytes: int | None = None,
    ) -> Path:
        full = self._full(key)
        target = Path(local)
        if max_bytes is not None and (size := self.stat(key).size) > max_bytes:
            raise ObjectTooLargeError(
                f"{self.url_of(key)} holds {size} bytes, more than the {max_bytes} expected; not downloaded",
                self.url_of(key))
        tmp = temp_path(target)
        try:

            def attempt() -> None:
                with open(tmp, "wb") as f:  # truncates what a failed attempt left
                    self._download_into(full, f if max_bytes is None else CappedWriter(f, max_bytes, self.url_of(key)))

            for n in range(1, max(1, check_attempts) + 1):
                self._call("download", key, attempt)
                if check is None:
                    break
                try:
                    check(tmp)
                    break
                except Exception:
                    if n >= check_attempts:
                        raise
            commit_temp(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return target

    def put_bytes(self, key: str, data: bytes) -> None:
        full = self._full(key)
        self._call("write", key, lambda: self._put_bytes(full, bytes(data)))

    def put_file(self, local: str | os.PathLike[str], key: str) -> None:
        full = self._full(key)
        size = os.path.getsize(local)
        if size > self.multipart_threshold:
            self._put_multipart(Path(local), full, key, size)
        else:
            with open(local, "rb") as f:
                data = f.read()
            self._call("upload", key, lambda: self._put_bytes(full, data))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        full = self._full(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        infos = self._call("list", prefix, lambda: self._list(full))
        assert isinstance(infos, list)
        return sorted((ObjectInfo(self._rel(i.key), i.size, i.etag, i.mtime, i.version) for i in infos), key=lambda i: i.key)

    def delete(self, key: str) -> None:
        full = self._full(key)
        self._call("delete", key, lambda: self._delete(full))

    def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.delete(key)

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        full = self._full(key)
        found = self._call("read", key, lambda: self._get_versioned(full))
        assert found is None or isinstance(found, tuple)
        return found

    def put_if(self, key: str, data: bytes, token: str | None) -> bool:
        full = self._full(key)
        written = self._call("conditional write", key, lambda: self._put_if(full, bytes(data), token))
        return bool(written)

    # ---------------------------------------------------------------- backend primitives (full keys)

    def _get_versioned(self, full_key: str) -> tuple[bytes, str] | None:
        raise NotImplementedError(f"{type(self).__name__} has no conditional writes")

    def _put_if(self, full_key: str, data: bytes, token: str | None) -> bool:
        raise NotImplementedError(f"{type(self).__name__} has no conditional writes")


    def _stat(self, full_key: str) -> ObjectInfo:
        raise NotImplementedError

    def _get_range(self, full_key: str, start: int, end: int | None) -> bytes:
        raise NotImplementedError

    def _download_into(self, full_key: str, f: IO[bytes]) -> None:
        raise NotImplementedError

    def _put_bytes(self, full_key: str, data: bytes) -> None:
        raise NotImplementedError

    def _put_multipart(self, local: Path, full_key: str, key: str, size: int) -> None:
        raise NotImplementedError

    def _list(self, full_prefix: str) -> list[ObjectInfo]:
        raise NotImplementedError

    def _delete(self, full_key: str) -> None:
        raise NotImplementedError


class CappedWriter:
    """A binary file that raises :class:`ObjectTooLargeError` when a write would end past ``limit`` bytes.

    Clients that download in parallel seek before each write; the check is on the position a write ends at.
    """

    def __init__(self, f: IO[bytes], limit: int, url: str) -> None:
        self._f, self._limit, self._url = f, limit, url

    def write(self, data: bytes) -> int:
        end = self._f.tell() + len(data)
        if end > self._limit:
            raise ObjectTooLargeError(f"{self._url} holds more than the {self._limit} bytes expected "
                                      f"(at least {end}); download stopped", self._url)
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)  # seek, tell, flush, seekable, fileno, ...


def read_part(local: Path, offset: int, length: int) -> bytes:
    """Bytes ``[offset, offset+length)`` of file ``local`` (a multipart part; each attempt re-reads it)."""
    with open(local, "rb") as f:
        f.seek(offset)
        return f.read(length)
