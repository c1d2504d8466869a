"""How long an ``index.json`` of many shards takes to load, and how much memory it takes, per process.

Writes a version-2 MDS index of ``--shards`` entries (the fields and sizes ``MDSWriter`` writes for zstd
shards of 16,384 samples of 2,048 uint16 tokens, sha1 and xxh64 hashes, one sub-folder per 1,000 shards) into
a temporary folder, with its columnar copy ``index.npz`` (made from the same entries as they are written),
then loads it in fresh processes: with ``json.loads`` alone, with ``smalti.streaming.mds.load_index`` (which
also checks every entry's names and declared sizes), and with ``read_index`` from ``index.npz`` (hashing
``index.json`` to check the match, and the same checks over the columns). Times are CPU seconds of the
process (``time.process_time``: the machine's load does not inflate them), memory the growth of its
resident set (what the loaded index keeps).
No shard files are written: the index is what is measured.

    python bench/streaming_index.py [--shards 1000000] [--no-json]

The JSON loads keep about 3 KB of Python objects per shard (1e6 shards: over 3 GB; ``--no-json`` skips them);
the columnar load about 230 bytes. The last line is ``streaming_index: shards N json_mb X json_s X.XX
json_mb_rss X load_index_s X.XX load_index_mb_rss X columnar_s X.XX columnar_mb_rss X``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def entry(i: int) -> dict:
    """Shard ``i``'s index entry, as ``MDSWriter`` writes it for a zstd shard with two hashes."""
    def data(suffix: str, size: int) -> dict:
        return {"basename": f"part-{i // 1000:05d}/shard.{i % 1000:05d}.mds{suffix}", "bytes": size,
                "hashes": {"sha1": f"{i:040x}", "xxh64": f"{i:016x}"}}

    return {"column_encodings": ["ndarray:uint16:2048"], "column_names": ["tokens"], "column_sizes": [4096],
            "compression": "zstd", "format": "mds", "hashes": ["sha1", "xxh64"],
            "raw_data": data("", 67_174_408), "samples": 16_384, "size_limit": 1 << 27, "version": 2,
            "zip_data": data(".zstd", 33_554_432)}


def write_index(path: Path, shards: int) -> None:
    """``path``: an index of ``shards`` entries, written entry by entry (the writer never holds them all)."""
    with open(path, "w") as f:
        f.write('{"version": 2, "shards": [')
        for i in range(shards):
            f.write(("," if i else "") + json.dumps(entry(i)))
        f.write("]}")


class Entries:
    """The index's entries, made one at a time as the columnar writer walks them."""

    def __init__(self, shards: int) -> None:
        self.shards = shards

    def __len__(self) -> int:
        return self.shards

    def __iter__(self):
        return (entry(i) for i in range(self.shards))


def write_columnar(path: Path, shards: int) -> None:
    """``index.npz`` beside ``path``, from the same entries, recording ``path``'s size and hash."""
    from smalti.streaming.shard_table import INDEX_NPZ, ShardTable, json_digest

    table = ShardTable.from_entries(Entries(shards), path)  # type: ignore[arg-type]
    data = path.read_bytes()
    table.save(path.parent / INDEX_NPZ, len(data), json_digest(data))


def child(kind: str, path: Path) -> dict:
    from smalti.streaming.mds import load_index, read_index

    before = resident_mb()
    start = time.process_time()
    if kind == "json":
        shards = json.loads(path.read_bytes())["shards"]
    elif kind == "load_index":
        shards = load_index(path)
    else:
        shards = read_index(path)
        assert type(shards).__name__ == "ShardTable", "index.npz was not used"
    seconds = time.process_time() - start
    return {"s": seconds, "mb": resident_mb() - before, "n": len(shards)}


def resident_mb() -> float:
    """This process's resident memory now (what a loaded index keeps, not a transient peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e6


def run(kind: str, path: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, str(path)], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--shards", type=int, default=1_000_000)
    parser.add_argument("--no-json", action="store_true", help="only the columnar load (1e6 shards of JSON "
                                                               "need over 3 GB)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "index.json"
        write_index(path, args.shards)
        write_columnar(path, args.shards)
        size_mb = path.stat().st_size / 1e6
        npz_mb = (path.parent / "index.npz").stat().st_size / 1e6
        nan = {"s": float("nan"), "mb": float("nan")}
        plain, checked = (nan, nan) if args.no_json else (run("json", path), run("load_index", path))
        columnar = run("columnar", path)
    print(f"index.json of {args.shards:,} shards: {size_mb:.0f} MB; index.npz {npz_mb:.0f} MB")
    print(f"  json.loads   {plain['s']:7.2f} s CPU  +{plain['mb']:.0f} MB resident")
    print(f"  load_index   {checked['s']:7.2f} s CPU  +{checked['mb']:.0f} MB resident (json.loads and the checks)")
    print(f"  index.npz    {columnar['s']:7.2f} s CPU  +{columnar['mb']:.0f} MB resident (hash, columns, checks)")
    print(f"streaming_index: shards {args.shards} json_mb {size_mb:.0f} json_s {plain['s']:.2f} "
          f"json_mb_rss {plain['mb']:.0f} load_index_s {checked['s']:.2f} load_index_mb_rss {checked['mb']:.0f} "
          f"columnar_s {columnar['s']:.2f} columnar_mb_rss {columnar['mb']:.0f}")


if __name__ == "__main__":
    main()
