"""Where checkpoints live: any folder URL smalti-storage opens (a path, ``s3://``, ``gs://``, ``az://``, ``oci://``).

:class:`CheckpointStore` speaks in checkpoint folder names and paths relative to the save folder, over one
:class:`smalti.storage.ObjectStore`. Every call goes through smalti-storage's retry policy (a time budget,
120 s by default); what outlasts it becomes :class:`CheckpointUploadError`. No object store has a rename, so
a checkpoint becomes visible only when its manifest is put, after every other file (the same on a local
folder, where files are written in place and the manifest last).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from smalti.checkpoint.errors import CheckpointCorruptError, CheckpointError, CheckpointUploadError
from smalti.checkpoint.manifest import algorithm_of, hash_file, mismatch, parse_manifest, write_json_atomic
from smalti.checkpoint.naming import LATEST_NAME, MANIFEST_NAME, checkpoint_names
from smalti.checkpoint.safe_load import check_inside, no_link_inside
from smalti.storage import ObjectNotFoundError, ObjectTooLargeError, RetryPolicy, StorageError, split_url
from smalti.storage import open_store as _open_object_store

# the per-request time-out option of each built-in backend
_TIMEOUT_OPTION = {"s3": "read_timeout_s", "oci": "read_timeout_s", "gs": "timeout_s", "az": "timeout_s",
                   "azure": "timeout_s"}
_MIN_PART = 5 << 20  # S3's smallest multipart part


def is_remote(url: str | os.PathLike[str]) -> bool:
    """Whether ``url`` names an object store (``s3://``, ``gs://``, ...) rather than a local path."""
    return split_url(str(url))[0] != "file"


@contextlib.contextmanager
def _transport(what: str, path: str) -> Iterator[None]:
    """Turn what the storage layer raises (after its retries) into :class:`CheckpointUploadError`."""
    try:
        yield
    except ObjectNotFoundError:
        raise
    except StorageError as exc:  # its message names the operation, the URL and the fix
        raise CheckpointUploadError(str(exc) or f"{what} failed", path) from exc


class CheckpointStore:
    """The checkpoints under one save folder, local or remote.

    Args:
        url: the save folder: a path, ``file://``, or ``scheme://bucket/prefix`` of any smalti-storage scheme.
        retry_budget_s: seconds an object-store call may keep retrying (``None``: smalti-storage's default,
            120 s or ``SMALTI_STORAGE_RETRY_BUDGET_S``). Local folders are not retried.
        multipart_threshold_mb: files above this size upload in parts of this size (at least 5 MiB).
        timeout_s: per-request time-out of the object store's client.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        retry_budget_s: float | None = None,
        multipart_threshold_mb: int = 64,
        timeout_s: float = 60,
    ) -> None:
        text = str(url)
        scheme = split_url(text)[0]
        self.remote = scheme != "file"
        options: dict[str, Any] = {}
        if self.remote:
            threshold = int(multipart_threshold_mb) << 20
            options = {"retry": RetryPolicy(budget_s=retry_budget_s), "multipart_threshold": threshold,
                       "part_size": max(threshold, _MIN_PART)}
            if scheme in _TIMEOUT_OPTION:
                options[_TIMEOUT_OPTION[scheme]] = timeout_s
        try:
            self.objects = _open_object_store(text, **options)
        except StorageError as exc:
            raise CheckpointError(f"checkpoint folder {text!r}: {exc}") from None
        self.url = self.objects.url.rstrip("/") if self.remote else str(Path(split_url(text)[2] or "."))
        self.root = None if self.remote else Path(self.url)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    def _where(self, rel: str) -> str:
        return f"{self.url}/{rel}"

    # ------------------------------------------------------------------ local folders

    def folder(self, name: str) -> Path:
        """The local path of checkpoint ``name`` (local stores only)."""
        if self.root is None:
            raise CheckpointError(f"{self.url} is an object store: its checkpoints have no local folder")
        return self.root / name

    def staging(self, name: str, cache_dir: Path) -> Path:
        """Where a save of ``name`` writes its files: in place locally, else a folder under ``cache_dir``."""
        return cache_dir / "staging" / name if self.remote else self.folder(name)

    def release_staging(self, staging: Path) -> None:
        """Remove a remote save's local staging folder once the save is over (a local save *is* its folder)."""
        if self.remote:
            shutil.rmtree(staging, ignore_errors=True)

    def same_folder(self, url: str) -> bool:
        """Whether ``url`` names this save folder."""
        if self.remote:
            return is_remote(url) and url.rstrip("/") == self.url
        assert self.root is not None
        return not is_remote(url) and Path(split_url(url)[2]).resolve() == self.root.resolve()

    # ------------------------------------------------------------------ listing and reading

    def list_names(self) -> list[str]:
        """Checkpoint folder names present (committed or not), oldest first."""
        if self.root is not None:
            # the folders themselves: an empty leftover counts too, and no walk over every file on a shared FS
            return checkpoint_names([p.name for p in self.root.iterdir() if p.is_dir()]) if self.root.is_dir() else []
        with _transport(f"listing {self.url}/", self.url):
            try:
                keys = [info.key for info in self.objects.list("")]
            except ObjectNotFoundError:
                return []
        return checkpoint_names(sorted({key.split("/", 1)[0] for key in keys if "/" in key}))

    def read_bytes(self, rel: str) -> bytes | None:
        """The object's bytes, or ``None`` when it does not exist."""
        with _transport(f"reading {self._where(rel)}", self._where(rel)):
            try:
                return self.objects.get_bytes(rel)
            except ObjectNotFoundError:
                return None

    def read_manifest(self, name: str) -> dict[str, Any] | None:
        """The parsed manifest of ``name``, ``None`` when it has none; raises when it is invalid."""
        raw = self.read_bytes(f"{name}/{MANIFEST_NAME}")
        return None if raw is None else parse_manifest(raw, self._where(f"{name}/{MANIFEST_NAME}"))

    # ------------------------------------------------------------------ writing

    def put_bytes(self, rel: str, data: bytes) -> None:
        """Put a small object (atomic per object)."""
        with _transport(f"writing {self._where(rel)}", self._where(rel)):
            self.objects.put_bytes(rel, data)

    def write_manifest(self, name: str, manifest: dict[str, Any]) -> None:
        """Put ``name``'s manifest: the commit, so only after every other file of the checkpoint."""
        self.put_bytes(f"{name}/{MANIFEST_NAME}", json.dumps(manifest, indent=1, sort_keys=True).encode())

    def write_latest(self, name: str) -> None:
        """Point ``latest`` at checkpoint ``name``."""
        self.put_bytes(LATEST_NAME, (name + "\n").encode())

    def upload_file(self, local: Path, rel: str) -> None:
        """Upload ``local`` to ``rel`` (in parts above the threshold), then check the stored size."""
        target = self._where(rel)
        size = local.stat().st_size
        with _transport(f"uploading {local} to {target}", target):
            self.objects.put_file(local, rel)
            stored = self.objects.stat(rel).size
        if stored != size:
            raise CheckpointUploadError(f"{target} holds {stored} bytes after upload, expected {size}", target)

    def publish(self, staging: Path, name: str, rel: str) -> None:
        """Make file ``rel`` of a save staged in ``staging`` part of checkpoint ``name`` (locally: already is)."""
        if self.remote:
            self.upload_file(staging / rel, f"{name}/{rel}")

    def download(self, rel: str, local: Path, size: int | None = None) -> None:
        """Download ``rel`` to ``local`` atomically (temp name, fsync, rename); ``size``: what the manifest
        lists, so that a larger object is refused before (or while) it is downloaded, not after."""
        local.parent.mkdir(parents=True, exist_ok=True)
        with _transport(f"downloading {self._where(rel)}", self._where(rel)):
            try:
                self.objects.get_file(rel, local, max_bytes=size)
            except ObjectTooLargeError as exc:
                raise CheckpointCorruptError(
                    f"checkpoint file {self._where(rel)} is larger than the {size} bytes its manifest lists; "
                    f"not downloaded ({exc})", self._where(rel)
                ) from None
            except ObjectNotFoundError:
                # a file the manifest lists is gone: the checkpoint is damaged, not the connection
                raise CheckpointCorruptError(
                    f"checkpoint file {self._where(rel)} listed in the manifest is missing", self._where(rel)
                ) from None

    def download_checkpoint(self, name: str, dest: Path, manifest: dict[str, Any]) -> None:
        """Fetch every file the manifest lists (and the manifest, last) into local folder ``dest``."""
        for rel, entry in manifest["files"].items():
            local = dest / check_inside(rel, f"manifest {self._where(f'{name}/{MANIFEST_NAME}')}")
            with contextlib.suppress(FileNotFoundError):  # a link planted in the cache: never written through
                no_link_inside(dest, rel, "in the download cache")
            if (local.is_file() and local.stat().st_size == entry["size"]
                    and mismatch(local, entry, hash_file(local, algorithm_of(entry))[1]) is None):
                continue  # already here from an earlier download
            self.download(f"{name}/{rel}", local, size=int(entry["size"]))
        write_json_atomic(dest / MANIFEST_NAME, manifest)

    def local_copy(self, name: str, cache_dir: Path, manifest: dict[str, Any]) -> Path:
        """A local folder holding checkpoint ``name``: itself, or a download under ``cache_dir``."""
        if not self.remote:
            return self.folder(name)
        folder = cache_dir / name
        self.download_checkpoint(name, folder, manifest)
        return folder

    def delete(self, name: str) -> None:
        """Delete checkpoint ``name``: the manifest first, so a crash mid-way leaves an uncommitted folder."""
        with _transport(f"deleting {self.url}/{name}/", self._where(name)):
            self.objects.delete(f"{name}/{MANIFEST_NAME}")
            self.objects.delete_many([info.key for info in self.objects.list(f"{name}/")])
        if self.root is not None:
            shutil.rmtree(self.root / name, ignore_errors=True)  # empty folders and temp files left


Store = CheckpointStore


def open_store(url: str | os.PathLike[str], **options: Any) -> CheckpointStore:
    """The :class:`CheckpointStore` of save folder ``url``; ``options`` as :class:`CheckpointStore` takes them."""
    return CheckpointStore(url, **options)
