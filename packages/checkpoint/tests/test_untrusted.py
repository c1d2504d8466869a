"""A checkpoint from elsewhere runs no code: crafted pickles (DCP's ``.metadata``, a rank's ``extra`` file, an
object record inside a ``*.distcp`` file), with the manifest rewritten to match, are refused by every path
that reads them (``inspect``, ``--verify full``, ``load_path``, autoresume) unless the user trusts the
checkpoint; older checkpoints still load."""

import dataclasses
import functools
import io
import pickle
import shutil

import pytest
import torch

from smalti.checkpoint import Checkpointer, UnsafeCheckpointError
from smalti.checkpoint.cli import main as cli_main
from smalti.checkpoint.safe_load import from_safe_tree, read_dcp_metadata
from smalti.core import Trainer
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.testing.hostile_checkpoints import RunsCode, craft_metadata, reseal


def make_trainer(duration, checkpointer=None):
    torch.manual_seed(0)
    return Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(96), 16, seed=5), duration,
                   optimizers=functools.partial(torch.optim.AdamW, lr=1e-2),
                   callbacks={"checkpoint": checkpointer} if checkpointer else None)


def craft_extra(folder, marker):
    path = folder / "extra" / "rank0.pt"
    extra = torch.load(path, weights_only=True)
    extra["note"] = RunsCode(marker)
    torch.save(extra, path)
    return "extra/rank0.pt"


def craft_distcp(folder, marker):
    """Point the optimizer's ``lr`` record at a pickle appended to the data file (``.metadata`` stays plain)."""
    metadata = read_dcp_metadata(folder / ".metadata")
    index = next(i for i in metadata.storage_data if i.fqn == "optim.param_groups.0.lr")
    info = metadata.storage_data[index]
    record = io.BytesIO()
    torch.save(RunsCode(marker, 0.01), record)
    data = folder / info.relative_path
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(record.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(record.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return info.relative_path


CRAFT = {"metadata": craft_metadata, "extra": craft_extra, "distcp": craft_distcp}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved") / "run"
    make_trainer("4ba", Checkpointer(str(folder), save_interval="2ba")).fit()
    return folder


@pytest.fixture
def crafted(saved, tmp_path, request):
    """A copy of the run whose newest checkpoint (ep0-ba4) holds the crafted file; ``(run, file, marker)``."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    marker = tmp_path / "code-ran"
    bad = CRAFT[request.param](run / "ep0-ba4", marker)
    reseal(run / "ep0-ba4")
    return run, bad, marker


def assert_refused(error_text, bad, marker):
    assert bad in error_text and "builtins.eval" in error_text and "trust_pickles" in error_text, error_text
    assert not marker.exists()


@pytest.mark.parametrize("crafted", list(CRAFT), indirect=True)
def test_inspect_and_verify_full_refuse_a_crafted_pickle_and_run_nothing(crafted, capsys):
    run, bad, marker = crafted
    status = cli_main(["inspect", str(run / "ep0-ba4")])
    if bad == ".metadata":  # the entries listing reads DCP's metadata
        assert status == 1
        assert_refused(capsys.readouterr().err, bad, marker)
    assert not marker.exists()
    assert cli_main(["inspect", str(run / "ep0-ba4"), "--verify", "full"]) == 1
    assert_refused(capsys.readouterr().err, bad, marker)
    assert cli_main(["export", str(run / "ep0-ba4"), str(run / "m.safetensors"), "--verify", "full"]) == 1
    assert not marker.exists()


@pytest.mark.parametrize("crafted", list(CRAFT), indirect=True)
def test_load_path_and_autoresume_refuse_a_crafted_pickle_and_run_nothing(crafted):
    run, bad, marker = crafted
    with pytest.raises(UnsafeCheckpointError) as err:
        make_trainer("6ba", Checkpointer(load_path=str(run / "ep0-ba4")))
    assert_refused(str(err.value), bad, marker)
    assert err.value.wanted == ["builtins.eval"]
    # autoresume does not pass over it to the older checkpoint either: someone planted it, the user must know
    with pytest.raises(UnsafeCheckpointError) as err:
        make_trainer("6ba", Checkpointer(str(run), autoresume=True))
    assert_refused(str(err.value), bad, marker)
    with pytest.raises(UnsafeCheckpointError):
        make_trainer("6ba", Checkpointer(str(run), autoresume=True, verify="full"))
    assert not marker.exists()


@pytest.mark.parametrize("crafted", list(CRAFT), indirect=True)
def test_with_the_trust_switch_the_crafted_pickle_is_read(crafted, capsys):
    """The crafted files really would run code: the switch lets them (so the refusals above are the guard)."""
    run, bad, marker = crafted
    assert cli_main(["inspect", str(run / "ep0-ba4"), "--verify", "full", "--trust-pickles"]) == 0, capsys.readouterr().err
    assert marker.exists()
    marker.unlink()
    with make_trainer("6ba", Checkpointer(load_path=str(run / "ep0-ba4"), trust_pickles=True)) as loaded:
        assert loaded.state.timestamp.batch == 4
    assert marker.exists()


def test_a_checkpoint_written_before_the_change_loads_with_the_switch(saved, tmp_path):
    """Before, ``extra/rank<r>.pt`` held the NumPy RNG state as pickled arrays and the manifest had no seal."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    for name in ("ep0-ba2", "ep0-ba4"):
        path = run / name / "extra" / "rank0.pt"
        torch.save(from_safe_tree(torch.load(path, weights_only=True)), path)  # what the old writer wrote
        reseal(run / name, legacy=True)
    with pytest.raises(UnsafeCheckpointError, match=r"rank0\.pt.*numpy.*trust_pickles"):
        make_trainer("6ba", Checkpointer(load_path=str(run / "ep0-ba4")))
    reference = make_trainer("6ba")
    reference.fit()
    # its .metadata is read as it is; its rank file needs the switch
    resumed = make_trainer("6ba", Checkpointer(str(run), autoresume=True, trust_pickles=True, save_interval="2ba"))
    assert resumed.state.timestamp.batch == 4
    resumed.fit()
    for a, b in zip(reference.state.model.parameters(), resumed.state.model.parameters()):
        assert torch.equal(a, b)  # RNG, schedule and data position came back exactly


def test_the_rank_file_holds_no_pickled_classes_and_resumes_exactly(saved, tmp_path):
    extra = torch.load(saved / "ep0-ba4" / "extra" / "rank0.pt", weights_only=True)  # no allow-list needed
    assert torch.serialization.get_unsafe_globals_in_checkpoint(saved / "ep0-ba4" / "extra" / "rank0.pt") == []
    state = from_safe_tree(extra)
    assert state["rng"]["numpy"][1].dtype.name == "uint32" and len(state["rng"]["numpy"][1]) == 624


@pytest.mark.parametrize("async_save", [False, True])
def test_state_that_only_full_unpickling_could_read_back_fails_the_save_naming_its_class(tmp_path, async_save):
    """An async save checks the captured bytes in the background: that save fails (when the run next waits for
    it, at the latest at fit end) and is never committed."""
    from fractions import Fraction

    from smalti.checkpoint import CheckpointError
    from smalti.core import Callback

    class KeepsAnObject(Callback):
        def plugin_state_dict(self):
            return {"thing": Fraction(1, 3)}  # pickles as a class that the weights-only loader refuses

    trainer = Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(96), 16, seed=5), "2ba",
                      optimizers=functools.partial(torch.optim.AdamW, lr=1e-2),
                      callbacks={"checkpoint": Checkpointer(str(tmp_path), save_interval="2ba", async_save=async_save),
                                 "opaque": KeepsAnObject()})
    with pytest.raises(CheckpointError, match=r"fractions\.Fraction.*plugin_state_dict"):
        trainer.fit()
    assert not (tmp_path / "ep0-ba2" / "manifest.json").exists()


