"""Algorithms as a user notices them: gradient clipping and the EMA of weights, on one process and on FSDP2."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from smalti.core import Callback, Trainer
from smalti.core.algorithms import EMA, GradientClipping
from smalti.core.callbacks import NaNGuard
from smalti.core.data import build_dataloader
from smalti.core.errors import ConfigError, TrainingError
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.testing import MetricsRecorder


def fit(duration="6ba", callbacks=None, algorithms=None, model=None, evals=False, lr=1e-2, **kw):
    torch.manual_seed(0)
    sink = MetricsRecorder()
    Trainer(model or MLPRegressor(), build_dataloader(SyntheticRegression(128), 16), duration,
            optimizers=lambda p: torch.optim.SGD(p, lr=lr), callbacks=callbacks, algorithms=algorithms,
            loggers={"sink": sink}, eval_interval="2ba" if evals else None,
            eval_dataloader=build_dataloader(SyntheticRegression(32, seed=1), 16, shuffle=False) if evals else None,
            **kw).fit()
    return sink


def grad_norm(model):
    return float(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm())


class GradNorms(Callback):
    """Records the global gradient norm before clipping (end of backward) and right before the step."""

    def __init__(self):
        self.before, self.after = [], []

    def on_microbatch_end(self, state):
        if state.microbatch_idx == state.num_microbatches - 1:
            self.before.append(grad_norm(state.model))

    def on_before_optimizer_step(self, state):
        self.after.append(grad_norm(state.model))


# ---------------------------------------------------------------------------------------------- clipping


def test_gradient_clipping_by_norm_bounds_the_norm_and_logs_it_before_clipping():
    norms = GradNorms()
    sink = fit(callbacks=[norms], algorithms=[GradientClipping("norm", 0.5)], lr=0.5)
    assert max(norms.before) > 0.5  # the threshold does bite in this run
    for before, after in zip(norms.before, norms.after):
        assert after == pytest.approx(min(before, 0.5), rel=1e-4)
    assert sink.values("grad_norm") == pytest.approx(norms.before, rel=1e-5)
    # the norm is logged at the step of the batch it belongs to, beside the loss
    assert [s for s, m in sink.rows if "grad_norm" in m] == [s for s, m in sink.rows if "loss/train/total" in m]


def test_gradient_clipping_by_value_bounds_every_element():
    seen = []

    class Max(Callback):
        def on_before_optimizer_step(self, state):
            seen.append(max(float(p.grad.abs().max()) for p in state.model.parameters()))

    sink = fit(callbacks=[Max()], algorithms=[GradientClipping("value", 0.01)])
    assert max(seen) == pytest.approx(0.01)  # clamped, and some element reached the bound
    assert sink.values("grad_norm") == []


def test_gradient_clipping_works_with_gradient_accumulation():
    norms = GradNorms()
    fit("3ba", callbacks=[norms], algorithms=[GradientClipping("norm", 0.1)], device_train_microbatch_size=4)
    assert len(norms.after) == 3 and max(norms.after) <= 0.1 * (1 + 1e-4)


def test_gradient_clipping_reads_the_norms_once_per_log_interval():
    from smalti.testing.host_sync import count_host_syncs

    syncs: dict[int, list[str]] = {}

    class Probe(Callback):
        def on_after_dataloader(self, state):
            self._block = count_host_syncs()
            self._counter = self._block.__enter__()

        def on_batch_end(self, state):
            self._block.__exit__(None, None, None)
            # moving the batch to the (CPU) device counts as a copy to the host here; only reads matter
            syncs[state.timestamp.batch] = [s.op for s in self._counter.syncs if not s.op.startswith("to(")]

    clip = GradientClipping("norm", 0.5, log_every="3ba")
    sink = fit("7ba", callbacks=[Probe()], algorithms=[clip], lr=0.5, log_interval="10ba")
    # clipping never waits for the device; the norms of batches 1-3 and 4-6 are read in one transfer each (algorithms
    # run before callbacks at batch end, so inside the probe's window); batch 7's at fit end
    assert syncs == {1: [], 2: [], 3: ["tolist"], 4: [], 5: [], 6: ["tolist"], 7: []}
    assert [s for s, m in sink.rows if "grad_norm" in m] == list(range(1, 8))
    with pytest.raises(ConfigError, match="log_every"):
        GradientClipping("norm", 1.0, log_every="0.5dur")


# ---------------------------------------------------------------------------------------------- EMA


class NormedMLP(MLPRegressor):
    """The example MLP with a BatchNorm in front, so the model has floating-point buffers as well."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(16)

    def forward(self, batch):
        return super().forward((self.norm(batch[0]), batch[1]))


