"""The MDS shard format: :class:`MDSWriter` writes shards and ``index.json``; :func:`read_shard_samples` and
:class:`ShardReader` read them back. Byte-compatible with mosaicml-streaming's index version 2.

A shard is ``u32 N | u32 offsets[N+1] | config JSON | samples``; a sample is the ``u32`` lengths of its
variable-size columns followed by every column's bytes, columns in sorted-name order.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from smalti.storage import (
    StorageError,
    UnsafeLocalPathError,
    atomic_write,
    atomic_write_bytes,
    open_beneath,
    open_store,
    split_url,
)
from smalti.streaming import compression as comp
from smalti.streaming import encodings, seekable
from smalti.streaming.declared_sizes import (  # noqa: F401  (MAX_*: part of this module's API)
    MAX_COMPRESSION_RATIO,
    MAX_SHARD_BYTES,
    SMALL_SHARD_BYTES,
    check_declared_sizes,
)
from smalti.streaming.errors import ShardCorruptError, StreamingError, UnsafePathError, UploadError
from smalti.streaming.hashing import digest
from smalti.streaming.paths import check_name
from smalti.streaming.shard_table import INDEX_NPZ, NotColumnar, ShardTable, matching_table, write_table

log = logging.getLogger(__name__)

INDEX = "index.json"
COPY_HASH = "xxh3_128"  # recorded for every local copy smalti makes of a shard (fast: ~10+ GB/s)
DEFAULT_SIZE_LIMIT = 1 << 26
DEFAULT_ZSTD_FRAME_SIZE = 1 << 20  # raw bytes per zstd frame of a seekable shard (see smalti.streaming.seekable)
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]\+?([0-9]+))?\s*([a-z]*)\s*$")
# binary multiples whichever way they are written ("50gb" = "50GiB" = 50 * 2**30), as mosaicml-streaming reads them
_UNITS = {"": 1, "b": 1}
for _power, _letter in enumerate("kmgtpe", start=1):
    for _suffix in (_letter, _letter + "b", _letter + "ib"):
        _UNITS[_suffix] = 1 << (10 * _power)
# index.json below this size (about 1,800 shards) is parsed, not read from index.npz: opening the ten arrays of
# an .npz costs ~1 ms, more than parsing a small JSON, which matters to a mix of many small streams
COLUMNAR_MIN_BYTES = 1 << 20


def parse_size(value: int | str | None, what: str = "size") -> int | None:
    """A byte count from ``value``: an int, or a string like ``"50gb"``, ``"1.5TiB"``, ``"64 MB"``, ``"4096"``.

    Units are binary (``kb`` = ``kib`` = ``k`` = 1024 bytes, up to ``eb``) and case-insensitive; a fraction is
    rounded down to whole bytes. ``None`` passes through. Anything else, or a size below one byte, raises
    :class:`StreamingError` naming ``what`` and the value.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise StreamingError(f"{what}={value!r} is not a size: give bytes (an int) or a string like '64mb', '50gb'")
    if isinstance(value, str):
        match = _SIZE.match(value.lower())
        if match is None or match.group(3) not in _UNITS:
            raise StreamingError(f"{what}={value!r} is not a size: give bytes or a number with a unit (b, kb, mb, "
                                 "gb, tb, pb; kib... and k... mean the same), e.g. '64mb', '50gb', '1.5TiB'")
        number, exponent, unit = match.groups()
        size = int(float(number) * 10 ** int(exponent or 0) * _UNITS[unit]) if ("." in number or exponent) \
            else int(number) * _UNITS[unit]
    elif isinstance(value, float):
        if not value == value or value in (float("inf"), float("-inf")):
            raise StreamingError(f"{what}={value!r} is not a size")
        size = int(value)
    else:
        size = value
    if size < 1:
        raise StreamingError(f"{what}={value!r} must be at least 1 byte")
    return size


