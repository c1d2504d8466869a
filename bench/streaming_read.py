"""Epoch read throughput of smalti-streaming against mosaicml-streaming 0.13.0 and LitData, same data, same run,
and against the limit of the disk and the decompressor.

Writes one tokenized dataset (``--samples`` samples of 2048 uint16 tokens, zstd shards in frames of 1 MiB with
a seek table, MDSWriter's default; ``--zstd-frame-size none``: one frame per shard) in MDS and, with
``litdata.optimize``, in LitData's own format (zstd, the same 32 MB chunks), then iterates one full shuffled
epoch (batch 32, one rank, 2 DataLoader workers: py1e for the MDS readers, LitData's own shuffle) with each
library: from local disk, then from a loopback S3 endpoint (moto) with an empty cache. Each library uses its
own loader (smalti's and LitData's ``StreamingDataLoader``; torch's ``DataLoader`` for mosaicml-streaming,
whose loader adds only state). mosaicml-streaming and LitData run in virtual environments of their own,
created by this script under ``.bench-venvs/`` (mosaicml-streaming pins numpy<2.2; both get the CPU build of
torch 2.13.0 first, so nothing pulls CUDA; LitData without torchvision, which it uses only for images).
Prints samples/s, MB/s, the ratios and the time to the first batch (counted from the dataset's
construction, so index download and set-up are included for every library).

The limit: the same MDS shards read and zstd-decompressed in one process with no dataset machinery (read the
file, decompress, cut the samples into batches of 32): an upper bound for one core, in samples/s and MB/s,
measured right before and right after every local smalti run. ``of_limit`` is the median over the smalti
runs of each run's throughput over the better of the two limit runs around it (so a load change between the
two measurements does not count for smalti).

    python bench/streaming_read.py [--samples 200000] [--skip-s3] [--repeats 1]
    python bench/streaming_read.py --remote gs://bench/ds   # or az://bench/ds, s3://bench/ds

The last line is ``streaming_read: vs_mosaic_local X.XX vs_mosaic_s3 X.XX vs_litdata_local X.XX
vs_litdata_s3 X.XX of_limit X.XX`` (smalti's throughput over each).

The issue's figure is 200k samples (~800 MB); ``--samples 20000`` runs in a few minutes on a small machine.

``--shuffles py1e,keyed`` compares smalti's own epoch orders instead (no other library needed): one dataset,
``--repeats`` rounds each reading one epoch per order in turn, each order's median samples/s and CPU
microseconds per sample, and the last order over the first, whose last line is ``streaming_read_shuffles:
keyed_vs_py1e X.XXX paired X.XXX min X.XXX max X.XXX cpu_per_sample X.XXX`` (samples/s ratio of the medians,
the median, least and greatest of the rounds' ratios, and the ratio of CPU time per sample).

``--remote gs://...`` / ``az://...`` reads a cold epoch from the loopback GCS emulator / Azurite (started
here, the dataset uploaded through smalti-storage) with smalti-streaming only (mosaicml-streaming cannot be
pointed at these emulators), and prints its ratio against the same epoch from loopback S3 (moto) as the
baseline, run alternately in the same script.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".bench-venvs" / "mosaicml-streaming"
LITDATA_VENV = ROOT / ".bench-venvs" / "litdata"
LITDATA = "litdata==0.2.76"
# litdata's requirements but torchvision (image serializers only; it would pull a CUDA build of torch)
LITDATA_DEPS = ["lightning-utilities", "filelock", "numpy", "boto3", "requests", "urllib3>=1.26", "tifffile",
                "obstore", "zstd"]
SEQ = 2048
CHUNK = "32mb"


def tokens(i: int) -> np.ndarray:
    """Sample ``i``'s tokens: the same in every format (LITDATA_WRITER repeats this line)."""
    return np.random.default_rng([0, i]).integers(0, 50000, SEQ, dtype=np.uint16)


