"""The manifest: written last, it lists every file of a checkpoint with its size and digest.

A folder without a valid manifest is not a checkpoint. ``verify_folder`` checks a local copy against it.
Each file's entry is ``{"size": n, "hash": "<algorithm>:<hex>"}`` (see :mod:`smalti.checkpoint.hashes`;
manifests before ``smalti-checkpoint/3`` have ``{"size": n, "sha256": "<hex>"}``, still read and checked).
The manifest carries the sha256 of its own canonical JSON (``manifest_sha256``: a few kB, so the choice of
hash does not matter there), so a changed byte in it is caught as surely as one in the files it lists, and
every file name it lists must stay inside the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from smalti.checkpoint.errors import CheckpointCorruptError, UncommittedCheckpointError, UnsafeCheckpointError
from smalti.checkpoint.hashes import DEFAULT_ALGORITHM, entry_digest, new_hasher, tagged
from smalti.checkpoint.limits import check_extent, decode_bounded, decoded_limit
from smalti.checkpoint.naming import MANIFEST_NAME
from smalti.checkpoint.safe_load import check_inside, no_link_inside
from smalti.storage import atomic_write_text

FORMAT = "smalti-checkpoint/3"
#: every format read: /1 had no self-checksum (no ``manifest_sha256`` required), /1 and /2 record ``sha256``
#: per file, /3 ``hash`` (``"<algorithm>:<hex>"``)
FORMATS = ("smalti-checkpoint/1", "smalti-checkpoint/2", FORMAT)
SELF_HASH = "manifest_sha256"
VERIFY_LEVELS = ("none", "manifest", "full")
_CHUNK = 8 << 20


def hash_file(path: str | os.PathLike[str], algorithm: str = "sha256") -> tuple[int, str]:
    """``(size, hex digest)`` of a file with ``algorithm`` (sha256 unless told: what manifests before
    ``smalti-checkpoint/3`` record), read front to back in 8 MiB chunks."""
    digest = new_hasher(algorithm)
    size = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def hash_files(
    folder: Path, relpaths: Iterable[str], algorithm: str | dict[str, str] = DEFAULT_ALGORITHM, threads: int = 4
) -> dict[str, dict[str, Any]]:
    """``{relpath: {"size", "hash"}}`` for files under ``folder``, several files at once; ``algorithm`` for
    every file, or per file (``{relpath: algorithm}``)."""
    relpaths = list(relpaths)
    algorithms = algorithm if isinstance(algorithm, dict) else dict.fromkeys(relpaths, algorithm)
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(relpaths) or 1))) as pool:
        results = list(pool.map(lambda rel: hash_file(folder / rel, algorithms[rel]), relpaths))
    return {rel: {"size": size, "hash": tagged(algorithms[rel], hexdigest)} for rel, (size, hexdigest) in zip(relpaths, results)}


def build_manifest(
    name: str,
    files: dict[str, dict[str, Any]],
    world_size: int,
    mesh_shape: list[int],
    mesh_dim_names: list[str],
    timestamp: dict[str, Any],
    writer_ranks: list[int],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest dict for checkpoint ``name`` (JSON-serialisable)."""
    import torch

    return seal({
        "format": FORMAT,
        "name": name,
        "world_size": world_size,
        "mesh_shape": list(mesh_shape),
        "mesh_dim_names": list(mesh_dim_names),
        "writer_ranks": list(writer_ranks),
        "timestamp": dict(timestamp),
        "created_unix": time.time(),
        "torch_version": torch.__version__,
        "files": dict(sorted(files.items())),
        **(extra or {}),
    })


