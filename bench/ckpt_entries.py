"""What a checkpoint entry costs: many small tensors against one tensor of the same bytes, through
smalti-checkpoint's DCP writer and through plain DCP, in the same process.

Every DCP entry is a ``torch.save`` zip record of its own, so a checkpoint of many small tensors (a LoRA run's
adapters, each with AdamW's two moments and a ``step``) pays per entry, not per byte. For each writer the bench
saves ``--entries`` tensors of ``--numel`` fp32 values each, then one tensor holding the same bytes, into a fresh
folder ``--repeats`` times (median seconds), and counts the write calls the files received. Writers:

  dcp              torch's ``FileSystemWriter`` (one file, its defaults)
  smalti           smalti-checkpoint's ``HashingFileSystemWriter`` (hashing, fsynced files; torch.save's
                   archives replayed per layout, small entries written in one call)
  smalti_dcp_loop  the same hashing files under DCP's own write loop (``torch.save`` per entry, ~39 writes
                   each into the hashing file): smalti before the per-entry work, what it saves

The last line:

    ckpt_entries: smalti_vs_dcp X.XX dcp_loop_vs_dcp X.XX smalti_writes_per_entry X.X ms_per_entry X.XXX

(seconds of the many-entry save over plain DCP's, write calls per entry, smalti's milliseconds per entry above
the one-tensor save of the same bytes.)

    OMP_NUM_THREADS=1 nice -n 5 python bench/ckpt_entries.py --entries 500 --numel 4096
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from smalti.checkpoint.writer import HashingFileSystemWriter

warnings.filterwarnings("ignore", message=r"torch\.distributed is .*unavailable")


def make_writer(kind: str, folder: Path) -> FileSystemWriter:
    """The storage writer ``kind`` names, writing into ``folder``."""
    if kind == "dcp":
        return FileSystemWriter(str(folder), single_file_per_rank=True)
    writer = HashingFileSystemWriter(folder)
    if kind == "smalti_dcp_loop":
        writer.write_data = functools.partial(FileSystemWriter.write_data, writer)
    return writer


def count_writes(writer: FileSystemWriter) -> list[int]:
    """Make every stream ``writer`` opens count its write calls into the returned one-item list."""
    calls = [0]
    fs = writer.fs
    real = fs.create_stream

    @contextmanager
    def counted(path, mode):
        with real(path, mode) as stream:
            if "w" in mode:
                write = stream.write

                def counting(data):
                    calls[0] += 1
                    return write(data)

                stream.write = counting
            yield stream

    fs.create_stream = counted
    return calls


def timed_save(kind: str, state: dict, repeats: int) -> tuple[float, int]:
    """Median seconds of ``repeats`` saves of ``state`` by writer ``kind``, and the write calls of one save."""
    times, writes = [], 0
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            writer = make_writer(kind, Path(tmp))
            calls = count_writes(writer)
            start = time.perf_counter()
            dcp.save(state, storage_writer=writer, no_dist=True)
            times.append(time.perf_counter() - start)
            writes = calls[0]
    return statistics.median(times), writes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=500)
    parser.add_argument("--numel", type=int, default=4096, help="fp32 values per small tensor")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    many = {"model": {f"t{i}": torch.randn(args.numel, generator=gen) for i in range(args.entries)}}
    one = {"model": {"t": torch.randn(args.entries * args.numel, generator=gen)}}
    mb = args.entries * args.numel * 4 / 2**20
    print(f"{args.entries} tensors of {args.numel} fp32 values ({mb:.1f} MB) against one tensor of the same bytes")
    results = {}
    for kind in ("dcp", "smalti", "smalti_dcp_loop"):
        timed_save(kind, many, 1)  # lazy imports and first-use costs
        many_s, many_w = timed_save(kind, many, args.repeats)
        one_s, _ = timed_save(kind, one, args.repeats)
        results[kind] = (many_s, one_s, many_w)
        print(f"{kind:18s} {args.entries} entries {many_s:.3f} s ({many_w / args.entries:.1f} writes per entry)  "
              f"one tensor {one_s:.3f} s  per entry {(many_s - one_s) / args.entries * 1e3:.3f} ms", flush=True)
    base = results["dcp"][0]
    mine = results["smalti"]
    loop = results["smalti_dcp_loop"][0]
    print(f"ckpt_entries: smalti_vs_dcp {mine[0] / base:.2f} dcp_loop_vs_dcp {loop / base:.2f} "
          f"smalti_writes_per_entry {mine[2] / args.entries:.1f} ms_per_entry {(mine[0] - mine[1]) / args.entries * 1e3:.3f}")


if __name__ == "__main__":
    main()
