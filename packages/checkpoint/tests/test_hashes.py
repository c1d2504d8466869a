"""``checkpoint.hash``: the manifest records every file's digest with its algorithm (xxh3_128, blake3, sha256),
checkpoints written before (``sha256`` fields, format 2) still load and verify, the CLI names the algorithm,
and the setting is checked at start and reaches Hydra's ``checkpoint=dcp``."""

import functools
import hashlib
import json
import logging
import sys

import pytest
import torch

from smalti.checkpoint import CheckpointCorruptError, Checkpointer, CheckpointError
from smalti.checkpoint.cli import main as cli_main
from smalti.checkpoint.hashes import ALGORITHMS
from smalti.checkpoint.manifest import seal
from smalti.core import Trainer
from smalti.core.data import build_dataloader
from smalti.core.errors import ConfigError
from smalti.core.examples import MLPRegressor, SyntheticRegression


def make_trainer(duration, checkpointer=None):
    torch.manual_seed(0)
    return Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(96), 16, seed=5), duration,
                   optimizers=functools.partial(torch.optim.AdamW, lr=1e-2),
                   callbacks={"checkpoint": checkpointer} if checkpointer else None)


def reference_digest(algorithm, data):
    """The digest by the algorithm's own package, over the whole bytes at once."""
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128(data).hexdigest()
    if algorithm == "blake3":
        import blake3

        return blake3.blake3(data).hexdigest()
    return hashlib.sha256(data).hexdigest()


def flip(path, at=None):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_manifest_records_every_files_digest_with_its_algorithm(tmp_path, algorithm):
    make_trainer("2ba", Checkpointer(str(tmp_path), save_interval="2ba", hash=algorithm)).fit()
    folder = tmp_path / "ep0-ba2"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format"] == "smalti-checkpoint/3"
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "extra/rank0.pt"}
    for rel, entry in manifest["files"].items():
        data = (folder / rel).read_bytes()
        assert entry == {"size": len(data), "hash": f"{algorithm}:{reference_digest(algorithm, data)}"}, rel


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_inspect_names_the_algorithm_it_verified_with(tmp_path, capsys, algorithm):
    make_trainer("2ba", Checkpointer(str(tmp_path), save_interval="2ba", hash=algorithm)).fit()
    folder = tmp_path / "ep0-ba2"
    assert cli_main(["inspect", str(folder), "--verify", "full"]) == 0
    out = capsys.readouterr().out
    assert f"verified (full): ok, sizes and {algorithm} digests of every file match the manifest" in out
    assert f"B  {algorithm} " in out  # every file's line names its algorithm
    flip(folder / "__0_0.distcp")
    assert cli_main(["inspect", str(folder), "--verify", "full"]) == 1
    err = capsys.readouterr().err
    assert f"{folder / '__0_0.distcp'} has {algorithm} " in err


def as_format_2(folder):
    """Rewrite a checkpoint's manifest as smalti-checkpoint/2 wrote it: ``{"size", "sha256"}`` per file."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.pop("manifest_sha256")
    manifest["format"] = "smalti-checkpoint/2"
    manifest["files"] = {rel: {"size": entry["size"], "sha256": hashlib.sha256((folder / rel).read_bytes()).hexdigest()}
                         for rel, entry in manifest["files"].items()}
    (folder / "manifest.json").write_text(json.dumps(seal(manifest), indent=1, sort_keys=True))


def test_a_checkpoint_with_sha256_fields_from_before_format_3_loads_and_verifies(tmp_path, caplog, capsys):
    make_trainer("4ba", Checkpointer(str(tmp_path), save_interval="2ba")).fit()
    for name in ("ep0-ba2", "ep0-ba4"):
        as_format_2(tmp_path / name)
    at_batch_4 = make_trainer("4ba")
    at_batch_4.fit()
    with make_trainer("6ba", Checkpointer(str(tmp_path), save_interval=None, save_on_fit_end=False,
                                          autoresume=True)) as resumed:
        assert resumed.state.timestamp.batch == 4
        for a, b in zip(at_batch_4.state.model.parameters(), resumed.state.model.parameters()):
            assert torch.equal(a, b)
    assert cli_main(["inspect", str(tmp_path / "ep0-ba4"), "--verify", "full"]) == 0
    assert "sizes and sha256 digests" in capsys.readouterr().out
    flip(tmp_path / "ep0-ba4" / "__0_0.distcp")  # still caught, by the sha256 the old manifest records
    loader = Checkpointer(str(tmp_path), save_interval=None, save_on_fit_end=False, autoresume=True)
    with caplog.at_level(logging.ERROR, logger="smalti.checkpoint"), make_trainer("6ba", loader) as fallback:
        assert fallback.state.timestamp.batch == 2
    assert f"{tmp_path / 'ep0-ba4' / '__0_0.distcp'} has sha256 " in caplog.text


def test_an_entry_without_a_valid_digest_makes_the_manifest_invalid(tmp_path):
    make_trainer("2ba", Checkpointer(str(tmp_path), save_interval="2ba")).fit()
    folder = tmp_path / "ep0-ba2"
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.pop("manifest_sha256")
    manifest["files"]["__0_0.distcp"]["hash"] = "md5:" + "0" * 32  # an algorithm nobody wrote: not a digest
    (folder / "manifest.json").write_text(json.dumps(seal(manifest)))
    with pytest.raises(CheckpointCorruptError, match=r"no valid size and hash for '__0_0\.distcp'.*md5"):
        make_trainer("4ba", Checkpointer(load_path=str(folder)))


def test_the_hash_setting_is_checked_at_start(monkeypatch):
    with pytest.raises(ConfigError, match=r"checkpoint\.hash='md5' .*xxh3_128, blake3, sha256"):
        Checkpointer(hash="md5")
    monkeypatch.setitem(sys.modules, "blake3", None)  # as if the extra were not installed
    with pytest.raises(ConfigError, match=r"pip install 'smalti-checkpoint\[blake3\]'"):
        Checkpointer(hash="blake3")


def test_a_blake3_checkpoint_where_blake3_is_missing_fails_naming_the_fix_and_is_not_passed_over(tmp_path, monkeypatch):
    make_trainer("4ba", Checkpointer(str(tmp_path), save_interval="2ba", hash="blake3")).fit()
    monkeypatch.setitem(sys.modules, "blake3", None)
    with pytest.raises(CheckpointError, match=r"pip install 'smalti-checkpoint\[blake3\]'") as err:
        make_trainer("6ba", Checkpointer(str(tmp_path), save_interval="2ba", autoresume=True))
    assert not isinstance(err.value, CheckpointCorruptError)  # the checkpoint is fine: no silent fallback


def _compose(overrides):
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from smalti.core.config.build import build
    from smalti.core.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module("smalti.core.conf", version_base="1.3"):
        cfg = compose("train", overrides=["checkpoint=dcp", "run_name=hashes", *overrides])
    GlobalHydra.instance().clear()
    return cfg.checkpoint, build(cfg.checkpoint, "checkpoint")


def test_checkpoint_dcp_carries_the_hash_key(tmp_path):
    cfg, checkpointer = _compose([f"checkpoint.save_folder={tmp_path}"])
    assert cfg.hash == "xxh3_128" and checkpointer.hash == "xxh3_128"
    cfg, checkpointer = _compose([f"checkpoint.save_folder={tmp_path}", "checkpoint.hash=blake3"])
    assert checkpointer.hash == "blake3"
