"""Retention: ``retained()`` over every small (committed, keep_last_n, keep_every_n), and whole runs, through
the Trainer and through every shipped ``checkpoint=`` option, keep exactly what the policy says."""

import functools
import itertools
import random
from importlib import resources

import pytest
import torch

from smalti.checkpoint import Checkpointer
from smalti.checkpoint.checkpointer import retained
from smalti.core import Trainer
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression


def make_trainer(duration, checkpointer):
    torch.manual_seed(0)
    return Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(96), 16, seed=5), duration,  # 6 batches/epoch
                   optimizers=functools.partial(torch.optim.AdamW, lr=1e-2), callbacks={"checkpoint": checkpointer})


def committed(folder):
    return sorted((p.name for p in folder.iterdir() if (p / "manifest.json").is_file()),
                  key=lambda n: int(n.split("-ba")[1]))


def test_retained_keeps_every_checkpoint_while_fewer_than_keep_last_n_are_committed():
    assert retained(["ep0-ba1"], 3, None) == {"ep0-ba1"}
    assert retained(["ep0-ba2", "ep0-ba1"], 3, None) == {"ep0-ba1", "ep0-ba2"}
    assert retained(["ep0-ba1", "ep0-ba2", "ep0-ba3", "ep0-ba4"], 3, None) == {"ep0-ba2", "ep0-ba3", "ep0-ba4"}
    assert retained(["ep0-ba1", "ep0-ba2"], 0, None) == set()
    assert retained(["ep0-ba1", "ep0-ba2"], -1, None) == {"ep0-ba1", "ep0-ba2"}
    assert retained(["ep0-ba2", "ep0-ba3", "ep1-ba6", "ep1-ba7"], 1, 2) == {"ep0-ba2", "ep1-ba6", "ep1-ba7"}


def test_retained_as_a_property_over_every_small_policy():
    rng = random.Random(0)
    for count, keep_last_n, keep_every_n, spacing in itertools.product(range(13), range(-1, 9), [None, 0, 1, 2, 3, 5],
                                                                       [1, 2, 3]):
        batches = [spacing * (i + 1) for i in range(count)]
        names = [f"ep{b // 6}-ba{b}" for b in batches]
        rng.shuffle(names)  # the order of a listing must not matter
        keep = retained(names, keep_last_n, keep_every_n)
        case = (count, keep_last_n, keep_every_n, spacing)
        newest_first = sorted(names, key=lambda n: -int(n.split("-ba")[1]))
        assert keep <= set(names), case
        last = newest_first if keep_last_n < 0 else newest_first[:keep_last_n]
        assert set(last) <= keep, case  # the newest keep_last_n (every one while fewer are committed)
        assert len(set(last)) == (count if keep_last_n < 0 else min(count, keep_last_n)), case
        for name in names:
            multiple = bool(keep_every_n) and int(name.split("-ba")[1]) % keep_every_n == 0
            assert (name in keep) == (name in last or multiple), (case, name)


def test_a_run_saving_every_batch_ends_with_exactly_keep_last_n_checkpoints(tmp_path):
    # smalti-train model=mlp data=synthetic trainer.max_duration=6ba checkpoint=dcp checkpoint.save_interval=1ba
    #   checkpoint.keep_last_n=3
    make_trainer("6ba", Checkpointer(str(tmp_path), save_interval="1ba", keep_last_n=3)).fit()
    assert committed(tmp_path) == ["ep0-ba4", "ep0-ba5", "ep0-ba6"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["ep0-ba4", "ep0-ba5", "ep0-ba6"]


def _shipped_options():
    folder = resources.files("smalti.checkpoint.conf").joinpath("checkpoint")
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def _compose(option, overrides):
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from smalti.core.config.build import build
    from smalti.core.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module("smalti.core.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"checkpoint={option}", *overrides])
    GlobalHydra.instance().clear()
    return cfg.checkpoint, build(cfg.checkpoint, "checkpoint")


@pytest.mark.parametrize("option", _shipped_options())
def test_every_shipped_checkpoint_option_keeps_what_it_says(option, tmp_path, request, monkeypatch):
    assert set(_shipped_options()) >= {"dcp", "s3"}
    overrides = ["checkpoint.save_interval=1ba", "run_name=keep"]
    if option == "s3":
        monkeypatch.setenv("SMALTI_CHECKPOINT_BUCKET", request.getfixturevalue("s3_bucket"))
        request.getfixturevalue("s3_server")  # S3_ENDPOINT_URL points at the loopback server
        overrides.append(f"checkpoint.local_cache_dir={tmp_path / 'cache'}")
    else:
        overrides.append(f"checkpoint.save_folder={tmp_path / 'ck'}")
    cfg, checkpointer = _compose(option, overrides)
    make_trainer("6ba", checkpointer).fit()
    if checkpointer.store.remote:
        names = [n for n in checkpointer.store.list_names() if checkpointer.store.read_manifest(n) is not None]
        assert checkpointer.store.list_names() == names  # nothing uncommitted is left behind either
    else:
        names = committed(checkpointer.store.root)
    every = [f"ep0-ba{b}" for b in range(1, 7)]
    expected = every if cfg.keep_last_n < 0 else every[len(every) - cfg.keep_last_n:]
    if cfg.keep_every_n:
        expected = sorted(set(expected) | {n for n in every if int(n.split("-ba")[1]) % cfg.keep_every_n == 0},
                          key=every.index)
    assert names == expected
    if option == "s3":
        assert cfg.keep_last_n == 3 and len(names) == 3  # what the shipped s3 option promises