LITDATA_WRITER = r"""
import sys
import numpy as np
from litdata import optimize

def sample(i):
    return {"tokens": np.random.default_rng([0, i]).integers(0, 50000, 2048, dtype=np.uint16)}

if __name__ == "__main__":
    optimize(fn=sample, inputs=list(range(int(sys.argv[2]))), output_dir=sys.argv[1], chunk_bytes="32MB",
             compression="zstd", num_workers=2, mode="overwrite")
"""

READER = r"""
import json, multiprocessing, os, resource, sys, time
from torch.utils.data import DataLoader


def cpu_seconds():  # this process and its reaped children (the DataLoader workers, forked, joined at the end)
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


kind, remote, local = sys.argv[1], sys.argv[2], sys.argv[3]
remote = None if remote == "-" else remote
if kind == "mosaic":
    from streaming import StreamingDataset
elif kind == "litdata":
    import litdata
elif kind == "smalti_plain":  # torch's DataLoader: samples one by one, collated by the loader
    from smalti.streaming import StreamingDataset
else:
    from smalti.streaming import StreamingDataLoader as DataLoader, StreamingDataset
start, cpu_start = time.perf_counter(), cpu_seconds()  # both include building the dataset (index, setup)
if kind == "litdata":
    # local: the optimized folder itself (LitData reads local chunks in place); S3: a cold cache folder.
    # LitData's S3 clients (boto3 for the index, obstore for chunks) take the endpoint from storage_options;
    # obstore refuses plain http unless allowed, and LitData has no option for that, so it is set here.
    opts = {"endpoint_url": os.environ["S3_ENDPOINT_URL"]} if remote else None
    import litdata.streaming.downloader as ld_downloader
    ld_downloader._OBSTORE_CLIENT_OPTIONS = {**ld_downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": True}
    ds = litdata.StreamingDataset(input_dir=remote or local, cache_dir=local if remote else None, shuffle=True,
                                  storage_options=opts)
    loader = litdata.StreamingDataLoader(ds, batch_size=32, num_workers=2)
else:
    algo = os.environ.get("SMALTI_BENCH_SHUFFLE", "py1e")  # py1e: the same shuffle as mosaicml-streaming's
    ds = StreamingDataset(remote=remote, local=local, batch_size=32, shuffle=True, shuffle_algo=algo,
                          num_canonical_nodes=1, predownload=256)
    loader = DataLoader(ds, batch_size=32, num_workers=2)
first = None
n = 0
for batch in loader:
    if first is None:
        first = time.perf_counter() - start
    n += len(batch["tokens"])
total = time.perf_counter() - start
del loader
multiprocessing.active_children()  # reaps any worker not joined yet, so its CPU time is counted
print(json.dumps({"samples": n, "seconds": total, "first_batch": first, "cpu": cpu_seconds() - cpu_start}))
"""


def ensure_mosaic_venv() -> Path:
    python = VENV / "bin" / "python"
    if python.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + ["mosaicml-streaming==0.13.0", "boto3"], check=True)
    return python


def ensure_litdata_venv() -> Path:
    python = LITDATA_VENV / "bin" / "python"
    if python.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", str(LITDATA_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + ["--no-deps", LITDATA], check=True)
    subprocess.run(pip + LITDATA_DEPS, check=True)
    return python


def write_data(path: Path, samples: int, frame_size: str | None = "default") -> int:
    """The MDS dataset (zstd shards of ``frame_size`` frames with a seek table; ``None``: one frame each)."""
    from smalti.streaming import MDSWriter

    frames = {} if frame_size == "default" else {"zstd_frame_size": frame_size}
    with MDSWriter(path, {"tokens": f"ndarray:uint16:{SEQ}"}, compression="zstd", hashes=["xxh64"],
                   size_limit=CHUNK, **frames) as writer:
        for i in range(samples):
            writer.write({"tokens": tokens(i)})
    return sum(p.stat().st_size for p in path.iterdir())


