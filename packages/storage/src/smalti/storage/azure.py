"""``az://container/prefix`` and ``azure://container/prefix`` through azure-storage-blob.

Which account and credential, first match wins:

1. ``AZURE_STORAGE_CONNECTION_STRING`` (also how Azurite is reached);
2. the account from ``az://container@account/prefix``, ``AZURE_STORAGE_ACCOUNT_URL`` or
   ``AZURE_STORAGE_ACCOUNT`` (``https://<account>.blob.core.windows.net``) with ``AZURE_STORAGE_KEY`` or
   ``AZURE_STORAGE_SAS_TOKEN``, else ``DefaultAzureCredential`` from azure-identity when it is installed
   (environment service principal, workload identity, managed identity, Azure CLI login).

The SDK's own retries are switched off (``retry_total=0``): smalti-storage's RetryPolicy is the only one.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from smalti.storage.base import BaseStore, ObjectInfo, PerProcess, read_part
from smalti.storage.errors import (
    BucketNotFoundError,
    CredentialsError,
    MissingClientError,
    ObjectNotFoundError,
    PermissionDeniedError,
    StorageError,
)
from smalti.storage.retry import RetryPolicy, _brief, is_transient_status

AZURE_CHAIN = (
    "AZURE_STORAGE_CONNECTION_STRING; or an account (az://container@account/..., AZURE_STORAGE_ACCOUNT_URL or "
    "AZURE_STORAGE_ACCOUNT) with AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, or with DefaultAzureCredential "
    "(pip install azure-identity: AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET, workload identity, "
    "managed identity, `az login`)"
)


def _import_azure() -> Any:
    try:
        blob = importlib.import_module("azure.storage.blob")
    except ImportError:
        raise MissingClientError(
            'az:// and azure:// need azure-storage-blob, which is not installed: pip install "smalti-storage[azure]"'
        ) from None
    return blob


def parse_azure_url(url: str) -> tuple[str, str | None, str]:
    """``az://container[@account]/prefix`` -> ``(container, account or None, prefix)``."""
    rest = url.split("://", 1)[1]
    authority, _, prefix = rest.partition("/")
    container, _, account = authority.partition("@")
    if not container:
        raise StorageError(f"{url!r} names no container; write az://container/prefix", url)
    return container, account.split(".")[0] or None, prefix