class MDSWriter:
    """Writes samples (dicts keyed by column) into MDS shards of at most ``size_limit`` bytes.

    ``out`` is a local directory or any URL smalti-storage opens (``s3://``, ``gs://``, ``az://``, ``oci://``,
    plugin schemes): shards are staged locally, uploaded, and ``index.json`` goes last, so readers never see
    an index that lists a shard not yet there. Use as a context manager; ``index.json`` is written only by
    :meth:`finish`, so an interrupted write never looks like a complete dataset.

    zstd shards are written as frames of about ``zstd_frame_size`` raw bytes (whole samples each) followed
    by a seek table (zstd's seekable format, see :mod:`smalti.streaming.seekable`), so that a reader can
    decompress only the frames of the samples it needs first; every zstd decoder, mosaicml-streaming's
    included, reads such a shard as before. ``zstd_frame_size=None`` (or 0) writes each shard as one frame.
    """

    def __init__(self, out: str | os.PathLike[str], columns: dict[str, str], compression: str | None = None,
                 hashes: list[str] | None = None, size_limit: int | str | None = DEFAULT_SIZE_LIMIT,
                 exist_ok: bool = False, allow_unsafe_types: bool = False,
                 zstd_frame_size: int | str | None = DEFAULT_ZSTD_FRAME_SIZE) -> None:
        scheme, _, path = split_url(out)
        self.remote = str(out) if scheme != "file" else None
        self._store = None
        if self.remote:
            try:  # an unknown scheme or a missing client fails now, not after the shards are written
                self._store = open_store(self.remote)
            except StorageError as exc:
                raise StreamingError(f"MDSWriter(out={self.remote!r}): {exc}") from exc
        self.local = Path(tempfile.mkdtemp(prefix="smalti-mds-")) if self.remote else Path(path)
        if not self.remote:
            if self.local.exists() and any(self.local.iterdir()) and not exist_ok:
                raise StreamingError(f"output directory {self.local} is not empty; pass exist_ok=True to overwrite")
            self.local.mkdir(parents=True, exist_ok=True)
        self.column_names = sorted(columns)
        self.column_encodings = [columns[name] for name in self.column_names]
        for name, enc in zip(self.column_names, self.column_encodings):
            encodings.check(enc, allow_unsafe_types, name)
        self.column_sizes = [encodings.fixed_size(enc) for enc in self.column_encodings]
        comp.parse(compression)
        self.compression = compression or None
        self.zstd_frame_size = None if zstd_frame_size in (None, 0) else \
            parse_size(zstd_frame_size, "zstd_frame_size")
        self.hashes = list(hashes or [])
        if sorted(set(self.hashes)) != self.hashes:
            raise StreamingError(f"hashes={self.hashes} must be unique and sorted")
        for algo in self.hashes:
            digest(algo, b"")
        self.size_limit = parse_size(size_limit, "size_limit")
        if self.size_limit is not None and self.size_limit > MAX_SHARD_BYTES:
            raise StreamingError(f"size_limit={size_limit!r} ({self.size_limit} bytes) is too large: an MDS shard "
                                 f"holds at most {MAX_SHARD_BYTES} bytes (its offsets are 32-bit)")
        self.config = json.dumps({
            "column_encodings": self.column_encodings, "column_names": self.column_names,
            "column_sizes": self.column_sizes, "compression": self.compression, "format": "mds",
            "hashes": self.hashes, "size_limit": self.size_limit, "version": 2,
        }, sort_keys=True).encode("utf-8")
        self.shards: list[dict[str, Any]] = []
        self._samples: list[bytes] = []
        self._size = 8 + len(self.config)
        self._finished = False

    def encode_sample(self, sample: dict[str, Any]) -> bytes:
        """The bytes of one sample; raises naming a missing column."""
        lengths, values = [], []
        for name, enc, size in zip(self.column_names, self.column_encodings, self.column_sizes):
            if name not in sample:
                raise StreamingError(f"sample is missing column {name!r} (columns: {', '.join(self.column_names)})")
            data = encodings.encode(enc, sample[name])
            if size is None:
                lengths.append(len(data))
            elif len(data) != size:
                raise StreamingError(f"column {name!r} ({enc}) must be {size} bytes, got {len(data)}")
            values.append(data)
        return struct.pack(f"<{len(lengths)}I", *lengths) + b"".join(values)

    def write(self, sample: dict[str, Any]) -> None:
        """Append one sample, starting a new shard first when it would not fit in ``size_limit``."""
        data = self.encode_sample(sample)
        if self.size_limit and self.size_limit < self._size + len(data) + 4:
            self._flush()
        self._samples.append(data)
        self._size += len(data) + 4

    def _flush(self) -> None:
        n = len(self._samples)
        sizes = np.array([len(s) for s in self._samples], dtype=np.uint32)
        start = 4 + 4 * (n + 1) + len(self.config)
        offsets = start + np.concatenate([[0], np.cumsum(sizes, dtype=np.uint64)]).astype(np.uint32)
        raw = struct.pack("<I", n) + offsets.tobytes() + self.config + b"".join(self._samples)
        basename = f"shard.{len(self.shards):05}.mds"
        entry: dict[str, Any] = {
            "column_encodings": self.column_encodings, "column_names": self.column_names,
            "column_sizes": self.column_sizes, "compression": self.compression, "format": "mds",
            "hashes": self.hashes, "samples": n, "size_limit": self.size_limit, "version": 2,
            "raw_data": {"basename": basename, "bytes": len(raw), "hashes": {h: digest(h, raw) for h in self.hashes}},
            "zip_data": None,
        }
        if self.compression:
            packed = self._compress(raw, offsets)
            zip_name = basename + comp.extension(self.compression)
            entry["zip_data"] = {"basename": zip_name, "bytes": len(packed),
                                 "hashes": {h: digest(h, packed) for h in self.hashes}}
            atomic_write_bytes(self.local / zip_name, packed, fsync=not self.remote)
        else:
            atomic_write_bytes(self.local / basename, raw, fsync=not self.remote)  # staged copies need no fsync
        self.shards.append(entry)
        self._samples = []
        self._size = 8 + len(self.config)

    def _compress(self, raw: bytes, offsets: np.ndarray) -> bytes:
        family, level = comp.parse(self.compression)  # type: ignore[misc]
        if family == "zstd" and self.zstd_frame_size:
            cuts = seekable.frame_cuts(offsets, self.zstd_frame_size)  # offsets[-1] is the shard's end
            if max(b - a for a, b in zip(cuts[:-1], cuts[1:])) <= seekable.MAX_FRAME_RAW:
                return seekable.compress_frames(raw, cuts, level)  # type: ignore[arg-type]
        return comp.compress(self.compression, raw)  # type: ignore[arg-type]

    def finish(self) -> None:
        """Flush the last shard and write ``index.json`` (for a remote ``out``: uploading the shards first)."""
        if self._finished:
            return
        if self._samples or not self.shards:
            self._flush()
        index = json.dumps({"shards": self.shards, "version": 2}, sort_keys=True).encode("utf-8")
        if self._store is not None:
            names = [(entry["zip_data"] or entry["raw_data"])["basename"] for entry in self.shards]
            for name in names:
                self._upload(lambda name=name: self._store.put_file(self.local / name, name), name)
            if write_table(self.local, index, self.shards):
                npz = self.local / INDEX_NPZ
                self._upload(lambda: self._store.put_file(npz, INDEX_NPZ), INDEX_NPZ)
            self._upload(lambda: self._store.put_bytes(INDEX, index), INDEX)  # last: the commit
            shutil.rmtree(self.local, ignore_errors=True)
        else:
            write_table(self.local, index, self.shards)  # first: readers use it only once index.json matches it
            atomic_write_bytes(self.local / INDEX, index)
        self._finished = True

    def _upload(self, put: Any, name: str) -> None:
        try:
            put()
        except StorageError as exc:
            raise UploadError(f"could not upload {name} of the dataset to {self.remote} (staged in {self.local}; "
                              f"nothing is published until index.json is): {exc}") from exc

    def __enter__(self) -> MDSWriter:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.finish()


