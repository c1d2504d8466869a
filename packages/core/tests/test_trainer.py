"""Trainer behaviour: resumption, accumulation, auto microbatching, schedules, errors."""

import copy
import functools

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from smalti.core import Callback, Time, Trainer, TrainingError
from smalti.core.data import build_dataloader
from smalti.core.errors import ConfigError
from smalti.core.examples import CharCorpus, MLPRegressor, SyntheticRegression, TinyLM
from smalti.core.optim import CosineWithWarmup, LinearWithWarmup


def make_trainer(max_duration="12ba", batch=16, micro=None, callbacks=None, load_state=None, **kw):
    torch.manual_seed(0)
    loader = build_dataloader(SyntheticRegression(128), batch, seed=3)
    return Trainer(
        MLPRegressor(),
        loader,
        max_duration,
        optimizers=functools.partial(torch.optim.AdamW, lr=1e-2),
        schedulers=CosineWithWarmup("3ba"),
        device_train_microbatch_size=micro,
        callbacks=callbacks,
        load_state=load_state,
        **kw,
    )


def params(trainer):
    return [p.detach().clone() for p in trainer.state.raw_model.parameters()]


class StopAt(Callback):
    def __init__(self, batch):
        self.batch = batch

    def should_stop(self, state):
        return state.timestamp.batch >= self.batch or None


def test_resume_from_state_dict_is_bit_identical():
    full = make_trainer("20ba")
    full.fit()
    expected = params(full)

    first = make_trainer("20ba", callbacks={"stop": StopAt(11)})
    first.fit()
    assert first.state.timestamp.batch == 11 and first.state.timestamp.epoch == 1  # 8 batches per epoch
    saved = copy.deepcopy(first.state.state_dict())

    torch.manual_seed(1234)  # a fresh process would have other RNG state: the checkpoint must restore it
    second = make_trainer("20ba", load_state=saved)
    assert second.state.timestamp.batch == 11
    second.fit()
    for a, b in zip(params(second), expected):
        assert torch.equal(a, b)
    assert second.state.schedulers[0].last_epoch == full.state.schedulers[0].last_epoch


def test_gradient_accumulation_matches_whole_batch():
    whole = make_trainer(micro=None)
    whole.fit()
    accumulated = make_trainer(micro=4)
    accumulated.fit()
    assert accumulated.state.num_microbatches == 4
    for a, b in zip(params(whole), params(accumulated)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class OOMAbove(Callback):
    """Raises torch.OutOfMemoryError for microbatches larger than ``limit``, like a GPU would."""

    def __init__(self, limit):
        self.limit = limit
        self.changes = []

    def on_before_forward(self, state):
        if state.microbatch[0].shape[0] > self.limit:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")

    def on_microbatch_size_change(self, state, old, new):
        self.changes.append((old, new))


def test_auto_microbatching_halves_and_matches_smaller_start():
    oom = OOMAbove(limit=4)
    auto = make_trainer(micro="auto", callbacks={"oom": oom})
    auto.fit()
    assert oom.changes == [(16, 8), (8, 4)]
    assert auto.state.device_train_microbatch_size == 4
    fixed = make_trainer(micro=4)
    fixed.fit()
    for a, b in zip(params(auto), params(fixed)):
        assert torch.equal(a, b)


def test_oom_without_auto_propagates():
    with pytest.raises(torch.OutOfMemoryError):
        make_trainer(micro=16, callbacks={"oom": OOMAbove(limit=4)}).fit()


def test_scheduler_warmup_and_decay_in_time_units():
    trainer = make_trainer("10ba")
    trainer.state.schedulers = []
    sched = LinearWithWarmup(t_warmup="0.2dur", alpha_f=0.0)
    lrs = [sched(trainer.state, step) for step in range(11)]
    assert lrs[0] == pytest.approx(1 / 3) and lrs[1] == pytest.approx(2 / 3)
    assert lrs[2] == pytest.approx(1.0) and lrs[10] == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))


def test_max_duration_in_tokens_and_epochs():
    loader = build_dataloader(CharCorpus(seq_len=32), 8)
    trainer = Trainer(TinyLM(d_model=32, n_layers=1), loader, "2000tok", eval_interval=None)
    trainer.fit()
    assert trainer.state.timestamp.token >= 2000 and trainer.state.timestamp.batch == 8  # 256 tokens/batch
    small = build_dataloader(SyntheticRegression(64), 16)
    trainer = Trainer(MLPRegressor(), small, "2ep")
    trainer.fit()
    assert trainer.state.timestamp.epoch == 2 and trainer.state.timestamp.batch == 8


