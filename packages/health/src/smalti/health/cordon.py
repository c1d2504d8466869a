"""The cordon list: hosts found bad, each with a reason and a time, in a JSON file local or in a bucket.

The file is ``{"cordoned": [{"host": ..., "reason": ..., "time": ...}, ...]}``, which smalti-core's launch
tools read (``smalti.core.launch.cordon``) to keep jobs off those hosts, and ``smalti-health preflight``
reads to refuse to join. It lives wherever smalti-storage reaches (a path, ``s3://``, ``az://``, ``gs://``,
``oci://``). Every update is a read, a change and a conditional write (:meth:`ObjectStore.put_if`: the
object's ETag or generation on a bucket, the content under a folder lock on a file system), retried when
another writer got there first, so concurrent adds from several nodes all land and a reader never sees a
half-written file.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from typing import Any

from smalti.core.launch.cordon import CordonedHost, parse_cordon
from smalti.core.launch.errors import LaunchError
from smalti.core.launch.script_values import check_host_name, one_line
from smalti.health.errors import HealthError
from smalti.storage import ObjectStore, StorageError, open_object

_BACKOFF_RNG = random.Random()  # jitter of its own: training's seeded global generator stays untouched


def _open(path: str) -> tuple[ObjectStore, str]:
    try:
        store, key = open_object(path if "://" in path else os.path.abspath(path))
    except StorageError as exc:
        raise HealthError(f"cordon file {path}: {exc}") from exc
    if "://" in path and not path.startswith("file://") and "/" not in path.split("://", 1)[1].strip("/"):
        raise HealthError(f"cordon file {path}: a bucket path needs a bucket and a key (s3://bucket/cordon.json)")
    return store, key


def _parse(text: str, source: str) -> list[dict[str, Any]]:
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise HealthError(f"cordon file {source} is not valid JSON or YAML: {exc}") from exc
    try:
        hosts = parse_cordon(data, source)
    except LaunchError as exc:
        raise HealthError(str(exc)) from exc
    extra = {e.get("host"): e for e in (data.get("cordoned", []) if isinstance(data, dict) else []) if isinstance(e, dict)}
    return [{**extra.get(h.host, {}), "host": h.host, "reason": h.reason} for h in hosts]


def _render(entries: list[dict[str, Any]]) -> str:
    return json.dumps({"cordoned": entries}, indent=2, sort_keys=True) + "\n"


def read_cordon(path: str) -> list[CordonedHost]:
    """The cordoned hosts in ``path`` (a path or a bucket URL); a missing file is an empty list."""
    return [CordonedHost(e["host"], e.get("reason", "")) for e in _read_entries(path)[0]]


def is_cordoned(path: str, host: str) -> str | None:
    """The reason ``host`` is cordoned in ``path``, or None when it is not."""
    return next((h.reason or "no reason given" for h in read_cordon(path) if h.host == host), None)


def _read_entries(path: str) -> tuple[list[dict[str, Any]], str | None]:
    """Entries and the version token they were read at (None when the file does not exist)."""
    store, key = _open(path)
    try:
        found = store.get_versioned(key)
    except StorageError as exc:
        raise HealthError(f"cordon file {path}: {exc}") from exc
    if found is None:
        return [], None
    return _parse(found[0].decode(), path), found[1]


def _update(path: str, change: Callable[[list[dict[str, Any]]], list[dict[str, Any]]], retries: int = 20) -> None:
    store, key = _open(path)
    for attempt in range(retries):
        entries, token = _read_entries(path)
        try:
            if store.put_if(key, _render(change(entries)).encode(), token):
                return
        except StorageError as exc:
            raise HealthError(f"cordon file {path}: write failed: {exc}") from exc
        time.sleep(_BACKOFF_RNG.uniform(0.01, 0.05) * (attempt + 1))
    raise HealthError(f"cordon file {path}: {retries} writers raced and this one never got in; try again")


def add_to_cordon(path: str, host: str, reason: str) -> None:
    """Cordon ``host`` in ``path`` (created if missing); a host already there gets the new reason and time.

    ``host`` must be one valid host name (launchers write it into job scripts); the reason is folded onto one line.
    """
    try:
        check_host_name(host, f"cordon file {path}: host to cordon")
    except LaunchError as exc:
        raise HealthError(str(exc)) from exc
    entry = {"host": host, "reason": one_line(reason), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _update(path, lambda entries: [e for e in entries if e["host"] != host] + [entry])


def remove_from_cordon(path: str, host: str) -> bool:
    """Take ``host`` off the list in ``path``; True when it was there."""
    found = [False]

    def change(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        kept = [e for e in entries if e["host"] != host]
        found[0] = len(kept) != len(entries)
        return kept

    _update(path, change)
    return found[0]
