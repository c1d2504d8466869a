"""optimizer_monitor as a user reads it back from metrics.jsonl: Composer's keys, hand-checked values, no work
between intervals, and the global norm over FSDP2 shards."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from smalti.core import Callback, Trainer
from smalti.core.callbacks import OptimizerMonitor
from smalti.core.data import build_dataloader
from smalti.core.errors import ConfigError
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.core.loggers import JSONLLogger
from smalti.core.loggers.jsonl import read_jsonl


class Watch(Callback):
    """What the optimizer saw and did at every step, by parameter name."""

    def __init__(self):
        self.grads, self.before, self.after, self.m, self.v = [], [], [], [], []

    def on_before_optimizer_step(self, state):
        model = state.raw_model
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        self.before.append({n: p.detach().clone() for n, p in model.named_parameters()})

    def on_after_optimizer_step(self, state):
        opt = state.optimizers[0]
        named = dict(state.raw_model.named_parameters())
        self.after.append({n: p.detach().clone() for n, p in named.items()})
        self.m.append({n: opt.state[p]["exp_avg"].clone() for n, p in named.items()})
        self.v.append({n: opt.state[p]["exp_avg_sq"].clone() for n, p in named.items()})


def run(tmp_path, monitor, duration="4ba", extra=None):
    torch.manual_seed(0)
    path = tmp_path / "metrics.jsonl"
    callbacks = {"optimizer_monitor": monitor, **(extra or {})}
    Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(128), 16), duration,
            optimizers=lambda p: torch.optim.AdamW(p, lr=1e-2), callbacks=callbacks, eval_interval=None,
            loggers={"jsonl": JSONLLogger(str(path))}).fit()
    return read_jsonl(path)


def test_norms_under_composer_names_equal_a_hand_computation_at_each_interval(tmp_path):
    watch = Watch()
    rows = run(tmp_path, OptimizerMonitor(interval="2ba"), extra={"watch": watch})
    logged = {r["step"]: r["metrics"] for r in rows if any(k.startswith("l2_norm") for k in r["metrics"])}
    assert sorted(logged) == [2, 4]  # at the interval, at the step of the batch it describes
    for step, metrics in logged.items():
        i = step - 1
        grads = watch.grads[i]
        total = torch.sqrt(sum(g.square().sum() for g in grads.values()))
        assert metrics["l2_norm/grad/global"] == pytest.approx(float(total), rel=1e-5)
        for name in grads:
            update = (watch.after[i][name] - watch.before[i][name]).norm()
            expected = {
                f"l2_norm/grad/{name}": grads[name].norm(),
                f"l2_norm/param/{name}": watch.after[i][name].norm(),
                f"l2_norm/moment/{name}": watch.m[i][name].norm(),
                f"l2_norm/second_moment_sqrt/{name}": watch.v[i][name].sqrt().norm(),
                f"l2_norm/update/{name}": update,
                f"l2_norm_ratio/update_param/{name}": update / watch.before[i][name].norm(),
            }
            for key, value in expected.items():
                assert metrics[key] == pytest.approx(float(value), rel=1e-4, abs=1e-7), key
    assert "l2_norm/grad/blocks.0.0.weight" in logged[2]


def test_global_only(tmp_path):
    rows = run(tmp_path, OptimizerMonitor(interval="1ba", per_layer=False), duration="2ba")
    keys = {k for r in rows for k in r["metrics"] if k.startswith("l2_norm")}
    assert keys == {"l2_norm/grad/global"}


class CountOps(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls, self.reads = 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if getattr(func, "__name__", "") in ("tolist", "item", "__float__"):
            self.reads += 1
        return func(*args, **(kwargs or {}))


class Counted(OptimizerMonitor):
    """The monitor with every hook run under a torch-function counter, per step."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.per_step = {}

    def _counted(self, hook, state, *args):
        mode = CountOps()
        with mode:
            hook(*args)
        calls, reads = self.per_step.get(state.timestamp.batch, (0, 0))
        self.per_step[state.timestamp.batch] = (calls + mode.calls, reads + mode.reads)

    def on_before_optimizer_step(self, state):
        self._counted(super().on_before_optimizer_step, state, state)

    def on_after_optimizer_step(self, state):
        self._counted(super().on_after_optimizer_step, state, state)

    def on_batch_end(self, state, logger):
        self._batch = state.timestamp.batch
        mode = CountOps()
        with mode:
            super().on_batch_end(logger)
        calls, reads = self.per_step.get(self._batch - 1, (0, 0))
        self.per_step[self._batch - 1] = (calls + mode.calls, reads + mode.reads)


def test_no_tensor_work_between_intervals_and_one_read_per_interval(tmp_path):
    monitor = Counted(interval="3ba")
    rows = run(tmp_path, monitor, duration="6ba")
    assert [r["step"] for r in rows if "l2_norm/grad/global" in r["metrics"]] == [3, 6]
    # keyed by the step's 0-based index: steps 3 and 6 are indices 2 and 5
    for index, (calls, reads) in sorted(monitor.per_step.items()):
        if index in (2, 5):
            assert calls > 0 and reads == 1, index
        else:
            assert (calls, reads) == (0, 0), index


@pytest.mark.parametrize("interval", ["0ba", "1ep", "-1"])
def test_bad_interval_names_the_key(interval):
    with pytest.raises(ConfigError, match=r"callbacks\.optimizer_monitor\.interval"):
        OptimizerMonitor(interval=interval)


@pytest.mark.world_size(2)
def test_global_grad_norm_over_fsdp2_shards(tmp_path):
    import torch.distributed as dist

    from smalti.core.parallelism import FSDP

    class Full(Callback):
        def __init__(self):
            self.norms, self.params = [], []

        def on_before_optimizer_step(self, state):
            self.norms.append(float(torch.cat([p.grad.full_tensor().flatten()
                                               for p in state.model.parameters()]).norm()))

        def on_after_optimizer_step(self, state):
            self.params.append({n: float(p.full_tensor().norm()) for n, p in state.raw_model.named_parameters()})

    rank = dist.get_rank()
    shared = tmp_path / "metrics.jsonl"
    loader = build_dataloader(SyntheticRegression(256), 16, dp_rank=rank, dp_world_size=2, seed=5)
    torch.manual_seed(0)
    full = Full()
    Trainer(MLPRegressor(), loader, "2ba", optimizers=lambda p: torch.optim.AdamW(p, lr=1e-2), parallelism=FSDP(),
            callbacks={"optimizer_monitor": OptimizerMonitor(interval="1ba"), "full": full}, eval_interval=None,
            loggers={"jsonl": JSONLLogger(str(shared), rank_zero_only=False)}).fit()
    mine = shared if rank == 0 else tmp_path / f"metrics.rank{rank}.jsonl"  # every rank logs what it computed
    rows = [r["metrics"] for r in read_jsonl(mine) if "l2_norm/grad/global" in r["metrics"]]
    assert [m["l2_norm/grad/global"] for m in rows] == pytest.approx(full.norms, rel=1e-5)
    for metrics, params in zip(rows, full.params):
        for name, norm in params.items():
            assert metrics[f"l2_norm/param/{name}"] == pytest.approx(norm, rel=1e-5), name
