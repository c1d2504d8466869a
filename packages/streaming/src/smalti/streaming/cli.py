"""``smalti-streaming``: convert data to MDS, inspect and verify datasets, merge indexes of parallel writers."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from smalti.streaming.errors import ShardCorruptError, StreamingError
from smalti.streaming.mds import INDEX, decompress_shard, load_index, merge_index, verify_file


def _rows(path: Path, fmt: str, text_key: str) -> Iterator[dict[str, Any]]:
    if fmt == "jsonl":
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)
    elif fmt == "text":
        files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
        for file in files:
            yield {text_key: file.read_text(encoding="utf-8")}
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches():
            yield from batch.to_pylist()
    else:
        raise StreamingError(f"--format {fmt!r} must be jsonl, text or parquet")


def _guess_encoding(value: Any) -> str:
    if isinstance(value, bool | int):
        return "int"
    if isinstance(value, float):
        return "float64"
    if isinstance(value, str):
        return "str"
    if isinstance(value, bytes):
        return "bytes"
    return "json"


def convert(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from smalti.streaming.mds import MDSWriter

    source = Path(args.input)
    fmt = args.format or {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(source.suffix, "text")
    rows = _rows(source, fmt, args.text_key)
    first = next(rows, None)
    if first is None:
        raise StreamingError(f"{source} holds no rows")
    columns = dict(c.split(":", 1) for c in args.column) if args.column else {k: _guess_encoding(v) for k, v in first.items()}
    hashes = sorted(args.hashes.split(",")) if args.hashes else []
    frames = {} if args.zstd_frame_size is None else \
        {"zstd_frame_size": None if args.zstd_frame_size.lower() in ("none", "0") else args.zstd_frame_size}
    with MDSWriter(args.out, columns, compression=args.compression, hashes=hashes, size_limit=args.size_limit,
                   exist_ok=args.overwrite, **frames) as writer, tqdm(desc=f"converting {source.name}", unit="rows",
                                                             disable=not sys.stderr.isatty()) as bar:
        for row in [first] if first else []:
            writer.write({k: row[k] for k in columns})
            bar.update()
        for row in rows:
            writer.write({k: row[k] for k in columns})
            bar.update()
    print(f"wrote {len(writer.shards)} shards to {args.out}")
    return 0


def inspect(args: argparse.Namespace) -> int:
    entries = load_index(Path(args.dataset) / INDEX)
    first = entries[0] if entries else {}
    print(f"dataset: {args.dataset}")
    print(f"shards: {len(entries)}  samples: {sum(e['samples'] for e in entries)}")
    print(f"raw bytes: {sum(e['raw_data']['bytes'] for e in entries)}  "
          f"compressed bytes: {sum((e.get('zip_data') or {}).get('bytes', 0) for e in entries)}")
    print(f"compression: {first.get('compression')}  hashes: {', '.join(first.get('hashes', [])) or '-'}")
    for name, enc, size in zip(first.get("column_names", []), first.get("column_encodings", []),
                               first.get("column_sizes", [])):
        print(f"  column {name}: {enc} ({'variable' if size is None else f'{size} bytes'})")
    return 0


def verify(args: argparse.Namespace) -> int:
    """Exit 0 when every shard matches its hashes, 1 when one does not, 3 when some have no hashes to check
    (only their sizes could be) and ``--allow-unhashed`` was not given."""
    root = Path(args.dataset)
    entries = load_index(root / INDEX)
    bad = unhashed = 0
    for entry in entries:
        info = entry.get("zip_data") or entry["raw_data"]
        if not info.get("hashes"):
            unhashed += 1
        try:
            verify_file(root / info["basename"], info)
            if entry.get("zip_data") and args.decompress:
                verify_file(decompress_shard(root, entry), entry["raw_data"])
        except (ShardCorruptError, OSError) as exc:
            bad += 1
            print(f"BAD {info['basename']}: {exc}")
    if bad:
        print(f"FAILED: {bad} bad shard(s) of {len(entries)}")
        return 1
    if unhashed and not args.allow_unhashed:
        print(f"NOT VERIFIED: {unhashed} of {len(entries)} shard(s) have no hashes in {root / INDEX}, so only "
              "their sizes were checked and a changed byte would go unnoticed. Write the dataset with hashes "
              "(smalti-streaming convert --hashes xxh3_64, or MDSWriter(hashes=[...])), or pass "
              "--allow-unhashed to accept size checks for them")
        return 3
    hashed = len(entries) - unhashed
    print(f"OK: {hashed} shard(s) match their hashes" + (f", {unhashed} checked by size only (no hashes)"
                                                         if unhashed else ""))
    return 0


def index(args: argparse.Namespace) -> int:
    """Write ``index.npz`` (the columnar copy of ``index.json``, see :mod:`smalti.streaming.shard_table`)."""
    from smalti.streaming.shard_table import INDEX_NPZ, write_table

    root = Path(args.dataset)
    try:
        data = (root / INDEX).read_bytes()
    except OSError as exc:
        raise StreamingError(f"cannot read {root / INDEX}: {exc}") from exc
    entries = load_index(root / INDEX)  # checked as readers check it: a bad index gets no columnar copy
    if not write_table(root, data, entries):
        print(f"{root / INDEX}: its entries have no exact columnar form; readers parse the JSON")
        return 1
    print(f"wrote {root / INDEX_NPZ} ({len(entries)} shards)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="smalti-streaming", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("convert", help="JSONL, text files or Parquet to MDS")
    p.add_argument("input")
    p.add_argument("out")
    p.add_argument("--format", choices=["jsonl", "text", "parquet"])
    p.add_argument("--column", action="append", help="name:encoding (default: guessed from the first row)")
    p.add_argument("--text-key", default="text")
    p.add_argument("--compression", default="zstd")
    p.add_argument("--hashes", default="sha1")
    p.add_argument("--size-limit", default="64mb")
    p.add_argument("--zstd-frame-size", default=None,
                   help="raw bytes per frame of a zstd shard (default 1mb; 'none': one frame per shard, "
                        "byte-identical to mosaicml-streaming's)")
    p.add_argument("--overwrite", action="store_true")
    p = sub.add_parser("inspect", help="columns, sample counts and sizes")
    p.add_argument("dataset")
    p = sub.add_parser("verify", help="check every shard against the hashes in index.json (exit 0 ok, 1 bad, "
                                      "3 unhashed shards)")
    p.add_argument("dataset")
    p.add_argument("--decompress", action="store_true", help="also decompress and check the raw shards")
    p.add_argument("--allow-unhashed", action="store_true",
                   help="exit 0 even if some shards have no hashes (only their sizes are checked); without it "
                        "such a dataset exits 3, since nothing was verified")
    p = sub.add_parser("index", help="write index.npz beside index.json: the same index as columns, which "
                                     "loads in a fraction of the time (read only while it matches index.json)")
    p.add_argument("dataset")
    p = sub.add_parser("merge-index", help="write root/index.json from root/*/index.json")
    p.add_argument("root")
    args = parser.parse_args(argv)
    try:
        if args.command == "merge-index":
            print(merge_index(args.root))
            return 0
        return {"convert": convert, "inspect": inspect, "verify": verify, "index": index}[args.command](args)
    except StreamingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