def test_eval_interval_and_metrics():
    data = SyntheticRegression(64)
    trainer = Trainer(
        MLPRegressor(),
        build_dataloader(data, 16),
        "8ba",
        eval_dataloader=build_dataloader(SyntheticRegression(32, seed=1), 16, shuffle=False, drop_last=False),
        eval_interval="3ba",
    )
    evals = []

    class Watch(Callback):
        def on_eval_after_all(self, state):
            evals.append((state.timestamp.batch, state.eval_metrics["eval"]["MSE"]))

    trainer.pm.register(Watch(), "watch")
    try:
        trainer.fit()
    finally:
        trainer.pm.unregister(name="watch")
    assert [b for b, _ in evals] == [3, 6, 8]  # every 3 batches, and once at fit end
    assert evals[-1][1] < evals[0][1]


def test_model_without_loss_is_a_clear_error():
    with pytest.raises(ConfigError, match="no loss"):
        Trainer(torch.nn.Linear(2, 2), [torch.zeros(1, 2)], "1ba")


def test_empty_dataloader_is_a_clear_error():
    empty = DataLoader(TensorDataset(torch.zeros(3, 16), torch.zeros(3, 4)), batch_size=8, drop_last=True)
    with pytest.raises(TrainingError, match="no batches") as caught:
        Trainer(MLPRegressor(), empty, "1ba")
    # The numbers a user needs to fix it: what the dataset holds, the batch size, and what would fit.
    assert "holds 3 rows" in str(caught.value)
    assert "batch_size=8 per rank with drop_last=True; set batch_size to at most 3" in str(caught.value)
    assert str(caught.value).endswith("or drop_last=False")


def test_bad_microbatch_value_names_the_key():
    with pytest.raises(ConfigError, match="device_train_microbatch_size"):
        make_trainer(micro="big")


def test_loss_goes_down_on_corpus():
    loader = build_dataloader(CharCorpus(seq_len=64), 32, seed=1)
    losses = []

    class Record(Callback):
        def on_batch_end(self, state):
            losses.append(float(state.batch_loss))

    Trainer(TinyLM(d_model=64), loader, "40ba", optimizers=functools.partial(torch.optim.AdamW, lr=3e-3),
            callbacks=[Record()]).fit()
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


@pytest.mark.parametrize("precision", ["amp_bf16", "amp_fp16"])
def test_mixed_precision_trains(precision):
    trainer = make_trainer("6ba", precision=precision)
    trainer.fit()
    assert torch.isfinite(trainer.state.batch_loss)
    assert (trainer.state.grad_scaler is not None) == (precision == "amp_fp16")


def test_compile_option_matches_eager():
    eager = make_trainer("3ba")
    eager.fit()
    compiled = make_trainer("3ba", compile=True)
    compiled.fit()
    for a, b in zip(params(eager), params(compiled)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_time_helpers_on_state():
    trainer = make_trainer("2ep")
    assert trainer.state.to_batches(Time.parse("1ep")) == 8
    assert trainer.state.to_batches("0.5dur") == 8


def test_model_built_on_meta_device_is_materialized():
    with torch.device("meta"):
        model = MLPRegressor()
    assert all(p.is_meta for p in model.parameters())
    trainer = Trainer(model, build_dataloader(SyntheticRegression(64), 16), "2ba")
    trainer.fit()
    assert not any(p.is_meta for p in trainer.state.raw_model.parameters())
    assert torch.isfinite(trainer.state.batch_loss)


@pytest.mark.parametrize("cls", ["DecoupledAdamW", "DecoupledSGDW"])
def test_decoupled_weight_decay_follows_the_schedule(cls):
    import smalti.core.optim as optim

    p = torch.nn.Parameter(torch.ones(3))
    opt = getattr(optim, cls)([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros(3)
    opt.step()  # zero gradient: only the decay acts, 0.5 per step at the initial LR
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.5))
    opt.param_groups[0]["lr"] = 0.05  # half the LR -> half the decay
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.375))


@pytest.mark.parametrize("cls", ["DecoupledAdamW", "DecoupledSGDW"])
def test_decoupled_weight_decay_survives_a_state_dict_round_trip(cls):
    """torch's AdamW sets its own ``decoupled_weight_decay`` key to True on load; the decay must stay 0.5, not
    become 1.0 (which zeroed every weight on the first step after a resume)."""
    import smalti.core.optim as optim

    def fresh():
        p = torch.nn.Parameter(torch.ones(3))
        return p, getattr(optim, cls)([p], lr=0.1, weight_decay=0.5)

    p, opt = fresh()
    p.grad = torch.zeros(3)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    q, resumed = fresh()
    with torch.no_grad():
        q.copy_(p)
    resumed.load_state_dict(saved)
    q.grad = torch.zeros(3)
    resumed.step()
    torch.testing.assert_close(q.detach(), torch.full((3,), 0.25))
    # a checkpoint written before the key was renamed holds the decay under torch's key, as a float
    legacy = copy.deepcopy(saved)
    for group in legacy["param_groups"]:
        group["decoupled_weight_decay"] = group.pop("smalti_decoupled_weight_decay")
    r, old = fresh()
    old.param_groups[0]["smalti_decoupled_weight_decay"] = 0.0
    old.load_state_dict(legacy)
    assert old.param_groups[0]["smalti_decoupled_weight_decay"] == 0.5
