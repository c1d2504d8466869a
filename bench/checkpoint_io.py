"""Checkpoint I/O against the raw disk, measured in the same run.

Prints, for a training state of ``--size`` (default 1 GiB: fp32 parameters plus AdamW's two moments, after
one real optimizer step) on the disk that holds ``--dir`` (its file system type is printed):

* raw write bandwidth: one file written in 16 MiB chunks then fsynced, three ways (buffered; buffered with
  the kernel's writeback started behind each chunk; ``O_DIRECT`` straight from memory on 2 MiB huge pages, no
  copy: the disk's best case); the fastest counts; beside it (not a baseline) an ``O_DIRECT`` write straight from the model's
  parameters, the most a save without a copy could do with the tensors' own pages;
* smalti-checkpoint's synchronous save (DCP write + a digest of every file + manifest, every file fsynced),
  as a ratio of the raw write (``save ratio``);
* raw read bandwidth (64 MiB reads into one reused, mapped buffer on huge pages, buffered and ``O_DIRECT``; the
  faster counts) and the verified load
  (``verify=manifest``: every data file's digest checked while DCP loads it into the model and optimizer of a
  fresh ``Trainer``; the checkpointer's own ``checkpoint/load_s``), as a ratio of the raw read (``load
  ratio``); beside it the same load with ``verify=none``, and the whole ``Trainer`` construction around it;
* the load of files that another rank checks (a DDP replica's): read straight into the tensors, against
  DCP's own reader of the same files;
* with ``async_save``, the time the training loop is blocked, as a fraction of a synchronous save (``async
  blocked ratio``: a run's later saves; its first one also allocates the host staging buffers), and the
  worst case, a next step with no forward/backward to hide the background copy of the weights behind.

Before every read the page cache is emptied: ``/proc/sys/vm/drop_caches`` as root, else
``posix_fadvise(DONTNEED)`` on every file read (which the output says). Which side (raw or ours) runs first
alternates from one repetition to the next; medians are printed, and for the ratios also the best time of
each side (a shared virtual disk varies by 2x from one second to the next).
Goals (issue 16): save >= 0.90 x raw write, verified load >= 0.90 x raw read, blocked <= 0.05 x sync save.

    python bench/checkpoint_io.py --size 1G --repeats 5
    python bench/checkpoint_io.py --size 128M --repeats 3      # a quick run
    python bench/checkpoint_io.py --size 1G --repeats 5 --thp  # tensors on 2 MiB pages (torch's THP_MEM_ALLOC_ENABLE)
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import functools
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from smalti.checkpoint.io.huge_pages import huge_page_buffer
from smalti.core import LoggerDestination

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


def drop_caches(root: Path) -> str:
    """Empty the page cache of what the next read will read: all of it as root, else every file under ``root``
    (``posix_fadvise(DONTNEED)``, after an ``fsync`` so no page is dirty); how it was done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "posix_fadvise(DONTNEED) per file (not root)"


def parse_size(text: str) -> int:
    """Bytes from ``1G``, ``256M``, ``1.5GiB`` or a plain number of GiB."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(float(text) * (1 << 30))


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
    chunk. ``direct``: ``O_DIRECT`` writes straight from ``data`` (page-aligned: no copy at all); a ragged
    end of less than a block goes buffered.
    """
    from smalti.checkpoint.io import CHUNK_BYTES, SYNC_FILE_RANGE_WRITE, sync_file_range

    start = time.perf_counter()
    if how == "direct":
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            whole = len(data) // 4096 * 4096
            for offset in range(0, whole, CHUNK_BYTES):
                os.write(fd, data[offset : min(offset + CHUNK_BYTES, whole)])
            if whole < len(data):
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                os.write(fd, data[whole:])
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


