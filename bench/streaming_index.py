"""How long an ``index.json`` of many shards takes to load, and how much memory it takes, per process.

Writes a version-2 MDS index of ``--shards`` entries (the fields and sizes ``MDSWriter`` writes for zstd
shards of 16,384 samples of 2,048 uint16 tokens, sha1 and xxh64 hashes, one sub-folder per 1,000 shards) into
a temporary folder, then loads it in fresh processes: once with ``json.loads`` alone and once with
``smalti.streaming.mds.load_index`` (which also checks every entry's names and declared sizes). No shard
files are written: the index is what is measured.

    python bench/streaming_index.py [--shards 1000000]

Memory grows with the shard count (about 3 KB of Python objects per shard): 1e6 shards need about 3.5 GB
free. The last line is ``streaming_index: shards N json_mb X json_s X.XX json_mb_rss X load_index_s X.XX
load_index_mb_rss X``.
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


def child(kind: str, path: Path) -> dict:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if kind == "load_index":
        from smalti.streaming.mds import load_index

        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    shards = json.loads(path.read_bytes())["shards"] if kind == "json" else load_index(path)
    return {"s": time.perf_counter() - start, "mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before,
            "n": len(shards)}


def run(kind: str, path: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, str(path)], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--shards", type=int, default=1_000_000)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "index.json"
        write_index(path, args.shards)
        size_mb = path.stat().st_size / 1e6
        plain, checked = run("json", path), run("load_index", path)
    print(f"index.json of {args.shards:,} shards: {size_mb:.0f} MB")
    print(f"  json.loads   {plain['s']:7.2f} s  +{plain['mb']:.0f} MB resident")
    print(f"  load_index   {checked['s']:7.2f} s  +{checked['mb']:.0f} MB resident (json.loads and the checks)")
    print(f"streaming_index: shards {args.shards} json_mb {size_mb:.0f} json_s {plain['s']:.2f} "
          f"json_mb_rss {plain['mb']:.0f} load_index_s {checked['s']:.2f} load_index_mb_rss {checked['mb']:.0f}")


if __name__ == "__main__":
    main()