def _parse_index(path: Path) -> list[Any]:
    """``index.json``'s ``shards`` list, unchecked beyond the index's own version."""
    try:
        obj = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise StreamingError(f"cannot read MDS index {path}: {exc}") from exc
    if not isinstance(obj, dict) or obj.get("version") != 2:
        version = obj.get("version") if isinstance(obj, dict) else None
        raise StreamingError(f"{path}: index version {version!r} is not supported (need 2)")
    shards = obj.get("shards", [])
    if not isinstance(shards, list):
        raise StreamingError(f"{path}: 'shards' is not a list")
    return shards


def load_index(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The shard entries of an ``index.json``; raise naming the file when it is not a version-2 MDS index."""
    path = Path(path)
    shards = _parse_index(path)
    _check_entries(shards, path)
    return shards


def _check_entries(shards: list[Any], path: Path) -> None:
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict) or shard.get("format") != "mds" or shard.get("version") != 2:
            shard = shard if isinstance(shard, dict) else {}
            raise StreamingError(f"{path}: shard {i} is format {shard.get('format')!r} v{shard.get('version')}, "
                                 "only MDS version 2 is supported")
        for key in ("raw_data", "zip_data"):
            if key == "raw_data" or shard.get(key):
                check_name((shard.get(key) or {}).get("basename"), path, f"shard {i} {key}.basename")
        check_declared_sizes(shard, path, i)


def read_index(path: str | os.PathLike[str], index_bytes: bytes | None = None,
               npz: bytes | Path | None | bool = True) -> Sequence[dict[str, Any]]:
    """The shard entries of the ``index.json`` at ``path`` (whose bytes are ``index_bytes`` when already read),
    checked as :func:`load_index` checks them, as a :class:`~smalti.streaming.shard_table.ShardTable` when
    they have a columnar form: read from ``npz`` (``index.npz``'s bytes or path; ``True``: the one beside
    ``path``) when it matches the JSON, else parsed from the JSON (see :mod:`smalti.streaming.shard_table`).
    An ``index.json`` under :data:`COLUMNAR_MIN_BYTES` is read as a list of dicts, as :func:`load_index` reads
    it: for a few thousand shards that is faster than opening the columns."""
    path = Path(path)
    size = len(index_bytes) if index_bytes is not None else path.stat().st_size
    if size < COLUMNAR_MIN_BYTES:  # a few thousand shards at most: the JSON is read faster than the columns
        return load_index(path)
    if npz is True:
        npz = path.parent / INDEX_NPZ
    table = matching_table(path, npz or None, index_bytes)  # type: ignore[arg-type]
    if table is not None:
        return table
    entries = _parse_index(path)
    try:
        table = ShardTable.from_entries(entries, path)
    except NotColumnar:  # the entry-by-entry checks name what is wrong, or it is right but has no columns
        _check_entries(entries, path)
        return entries
    del entries  # the columns hold it all: let the JSON's objects go before the checks
    table.check()
    return table


def check_columns(entry: dict[str, Any], allow_unsafe_types: bool, where: object) -> None:
    """Raise naming ``where`` and the column when a shard has an unknown or (not allowed) unsafe encoding."""
    for name, enc in zip(entry["column_names"], entry["column_encodings"]):
        try:
            encodings.check(enc, allow_unsafe_types, name)
        except StreamingError as exc:
            raise StreamingError(f"{where}: {exc}") from None


class ShardReader:
    """Random access to the samples of one raw (decompressed) shard file (or of ``data``, the raw shard's
    bytes in memory, when given).

    A shard with a ``pkl`` column (unpickling can run code) is refused unless ``allow_unsafe_types``.
    """

    def __init__(self, path: Path, entry: dict[str, Any], stream: str = "", allow_unsafe_types: bool = False,
                 data: Any = None) -> None:
        check_columns(entry, allow_unsafe_types, f"shard {path} of stream {stream or path.parent}")
        self.path, self.entry, self.stream = path, entry, stream
        self.identity: tuple[int, int] | None = None
        if data is not None:  # the raw shard's bytes in memory (see smalti.streaming.partial)
            self.data = data
        else:
            with _open_nofollow(path) as f:  # mapped, not read: opening a shard costs nothing until samples are touched
                st = os.fstat(f.fileno())
                self.identity = (st.st_dev, st.st_ino)  # tells a replaced file from this one
                self.data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if st.st_size else b""
        n = entry["samples"]
        if len(self.data) != entry["raw_data"]["bytes"]:
            raise ShardCorruptError(
                f"shard {path} of stream {stream or path.parent} is {len(self.data)} bytes, the index says "
                f"{entry['raw_data']['bytes']}: truncated or replaced"
            )
        (count,) = struct.unpack_from("<I", self.data, 0)
        if count != n:
            raise ShardCorruptError(f"shard {path} of stream {stream or path.parent} holds {count} samples, "
                                    f"the index says {n}")
        self.offsets = np.frombuffer(self.data, dtype=np.uint32, count=n + 1, offset=4)
        self.encodings = entry["column_encodings"]
        self.names = entry["column_names"]
        self.sizes = entry["column_sizes"]
        self.variable = [i for i, s in enumerate(self.sizes) if s is None]
        self._decoders = [encodings.decoder(enc) for enc in self.encodings]
        self._view = memoryview(self.data)
        self._columns: dict[str, np.ndarray] | None | bool = False  # False: not worked out yet
        self.column_layout: tuple[tuple[str, np.dtype, tuple[int, ...]], ...] | None = None  # names, dtypes, shapes

    def __len__(self) -> int:
        return self.entry["samples"]

    def raw_sample(self, i: int) -> bytes:
        """The encoded bytes of sample ``i``."""
        return bytes(self.data[self.offsets[i] : self.offsets[i + 1]])

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} is out of range for shard {self.path} ({len(self)} samples)")
        begin, end = int(self.offsets[i]), int(self.offsets[i + 1])
        if not (0 < begin <= end <= len(self.data)):
            raise ShardCorruptError(f"shard {self.path} of stream {self.stream or self.path.parent}: sample {i} "
                                    f"spans bytes {begin}..{end} of {len(self.data)}")
        data = self._view[begin:end]
        sizes = list(self.sizes)
        if self.variable:
            lengths = struct.unpack_from(f"<{len(self.variable)}I", data, 0)
            for col, length in zip(self.variable, lengths):
                sizes[col] = length
        pos = 4 * len(self.variable)
        sample = {}
        for name, decode, size in zip(self.names, self._decoders, sizes):
            try:
                sample[name] = decode(data[pos : pos + size])
            except StreamingError as exc:
                raise ShardCorruptError(f"shard {self.path} of stream {self.stream or self.path.parent}: sample {i} "
                                        f"column {name!r}: {exc}") from None
            pos += size
        if pos != len(data):
            raise ShardCorruptError(f"shard {self.path} of stream {self.stream or self.path.parent}: sample {i} "
                                    f"holds {len(data)} bytes, its columns {pos}")
        return sample

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))

    def column_views(self) -> dict[str, np.ndarray] | None:
        """Zero-copy, read-only views ``(samples, *shape)`` of every column, or ``None`` when not columnar.

        A shard is columnar when every column is a fixed-size number or array (``ndarray:<dtype>:<shape>``,
        the numeric encodings, ``int``) and its samples lie at a constant stride, which the offsets table is
        checked against once. Batched reads gather rows from these views with one copy per column.
        """
        if self._columns is False:
            self._columns = self._make_column_views()
            self.column_layout = None if self._columns is None else tuple(
                (name, view.dtype, view.shape[1:]) for name, view in self._columns.items())
        return self._columns

    def _make_column_views(self) -> dict[str, np.ndarray] | None:
        n = len(self)
        specs = [encodings.column_spec(enc) for enc in self.encodings]
        if not n or self.variable or any(spec is None for spec in specs):
            return None
        stride = sum(self.sizes)
        first = int(self.offsets[0])
        expected = first + stride * np.arange(n + 1, dtype=np.int64)
        if first <= 0 or not np.array_equal(self.offsets.astype(np.int64), expected) or \
                int(expected[-1]) > len(self.data):
            return None  # not laid out at a constant stride: the per-sample path checks each sample
        views, pos = {}, first
        for name, (dtype, shape), size in zip(self.names, specs, self.sizes):
            inner = tuple(int(np.prod(shape[i + 1 :], dtype=np.int64)) * dtype.itemsize for i in range(len(shape)))
            views[name] = np.ndarray((n, *shape), dtype=dtype, buffer=self.data, offset=pos,
                                     strides=(stride, *inner))
            pos += size
        return views

    def gather(self, rows: np.ndarray | list[int]) -> list[dict[str, Any]]:
        """Samples ``rows`` (in that order), equal to ``[self[i] for i in rows]``, fetched in one pass."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and not (rows.min() >= 0 and rows.max() < len(self)):
            bad = int(rows[(rows < 0) | (rows >= len(self))][0])
            raise IndexError(f"sample {bad} is out of range for shard {self.path} ({len(self)} samples)")
        views = self.column_views()
        if views is None:
            return [self[int(i)] for i in rows]
        blocks = []
        for name, enc in zip(self.names, self.encodings):
            block = views[name][rows]  # one copy: the samples own their memory, never the mapped file's
            blocks.append((name, block.tolist() if enc == "int" else block))
        return [{name: block[j] for name, block in blocks} for j in range(len(rows))]


def verify_file(path: Path, info: dict[str, Any], stream: str = "", shown_as: Path | None = None) -> None:
    """Check a shard file's size and every hash the index lists; raise naming the shard and stream.

    ``shown_as`` is the name to report when ``path`` is a temporary copy of that shard.
    """
    with _open_nofollow(path) as f:
        data = _map(f)
    try:
        verify_buffer(data, info, shown_as or path, stream)
    finally:
        if isinstance(data, mmap.mmap):
            data.close()


def _open_nofollow(path: Path) -> Any:
    """``open(path, "rb")``, refusing a link (:class:`UnsafePathError`): cached shards are never links."""
    try:
        return os.fdopen(open_beneath(path.parent, path.name), "rb")
    except UnsafeLocalPathError as exc:
        raise UnsafePathError(str(exc)) from None


def _map(f: Any) -> mmap.mmap | bytes:
    """A read-only mapping of the open file ``f`` (``b""`` when it is empty: an empty file cannot be mapped)."""
    return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else b""


def verify_buffer(data: Any, info: dict[str, Any], name: Path, stream: str = "") -> None:
    """Check the contents ``data`` of shard file ``name`` against the size and hashes ``info`` lists."""
    size = len(data)
    if size != info["bytes"]:
        raise ShardCorruptError(f"shard {name} of stream {stream or name.parent} is {size} bytes, the index "
                                f"says {info['bytes']}: truncated or replaced")
    for algo, expected in (info.get("hashes") or {}).items():
        got = digest(algo, data)
        if got != expected:
            raise ShardCorruptError(f"shard {name} of stream {stream or name.parent}: {algo} is {got}, the "
                                    f"index says {expected}")


_COPY_XATTR = f"user.smalti.{COPY_HASH}"


def copy_record(raw: Path) -> Path:
    """The file holding the hash of the local copy ``raw`` where the filesystem has no user xattrs."""
    return raw.parent / f".{raw.name}.{COPY_HASH}"


def record_copy(path: Path, hexdigest: str, final: Path | None = None) -> None:
    """Record ``hexdigest`` (:data:`COPY_HASH`) for the file ``path`` that will be renamed to ``final``.

    It is an extended attribute of the file itself, so it appears with the file's rename, travels with it
    and goes when it is deleted; on filesystems without user xattrs it is a hidden file beside ``final``.
    """
    try:
        os.setxattr(path, _COPY_XATTR, hexdigest.encode("ascii"))
    except (OSError, AttributeError):  # no user xattrs on this filesystem (or not Linux)
        atomic_write_bytes(copy_record(final or path), hexdigest.encode("ascii"), fsync=False)
    else:
        copy_record(final or path).unlink(missing_ok=True)  # a record left by an earlier copy would mislead


def _recorded(raw: Path) -> str | None:
    try:
        return os.getxattr(raw, _COPY_XATTR).decode("ascii", "replace")
    except (OSError, AttributeError):
        pass
    try:
        return copy_record(raw).read_text(errors="replace").strip()
    except FileNotFoundError:
        return None


def remove_copy(raw: Path) -> None:
    """Delete a local shard copy (and the record of its hash, when that is a file of its own)."""
    copy_record(raw).unlink(missing_ok=True)
    raw.unlink(missing_ok=True)


def file_digest(path: Path, algo: str = COPY_HASH) -> str:
    with _open_nofollow(path) as f:
        size = os.fstat(f.fileno()).st_size
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    try:
        return digest(algo, data)
    finally:
        if isinstance(data, mmap.mmap):
            data.close()


def check_copy(raw: Path, info: dict[str, Any], stream: str = "", trust_record: bool = True) -> str:
    """Whether the local copy ``raw`` of a shard is what was written: ``"ok"``, ``"bad"`` or ``"unknown"``.

    It is compared with the hash recorded when the copy was made. A copy without a record (made by an
    older version or another tool) is checked against the index's hashes for it (``info``), and recorded
    when they match; without those it is ``"unknown"``. ``trust_record=False`` (a cache other users may
    write to, where a record could be forged with the copy) checks against the index's hashes when it
    lists any, whatever the record says.
    """
    recorded = _recorded(raw) if trust_record or not info.get("hashes") else None
    if recorded is not None:
        if file_digest(raw) == recorded:
            return "ok"
        log.warning("local copy %s of stream %s differs from the %s recorded when it was made (bit rot, or "
                    "changed by something else); it will not be used", raw, stream or raw.parent, COPY_HASH)
        return "bad"
    if not info.get("hashes"):
        return "unknown"
    try:
        verify_file(raw, info, stream)
    except ShardCorruptError as exc:
        log.warning("%s; it will not be used", exc)
        return "bad"
    try:
        record_copy(raw, file_digest(raw))
    except OSError as exc:  # a read-only dataset: checked against the index again next time
        log.debug("cannot record the hash of %s: %r", raw, exc)
    return "ok"


def decompress_shard(root: Path, entry: dict[str, Any], stream: str = "", validate_hash: bool = True) -> Path:
    """Make sure a good raw shard file exists under ``root`` (decompressing the zip if needed); return its path.

    Output is hashed as it is written and the hash recorded beside it (see :func:`check_copy`); an
    existing raw copy that fails that check is made again from the zip. Decompression stops, and the shard is
    refused, as soon as the output would pass the index's ``raw_data.bytes``.
    """
    raw = root / entry["raw_data"]["basename"]
    zip_info = entry.get("zip_data")
    packed = root / zip_info["basename"] if zip_info else None
    if raw.exists():
        if not zip_info:
            return raw
        state = check_copy(raw, entry["raw_data"], stream)
        if state == "ok" or (state == "unknown" and not packed.exists()):
            return raw
        if not packed.exists():
            raise ShardCorruptError(f"shard {raw} of stream {stream or root} differs from the hash recorded when "
                                    f"it was decompressed, and its compressed copy {packed.name} is gone: delete "
                                    "it and fetch the dataset again")
    elif not zip_info:
        raise StreamingError(f"shard {raw} of stream {stream or root} is missing")
    with _open_nofollow(packed) as f:
        # one mapping of the zip serves the hash check and the decompression (zstd reads it in place)
        packed_data = _map(f)
    try:
        if validate_hash:
            verify_buffer(packed_data, zip_info, packed, stream)
        _decompress_to(raw, packed, packed_data, entry, stream or str(root))
    finally:
        if isinstance(packed_data, mmap.mmap):
            packed_data.close()
    return raw


def _decompress_to(raw: Path, packed: Path, packed_data: Any, entry: dict[str, Any], stream: str) -> None:
    """Decompress ``packed_data`` (the contents of ``packed``) into ``raw``, recording the copy's hash."""
    declared = entry["raw_data"]["bytes"]
    with atomic_write(raw, "wb", fsync=False) as dst:
        # no fsync: a copy a crash damaged fails its recorded hash and is made again from the zip or remote
        import xxhash

        hasher = getattr(xxhash, COPY_HASH)()
        try:
            size = comp.decompress_stream(entry["compression"], packed_data, dst, limit=declared,
                                          on_write=hasher.update)
        except comp.OutputLimitError as exc:
            raise ShardCorruptError(
                f"shard {packed} of stream {stream} decompresses to more than the {declared} bytes "
                f"its index declares (raw_data.bytes; stopped at {exc.produced}): refused as damaged or "
                "hostile; write the dataset again"
            ) from None
        except Exception as exc:  # zstd/zlib/bz2/brotli/snappy errors on damaged data
            raise ShardCorruptError(f"shard {packed} of stream {stream} does not decompress: "
                                    f"{exc}") from exc
        if size != declared:
            raise ShardCorruptError(f"shard {packed} of stream {stream} decompresses to {size} bytes, the "
                                    f"index says {declared}: truncated or replaced")
        dst.flush()
        record_copy(Path(dst.name), hasher.hexdigest(), final=raw)


def read_shard_samples(root: str | os.PathLike[str], validate_hash: bool = True,
                       allow_unsafe_types: bool = False) -> Iterator[dict[str, Any]]:
    """Every sample of a local MDS directory, in order (checking hashes).

    A dataset with a ``pkl`` column is refused before anything is read unless ``allow_unsafe_types``.
    """
    root = Path(root)
    entries = load_index(root / INDEX)
    for entry in entries:
        check_columns(entry, allow_unsafe_types, root / INDEX)
    for entry in entries:
        raw = decompress_shard(root, entry, validate_hash=validate_hash)
        if validate_hash and not entry.get("zip_data"):
            verify_file(raw, entry["raw_data"])
        yield from ShardReader(raw, entry, allow_unsafe_types=allow_unsafe_types)


def merge_index(root: str | os.PathLike[str], subdirs: list[str] | None = None) -> Path:
    """Write ``root/index.json`` listing the shards of each ``root/<subdir>/index.json`` (parallel writers)."""
    root = Path(root)
    subdirs = subdirs or sorted(p.parent.name for p in root.glob("*/" + INDEX))
    shards = []
    for sub in subdirs:
        check_name(sub, root / INDEX, f"sub-index folder of {root}")
        for entry in load_index(root / sub / INDEX):
            entry = json.loads(json.dumps(entry))
            entry["raw_data"]["basename"] = f"{sub}/{entry['raw_data']['basename']}"
            if entry.get("zip_data"):
                entry["zip_data"]["basename"] = f"{sub}/{entry['zip_data']['basename']}"
            shards.append(entry)
    index = json.dumps({"shards": shards, "version": 2}, sort_keys=True).encode()
    write_table(root, index, shards)
    atomic_write_bytes(root / INDEX, index)
    return root / INDEX
