"""Checkpoint I/O against the raw disk, measured in the same run.

Prints, for a training state of ``--size-gib`` (default 1 GiB: fp32 parameters plus AdamW's two moments,
after one real optimizer step) on the disk that holds ``--dir`` (its file system type is printed):

* raw write bandwidth: one file written in 16 MiB chunks then fsynced, three ways (buffered; buffered with
  the kernel's writeback started behind each chunk; ``O_DIRECT``); the fastest counts;
* smalti-checkpoint's synchronous save throughput (DCP write + sha256 of every file + manifest, every
  file fsynced), as a ratio of the raw write;
* raw read bandwidth (64 MiB reads, buffered and ``O_DIRECT``; the faster counts) and load throughput
  (sha256 of every data file + DCP read into the model and optimizer, in a fresh ``Trainer``), both after
  dropping the page cache where allowed (root), as a ratio of the raw read; and the same load without
  the sha256 check (``verify=none``);
* with ``async_save``, the time the training loop is blocked as a fraction of a synchronous save, for a
  run's first save (which allocates the host staging buffers) and for a later one (the steady state); and
  the worst case, a next step with no forward/backward time behind which the background copy of the
  parameters and optimizer state could hide (its optimizer step waits for the whole copy).

Which side (raw or ours) runs first alternates from one repetition to the next; medians are printed, and
for the ratios also the best time of each side (a shared virtual disk varies by 2x from one second to the
next: the best times say what each side can do, the medians what it usually did).
Goals (issue 5): save >= 0.8 x raw write, load >= 0.8 x raw read, blocked <= 0.1 x sync save.

    python bench/checkpoint_io.py --size-gib 1 --dir /tmp/bench
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import functools
import hashlib
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

RAW_WRITE_WAYS = ("plain", "writeback", "direct")
RAW_READ_WAYS = ("buffered", "direct")


class Blob(nn.Module):
    """A model whose parameters add up to ``size`` bytes of fp32, in ``pieces`` tensors."""

    def __init__(self, size: int, pieces: int = 16) -> None:
        super().__init__()
        per = size // 4 // pieces
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(per)) for _ in range(pieces))

    def forward(self, batch):
        return sum(w.sum() for w in self.weights) * batch[0].sum()

    def loss(self, outputs, batch):
        return outputs


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def filesystem_type(path: Path) -> str:
    """The type of the file system holding ``path`` (from /proc/mounts: the longest mount point above it)."""
    path = path.resolve()
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                if (path == Path(mount) or Path(mount) in path.parents) and len(mount) >= len(best):
                    best, kind = mount, f"{fields[2]} ({fields[0]} on {mount})"
    except OSError:
        pass
    return kind


def raw_write(path: Path, data: memoryview, how: str) -> float:
    """Write ``data`` in chunks of smalti's buffer size, then fsync, and return the seconds taken.

    ``plain``: buffered writes. ``writeback``: buffered, with the kernel's writeback started behind each
    chunk. ``direct``: ``O_DIRECT`` writes from a page-aligned buffer the chunks are copied into.
    """
    from smalti.checkpoint.hashing_file import CHUNK_BYTES, SYNC_FILE_RANGE_WRITE, sync_file_range

    start = time.perf_counter()
    if how == "direct":
        aligned = mmap.mmap(-1, CHUNK_BYTES)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            for offset in range(0, len(data), CHUNK_BYTES):
                chunk = data[offset : offset + CHUNK_BYTES]
                aligned[: len(chunk)] = chunk
                whole = len(chunk) // 4096 * 4096  # O_DIRECT writes whole blocks; a ragged end goes buffered
                os.write(fd, memoryview(aligned)[:whole])
                if whole < len(chunk):
                    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                    os.write(fd, memoryview(aligned)[whole : len(chunk)])
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - start
    with open(path, "wb", buffering=0) as f:
        fd = f.fileno()
        for offset in range(0, len(data), CHUNK_BYTES):
            chunk = data[offset : offset + CHUNK_BYTES]
            f.write(chunk)
            if how == "writeback" and sync_file_range is not None:
                sync_file_range(fd, offset, len(chunk), SYNC_FILE_RANGE_WRITE)
        os.fsync(fd)
    return time.perf_counter() - start


def sha256_rate(data: memoryview) -> float:
    """GB/s of one thread's sha256 over (up to 256 MiB of) ``data``."""
    part = data[: 256 << 20]
    start = time.perf_counter()
    hashlib.sha256(part).digest()
    return len(part) / (time.perf_counter() - start) / 1e9