def write_litdata(python: str, path: Path, samples: int) -> int:
    """The same samples through ``litdata.optimize`` (zstd, 32 MB chunks, 2 processes)."""
    script = path.parent / "litdata_writer.py"
    script.write_text(LITDATA_WRITER)
    out = subprocess.run([python, str(script), str(path), str(samples)], capture_output=True, text=True,
                         timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"litdata.optimize failed:\n{out.stderr[-3000:]}")
    return sum(p.stat().st_size for p in path.iterdir())


def limit(data: Path, repeats: int) -> float:
    """Samples/s of the bare work: read each zstd shard, decompress it (all its frames, into one buffer), cut
    its samples into batches of 32."""
    import zstandard

    from smalti.streaming import load_index

    entries = load_index(data / "index.json")
    rates = []
    for _ in range(max(repeats, 1)):
        start, n = time.perf_counter(), 0
        for entry in entries:
            packed = (data / entry["zip_data"]["basename"]).read_bytes()
            raw = bytearray(entry["raw_data"]["bytes"])
            reader = zstandard.ZstdDecompressor().stream_reader(packed, read_across_frames=True)
            view, got = memoryview(raw), 0
            while step := reader.readinto(view[got:]):
                got += step
            count = entry["samples"]
            offsets = np.frombuffer(raw, np.uint32, count + 1, 4)
            rows = np.frombuffer(raw, np.uint16, count * SEQ, int(offsets[0])).reshape(count, SEQ)
            for i in range(0, count, 32):
                n += len(rows[i : i + 32].copy())
        rates.append(n / (time.perf_counter() - start))
    return float(np.median(rates))


def run_once(python: str, kind: str, remote: str | None, local: Path, env: dict[str, str],
             source: Path | None = None) -> dict[str, float]:
    """One epoch in a fresh process, starting from an empty cache or a fresh copy of ``source``."""
    shutil.rmtree(local, ignore_errors=True)
    if source is not None:
        shutil.copytree(source, local)
    try:
        out = subprocess.run([python, "-c", READER, kind, remote or "-", str(local)], capture_output=True,
                             text=True, env={**os.environ, **env}, timeout=3600)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} reader failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(pythons: dict[str, str], remotes: dict[str, str | None], work: Path, tag: str, env: dict[str, str],
            repeats: int, sources: dict[str, Path] | None = None, around_smalti: Callable[[], None] | None = None,
            runs: dict[str, list[dict[str, float]]] | None = None) -> dict[str, dict[str, float]]:
    """``repeats`` epochs per library, alternating (so load changes hit all alike); the medians of each.

    ``pythons``, ``remotes`` and ``sources`` are per library: its interpreter, its remote URL (``None``:
    local) and the folder each run starts from a fresh copy of (``None``: an empty cache). ``around_smalti``
    runs right before and right after every smalti run (the limit's measurement, so that each smalti run is
    compared with the limit at the same load). ``runs`` (if given) receives every run, per library.
    """
    runs = {} if runs is None else runs
    runs.update({kind: [] for kind in pythons})
    for _ in range(repeats):
        for kind, python in pythons.items():
            source = (sources or {}).get(kind)
            if kind == "smalti" and around_smalti is not None:
                around_smalti()
            runs[kind].append(run_once(python, kind, remotes[kind], work / f"{tag}-{kind}", env, source))
            if kind == "smalti" and around_smalti is not None:
                around_smalti()
    for kind, rs in runs.items():
        print(f"  {kind} runs: " + ", ".join(f"{r['seconds']:.2f} s (first batch {r['first_batch']:.3f} s)"
                                             for r in rs))
    return {kind: {key: float(np.median([r[key] for r in rs])) for key in ("samples", "seconds", "first_batch")}
            for kind, rs in runs.items()}


NAMES = {"smalti": "smalti-streaming", "mosaic": "mosaicml-streaming", "litdata": "LitData",
         "smalti_plain": "smalti, per sample"}


