"""Checkpoints on a real S3 endpoint (moto's server on loopback), reached through a fault-injecting proxy."""

import functools
import json

import pytest
import torch

from smalti.checkpoint import Checkpointer, CheckpointError, CheckpointUploadError
from smalti.core import Trainer
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression


def make_trainer(duration, checkpointer, model=None):
    torch.manual_seed(0)
    return Trainer(model or MLPRegressor(), build_dataloader(SyntheticRegression(96), 16, seed=5), duration,
                   optimizers=functools.partial(torch.optim.AdamW, lr=1e-2), callbacks={"checkpoint": checkpointer})


def keys(s3_server, bucket):
    listing = s3_server.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    return sorted(obj["Key"] for obj in listing)


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
    make_trainer("2ba", Checkpointer(url, save_interval="2ba", keep_last_n=1, s3_retries=2,
                                     local_cache_dir=str(tmp_path / "c"))).fit()
    faulty_s3.fail("PUT", "/ep0-ba4/__0_0.distcp")  # every attempt fails
    trainer = make_trainer("4ba", Checkpointer(url, save_interval="2ba", keep_last_n=1, autoresume=True, s3_retries=2,
                                               local_cache_dir=str(tmp_path / "c")))
    with pytest.raises(CheckpointError, match=r"ep0-ba4/__0_0\.distcp.*after 2 attempts"):
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
    with pytest.raises(CheckpointUploadError, match=rf"ep0-ba4/{failing}.*after 2 attempts"):
        make_trainer("6ba", Checkpointer(url, save_interval="2ba", autoresume=True, s3_retries=2,
                                         local_cache_dir=str(tmp_path / "d")))
    faulty_s3.clear()
    with make_trainer("6ba", Checkpointer(url, autoresume=True, local_cache_dir=str(tmp_path / "d"))) as resumed:
        assert resumed.state.timestamp.batch == 4  # the checkpoint was fine all along


@pytest.mark.parametrize("damage", ["flipped", "deleted"])
def test_corrupt_remote_object_is_skipped_on_autoresume(s3_server, s3_bucket, tmp_path, caplog, damage):
    url = f"s3://{s3_bucket}/run"
    make_trainer("4ba", Checkpointer(url, save_interval="2ba", local_cache_dir=str(tmp_path / "c"))).fit()
    client = s3_server.client()
    if damage == "deleted":
        client.delete_object(Bucket=s3_bucket, Key="run/ep0-ba4/__0_0.distcp")
        with make_trainer("6ba", Checkpointer(url, autoresume=True, local_cache_dir=str(tmp_path / "d"))) as resumed:
            assert resumed.state.timestamp.batch == 2
        assert "ep0-ba4/__0_0.distcp" in caplog.text and "missing" in caplog.text
        return
    body = bytearray(client.get_object(Bucket=s3_bucket, Key="run/ep0-ba4/__0_0.distcp")["Body"].read())
    body[100] ^= 0xFF
    client.put_object(Bucket=s3_bucket, Key="run/ep0-ba4/__0_0.distcp", Body=bytes(body))
    manifest = json.loads(client.get_object(Bucket=s3_bucket, Key="run/ep0-ba4/manifest.json")["Body"].read())
    assert manifest["files"]["__0_0.distcp"]["size"] == len(body)
    with make_trainer("6ba", Checkpointer(url, autoresume=True, local_cache_dir=str(tmp_path / "d"))) as resumed:
        assert resumed.state.timestamp.batch == 2
    assert "ep0-ba4/__0_0.distcp" in caplog.text and "sha256" in caplog.text


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