def averaged(model):
    """The tensors EMA averages: parameters and floating-point buffers, by name."""
    named = {k: p.detach().clone() for k, p in model.named_parameters()}
    named.update({k: b.detach().clone() for k, b in model.named_buffers() if b.is_floating_point()})
    return named


class Snapshots(Callback):
    """The model's tensors after every optimizer step (taken before anything else can change them)."""

    def __init__(self):
        self.taken = []

    def on_after_optimizer_step(self, state):
        self.taken.append(averaged(state.raw_model))


def hand_ema(initial, snapshots, s, updates):
    """``ema <- s * ema + (1 - s) * w`` at the (1-based) steps in ``updates``, starting from ``initial``."""
    ema = dict(initial)
    for step, weights in enumerate(snapshots, start=1):
        if step in updates:
            ema = {k: s * ema[k] + (1 - s) * weights[k] for k in ema}
    return ema


@pytest.mark.parametrize(("options", "s"), [
    ({"half_life": None, "smoothing": 0.5}, 0.5),
    ({"half_life": "2ba"}, 2 ** -(1 / 2)),  # s = 2 ** -(update_interval / half_life)
])
def test_ema_equals_a_hand_computed_average_over_three_steps(options, s):
    model = NormedMLP()
    initial = averaged(model)
    snaps, ema = Snapshots(), EMA(**options)
    fit("3ba", model=model, callbacks=[snaps], algorithms=[ema])
    expected = hand_ema(initial, snaps.taken, s, updates={1, 2, 3})
    assert set(ema.shadow) == set(expected) and "norm.running_mean" in expected
    for name, value in expected.items():
        torch.testing.assert_close(ema.shadow[name], value, msg=name)
    assert not torch.equal(ema.shadow["head.weight"], snaps.taken[-1]["head.weight"])


def test_ema_start_and_update_interval():
    snaps, ema = Snapshots(), EMA(half_life="4ba", update_interval="2ba", ema_start="2ba")
    fit("6ba", callbacks=[snaps], algorithms=[ema])
    # the average starts from the weights after step 2 and is updated after steps 4 and 6
    expected = hand_ema(snaps.taken[1], snaps.taken, 2 ** -(2 / 4), updates={4, 6})
    for name, value in expected.items():
        torch.testing.assert_close(ema.shadow[name], value, msg=name)


def test_ema_weights_are_evaluated_and_training_continues_from_the_live_weights():
    seen = {}

    class Watch(Callback):
        def on_batch_end(self, state):
            seen.setdefault("live", []).append(state.raw_model.head.weight.detach().clone())

        def on_eval_start(self, state):
            seen.setdefault("evaluated", []).append(state.raw_model.head.weight.detach().clone())
            seen.setdefault("shadow", []).append(ema.shadow["head.weight"].clone())

        def on_eval_after_all(self, state):
            seen.setdefault("restored", []).append(state.raw_model.head.weight.detach().clone())

    ema = EMA(half_life="2ba")
    fit("4ba", callbacks=[Watch()], algorithms=[ema], evals=True)
    assert len(seen["evaluated"]) == 2  # at batches 2 and 4
    for k, batch in enumerate((1, 3)):
        live = seen["live"][batch]
        assert not torch.equal(seen["evaluated"][k], live)
        torch.testing.assert_close(seen["restored"][k], live)
    # what evaluation saw is the average, which sits back in the shadow copy afterwards
    torch.testing.assert_close(seen["evaluated"][-1], ema.shadow["head.weight"])


def test_ema_swap_at_fit_end_leaves_the_average_in_the_model():
    model = MLPRegressor()
    initial = averaged(model)
    snaps, ema = Snapshots(), EMA(half_life=None, smoothing=0.5, swap_at_fit_end=True)
    fit("3ba", model=model, callbacks=[snaps], algorithms=[ema])
    expected = hand_ema(initial, snaps.taken, 0.5, updates={1, 2, 3})
    for name, tensor in model.named_parameters():
        torch.testing.assert_close(tensor.detach(), expected[name], msg=name)
        torch.testing.assert_close(ema.shadow[name], snaps.taken[-1][name], msg=name)


