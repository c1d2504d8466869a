"""trainer.optimizer_in_backward as a user meets it: the same losses and weights as the step after backward
(with a schedule, several optimizers and param groups, tied weights), no gradient left after backward and fewer
live bytes, a resume that continues bit for bit (and checkpoints interchangeable with the usual path), the
combinations it refuses, and FSDP2 on two ranks."""

import copy
import functools

import pytest
import torch

from smalti.core import Callback, Trainer
from smalti.core.algorithms import SAM, GradientClipping
from smalti.core.callbacks import NaNGuard, OptimizerMonitor
from smalti.core.data import build_dataloader
from smalti.core.errors import ConfigError, TrainingError
from smalti.core.examples import CharCorpus, TinyLM
from smalti.core.optim import CosineWithWarmup, DecoupledAdamW, OptimizerInBackward
from smalti.core.tensors import local_shard


class Record(Callback):
    """Per step: the loss, the facade's lr, and whether any gradient was left after backward."""

    def __init__(self):
        self.losses, self.lrs, self.grads_left, self.live_bytes = [], [], [], []

    def on_after_backward(self, state):
        self.grads_left.append([n for n, p in state.raw_model.named_parameters() if p.grad is not None])
        self.live_bytes.append(_live_tensor_bytes(state))

    def on_after_train_batch(self, state):
        self.losses.append(state.batch_loss.item())

    def on_batch_end(self, state):
        self.lrs.append([g["lr"] for opt in state.optimizers for g in opt.param_groups])


class StopAt(Callback):
    """Ends the run after batch ``batch`` (a run of the same length that stops early, as a killed one does)."""

    def __init__(self, batch):
        self.batch = batch

    def on_batch_end(self, state):
        if state.timestamp.batch >= self.batch:
            state.stop_requested = True


def _live_tensor_bytes(state):
    """Bytes of the distinct storages the training holds: weights, their gradients, the optimizer state."""
    tensors = [local_shard(t) for p in state.raw_model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [local_shard(t) for opt in state.optimizers for per_param in opt.state.values()
                for t in per_param.values() if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class TiedLM(TinyLM):
    """TinyLM whose output head shares the embedding's weight (a gradient from two uses)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.head.weight = self.embed.weight


def _model(tied=False):
    torch.manual_seed(0)
    cls = TiedLM if tied else TinyLM
    return cls(d_model=32, n_heads=2, n_layers=2, max_seq_len=32)


def _adamw_groups(params):
    """Two param groups (no decay on 1-d tensors), different lrs: torch's fused AdamW."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0, "lr": 3e-3}],
                             lr=1e-2, fused=True)


OPTIMIZERS = {
    "decoupled_adamw_fused": functools.partial(DecoupledAdamW, lr=1e-2, weight_decay=1e-3, fused=True),
    "adamw_groups": _adamw_groups,
    "sgd_momentum": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
}


def _train(in_backward, steps=6, optimizer=OPTIMIZERS["decoupled_adamw_fused"], model=None, load_state=None,
           callbacks=None, **kwargs):
    model = model if model is not None else _model()
    record = Record()
    trainer = Trainer(model, build_dataloader(CharCorpus(seq_len=32), 8, seed=1), f"{steps}ba", optimizers=optimizer,
                      schedulers=CosineWithWarmup(t_warmup="2ba"), eval_interval=None, loggers=[],
                      progress_bar=False, callbacks={"record": record, **(callbacks or {})},
                      optimizer_in_backward=in_backward, load_state=load_state, **kwargs)
    trainer.fit()
    return trainer, record


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_same_losses_lrs_and_weights_as_the_step_after_backward(name, tied):
    usual, usual_rec = _train(False, optimizer=OPTIMIZERS[name], model=_model(tied))
    early, early_rec = _train(True, optimizer=OPTIMIZERS[name], model=_model(tied))
    assert early_rec.losses == pytest.approx(usual_rec.losses, abs=1e-6, rel=0)
    assert early_rec.lrs == usual_rec.lrs  # the scheduler drove the per-parameter steps through the facade
    for (n, a), b in zip(usual.state.raw_model.state_dict().items(), early.state.raw_model.state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=n)
    assert len(early.state.optimizers) == 1  # the configured optimizer is the one the run shows


def test_no_gradient_after_backward_and_fewer_live_bytes():
    usual, usual_rec = _train(False, steps=3)
    early, early_rec = _train(True, steps=3)
    assert all(not left for left in early_rec.grads_left)
    assert usual_rec.grads_left[0]  # the usual path holds them: the check can see a gradient
    # the optimizer stepped inside backward: its state exists after the first backward
    assert early.state.optimizers[0].state
    param_bytes = sum(p.numel() * p.element_size() for p in early.state.raw_model.parameters())
    # after a step both hold the AdamW moments; the usual path also holds one gradient per weight
    assert usual_rec.live_bytes[-1] - early_rec.live_bytes[-1] == param_bytes
    assert early_rec.live_bytes[-1] == pytest.approx(3 * param_bytes, rel=0.01)  # weights, exp_avg, exp_avg_sq


def test_hooks_are_removed_when_the_run_ends():
    trainer, _ = _train(True, steps=1)
    model = trainer.state.raw_model
    out = model({"input_ids": torch.zeros(2, 33, dtype=torch.long)})
    model.loss(out, {"input_ids": torch.zeros(2, 33, dtype=torch.long)}).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(("saved_with", "resumed_with"), [(True, True), (True, False), (False, True)])
def test_resume_continues_bit_for_bit(saved_with, resumed_with):
    whole, _ = _train(resumed_with, steps=6)
    first, _ = _train(saved_with, steps=6, callbacks={"stop": StopAt(3)})
    saved = copy.deepcopy(first.state.state_dict())
    resumed, rec = _train(resumed_with, steps=6, load_state=saved)
    assert len(rec.losses) == 3
    for (n, a), b in zip(whole.state.raw_model.state_dict().items(), resumed.state.raw_model.state_dict().values()):
        assert torch.equal(a, b), n
    ours, theirs = resumed.state.optimizers[0].state_dict(), whole.state.optimizers[0].state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    for key, per_param in theirs["state"].items():
        for field, value in per_param.items():
            assert torch.equal(ours["state"][key][field], value), (key, field)


def _refused(**kwargs):
    with pytest.raises(ConfigError) as info:
        _train(True, steps=1, **kwargs)
    return str(info.value)


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"algorithms": {"gradient_clipping": GradientClipping(clipping_threshold=1.0)}}, ["gradient_clipping"]),
    ({"algorithms": {"gradient_clipping": GradientClipping("value", 1.0)}}, ["gradient_clipping"]),
    ({"algorithms": {"sam": SAM()}}, ["sam", "on_gradients_ready"]),
    ({"callbacks": {"optimizer_monitor": OptimizerMonitor()}}, ["optimizer_monitor"]),
    ({"callbacks": {"nan_guard": NaNGuard(action="skip")}}, ["nan_guard", "action='skip'"]),
    ({"device_train_microbatch_size": "auto"}, ["trainer.device_train_microbatch_size=auto"]),
    ({"precision": "amp_fp16"}, ["trainer.precision=amp_fp16"]),
    ({"optimizer": functools.partial(torch.optim.LBFGS, lr=0.1)}, ["LBFGS"]),
], ids=["clip_norm", "clip_value", "sam", "optimizer_monitor", "nan_guard_skip", "auto_microbatch", "amp_fp16",
        "lbfgs"])