def raw_read(path: Path, how: str) -> float:
    """Read the file front to back in 64 MiB reads and return the seconds taken. ``buffered``: through the
    page cache. ``direct``: ``O_DIRECT`` into a page-aligned buffer."""
    start = time.perf_counter()
    if how == "direct":
        aligned = mmap.mmap(-1, 64 << 20)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            offset = 0
            while n := os.preadv(fd, [aligned], offset):
                offset += n
        finally:
            os.close(fd)
        return time.perf_counter() - start
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="DCP writer threads")
    parser.add_argument("--buffered", action="store_true", help="save with direct_io=false (page cache + writeback)")
    args = parser.parse_args()

    from smalti.checkpoint import Checkpointer
    from smalti.core import Trainer

    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    size = int(args.size_gib * (1 << 30))
    torch.manual_seed(0)
    model = Blob(size // 3)  # weights + exp_avg + exp_avg_sq = size
    nbytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    raw_data = memoryview(torch.randn(nbytes // 4).numpy().view("uint8"))
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    batches = [(torch.ones(1), torch.ones(1))] * 2

    def trained(checkpointer, duration="1ba"):
        trainer = Trainer(model, batches, duration, optimizers=optimizer, callbacks={"checkpoint": checkpointer}, loggers=[])
        trainer.fit()  # one real step: the optimizer state exists, as in training
        return trainer

    class Log:
        def log_metrics(self, metrics, step=None):
            pass

    results: dict[str, list[float]] = collections.defaultdict(list)
    cold = drop_caches()
    saved_bytes = 0

    def raw_side(rep: int) -> None:
        raw_file = root / f"raw-{rep}.bin"
        # the disk's raw write is the fastest of three ways of writing (which one wins depends on the disk)
        times = []
        for how in RAW_WRITE_WAYS:
            if raw_file.exists():
                raw_file.unlink()
                os.sync()
            times.append(raw_write(raw_file, raw_data, how))
            results[f"raw_write_{how}"].append(times[-1])
        results["raw_write"].append(min(times))
        times = []
        for how in RAW_READ_WAYS:
            drop_caches()
            times.append(raw_read(raw_file, how))
            results[f"raw_read_{how}"].append(times[-1])
        results["raw_read"].append(min(times))
        raw_file.unlink()

    def our_side(rep: int) -> None:
        nonlocal saved_bytes
        folder = root / f"sync-{rep}"
        ck = Checkpointer(str(folder), save_interval=None, save_on_fit_end=False, thread_count=args.threads,
                          direct_io=not args.buffered)
        trainer = trained(ck)
        start = time.perf_counter()
        ck.save(trainer.state, Log())
        results["save"].append(time.perf_counter() - start)
        saved_bytes = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

        # the load as configured, and without the sha256 check (what verification costs on this machine); which
        # of the two goes first alternates with the repetition
        loads = (("load", "manifest"), ("load_unverified", "none"))
        for key, verify in loads if rep % 2 == 0 else loads[::-1]:
            drop_caches()
            loader = Checkpointer(load_path=str(folder), save_interval=None, save_on_fit_end=False, verify=verify)
            start = time.perf_counter()
            trainer = Trainer(model, batches, "1ba", optimizers=optimizer, callbacks={"checkpoint": loader}, loggers=[])
            results[key].append(time.perf_counter() - start)
            trainer.close()
        shutil.rmtree(folder)

    for rep in range(args.repeats):
        sides = (raw_side, our_side) if rep % 2 == 0 else (our_side, raw_side)
        for side in sides:
            side(rep)

        folder = root / f"async-{rep}"
        ck = Checkpointer(str(folder), save_interval=None, save_on_fit_end=False, async_save=True,
                          thread_count=args.threads, direct_io=not args.buffered)
        trainer = trained(ck)
        start = time.perf_counter()
        ck.save(trainer.state, Log())  # the first async save also allocates the reused host staging buffers
        results["async_first_blocked"].append(time.perf_counter() - start)
        ck.wait()
        trainer.close()
        trainer = trained(ck, "2ba")  # the next save of the same run, at batch 2: the steady state
        start = time.perf_counter()
        ck.save(trainer.state, Log())
        results["async_blocked"].append(time.perf_counter() - start)
        # parameters and optimizer state are copied to host memory in the background until the next optimizer
        # step, which waits for that copy: a step with no forward/backward time to hide it behind waits it all
        ck.wait_for_staging()
        results["async_blocked_no_compute"].append(time.perf_counter() - start)
        ck.wait()
        results["async_total"].append(time.perf_counter() - start)
        shutil.rmtree(folder)

    med = {k: statistics.median(v) for k, v in results.items()}
    best = {k: min(v) for k, v in results.items()}
    gb = nbytes / 1e9
    print(f"state: {nbytes / (1 << 30):.3f} GiB (checkpoint {saved_bytes / (1 << 30):.3f} GiB on disk); dir {root}; "
          f"file system: {filesystem_type(root)}")
    print(f"page cache dropped before reads: {cold}; median of {args.repeats} (raw first in even repetitions, ours first in odd)")
    print(f"sha256 on this CPU: {sha256_rate(raw_data):.2f} GB/s per thread (every byte saved or loaded is hashed; "
          f"{args.threads} writer thread(s), one file each; {'buffered' if args.buffered else 'direct'} I/O)")
    print(f"raw write (best of 3 ways, + fsync)         {gb / med['raw_write']:8.2f} GB/s  ({med['raw_write']:.3f} s)")
    print("  each way: " + ", ".join(f"{how} {gb / med[f'raw_write_{how}']:.2f} GB/s" for how in RAW_WRITE_WAYS))
    print(f"save (DCP + sha256 + manifest)               {gb / med['save']:8.2f} GB/s  ({med['save']:.3f} s)   "
          f"ratio {med['raw_write'] / med['save']:.2f} (goal >= 0.8); best of each {best['raw_write'] / best['save']:.2f}")
    print(f"raw read (best of 2 ways)                    {gb / med['raw_read']:8.2f} GB/s  ({med['raw_read']:.3f} s)")
    print("  each way: " + ", ".join(f"{how} {gb / med[f'raw_read_{how}']:.2f} GB/s" for how in RAW_READ_WAYS))
    print(f"load (verify sha256 + DCP)                   {gb / med['load']:8.2f} GB/s  ({med['load']:.3f} s)   "
          f"ratio {med['raw_read'] / med['load']:.2f} (goal >= 0.8); best of each {best['raw_read'] / best['load']:.2f}")
    print(f"  the same load with verify=none              {gb / med['load_unverified']:8.2f} GB/s  "
          f"({med['load_unverified']:.3f} s)   ratio {med['raw_read'] / med['load_unverified']:.2f}; best of each "
          f"{best['raw_read'] / best['load_unverified']:.2f}")
    print(f"async save blocked: steady state {med['async_blocked']:.3f} s = {med['async_blocked'] / med['save']:.3f} of a sync save "
          f"(goal <= 0.1); first save of a run {med['async_first_blocked']:.3f} s = "
          f"{med['async_first_blocked'] / med['save']:.3f} (allocates the staging buffers)")
    print(f"  + background copy of parameters and optimizer state, waited for by the next optimizer step: a step with "
          f"no compute to overlap it is blocked {med['async_blocked_no_compute']:.3f} s = "
          f"{med['async_blocked_no_compute'] / med['save']:.3f} of a sync save; steady-state save to commit "
          f"{med['async_total']:.3f} s")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
