"""File hashes by name: every hashlib algorithm and xxHash's (``xxh32``, ``xxh64``, ``xxh3_64``, ``xxh128``, ``xxh3_128``)."""

from __future__ import annotations

import hashlib

from smalti.streaming.errors import StreamingError

_XXH = ("xxh32", "xxh64", "xxh3_64", "xxh128", "xxh3_128")


def supported() -> list[str]:
    names = [n for n in sorted(hashlib.algorithms_guaranteed) if not n.startswith("shake_")]
    return names + list(_XXH)


def digest(algo: str, data: bytes) -> str:
    """The hex digest of ``data`` under ``algo``."""
    if algo in _XXH:
        import xxhash

        return getattr(xxhash, algo)(data).hexdigest()
    if algo.startswith("shake_") or not hasattr(hashlib, algo):
        raise StreamingError(f"hash {algo!r} is not supported; choose from {', '.join(supported())}")
    return getattr(hashlib, algo)(data).hexdigest()
