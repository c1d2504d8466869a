"""Where shards come from and go to: any URL smalti-storage opens, through smalti-storage.

Local paths, ``s3://``, ``gs://``, ``az://``/``azure://``, ``oci://`` and the schemes other distributions add
through the ``smalti.storage`` entry-point group. smalti-storage does the I/O: its one retry policy rides
out transient store errors within a time budget (``SMALTI_STORAGE_RETRY_BUDGET_S``, 120 s by default), with
jitter from a private generator, and a download appears under its real name only complete. What this module
adds is what streaming means by a download: a file that fails its check is fetched again (``retries``
times), a read that stalls longer than ``timeout`` seconds is abandoned and retried, and failures become
:class:`~smalti.streaming.errors.DownloadError`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from smalti.storage import ObjectNotFoundError, ObjectStore, StorageError, open_object, open_store
from smalti.streaming.errors import DownloadError


class Fetcher:
    """Downloads files of remote datasets, keeping one open store per dataset root in each process.

    A store's client is made once and reused by every download from that root (a client costs about a
    second to set up); a forked DataLoader worker, or an unpickled copy, opens its own.
    """

    def __init__(self, retries: int = 2, timeout: float = 60.0) -> None:
        self.retries, self.timeout = retries, timeout
        self._new_process()

    def _new_process(self) -> None:
        self._pid = os.getpid()
        self._stores: dict[str, ObjectStore] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"retries": self.retries, "timeout": self.timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._new_process()

    def store(self, root: str) -> ObjectStore:
        """The store rooted at ``root`` (a URL or a folder), opened once per process."""
        if os.getpid() != self._pid:  # forked: the parent's clients (and a lock it may hold) stay behind
            self._new_process()
        store = self._stores.get(root)
        if store is None:
            with self._lock:
                store = self._stores.get(root)
                if store is None:
                    try:
                        store = open_store(root, read_timeout_s=self.timeout)
                    except StorageError as exc:
                        raise DownloadError(f"cannot read {root}: {exc}") from exc
                    self._stores[root] = store
        return store

    def get_bytes(self, root: str, key: str) -> bytes:
        """The contents of ``key`` under ``root`` (a small file: an index)."""
        store = self.store(root)
        try:
            return store.get_bytes(key)
        except ObjectNotFoundError as exc:
            raise DownloadError(f"{store.url_of(key)} does not exist") from exc
        except StorageError as exc:
            raise DownloadError(f"could not download {store.url_of(key)}: {exc}") from exc

    def get(self, root: str, key: str, local: Path, check: Callable[[Path], None] | None = None,
            max_bytes: int | None = None) -> Path:
        """Download ``key`` under ``root`` to ``local`` atomically; see :func:`download_file` for ``check``.

        ``max_bytes`` (the size the index declares): a larger object is refused before its download, or at
        the first byte past it, instead of filling the cache's disk and being rejected by its hash after it
        (or, without hash checks, read with trailing bytes nobody wrote there)."""
        return _get(self.store(root), key, local, check, self.retries, max_bytes)


def _get(store: ObjectStore, key: str, local: Path, check: Callable[[Path], None] | None, retries: int,
         max_bytes: int | None = None) -> Path:
    try:
        return store.get_file(key, local, check=check, check_attempts=retries + 1, max_bytes=max_bytes)
    except ObjectNotFoundError as exc:
        raise DownloadError(f"{store.url_of(key)} does not exist") from exc
    except StorageError as exc:
        raise DownloadError(f"could not download {store.url_of(key)}: {exc}") from exc


def download_file(remote: str, local: Path, retries: int = 2, timeout: float = 60.0,
                  check: Callable[[Path], None] | None = None) -> Path:
    """Fetch one file ``remote`` (a URL or a local path) to ``local``, atomically.

    ``check(tmp_path)`` runs on the complete temporary file before it is renamed to ``local``; if it raises,
    the file is downloaded again, up to ``retries`` more times, and its error is raised when none is left.
    Transient store errors are retried by smalti-storage's retry policy; a read that stalls for ``timeout``
    seconds counts as one.
    """
    try:
        store, key = open_object(remote, read_timeout_s=timeout)
    except StorageError as exc:
        raise DownloadError(f"cannot read {remote}: {exc}") from exc
    return _get(store, key, Path(local), check, retries)
