"""MDSWriter and StreamingDataset on every object store smalti-storage speaks, each a real server on loopback:
moto (``s3://``), gcp-storage-emulator (``gs://``), Azurite (``az://``); and an S3 brown-out ridden out."""

import decimal
import json
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from smalti.storage import open_store
from smalti.streaming import DownloadError, MDSWriter, StreamingDataset, StreamingError

FIXTURES = Path(__file__).parent / "fixtures"
COLUMNS = {"id": "int", "x": "ndarray:float32:4", "s": "str", "b": "bytes"}
N = 300


def sample(i):
    return {"id": i, "x": np.arange(4, dtype=np.float32) * i - 0.5, "s": f"sample {i} é",
            "b": bytes(range(i % 7))}


def plain(s):
    return (int(s["id"]), s["x"].tolist(), s["s"], s["b"])


EXPECTED = {i: plain(sample(i)) for i in range(N)}


@pytest.fixture(params=["s3", "gs", "az"])
def bucket_url(request):
    """A fresh, empty bucket (or container) on the loopback server of each scheme; the environment points at it."""
    if request.param == "s3":
        request.getfixturevalue("s3_server")
        return f"s3://{request.getfixturevalue('s3_bucket')}"
    if request.param == "gs":
        return f"gs://{request.getfixturevalue('gcs_bucket')}"
    return f"az://{request.getfixturevalue('azure_container')}"


def write(out, n=N):
    with MDSWriter(out, COLUMNS, compression="zstd", hashes=["xxh64"], size_limit=2000) as writer:
        for i in range(n):
            writer.write(sample(i))


def read(ds, stop=None):
    """The samples of one epoch, in order, in this process (``stop``: only the first ``stop``)."""
    out = []
    for s in ds:
        out.append(plain(s))
        if stop is not None and len(out) == stop:
            break
    return out


KW = {"batch_size": 8, "shuffle": True, "shuffle_block_size": 64, "predownload": 16}


def test_writer_to_bucket_then_every_sample_back_exactly_and_resume(bucket_url, tmp_path):
    url = f"{bucket_url}/ds"
    write(url)
    write(tmp_path / "local")  # the same data on disk: the order a local read gives
    keys = [o.key for o in open_store(url).list()]
    assert sorted(keys) == sorted(p.name for p in (tmp_path / "local").iterdir() if not p.name.startswith("."))
    want = read(StreamingDataset(local=str(tmp_path / "local"), **KW))

    got = read(StreamingDataset(remote=url, local=str(tmp_path / "c1"), **KW))
    assert got == want
    assert {s[0] for s in got} == set(range(N)) and all(s == EXPECTED[s[0]] for s in got)  # every sample, exact

    first = StreamingDataset(remote=url, local=str(tmp_path / "c2"), **KW)
    head = read(first, stop=96)
    state = first.state_dict()
    resumed = StreamingDataset(remote=url, local=str(tmp_path / "c3"), **KW)  # a fresh cache: all from the bucket
    resumed.load_state_dict(state)
    assert head + read(resumed) == want


def as_json(value):
    if isinstance(value, np.ndarray):
        return {"ndarray": {"dtype": str(value.dtype), "shape": list(value.shape), "data": value.reshape(-1).tolist()}}
    if isinstance(value, np.generic):
        return {"scalar": {"dtype": str(value.dtype), "value": value.item()}}
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    if isinstance(value, decimal.Decimal):
        return {"decimal": str(value)}
    return value


def test_golden_fixture_in_bucket_reads_exactly(bucket_url, tmp_path):
    """A dataset written by mosaicml-streaming 0.13.0 (zstd:7, sha1 + xxh3_64 hashes), served from the bucket."""
    url = f"{bucket_url}/golden"
    store = open_store(url)
    for path in sorted((FIXTURES / "zstd7_sha1_xxh3").iterdir()):
        store.put_file(path, path.name)
    expected = [json.loads(line) for line in (FIXTURES / "expected_samples.jsonl").read_text().splitlines()]
    ds = StreamingDataset(remote=url, local=str(tmp_path / "cache"), batch_size=1)
    assert [{k: as_json(v) for k, v in s.items()} for s in ds] == expected


def test_unknown_scheme_names_the_schemes_and_fails_before_writing(tmp_path):
    with pytest.raises(StreamingError, match=r"no storage backend for nope://.*have: .*gs.*s3"):
        MDSWriter("nope://bucket/ds", COLUMNS)
    with pytest.raises(DownloadError, match=r"no storage backend for nope://.*have: .*gs.*s3"):
        StreamingDataset(remote="nope://bucket/ds", local=str(tmp_path / "cache"), batch_size=8)


def test_s3_brown_out_during_an_epoch_is_ridden_out(s3_server, s3_bucket, fault_proxy, monkeypatch, tmp_path):
    """503s for 30 s (the issue's brown-out) while an epoch streams from S3: it finishes, every sample exact,
    no RNG stream moved."""
    url = f"s3://{s3_bucket}/ds"
    write(url)
    write(tmp_path / "local")
    want = read(StreamingDataset(local=str(tmp_path / "local"), **KW))
    proxy = fault_proxy(s3_server.endpoint_url)
    monkeypatch.setenv("S3_ENDPOINT_URL", proxy.url)
    ds = StreamingDataset(remote=url, local=str(tmp_path / "cache"), **KW)  # index.json before the outage
    random.seed(7)
    torch.manual_seed(7)
    py_rng, torch_rng = random.getstate(), torch.get_rng_state()
    proxy.brown_out(30.0, min_failures=3)
    start = time.monotonic()
    got = read(ds)
    elapsed = time.monotonic() - start
    assert got == want
    assert len(proxy.failed()) >= 3
    assert elapsed >= 29.5  # waited the outage out rather than reading around it
    assert random.getstate() == py_rng  # retry jitter came from smalti-storage's private generator
    assert torch.equal(torch.get_rng_state(), torch_rng)
