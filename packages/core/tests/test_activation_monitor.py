"""activation_monitor as a user reads it from metrics.jsonl: each layer's max, average and std on the interval steps
equal to the values computed by hand, and no forward hook on the model between intervals."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from smalti.core import Callback, Trainer
from smalti.core.callbacks import ActivationMonitor
from smalti.core.errors import ConfigError
from smalti.core.loggers import JSONLLogger
from smalti.core.loggers.jsonl import read_jsonl


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(3, 4), nn.Tanh()), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, batch):
        x = batch[0]
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss(self, outputs, batch):
        return nn.functional.mse_loss(outputs, batch[1])


class HookCount(Callback):
    """The number of forward hooks on the model's modules at each point of each step."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str, int]] = []

    def _count(self, state, where):
        hooks = sum(len(m._forward_hooks) for m in state.raw_model.modules())
        self.seen.append((state.timestamp.batch + 1, where, hooks))

    def on_before_forward(self, state):
        self._count(state, "forward")

    def on_after_backward(self, state):
        self._count(state, "backward")

    def on_batch_start(self, state):
        self._count(state, "start")


def test_stats_equal_hand_computed_values_and_hooks_exist_only_in_interval_forwards(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    x, y = torch.randn(24, 3), torch.randn(24, 2)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)
    path = tmp_path / "metrics.jsonl"
    counts = HookCount()
    Trainer(
        model,
        loader,
        "3ba",
        optimizers=lambda p: torch.optim.SGD(p, lr=0.0),
        eval_interval=None,
        device_train_microbatch_size=4,  # two microbatches per step: their statistics add up
        callbacks={"activation_monitor": ActivationMonitor(interval="2ba"), "hooks": counts},
        loggers={"jsonl": JSONLLogger(str(path))},
    ).fit()

    rows = [r for r in read_jsonl(path) if any(k.startswith("activations/") for k in r["metrics"])]
    assert [r["step"] for r in rows] == [2]
    logged = rows[0]["metrics"]
    assert sorted(logged) == sorted(
        f"activations/{s}/{layer}"
        for s in ("max", "average", "std")
        for layer in ("blocks.0", "blocks.1", "head")
    )
    with torch.no_grad():  # lr 0: the weights of step 2 are the initial ones; its batch is rows 8..15
        h0 = model.blocks[0](x[8:16])
        h1 = model.blocks[1](h0)
        out = model.head(h1)
    for layer, value in (("blocks.0", h0), ("blocks.1", h1), ("head", out)):
        assert logged[f"activations/max/{layer}"] == pytest.approx(value.amax(dim=-1).mean().item(), rel=1e-5)
        assert logged[f"activations/average/{layer}"] == pytest.approx(
            value.mean().item(), rel=1e-5, abs=1e-7
        )
        assert logged[f"activations/std/{layer}"] == pytest.approx(value.std(unbiased=False).item(), rel=1e-4)

    # hooks only in the forwards of step 2 (three layers), never in backward, never in steps 1 and 3
    assert {(step, where) for step, where, n in counts.seen if n} == {(2, "forward")}
    assert [n for step, where, n in counts.seen if step == 2 and where == "forward"] == [3, 3]
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0


def test_other_stats_and_chosen_layers():
    torch.manual_seed(0)
    model = Tiny()
    monitor = ActivationMonitor(
        interval="1ba", stats=["l2_norm", "kurtosis"], module_types=["Tanh"], modules=["head"]
    )
    assert [name for name, _ in monitor.layers(model)] == ["blocks.0.1", "head"]
    x = torch.randn(5, 3)
    sums = monitor._moments(model.head(model.blocks[1](model.blocks[0](x))).detach())
    out = model.head(model.blocks[1](model.blocks[0](x))).detach()
    centred = out - out.mean(-1, keepdim=True)
    kurtosis = (centred.pow(4).mean(-1) / centred.square().mean(-1).square()).sum()
    assert sums[5].item() == pytest.approx(out.norm(dim=-1).sum().item(), rel=1e-5)
    assert sums[6].item() == pytest.approx(kurtosis.item(), rel=1e-5)
    with pytest.raises(ConfigError, match="no module of Tiny matches"):
        ActivationMonitor(modules=["nothing.*"]).layers(model)
    with pytest.raises(ConfigError, match="stats"):
        ActivationMonitor(stats=["median"])
    with pytest.raises(ConfigError, match="interval"):
        ActivationMonitor(interval="1ep")