def _self_hash(manifest: dict[str, Any]) -> str:
    body = {key: value for key, value in manifest.items() if key != SELF_HASH}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with ``manifest_sha256`` set to the sha256 of the rest of it (canonical JSON)."""
    return {**manifest, SELF_HASH: _self_hash(manifest)}


def write_json_atomic(path: Path, payload: dict[str, Any] | str) -> None:
    """Write ``payload`` (JSON or text) to ``path`` atomically (smalti-storage's temp name, fsync, rename)."""
    atomic_write_text(path, payload if isinstance(payload, str) else json.dumps(payload, indent=1, sort_keys=True))


def parse_manifest(raw: bytes | str, where: str) -> dict[str, Any]:
    """Parse and sanity-check manifest bytes; raise :class:`CheckpointCorruptError` naming ``where``."""
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"manifest {where} is not valid JSON ({exc}); the checkpoint is incomplete", where) from None
    if not isinstance(manifest, dict) or manifest.get("format") not in FORMATS or not isinstance(manifest.get("files"), dict):
        raise CheckpointCorruptError(
            f"manifest {where} is not a {FORMAT} manifest (format={manifest.get('format') if isinstance(manifest, dict) else None!r})",
            where,
        )
    sealed = SELF_HASH in manifest or manifest["format"] != FORMATS[0]  # only the first format had no seal
    if sealed and manifest.get(SELF_HASH) != _self_hash(manifest):
        raise CheckpointCorruptError(
            f"manifest {where} does not match its own {SELF_HASH} (corrupted or edited); the checkpoint is not valid",
            where,
        )
    for rel, entry in manifest["files"].items():
        check_inside(rel, f"manifest {where}")
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and entry["size"] >= 0
                and entry_digest(entry) is not None):
            raise CheckpointCorruptError(
                f"manifest {where} has no valid size and hash for {rel!r} (want {{\"size\": <bytes>, \"hash\": "
                f"\"<xxh3_128|blake3|sha256>:<hex>\"}}, got {entry!r:.200})", where
            )
    return manifest


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a local checkpoint folder; :class:`CheckpointCorruptError` when absent or invalid."""
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise UncommittedCheckpointError(
            f"{folder} has no {MANIFEST_NAME}: it is not a committed checkpoint (a save was interrupted or is still running)",
            str(path),
        )
    return parse_manifest(path.read_bytes(), str(path))


def verify_folder(
    folder: Path, level: str = "manifest", manifest: dict[str, Any] | None = None, defer_data: bool = False,
    trust_pickles: bool = False,
) -> dict[str, Any]:
    """Check a local checkpoint folder against its manifest and return the manifest.

    ``none``: the manifest exists and parses. ``manifest``: also every listed file exists with its recorded
    size and digest. ``full``: also DCP's ``.metadata`` refers only to listed files and to byte ranges inside
    them, and every rank's ``extra/`` file reads with torch's weights-only loader (read without running code from it unless ``trust_pickles``: see :mod:`smalti.checkpoint.safe_load`).
    Raises :class:`CheckpointCorruptError` naming the first file at fault. With ``defer_data``, the
    digest of the tensor data files (``*.distcp``) is left to the load (:mod:`smalti.checkpoint.read_ahead`), so it can run
    while they load; every other file (pickles among them) is still checked here, before anything reads it.
    """
    if level not in VERIFY_LEVELS:
        raise ValueError(f"verify={level!r} must be one of {', '.join(VERIFY_LEVELS)}")
    manifest = manifest or read_manifest(folder)
    if level == "none":
        return manifest
    files: dict[str, dict[str, Any]] = manifest["files"]
    for rel, entry in files.items():
        where = f"listed in the manifest {folder / MANIFEST_NAME}"
        path = folder / check_inside(rel, f"manifest {folder / MANIFEST_NAME}")
        try:
            no_link_inside(folder, rel, where)  # a link would read from outside the checkpoint
            info = os.lstat(path)
        except FileNotFoundError:
            info = None
        if info is None or not stat.S_ISREG(info.st_mode):
            raise CheckpointCorruptError(f"checkpoint file {path} {where} is missing (or not a file)", str(path))
        size = info.st_size
        if size != entry["size"]:
            raise CheckpointCorruptError(
                f"checkpoint file {path} has {size} bytes but the manifest says {entry['size']} (truncated or overwritten)",
                str(path),
            )
    _check_hashes(folder, {rel: entry for rel, entry in files.items() if not (defer_data and is_data_file(rel))})
    if level == "full":
        _verify_dcp_metadata(folder, files, trust_pickles)
        _verify_rank_files(folder, files, trust_pickles)
    return manifest


def is_data_file(relpath: str) -> bool:
    """Whether ``relpath`` is one of DCP's tensor data files (read with ``torch.load(weights_only=True)``)."""
    return relpath.endswith(".distcp")


def data_files(manifest: dict[str, Any]) -> list[str]:
    """The tensor data files a manifest lists (what :func:`verify_folder` leaves out with ``defer_data``)."""
    return sorted(rel for rel in manifest["files"] if is_data_file(rel))


def split_by_size(
    relpaths: list[str], manifest: dict[str, Any], parts: int, preferred: dict[str, int] | None = None
) -> list[list[str]]:
    """``relpaths`` in ``parts`` shares of about equal bytes; every rank computes the same split from the same
    manifest. A file named in ``preferred`` goes to that share (the rank that will load it); the others go,
    largest first, to the lightest share."""
    shares: list[list[str]] = [[] for _ in range(max(1, parts))]
    loads = [0] * len(shares)
    preferred = {rel: part for rel, part in (preferred or {}).items() if 0 <= part < len(shares)}
    for rel in sorted(relpaths, key=lambda r: (r not in preferred, -manifest["files"][r]["size"], r)):
        part = preferred.get(rel, loads.index(min(loads)))
        shares[part].append(rel)
        loads[part] += manifest["files"][rel]["size"]
    return shares


def writer_rank(relpath: str) -> int | None:
    """The rank that wrote DCP data file ``relpath`` (``__<rank>_<i>.distcp``), if the name says."""
    match = re.fullmatch(r"__(\d+)_\d+\.distcp", relpath.rpartition("/")[2])
    return int(match.group(1)) if match else None


