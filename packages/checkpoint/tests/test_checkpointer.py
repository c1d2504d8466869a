"""Single-process save/load through the Checkpointer callback: resume, retention, partial loads, corruption, CLI."""

import functools
import json
import logging
import os
import signal
import time

import pytest
import torch

from smalti.checkpoint import CheckpointCorruptError, Checkpointer, CheckpointError
from smalti.checkpoint.cli import main as cli_main
from smalti.checkpoint.hashes import ALGORITHMS
from smalti.core import Algorithm, Callback, LoggerDestination, Trainer
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression


def make_trainer(duration, checkpointer=None, model=None, callbacks=None, loggers=None, optimizer=None):
    torch.manual_seed(0)
    plugins = dict(callbacks or {})
    if checkpointer is not None:
        plugins["checkpoint"] = checkpointer
    return Trainer(
        model or MLPRegressor(),
        build_dataloader(SyntheticRegression(96), 16, seed=5),  # 6 batches per epoch
        duration,
        optimizers=optimizer or functools.partial(torch.optim.AdamW, lr=1e-2),
        callbacks=plugins,
        loggers=loggers,
    )


def assert_same_training_state(a, b):
    for (name, pa), pb in zip(a.state.model.named_parameters(), b.state.model.parameters()):
        assert torch.equal(pa, pb), name
    sa, sb = a.state.optimizers[0].state_dict()["state"], b.state.optimizers[0].state_dict()["state"]
    for idx in sa:
        for key in sa[idx]:
            assert torch.equal(sa[idx][key], sb[idx][key]), (idx, key)
    assert a.state.timestamp.batch == b.state.timestamp.batch


class MetricsRecorder(LoggerDestination):
    def __init__(self):
        self.metrics = {}

    def log_metrics(self, metrics, step):
        for key, value in metrics.items():
            self.metrics.setdefault(key, []).append(value)


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, async_save):
    reference = make_trainer("10ba")
    reference.fit()
    make_trainer("4ba", Checkpointer(str(tmp_path), save_interval="2ba", async_save=async_save)).fit()
    recorder = MetricsRecorder()
    resumed = make_trainer("10ba", Checkpointer(str(tmp_path), save_interval="2ba", autoresume=True,
                                                async_save=async_save), loggers={"rec": recorder})
    assert resumed.state.timestamp.batch == 4  # across the epoch boundary at batch 6 below
    resumed.fit()
    assert_same_training_state(reference, resumed)
    assert (tmp_path / "latest").read_text().strip() == "ep1-ba10"
    assert recorder.metrics["checkpoint/blocked_s"] and recorder.metrics["checkpoint/save_s"]
    assert len(recorder.metrics["checkpoint/save_s"]) == 3  # ba6, ba8, ba10 committed


def test_manifest_lists_every_file_and_retention_keeps_policy(tmp_path):
    make_trainer("10ba", Checkpointer(str(tmp_path), save_interval="2ba", keep_last_n=2, keep_every_n=4)).fit()
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == ["ep0-ba4", "ep1-ba10", "ep1-ba8"]  # last two, plus multiples of 4 batches
    manifest = json.loads((tmp_path / "ep1-ba10" / "manifest.json").read_text())
    on_disk = {str(p.relative_to(tmp_path / "ep1-ba10")) for p in (tmp_path / "ep1-ba10").rglob("*") if p.is_file()}
    assert set(manifest["files"]) | {"manifest.json"} == on_disk
    for rel, entry in manifest["files"].items():
        assert (tmp_path / "ep1-ba10" / rel).stat().st_size == entry["size"]
    assert manifest["world_size"] == 1 and manifest["timestamp"]["batch"] == 10 and manifest["timestamp"]["epoch"] == 1


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path, at=None):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("damage", ["truncated_shard", "flipped_byte", "flipped_header_byte", "missing_manifest",
                                    "missing_rank_file"])
