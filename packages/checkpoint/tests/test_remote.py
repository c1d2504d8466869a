"""Checkpoints in object stores that the tests start on loopback: S3 (moto), Google Cloud Storage
(gcp-storage-emulator), Azure Blob (Azurite; skipped when it is not installed) and OCI (its S3-compatible API,
served by moto), some reached through smalti-testing's fault-injecting proxy."""

import functools
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from smalti.checkpoint import Checkpointer, CheckpointError, CheckpointUploadError
from smalti.checkpoint.hashes import ALGORITHMS
from smalti.core import Trainer
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.storage import open_store


def make_trainer(duration, checkpointer, model=None):
    torch.manual_seed(0)
    return Trainer(model or MLPRegressor(), build_dataloader(SyntheticRegression(96), 16, seed=5), duration,
                   optimizers=functools.partial(torch.optim.AdamW, lr=1e-2), callbacks={"checkpoint": checkpointer})


def keys(s3_server, bucket):
    listing = s3_server.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    return sorted(obj["Key"] for obj in listing)


@dataclass
class Remote:
    """One object store under test. ``raw`` is a store at the bucket's root that talks to the server directly
    (to list and to damage objects behind the checkpointer's back); ``route(proxy_url)`` sends every store the
    test opens afterwards through a fault proxy in front of ``upstream``."""

    kind: str
    base: str
    raw: Any
    upstream: str
    route: Callable[[str], None]

    def folder(self, name: str) -> str:
        return f"{self.base}/{name}"

    def keys(self, prefix: str = "") -> list[str]:
        return [info.key for info in self.raw.list(prefix)]


def _remote(kind: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Remote:
    if kind in ("s3", "oci"):
        s3 = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        raw = open_store(f"s3://{bucket}", endpoint_url=s3.endpoint_url)
        if kind == "s3":
            return Remote(kind, f"s3://{bucket}", raw, s3.endpoint_url,
                          lambda proxy: monkeypatch.setenv("S3_ENDPOINT_URL", proxy))
        monkeypatch.setenv("OCI_REGION", "us-ashburn-1")
        monkeypatch.setenv("SMALTI_OCI_S3_ENDPOINT_URL", s3.endpoint_url)
        return Remote(kind, f"oci://{bucket}@testns", raw, s3.endpoint_url,
                      lambda proxy: monkeypatch.setenv("SMALTI_OCI_S3_ENDPOINT_URL", proxy))
    if kind == "gs":
        gcs = request.getfixturevalue("gcs_server")
        bucket = request.getfixturevalue("gcs_bucket")  # points STORAGE_EMULATOR_HOST at the emulator
        return Remote(kind, f"gs://{bucket}", open_store(f"gs://{bucket}"), gcs.endpoint,
                      lambda proxy: monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy))
    azurite = request.getfixturevalue("azurite_server")  # skips when Azurite is not installed
    container = request.getfixturevalue("azure_container")
    raw = open_store(f"az://{container}", connection_string=azurite.connection_string())
    return Remote(kind, f"az://{container}", raw, azurite.blob_endpoint.rsplit("/", 1)[0],
                  lambda proxy: monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                                                   azurite.connection_string(f"{proxy}/devstoreaccount1")))


@pytest.fixture(params=["s3", "gs", "az"])
def remote(request, monkeypatch) -> Remote:
    """Each object store in turn (``indirect`` parametrisation may pick others, such as ``oci``)."""
    return _remote(request.param, request, monkeypatch)


