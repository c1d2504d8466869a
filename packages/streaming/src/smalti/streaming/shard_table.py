"""An MDS index held as columns: ``index.npz``, written beside ``index.json`` and read in its place when it matches.

mosaicml-streaming's ``index.json`` stays the source of truth (and byte for byte what mosaicml-streaming
writes and reads). Parsing and checking it costs CPU time and Python objects per shard in every process (the
streaming README's index section has the figures), so smalti also writes the same entries as NumPy columns: per shard its sample
count, raw and zip sizes, the index of its *configuration* (the keys every shard of a dataset usually shares:
columns, compression, hash names, ``size_limit``...; each distinct one stored once), its file names (one UTF-8
blob and offsets) and its hashes (raw bytes, half the size of their hex). A shard's entry dict is made only
when the shard is used (:meth:`ShardTable.__getitem__`), equal to the one in ``index.json``.

``index.npz`` records the size and ``xxh3_128`` of the ``index.json`` it was made from and is read only when
the current ``index.json`` has both: a content hash, not size and mtime, because a download or copy of the
folder (a remote stream's cached index is rewritten at every start) changes the mtime of an unchanged file,
and an edit can keep the size; hashing the JSON costs far less than parsing it. Anything else (no
``index.npz``, one of another ``index.json``, one that does not read) falls back to the JSON with a log line.
"""

from __future__ import annotations

import io
import json
import logging
import mmap
import os
import zipfile
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from smalti.storage import atomic_write
from smalti.streaming.declared_sizes import check_declared_sizes, declared_sizes_ok
from smalti.streaming.errors import StreamingError
from smalti.streaming.paths import check_name

log = logging.getLogger(__name__)

INDEX_NPZ = "index.npz"
FORMAT = "smalti-mds-columnar/1"
JSON_HASH = "xxh3_128"
_PER_SHARD = ("samples", "raw_data", "zip_data")
_ZIP_ABSENT, _ZIP_NULL, _ZIP_FILE = 0, 1, 2  # an entry without a zip_data key, with null, with a file
_FILE_KEYS = {"basename": 0, "bytes": 0, "hashes": 0}.keys()


class NotColumnar(StreamingError):
    """An index entry the columnar form cannot hold exactly (the index is then read from its JSON)."""


