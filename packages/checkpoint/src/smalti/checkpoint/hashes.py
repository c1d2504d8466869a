"""The file digests a manifest records: ``xxh3_128`` (default), ``blake3`` or ``sha256``.

The manifest guards against torn writes, truncation, bit rot and a wrong file, not against someone who can
rewrite both the data and the manifest (see the README), so the default is the fastest well-mixed 128-bit
hash (xxh3-128: it costs less than the copy a save makes anyway; figures in the README). ``blake3`` (the
``smalti-checkpoint[blake3]`` extra) and ``sha256`` are there for whoever wants a cryptographic digest.

A manifest entry records its algorithm with the digest, ``{"size": n, "hash": "xxh3_128:<hex>"}``; entries of
checkpoints written before (``{"size": n, "sha256": "<hex>"}``) read as ``sha256``.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Protocol

from smalti.checkpoint.errors import CheckpointError

ALGORITHMS = ("xxh3_128", "blake3", "sha256")
DEFAULT_ALGORITHM = "xxh3_128"
_HEX_DIGITS = {"xxh3_128": 32, "blake3": 64, "sha256": 64}


class Hasher(Protocol):
    """What every algorithm's running digest offers (all release the GIL on large buffers)."""

    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


class HashUnavailableError(CheckpointError):
    """The algorithm a setting or a manifest names is not installed here."""


def check_algorithm(name: str, where: str = "checkpoint.hash") -> str:
    """``name`` if it is a known algorithm whose package is installed; else an error naming ``where`` and the fix."""
    if name not in ALGORITHMS:
        raise HashUnavailableError(f"{where}={name!r} is not a hash smalti-checkpoint knows; use one of {', '.join(ALGORITHMS)}")
    new_hasher(name, where)
    return name


def new_hasher(name: str, where: str = "checkpoint.hash") -> Hasher:
    """A fresh running digest of algorithm ``name``."""
    if name == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if name == "sha256":
        return hashlib.sha256()
    if name == "blake3":
        try:
            import blake3
        except ImportError:
            raise HashUnavailableError(
                f"{where} needs the blake3 hash, which is not installed: pip install 'smalti-checkpoint[blake3]' "
                "(or set checkpoint.hash=xxh3_128)"
            ) from None
        return blake3.blake3()
    raise HashUnavailableError(f"{where}={name!r} is not a hash smalti-checkpoint knows; use one of {', '.join(ALGORITHMS)}")


def tagged(name: str, hexdigest: str) -> str:
    """The manifest's spelling of a digest: ``"<algorithm>:<hex>"``."""
    return f"{name}:{hexdigest}"


def entry_digest(entry: Any) -> tuple[str, str] | None:
    """``(algorithm, hex)`` of a manifest file entry (``hash``, or the older ``sha256`` field); ``None`` when
    the entry has neither in a valid form."""
    if not isinstance(entry, dict):
        return None
    if isinstance(entry.get("hash"), str):
        name, _, hexdigest = entry["hash"].partition(":")
    elif isinstance(entry.get("sha256"), str):
        name, hexdigest = "sha256", entry["sha256"]
    else:
        return None
    digits = _HEX_DIGITS.get(name)
    if digits is None or not re.fullmatch(rf"[0-9a-f]{{{digits}}}", hexdigest):
        return None
    return name, hexdigest