def test_save_uploads_manifest_last_and_autoresumes_from_s3(faulty_s3, s3_server, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/run"
    faulty_s3.fail("PUT", "/ep0-ba2/__0_0.distcp", times=2, status=503)  # transient: retried
    reference = make_trainer("6ba", Checkpointer(None))
    reference.fit()
    make_trainer("4ba", Checkpointer(url, save_interval="2ba", keep_last_n=1, async_save=True,
                                     local_cache_dir=str(tmp_path / "cache"), s3_multipart_mb=5)).fit()
    assert keys(s3_server, s3_bucket) == ["run/ep0-ba4/.metadata", "run/ep0-ba4/__0_0.distcp",
                                          "run/ep0-ba4/extra/rank0.pt", "run/ep0-ba4/manifest.json", "run/latest"]
    puts = [path for method, path, status in faulty_s3.requests if method == "PUT" and status == 200 and "ep0-ba4" in path]
    assert puts[-1].endswith("/ep0-ba4/manifest.json") and len(puts) == 4
    assert sum(1 for m, p, s in faulty_s3.requests if s == 503) == 2
    assert not (tmp_path / "cache" / "staging" / "ep0-ba4").exists()  # local staging removed after commit

    resumed = make_trainer("6ba", Checkpointer(url, save_interval="2ba", autoresume=True,
                                               local_cache_dir=str(tmp_path / "cache2")))
    assert resumed.state.timestamp.batch == 4
    resumed.fit()
    for a, b in zip(reference.state.model.parameters(), resumed.state.model.parameters()):
        assert torch.equal(a, b)


def test_upload_failure_is_reported_and_loses_no_committed_checkpoint(faulty_s3, s3_server, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/run"
    make_trainer("2ba", Checkpointer(url, save_interval="2ba", keep_last_n=1, retry_budget_s=1,
                                     local_cache_dir=str(tmp_path / "c"))).fit()
    faulty_s3.fail("PUT", "/ep0-ba4/__0_0.distcp")  # every attempt fails
    trainer = make_trainer("4ba", Checkpointer(url, save_interval="2ba", keep_last_n=1, autoresume=True, retry_budget_s=1,
                                               local_cache_dir=str(tmp_path / "c")))
    with pytest.raises(CheckpointError, match=r"ep0-ba4/__0_0\.distcp.*retry budget of 1 s"):
        trainer.fit()
    names = keys(s3_server, s3_bucket)
    assert "run/ep0-ba2/manifest.json" in names and "run/ep0-ba4/manifest.json" not in names
    latest = s3_server.client().get_object(Bucket=s3_bucket, Key="run/latest")["Body"].read().decode().strip()
    assert latest == "ep0-ba2"
    faulty_s3.clear()
    with make_trainer("4ba", Checkpointer(url, autoresume=True, local_cache_dir=str(tmp_path / "d"))) as again:
        assert again.state.timestamp.batch == 2


@pytest.mark.parametrize("failing", ["manifest.json", "__0_0.distcp"])
def test_transport_failure_fails_autoresume_instead_of_falling_back(faulty_s3, s3_bucket, tmp_path, failing):
    url = f"s3://{s3_bucket}/run"
    make_trainer("4ba", Checkpointer(url, save_interval="2ba", local_cache_dir=str(tmp_path / "c"))).fit()
    faulty_s3.fail("GET", f"/ep0-ba4/{failing}")  # the endpoint keeps failing reads of this object
    with pytest.raises(CheckpointUploadError, match=rf"ep0-ba4/{failing}.*retry budget of 1 s"):
        make_trainer("6ba", Checkpointer(url, save_interval="2ba", autoresume=True, retry_budget_s=1,
                                         local_cache_dir=str(tmp_path / "d")))
    faulty_s3.clear()
    with make_trainer("6ba", Checkpointer(url, autoresume=True, local_cache_dir=str(tmp_path / "d"))) as resumed:
        assert resumed.state.timestamp.batch == 4  # the checkpoint was fine all along


def _corrupt_remote_object_is_skipped_on_autoresume(remote, tmp_path, caplog, damage, algorithm="xxh3_128"):
    url = remote.folder("run")
    make_trainer("4ba", Checkpointer(url, save_interval="2ba", local_cache_dir=str(tmp_path / "c"),
                                     hash=algorithm)).fit()
    shard = "run/ep0-ba4/__0_0.distcp"
    if damage == "deleted":
        remote.raw.delete(shard)
        with make_trainer("6ba", Checkpointer(url, autoresume=True, local_cache_dir=str(tmp_path / "d"))) as resumed:
            assert resumed.state.timestamp.batch == 2
        assert "ep0-ba4/__0_0.distcp" in caplog.text and "missing" in caplog.text
        return
    body = bytearray(remote.raw.get_bytes(shard))
    body[100] ^= 0xFF
    remote.raw.put_bytes(shard, bytes(body))
    manifest = json.loads(remote.raw.get_bytes("run/ep0-ba4/manifest.json"))
    assert manifest["files"]["__0_0.distcp"]["size"] == len(body)
    assert manifest["files"]["__0_0.distcp"]["hash"].startswith(f"{algorithm}:")
    with make_trainer("6ba", Checkpointer(url, autoresume=True, local_cache_dir=str(tmp_path / "d"))) as resumed:
        assert resumed.state.timestamp.batch == 2
    assert f"ep0-ba4/__0_0.distcp has {algorithm} " in caplog.text


@pytest.mark.parametrize("remote", ["s3"], indirect=True)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("damage", ["flipped", "deleted"])
def test_corrupt_s3_object_is_skipped_on_autoresume_with_every_hash(remote, tmp_path, caplog, damage, algorithm):
    _corrupt_remote_object_is_skipped_on_autoresume(remote, tmp_path, caplog, damage, algorithm)


@pytest.mark.parametrize("remote", ["gs", "az"], indirect=True)
@pytest.mark.parametrize("damage", ["flipped", "deleted"])
def test_corrupt_remote_object_is_skipped_on_autoresume(remote, tmp_path, caplog, damage):
    _corrupt_remote_object_is_skipped_on_autoresume(remote, tmp_path, caplog, damage)


@pytest.mark.parametrize("remote", ["gs", "az", "oci"], indirect=True)
def test_save_prunes_by_retention_and_autoresumes(remote, tmp_path):
    """S3 has the same, with the order of the puts checked, in the first test of this file."""
    url = remote.folder("run")
    reference = make_trainer("6ba", Checkpointer(None))
    reference.fit()
    make_trainer("4ba", Checkpointer(url, save_interval="2ba", keep_last_n=1, async_save=True,
                                     local_cache_dir=str(tmp_path / "cache"))).fit()
    assert remote.keys() == ["run/ep0-ba4/.metadata", "run/ep0-ba4/__0_0.distcp", "run/ep0-ba4/extra/rank0.pt",
                             "run/ep0-ba4/manifest.json", "run/latest"]  # ep0-ba2 pruned once ep0-ba4 committed
    assert remote.raw.get_bytes("run/latest").decode().strip() == "ep0-ba4"
    assert not (tmp_path / "cache" / "staging" / "ep0-ba4").exists()
    resumed = make_trainer("6ba", Checkpointer(url, save_interval="2ba", autoresume=True,
                                               local_cache_dir=str(tmp_path / "cache2")))
    assert resumed.state.timestamp.batch == 4
    resumed.fit()
    for a, b in zip(reference.state.model.parameters(), resumed.state.model.parameters()):
        assert torch.equal(a, b)


#: the issue's 30 s outage on S3; 5 s on the emulators, which go through the same retry policy
BROWN_OUT_S = {"s3": 30.0, "gs": 5.0, "az": 5.0}


def test_a_brown_out_during_a_save_is_ridden_out_with_nothing_corrupt(remote, fault_proxy, tmp_path):
    """Issue 21: the store answers 503 to everything for a while during a save. Under smalti-storage's default
    retry policy the save waits it out and commits a checkpoint that verifies, and the global ``random`` and
    torch RNG states end as a run without the outage leaves them (retry jitter has its own generator).

    On S3 the outage lasts the issue's 30 s; on the emulators 5 s (the same retry policy serves every
    backend), to keep the suite fast. That the default budget (120 s) rides out a 60 s brown-out is shown by
    smalti-storage's own test
    ``packages/storage/tests/test_retry.py::test_default_budget_rides_out_a_60s_brown_out``.
    """
    proxy = fault_proxy(remote.upstream)
    remote.route(proxy.url)

    def run(name: str, outage: bool) -> tuple[Trainer, Any, torch.Tensor, float]:
        trainer = make_trainer("2ba", Checkpointer(remote.folder(name), save_interval="2ba",
                                                   local_cache_dir=str(tmp_path / name)))
        random.seed(1234)
        if outage:
            proxy.brown_out(BROWN_OUT_S[remote.kind], min_failures=3)  # however slow the machine, the save meets it
        start = time.monotonic()
        trainer.fit()
        return trainer, random.getstate(), torch.get_rng_state(), time.monotonic() - start

    calm, calm_random, calm_torch, _ = run("calm", outage=False)
    assert not proxy.failed()
    stormy, stormy_random, stormy_torch, elapsed = run("stormy", outage=True)
    assert len(proxy.failed()) >= 3 and elapsed >= BROWN_OUT_S[remote.kind] * 0.9  # it met the outage and waited it out
    assert stormy_random == calm_random and torch.equal(stormy_torch, calm_torch)
    assert [k.split("/", 1)[1] for k in remote.keys("stormy/")] == [k.split("/", 1)[1] for k in remote.keys("calm/")]
    with make_trainer("2ba", Checkpointer(remote.folder("stormy"), autoresume=True, verify="full",
                                          local_cache_dir=str(tmp_path / "check"))) as resumed:
        assert resumed.state.timestamp.batch == 2
        for a, b in zip(calm.state.model.parameters(), resumed.state.model.parameters()):
            assert torch.equal(a, b)


def test_large_files_upload_in_parts_and_a_failed_part_is_retried(faulty_s3, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/big"
    faulty_s3.fail("PUT", "partNumber=2", times=1, status=500)  # one UploadPart fails once
    trainer = make_trainer("2ba", Checkpointer(url, save_interval="2ba", s3_multipart_mb=5,
                                               local_cache_dir=str(tmp_path / "c")),
                           model=MLPRegressor(hidden=1024, depth=3))
    assert sum(p.numel() * 4 for p in trainer.state.model.parameters()) >= 6 << 20
    trainer.fit()
    shard = [(m, p.split("?")[1] if "?" in p else "", s) for m, p, s in faulty_s3.requests if "/big/ep0-ba2/__0_0.distcp" in p]
    assert ("POST", "uploads", 200) in [(m, q.split("=")[0], s) for m, q, s in shard]  # CreateMultipartUpload
    parts = [(q, s) for m, q, s in shard if m == "PUT" and "partNumber=" in q]
    assert len({q for q, _ in parts}) >= 3  # a ~25 MB file in 5 MiB parts
    failed = [q for q, s in parts if s == 500]
    assert len(failed) == 1 and "partNumber=2" in failed[0] and (failed[0], 200) in parts  # retried
    assert any(m == "POST" and "uploadId=" in q and s == 200 for m, q, s in shard)  # CompleteMultipartUpload
    with make_trainer("2ba", Checkpointer(url, autoresume=True, local_cache_dir=str(tmp_path / "d")),
                      model=MLPRegressor(hidden=1024, depth=3)) as resumed:
        assert resumed.state.timestamp.batch == 2
        for a, b in zip(trainer.state.model.parameters(), resumed.state.model.parameters()):
            assert torch.equal(a, b)


def test_load_path_on_s3(s3_bucket, s3_server, tmp_path):
    url = f"s3://{s3_bucket}/src"
    at2 = make_trainer("2ba", Checkpointer(None))
    at2.fit()
    make_trainer("4ba", Checkpointer(url, save_interval="2ba", local_cache_dir=str(tmp_path / "c"))).fit()
    with make_trainer("6ba", Checkpointer(load_path=f"{url}/ep0-ba2", local_cache_dir=str(tmp_path / "d"))) as loaded:
        assert loaded.state.timestamp.batch == 2
        for a, b in zip(at2.state.model.parameters(), loaded.state.model.parameters()):
            assert torch.equal(a, b)
    with make_trainer("6ba", Checkpointer(load_path=url + "/", local_cache_dir=str(tmp_path / "e"))) as newest:
        assert newest.state.timestamp.batch == 4  # a save folder: its newest committed checkpoint
