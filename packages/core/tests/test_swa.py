"""swa as a user notices it: the evaluated and final weights are the mean of the snapshots, the LR follows SWALR's
anneal, batch-norm statistics fit the average, and a resumed or FSDP2 run gets the same."""

import copy
import io

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from smalti.core import Callback, Trainer
from smalti.core.algorithms import SWA
from smalti.core.cli.main import list_run_plugins
from smalti.core.data import build_dataloader
from smalti.core.errors import ConfigError
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.core.loggers import JSONLLogger
from smalti.core.loggers.jsonl import read_jsonl

LR, SWA_LR = 0.1, 0.01


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


class Record(Callback):
    """The weights after each step, the LR each step used, and the weights evaluated and kept around an eval."""

    def __init__(self):
        self.after, self.lrs, self.evaluated, self.after_eval = [], [], {}, {}

    def weights(self, state):
        return {n: full(p) for n, p in state.raw_model.named_parameters()}

    def on_before_optimizer_step(self, state):
        self.lrs.append(state.optimizers[0].param_groups[0]["lr"])

    def on_after_optimizer_step(self, state):
        self.after.append(self.weights(state))

    def on_eval_start(self, state):
        self.evaluated[state.timestamp.batch] = self.weights(state)

    def on_eval_after_all(self, state):
        self.after_eval[state.timestamp.batch] = self.weights(state)


def make_swa(**kw):
    return SWA(
        **{
            "swa_start": "4ba",
            "update_interval": "2ba",
            "swa_lr": SWA_LR,
            "anneal_steps": 2,
            "anneal_strategy": "linear",
            "bn_update_batches": 0,
            **kw,
        }
    )


def fit(tmp_path, swa, model=None, loader=None, duration="10ba", load_state=None, callbacks=None, **kw):
    torch.manual_seed(0)
    path = tmp_path / "metrics.jsonl"
    record = Record()
    trainer = Trainer(
        model or MLPRegressor(),
        loader or build_dataloader(SyntheticRegression(256), 16),
        duration,
        optimizers=lambda p: torch.optim.SGD(p, lr=LR),
        schedulers=[lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)],
        algorithms={"swa": swa},
        callbacks={"record": record, **(callbacks or {})},
        loggers={"jsonl": JSONLLogger(str(path), rank_zero_only=False)},
        load_state=load_state,
        progress_bar=False,
        **kw,
    )
    trainer.fit()
    return trainer, record, path


def mean_of(snapshots):
    return {n: torch.stack([s[n] for s in snapshots]).mean(0) for n in snapshots[0]}


def assert_weights(got, want):
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_average_is_the_mean_of_the_snapshots_evaluated_and_kept_and_the_lr_is_swalr(tmp_path):
    eval_loader = build_dataloader(SyntheticRegression(32, seed=1), 16, shuffle=False)
    trainer, rec, path = fit(tmp_path, make_swa(), eval_dataloader=eval_loader, eval_interval="6ba")
    # snapshots after steps 4, 6, 8, 10
    assert_weights(rec.evaluated[6], mean_of([rec.after[3], rec.after[5]]))
    assert_weights(rec.after_eval[6], rec.after[5])  # the live weights come back after the eval
    final = mean_of([rec.after[i] for i in (3, 5, 7, 9)])
    assert_weights(rec.evaluated[10], final)
    assert_weights({n: p.detach() for n, p in trainer.state.raw_model.named_parameters()}, final)
    # the trainer's schedule until step 4; then SWALR from the LR in effect, linear to SWA_LR over 2 snapshots
    start = LR * 0.9**4
    want = [LR * 0.9**i for i in range(4)] + [start] * 2 + [(start + SWA_LR) / 2] * 2 + [SWA_LR] * 2
    assert rec.lrs == pytest.approx(want, rel=1e-12)
    logs = [
        (r["step"], r["metrics"]["swa/n_averaged"], r["metrics"]["swa/lr"])
        for r in read_jsonl(path)
        if "swa/n_averaged" in r["metrics"]
    ]
    # swa/lr: the LR set for the steps after the snapshot
    assert logs == [
        (4, 1.0, pytest.approx(start)),
        (6, 2.0, pytest.approx((start + SWA_LR) / 2)),
        (8, 3.0, pytest.approx(SWA_LR)),
        (10, 4.0, pytest.approx(SWA_LR)),
    ]


