"""Callbacks and algorithms as a user notices them."""

import math

import pytest
import torch

from smalti.core import Callback, Trainer, TrainingError
from smalti.core.algorithms import EMA, GradientClipping
from smalti.core.callbacks import EarlyStopping, LRMonitor, NaNGuard, ProgressBar, SpeedMonitor, peak_flops
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.core.plugins import LoggerDestination


class Collect(LoggerDestination):
    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step):
        self.rows.append((step, dict(metrics)))

    def values(self, key):
        return [m[key] for _, m in self.rows if key in m]


def fit(duration="6ba", callbacks=None, algorithms=None, model=None, evals=False, lr=1e-2, **kw):
    torch.manual_seed(0)
    sink = Collect()
    Trainer(model or MLPRegressor(), build_dataloader(SyntheticRegression(128), 16), duration,
            optimizers=lambda p: torch.optim.SGD(p, lr=lr), callbacks=callbacks, algorithms=algorithms,
            loggers={"sink": sink}, eval_interval="2ba" if evals else None,
            eval_dataloader=build_dataloader(SyntheticRegression(32, seed=1), 16, shuffle=False) if evals else None,
            **kw).fit()
    return sink


def test_speed_monitor_mfu_from_flops_and_peak():
    sink = fit(callbacks={"speed": SpeedMonitor(window_size=3, gpu_flops_available=1e9)})
    samples = sink.values("throughput/samples_per_sec")
    flops = sink.values("throughput/device/flops_per_sec")
    mfu = sink.values("throughput/mfu")
    assert len(mfu) == 6 and all(s > 0 for s in samples)
    for f, m in zip(flops, mfu):
        assert m == pytest.approx(f / 1e9)
    # flops_per_batch = 6 * params * batch; samples/s * 6 * params = flops/s
    params = sum(p.numel() for p in MLPRegressor().parameters())
    assert flops[-1] == pytest.approx(samples[-1] * 6 * params, rel=1e-6)


def test_peak_table_by_device_name():
    assert peak_flops("NVIDIA H100 80GB HBM3", "amp_bf16") == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 PCIe", "amp_bf16") == pytest.approx(756e12)
    assert peak_flops("NVIDIA H200", "amp_fp8") == pytest.approx(1978.9e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB", "amp_bf16") == pytest.approx(312e12)
    assert peak_flops("Tesla T4", "amp_bf16") is None


def test_lr_monitor_follows_schedule():
    from smalti.core.optim import LinearWithWarmup

    sink = fit(callbacks=[LRMonitor()], schedulers=LinearWithWarmup("0ba"))
    lrs = sink.values("lr-SGD/group0")
    assert lrs[0] < 1e-2 and lrs[-1] == pytest.approx(0.0) and lrs == sorted(lrs, reverse=True)


class PoisonAt(Callback):
    def __init__(self, batch):
        self.batch = batch

    def on_after_loss(self, state):
        if state.timestamp.batch + 1 == self.batch:
            state.loss = state.loss * float("nan")


def test_nan_guard_stop_names_the_batch():
    with pytest.raises(TrainingError, match=r"nan at batch 3 .*nan_guard.action=skip"):
        fit(callbacks={"poison": PoisonAt(3), "nan_guard": NaNGuard("stop")})


def test_nan_guard_skip_keeps_weights_finite():
    guard = NaNGuard("skip")
    sink = fit(callbacks={"poison": PoisonAt(3), "nan_guard": guard})
    assert guard.skipped == 1 and sink.values("nan_guard/skipped_batches") == [1]
    assert math.isfinite(sink.values("loss/train/total")[-1])


def test_gradient_clipping_bounds_the_norm():
    seen = []

    class Norm(Callback):
        def on_before_optimizer_step(self, state):
            grads = [p.grad.flatten() for p in state.model.parameters() if p.grad is not None]
            seen.append(float(torch.cat(grads).norm()))

    sink = fit(callbacks=[Norm()], algorithms=[GradientClipping("norm", 0.5)])
    assert max(seen) <= 0.5 + 1e-5
    assert max(sink.values("grad_norm")) > 0.5  # the pre-clip norm is what gets logged


def test_gradient_clipping_by_value():
    seen = []

    class Max(Callback):
        def on_before_optimizer_step(self, state):
            seen.append(max(float(p.grad.abs().max()) for p in state.model.parameters()))

    fit(callbacks=[Max()], algorithms=[GradientClipping("value", 0.01)])
    assert max(seen) <= 0.01 + 1e-7


def test_ema_matches_hand_computed_average():
    snapshots = []

    class Snap(Callback):
        def on_after_optimizer_step(self, state):
            snapshots.append(state.raw_model.head.bias.detach().clone())

    torch.manual_seed(0)
    initial = MLPRegressor().head.bias.detach().clone()
    ema = EMA(half_life=None, smoothing=0.5)
    fit("3ba", callbacks=[Snap()], algorithms=[ema])
    expected = initial
    for snap in snapshots:
        expected = 0.5 * expected + 0.5 * snap
    torch.testing.assert_close(ema.shadow["head.bias"], expected)


def test_ema_smoothing_from_half_life_and_eval_swap():
    ema = EMA(half_life="2ba")
    evaluated = []

    class AtEval(Callback):
        def on_eval_start(self, state):
            evaluated.append(state.raw_model.head.bias.detach().clone())

    fit("4ba", callbacks=[AtEval()], algorithms=[ema], evals=True)
    assert ema._smoothing(type("S", (), {"to_batches": staticmethod(lambda t: t.value)})()) == pytest.approx(2**-0.5)
    assert len(evaluated) == 2  # evaluation saw the EMA weights, which are not the live ones afterwards


def test_early_stopping_stops_after_patience():
    stopper = EarlyStopping(monitor="eval/MSE", patience=2, min_delta=1e9)  # nothing counts as an improvement
    sink = fit("20ba", callbacks=[stopper], evals=True)
    steps = [s for s, m in sink.rows if "loss/train/total" in m]
    assert steps[-1] == 6  # evals at 2 (first is 'best'), 4 and 6: two rounds without improvement


def test_progress_bar_only_when_forced_off_tty(capsys):
    fit("3ba", callbacks=[ProgressBar()])
    assert "ba/s" not in capsys.readouterr().out
    fit("3ba", callbacks=[ProgressBar(force=True)])
    assert "3/3" in capsys.readouterr().out