class AzureStore(BaseStore):
    """Blobs under ``az://container/prefix`` (a "bucket" here is a container).

    Commit semantics: a single put is atomic per blob; large files are staged as blocks that stay invisible
    until one Put Block List commits them all at once. No multi-blob transaction: the manifest put last is
    the commit.
    """

    scheme = "az"
    commit_semantics = "put and block-list commit are atomic per blob; the manifest put last is the commit"

    def __init__(
        self,
        url: str,
        connection_string: str | None = None,
        account_url: str | None = None,
        credential: Any = None,
        timeout_s: float = 60.0,
        read_timeout_s: float | None = None,
        max_concurrency: int = 4,
        retry: RetryPolicy | None = None,
        **options: int,
    ) -> None:
        container, account, prefix = parse_azure_url(url)
        scheme = url.split("://", 1)[0]
        super().__init__(f"{scheme}://{url.split('://', 1)[1].strip('/')}", container, prefix, retry=retry, **options)
        _import_azure()
        self.timeout_s = timeout_s if read_timeout_s is None else read_timeout_s  # the name S3Store uses
        self.max_concurrency = max(1, max_concurrency)
        self._connection_string = connection_string
        self._account_url = account_url
        self._credential = credential
        if not (connection_string or account_url):
            self._resolve(account)
        self._container = PerProcess(self._make_container)

    def _resolve(self, account: str | None) -> None:
        env = os.environ
        if env.get("AZURE_STORAGE_CONNECTION_STRING") and not account:
            self._connection_string = env["AZURE_STORAGE_CONNECTION_STRING"]
            return
        account = account or env.get("AZURE_STORAGE_ACCOUNT") or env.get("AZURE_STORAGE_ACCOUNT_NAME")
        self._account_url = env.get("AZURE_STORAGE_ACCOUNT_URL") or (
            f"https://{account}.blob.core.windows.net" if account else None
        )
        if not self._account_url:
            raise CredentialsError(f"no Azure storage account for {self.url}; looked for {AZURE_CHAIN}", self.url)
        if self._credential is not None:
            return
        if env.get("AZURE_STORAGE_KEY"):
            self._credential = {"account_name": account, "account_key": env["AZURE_STORAGE_KEY"]}
        elif env.get("AZURE_STORAGE_SAS_TOKEN"):
            self._credential = env["AZURE_STORAGE_SAS_TOKEN"]
        else:
            try:
                from azure.identity import DefaultAzureCredential
            except ImportError:
                raise CredentialsError(
                    f"no Azure credential for {self.url} (account {self._account_url}); looked for {AZURE_CHAIN}",
                    self.url,
                ) from None
            self._credential = DefaultAzureCredential()

    @property
    def container(self) -> Any:
        """This process's container client (thread-safe; a forked child makes its own)."""
        return self._container.get()

    def _make_container(self) -> Any:
        blob = _import_azure()
        kwargs = {"retry_total": 0, "connection_timeout": min(self.timeout_s, 10), "read_timeout": self.timeout_s}
        if self._connection_string:
            service = blob.BlobServiceClient.from_connection_string(self._connection_string, **kwargs)
        else:
            service = blob.BlobServiceClient(self._account_url, credential=self._credential, **kwargs)
        return service.get_container_client(self.bucket)

    # ---------------------------------------------------------------- errors

    def _is_transient(self, exc: BaseException) -> bool:
        from azure.core import exceptions as zx

        if isinstance(exc, zx.ClientAuthenticationError):
            return False
        if isinstance(exc, (zx.ServiceRequestError, zx.ServiceResponseError, zx.IncompleteReadError,
                            ConnectionError, TimeoutError)):
            return True
        if isinstance(exc, zx.HttpResponseError):
            return is_transient_status(exc.status_code)
        return False

    def _translate(self, exc: Exception, url: str, key: str) -> StorageError:
        from azure.core import exceptions as zx

        if isinstance(exc, zx.ClientAuthenticationError):
            return PermissionDeniedError(f"{url}: not authorised ({_brief(exc)}); credentials from {AZURE_CHAIN}", url)
        if type(exc).__name__ == "CredentialUnavailableError":
            return CredentialsError(f"no Azure credential for {url}: {_brief(exc)}; looked for {AZURE_CHAIN}", url)
        if isinstance(exc, zx.ResourceNotFoundError):
            code = str(getattr(exc, "error_code", "") or "")
            if code == "ContainerNotFound" or (code != "BlobNotFound" and not self._container_exists()):
                return BucketNotFoundError(
                    f"container {self.bucket!r} does not exist in account {self.container.account_name!r} "
                    f"(for {url}); create it or fix the URL", url
                )
            return ObjectNotFoundError(f"{url} does not exist", url)
        return StorageError(f"{url}: {_brief(exc)}", url)

    def _container_exists(self) -> bool:
        try:
            return bool(self.container.exists())
        except Exception:
            return True

    # ---------------------------------------------------------------- primitives

    @staticmethod
    def _info(props: Any) -> ObjectInfo:
        modified = props.last_modified
        return ObjectInfo(props.name, int(props.size), str(props.etag).strip('"') if props.etag else None,
                          modified.timestamp() if modified else None)

    def _stat(self, full_key: str) -> ObjectInfo:
        props = self.container.get_blob_client(full_key).get_blob_properties(timeout=self.timeout_s)
        return self._info(props)

    def _get_range(self, full_key: str, start: int, end: int | None) -> bytes:
        length = None if end is None else end - start
        stream = self.container.download_blob(full_key, offset=start if start or length else None, length=length,
                                              timeout=self.timeout_s)
        return stream.readall()

    def _download_into(self, full_key: str, f: IO[bytes]) -> None:
        self.container.download_blob(full_key, timeout=self.timeout_s, max_concurrency=self.max_concurrency).readinto(f)

    def _put_bytes(self, full_key: str, data: bytes) -> None:
        self.container.upload_blob(full_key, data, overwrite=True, timeout=self.timeout_s)

    def _get_versioned(self, full_key: str) -> tuple[bytes, str] | None:
        from azure.core.exceptions import ResourceNotFoundError

        try:
            stream = self.container.download_blob(full_key, timeout=self.timeout_s)
        except ResourceNotFoundError as exc:
            if str(getattr(exc, "error_code", "") or "") == "ContainerNotFound":
                raise
            return None
        return stream.readall(), str(stream.properties.etag)  # one response: the ETag is the content's

    def _put_if(self, full_key: str, data: bytes, token: str | None) -> bool:
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceExistsError, ResourceModifiedError

        conditions: dict[str, Any] = (
            {"overwrite": True, "etag": token, "match_condition": MatchConditions.IfNotModified}
            if token else {"overwrite": False}
        )
        try:
            self.container.upload_blob(full_key, data, timeout=self.timeout_s, **conditions)
        except (ResourceExistsError, ResourceModifiedError):
            return False
        return True

    def _put_multipart(self, local: Path, full_key: str, key: str, size: int) -> None:
        blob_client = self.container.get_blob_client(full_key)
        offsets = list(range(0, size, self.part_size))
        ids = [base64.b64encode(f"smalti-{i:08d}".encode()).decode() for i in range(len(offsets))]

        def stage(i: int) -> None:
            def send() -> None:
                data = read_part(local, offsets[i], min(self.part_size, size - offsets[i]))
                blob_client.stage_block(ids[i], data, length=len(data), timeout=self.timeout_s)

            self._call(f"upload block {i + 1} of {len(offsets)} of", key, send)

        with ThreadPoolExecutor(min(self.max_concurrency, len(offsets))) as pool:
            list(pool.map(stage, range(len(offsets))))
        from azure.storage.blob import BlobBlock

        blocks = [BlobBlock(block_id=b) for b in ids]
        self._call("commit blocks of", key, lambda: blob_client.commit_block_list(blocks, timeout=self.timeout_s))

    def _list(self, full_prefix: str) -> list[ObjectInfo]:
        return [self._info(p) for p in self.container.list_blobs(name_starts_with=full_prefix or None,
                                                                  timeout=self.timeout_s)]

    def _delete(self, full_key: str) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        with contextlib.suppress(ResourceNotFoundError):
            self.container.delete_blob(full_key, timeout=self.timeout_s)