def test_without_swa_lr_the_trainer_schedule_goes_on(tmp_path):
    _, rec, _ = fit(tmp_path, make_swa(swa_lr=None))
    assert rec.lrs == pytest.approx([LR * 0.9**i for i in range(10)], rel=1e-12)


def test_resumes_bit_exactly_mid_anneal(tmp_path):
    straight_swa = make_swa(swap_at_fit_end=False)
    save = _SaveAt(7)  # 3 snapshots taken, 1 to go; the LR half-way down its anneal
    straight, s_rec, _ = fit(tmp_path / "a", straight_swa, callbacks={"save": save})
    swa = make_swa(swap_at_fit_end=False)
    resumed, r_rec, _ = fit(tmp_path / "c", swa, load_state=save.saved)
    assert r_rec.lrs == s_rec.lrs[7:]
    for (name, a), b in zip(
        straight.state.raw_model.state_dict().items(),
        resumed.state.raw_model.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b), name
    assert swa.n_averaged == straight_swa.n_averaged == 4
    for name, tensor in straight_swa.average.items():
        assert torch.equal(tensor, swa.average[name]), name


class _SaveAt(Callback):
    """The run's state dict as a checkpoint at ``batch`` would hold it."""

    def __init__(self, batch):
        self.batch, self.saved = batch, None

    def on_batch_checkpoint(self, state):
        if state.timestamp.batch == self.batch:
            self.saved = copy.deepcopy(state.state_dict())


class BNRegressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 4)

    def forward(self, batch):
        return self.head(self.norm(batch[0]))

    def loss(self, outputs, batch):
        return nn.functional.mse_loss(outputs, batch[1])


def test_batch_norm_statistics_are_recomputed_for_the_average(tmp_path):
    data = SyntheticRegression(128)
    x = data.x * 3.0 + 1.0
    loader = build_dataloader(TensorDataset(x, data.y), 16, shuffle=False)
    trainer, _, _ = fit(
        tmp_path, make_swa(bn_update_batches=3), model=BNRegressor(), loader=loader, duration="8ba"
    )
    norm = trainer.state.raw_model.norm
    # momentum None: the cumulative mean over the first 3 train batches of their batch means
    torch.testing.assert_close(
        norm.running_mean, x[:48].reshape(3, 16, 16).mean(1).mean(0), rtol=1e-5, atol=1e-6
    )
    assert norm.momentum == 0.1


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"swa_start": "x"}, "swa_start"),
        ({"anneal_strategy": "step"}, "anneal_strategy"),
        ({"swa_lr": -1.0}, "swa_lr"),
        ({"bn_update_batches": -1}, "bn_update_batches"),
    ],
)
def test_bad_options_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=rf"algorithms\.swa\.{key}"):
        SWA(**kw)


def test_smalti_plugins_lists_it_with_its_config_path():
    out = io.StringIO()
    assert list_run_plugins(["algorithms=[swa]"], out=out) == 0
    assert "  swa: smalti.core.algorithms.SWA  (off: algorithms.swa=null)" in out.getvalue()


@pytest.mark.world_size(2)
def test_average_of_the_shards_on_fsdp2(tmp_path):
    import torch.distributed as dist

    from smalti.core.parallelism import FSDP

    rank = dist.get_rank()
    loader = build_dataloader(SyntheticRegression(256), 16, dp_rank=rank, dp_world_size=2, seed=5)
    trainer, rec, _ = fit(
        tmp_path, make_swa(swa_start="2ba"), loader=loader, duration="6ba", parallelism=FSDP()
    )
    final = mean_of([rec.after[i] for i in (1, 3, 5)])
    assert_weights({n: full(p) for n, p in trainer.state.raw_model.named_parameters()}, final)
    start = LR * 0.9**2
    assert rec.lrs == pytest.approx([LR, LR * 0.9, start, start, (start + SWA_LR) / 2, (start + SWA_LR) / 2])
