"""From a URL to a store: :func:`split_url`, :func:`open_store`, :func:`open_object`.

Built-in schemes: plain paths and ``file://``, ``s3://``, ``gs://``, ``az://``/``azure://``, ``oci://``.
Another distribution adds a scheme with an entry point in group ``smalti.storage`` whose name is the scheme
and whose object is called as ``factory(url, **options)`` and returns an :class:`~smalti.storage.ObjectStore`
rooted at ``url``::

    [project.entry-points."smalti.storage"]
    hf = "smalti_hf.store:HfStore"

Built-in schemes win over entry points of the same name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from smalti.storage.base import ObjectStore
from smalti.storage.errors import StorageError, UnknownSchemeError

GROUP = "smalti.storage"
# scheme -> (module, class, pip extra)
_BUILTIN: dict[str, tuple[str, str, str | None]] = {
    "file": ("smalti.storage.local", "LocalStore", None),
    "s3": ("smalti.storage.s3", "S3Store", "s3"),
    "gs": ("smalti.storage.gcs", "GcsStore", "gcs"),
    "az": ("smalti.storage.azure", "AzureStore", "azure"),
    "azure": ("smalti.storage.azure", "AzureStore", "azure"),
    "oci": ("smalti.storage.oci", "OciStore", "oci"),
}


def split_url(url: str | os.PathLike[str]) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of ``url``; a plain path is ``("file", "", path)``.

    ``s3://b/k/x`` -> ``("s3", "b", "k/x")``; ``oci://b@ns/k`` -> ``("oci", "b@ns", "k")``;
    ``file:///tmp/x`` and ``/tmp/x`` -> ``("file", "", "/tmp/x")``.
    """
    text = os.fspath(url)
    if "://" not in text:
        return "file", "", text
    scheme, rest = text.split("://", 1)
    scheme = scheme.lower()
    if scheme == "file":
        return "file", "", rest
    bucket, _, key = rest.partition("/")
    return scheme, bucket, key.strip("/")


def _plugins() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def available_schemes() -> list[str]:
    """Every scheme :func:`open_store` accepts here: built-ins and ``smalti.storage`` entry points."""
    return sorted(set(_BUILTIN) | set(_plugins()))


def _factory(scheme: str, url: str) -> Callable[..., ObjectStore]:
    if scheme in _BUILTIN:
        import importlib

        module, name, _ = _BUILTIN[scheme]
        return getattr(importlib.import_module(module), name)
    plugins = _plugins()
    if scheme in plugins:
        ep = plugins[scheme]
        try:
            return ep.load()
        except Exception as exc:
            dist = getattr(ep.dist, "name", "?")
            raise StorageError(
                f"the {scheme}:// backend (entry point {ep.value!r} of {dist}) failed to import: "
                f"{type(exc).__name__}: {exc}", url
            ) from exc
    raise UnknownSchemeError(
        f"no storage backend for {scheme}:// in {url!r} (have: {', '.join(available_schemes())}); "
        f"a distribution adds one with an entry point in group {GROUP!r} named {scheme!r}, e.g. "
        f'[project.entry-points."{GROUP}"] {scheme} = "yourpkg.store:YourStore"',
        url,
    )


def open_store(url: str | os.PathLike[str], **options: Any) -> ObjectStore:
    """The store rooted at ``url`` (keys are relative to it); ``options`` go to the backend's constructor.

    Common options: ``retry`` (a :class:`~smalti.storage.RetryPolicy`), ``part_size`` and
    ``multipart_threshold`` (bytes). Raises :class:`UnknownSchemeError` for a scheme nothing handles and
    :class:`MissingClientError` (naming the pip extra) when the cloud's client library is missing.
    """
    text = os.fspath(url)
    scheme, bucket, key = split_url(text)
    factory = _factory(scheme, text)
    if scheme == "file":
        return factory(key, **options)
    if scheme in ("s3",):
        return factory(f"{scheme}://{bucket}/{key}".rstrip("/"), bucket, key, **options)
    if scheme == "gs":
        return factory(f"gs://{bucket}/{key}".rstrip("/"), bucket, key, **options)
    return factory(text, **options)


def open_object(url: str | os.PathLike[str], **options: Any) -> tuple[ObjectStore, str]:
    """``(store, key)`` for one object's URL: the store is rooted at the object's folder, ``key`` is its name.

    ``open_object("s3://b/ds/shard.00000.mds")`` -> ``(store at s3://b/ds, "shard.00000.mds")``.
    """
    text = os.fspath(url).rstrip("/")
    head, _, name = text.rpartition("/")
    if not name or not head or head.endswith(":/"):
        raise StorageError(f"{text!r} does not name an object (want scheme://bucket/path/name or a file path)", text)
    return open_store(head, **options), name