def test_autoresume_reports_a_bad_newest_checkpoint_and_uses_the_previous(tmp_path, caplog, damage, algorithm):
    make_trainer("4ba", Checkpointer(str(tmp_path), save_interval="2ba", hash=algorithm)).fit()
    at_batch_2 = make_trainer("2ba")
    at_batch_2.fit()
    newest = tmp_path / "ep0-ba4"
    data = newest / "__0_0.distcp"
    bad = {"missing_manifest": newest / "manifest.json", "missing_rank_file": newest / "extra" / "rank0.pt"}.get(damage, data)
    {"truncated_shard": _truncate, "flipped_byte": _flip,  # a tensor's bytes: loads, then fails its digest
     "flipped_header_byte": lambda p: _flip(p, at=10),  # a zip header: torch.load fails before the digest ends
     }.get(damage, os.remove)(bad)
    with caplog.at_level(logging.ERROR, logger="smalti.checkpoint"):
        resumed = make_trainer("6ba", Checkpointer(str(tmp_path), save_interval="2ba", autoresume=True))
    assert resumed.state.timestamp.batch == 2, caplog.text
    assert_same_training_state(at_batch_2, resumed)  # nothing of the damaged checkpoint is left in the state
    assert str(newest if damage == "missing_manifest" else bad) in caplog.text
    if damage == "flipped_byte":
        assert f"has {algorithm} " in caplog.text  # the message names the algorithm that caught it
    resumed.fit()
    assert (tmp_path / "ep0-ba4" / "manifest.json").is_file()  # re-saved and committed


def test_folder_without_manifest_is_never_loaded(tmp_path):
    make_trainer("2ba", Checkpointer(str(tmp_path), save_interval="2ba")).fit()
    os.remove(tmp_path / "ep0-ba2" / "manifest.json")
    with pytest.raises(CheckpointCorruptError, match="manifest.json"):
        make_trainer("4ba", Checkpointer(load_path=str(tmp_path / "ep0-ba2")))  # a failed __init__ closes itself
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        make_trainer("4ba", Checkpointer(load_path=str(tmp_path)))


def test_relaunch_into_a_folder_with_committed_checkpoints_fails_and_deletes_nothing(tmp_path):
    make_trainer("4ba", Checkpointer(str(tmp_path), save_interval="2ba")).fit()
    manifests = {n: (tmp_path / n / "manifest.json").read_bytes() for n in ("ep0-ba2", "ep0-ba4")}
    with pytest.raises(CheckpointError, match=r"ep0-ba2, ep0-ba4.*checkpoint\.autoresume=true.*checkpoint\.overwrite=true") as err:
        make_trainer("6ba", Checkpointer(str(tmp_path), save_interval="2ba"))
    assert f"save_folder={tmp_path}" in str(err.value)
    # loading an older checkpoint of the same folder would save over the newer one
    with pytest.raises(CheckpointError, match=r"loaded ep0-ba2.*\(ep0-ba4\)|\(ep0-ba4\).*loaded ep0-ba2"):
        make_trainer("6ba", Checkpointer(str(tmp_path), save_interval="2ba", load_path=str(tmp_path / "ep0-ba2")))
    for name, raw in manifests.items():
        assert (tmp_path / name / "manifest.json").read_bytes() == raw
    assert (tmp_path / "latest").read_text().strip() == "ep0-ba4"
    # loading the newest one and going on is fine
    with make_trainer("6ba", Checkpointer(str(tmp_path), save_interval="2ba", load_path=str(tmp_path))) as on:
        on.fit()
    assert (tmp_path / "latest").read_text().strip() == "ep0-ba6"


def test_uncommitted_leftover_of_the_same_name_is_replaced(tmp_path):
    (tmp_path / "ep0-ba2").mkdir()
    (tmp_path / "ep0-ba2" / "__0_0.distcp").write_bytes(b"half-written")
    make_trainer("2ba", Checkpointer(str(tmp_path), save_interval="2ba")).fit()
    manifest = json.loads((tmp_path / "ep0-ba2" / "manifest.json").read_text())
    assert manifest["files"]["__0_0.distcp"]["size"] == (tmp_path / "ep0-ba2" / "__0_0.distcp").stat().st_size > 12


def test_overwrite_replaces_the_earlier_run_and_autoresume_follows_the_new_one(tmp_path):
    make_trainer("4ba", Checkpointer(str(tmp_path), save_interval="2ba")).fit()  # earlier run: ep0-ba2, ep0-ba4
    torch.manual_seed(1)
    new = make_trainer("2ba", Checkpointer(str(tmp_path), save_interval="2ba", overwrite=True), model=MLPRegressor())
    new.fit()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["ep0-ba2"]  # the earlier ep0-ba4 is gone
    assert (tmp_path / "latest").read_text().strip() == "ep0-ba2"
    with make_trainer("4ba", Checkpointer(str(tmp_path), save_interval="2ba", autoresume=True)) as resumed:
        assert resumed.state.timestamp.batch == 2
        for a, b in zip(new.state.model.parameters(), resumed.state.model.parameters()):
            assert torch.equal(a, b)


