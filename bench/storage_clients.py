"""Cold read of N objects through smalti-storage (the clouds' own SDKs) vs obstore, against loopback servers.

    python bench/storage_clients.py [--objects 64] [--size-kb 256] [--threads 8] [--repeat 3]

For Google Cloud Storage (gcp-storage-emulator), S3 (moto's server in its own process) and, when Azurite is
installed, Azure Blob: the objects are written once, then each side reads all of them with a fresh client
(cold: new connections, no cache), sequentially and with ``--threads`` readers, then again with the same
client (warm: no client set-up); the best of ``--repeat`` runs is reported, alternating which side goes
first. Prints each time and the ratio obstore / smalti-storage (above 1: smalti-storage is faster). The
servers share the machine's cores with the clients, so the ratio bounds the client-side cost rather than
predicting cloud throughput.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def start_moto_process(root: Path):  # noqa: ANN201 - a GcsServer-like handle with endpoint_url
    """moto's server in its own process (in this one it would share the GIL with the client under test)."""
    import shutil
    import subprocess
    import sys

    from smalti.testing.cloud_servers import _terminate
    from smalti.testing.ports import free_port, wait_for_port
    from smalti.testing.servers import S3Server

    port = free_port()
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    with open(root / "moto.log", "wb") as log:
        proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    wait_for_port(port, timeout=60)
    server = S3Server(endpoint_url=f"http://127.0.0.1:{port}", _stop=lambda: _terminate(proc))
    server.apply_env()
    return server


def timed(read_all: Callable[[], int], expect: int) -> float:
    start = time.perf_counter()
    got = read_all()
    elapsed = time.perf_counter() - start
    assert got == expect, f"read {got} bytes, expected {expect}"
    return elapsed


def run_pair(label: str, names: list[str], total: int, threads: int, repeat: int,
             ours: Callable[[], Callable[[str], bytes]], theirs: Callable[[], Callable[[str], bytes]]) -> None:
    failed: dict[str, str] = {}
    for workers in (1, threads):
        best = {"smalti-storage": float("inf"), "obstore": float("inf")}
        warm = dict(best)
        for i in range(repeat):
            order = [("smalti-storage", ours), ("obstore", theirs)]
            if i % 2:
                order.reverse()
            for name, make in order:
                if name in failed:
                    continue
                get = make()  # a fresh client each run: a cold read

                def read_all(get: Callable[[str], bytes] = get, workers: int = workers) -> int:
                    with ThreadPoolExecutor(workers) as pool:
                        return sum(len(b) for b in pool.map(get, names))

                try:
                    best[name] = min(best[name], timed(read_all, total))
                    warm[name] = min(warm[name], timed(read_all, total))  # same client again: no set-up cost
                except Exception as exc:  # noqa: BLE001 - a client that cannot talk to this server is a result
                    failed[name] = str(exc).splitlines()[0]
        mb = total / 1e6
        sides = [f"{name} {'failed' if name in failed else f'{t:.3f} s ({mb / t:.1f} MB/s)'}"
                 for name, t in best.items()]
        ratio = "n/a" if failed else f"{best['obstore'] / best['smalti-storage']:.2f}"
        print(f"{label:6s} threads={workers:<2d} cold {'  '.join(sides)}  ratio obstore/smalti-storage {ratio}")
        sides = [f"{name} {'failed' if name in failed else f'{t:.3f} s ({mb / t:.1f} MB/s)'}"
                 for name, t in warm.items()]
        ratio = "n/a" if failed else f"{warm['obstore'] / warm['smalti-storage']:.2f}"
        print(f"{label:6s} threads={workers:<2d} warm {'  '.join(sides)}  ratio obstore/smalti-storage {ratio}")
    for name, why in failed.items():
        print(f"{label:6s} {name} failed: {why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=64)
    parser.add_argument("--size-kb", type=int, default=256)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    import obstore
    from obstore.store import AzureStore as ObAzure
    from obstore.store import GCSStore as ObGcs
    from obstore.store import S3Store as ObS3

    from smalti.storage import RetryPolicy, open_store
    from smalti.testing.cloud_servers import (
        AZURITE_ACCOUNT,
        AZURITE_KEY,
        find_azurite,
        start_azurite,
        start_gcs_server,
    )

    rng = random.Random(0)
    blobs = {f"shard.{i:05d}.mds": rng.randbytes(args.size_kb << 10) for i in range(args.objects)}
    total = sum(map(len, blobs.values()))
    names = sorted(blobs)
    root = Path(tempfile.mkdtemp(prefix="bench-storage-"))
    print(f"{args.objects} objects of {args.size_kb} KiB ({total / 1e6:.1f} MB), best of {args.repeat}")

    gcs = start_gcs_server(root)
    try:
        os.environ.update(gcs.env())
        gcs.client().create_bucket("bench")
        writer = open_store("gs://bench/ds", retry=RetryPolicy(budget_s=30))
        for name, data in blobs.items():
            writer.put_bytes(name, data)

        def ours_gs() -> Callable[[str], bytes]:
            return open_store("gs://bench/ds").get_bytes

        def theirs_gs() -> Callable[[str], bytes]:
            store = ObGcs("bench", prefix="ds", base_url=gcs.endpoint, skip_signature=True,
                          client_options={"allow_http": True})
            return lambda name: bytes(obstore.get(store, name).bytes())

        run_pair("gs://", names, total, args.threads, args.repeat, ours_gs, theirs_gs)
    finally:
        gcs.stop()

    s3 = start_moto_process(root)
    try:
        s3.client().create_bucket(Bucket="bench")
        writer = open_store("s3://bench/ds", endpoint_url=s3.endpoint_url)
        for name, data in blobs.items():
            writer.put_bytes(name, data)

        def ours_s3() -> Callable[[str], bytes]:
            return open_store("s3://bench/ds", endpoint_url=s3.endpoint_url).get_bytes

        def theirs_s3() -> Callable[[str], bytes]:
            store = ObS3("bench", prefix="ds", endpoint=s3.endpoint_url, region="us-east-1",
                         access_key_id="testing", secret_access_key="testing", client_options={"allow_http": True})
            return lambda name: bytes(obstore.get(store, name).bytes())

        run_pair("s3://", names, total, args.threads, args.repeat, ours_s3, theirs_s3)
    finally:
        s3.stop()

    exe = find_azurite(Path(__file__).resolve().parent)
    if exe is None:
        print("az://  skipped: Azurite is not installed (scripts/setup.sh installs it)")
        return
    azurite = start_azurite(root, exe)
    try:
        azurite.client().create_container("bench")
        conn = azurite.connection_string()
        writer = open_store("az://bench/ds", connection_string=conn)
        for name, data in blobs.items():
            writer.put_bytes(name, data)

        def ours_az() -> Callable[[str], bytes]:
            return open_store("az://bench/ds", connection_string=conn).get_bytes

        def theirs_az() -> Callable[[str], bytes]:
            store = ObAzure("bench", prefix="ds", account_name=AZURITE_ACCOUNT, account_key=AZURITE_KEY,
                            endpoint=azurite.blob_endpoint, client_options={"allow_http": True})
            return lambda name: bytes(obstore.get(store, name).bytes())

        run_pair("az://", names, total, args.threads, args.repeat, ours_az, theirs_az)
    finally:
        azurite.stop()


if __name__ == "__main__":
    main()