def test_refuses_what_needs_every_gradient(kwargs, names):
    message = _refused(**kwargs)
    assert "trainer.optimizer_in_backward" in message
    for name in names:
        assert name in message


def test_nan_guard_that_stops_is_allowed():
    _, rec = _train(True, steps=2, callbacks={"nan_guard": NaNGuard(action="stop")})
    assert len(rec.losses) == 2


def test_refuses_accumulation_over_microbatches():
    with pytest.raises(TrainingError, match=r"trainer.device_train_microbatch_size=4 splits this batch of 8"):
        _train(True, steps=1, device_train_microbatch_size=4)
    _, rec = _train(True, steps=1, device_train_microbatch_size=8)  # one microbatch: nothing to accumulate
    assert len(rec.losses) == 1


def test_refuses_a_plugin_that_skips_a_step_at_run_time():
    class Skip(Callback):
        def on_before_optimizer_step(self, state):
            state.skip_optimizer_step = True

    with pytest.raises(TrainingError, match="skip_optimizer_step.*already stepped"):
        _train(True, steps=1, callbacks={"skip": Skip()})


def test_wraps_only_torch_optimizers():
    with pytest.raises(ConfigError, match="needs a torch.optim.Optimizer"):
        OptimizerInBackward(object())  # type: ignore[arg-type]


@pytest.mark.world_size(2, timeout=400)
def test_fsdp2_steps_each_reduced_shard_in_backward_and_ddp_is_refused():
    import torch.distributed as dist

    from smalti.core.parallelism import DDP, FSDP

    assert "parallelism=ddp" in _refused(parallelism=DDP())

    def run(in_backward):
        loader = build_dataloader(CharCorpus(seq_len=32), 8, dp_rank=dist.get_rank(), dp_world_size=2, seed=1)
        record = Record()
        trainer = Trainer(_model(), loader, "3ba", optimizers=OPTIMIZERS["decoupled_adamw_fused"],
                          schedulers=CosineWithWarmup(t_warmup="1ba"), parallelism=FSDP(), eval_interval=None,
                          loggers=[], progress_bar=False, callbacks={"record": record},
                          optimizer_in_backward=in_backward)
        trainer.fit()
        return {n: p.full_tensor() for n, p in trainer.state.raw_model.named_parameters()}, record

    usual, usual_rec = run(False)
    early, early_rec = run(True)
    assert all(not left for left in early_rec.grads_left)
    assert early_rec.losses == pytest.approx(usual_rec.losses, abs=1e-6, rel=0)
    for name, value in usual.items():
        torch.testing.assert_close(early[name], value, atol=1e-6, rtol=0, msg=name)