def report(title: str, med: dict[str, dict[str, float]], mb_per_sample: float) -> dict[str, float]:
    """Print each library's figures and smalti's ratios; return ``{library: smalti / library throughput}``."""
    rate = {kind: m["samples"] / m["seconds"] for kind, m in med.items()}
    print(f"\n{title}")
    for kind, m in med.items():
        print(f"  {NAMES[kind]:19s} {rate[kind]:10.0f} samples/s  {rate[kind] * mb_per_sample:8.1f} MB/s  "
              f"first batch {m['first_batch']:.3f} s")
    ratios = {}
    for kind in med:
        if kind != "smalti":
            ratios[kind] = rate["smalti"] / rate[kind]
            print(f"  ratio smalti / {kind} = {ratios[kind]:.2f}   time to first batch ratio = "
                  f"{med['smalti']['first_batch'] / med[kind]['first_batch']:.2f}")
    return ratios


def start_remote(url: str, work: Path, data: Path) -> tuple[dict[str, str], object]:
    """Start the loopback server for ``url``'s scheme, upload ``data`` there; (environment, server)."""
    from smalti.storage import open_store, split_url
    from smalti.testing.cloud_servers import find_azurite, start_azurite, start_gcs_server
    from smalti.testing.servers import start_s3_server

    scheme, bucket, _ = split_url(url)
    work.mkdir(parents=True, exist_ok=True)
    if scheme == "s3":
        server = start_s3_server()
        server.client().create_bucket(Bucket=bucket)
        env = {k: os.environ[k] for k in ("S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                          "AWS_DEFAULT_REGION")}
    elif scheme == "gs":
        server = start_gcs_server(work)
        server.client().create_bucket(bucket)
        env = server.env()
    elif scheme in ("az", "azure"):
        exe = find_azurite(ROOT)
        if exe is None:
            raise SystemExit("Azurite is not installed: run scripts/setup.sh")
        server = start_azurite(work, exe)
        server.client().create_container(bucket)
        env = server.env()
    else:
        raise SystemExit(f"--remote {url}: this bench starts loopback servers for s3://, gs:// and az:// only")
    os.environ.update(env)
    store = open_store(url)
    for path in sorted(data.iterdir()):
        store.put_file(path, path.name)
    return env, server


def compare_remote(url: str, work: Path, data: Path, repeats: int, mb_per_sample: float) -> None:
    """Cold epochs from ``url`` (its emulator) against the same from loopback S3, smalti-streaming only."""
    baseline = "s3://bench/ds"
    servers = []
    try:
        env, server = start_remote(url, work / "remote", data)
        servers.append(server)
        base_env, server = start_remote(baseline, work / "s3", data)
        servers.append(server)
        runs: dict[str, list[dict[str, float]]] = {url: [], baseline: []}
        for _ in range(repeats):
            for target, target_env in ((url, env), (baseline, base_env)):
                runs[target].append(run_once(sys.executable, "smalti", target, work / "cache", target_env))
        med = {t: {k: float(np.median([r[k] for r in rs])) for k in ("samples", "seconds", "first_batch")}
               for t, rs in runs.items()}
        for t, m in med.items():
            rate = m["samples"] / m["seconds"]
            print(f"  {t:24s} {rate:10.0f} samples/s  {rate * mb_per_sample:8.1f} MB/s  "
                  f"first batch {m['first_batch']:.3f} s")
        ours, base = med[url], med[baseline]
        print(f"  ratio {url} / s3 = {(ours['samples'] / ours['seconds']) / (base['samples'] / base['seconds']):.2f}"
              f"   time to first batch ratio = {ours['first_batch'] / base['first_batch']:.2f}")
    finally:
        for server in servers:
            server.stop()


def spread(values: list[float]) -> str:
    """``median [min-max]`` of ``values``, three decimals."""
    return f"{np.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def compare_shuffles(algos: list[str], samples: int, repeats: int) -> dict[str, float]:
    """One local epoch (batch 32, 2 workers) per shuffle algorithm, interleaved (A B A B ...) ``repeats`` times.

    Each epoch runs in a fresh process from a fresh copy of one dataset written once. Prints per algorithm the
    median wall samples/s and CPU microseconds per sample (the reader and its workers, from the dataset's
    construction to the end of the epoch: what a loaded machine inflates least), then the last algorithm over
    the first: the ratio of the medians and, with its spread, the median of the ratios within each round (the
    two runs of a round are seconds apart, so they share the machine's load). Returns the ratios.
    """
    if len(algos) < 2:
        raise SystemExit(f"--shuffles {','.join(algos)}: give at least two algorithms to compare, e.g. py1e,keyed")
    work = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    try:
        data = work / "data"
        size = write_data(data, samples)
        print(f"dataset: {samples} samples x {SEQ} uint16 tokens, {size / 1e6:.0f} MB zstd; {repeats} rounds of "
              f"{' '.join(algos)}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        rates: dict[str, list[float]] = {a: [] for a in algos}
        cpus: dict[str, list[float]] = {a: [] for a in algos}
        firsts: dict[str, list[float]] = {a: [] for a in algos}
        for _ in range(repeats):
            for algo in algos:
                res = run_once(sys.executable, "smalti", None, work / "copy", {"SMALTI_BENCH_SHUFFLE": algo}, data)
                if res["samples"] < samples:
                    raise RuntimeError(f"{algo}: an epoch read {res['samples']} samples, fewer than {samples}")
                rates[algo].append(res["samples"] / res["seconds"])
                cpus[algo].append(res["cpu"] / res["samples"] * 1e6)
                firsts[algo].append(res["first_batch"])
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for algo in algos:
            print(f"{algo:7s} {np.median(rates[algo]):8.0f} samples/s (runs {', '.join(f'{r:.0f}' for r in rates[algo])}), "
                  f"CPU {np.median(cpus[algo]):6.1f} us/sample (runs {', '.join(f'{c:.1f}' for c in cpus[algo])}), "
                  f"first batch {np.median(firsts[algo]):.2f} s")
        a, b = algos[0], algos[-1]
        ratio = float(np.median(rates[b]) / np.median(rates[a]))
        paired = [y / x for x, y in zip(rates[a], rates[b])]
        cpu_ratio = float(np.median(cpus[b]) / np.median(cpus[a]))
        cpu_paired = [y / x for x, y in zip(cpus[a], cpus[b])]
        print(f"{b}/{a} samples/s: ratio of medians {ratio:.3f}, per round {spread(paired)}")
        print(f"{b}/{a} CPU per sample: ratio of medians {cpu_ratio:.3f}, per round {spread(cpu_paired)}")
        print(f"streaming_read_shuffles: {b}_vs_{a} {ratio:.3f} paired {np.median(paired):.3f} "
              f"min {min(paired):.3f} max {max(paired):.3f} cpu_per_sample {cpu_ratio:.3f}")
        return {"ratio": ratio, "paired": float(np.median(paired)), "cpu_ratio": cpu_ratio}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=200_000, help="dataset size (scale down on small machines)")
    parser.add_argument("--skip-s3", action="store_true")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per library and source, alternating; the medians are reported")
    parser.add_argument("--zstd-frame-size", default="default",
                        help="raw bytes per zstd frame of the MDS shards (e.g. 256kb; 'none': one frame per "
                        "shard, as mosaicml-streaming writes them); default: MDSWriter's")
    parser.add_argument("--remote", help="gs://bucket/ds, az://container/ds or s3://bucket/ds: a cold epoch from "
                        "that scheme's loopback server against loopback S3, smalti-streaming only")
    parser.add_argument("--shuffles", help="e.g. py1e,keyed: a local epoch with each of smalti's shuffles, "
                        "interleaved, smalti-streaming only (no other library installed); prints each one's "
                        "samples/s and CPU us/sample and the ratio of the last to the first with its spread")
    args = parser.parse_args()
    if args.shuffles:
        compare_shuffles(args.shuffles.split(","), args.samples, args.repeats)
        return
    frame_size = None if args.zstd_frame_size.lower() in ("none", "0") else args.zstd_frame_size
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    sys.path.insert(0, str(ROOT / "packages" / "testing" / "src"))
    if args.remote:
        work = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
        try:
            data = work / "data"
            size = write_data(data, args.samples, frame_size)
            print(f"dataset: {args.samples} samples x {SEQ} uint16 tokens, {size / 1e6:.0f} MB zstd")
            print(f"\ncold epoch from {args.remote} vs loopback S3 (py1e, batch 32, 2 workers, empty cache)")
            compare_remote(args.remote, work, data, args.repeats, SEQ * 2 / 1e6)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    pythons = {"smalti": sys.executable, "mosaic": str(ensure_mosaic_venv()), "litdata": str(ensure_litdata_venv())}
    work = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    ratios: dict[str, float] = {}
    try:
        data, ldata = work / "data", work / "litdata"
        size = write_data(data, args.samples, frame_size)
        lsize = write_litdata(pythons["litdata"], ldata, args.samples)
        mb_per_sample = SEQ * 2 / 1e6
        print(f"dataset: {args.samples} samples x {SEQ} uint16 tokens, {size / 1e6:.0f} MB zstd MDS, "
              f"{lsize / 1e6:.0f} MB zstd LitData, in {work}")
        # Local: each run starts from a fresh copy of the zipped shards (the MDS readers decompress them
        # beside the zips on first read; LitData reads its chunks where they are).
        # smalti_plain: the same dataset through torch's DataLoader (sample by sample, collated by the
        # loader) instead of StreamingDataLoader's whole batches: what the batched path is worth.
        local_pythons = {**pythons, "smalti_plain": sys.executable}
        sources = {"smalti": data, "mosaic": data, "litdata": ldata, "smalti_plain": data}
        bounds: list[float] = []  # measured right before and right after each smalti run
        runs: dict[str, list[dict[str, float]]] = {}
        med = compare(local_pythons, dict.fromkeys(local_pythons), work, "local", {}, args.repeats, sources,
                      around_smalti=lambda: bounds.append(limit(data, 1)), runs=runs)
        # each smalti run against the better of the two limit runs around it (the bound at that moment's load)
        pair_bounds = [max(bounds[2 * i], bounds[2 * i + 1]) for i in range(len(runs["smalti"]))]
        per_run = [r["samples"] / r["seconds"] / b for r, b in zip(runs["smalti"], pair_bounds)]
        bound = float(np.median(pair_bounds))
        print("  limit runs (before, after each smalti run): "
              + ", ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(bounds[::2], bounds[1::2])) + " samples/s")
        print(f"\nlimit: read + zstd-decompress + cut into batches, one process: {bound:10.0f} samples/s "
              f"{bound * mb_per_sample:8.1f} MB/s (median of the better of each pair)")
        local = report("local disk, full shuffled epoch (batch 32, 2 workers)", med, mb_per_sample)
        ratios.update({f"{k}_local": v for k, v in local.items()})
        of_limit = float(np.median(per_run))
        print(f"  smalti local / limit = {of_limit:.2f} (median of each run over the limit around it: "
              + ", ".join(f"{x:.2f}" for x in per_run) + ")")
        if not args.skip_s3:
            from smalti.testing.servers import start_s3_server

            server = start_s3_server()
            try:
                client = server.client()
                client.create_bucket(Bucket="bench")
                for folder, prefix in ((data, "ds"), (ldata, "ld")):
                    for path in folder.iterdir():
                        client.upload_file(str(path), "bench", f"{prefix}/{path.name}")
                env = {k: os.environ[k] for k in ("S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                  "AWS_DEFAULT_REGION")}
                remotes = {"smalti": "s3://bench/ds", "mosaic": "s3://bench/ds", "litdata": "s3://bench/ld"}
                med = compare(pythons, remotes, work, "s3", env, args.repeats)
                s3 = report("loopback S3 (moto), empty cache", med, mb_per_sample)
                ratios.update({f"{k}_s3": v for k, v in s3.items()})
            finally:
                server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fields = ["mosaic_local", "mosaic_s3", "litdata_local", "litdata_s3"]
    print("streaming_read: " + " ".join(f"vs_{f} " + (f"{ratios[f]:.2f}" if f in ratios else "n/a") for f in fields)
          + f" of_limit {of_limit:.2f}")


if __name__ == "__main__":
    main()
