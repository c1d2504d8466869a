"""smalti-storage: object storage behind one small Protocol, one retry policy and one atomic-write helper.

    from smalti.storage import open_store

    store = open_store("gs://bucket/datasets/c4")      # or s3://, az://, oci://bucket@ns/..., a path
    store.put_file("shard.00000.mds", "shard.00000.mds")
    store.get_file("index.json", "/cache/c4/index.json")  # atomic: temp name, fsync, rename
    for info in store.list(""):
        print(info.key, info.size)

No torch; each cloud's client is an extra (``smalti-storage[s3]``, ``[gcs]``, ``[azure]``, ``[oci]``).
"""

from smalti.storage.atomic import (
    atomic_copy,
    atomic_write,
    atomic_write_bytes,
    atomic_write_text,
    fsync_dir,
    is_temp_name,
)
from smalti.storage.base import ObjectInfo, ObjectStore
from smalti.storage.errors import (
    BucketNotFoundError,
    CredentialsError,
    IntegrityError,
    MissingClientError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    PermissionDeniedError,
    RetryBudgetExceededError,
    StorageError,
    UnknownSchemeError,
    UnsafeLocalPathError,
)
from smalti.storage.private import check_no_links, check_private_dir, open_beneath, user_cache_dir
from smalti.storage.registry import available_schemes, open_object, open_store, split_url
from smalti.storage.retry import RetryPolicy

__version__ = "0.1.0"

__all__ = [
    "BucketNotFoundError",
    "CredentialsError",
    "IntegrityError",
    "MissingClientError",
    "ObjectInfo",
    "ObjectNotFoundError",
    "ObjectTooLargeError",
    "ObjectStore",
    "PermissionDeniedError",
    "RetryBudgetExceededError",
    "RetryPolicy",
    "StorageError",
    "UnknownSchemeError",
    "UnsafeLocalPathError",
    "atomic_copy",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "available_schemes",
    "check_no_links",
    "check_private_dir",
    "fsync_dir",
    "is_temp_name",
    "open_beneath",
    "open_object",
    "open_store",
    "split_url",
    "user_cache_dir",
]
