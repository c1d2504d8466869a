"""Epoch read throughput of smalti-streaming against mosaicml-streaming 0.13.0, same data, same run.

Writes one tokenized MDS dataset (``--samples`` samples of 2048 uint16 tokens, zstd), then iterates one full
shuffled epoch (py1e, batch 32, one rank, 2 DataLoader workers) with each library: from local disk, then
from a loopback S3 endpoint (moto) with an empty cache. mosaicml-streaming runs in its own virtual
environment, created by this script under ``.bench-venvs/`` (it pins numpy<2.2). Prints samples/s, MB/s,
the ratio smalti / mosaic and the time to the first batch (counted from the dataset's construction,
so index download and set-up are included for both libraries).

    python bench/streaming_read.py [--samples 200000] [--skip-s3] [--repeats 1]
    python bench/streaming_read.py --remote gs://bench/ds   # or az://bench/ds, s3://bench/ds

The issue's figure is 200k samples (~800 MB); ``--samples 20000`` runs in about a minute on a small machine.

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
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".bench-venvs" / "mosaicml-streaming"
SEQ = 2048

READER = r"""
import json, sys, time
from torch.utils.data import DataLoader
kind, remote, local = sys.argv[1], sys.argv[2], sys.argv[3]
remote = None if remote == "-" else remote
if kind == "mosaic":
    from streaming import StreamingDataset
else:
    from smalti.streaming import StreamingDataset
start = time.perf_counter()  # the first batch's time includes building the dataset (index download, setup)
ds = StreamingDataset(remote=remote, local=local, batch_size=32, shuffle=True, shuffle_algo="py1e",
                      num_canonical_nodes=1, predownload=256)
first = None
n = 0
for batch in DataLoader(ds, batch_size=32, num_workers=2):
    if first is None:
        first = time.perf_counter() - start
    n += len(batch["tokens"])
total = time.perf_counter() - start
print(json.dumps({"samples": n, "seconds": total, "first_batch": first}))
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


def write_data(path: Path, samples: int) -> int:
    from smalti.streaming import MDSWriter

    rng = np.random.default_rng(0)
    with MDSWriter(path, {"tokens": f"ndarray:uint16:{SEQ}"}, compression="zstd", hashes=["xxh64"],
                   size_limit="32mb") as writer:
        for _ in range(samples):
            writer.write({"tokens": rng.integers(0, 50000, SEQ, dtype=np.uint16)})
    return sum(p.stat().st_size for p in path.iterdir())


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


def compare(mosaic: str, remote: str | None, work: Path, tag: str, env: dict[str, str], repeats: int,
            source: Path | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """``repeats`` epochs per library, alternating (so load changes hit both alike); the medians of each."""
    runs: dict[str, list[dict[str, float]]] = {"smalti": [], "mosaic": []}
    for _ in range(repeats):
        runs["smalti"].append(run_once(sys.executable, "smalti", remote, work / f"{tag}-smalti", env, source))
        runs["mosaic"].append(run_once(mosaic, "mosaic", remote, work / f"{tag}-mosaic", env, source))
    med = {kind: {key: float(np.median([r[key] for r in rs])) for key in ("samples", "seconds", "first_batch")}
           for kind, rs in runs.items()}
    for kind, rs in runs.items():
        print(f"  {kind} runs: " + ", ".join(f"{r['seconds']:.2f} s (first batch {r['first_batch']:.2f} s)"
                                             for r in rs))
    return med["smalti"], med["mosaic"]


def report(title: str, ours: dict[str, float], theirs: dict[str, float], mb_per_sample: float) -> None:
    o, t = ours["samples"] / ours["seconds"], theirs["samples"] / theirs["seconds"]
    print(f"\n{title}")
    print(f"  smalti-streaming    {o:10.0f} samples/s  {o * mb_per_sample:8.1f} MB/s  first batch {ours['first_batch']:.2f} s")
    print(f"  mosaicml-streaming  {t:10.0f} samples/s  {t * mb_per_sample:8.1f} MB/s  first batch {theirs['first_batch']:.2f} s")
    print(f"  ratio smalti / mosaic = {o / t:.2f}   time to first batch ratio = {ours['first_batch'] / theirs['first_batch']:.2f}")


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
                  f"first batch {m['first_batch']:.2f} s")
        ours, base = med[url], med[baseline]
        print(f"  ratio {url} / s3 = {(ours['samples'] / ours['seconds']) / (base['samples'] / base['seconds']):.2f}"
              f"   time to first batch ratio = {ours['first_batch'] / base['first_batch']:.2f}")
    finally:
        for server in servers:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=200_000, help="dataset size (scale down on small machines)")
    parser.add_argument("--skip-s3", action="store_true")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per library and source, alternating; the medians are reported")
    parser.add_argument("--remote", help="gs://bucket/ds, az://container/ds or s3://bucket/ds: a cold epoch from "
                        "that scheme's loopback server against loopback S3, smalti-streaming only")
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    sys.path.insert(0, str(ROOT / "packages" / "testing" / "src"))
    if args.remote:
        work = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
        try:
            data = work / "data"
            size = write_data(data, args.samples)
            print(f"dataset: {args.samples} samples x {SEQ} uint16 tokens, {size / 1e6:.0f} MB zstd")
            print(f"\ncold epoch from {args.remote} vs loopback S3 (py1e, batch 32, 2 workers, empty cache)")
            compare_remote(args.remote, work, data, args.repeats, SEQ * 2 / 1e6)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    mosaic = str(ensure_mosaic_venv())
    work = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    try:
        data = work / "data"
        size = write_data(data, args.samples)
        mb_per_sample = SEQ * 2 / 1e6
        print(f"dataset: {args.samples} samples x {SEQ} uint16 tokens, {size / 1e6:.0f} MB zstd, in {data}")
        # Local: each run starts from a fresh copy of the zipped shards (both libraries decompress them
        # beside the zips on first read).
        ours, theirs = compare(mosaic, None, work, "local", {}, args.repeats, data)
        report("local disk, full shuffled epoch (py1e, batch 32, 2 workers)", ours, theirs, mb_per_sample)
        if args.skip_s3:
            return
        from smalti.testing.servers import start_s3_server

        server = start_s3_server()
        try:
            client = server.client()
            client.create_bucket(Bucket="bench")
            for path in data.iterdir():
                client.upload_file(str(path), "bench", f"ds/{path.name}")
            env = {k: os.environ[k] for k in ("S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                              "AWS_DEFAULT_REGION")}
            ours, theirs = compare(mosaic, "s3://bench/ds", work, "s3", env, args.repeats)
            report("loopback S3 (moto), empty cache", ours, theirs, mb_per_sample)
        finally:
            server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
