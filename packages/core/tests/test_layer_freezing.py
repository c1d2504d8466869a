"""layer_freezing as a user notices it: the earliest layers stop changing on schedule, bit for bit, their optimizer
state kept or freed, the same after a resume and on FSDP2."""

import copy

import pytest
import torch

from smalti.core import Callback, Trainer
from smalti.core.algorithms import LayerFreezing
from smalti.core.data import build_dataloader
from smalti.core.errors import ConfigError
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.core.loggers import JSONLLogger
from smalti.core.loggers.jsonl import read_jsonl

LAYERS = ["blocks.0.0", "blocks.1.0", "head"]
FROZEN_AFTER = {"blocks.0.0": 3, "blocks.1.0": 5, "head": 7}  # the last step that still trains each layer


class Weights(Callback):
    def __init__(self):
        self.after, self.momentum = [], []

    def on_after_optimizer_step(self, state):
        full = (lambda t: t.full_tensor()) if state.world_size > 1 else (lambda t: t)
        named = dict(state.raw_model.named_parameters())
        self.after.append({n: full(p.detach()).clone() for n, p in named.items()})
        opt = state.optimizers[0]
        self.momentum.append({n: full(opt.state[p]["momentum_buffer"]).clone()
                              for n, p in named.items() if "momentum_buffer" in opt.state.get(p, {})})


def fit(tmp_path, algo, duration="8ba", load_state=None, **kw):
    torch.manual_seed(0)
    path = tmp_path / "metrics.jsonl"
    weights = Weights()
    trainer = Trainer(MLPRegressor(), kw.pop("loader", None) or build_dataloader(SyntheticRegression(256), 16), duration,
                      optimizers=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
                      eval_interval=None, algorithms={"layer_freezing": algo},
                      callbacks={"weights": weights, **kw.pop("callbacks", {})},
                      loggers={"jsonl": JSONLLogger(str(path), rank_zero_only=False)}, load_state=load_state, **kw)
    trainer.fit()
    return trainer, weights, path


def test_earliest_layers_freeze_on_schedule_bit_identical_with_their_state_kept(tmp_path):
    _, w, path = fit(tmp_path, LayerFreezing(freeze_start="2ba", freeze_level=1.0))
    logged = [(r["step"], r["metrics"]["layer_freezing/frozen_layers"]) for r in read_jsonl(path)
              if "layer_freezing/frozen_layers" in r["metrics"]]
    assert logged == [(1, 0.0), (4, 1.0), (6, 2.0), (8, 3.0)]
    for layer, last in FROZEN_AFTER.items():
        for name in (f"{layer}.weight", f"{layer}.bias"):
            kept = w.after[last - 1][name]
            assert not torch.equal(kept, w.after[last - 2][name]), name  # it did train until then
            for step in range(last, 8):
                assert torch.equal(w.after[step][name], kept), (name, step + 1)
                assert torch.equal(w.momentum[step][name], w.momentum[last - 1][name]), (name, step + 1)


def test_drop_optimizer_state_frees_the_frozen_layers_state(tmp_path):
    trainer, _, _ = fit(tmp_path, LayerFreezing(freeze_start="2ba", freeze_level=0.5, drop_optimizer_state=True))
    # level 0.5 of 3 layers: one frozen at the end
    opt = trainer.state.optimizers[0]
    model = trainer.state.raw_model
    assert model.blocks[0][0].weight not in opt.state and model.head.weight in opt.state


def test_resumes_bit_exactly_mid_schedule(tmp_path):
    straight, _, _ = fit(tmp_path / "a", LayerFreezing(freeze_start="2ba"))
    first, _, _ = fit(tmp_path / "b", LayerFreezing(freeze_start="2ba"), duration="8ba",
                      callbacks={"stop": _StopAt(5)})
    saved = copy.deepcopy(first.state.state_dict())
    resumed, _, _ = fit(tmp_path / "c", LayerFreezing(freeze_start="2ba"), load_state=saved)
    assert first.state.timestamp.batch == 5
    for (name, a), b in zip(straight.state.raw_model.state_dict().items(),
                            resumed.state.raw_model.state_dict().values()):
        assert torch.equal(a, b), name


class _StopAt(Callback):
    def __init__(self, batch):
        self.batch = batch

    def should_stop(self, state):
        return state.timestamp.batch >= self.batch or None


@pytest.mark.parametrize(("kw", "key"), [({"freeze_level": 1.5}, "freeze_level"), ({"freeze_start": "x"}, "freeze_start")])
def test_bad_options_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=rf"algorithms\.layer_freezing\.{key}"):
        LayerFreezing(**kw)


@pytest.mark.world_size(2)
def test_frozen_shards_stay_bit_identical_on_fsdp2(tmp_path):
    import torch.distributed as dist

    from smalti.core.parallelism import FSDP

    rank = dist.get_rank()
    loader = build_dataloader(SyntheticRegression(256), 16, dp_rank=rank, dp_world_size=2, seed=5)
    _, w, _ = fit(tmp_path, LayerFreezing(freeze_start="2ba"), loader=loader, parallelism=FSDP())
    for layer, last in FROZEN_AFTER.items():
        name = f"{layer}.weight"
        assert not torch.equal(w.after[last - 1][name], w.after[last - 2][name]), name
        for step in range(last, 8):
            assert torch.equal(w.after[step][name], w.after[last - 1][name]), (name, step + 1)