def _build_on_global(module, name, state):
    """A pickle that names an allowed global and sets attributes on it with BUILD, then ends in a real Metadata
    (so only the BUILD is wrong): protocol 2 opcodes written by hand."""
    meta = pickle.dumps(read_dcp_metadata_default(), protocol=2)[2:-1]  # the Metadata, without PROTO and STOP
    return (b"\x80\x02" + pickle.GLOBAL + f"{module}\n{name}\n".encode() + pickle.dumps(state, protocol=2)[2:-1]
            + pickle.BUILD + pickle.POP + meta + pickle.STOP)


def read_dcp_metadata_default():
    from torch.distributed.checkpoint.metadata import Metadata

    return Metadata(state_dict_metadata={})


BUILD_ATTACKS = {
    # a class attribute every later path gets
    "class attribute": ("pathlib", "PurePosixPath", (None, {"owned_by_ckpt": True})),
    # the layout cache torch.load(weights_only=True) reads: torch.strided would come back as a string
    "function state": ("torch.serialization", "_get_layout", {"cache": {"torch.strided": "pwned"}}),
    # an unhashable MetadataIndex breaks every later checkpoint load in the process
    "dunder on a class": ("torch.distributed.checkpoint.metadata", "MetadataIndex", (None, {"__hash__": None})),
}


@pytest.mark.parametrize("attack", list(BUILD_ATTACKS))
def test_a_metadata_pickle_cannot_set_attributes_on_allowed_classes_or_functions(tmp_path, saved, attack):
    import pathlib

    from torch.distributed.checkpoint.metadata import MetadataIndex

    module, name, state = BUILD_ATTACKS[attack]
    path = tmp_path / ".metadata"
    path.write_bytes(_build_on_global(module, name, state))
    layout_cache = dict(torch.serialization._get_layout.cache)
    with pytest.raises(UnsafeCheckpointError, match=rf"{path}.*BUILD \(setting attributes\) on {name}"):
        read_dcp_metadata(path)
    # the process is as it was: nothing the file said reached the class, the function or the cache
    assert not hasattr(pathlib.PurePosixPath, "owned_by_ckpt")
    assert torch.serialization._get_layout.cache == layout_cache
    assert hash(MetadataIndex("w")) == hash(MetadataIndex("w"))
    buffer = io.BytesIO()
    torch.save(torch.ones(2), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True).layout is torch.strided
    # and real metadata still reads, dataclass BUILDs included
    assert read_dcp_metadata(saved / "ep0-ba4" / ".metadata").state_dict_metadata
