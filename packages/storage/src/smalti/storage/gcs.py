"""``gs://bucket/prefix`` through google-cloud-storage.

``STORAGE_EMULATOR_HOST`` points the client at an emulator (anonymous credentials then); otherwise
credentials come from Google's Application Default Credentials chain. The client's own retries are
switched off (``retry=None`` on every call): smalti-storage's RetryPolicy is the only one.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import random
import shutil
import sys
import threading
from pathlib import Path
from typing import IO, Any

from smalti.storage.base import BaseStore, ObjectInfo
from smalti.storage.errors import (
    BucketNotFoundError,
    CredentialsError,
    MissingClientError,
    ObjectNotFoundError,
    PermissionDeniedError,
    StorageError,
)
from smalti.storage.retry import RetryPolicy, _brief, is_transient_status

GCS_CHAIN = (
    "GOOGLE_APPLICATION_CREDENTIALS (a service-account or workload-identity-federation JSON file), the gcloud "
    "application-default credentials (~/.config/gcloud/application_default_credentials.json, written by "
    "`gcloud auth application-default login`), and the GCE/GKE metadata server (attached service account, "
    "workload identity); STORAGE_EMULATOR_HOST selects an emulator instead"
)
_CHUNK = 256 << 10  # resumable-upload chunks are multiples of 256 KiB
_BOUNDARY_RNG = random.Random()


def _import_gcs() -> Any:
    try:
        storage = importlib.import_module("google.cloud.storage")
    except ImportError:
        raise MissingClientError(
            'gs:// needs google-cloud-storage, which is not installed: pip install "smalti-storage[gcs]"'
        ) from None
    _private_boundaries()
    return storage


def _private_boundaries() -> None:
    """google-cloud-storage draws each multipart upload's MIME boundary from the global ``random``; give it a
    generator of its own so uploads never shift a training run's Python RNG stream (only uniqueness matters)."""
    for name in ("google.cloud.storage._media._upload", "google.resumable_media._upload"):
        module = sys.modules.get(name)
        if module is None:
            with contextlib.suppress(ImportError):
                module = importlib.import_module(name)
        if module is not None and getattr(module, "random", None) is random:
            module.random = _BOUNDARY_RNG