def raw_write_from_tensors(path: Path, tensors: list[torch.Tensor]) -> tuple[float, int]:
    """``O_DIRECT``-write the whole pages inside each tensor straight from its memory, one after the other, then
    fsync: the seconds taken and the bytes written. Not a baseline: it shows what the disk does with the
    tensors' own pages (a save without a copy can go no faster than this)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    start = time.perf_counter()
    offset = 0
    try:
        for tensor in tensors:
            address = tensor.data_ptr()
            first = -(-address // 4096) * 4096
            length = (address + tensor.numel() * tensor.element_size() - first) // 4096 * 4096
            if length > 0:
                view = memoryview(tensor.detach().numpy()).cast("B")[first - address : first - address + length]
                offset += os.pwrite(fd, view, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start, offset


def hash_rate(algorithm: str, data: memoryview) -> float:
    """GB/s of one thread's ``algorithm`` over (up to 256 MiB of) ``data``."""
    from smalti.checkpoint.hashes import new_hasher

    part = data[: 256 << 20]
    digest = new_hasher(algorithm)
    start = time.perf_counter()
    digest.update(part)
    digest.hexdigest()
    return len(part) / (time.perf_counter() - start) / 1e9


def raw_read(path: Path, how: str) -> float:
    """Read the file front to back in 64 MiB reads into one reused buffer on huge pages (allocated and mapped
    before the clock starts) and return the seconds taken. ``buffered``: through the page cache.
    ``direct``: ``O_DIRECT``."""
    aligned = huge_page_buffer(64 << 20)  # mapped before the clock starts: the read measures the disk, not faults
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if how == "direct" else 0))
    start = time.perf_counter()
    try:
        offset = 0
        while n := os.preadv(fd, [aligned], offset):
            offset += n
    finally:
        os.close(fd)
    return time.perf_counter() - start


class Recorder(LoggerDestination):
    """A logger keeping the checkpointer's metrics (``checkpoint/load_s``, ``checkpoint/blocked_s``, ...)."""

    def __init__(self) -> None:
        self.metrics: dict[str, list[float]] = collections.defaultdict(list)

    def log_metrics(self, metrics, step=None):
        for key, value in metrics.items():
            self.metrics[key].append(value)