def algorithm_of(entry: dict[str, Any]) -> str:
    """The hash algorithm a (parsed) manifest entry was recorded with."""
    found = entry_digest(entry)
    assert found is not None, "entries are checked by parse_manifest"
    return found[0]


def mismatch(path: Path, entry: dict[str, Any], hexdigest: str) -> CheckpointCorruptError | None:
    """The error for a file whose ``hexdigest`` (of the entry's algorithm) is not the recorded one, or None."""
    found = entry_digest(entry)
    assert found is not None, "entries are checked by parse_manifest"
    algorithm, expected = found
    if hexdigest == expected:
        return None
    return CheckpointCorruptError(
        f"checkpoint file {path} has {algorithm} {hexdigest[:16]}… but the manifest says {expected[:16]}… (corrupted)",
        str(path),
    )


def _check_hashes(folder: Path, files: dict[str, dict[str, Any]]) -> None:
    hashed = hash_files(folder, files, {rel: algorithm_of(entry) for rel, entry in files.items()})
    for rel, entry in files.items():
        problem = mismatch(folder / rel, entry, hashed[rel]["hash"].partition(":")[2])
        if problem is not None:
            raise problem


def _verify_dcp_metadata(folder: Path, files: dict[str, dict[str, Any]], trust_pickles: bool = False) -> None:
    from smalti.checkpoint.safe_load import read_dcp_metadata

    where = folder / ".metadata"
    if ".metadata" not in files:
        raise CheckpointCorruptError(f"the manifest of {folder} does not list DCP's .metadata", str(where))
    metadata = read_dcp_metadata(where, trust_pickles)  # refuses what is not DCP metadata, runs no code
    for index, info in (metadata.storage_data or {}).items():
        rel = info.relative_path
        if rel not in files:
            raise CheckpointCorruptError(f"{where} refers to {rel} (for {index.fqn}), which the manifest does not list", str(folder / rel))
        check_extent(info, files[rel]["size"], f"the entry {index.fqn!r} of {folder / rel}")
    _verify_dcp_objects(folder, metadata, trust_pickles)


def _verify_dcp_objects(folder: Path, metadata: Any, trust_pickles: bool = False) -> None:
    """The objects DCP stored beside the tensors (optimizer hyperparameters: small ``torch.save`` records in the
    data files) read with torch's weights-only loader, as the load reads them; every transformed (zstd) entry,
    tensor or object, decoded within its bound (:mod:`smalti.checkpoint.limits`) and a tensor's checked to
    hold its chunk's shape and dtype."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from smalti.checkpoint.safe_load import load_torch, open_inside

    for index, info in sorted((metadata.storage_data or {}).items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        entry = metadata.state_dict_metadata.get(index.fqn)
        transformed = getattr(info, "transform_descriptors", None)
        if not isinstance(entry, BytesStorageMetadata) and not transformed:
            continue  # an untransformed tensor: its bytes are the file's, digest-checked above
        where = f"the entry {index.fqn!r} of {folder / info.relative_path}"
        with open_inside(folder, info.relative_path, "named by DCP's metadata") as f:
            f.seek(info.offset)
            record = f.read(info.length)
        if transformed:
            record = decode_bounded(record, transformed, decoded_limit(metadata, index, where), where)
        try:
            loaded = load_torch(io.BytesIO(record), where, trust_pickles)
        except (CheckpointCorruptError, UnsafeCheckpointError):
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged record fails in many ways
            raise CheckpointCorruptError(f"cannot read {where}: {exc!r}", str(folder / info.relative_path)) from None
        if not isinstance(entry, BytesStorageMetadata):
            chunk = next(c for c in entry.chunks if c.offsets == index.offset)  # decoded_limit found it
            if not (isinstance(loaded, torch.Tensor) and loaded.dtype == entry.properties.dtype
                    and tuple(loaded.shape) == tuple(chunk.sizes)):
                got = f"{type(loaded).__name__} {getattr(loaded, 'dtype', '')} {tuple(getattr(loaded, 'shape', ()))}"
                raise CheckpointCorruptError(
                    f"{where} holds a {got}, not the {entry.properties.dtype} {tuple(chunk.sizes)} chunk its "
                    "metadata declares", str(folder / info.relative_path),
                )


def _verify_rank_files(folder: Path, files: dict[str, dict[str, Any]], trust_pickles: bool = False) -> None:
    """Every rank-local state file reads without running code (or, with ``trust_pickles``, reads at all)."""
    from smalti.checkpoint.safe_load import load_torch

    for rel in sorted(files):
        if rel.startswith("extra/"):
            try:
                load_torch(folder / rel, str(folder / rel), trust_pickles)
            except (CheckpointCorruptError, UnsafeCheckpointError):
                raise
            except Exception as exc:  # noqa: BLE001 - a damaged file fails in many ways
                raise CheckpointCorruptError(f"cannot read {folder / rel}: {exc!r}", str(folder / rel)) from None