class GcsStore(BaseStore):
    """Objects under ``gs://bucket/prefix``.

    Commit semantics: an upload (single request or resumable, in ``part_size`` chunks) creates a new
    generation atomically when its last byte lands; readers see the previous generation until then. No
    multi-object transaction: the manifest put last is the commit. A failed resumable upload is restarted
    whole by the retry policy.
    """

    scheme = "gs"
    commit_semantics = "an upload publishes a new generation atomically; the manifest put last is the commit"

    def __init__(
        self,
        url: str,
        bucket: str,
        prefix: str = "",
        project: str | None = None,
        timeout_s: float = 60.0,
        read_timeout_s: float | None = None,
        retry: RetryPolicy | None = None,
        **options: int,
    ) -> None:
        super().__init__(url, bucket, prefix, retry=retry, **options)
        if not bucket:
            raise StorageError(f"{url!r} names no bucket; write gs://bucket/prefix", url)
        self.project = project
        self.timeout_s = timeout_s if read_timeout_s is None else read_timeout_s  # the name S3Store uses
        self.emulator = os.environ.get("STORAGE_EMULATOR_HOST") or None
        self._local = threading.local()
        _import_gcs()

    @property
    def client(self) -> Any:
        """This thread's client (google-cloud-storage's HTTP session is not shared between threads)."""
        pid = os.getpid()
        if getattr(self._local, "pid", None) != pid:
            storage = _import_gcs()
            if self.emulator:
                from google.auth.credentials import AnonymousCredentials

                client = storage.Client(
                    project=self.project or os.environ.get("GOOGLE_CLOUD_PROJECT") or "smalti",
                    credentials=AnonymousCredentials(),
                    client_options={"api_endpoint": self.emulator},
                )
            else:
                client = storage.Client(project=self.project)
            if getattr(client, "_bucket_metadata_cache", None) is not None:
                # a tracing aid (google-cloud-storage 3.x) that fetches bucket metadata on a background thread
                # with the library's own retries (and the global `random`): an extra request per bucket that
                # bypasses RetryPolicy; smalti reports no traces, so it is switched off
                client._bucket_metadata_cache = None
            self._local.client, self._local.pid = client, pid
        return self._local.client

    def _blob(self, full_key: str) -> Any:
        return self.client.bucket(self.bucket).blob(full_key)

    # ---------------------------------------------------------------- errors

    def _is_transient(self, exc: BaseException) -> bool:
        from google.api_core import exceptions as gx
        from google.auth import exceptions as ax

        if isinstance(exc, gx.GoogleAPICallError):
            return is_transient_status(getattr(exc, "code", None))
        if isinstance(exc, ax.DefaultCredentialsError):
            return False
        if isinstance(exc, (ax.TransportError, ConnectionError, TimeoutError)):
            return True
        import requests

        if isinstance(exc, (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)):
            return True
        response = getattr(exc, "response", None)  # resumable-media's InvalidResponse / DataCorruption
        status = getattr(response, "status_code", None)
        return is_transient_status(status) or type(exc).__name__ == "DataCorruption"

    def _translate(self, exc: Exception, url: str, key: str) -> StorageError:
        from google.api_core import exceptions as gx
        from google.auth import exceptions as ax

        if isinstance(exc, ax.DefaultCredentialsError):
            return CredentialsError(f"no Google Cloud credentials for {url}; looked for {GCS_CHAIN}", url)
        if isinstance(exc, gx.NotFound):
            if not self._bucket_exists():
                where = f" at {self.emulator}" if self.emulator else ""
                return BucketNotFoundError(
                    f"bucket {self.bucket!r}{where} does not exist (for {url}); create it or fix the URL", url
                )
            return ObjectNotFoundError(f"{url} does not exist", url)
        if isinstance(exc, (gx.Forbidden, gx.Unauthorized)):
            return PermissionDeniedError(f"{url}: access denied ({_brief(exc)}); credentials chain: {GCS_CHAIN}", url)
        return StorageError(f"{url}: {_brief(exc)}", url)

    def _bucket_exists(self) -> bool:
        try:
            return bool(self.client.bucket(self.bucket).exists(retry=None, timeout=self.timeout_s))
        except Exception:
            return True

    # ---------------------------------------------------------------- primitives

    @staticmethod
    def _info(blob: Any) -> ObjectInfo:
        return ObjectInfo(
            blob.name, int(blob.size or 0), blob.etag or blob.md5_hash,
            blob.updated.timestamp() if blob.updated else None,
            str(blob.generation) if blob.generation is not None else None,
        )

    def _stat(self, full_key: str) -> ObjectInfo:
        blob = self._blob(full_key)
        blob.reload(retry=None, timeout=self.timeout_s)
        return self._info(blob)

    def _get_range(self, full_key: str, start: int, end: int | None) -> bytes:
        ranged = bool(start) or end is not None
        return self._blob(full_key).download_as_bytes(
            start=start or None, end=None if end is None else end - 1, retry=None, timeout=self.timeout_s,
            checksum=None if ranged else "auto",
        )

    def _download_into(self, full_key: str, f: IO[bytes]) -> None:
        self._blob(full_key).download_to_file(f, retry=None, timeout=self.timeout_s)

    def _put_bytes(self, full_key: str, data: bytes) -> None:
        self._blob(full_key).upload_from_string(data, retry=None, timeout=self.timeout_s)

    def _get_versioned(self, full_key: str) -> tuple[bytes, str] | None:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        bucket = self.client.bucket(self.bucket)
        while True:
            blob = bucket.get_blob(full_key, retry=None, timeout=self.timeout_s)
            if blob is None:
                return None
            if blob.generation is None:
                raise StorageError(f"gs://{self.bucket}/{full_key}: the server reports no object generation, so a "
                                   "conditional write cannot be made (an emulator without generations?)",
                                   f"gs://{self.bucket}/{full_key}")
            try:  # the bytes of exactly the generation stat'ed, so the token matches the content
                data = blob.download_as_bytes(if_generation_match=blob.generation, retry=None, timeout=self.timeout_s)
            except (PreconditionFailed, NotFound):
                continue  # replaced or deleted between the two requests: read again
            return data, str(blob.generation)

    def _put_if(self, full_key: str, data: bytes, token: str | None) -> bool:
        # generation preconditions: 0 means "only if no live object"
        from google.api_core.exceptions import PreconditionFailed

        try:
            self._blob(full_key).upload_from_string(
                data, if_generation_match=int(token) if token else 0, retry=None, timeout=self.timeout_s
            )
        except PreconditionFailed:
            return False
        return True

    def _put_multipart(self, local: Path, full_key: str, key: str, size: int) -> None:
        chunk = max(_CHUNK, self.part_size // _CHUNK * _CHUNK)

        def upload() -> None:
            # a resumable upload, one request per chunk; the object appears when the writer closes
            with open(local, "rb") as src, self._blob(full_key).open(
                "wb", chunk_size=chunk, retry=None, ignore_flush=True, timeout=self.timeout_s
            ) as dst:
                shutil.copyfileobj(src, dst, length=chunk)

        self._call("upload", key, upload)

    def _list(self, full_prefix: str) -> list[ObjectInfo]:
        blobs = self.client.list_blobs(self.bucket, prefix=full_prefix or None, retry=None, timeout=self.timeout_s)
        return [self._info(b) for b in blobs]

    def _delete(self, full_key: str) -> None:
        from google.api_core.exceptions import NotFound

        with contextlib.suppress(NotFound):
            self._blob(full_key).delete(retry=None, timeout=self.timeout_s)