def test_autoresume_fails_when_no_committed_checkpoint_verifies(tmp_path):
    make_trainer("4ba", Checkpointer(str(tmp_path), save_interval="2ba")).fit()
    _flip(tmp_path / "ep0-ba2" / "__0_0.distcp")
    _truncate(tmp_path / "ep0-ba4" / "__0_0.distcp")
    with pytest.raises(CheckpointCorruptError, match=r"none of them verifies.*ep0-ba4/__0_0\.distcp.*ep0-ba2/__0_0\.distcp"):
        make_trainer("6ba", Checkpointer(str(tmp_path), save_interval="2ba", autoresume=True))
    assert (tmp_path / "ep0-ba2" / "manifest.json").is_file() and (tmp_path / "ep0-ba4" / "manifest.json").is_file()


def test_weights_only_ignore_keys_and_strictness(tmp_path):
    saved = make_trainer("4ba", Checkpointer(str(tmp_path), save_interval="4ba"))
    saved.fit()
    weights = {k: v.clone() for k, v in saved.state.model.state_dict().items()}

    # Trainers that never fit are closed by hand, so their plugins leave the plugin manager.
    with make_trainer("1ba", Checkpointer(load_path=str(tmp_path), load_weights_only=True)) as only:
        assert only.state.timestamp.batch == 0 and not only.state.optimizers[0].state
        for key, value in only.state.model.state_dict().items():
            assert torch.equal(value, weights[key]), key

    with make_trainer("1ba", Checkpointer(load_path=str(tmp_path), load_weights_only=True,
                                          load_ignore_keys=["model.head.*"])) as partial:
        assert not torch.equal(partial.state.model.head.weight, weights["head.weight"])
        assert torch.equal(partial.state.model.blocks[0][0].weight, weights["blocks.0.0.weight"])

    with pytest.raises(CheckpointError, match=r"missing \['blocks.2.0.bias'"):
        make_trainer("1ba", Checkpointer(load_path=str(tmp_path), load_weights_only=True), model=MLPRegressor(depth=3))
    with make_trainer("1ba", Checkpointer(load_path=str(tmp_path), load_weights_only=True, load_strict=False),
                      model=MLPRegressor(depth=3)) as loose:
        assert torch.equal(loose.state.model.blocks[1][0].weight, weights["blocks.1.0.weight"])


def test_epoch_cadence_saves_at_each_epoch_end(tmp_path):
    make_trainer("14ba", Checkpointer(str(tmp_path), save_interval="1ep", save_on_fit_end=False)).fit()  # 6 batches an epoch
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["ep1-ba6", "ep2-ba12"]
    assert json.loads((tmp_path / "ep2-ba12" / "manifest.json").read_text())["timestamp"]["epoch"] == 2


class SlowSave(Checkpointer):
    """An async Checkpointer on a slow disk: staging blocks ``blocked_s`` and the commit takes ``commit_s``."""

    def __init__(self, *args, blocked_s=0.4, commit_s=0.4, **kwargs):
        super().__init__(*args, **kwargs)
        self.blocked_s, self.commit_s = blocked_s, commit_s

    def save(self, state, logger):
        time.sleep(self.blocked_s)
        super().save(state, logger)

    def _commit(self, *args):
        time.sleep(self.commit_s)
        return super()._commit(*args)


def test_step_time_while_a_save_is_in_flight_is_reported_without_the_blocked_time(tmp_path):
    recorder = MetricsRecorder()
    make_trainer("6ba", SlowSave(str(tmp_path), save_interval="2ba", async_save=True),
                 loggers={"rec": recorder}).fit()
    in_flight = recorder.metrics["checkpoint/step_time_in_flight_s"]
    # ba2's save is in flight during batches 3 and 4 (its commit takes 0.4 s), ba4's during 5 and 6
    assert len(in_flight) == 4, recorder.metrics.keys()
    assert max(in_flight) < 0.3  # a step's time excludes the save (>= 0.4 s blocked) that ran before it began
    normal, ratio = recorder.metrics["checkpoint/step_time_s"], recorder.metrics["checkpoint/step_time_in_flight_ratio"]
    assert len(normal) == len(ratio) == 4
    for step, base, r in zip(in_flight, normal, ratio):
        assert base > 0 and r == pytest.approx(step / base)


class SendSignal(Callback):
    def on_batch_end(self, state):
        if state.timestamp.batch == 3:
            os.kill(os.getpid(), signal.SIGUSR1)


