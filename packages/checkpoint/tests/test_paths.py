"""File names read from a checkpoint (manifest entries, DCP metadata's file names) never leave its folder: a
crafted name is refused naming the file and the entry, locally and when a checkpoint is fetched from S3."""

import dataclasses
import functools
import json
import logging
import pickle
import shutil

import pytest
import torch

from smalti.checkpoint import Checkpointer, UnsafePathError
from smalti.checkpoint.manifest import hash_file, seal
from smalti.checkpoint.resume import default_cache_dir
from smalti.checkpoint.safe_load import read_dcp_metadata
from smalti.core import Trainer
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression


def make_trainer(duration, checkpointer=None):
    torch.manual_seed(0)
    return Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(96), 16, seed=5), duration,
                   optimizers=functools.partial(torch.optim.AdamW, lr=1e-2),
                   callbacks={"checkpoint": checkpointer} if checkpointer else None)


def with_entry(manifest, rel, payload):
    """``manifest`` listing one more file, ``rel``, with the size and sha256 of ``payload`` (and resealed)."""
    import hashlib

    manifest = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    manifest["files"] = {**manifest["files"], rel: {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}}
    return seal(manifest)


PAYLOAD = b"written where it must not be"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved") / "run"
    make_trainer("4ba", Checkpointer(str(folder), save_interval="2ba")).fit()
    return folder


def _escaping_names(root):
    return {"parent": "../outside.bin", "deeper": "extra/../../outside.bin", "absolute": str(root / "outside.bin"),
            "backslash": "extra\\..\\..\\outside.bin", "drive": "C:/outside.bin"}


@pytest.mark.parametrize("kind", ["parent", "deeper", "absolute", "backslash", "drive"])
def test_a_manifest_entry_leaving_the_folder_is_refused_locally(saved, tmp_path, kind, caplog):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    rel = _escaping_names(run)[kind]
    (run / "outside.bin").write_bytes(PAYLOAD)  # what ep0-ba4/../outside.bin (and the absolute name) reaches
    manifest_path = run / "ep0-ba4" / "manifest.json"
    manifest_path.write_text(json.dumps(with_entry(json.loads(manifest_path.read_text()), rel, PAYLOAD)))
    with pytest.raises(UnsafePathError) as err:
        make_trainer("6ba", Checkpointer(load_path=str(run / "ep0-ba4")))
    assert str(manifest_path) in str(err.value) and repr(rel) in str(err.value)
    with (caplog.at_level(logging.ERROR, logger="smalti.checkpoint"),
          make_trainer("6ba", Checkpointer(str(run), autoresume=True)) as resumed):
        assert resumed.state.timestamp.batch == 2  # not a checkpoint: the previous one is used
    assert repr(rel) in caplog.text
    assert (run / "outside.bin").read_bytes() == PAYLOAD


def test_dcp_metadata_naming_a_file_outside_the_folder_is_refused(saved, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    folder = run / "ep0-ba4"
    shutil.copy(folder / "__0_0.distcp", run / "outside.distcp")  # a load that followed the name would succeed
    metadata = read_dcp_metadata(folder / ".metadata")
    metadata.storage_data = {index: dataclasses.replace(info, relative_path="../outside.distcp")
                             for index, info in metadata.storage_data.items()}
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest = json.loads((folder / "manifest.json").read_text())
    size, sha = hash_file(folder / ".metadata")
    manifest["files"][".metadata"] = {"size": size, "sha256": sha}
    manifest.pop("manifest_sha256")
    (folder / "manifest.json").write_text(json.dumps(seal(manifest)))
    with pytest.raises(UnsafePathError, match=r"\.metadata refers to the file name '\.\./outside\.distcp'"):
        make_trainer("6ba", Checkpointer(load_path=str(folder)))


@pytest.mark.parametrize("kind", ["parent", "absolute"])
def test_a_manifest_entry_leaving_the_folder_is_refused_when_fetched_from_s3(s3_server, s3_bucket, tmp_path, kind,
                                                                              caplog):
    url = f"s3://{s3_bucket}/run"
    make_trainer("4ba", Checkpointer(url, save_interval="2ba", local_cache_dir=str(tmp_path / "c"))).fit()
    cache = tmp_path / "cache" / "deep"
    leaf = f"outside-{s3_bucket}.bin"
    rel = {"parent": f"../../{leaf}", "absolute": str(tmp_path / leaf)}[kind]
    # where a download would land: under the autoresume's cache, and under the default cache a load_path uses
    escaped = [(root / "ep0-ba4" / rel).resolve() for root in (cache, default_cache_dir(url))]
    for path in escaped:
        path.unlink(missing_ok=True)
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key=f"run/ep0-ba4/{rel}", Body=PAYLOAD)
    manifest = json.loads(client.get_object(Bucket=s3_bucket, Key="run/ep0-ba4/manifest.json")["Body"].read())
    client.put_object(Bucket=s3_bucket, Key="run/ep0-ba4/manifest.json",
                      Body=json.dumps(with_entry(manifest, rel, PAYLOAD)).encode())
    with pytest.raises(UnsafePathError) as err:
        make_trainer("6ba", Checkpointer(load_path=f"{url}/ep0-ba4", local_cache_dir=str(cache)))
    assert f"{url}/ep0-ba4/manifest.json" in str(err.value) and repr(rel) in str(err.value)
    assert not any(path.exists() for path in escaped)
    with (caplog.at_level(logging.ERROR, logger="smalti.checkpoint"),
          make_trainer("6ba", Checkpointer(url, autoresume=True, local_cache_dir=str(cache))) as resumed):
        assert resumed.state.timestamp.batch == 2
    assert repr(rel) in caplog.text
    assert not any(path.exists() for path in escaped)
    assert sorted(p.name for p in cache.iterdir()) == ["ep0-ba2"]  # nothing of the refused one was fetched