def main() -> None:
    from smalti.checkpoint.state_io import silence_single_process_warning

    silence_single_process_warning()  # the bench's single process, also where it calls DCP itself
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1G", help="state size: 1G, 256M, ... (default 1 GiB)")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="DCP writer threads")
    parser.add_argument("--direct-io", default="true", choices=["read", "true", "false"],
                        help="checkpoint.direct_io (true, the default: O_DIRECT saves; false: page-cache saves)")
    parser.add_argument("--hash", default="xxh3_128", help="checkpoint.hash: xxh3_128, blake3 or sha256")
    parser.add_argument("--thp", action="store_true",
                        help="THP_MEM_ALLOC_ENABLE=1: torch backs tensors of 2 MiB or more with transparent huge "
                             "pages (set before the state is allocated)")
    args = parser.parse_args()
    if args.thp:  # torch reads it once, at its first allocation of 2 MiB or more: none has happened yet
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"

    import smalti.checkpoint.state_io as state_io
    from smalti.checkpoint import Checkpointer
    from smalti.checkpoint.read_ahead import ReadAheadFileSystemReader
    from smalti.checkpoint.safe_load import SafeFileSystemReader
    from smalti.core import Trainer

    direct_io = {"read": "read", "true": True, "false": False}[args.direct_io]
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    size = parse_size(args.size)
    torch.manual_seed(0)
    model = Blob(size // 3)  # weights + exp_avg + exp_avg_sq = size
    nbytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    raw_data = huge_page_buffer(nbytes)  # on huge pages: the raw O_DIRECT write's best case, with no copy
    raw_data[:] = torch.randn(nbytes // 4).numpy().view("uint8")
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    batches = [(torch.ones(1), torch.ones(1))] * 2
    options = {"save_interval": None, "save_on_fit_end": False, "thread_count": args.threads,
               "direct_io": direct_io, "hash": args.hash}

    def trained(checkpointer, duration="1ba"):
        trainer = Trainer(model, batches, duration, optimizers=optimizer, callbacks={"checkpoint": checkpointer}, loggers=[])
        trainer.fit()  # one real step: the optimizer state exists, as in training
        return trainer

    class NoReadAhead(Checkpointer):
        """A rank whose data files another rank checks: it only loads (verify=none here)."""

        def _start_read_ahead(self, found):
            self._read_ahead = None

    class DcpReader(ReadAheadFileSystemReader):
        """What such a rank did before: DCP's own reader (torch.load of every item, then a copy)."""

        def read_data(self, plan, planner):
            return SafeFileSystemReader.read_data(self, plan, planner)

    results: dict[str, list[float]] = collections.defaultdict(list)
    cache_note = ""
    saved_bytes = 0

    def load(key: str, folder: Path, verify: str, kind=Checkpointer) -> None:
        nonlocal cache_note
        cache_note = drop_caches(root)
        recorder = Recorder()
        loader = kind(load_path=str(folder), verify=verify, **options)
        start = time.perf_counter()
        trainer = Trainer(model, batches, "1ba", optimizers=optimizer, callbacks={"checkpoint": loader},
                          loggers={"rec": recorder})
        results[f"{key}_trainer"].append(time.perf_counter() - start)
        results[key].append(recorder.metrics["checkpoint/load_s"][-1])
        trainer.close()

    def raw_side(rep: int) -> None:
        raw_file = root / f"raw-{rep}.bin"
        times = []
        for how in RAW_WRITE_WAYS:
            if raw_file.exists():
                raw_file.unlink()
                os.sync()
            times.append(raw_write(raw_file, raw_data, how))
            results[f"raw_write_{how}"].append(times[-1])
        results["raw_write"].append(min(times))
        tensors_file = root / f"raw-tensors-{rep}.bin"
        seconds, written = raw_write_from_tensors(tensors_file, list(model.parameters()))
        results["raw_write_tensors"].append(written / seconds / 1e9)
        tensors_file.unlink()
        times = []
        for how in RAW_READ_WAYS:
            drop_caches(root)
            times.append(raw_read(raw_file, how))
            results[f"raw_read_{how}"].append(times[-1])
        results["raw_read"].append(min(times))
        raw_file.unlink()

    def our_side(rep: int) -> None:
        nonlocal saved_bytes
        folder = root / f"sync-{rep}"
        ck = Checkpointer(str(folder), **options)
        trainer = trained(ck)
        os.sync()
        start = time.perf_counter()
        ck.save(trainer.state, Recorder())
        results["save"].append(time.perf_counter() - start)
        trainer.close()
        saved_bytes = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        checkpoint = folder / ck.committed[-1]
        # the first read of what a save just wrote is slow on this VM, whatever reads it (1.5-3.4 s against
        # 0.5 s for 1 GiB with THP): it is recorded apart, so that it does not fall on whichever load comes first
        load("load_first_after_save", checkpoint, "manifest")
        loads = [("load", "manifest", Checkpointer), ("load_unverified", "none", Checkpointer),
                 ("other_rank", "none", NoReadAhead), ("other_rank_dcp", "none", NoReadAhead)]
        for key, verify, kind in loads if rep % 2 == 0 else loads[::-1]:
            if key == "other_rank_dcp":
                state_io.ReadAheadFileSystemReader = DcpReader
            try:
                load(key, checkpoint, verify, kind)
            finally:
                state_io.ReadAheadFileSystemReader = ReadAheadFileSystemReader
        shutil.rmtree(folder)

    for rep in range(args.repeats):
        for side in (raw_side, our_side) if rep % 2 == 0 else (our_side, raw_side):
            side(rep)

        folder = root / f"async-{rep}"
        ck = Checkpointer(str(folder), async_save=True, **options)
        trainer = trained(ck)
        start = time.perf_counter()
        ck.save(trainer.state, Recorder())  # the first async save also allocates the reused host staging buffers
        results["async_first_blocked"].append(time.perf_counter() - start)
        ck.wait()
        trainer.close()
        trainer = trained(ck, "2ba")  # the next save of the same run, at batch 2: the steady state
        os.sync()
        start = time.perf_counter()
        ck.save(trainer.state, Recorder())
        results["async_blocked"].append(time.perf_counter() - start)
        # parameters and optimizer state are copied to host memory in the background until the next optimizer
        # step, which waits for that copy: a step with no forward/backward time to hide it behind waits it all
        ck.wait_for_staging()
        results["async_blocked_no_compute"].append(time.perf_counter() - start)
        ck.wait()
        results["async_total"].append(time.perf_counter() - start)
        trainer.close()
        shutil.rmtree(folder)

    med = {k: statistics.median(v) for k, v in results.items()}
    best = {k: min(v) for k, v in results.items()}
    gb = nbytes / 1e9
    save_ratio = med["raw_write"] / med["save"]
    load_ratio = med["raw_read"] / med["load"]
    async_ratio = med["async_blocked"] / med["save"]
    print(f"state: {nbytes / (1 << 30):.3f} GiB (checkpoint {saved_bytes / (1 << 30):.3f} GiB on disk); dir {root}; "
          f"file system: {filesystem_type(root)}; {os.cpu_count()} CPUs")
    print(f"page cache emptied before every read by {cache_note}; median of {args.repeats} (raw first in even "
          f"repetitions, ours first in odd)")
    print(f"hash {args.hash}: {hash_rate(args.hash, raw_data):.2f} GB/s on one thread; direct_io={args.direct_io}; "
          f"{args.threads} writer thread(s); THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}")
    print(f"raw write (best of 3 ways, + fsync)   {gb / med['raw_write']:6.2f} GB/s  ({med['raw_write']:.3f} s); each way: "
          + ", ".join(f"{how} {gb / med[f'raw_write_{how}']:.2f}" for how in RAW_WRITE_WAYS))
    print(f"  O_DIRECT from the parameters' own memory (whole pages, not a baseline) "
          f"{med['raw_write_tensors']:.2f} GB/s")
    print(f"save (DCP + {args.hash} + manifest)   {gb / med['save']:6.2f} GB/s  ({med['save']:.3f} s); "
          f"best of each {best['raw_write'] / best['save']:.2f}")
    print(f"save ratio {save_ratio:.2f}  (goal >= 0.90)")
    print(f"raw read (best of 2 ways)             {gb / med['raw_read']:6.2f} GB/s  ({med['raw_read']:.3f} s); each way: "
          + ", ".join(f"{how} {gb / med[f'raw_read_{how}']:.2f}" for how in RAW_READ_WAYS))
    print(f"load, verify=manifest                 {gb / med['load']:6.2f} GB/s  ({med['load']:.3f} s); best of each "
          f"{best['raw_read'] / best['load']:.2f}; whole Trainer construction {med['load_trainer']:.3f} s")
    print(f"  the same load, verify=none          {gb / med['load_unverified']:6.2f} GB/s  ({med['load_unverified']:.3f} s)"
          f"; ratio {med['raw_read'] / med['load_unverified']:.2f}")
    print(f"  files another rank checks: in place {med['other_rank']:.3f} s (ratio "
          f"{med['raw_read'] / med['other_rank']:.2f}), DCP's reader {med['other_rank_dcp']:.3f} s (ratio "
          f"{med['raw_read'] / med['other_rank_dcp']:.2f})")
    print(f"  the first load after each save (verify=manifest, not in the ratio) {med['load_first_after_save']:.3f} s")
    print(f"load ratio {load_ratio:.2f}  (goal >= 0.90)")
    print(f"async save blocked {med['async_blocked']:.3f} s (a run's first save {med['async_first_blocked']:.3f} s = "
          f"{med['async_first_blocked'] / med['save']:.3f}, allocating the staging buffers); with no compute to hide "
          f"the background copy behind, the next step waits until {med['async_blocked_no_compute']:.3f} s = "
          f"{med['async_blocked_no_compute'] / med['save']:.3f}; save to commit {med['async_total']:.3f} s")
    print(f"async blocked ratio {async_ratio:.2f}  (goal <= 0.05; {async_ratio:.3f})")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    print(f"checkpoint_io: save {save_ratio:.2f} load {load_ratio:.2f} async {async_ratio:.2f}")


if __name__ == "__main__":
    main()