def test_signal_saves_then_stops(tmp_path):
    previous = signal.getsignal(signal.SIGUSR1)
    trainer = make_trainer("20ba", Checkpointer(str(tmp_path), save_interval="10ba", save_on_signal=["SIGUSR1"]),
                           callbacks={"sender": SendSignal()})
    trainer.fit()
    assert trainer.state.timestamp.batch == 3
    assert (tmp_path / "ep0-ba3" / "manifest.json").is_file()
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_cli_inspect_verifies_and_export_writes_safetensors(tmp_path, capsys):
    from safetensors.torch import load_file

    trainer = make_trainer("2ba", Checkpointer(str(tmp_path / "ck"), save_interval="2ba"))
    trainer.fit()
    assert cli_main(["inspect", str(tmp_path / "ck"), "--verify", "full"]) == 0
    out = capsys.readouterr().out
    assert "ep0-ba2" in out and "model.head.weight" in out and "4x64" in out
    assert cli_main(["export", str(tmp_path / "ck" / "ep0-ba2"), str(tmp_path / "m.safetensors")]) == 0
    exported = load_file(str(tmp_path / "m.safetensors"))
    expected = trainer.state.model.state_dict()
    assert set(exported) == set(expected)
    for key in expected:
        assert torch.equal(exported[key], expected[key]), key
    _flip(tmp_path / "ck" / "ep0-ba2" / "__0_0.distcp")
    assert cli_main(["inspect", str(tmp_path / "ck" / "ep0-ba2")]) == 1
    assert "__0_0.distcp" in capsys.readouterr().err


class BumpWeightsAtEpochEnd(Algorithm):
    """Writes into the parameters outside an optimizer step (as an EMA swap at evaluation does)."""

    def on_epoch_end(self, state):
        with torch.no_grad():
            for p in state.model.parameters():
                p.add_(1.0)


class SnapshotAtSave(Callback):
    def __init__(self):
        self.weights = {}

    def on_batch_checkpoint(self, state):
        if state.checkpoint_requested:
            self.weights[state.timestamp.batch] = {k: v.clone() for k, v in state.model.state_dict().items()}


def test_an_async_save_holds_the_weights_of_its_batch_while_training_runs_on(tmp_path, monkeypatch):
    from smalti.checkpoint.writer import ReusedHostStager

    slow_copy = ReusedHostStager._copy

    def copy_slowly(self, *args):
        time.sleep(0.3)  # the next optimizer step and the epoch-end bump come long before the copy ends
        return slow_copy(self, *args)

    monkeypatch.setattr(ReusedHostStager, "_copy", copy_slowly)
    snapshot, recorder = SnapshotAtSave(), MetricsRecorder()
    trainer = make_trainer("8ba", Checkpointer(str(tmp_path), save_interval="3ba", async_save=True,
                                               save_on_fit_end=False),
                           callbacks={"bump": BumpWeightsAtEpochEnd(), "snapshot": snapshot},
                           loggers={"rec": recorder})
    trainer.fit()
    waits = recorder.metrics["checkpoint/staging_wait_s"]
    assert len(waits) == 2 and all(0.15 < w < 0.5 for w in waits), waits  # batch 4's step and ba6's epoch end
    saved = sorted((p for p in tmp_path.iterdir() if p.is_dir()), key=lambda p: int(p.name.split("-ba")[1]))
    assert [p.name for p in saved] == ["ep0-ba3", "ep0-ba6"]
    for folder, batch in zip(saved, (3, 6)):
        loaded = make_trainer("8ba", Checkpointer(load_path=str(folder)))
        for name, value in loaded.state.model.state_dict().items():
            assert torch.equal(value, snapshot.weights[batch][name]), (folder.name, name)
        loaded.close()


def test_a_load_path_naming_a_damaged_checkpoint_fails_and_one_naming_its_folder_takes_the_previous(tmp_path):
    make_trainer("4ba", Checkpointer(str(tmp_path / "run"), save_interval="2ba")).fit()
    bad = tmp_path / "run" / "ep0-ba4" / "__0_0.distcp"
    _flip(bad)
    with pytest.raises(CheckpointCorruptError, match="xxh3_128") as err:
        make_trainer("6ba", Checkpointer(load_path=str(tmp_path / "run" / "ep0-ba4")))
    assert err.value.path == str(bad)
    with make_trainer("6ba", Checkpointer(load_path=str(tmp_path / "run"))) as resumed:
        assert resumed.state.timestamp.batch == 2


