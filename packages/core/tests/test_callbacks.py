"""Callbacks as a user notices them: throughput and MFU, LR and memory monitors, NaN guard, early stopping,
progress bar, and their config options."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import smalti.core.callbacks.speed_monitor as speed_monitor_module
from smalti.core import Callback, Trainer, TrainingError
from smalti.core.callbacks import (
    EarlyStopping,
    LRMonitor,
    MemoryMonitor,
    NaNGuard,
    ProgressBar,
    SpeedMonitor,
    peak_flops,
)
from smalti.core.callbacks.speed_monitor import matmul_precision
from smalti.core.data import build_dataloader
from smalti.core.errors import ConfigError
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.core.time import Timestamp
from smalti.testing import MetricsRecorder

CONF = Path(speed_monitor_module.__file__).parents[1] / "conf"


class Logged:
    """Stands in for the ``logger`` facade when a hook is called directly."""

    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append(dict(metrics))


def fit(duration="6ba", callbacks=None, algorithms=None, model=None, evals=False, lr=1e-2, **kw):
    torch.manual_seed(0)
    sink = MetricsRecorder()
    Trainer(model or MLPRegressor(), build_dataloader(SyntheticRegression(128), 16), duration,
            optimizers=lambda p: torch.optim.SGD(p, lr=lr), callbacks=callbacks, algorithms=algorithms,
            loggers={"sink": sink}, eval_interval="2ba" if evals else None,
            eval_dataloader=build_dataloader(SyntheticRegression(32, seed=1), 16, shuffle=False) if evals else None,
            **kw).fit()
    return sink


class PoisonAt(Callback):
    """Makes the loss NaN at the given (1-based) batches."""

    def __init__(self, *batches):
        self.batches = set(batches)

    def on_after_loss(self, state):
        if state.timestamp.batch + 1 in self.batches:
            state.loss = state.loss * float("nan")


# ---------------------------------------------------------------------------------------------- speed


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


def test_speed_monitor_rates_and_mfu_over_the_window(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(speed_monitor_module, "time", clock)
    flops_per_rank = 3e12
    model = SimpleNamespace(flops_per_batch=lambda batch: flops_per_rank)
    state = SimpleNamespace(device=torch.device("cpu"), precision="fp32", raw_model=model, batch=None,
                            world_size=2, batch_num_samples=64, batch_num_tokens=64 * 128)
    monitor, logged = SpeedMonitor(window_size=2, gpu_flops_available=4e12), Logged()
    monitor.on_fit_start(state)
    for seconds in (1.0, 2.0, 0.5):
        monitor.on_before_dataloader()
        clock.now += seconds
        monitor.on_batch_start()
        monitor.on_batch_end(state, logged)
        clock.now += 10.0  # evaluation or checkpointing between batches: not training time
    last = logged.rows[-1]
    window = 2.0 + 0.5  # the first batch has left the window
    assert last["throughput/batches_per_sec"] == pytest.approx(2 / window)
    assert last["throughput/samples_per_sec"] == pytest.approx(2 * 64 / window)
    assert last["throughput/device/samples_per_sec"] == pytest.approx(2 * 64 / window / 2)
    assert last["throughput/tokens_per_sec"] == pytest.approx(2 * 64 * 128 / window)
    # MFU = flops_per_batch * world / (window time * world * peak)
    assert last["throughput/mfu"] == pytest.approx(2 * flops_per_rank * 2 / (window * 2 * 4e12))
    assert logged.rows[0]["throughput/mfu"] == pytest.approx(flops_per_rank / (1.0 * 4e12))


def test_speed_monitor_mfu_during_a_run_follows_the_model_flops():
    sink = fit(callbacks={"speed": SpeedMonitor(window_size=3, gpu_flops_available=1e9)})
    samples = sink.values("throughput/samples_per_sec")
    flops = sink.values("throughput/device/flops_per_sec")
    mfu = sink.values("throughput/mfu")
    assert len(mfu) == len(samples) == 6 and all(s > 0 for s in samples)
    params = sum(p.numel() for p in MLPRegressor().parameters())
    for s, f, m in zip(samples, flops, mfu):
        assert f == pytest.approx(s * 6 * params)  # the example model counts 6 * params FLOPs per sample
        assert m == pytest.approx(f / 1e9)


def test_speed_monitor_on_cpu_logs_no_mfu_without_a_peak():
    sink = fit("3ba", callbacks={"speed": SpeedMonitor()})
    assert len(sink.values("throughput/device/flops_per_sec")) == 3
    assert sink.values("throughput/mfu") == []


def test_peak_flops_table_by_device_name_and_precision():
    # NVIDIA datasheets print tensor-core rates with sparsity; MFU uses the dense rate, half of it.
    assert peak_flops("NVIDIA H100 80GB HBM3", "amp_bf16") == pytest.approx(1979e12 / 2)
    assert peak_flops("NVIDIA H100 PCIe", "amp_bf16") == pytest.approx(1513e12 / 2)
    assert peak_flops("NVIDIA H100 NVL", "amp_fp8") == pytest.approx(3341e12 / 2)
    assert peak_flops("NVIDIA H200", "amp_fp8") == pytest.approx(3958e12 / 2)
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp32") == pytest.approx(67e12)
    for a100 in ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe"):
        assert peak_flops(a100, "amp_bf16") == pytest.approx(312e12)
        assert peak_flops(a100, "tf32") == pytest.approx(156e12)
    assert peak_flops("NVIDIA A100-SXM4-40GB", "amp_fp8") is None  # Ampere has no FP8
    assert peak_flops("Tesla T4", "amp_bf16") is None


def test_fp32_runs_with_tf32_matmuls_use_the_tf32_peak():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert matmul_precision("fp32") == "fp32"
        torch.set_float32_matmul_precision("high")
        assert matmul_precision("fp32") == "tf32"
        assert matmul_precision("amp_bf16") == "amp_bf16"
    finally:
        torch.set_float32_matmul_precision(before)


# ---------------------------------------------------------------------------------------------- lr, memory


def test_lr_monitor_follows_the_schedule():
    from smalti.core.optim import LinearWithWarmup

    sink = fit(callbacks=[LRMonitor()], schedulers=LinearWithWarmup("0ba"))
    lrs = sink.values("lr-SGD/group0")
    assert len(lrs) == 6 and lrs[0] < 1e-2 and lrs[-1] == pytest.approx(0.0) and lrs == sorted(lrs, reverse=True)


def test_lr_monitor_names_every_group_of_every_optimizer():
    first = torch.optim.AdamW([{"params": [torch.zeros(1)], "lr": 0.1}, {"params": [torch.zeros(1)], "lr": 0.2}])
    second = torch.optim.AdamW([torch.zeros(1)], lr=0.3)
    logged = Logged()
    LRMonitor().on_batch_end(SimpleNamespace(optimizers=[first, second]), logged)
    assert logged.rows[-1] == {"lr-AdamW/group0": 0.1, "lr-AdamW/group1": 0.2, "lr-AdamW-1/group0": 0.3}


def test_memory_monitor_logs_process_memory_on_cpu_at_its_interval():
    sink = fit("6ba", callbacks=[MemoryMonitor(interval="2ba")])
    steps = [s for s, m in sink.rows if "memory/rss_gb" in m]
    assert steps == [2, 4, 6]
    rss, peak = sink.values("memory/rss_gb")[-1], sink.values("memory/peak_rss_gb")[-1]
    assert 0.05 < rss <= peak  # the interpreter with torch loaded holds well over 50 MB


# ---------------------------------------------------------------------------------------------- NaN guard


def test_nan_guard_stop_names_the_batch_and_the_fix():
    with pytest.raises(TrainingError, match=r"loss/train/total is nan at batch 3 .*nan_guard\.action=skip"):
        fit(callbacks={"poison": PoisonAt(3), "nan_guard": NaNGuard("stop")})


def test_nan_guard_skip_leaves_the_weights_of_that_batch_untouched():
    changed = []

    class Watch(Callback):
        def on_before_optimizer_step(self, state):
            self.before = [p.detach().clone() for p in state.model.parameters()]

        def on_after_optimizer_step(self, state):
            after = list(state.model.parameters())
            changed.append(any(not torch.equal(a, b) for a, b in zip(self.before, after)))

    guard = NaNGuard("skip")
    sink = fit(callbacks={"poison": PoisonAt(3), "nan_guard": guard, "watch": Watch()})
    assert changed == [True, True, False, True, True, True]
    assert guard.skipped == 1 and sink.values("nan_guard/skipped_batches") == [1]
    assert math.isfinite(sink.values("loss/train/total")[-1])


def test_nan_guard_skip_still_stops_a_run_that_keeps_diverging():
    with pytest.raises(TrainingError, match=r"batch 4 .*after 2 skipped batches in a row .*max_skips=2"):
        fit(callbacks={"poison": PoisonAt(2, 3, 4, 5), "nan_guard": NaNGuard("skip", max_skips=2)})


def test_nan_guard_skip_with_fp16_grad_scaler_keeps_training():
    guard = NaNGuard("skip")
    sink = fit("4ba", callbacks={"poison": PoisonAt(2), "nan_guard": guard}, precision="amp_fp16")
    assert guard.skipped == 1 and len(sink.values("loss/train/total")) == 4


@pytest.mark.world_size(2)
def test_nan_guard_ranks_agree_when_one_rank_sees_nan():
    import torch.distributed as dist

    rank = dist.get_rank()
    loader = build_dataloader(SyntheticRegression(256), 16, dp_rank=rank, dp_world_size=2, seed=5)
    torch.manual_seed(0)
    poison = PoisonAt(2) if rank == 1 else PoisonAt()
    trainer = Trainer(MLPRegressor(), loader, "4ba", optimizers=lambda p: torch.optim.SGD(p, lr=1e-2),
                      callbacks={"poison": poison, "nan_guard": NaNGuard("stop")})
    with pytest.raises(TrainingError, match=r"nan at batch 2 "):
        trainer.fit()
    # Both ranks stopped at the same point, none hung: "stop" reads the losses the trainer logs, at the end here.
    assert trainer.state.timestamp.batch == 4


# ---------------------------------------------------------------------------------------------- early stopping


def test_early_stopping_counts_rounds_without_improvement_and_resumes():
    stopper = EarlyStopping(monitor="metrics/eval/Loss", mode="min", patience=2, min_delta=0.01)
    decisions = []
    for value in (1.0, 0.9, 0.895, 0.8, 0.85, 0.81):  # 0.895 and 0.81 do not beat the best by min_delta
        stopper.on_eval_after_all(SimpleNamespace(eval_metrics={"eval": {"Loss": value}}))
        decisions.append(stopper.should_stop())
    assert decisions == [None, None, None, None, None, True]
    resumed = EarlyStopping(monitor="eval/Loss", mode="min", patience=2, min_delta=0.01)
    resumed.load_plugin_state_dict(stopper.plugin_state_dict())
    assert resumed.should_stop() is True and resumed.best == 0.8


def test_early_stopping_mode_max():
    stopper = EarlyStopping(monitor="eval/Accuracy", mode="max", patience=1)
    stopper.on_eval_after_all(SimpleNamespace(eval_metrics={"eval": {"Accuracy": 0.5}}))
    stopper.on_eval_after_all(SimpleNamespace(eval_metrics={"eval": {"Accuracy": 0.6}}))
    assert stopper.should_stop() is None
    stopper.on_eval_after_all(SimpleNamespace(eval_metrics={"eval": {"Accuracy": 0.6}}))
    assert stopper.should_stop() is True


def test_early_stopping_stops_a_run_after_patience():
    stopper = EarlyStopping(monitor="metrics/eval/MSE", patience=2, min_delta=1e9)  # nothing improves enough
    sink = fit("20ba", callbacks=[stopper], evals=True)
    steps = [s for s, m in sink.rows if "loss/train/total" in m]
    assert steps[-1] == 6  # evals at 2 (sets the best), 4 and 6: two rounds without improvement


def test_early_stopping_on_epoch_evals_stops_at_the_epoch_end():
    torch.manual_seed(0)
    trainer = Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(64), 16), "10ep", eval_interval="1ep",
                      eval_dataloader=build_dataloader(SyntheticRegression(32, seed=1), 16, shuffle=False),
                      callbacks=[EarlyStopping("metrics/eval/MSE", patience=1, min_delta=1e9)])
    trainer.fit()
    assert (trainer.state.timestamp.epoch, trainer.state.timestamp.batch) == (2, 8)  # 4 batches an epoch


def test_early_stopping_on_a_metric_evaluation_does_not_produce_lists_the_ones_it_does():
    with pytest.raises(ConfigError, match=r"metrics/eval/Nope.*metrics/eval/MSE"):
        fit("4ba", callbacks=[EarlyStopping(monitor="metrics/eval/Nope")], evals=True)


# ---------------------------------------------------------------------------------------------- progress bar


def test_progress_bar_draws_only_on_a_tty_unless_forced(capsys):
    fit("3ba", callbacks=[ProgressBar()])
    assert "ba/s" not in capsys.readouterr().out  # pytest's captured stdout is not a terminal
    bar = ProgressBar(force=True, refresh_every=1)
    fit("3ba", callbacks=[bar])
    out = capsys.readouterr().out
    assert "3/3" in out and "loss=" in out
    assert bar._bar is None  # closed with the trainer


def test_progress_bar_stays_off_on_other_ranks(capsys):
    bar = ProgressBar(force=True)
    bar.on_fit_start(SimpleNamespace(rank=1, timestamp=Timestamp()))
    assert bar._bar is None and capsys.readouterr().out == ""


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("group", ["callbacks", "algorithms"])
def test_every_shipped_option_builds_its_plugin(group):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from smalti.core.plugins import Algorithm
    from smalti.core.plugins import Callback as CallbackBase
    from smalti.core.run_name import register_resolvers

    register_resolvers()  # as smalti-train does: shipped options may name the run's folder (goodput)
    base = CallbackBase if group == "callbacks" else Algorithm
    files = sorted((CONF / group).glob("*.yaml"))
    assert files
    for path in files:
        cfg = OmegaConf.load(path)
        assert list(cfg) == [path.stem], f"{path} must hold one key named like the file"
        plugin = instantiate(cfg[path.stem])
        assert isinstance(plugin, base), path


@pytest.mark.parametrize("make", [
    lambda: NaNGuard(action="ignore"),
    lambda: EarlyStopping(monitor="eval/Loss", mode="lowest"),
    lambda: EarlyStopping(monitor="Loss"),
    lambda: EarlyStopping(monitor="eval/Loss", patience=0),
    lambda: SpeedMonitor(window_size=0),
])
def test_bad_options_fail_naming_the_key(make):
    with pytest.raises(ConfigError, match=r"callbacks\.\w+\.\w+="):
        make()
