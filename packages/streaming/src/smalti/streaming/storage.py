"""Where shards come from: local paths and ``s3://`` (boto3, honouring ``S3_ENDPOINT_URL``), behind one interface.

Other schemes can be added with :func:`register_backend`. Every download goes to a temporary name and is
renamed when complete, and is retried with exponential backoff on errors and time-outs.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from smalti.streaming.errors import DownloadError
from smalti.streaming.mds import temp_file

log = logging.getLogger(__name__)

Downloader = Callable[[str, Path, float], None]
_BACKENDS: dict[str, Downloader] = {}
_UPLOADERS: dict[str, Callable[[Path, str], None]] = {}
_local = threading.local()


def register_backend(scheme: str, download: Downloader, upload: Callable[[Path, str], None] | None = None) -> None:
    """Add a remote scheme (``"gs"``): ``download(remote, local_tmp_path, timeout_s)`` writes the file."""
    _BACKENDS[scheme] = download
    if upload is not None:
        _UPLOADERS[scheme] = upload


def _s3_client(timeout: float = 60.0):
    """A boto3 S3 client for this thread and process (a forked worker must not reuse its parent's connections)."""
    key = (os.getpid(), os.environ.get("S3_ENDPOINT_URL"), timeout)
    cache = getattr(_local, "clients", None)
    if cache is None:
        cache = _local.clients = {}
    if key not in cache:
        import boto3
        from botocore.config import Config

        cache[key] = boto3.session.Session().client(
            "s3", endpoint_url=key[1] or None,
            config=Config(connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": 1}),
        )
    return cache[key]


def _split_s3(url: str) -> tuple[str, str]:
    bucket, _, key = url[len("s3://") :].partition("/")
    return bucket, key


def _s3_download(remote: str, path: Path, timeout: float) -> None:
    bucket, key = _split_s3(remote)
    body = _s3_client(timeout).get_object(Bucket=bucket, Key=key)["Body"]
    with open(path, "wb") as f:
        shutil.copyfileobj(body, f, length=1 << 20)


def _s3_upload(path: Path, remote: str) -> None:
    bucket, key = _split_s3(remote)
    _s3_client().upload_file(str(path), bucket, key)


register_backend("s3", _s3_download, _s3_upload)


def _scheme(url: str) -> str | None:
    return url.split("://", 1)[0] if "://" in url else None


def download_file(remote: str, local: Path, retries: int = 2, timeout: float = 60.0,
                  check: Callable[[Path], None] | None = None) -> Path:
    """Fetch ``remote`` (URL or local path) to ``local``, atomically, with ``retries`` retries and backoff.

    ``check(tmp_path)`` runs on the complete temporary file before it is renamed to ``local``; if it raises,
    the download is retried, and its error is raised when no retry is left.
    """
    local.parent.mkdir(parents=True, exist_ok=True)
    scheme = _scheme(remote)
    if scheme is not None and scheme not in _BACKENDS:
        raise DownloadError(f"no storage backend for {scheme}:// (have: {', '.join(_BACKENDS)}); "
                            "register one with smalti.streaming.storage.register_backend")
    last: Exception | None = None
    for attempt in range(retries + 1):
        if attempt:
            delay = 2 ** (attempt - 1) * 0.25 + random.uniform(0, 0.25)
            log.warning("download of %s failed (%r); retry %d/%d in %.2f s", remote, last, attempt, retries, delay)
            time.sleep(delay)
        fd, name = temp_file(local)
        os.close(fd)
        tmp = Path(name)
        try:
            try:
                if scheme is None:
                    shutil.copyfile(remote, tmp)
                else:
                    _BACKENDS[scheme](remote, tmp, timeout)
            except FileNotFoundError as exc:
                raise DownloadError(f"{remote} does not exist") from exc
            except Exception as exc:
                if _is_missing(exc):
                    raise DownloadError(f"{remote} does not exist") from exc
                last = exc
                continue
            if check is not None:
                try:
                    check(tmp)
                except Exception as exc:
                    if attempt == retries:
                        raise
                    last = exc
                    continue
            os.replace(tmp, local)
            return local
        finally:
            tmp.unlink(missing_ok=True)
    raise DownloadError(f"could not download {remote} after {retries + 1} attempts: {last!r}") from last


def _is_missing(exc: Exception) -> bool:
    response = getattr(exc, "response", None)
    code = (response or {}).get("Error", {}).get("Code") if isinstance(response, dict) else None
    return code in ("NoSuchKey", "404", "NoSuchBucket")


def upload_file(local: Path, remote: str) -> None:
    """Copy ``local`` to ``remote`` (a path or a registered URL scheme)."""
    scheme = _scheme(remote)
    if scheme is None:
        Path(remote).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, remote)
        return
    if scheme not in _UPLOADERS:
        raise DownloadError(f"no upload backend for {scheme}://")
    _UPLOADERS[scheme](local, remote)