@pytest.mark.parametrize("direct_io", [True, False, "read"])
def test_direct_io_setting_reaches_every_file_and_either_way_resumes_exactly(tmp_path, monkeypatch, direct_io):
    import smalti.checkpoint.writer as writer

    opened = []
    real_open_file = writer.open_hashing_file

    def spy(path, direct=False, algorithm="xxh3_128"):
        opened.append((os.path.basename(path), direct))
        return real_open_file(path, direct, algorithm)

    monkeypatch.setattr(writer, "open_hashing_file", spy)
    reference = make_trainer("6ba")
    reference.fit()
    make_trainer("3ba", Checkpointer(str(tmp_path), save_interval="3ba", direct_io=direct_io)).fit()
    assert any(name.endswith(".distcp") for name, _ in opened)
    assert {direct for _, direct in opened} == {direct_io is True}  # saves write O_DIRECT only when true
    resumed = make_trainer("6ba", Checkpointer(str(tmp_path), save_interval="3ba", autoresume=True, direct_io=direct_io))
    assert resumed.state.timestamp.batch == 3
    resumed.fit()
    assert_same_training_state(reference, resumed)


def test_a_model_that_already_holds_gradients_still_gets_its_optimizer_state(tmp_path):
    make_trainer("2ba", Checkpointer(str(tmp_path), save_interval="2ba")).fit()
    at_batch_2 = make_trainer("2ba")
    at_batch_2.fit()
    torch.manual_seed(1)
    model = MLPRegressor()
    model(torch.randn(4, 16)).sum().backward()  # used before: every parameter has a .grad
    resumed = make_trainer("4ba", Checkpointer(load_path=str(tmp_path), save_interval=None, save_on_fit_end=False),
                           model=model)
    assert resumed.state.optimizers[0].state, "no optimizer state was loaded"
    assert_same_training_state(at_batch_2, resumed)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_state_made_from_the_checkpoint_loads_as_dcps_zero_lr_step_would(tmp_path, monkeypatch, amsgrad):
    from smalti.checkpoint import state_io

    adam = functools.partial(torch.optim.AdamW, lr=1e-2, amsgrad=amsgrad)
    make_trainer("2ba", Checkpointer(str(tmp_path), save_interval="2ba"), optimizer=adam).fit()
    reference = make_trainer("4ba", optimizer=adam)
    reference.fit()
    made = []
    real = state_io._prefill_adam_state
    monkeypatch.setattr(state_io, "_prefill_adam_state", lambda *args: made.append(real(*args)) or made[-1])
    loader = functools.partial(Checkpointer, load_path=str(tmp_path), save_interval=None, save_on_fit_end=False)
    prefilled = make_trainer("4ba", loader(), optimizer=adam)
    assert made == [True]
    monkeypatch.setattr(state_io, "_prefill_adam_state", lambda *args: False)
    stepped = make_trainer("4ba", loader(), optimizer=adam)  # DCP creates the state with its zero-lr step
    assert_same_training_state(prefilled, stepped)
    prefilled.fit()
    assert_same_training_state(reference, prefilled)


def test_a_checkpoint_without_the_state_the_optimizer_keeps_gets_no_uninitialised_entries(tmp_path):
    make_trainer("2ba", Checkpointer(str(tmp_path), save_interval="2ba")).fit()  # AdamW without amsgrad
    saved = make_trainer("2ba")
    saved.fit()
    resumed = make_trainer("4ba", Checkpointer(load_path=str(tmp_path), save_interval=None, save_on_fit_end=False),
                           optimizer=functools.partial(torch.optim.AdamW, lr=1e-2, amsgrad=True))
    state, before = resumed.state.optimizers[0].state_dict()["state"], saved.state.optimizers[0].state_dict()["state"]
    for idx in before:
        assert torch.equal(state[idx]["exp_avg"], before[idx]["exp_avg"])
        assert torch.count_nonzero(state[idx]["max_exp_avg_sq"]) == 0  # not in the checkpoint: made by DCP's zero step


def test_a_load_unpickles_dcps_metadata_once(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemReader

    from smalti.checkpoint import safe_load

    make_trainer("2ba", Checkpointer(str(tmp_path), save_interval="2ba")).fit()
    reads = []
    real = safe_load.read_dcp_metadata
    monkeypatch.setattr(safe_load, "read_dcp_metadata", lambda *a, **k: reads.append(1) or real(*a, **k))
    monkeypatch.setattr(FileSystemReader, "read_metadata", lambda *a, **k: pytest.fail("DCP's own unpickling"))
    resumed = make_trainer("4ba", Checkpointer(str(tmp_path), save_interval=None, autoresume=True))
    assert resumed.state.timestamp.batch == 2
    assert len(reads) == 1  # the load's key check and DCP share one reader
