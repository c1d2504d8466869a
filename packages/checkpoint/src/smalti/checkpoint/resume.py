"""Finding what to load: the newest committed checkpoint that verifies, or the one ``load_path`` names."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smalti.checkpoint.errors import CheckpointCorruptError, CheckpointError, UncommittedCheckpointError
from smalti.checkpoint.manifest import data_files, verify_folder
from smalti.checkpoint.naming import MANIFEST_NAME, parse_folder_name
from smalti.checkpoint.storage import Store, is_remote, open_store
from smalti.storage import UnsafeLocalPathError, check_private_dir, user_cache_dir

log = logging.getLogger(__name__)


@dataclass
class Found:
    """A verified checkpoint ready to load from a local folder (a download, for remote ones)."""

    name: str
    source: str
    folder: Path
    manifest: dict[str, Any]
    skipped: list[str]
    #: names of the newer checkpoints passed over (partial, or failing verification)
    skipped_names: list[str] = field(default_factory=list)
    #: with ``defer_data``: the tensor data files whose digest is still to be checked (by the loading ranks,
    #: while the files load: see :class:`~smalti.checkpoint.read_ahead.ReadAhead`)
    unchecked: list[str] = field(default_factory=list)


def default_cache_dir(url: str) -> Path:
    """A per-save-folder local directory for downloads and the staging of remote saves, in this user's own
    cache (smalti-storage's ``user_cache_dir("checkpoint")``: ``0700``, refused if another user owns it or may
    write into it, so nobody else can plant a link where a download writes)."""
    digest = hashlib.sha1(url.encode()).hexdigest()[:12]
    try:
        return check_private_dir(user_cache_dir("checkpoint") / digest)
    except UnsafeLocalPathError as exc:
        raise CheckpointError(f"checkpoint cache: {exc}") from None


def fetch(
    store: Store, name: str, cache_dir: Path, verify: str, manifest: dict[str, Any] | None = None,
    defer_data: bool = False, trust_pickles: bool = False,
) -> tuple[Path, dict[str, Any], list[str]]:
    """A verified local copy of checkpoint ``name``, its manifest, and the data files left unchecked; raises
    :class:`CheckpointCorruptError` naming the bad file.

    With ``defer_data`` the data files' digest is left to the caller (the list returned; else it is empty).
    ``trust_pickles``: ``verify="full"`` reads DCP's metadata with full unpickling where the restricted reader
    refuses it (see :mod:`smalti.checkpoint.safe_load`).
    Object-store failures that persist after the retries raise :class:`CheckpointUploadError` instead: they say
    nothing about the checkpoint itself.
    """
    manifest = manifest if manifest is not None else store.read_manifest(name)
    where = f"{store.url}/{name}"
    if manifest is None:
        raise UncommittedCheckpointError(
            f"{where} has no {MANIFEST_NAME}: it is not a committed checkpoint (a save was interrupted or is running)",
            f"{where}/{MANIFEST_NAME}",
        )
    folder = store.local_copy(name, cache_dir, manifest)
    defer = defer_data and verify != "none"
    verify_folder(folder, verify, manifest, defer_data=defer, trust_pickles=trust_pickles)
    return folder, manifest, data_files(manifest) if defer else []


def newest_good(
    store: Store, cache_dir: Path, verify: str, defer_data: bool = False, exclude: dict[str, str] | None = None,
    trust_pickles: bool = False,
) -> Found | None:
    """The newest checkpoint under ``store`` that has a valid manifest and verifies; report every one skipped.

    Only verification failures (no manifest, an invalid manifest, a file missing, truncated or with another
    digest) pass over a checkpoint. A transport failure that outlasts the retries (:class:`CheckpointUploadError`)
    propagates, so a flaky object store fails the run (a launcher can retry it) instead of resuming from an
    older checkpoint or from scratch. When committed checkpoints exist but none verifies, this raises
    :class:`CheckpointCorruptError` rather than returning ``None`` (which would start the run afresh).
    Returns ``None`` only when no folder holds a manifest. ``exclude`` maps names already found damaged
    (by a deferred data check) to why; they count as damaged. ``defer_data``: see :func:`fetch`.
    """
    skipped: list[str] = []
    names: list[str] = []
    damaged: list[str] = []
    for name in reversed(store.list_names()):
        if exclude and name in exclude:
            skipped.append(f"{name}: {exclude[name]}")
            names.append(name)
            damaged.append(f"{name}: {exclude[name]}")
            continue
        try:
            manifest = store.read_manifest(name)
            folder, manifest, unchecked = fetch(store, name, cache_dir, verify, manifest, defer_data, trust_pickles)
        except CheckpointCorruptError as exc:
            log.error("skipping checkpoint %s/%s: %s", store.url, name, exc)
            skipped.append(f"{name}: {exc}")
            names.append(name)
            if not isinstance(exc, UncommittedCheckpointError):
                damaged.append(f"{name}: {exc}")
            continue
        if skipped:
            log.warning("resuming from %s/%s, the newest good checkpoint; skipped newer: %s", store.url, name, "; ".join(skipped))
        return Found(name, f"{store.url}/{name}", folder, manifest, skipped, names, unchecked)
    if damaged:
        raise CheckpointCorruptError(
            f"{store.url} holds committed checkpoints but none of them verifies, so the run does not start from "
            f"batch 0 silently: {'; '.join(damaged)}. Repair or remove the damaged checkpoints (or choose another "
            "save folder) to start afresh",
            store.url,
        )
    return None


def resolve_load_path(
    load_path: str, cache_dir: Path | None, verify: str, defer_data: bool = False,
    exclude: dict[str, str] | None = None, trust_pickles: bool = False, **store_options: Any,
) -> Found:
    """``load_path`` names a checkpoint folder, or a save folder (its newest good checkpoint is used).

    ``defer_data``, ``trust_pickles``: see :func:`fetch`; ``exclude``: see :func:`newest_good`.
    """
    path = str(load_path).rstrip("/")
    parent, _, last = path.rpartition("/")
    cache = cache_dir or default_cache_dir(parent or path)
    if parse_folder_name(last) is not None and parent:
        store = open_store(parent, **store_options)
        folder, manifest, unchecked = fetch(store, last, cache, verify, defer_data=defer_data, trust_pickles=trust_pickles)
        return Found(last, path, folder, manifest, [], unchecked=unchecked)
    if not is_remote(path) and (Path(path) / MANIFEST_NAME).is_file():
        store = open_store(Path(path).parent)
        folder, manifest, unchecked = fetch(store, Path(path).name, cache, verify, defer_data=defer_data,
                                            trust_pickles=trust_pickles)
        return Found(Path(path).name, path, folder, manifest, [], unchecked=unchecked)
    store = open_store(path, **store_options)
    found = newest_good(store, cache_dir or default_cache_dir(store.url), verify, defer_data, exclude, trust_pickles)
    if found is None:
        raise CheckpointError(
            f"load_path={load_path!r} holds no committed checkpoint (no ep<N>-ba<M> folder with a valid {MANIFEST_NAME})"
        )
    return found
