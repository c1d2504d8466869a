"""One flipped byte in any kind of checkpoint file (DCP's ``.metadata``, a rank's ``extra`` file, a ``*.distcp``
data file, the manifest itself) is caught, whichever hash the manifest records (``checkpoint.hash``):
``load_path`` naming that checkpoint fails naming the file, and autoresume reports it and resumes from the
previous committed checkpoint, as if the damaged one were absent."""

import functools
import json
import logging
import shutil

import pytest
import torch

from smalti.checkpoint import CheckpointCorruptError, Checkpointer
from smalti.checkpoint.hashes import ALGORITHMS
from smalti.core import Trainer
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression


def make_trainer(duration, checkpointer=None):
    torch.manual_seed(0)
    return Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(96), 16, seed=5), duration,
                   optimizers=functools.partial(torch.optim.AdamW, lr=1e-2),
                   callbacks={"checkpoint": checkpointer} if checkpointer else None)


def flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def flip_in_manifest(path):
    """A digit of ``created_unix``: the manifest stays valid JSON and every file still matches it, so only the
    manifest's own seal can tell."""
    text = path.read_text()
    at = text.index('"created_unix": ') + len('"created_unix": ') + 2
    flip(path, at)
    json.loads(path.read_text())


def flip_in_metadata(path):
    """A character of the save id: the pickle still reads, so only the manifest's digest can tell."""
    from smalti.checkpoint.safe_load import read_dcp_metadata

    save_id = read_dcp_metadata(path).storage_meta.save_id
    flip(path, path.read_bytes().index(save_id.encode()) + 3)
    assert read_dcp_metadata(path).storage_meta.save_id != save_id


FILES = {  # kind: (file in the checkpoint, how its byte is flipped)
    "metadata": (".metadata", flip_in_metadata),
    "extra": ("extra/rank0.pt", lambda p: flip(p, p.stat().st_size // 2)),
    "distcp": ("__0_0.distcp", lambda p: flip(p, p.stat().st_size // 2)),
    "manifest": ("manifest.json", flip_in_manifest),
}


@pytest.fixture(scope="module", params=ALGORITHMS)
def saved(tmp_path_factory, request):
    """A run saved at batches 2 and 4 with each hash algorithm in turn, and the weights at batch 2."""
    folder = tmp_path_factory.mktemp("saved") / "run"
    make_trainer("4ba", Checkpointer(str(folder), save_interval="2ba", hash=request.param)).fit()
    manifest = json.loads((folder / "ep0-ba4" / "manifest.json").read_text())
    assert {entry["hash"].partition(":")[0] for entry in manifest["files"].values()} == {request.param}
    at_batch_2 = make_trainer("2ba")
    at_batch_2.fit()
    return folder, {k: v.clone() for k, v in at_batch_2.state.model.state_dict().items()}


@pytest.fixture
def damaged(saved, tmp_path, request):
    """A copy of the run whose newest checkpoint (ep0-ba4) has one flipped byte in a file of the given kind."""
    folder, weights_at_2 = saved
    run = tmp_path / "run"
    shutil.copytree(folder, run)
    rel, damage = FILES[request.param]
    damage(run / "ep0-ba4" / rel)
    return run, run / "ep0-ba4" / rel, weights_at_2


@pytest.mark.parametrize("damaged", list(FILES), indirect=True)
def test_a_flipped_byte_fails_a_load_path_naming_the_file(damaged):
    run, bad, _ = damaged
    with pytest.raises(CheckpointCorruptError) as err:
        make_trainer("6ba", Checkpointer(load_path=str(run / "ep0-ba4")))
    assert err.value.path == str(bad) and str(bad) in str(err.value)


@pytest.mark.parametrize("damaged", list(FILES), indirect=True)
def test_a_flipped_byte_makes_autoresume_take_the_previous_checkpoint(damaged, caplog):
    run, bad, weights_at_2 = damaged
    with caplog.at_level(logging.ERROR, logger="smalti.checkpoint"):
        resumed = make_trainer("6ba", Checkpointer(str(run), save_interval="2ba", autoresume=True))
    assert resumed.state.timestamp.batch == 2
    for name, value in resumed.state.model.state_dict().items():
        assert torch.equal(value, weights_at_2[name]), name
    assert str(bad) in caplog.text
    resumed.close()
