"""Retention: which committed checkpoints a policy keeps, and deleting the rest once a newer one is committed."""

from __future__ import annotations

import logging

from smalti.checkpoint.errors import CheckpointError
from smalti.checkpoint.naming import sort_key
from smalti.checkpoint.storage import CheckpointStore

log = logging.getLogger(__name__)


def retained(names: list[str], keep_last_n: int, keep_every_n: int | None) -> set[str]:
    """The committed checkpoint names that retention keeps: the newest ``keep_last_n`` (all when < 0; all of
    them while fewer are committed), plus every one whose batch count is a multiple of ``keep_every_n``."""
    ordered = sorted(names, key=sort_key)
    keep = set(ordered if keep_last_n < 0 else ordered[-keep_last_n:] if keep_last_n else [])
    if keep_every_n:
        keep |= {n for n in ordered if sort_key(n)[0] % keep_every_n == 0}
    return keep


def prune(store: CheckpointStore, newest: str, keep_last_n: int, keep_every_n: int | None) -> None:
    """Delete the checkpoints of ``store`` older than ``newest`` that :func:`retained` does not keep, and every
    older partial one (no valid manifest); ``newest`` must be committed already. Newer ones are left alone."""
    if keep_last_n < 0:
        return
    committed, partial = [], []
    for n in store.list_names():
        if sort_key(n) >= sort_key(newest) and n != newest:
            continue
        try:
            (committed if store.read_manifest(n) is not None else partial).append(n)
        except CheckpointError:
            partial.append(n)
    keep = retained(committed, keep_last_n, keep_every_n) | {newest}
    for n in [c for c in committed if c not in keep] + [p for p in partial if p != newest]:
        log.info("retention: deleting %s/%s", store.url, n)
        store.delete(n)