def json_digest(data: Any) -> str:
    """The ``xxh3_128`` hex digest of an ``index.json``'s bytes, which ``index.npz`` records."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


def _copy(value: Any) -> Any:
    """A fresh copy of a JSON value, so that no two entries share a list or dict."""
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


class ShardTable(Sequence[dict[str, Any]]):
    """The shard entries of one MDS index as columns; ``table[i]`` is entry ``i`` as ``index.json`` lists it.

    ``samples``, ``raw_bytes`` and ``zip_bytes`` (0 for a shard without a zip) are int64 arrays over the
    shards, for the dataset's sums and orders; names and hashes are decoded, and each name checked to stay
    inside its folder, only when an entry is made. ``source`` names the file in errors.
    """

    def __init__(self, configs: list[dict[str, Any]], columns: dict[str, np.ndarray], source: object) -> None:
        self.configs, self.source = configs, source
        self.config = columns["config"]
        self.samples, self.raw_bytes, self.zip_bytes = columns["samples"], columns["raw_bytes"], columns["zip_bytes"]
        self._columns = columns
        self._entries: OrderedDict[int, dict[str, Any]] = OrderedDict()  # the last entries made, reused

    # ------------------------------------------------------------------ reading entries

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]  # type: ignore[return-value]
        i = int(i)
        if i < 0:
            i += len(self)
        entry = self._entries.get(i)
        if entry is None:
            entry = self._make(i)
            self._entries[i] = entry
            if len(self._entries) > 4096:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(i)
        return entry

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self._make(i) for i in range(len(self)))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_entries": OrderedDict()}

    def raw_folders(self) -> set[str]:
        """The distinct folders of the raw files' names (``""`` for names without one), each checked."""
        blob, offsets = self._columns["raw_names"], self._columns["raw_name_offsets"]
        slashes = np.flatnonzero(blob == ord("/"))
        ends = offsets[1:]
        last = np.searchsorted(slashes, ends) - 1  # the last slash before each name's end, if in the name
        cut = np.where(last >= 0, slashes[np.maximum(last, 0)] if len(slashes) else 0, -1)
        has = cut >= offsets[:-1]
        folders = {""} if not has.all() else set()
        starts, cuts = offsets[:-1][has], cut[has]
        raw = blob.tobytes()
        found = {raw[a:c] for a, c in zip(starts.tolist(), cuts.tolist())}
        folders |= {check_name(f.decode("utf-8"), self.source, "a shard folder") for f in found}
        return folders

    def configs_as_entries(self) -> list[dict[str, Any]]:
        """The keys shared by shards (columns, compression, ...), one dict per distinct set: what
        :func:`smalti.streaming.mds.check_columns` checks, once per set instead of once per shard."""
        return [config["rest"] for config in self.configs]

    def zip_kinds(self) -> np.ndarray:
        """Per shard: 0 without a ``zip_data`` key, 1 with ``null``, 2 with a compressed file."""
        return np.array([config["zip"] for config in self.configs], dtype=np.int8)[self.config]

    def name(self, kind: str, i: int) -> str:
        """Shard ``i``'s ``raw`` or ``zip`` file name, checked to stay inside the dataset's folder."""
        return self._name(kind, i)

    def _name(self, kind: str, i: int) -> str:
        offsets = self._columns[f"{kind}_name_offsets"]
        blob = self._columns[f"{kind}_names"]
        try:
            name = blob[offsets[i] : offsets[i + 1]].tobytes().decode("utf-8")
        except UnicodeDecodeError:
            raise StreamingError(f"{self.source}: shard {i} {kind}_data.basename is not UTF-8") from None
        return check_name(name, self.source, f"shard {i} {kind}_data.basename")

    def _hashes(self, kind: str, algos: list[str], i: int) -> dict[str, str]:
        return {algo: self._columns[f"{kind}_hash.{algo}"][i].tobytes().hex() for algo in algos}

    def _make(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"shard {i} is out of range for {self.source} ({len(self)} shards)")
        config = self.configs[int(self.config[i])]
        entry = _copy(config["rest"])
        entry["samples"] = int(self.samples[i])
        entry["raw_data"] = {"basename": self._name("raw", i), "bytes": int(self.raw_bytes[i]),
                             "hashes": self._hashes("raw", config["raw_hashes"], i)}
        if config["zip"] == _ZIP_NULL:
            entry["zip_data"] = None
        elif config["zip"] == _ZIP_FILE:
            entry["zip_data"] = {"basename": self._name("zip", i), "bytes": int(self.zip_bytes[i]),
                                 "hashes": self._hashes("zip", config["zip_hashes"], i)}
        return entry

    # ------------------------------------------------------------------ building, saving, loading

    @classmethod
    def from_entries(cls, entries: Sequence[dict[str, Any]], source: object) -> ShardTable:
        """The table of ``entries`` (``index.json``'s ``shards``); :class:`NotColumnar` when one of them holds
        something the columns cannot give back exactly (extra keys in ``raw_data``, hashes that are not hex)."""
        try:
            return cls._from_entries(entries, source)
        except (KeyError, TypeError, AttributeError, OverflowError, UnicodeEncodeError) as exc:
            raise NotColumnar(f"{source}: an entry has no exact columnar form ({exc!r})") from None

    @classmethod
    def _from_entries(cls, entries: Sequence[dict[str, Any]], source: object) -> ShardTable:
        # One pass of plain list appends (the columns are made at the end); a shard whose shared keys equal
        # the previous shard's reuses its configuration without hashing them.
        n = len(entries)
        configs: dict[Any, int] = {}
        decoded: list[dict[str, Any]] = []
        config: list[int] = []
        samples: list[Any] = []
        sizes: dict[str, list[Any]] = {"raw": [], "zip": []}
        names: dict[str, list[str]] = {"raw": [], "zip": []}
        hashes: dict[str, tuple[list[int], list[Any]]] = {}
        previous: tuple[Any, ...] | None = None
        c = -1
        for i, entry in enumerate(entries):
            zip_info = entry.get("zip_data")
            mode = _ZIP_ABSENT if "zip_data" not in entry else _ZIP_NULL if zip_info is None else _ZIP_FILE
            files = (("raw", entry["raw_data"]), ("zip", zip_info)) if mode == _ZIP_FILE else \
                (("raw", entry["raw_data"]),)
            algos = []
            for kind, info in files:
                if info.keys() != _FILE_KEYS:
                    raise NotColumnar(f"{source}: shard {i} {kind}_data is not {{basename, bytes, hashes}}")
                names[kind].append(info["basename"])
                sizes[kind].append(info["bytes"])
                found = info["hashes"]
                algos.append(tuple(found))
                for algo, value in found.items():
                    rows, values = hashes.setdefault(f"{kind}_hash.{algo}", ([], []))
                    rows.append(i)
                    values.append(value)
            if mode != _ZIP_FILE:
                names["zip"].append("")
                sizes["zip"].append(0)
            samples.append(entry["samples"])
            rest = dict(entry)
            for key in _PER_SHARD:
                rest.pop(key, None)
            if previous is None or previous[1:] != (mode, algos) or previous[0] != rest:
                key = (_freeze(rest), mode, tuple(algos))
                c = configs.get(key, -1)
                if c < 0:
                    c = configs[key] = len(configs)
                    decoded.append({"rest": _copy(rest), "raw_hashes": list(algos[0]), "zip": mode,
                                    "zip_hashes": list(algos[1]) if mode == _ZIP_FILE else []})
                previous = (rest, mode, algos)
            config.append(c)
        columns: dict[str, np.ndarray] = {"config": np.array(config, dtype=np.int32), "samples": _ints(samples, source),
                                          "raw_bytes": _ints(sizes["raw"], source),
                                          "zip_bytes": _ints(sizes["zip"], source)}
        for kind, strings in names.items():
            if set(map(type, strings)) - {str}:
                raise NotColumnar(f"{source}: a {kind}_data.basename is not a string")
            joined = "".join(strings)
            blob = joined.encode("utf-8")
            lengths = np.fromiter(map(len, strings), dtype=np.int64, count=n) if len(blob) == len(joined) else \
                np.fromiter((len(name.encode("utf-8")) for name in strings), dtype=np.int64, count=n)
            columns[f"{kind}_names"] = np.frombuffer(blob, dtype=np.uint8)
            columns[f"{kind}_name_offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        for column, (rows, values) in hashes.items():
            columns[column] = _hash_column(column, rows, values, n, source)
        return cls(decoded, columns, source)

    def save(self, path: str | os.PathLike[str], json_bytes: int, json_hash: str) -> None:
        """Write the table to ``path`` (``index.npz``) atomically, recording the ``index.json`` it matches."""
        meta = {"format": FORMAT, "shards": len(self), "json_bytes": json_bytes, JSON_HASH: json_hash,
                "configs": self.configs}
        with atomic_write(path, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8), **self._columns)

    @classmethod
    def load(cls, data: str | os.PathLike[str] | bytes, source: object) -> tuple[ShardTable, dict[str, Any]]:
        """The table stored in ``index.npz`` (a path or its bytes) and its metadata; :class:`NotColumnar`
        naming ``source`` when it is not a whole, readable table of this format."""
        try:
            with np.load(io.BytesIO(data) if isinstance(data, bytes) else data, allow_pickle=False) as npz:
                arrays = {key: npz[key] for key in npz.files}
            meta = json.loads(arrays.pop("meta").tobytes())
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            raise NotColumnar(f"{source} does not read as a columnar index ({exc!r})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise NotColumnar(f"{source} is not a {FORMAT} index (format {meta.get('format')!r})")
        try:
            table = cls(meta["configs"], arrays, source)
            table._check_structure(meta)
        except (KeyError, TypeError, AttributeError, ValueError, IndexError):
            raise NotColumnar(f"{source}: its columns do not fit together (damaged or written by something "
                              "else)") from None
        return table, meta

    def _check_structure(self, meta: dict[str, Any]) -> None:
        n = meta.get("shards")
        cols = self._columns
        ok = isinstance(n, int) and all(cols[k].dtype == np.int64 and cols[k].shape == (n,)
                                        for k in ("samples", "raw_bytes", "zip_bytes"))
        ok = ok and cols["config"].shape == (n,) and cols["config"].dtype == np.int32 and (
            n == 0 or int(cols["config"].min()) >= 0 and int(cols["config"].max()) < len(self.configs))
        for kind in ("raw", "zip"):
            offsets, blob = cols.get(f"{kind}_name_offsets"), cols.get(f"{kind}_names")
            ok = ok and offsets is not None and blob is not None and offsets.shape == (n + 1,) and \
                blob.dtype == np.uint8 and int(offsets[0]) == 0 and int(offsets[-1]) == len(blob) and \
                bool(np.all(np.diff(offsets) >= 0))
        for config in self.configs if ok else []:
            for kind in ("raw", "zip"):
                for algo in config.get(f"{kind}_hashes") or []:
                    column = cols.get(f"{kind}_hash.{algo}")
                    ok = ok and column is not None and column.dtype == np.uint8 and column.ndim == 2 and \
                        column.shape[0] == n
        if not ok:
            raise NotColumnar(f"{self.source}: its columns do not fit together (damaged or written by something "
                              "else)")

    def declared_sizes_ok(self) -> np.ndarray:
        """Per shard, whether it passes :func:`~smalti.streaming.declared_sizes.check_declared_sizes` (the same
        rules, :func:`~smalti.streaming.declared_sizes.declared_sizes_ok`, over each configuration's columns)."""
        ok = np.ones(len(self), dtype=bool)
        for c, config in enumerate(self.configs):
            mine = slice(None) if len(self.configs) == 1 else np.flatnonzero(self.config == c)
            rest = config["rest"]
            ok[mine] = declared_sizes_ok(self.samples[mine], self.raw_bytes[mine],
                                         self.zip_bytes[mine] if config["zip"] == _ZIP_FILE else None,
                                         rest.get("column_sizes"), rest.get("size_limit"))
        return ok

    def check(self) -> None:
        """Raise :class:`StreamingError` naming ``source`` and the first shard that is not an MDS v2 shard, has
        a file name outside the dataset's folder or declares sizes no MDS shard can have: what
        :func:`smalti.streaming.mds.load_index` checks, with the same messages, over the columns at once."""
        for c, config in enumerate(self.configs):
            rest = config["rest"]
            if rest.get("format") != "mds" or rest.get("version") != 2:
                i = int(np.flatnonzero(self.config == c)[0])
                raise StreamingError(f"{self.source}: shard {i} is format {rest.get('format')!r} "
                                     f"v{rest.get('version')}, only MDS version 2 is supported")
        for kind in ("raw", "zip"):
            for i in suspicious_names(self._columns[f"{kind}_names"], self._columns[f"{kind}_name_offsets"]):
                if kind == "raw" or self.configs[int(self.config[i])]["zip"] == _ZIP_FILE:
                    self._name(kind, int(i))
        bad = ~self.declared_sizes_ok()
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            check_declared_sizes(self[i], self.source, i)
            raise StreamingError(f"{self.source}: shard {i} declares sizes no MDS shard can have")


def _freeze(value: Any) -> Any:
    """A hashable stand-in for a JSON value, equal for equal values (and told apart from other types)."""
    if isinstance(value, dict):
        return ("d", tuple(sorted((k, _freeze(v)) for k, v in value.items())))
    if isinstance(value, list):
        return ("l", tuple(_freeze(v) for v in value))
    return (type(value).__name__, value)


def suspicious_names(blob: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Indices of the names (``blob[offsets[i]:offsets[i + 1]]``) that :func:`smalti.streaming.paths.escapes`
    might refuse: empty, with a NUL, a ``..``, a leading separator or drive, or nothing but dots and separators.
    A superset, found over the whole blob at once; the caller checks these few names one by one."""
    n = len(offsets) - 1
    starts, lengths = offsets[:-1], np.diff(offsets)
    marks = np.zeros(len(blob) + 1, dtype=np.int64)
    marks[1:] = np.cumsum(~np.isin(blob, np.frombuffer(b"./\\", dtype=np.uint8)))
    plain = marks[offsets[1:]] - marks[starts]  # characters other than dots and separators
    bad = (lengths == 0) | (plain == 0)
    for needle in (np.flatnonzero(blob == 0), np.flatnonzero((blob[:-1] == ord(".")) & (blob[1:] == ord(".")))):
        bad[np.searchsorted(offsets, needle, side="right") - 1] = True
    first = np.where(lengths > 0, blob[np.minimum(starts, max(len(blob) - 1, 0))] if len(blob) else 0, 0)
    second = np.where(lengths > 1, blob[np.minimum(starts + 1, max(len(blob) - 1, 0))] if len(blob) else 0, 0)
    bad |= (first == ord("/")) | (first == ord("\\")) | (second == ord(":"))
    return np.flatnonzero(bad[:n])


def _ints(values: list[Any], source: object) -> np.ndarray:
    if set(map(type, values)) - {int}:
        raise NotColumnar(f"{source}: a count or size is not a whole number")
    out = np.array(values, dtype=np.int64)  # OverflowError past int64
    if len(out) and out.min() < 0:
        raise NotColumnar(f"{source}: a count or size is negative")
    return out


def _hash_column(column: str, rows: list[int], values: list[str], n: int, source: object) -> np.ndarray:
    width = len(values[0])
    if any(not isinstance(v, str) or len(v) != width for v in values) or width % 2:
        raise NotColumnar(f"{source}: the {column} hashes are not hex digests of one length")
    try:
        packed = bytes.fromhex("".join(values))
    except ValueError:
        raise NotColumnar(f"{source}: the {column} hashes are not hex") from None
    if packed.hex() != "".join(values):  # upper-case hex would come back lower-case
        raise NotColumnar(f"{source}: the {column} hashes are not lower-case hex")
    out = np.zeros((n, width // 2), dtype=np.uint8)
    out[np.asarray(rows, dtype=np.int64)] = np.frombuffer(packed, dtype=np.uint8).reshape(len(rows), width // 2)
    return out


def write_table(folder: str | os.PathLike[str], index_bytes: bytes, entries: Sequence[dict[str, Any]]) -> bool:
    """Write ``folder/index.npz`` for the ``index.json`` whose bytes are ``index_bytes`` and shards ``entries``;
    ``False`` (and a log line) when those entries have no exact columnar form, so only the JSON is read."""
    path = Path(folder) / INDEX_NPZ
    try:
        table = ShardTable.from_entries(entries, path)
    except NotColumnar as exc:
        log.info("%s; no %s is written, readers parse index.json", exc, INDEX_NPZ)
        Path(path).unlink(missing_ok=True)
        return False
    table.save(path, len(index_bytes), json_digest(index_bytes))
    return True


def _file_digest(path: Path) -> tuple[int, str]:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return 0, json_digest(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return size, json_digest(data)


def matching_table(index: Path, npz: bytes | Path | None, index_bytes: bytes | None = None) -> ShardTable | None:
    """The table in ``npz`` (``index.npz``'s path or bytes) when it was made from the ``index.json`` at
    ``index`` (or with bytes ``index_bytes``), checked; ``None`` with a log line when it is absent, of
    another ``index.json`` or unreadable (then the JSON is parsed)."""
    if npz is None or (isinstance(npz, Path) and not npz.exists()):
        log.info("%s: no %s beside it, parsing the JSON (`smalti-streaming index %s` writes one: faster loads of "
                 "big indexes)", index, INDEX_NPZ, index.parent)
        return None
    shown = npz if isinstance(npz, Path) else index.parent / INDEX_NPZ
    try:
        table, meta = ShardTable.load(npz, shown)
    except NotColumnar as exc:
        log.warning("%s; ignored, parsing %s instead", exc, index)
        return None
    size, digest = (len(index_bytes), json_digest(index_bytes)) if index_bytes is not None else _file_digest(index)
    if meta.get("json_bytes") != size or meta.get(JSON_HASH) != digest:
        log.warning("%s was made from another %s (stale: %s differs); ignored, parsing the JSON (rewrite it with "
                    "`smalti-streaming index %s`)", shown, index.name, JSON_HASH, index.parent)
        return None
    table.check()
    return table


def _column(entries: Sequence[dict[str, Any]], key: str) -> np.ndarray:
    if isinstance(entries, ShardTable):
        return getattr(entries, key)
    if key == "samples":
        return np.array([e["samples"] for e in entries], dtype=np.int64)
    kind = "raw_data" if key == "raw_bytes" else "zip_data"
    return np.array([(e.get(kind) or {}).get("bytes") or 0 for e in entries], dtype=np.int64)


class ShardList(Sequence[tuple[int, dict[str, Any]]]):
    """The shards of several streams as one sequence of ``(stream index, entry)``, entries made on use.

    ``samples``, ``raw_bytes``, ``zip_bytes`` and ``stream`` are int64 arrays over all the shards, and
    ``stream_ids(si)`` the range of stream ``si``'s shards: the dataset's sums, orders and cache sizes are
    computed from them, so nothing per shard is a Python object until that shard is read.
    """

    def __init__(self, tables: list[Sequence[dict[str, Any]]]) -> None:
        self.tables = tables
        counts = np.array([len(t) for t in tables], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        empty = np.zeros(0, dtype=np.int64)
        self.samples, self.raw_bytes, self.zip_bytes = (
            np.concatenate([_column(t, key) for t in tables] or [empty]).astype(np.int64)
            for key in ("samples", "raw_bytes", "zip_bytes"))
        self.stream = np.repeat(np.arange(len(tables), dtype=np.int64), counts)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, shard: int) -> tuple[int, dict[str, Any]]:  # type: ignore[override]
        shard = int(shard)
        if not 0 <= shard < len(self):
            raise IndexError(f"shard {shard} is out of range ({len(self)} shards)")
        si = int(self.stream[shard])
        return si, self.tables[si][shard - int(self.starts[si])]

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        for si, table in enumerate(self.tables):
            for entry in table:
                yield si, entry

    def stream_ids(self, si: int) -> range:
        """The shard numbers of stream ``si``."""
        return range(int(self.starts[si]), int(self.starts[si + 1]))

    def raw_folders(self, si: int) -> set[str]:
        """The distinct folders (relative to stream ``si``'s own) of its shards' raw files."""
        table = self.tables[si]
        if not isinstance(table, ShardTable):
            return {os.path.dirname(e["raw_data"]["basename"]) for e in table}
        return table.raw_folders()
