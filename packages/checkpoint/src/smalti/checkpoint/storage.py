"""Where checkpoints live: a local folder or ``s3://bucket/prefix`` (boto3, honouring ``S3_ENDPOINT_URL``).

Both stores speak in checkpoint folder names and paths relative to the save folder. Remote writes are
whole-file uploads with retries (multipart above a threshold) and a size check afterwards; S3 has no
rename, so a checkpoint becomes visible only when its manifest object is put, after every other file.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from smalti.checkpoint.errors import CheckpointCorruptError, CheckpointUploadError
from smalti.checkpoint.manifest import parse_manifest, write_json_atomic
from smalti.checkpoint.naming import LATEST_NAME, MANIFEST_NAME, checkpoint_names
from smalti.checkpoint.safe_load import check_inside

log = logging.getLogger(__name__)
T = TypeVar("T")


def is_remote(url: str) -> bool:
    """Whether ``url`` names an object store (``s3://``) rather than a local path."""
    return str(url).startswith("s3://")


class LocalStore:
    """Checkpoints in a local (or shared) directory."""

    remote = False

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = str(self.root)

    def folder(self, name: str) -> Path:
        """The local path of checkpoint ``name``."""
        return self.root / name

    def list_names(self) -> list[str]:
        """Checkpoint folder names present (committed or not), oldest first."""
        if not self.root.is_dir():
            return []
        return checkpoint_names([p.name for p in self.root.iterdir() if p.is_dir()])

    def read_manifest(self, name: str) -> dict[str, Any] | None:
        """The parsed manifest of ``name``, ``None`` when it has none; raises when it is invalid."""
        path = self.root / name / MANIFEST_NAME
        if not path.is_file():
            return None
        return parse_manifest(path.read_bytes(), str(path))

    def write_latest(self, name: str) -> None:
        """Point ``latest`` at checkpoint ``name``."""
        write_json_atomic(self.root / LATEST_NAME, name + "\n")

    def read_latest(self) -> str | None:
        path = self.root / LATEST_NAME
        return path.read_text().strip() or None if path.is_file() else None

    def delete(self, name: str) -> None:
        """Delete checkpoint ``name``: the manifest first, so a crash mid-way leaves an uncommitted folder."""
        folder = self.root / name
        (folder / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)


class S3Store:
    """Checkpoints under ``s3://bucket/prefix/``; the endpoint comes from ``S3_ENDPOINT_URL`` when set."""

    remote = True

    def __init__(
        self,
        url: str,
        retries: int = 5,
        multipart_threshold_mb: int = 64,
        timeout_s: float = 60,
        endpoint_url: str | None = None,
    ) -> None:
        if not is_remote(url):
            raise ValueError(f"{url!r} is not an s3:// URL")
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise CheckpointUploadError(f"save folder {url!r} names no bucket; use s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.retries = retries
        self.multipart_threshold = multipart_threshold_mb << 20
        self.timeout_s = timeout_s
        self.endpoint_url = endpoint_url or os.environ.get("S3_ENDPOINT_URL") or None
        self._client: Any = None

    # ------------------------------------------------------------------ plumbing

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.client(
                "s3",
                endpoint_url=self.endpoint_url,
                config=Config(
                    retries={"max_attempts": 3, "mode": "standard"},
                    connect_timeout=min(self.timeout_s, 10),
                    read_timeout=self.timeout_s,
                ),
            )
        return self._client

    def key(self, rel: str) -> str:
        """The object key of ``rel`` (a path relative to the save folder)."""
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _retry(self, what: str, fn: Callable[[], T], path: str | None = None) -> T:
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        delay = 0.2
        for attempt in range(1, self.retries + 1):
            try:
                return fn()
            except (Boto3Error, BotoCoreError, ClientError, OSError, CheckpointUploadError) as exc:
                code = getattr(exc, "response", {}).get("Error", {}).get("Code") if isinstance(exc, ClientError) else None
                if code in ("NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "NoSuchKey", "404"):
                    raise CheckpointUploadError(f"{what} failed: {exc}", path) from exc
                if attempt == self.retries:
                    raise CheckpointUploadError(f"{what} failed after {self.retries} attempts: {exc}", path) from exc
                log.warning("%s failed (attempt %d of %d): %s; retrying", what, attempt, self.retries, exc)
                time.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ listing and reading

    def list_names(self) -> list[str]:
        """Checkpoint folder names present under the prefix (committed or not), oldest first."""

        def run() -> list[str]:
            names = []
            paginator = self.client.get_paginator("list_objects_v2")
            prefix = f"{self.prefix}/" if self.prefix else ""
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/"):
                for entry in page.get("CommonPrefixes", []):
                    names.append(entry["Prefix"][len(prefix) :].rstrip("/"))
            return names

        return checkpoint_names(self._retry(f"listing {self.url}/", run))

    def read_bytes(self, rel: str) -> bytes | None:
        """The object's bytes, or ``None`` when it does not exist."""
        from botocore.exceptions import ClientError

        def run() -> bytes | None:
            try:
                return self.client.get_object(Bucket=self.bucket, Key=self.key(rel))["Body"].read()
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None
                raise

        return self._retry(f"reading {self.url}/{rel}", run, f"{self.url}/{rel}")

    def read_manifest(self, name: str) -> dict[str, Any] | None:
        """The parsed manifest of ``name``, ``None`` when it has none; raises when it is invalid."""
        raw = self.read_bytes(f"{name}/{MANIFEST_NAME}")
        return None if raw is None else parse_manifest(raw, f"{self.url}/{name}/{MANIFEST_NAME}")

    def read_latest(self) -> str | None:
        raw = self.read_bytes(LATEST_NAME)
        return raw.decode().strip() or None if raw else None

    # ------------------------------------------------------------------ writing

    def upload_file(self, local: Path, rel: str) -> None:
        """Upload ``local`` to ``rel`` (multipart above the threshold), then check the stored size."""
        from boto3.s3.transfer import TransferConfig

        size = local.stat().st_size
        config = TransferConfig(
            multipart_threshold=self.multipart_threshold,
            multipart_chunksize=max(self.multipart_threshold, 5 << 20),
            max_concurrency=4,
        )
        target = f"{self.url}/{rel}"

        def run() -> None:
            self.client.upload_file(str(local), self.bucket, self.key(rel), Config=config)
            stored = self.client.head_object(Bucket=self.bucket, Key=self.key(rel))["ContentLength"]
            if stored != size:
                raise CheckpointUploadError(f"{target} holds {stored} bytes after upload, expected {size}", target)

        self._retry(f"uploading {local} to {target}", run, target)

    def put_bytes(self, rel: str, data: bytes) -> None:
        """Put a small object."""
        self._retry(
            f"writing {self.url}/{rel}",
            lambda: self.client.put_object(Bucket=self.bucket, Key=self.key(rel), Body=data),
            f"{self.url}/{rel}",
        )

    def write_latest(self, name: str) -> None:
        """Point the remote ``latest`` object at checkpoint ``name``."""
        self.put_bytes(LATEST_NAME, (name + "\n").encode())

    def download(self, rel: str, local: Path) -> None:
        """Download ``rel`` to ``local`` through a temp name."""
        from botocore.exceptions import ClientError

        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.part-{os.getpid()}")

        def run() -> None:
            try:
                self.client.download_file(self.bucket, self.key(rel), str(tmp))
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    # a file the manifest lists is gone: the checkpoint is damaged, not the connection
                    raise CheckpointCorruptError(
                        f"checkpoint file {self.url}/{rel} listed in the manifest is missing", f"{self.url}/{rel}"
                    ) from None
                raise

        try:
            self._retry(f"downloading {self.url}/{rel}", run, f"{self.url}/{rel}")
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)

    def download_checkpoint(self, name: str, dest: Path, manifest: dict[str, Any]) -> None:
        """Fetch every file the manifest lists (and the manifest, last) into local folder ``dest``."""
        from smalti.checkpoint.manifest import hash_file

        for rel, entry in manifest["files"].items():
            local = dest / check_inside(rel, f"manifest {self.url}/{name}/{MANIFEST_NAME}")
            if local.is_file() and local.stat().st_size == entry["size"] and hash_file(local)[1] == entry["sha256"]:
                continue  # already here from an earlier download
            self.download(f"{name}/{rel}", local)
        write_json_atomic(dest / MANIFEST_NAME, manifest)

    def delete(self, name: str) -> None:
        """Delete checkpoint ``name``: the manifest object first, then the rest of its objects."""
        self._retry(
            f"deleting {self.url}/{name}/{MANIFEST_NAME}",
            lambda: self.client.delete_object(Bucket=self.bucket, Key=self.key(f"{name}/{MANIFEST_NAME}")),
        )

        def run() -> None:
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.key(name) + "/"):
                keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
                if keys:
                    self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})

        self._retry(f"deleting {self.url}/{name}/", run)


Store = LocalStore | S3Store


def open_store(url: str | os.PathLike[str], **s3_options: Any) -> Store:
    """A :class:`LocalStore` or :class:`S3Store` for ``url``."""
    url = str(url)
    return S3Store(url, **s3_options) if is_remote(url) else LocalStore(url)