def test_ema_ignores_skipped_steps():
    class PoisonSecond(Callback):
        def on_after_loss(self, state):
            if state.timestamp.batch == 1:
                state.loss = state.loss * float("nan")

    torch.manual_seed(0)
    initial = averaged(MLPRegressor())
    snaps, ema = Snapshots(), EMA(half_life=None, smoothing=0.5)
    fit("3ba", callbacks={"poison": PoisonSecond(), "nan_guard": NaNGuard("skip"), "snaps": snaps}, algorithms=[ema])
    expected = hand_ema(initial, snaps.taken, 0.5, updates={1, 3})
    for name, value in expected.items():
        torch.testing.assert_close(ema.shadow[name], value, msg=name)


def ema_state(model):
    return SimpleNamespace(raw_model=model, to_batches=lambda t: int(t.value))


def test_ema_state_resumes_into_a_fresh_run():
    ema = EMA(half_life="3ba")
    fit("3ba", algorithms=[ema])
    saved = ema.plugin_state_dict()
    resumed = EMA(half_life="3ba")
    resumed.load_plugin_state_dict(saved)  # loaded before fit, as a checkpoint loaded at start does
    resumed.on_fit_start(ema_state(MLPRegressor()))
    assert resumed.started
    for name, tensor in saved["shadow"].items():
        torch.testing.assert_close(resumed.shadow[name], tensor)


def test_ema_state_from_another_model_fails_naming_the_tensors():
    ema = EMA(half_life="3ba")
    ema.on_fit_start(ema_state(MLPRegressor()))
    with pytest.raises(TrainingError, match=r"missing \['norm.bias'.*norm.running_mean"):
        other = EMA(half_life="3ba")
        other.on_fit_start(ema_state(NormedMLP()))
        other.load_plugin_state_dict(ema.plugin_state_dict())


@pytest.mark.parametrize("make", [
    lambda: EMA(half_life="10ba", smoothing=0.9),
    lambda: EMA(half_life=None, smoothing=None),
    lambda: EMA(half_life=None, smoothing=1.5),
    lambda: GradientClipping("l2", 1.0),
    lambda: GradientClipping("norm", 0.0),
])
def test_bad_options_fail_naming_the_key(make):
    with pytest.raises(ConfigError, match=r"algorithms\.\w+"):
        make()


# ---------------------------------------------------------------------------------------------- FSDP2


@pytest.mark.world_size(2)
def test_clipping_and_ema_on_fsdp2_sharded_parameters():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from smalti.core.parallelism import FSDP

    def full_grad_norm(model):
        return float(torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()]).norm())

    class Watch(Callback):
        def __init__(self):
            self.before, self.after, self.weights = [], [], []

        def on_microbatch_end(self, state):
            self.before.append(full_grad_norm(state.model))

        def on_before_optimizer_step(self, state):
            self.after.append(full_grad_norm(state.model))

        def on_after_optimizer_step(self, state):
            self.weights.append({k: p.full_tensor() for k, p in state.raw_model.named_parameters()})

    rank = dist.get_rank()
    loader = build_dataloader(SyntheticRegression(256), 16, dp_rank=rank, dp_world_size=2, seed=5)
    torch.manual_seed(0)
    model = MLPRegressor()
    initial = averaged(model)
    watch, sink, ema = Watch(), MetricsRecorder(), EMA(half_life=None, smoothing=0.5)
    Trainer(model, loader, "3ba", optimizers=lambda p: torch.optim.SGD(p, lr=0.5), parallelism=FSDP(),
            algorithms=[GradientClipping("norm", 0.05), ema], callbacks=[watch], loggers={"sink": sink}).fit()

    assert all(isinstance(t, DTensor) for t in ema.shadow.values())
    assert min(watch.before) > 0.05
    assert watch.after == pytest.approx([0.05] * 3, rel=1e-4)  # the global norm over both ranks' shards
    assert sink.values("grad_norm") == pytest.approx(watch.before, rel=1e-5)
    expected = hand_ema(initial, watch.weights, 0.5, updates={1, 2, 3})
    for name, tensor in ema.shadow.items():
        torch.testing.assert_close(tensor.full_tensor(), expected[name], msg=name)
