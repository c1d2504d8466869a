"""What a stream's local folder may be trusted with: a cache folder of this user's, without links, holding an
index equal to the remote's and shard files of the sizes the index declares.

The default cache of a stream with a remote is ``<hash of the remote>`` under smalti-storage's
``user_cache_dir("streaming")`` (``<temp>/smalti-<uid>/streaming``, or ``$XDG_CACHE_HOME/smalti/streaming``): per
user, mode 0700 and checked to be this user's (the shared ``/tmp/smalti-streaming`` used before could be created,
or filled, by anyone). With a remote, the remote's ``index.json`` is fetched at start and the cached one must equal it; a
different cached index (planted, or left by an older version of the dataset) is replaced, and the shard copies
it names are dropped, so nothing a local folder holds is served in place of the remote's data.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from smalti.storage import (
    UnsafeLocalPathError,
    atomic_write_bytes,
    check_no_links,
    check_private_dir,
    open_beneath,
    user_cache_dir,
)
from smalti.streaming.errors import DownloadError, ShardCorruptError, UnsafePathError
from smalti.streaming.mds import INDEX, remove_copy
from smalti.streaming.paths import check_name
from smalti.streaming.shard_table import INDEX_NPZ, ShardTable

if TYPE_CHECKING:
    from smalti.streaming.storage import Fetcher
    from smalti.streaming.stream import Stream

log = logging.getLogger(__name__)


def default_cache_root() -> Path:
    """The folder under which streams without a ``local`` cache their remote: this user's, created 0700 and
    checked (:class:`UnsafePathError` naming it when it is a link, another user's, or others may write to it)."""
    try:
        return user_cache_dir("streaming")
    except UnsafeLocalPathError as exc:
        raise UnsafePathError(str(exc)) from None


def no_links(root: Path, relative: str) -> Path:
    """``root / relative`` when no existing part of ``relative`` inside ``root`` is a link (else
    :class:`UnsafePathError`); parts not there yet are made by this process (``mkdir``, a temp file renamed)."""
    try:
        return check_no_links(root, relative)
    except FileNotFoundError:
        return root / relative
    except UnsafeLocalPathError as exc:
        raise UnsafePathError(str(exc)) from None


def open_no_links(path: Path, flags: int = os.O_RDONLY, mode: int = 0o666) -> int:
    """``os.open(path)`` refusing a link as the file itself (:class:`UnsafePathError`); the folders above it are
    checked by :func:`no_links` before a shard is used."""
    try:
        return open_beneath(path.parent, path.name, flags, mode)
    except UnsafeLocalPathError as exc:
        raise UnsafePathError(str(exc)) from None


def secure_stream_folder(stream: Stream) -> None:
    """Create or check ``stream``'s local folder: a default one must be this user's alone (see
    :func:`smalti.storage.check_private_dir`); in any, the ``split`` folder and ``index.json`` must not be links."""
    try:
        root = getattr(stream, "_private_root", None)
        if root is not None:
            check_private_dir(root)
            check_private_dir(stream.local)  # type: ignore[arg-type]
    except UnsafeLocalPathError as exc:
        raise UnsafePathError(f"stream {stream.name}: {exc}") from None
    no_links(Path(stream.local), f"{stream.split}/{INDEX}" if stream.split else INDEX)  # type: ignore[arg-type]


def others_may_write(folder: Path) -> bool:
    """Whether a user other than this one owns ``folder`` or may write to it (so may have planted its files)."""
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return False
    return bool(st.st_mode & 0o022) or (hasattr(os, "getuid") and st.st_uid != os.getuid())


def _read_nofollow(path: Path) -> bytes | None:
    try:
        fd = open_no_links(path)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def sync_index(stream: Stream, remote_index: bytes) -> None:
    """Make ``stream``'s cached ``index.json`` equal to ``remote_index`` (the remote's, fetched at start).

    A cached index with other bytes is replaced, and the local shard copies the remote index names are
    dropped first: they were made for (or planted with) another index and are fetched again when needed.
    """
    folder = stream.local_dir()
    local = folder / INDEX
    cached = _read_nofollow(local)
    if cached == remote_index:
        return
    if cached is not None:
        log.warning("stream %s: the cached %s differs from the remote's; using the remote's and fetching its "
                    "shards again", stream.name, local)
        try:
            shards = json.loads(remote_index).get("shards", [])
        except (ValueError, AttributeError):
            shards = []  # load_index names the fault once the remote's index is in place
        for i, entry in enumerate(shards if isinstance(shards, list) else []):
            for key in ("raw_data", "zip_data"):
                name = (entry.get(key) or {}).get("basename") if isinstance(entry, dict) else None
                if name is not None:
                    remove_copy(no_links(folder, check_name(name, stream.remote_path(INDEX), f"shard {i} {key}")))
    atomic_write_bytes(local, remote_index, fsync=False)


def remote_table(fetcher: Fetcher, remote: str, stream: str) -> bytes | None:
    """The remote's ``index.npz`` bytes, or ``None`` (logged) when it has none: the JSON is read then."""
    try:
        return fetcher.get_bytes(remote, INDEX_NPZ)
    except DownloadError as exc:
        log.info("stream %s: no columnar index (%s); parsing %s", stream, exc, INDEX)
        return None


def check_local_lengths(folder: Path, entries: Sequence[dict[str, Any]], index: Path) -> None:
    """Refuse a shard of a local-only ``index`` when the file its samples come from (its zip, else its raw
    file), if present, is a link or not the size the index declares: before any count or size of it is used."""
    if isinstance(entries, ShardTable):
        with_zip = np.flatnonzero(entries.zip_kinds() == 2)
        sizes = np.where(entries.zip_kinds() == 2, entries.zip_bytes, entries.raw_bytes).tolist()
        zipped = set(with_zip.tolist())
        files = ((i, entries.name("zip" if i in zipped else "raw", i), size) for i, size in enumerate(sizes))
    else:
        files = ((i, info["basename"], info["bytes"]) for i, info in
                 enumerate(entry.get("zip_data") or entry["raw_data"] for entry in entries))
    checked: set[str] = set()
    for i, name, size in files:
        parent = os.path.dirname(name)
        if parent not in checked:  # the folders once, then each file itself refused if it is a link
            no_links(folder, name)
            checked.add(parent)
        path = folder / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{index}: shard {i} file {path} is not a regular file; refused")
        if st.st_size != size:
            raise ShardCorruptError(f"{index}: shard {i} file {path} is {st.st_size} bytes, the index declares "
                                    f"{size}: the index or the file was changed; write the dataset again")
