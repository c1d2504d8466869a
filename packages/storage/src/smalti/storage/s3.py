"""``s3://bucket/prefix`` through boto3: AWS and any S3-compatible endpoint (MinIO, R2, Ceph, OCI's compat API).

The endpoint is the ``endpoint_url`` argument, else ``S3_ENDPOINT_URL``, else boto3's own choice (which
honours ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``). Credentials come from boto3's chain. boto3's own
retries are switched off: smalti-storage's :class:`~smalti.storage.retry.RetryPolicy` is the only one.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from smalti.storage.base import BaseStore, ObjectInfo, PerProcess, read_part
from smalti.storage.errors import (
    BucketNotFoundError,
    CredentialsError,
    IntegrityError,
    MissingClientError,
    ObjectNotFoundError,
    PermissionDeniedError,
    StorageError,
)
from smalti.storage.retry import RetryPolicy, _brief, is_transient_status

AWS_CHAIN = (
    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (with AWS_SESSION_TOKEN), the profile AWS_PROFILE names in "
    "~/.aws/credentials and ~/.aws/config (or AWS_SHARED_CREDENTIALS_FILE / AWS_CONFIG_FILE), web identity "
    "(AWS_WEB_IDENTITY_TOKEN_FILE, as on EKS), container credentials (AWS_CONTAINER_CREDENTIALS_*), and the "
    "EC2 instance metadata service"
)
_THROTTLE = {"Throttling", "ThrottlingException", "SlowDown", "RequestLimitExceeded", "TooManyRequestsException",
             "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable", "ServerBusy"}
_MAX_DELETE = 1000


def _import_boto3() -> Any:
    try:
        boto3 = importlib.import_module("boto3")
    except ImportError:
        raise MissingClientError(
            's3:// and oci:// need boto3, which is not installed: pip install "smalti-storage[s3]"'
        ) from None
    return boto3


class S3Store(BaseStore):
    """Objects under ``s3://bucket/prefix``.

    Commit semantics: a PUT is atomic per object; a multipart upload is invisible until
    CompleteMultipartUpload, which publishes the whole object at once (an aborted one leaves nothing).
    S3 has no rename and no multi-object transaction: the manifest put last is the commit.
    """

    scheme = "s3"
    commit_semantics = "put and completed multipart upload are atomic per object; the manifest put last is the commit"
    credentials_chain = AWS_CHAIN

    def __init__(
        self,
        url: str,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        addressing_style: str | None = None,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
        max_concurrency: int = 4,
        retry: RetryPolicy | None = None,
        **options: int,
    ) -> None:
        super().__init__(url, bucket, prefix, retry=retry, **options)
        if not bucket:
            raise StorageError(f"{url!r} names no bucket; write {self.scheme}://bucket/prefix", url)
        self.endpoint_url = endpoint_url or os.environ.get("S3_ENDPOINT_URL") or None
        self.region = region
        self.profile = profile
        self._keys = (access_key_id, secret_access_key)
        self.addressing_style = addressing_style
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_concurrency = max(1, max_concurrency)
        self._client = PerProcess(self._make_client)
        _import_boto3()  # fail at open time, naming the extra, rather than at the first read

    @property
    def client(self) -> Any:
        """This process's boto3 client (thread-safe; a forked child makes its own)."""
        return self._client.get()

    def _make_client(self) -> Any:
        boto3 = _import_boto3()
        from botocore.config import Config

        session = boto3.session.Session(
            profile_name=self.profile, aws_access_key_id=self._keys[0], aws_secret_access_key=self._keys[1]
        )
        s3_options = {"addressing_style": self.addressing_style} if self.addressing_style else None
        config = Config(
            retries={"max_attempts": 1, "mode": "standard"},
            connect_timeout=self.connect_timeout_s,
            read_timeout=self.read_timeout_s,
            max_pool_connections=max(10, 2 * self.max_concurrency),
            s3=s3_options,
        )
        client = session.client("s3", endpoint_url=self.endpoint_url, region_name=self.region, config=config)
        # Even at max_attempts=1 botocore's retry handler draws a backoff from the global `random` on every
        # failure; with it gone, RetryPolicy is the only retry logic and the global stream is never touched.
        name = client.meta.service_model.service_id.hyphenize()
        client.meta.events.unregister(f"needs-retry.{name}", unique_id=f"retry-config-{name}")
        return client

    # ---------------------------------------------------------------- errors

    def _is_transient(self, exc: BaseException) -> bool:
        from botocore import exceptions as bx

        if isinstance(exc, bx.ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return is_transient_status(status) or exc.response.get("Error", {}).get("Code") in _THROTTLE
        if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError)):
            return False
        transient = (bx.ConnectionError, bx.HTTPClientError, bx.ResponseStreamingError, ConnectionError, TimeoutError)
        if isinstance(exc, transient):
            return True
        with contextlib.suppress(ImportError):
            from urllib3.exceptions import HTTPError as Urllib3Error

            return isinstance(exc, Urllib3Error)
        return False

    def _where(self) -> str:
        return f" at {self.endpoint_url}" if self.endpoint_url else ""

    def _translate(self, exc: Exception, url: str, key: str) -> StorageError:
        from botocore import exceptions as bx

        if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError)):
            return CredentialsError(
                f"no usable credentials for {url} ({_brief(exc)}); looked for {self.credentials_chain}", url
            )
        if isinstance(exc, bx.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code == "NoSuchBucket":
                return self._no_bucket(url)
            if code in ("NoSuchKey", "404", "NotFound"):
                return self._no_bucket(url) if not self._bucket_exists() else ObjectNotFoundError(
                    f"{url} does not exist", url
                )
            if code in ("AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return PermissionDeniedError(
                    f"{url}: access denied ({code}); check the credentials found in {self.credentials_chain}", url
                )
        return StorageError(f"{url}: {_brief(exc)}", url)

    def _no_bucket(self, url: str) -> BucketNotFoundError:
        return BucketNotFoundError(
            f"bucket {self.bucket!r}{self._where()} does not exist (for {url}); create it or fix the URL", url
        )

    def _bucket_exists(self) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            return str(exc.response.get("Error", {}).get("Code")) not in ("404", "NoSuchBucket", "NotFound")
        except Exception:
            return True  # cannot tell (the store is flaky): report the object, not the bucket
        return True

    # ---------------------------------------------------------------- primitives

    def _stat(self, full_key: str) -> ObjectInfo:
        head = self.client.head_object(Bucket=self.bucket, Key=full_key)
        modified = head.get("LastModified")
        return ObjectInfo(
            full_key, int(head["ContentLength"]), str(head.get("ETag", "")).strip('"') or None,
            modified.timestamp() if modified else None, head.get("VersionId"),
        )

    def _get_range(self, full_key: str, start: int, end: int | None) -> bytes:
        extra = {}
        if start or end is not None:
            extra["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        return self.client.get_object(Bucket=self.bucket, Key=full_key, **extra)["Body"].read()

    def _download_into(self, full_key: str, f: IO[bytes]) -> None:
        body = self.client.get_object(Bucket=self.bucket, Key=full_key)["Body"]
        shutil.copyfileobj(body, f, length=1 << 20)

    def _get_versioned(self, full_key: str) -> tuple[bytes, str] | None:
        from botocore.exceptions import ClientError

        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=full_key)
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code", "")) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        return obj["Body"].read(), str(obj["ETag"])

    def _put_if(self, full_key: str, data: bytes, token: str | None) -> bool:
        # S3 conditional writes (2024; botocore >= 1.35.69): If-Match on the ETag read, If-None-Match: * to create
        from botocore.exceptions import ClientError

        condition = {"IfMatch": token} if token else {"IfNoneMatch": "*"}
        try:
            self.client.put_object(Bucket=self.bucket, Key=full_key, Body=data, **condition)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                return False
            raise
        return True

    def _put_bytes(self, full_key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=full_key, Body=data)

    def _put_multipart(self, local: Path, full_key: str, key: str, size: int) -> None:
        from botocore.exceptions import ClientError

        created = self._call("start multipart upload of", key,
                             lambda: self.client.create_multipart_upload(Bucket=self.bucket, Key=full_key))
        upload_id = created["UploadId"]  # type: ignore[index]
        offsets = list(range(0, size, self.part_size))

        def part(number: int, offset: int) -> dict[str, Any]:
            def send() -> dict[str, Any]:
                body = read_part(local, offset, min(self.part_size, size - offset))
                answer = self.client.upload_part(Bucket=self.bucket, Key=full_key, UploadId=upload_id,
                                                 PartNumber=number, Body=body)
                return {"PartNumber": number, "ETag": answer["ETag"]}

            return self._call(f"upload part {number} of {len(offsets)} of", key, send)  # type: ignore[return-value]

        def complete() -> None:
            try:
                self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=full_key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                )
            except ClientError as exc:
                # an earlier attempt completed it but its answer was lost: the object is there, whole
                if exc.response.get("Error", {}).get("Code") == "NoSuchUpload" and self._stat(full_key).size == size:
                    return
                raise

        try:
            with ThreadPoolExecutor(min(self.max_concurrency, len(offsets))) as pool:
                parts = list(pool.map(part, range(1, len(offsets) + 1), offsets))
            self._call("complete multipart upload of", key, complete)
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full_key, UploadId=upload_id)
            raise
        stored = self.stat(key).size
        if stored != size:
            raise IntegrityError(f"{self.url_of(key)} holds {stored} bytes after upload, expected {size}",
                                 self.url_of(key))

    def _list(self, full_prefix: str) -> list[ObjectInfo]:
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full_prefix):
            for obj in page.get("Contents", []):
                out.append(ObjectInfo(obj["Key"], int(obj["Size"]), str(obj.get("ETag", "")).strip('"') or None,
                                      obj["LastModified"].timestamp() if obj.get("LastModified") else None))
        return out

    def _delete(self, full_key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=full_key)

    def delete_many(self, keys: Any) -> None:
        """Delete ``keys`` with batched DeleteObjects calls (1000 keys each)."""
        fulls = [self._full(k) for k in keys]
        for i in range(0, len(fulls), _MAX_DELETE):
            batch = [{"Key": k} for k in fulls[i : i + _MAX_DELETE]]

            def run(batch: list[dict[str, str]] = batch) -> None:
                answer = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
                errors = answer.get("Errors") or []
                if errors:
                    first = errors[0]
                    raise StorageError(
                        f"could not delete {len(errors)} objects under {self.url}, e.g. {first.get('Key')}: "
                        f"{first.get('Code')} {first.get('Message', '')}", self.url
                    )

            self._call("delete objects under", self._rel(batch[0]["Key"]), run)
