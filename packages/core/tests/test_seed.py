"""``smalti.core.seed_all``: a model built in Python after it matches the one a run with that seed builds."""

import random

import numpy as np
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate

import smalti.core.cli.train  # noqa: F401 - registers the config schema
from smalti.core import seed_all
from smalti.core.config.build import build_trainer


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def draws():
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_seed_all_seeds_python_numpy_and_torch():
    seed_all(123)
    first = draws()
    seed_all(123)
    second = draws()
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])
    seed_all(124)
    other = draws()
    assert other[0] != first[0] and other[1] != first[1] and not torch.equal(other[2], first[2])


def test_model_built_after_seed_all_has_the_weights_of_a_run_with_that_seed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with initialize_config_module(version_base="1.3", config_module="smalti.core.conf"):
        cfg = compose("train", overrides=["model=tiny_lm", "data=synthetic", "trainer.seed=123", "callbacks=[]",
                                          "logger=[]", "trainer.eval_interval=null"])
    trainer = build_trainer(cfg)
    try:
        in_run = weights(trainer.state.raw_model)
    finally:
        trainer.close()

    torch.manual_seed(0)  # whatever the process drew before: seed_all alone decides the weights
    seed_all(123)
    built = weights(instantiate(cfg.model))
    assert len(built) == len(in_run) and all(torch.equal(a, b) for a, b in zip(built, in_run))
    seed_all(124)
    assert not torch.equal(weights(instantiate(cfg.model))[0], in_run[0])
