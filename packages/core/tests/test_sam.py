"""sam as a user notices it: each SAM step is the hand-computed SAM update, plain steps in between, the same with
gradient accumulation, after a resume and on FSDP2; its norms and perturbed losses read back from metrics.jsonl."""

import copy
import io

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from smalti.core import Callback, Trainer
from smalti.core.algorithms import SAM
from smalti.core.cli.main import list_run_plugins
from smalti.core.data import build_dataloader
from smalti.core.errors import ConfigError
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.core.loggers import JSONLLogger
from smalti.core.loggers.jsonl import read_jsonl

LR, RHO, EPS = 0.1, 0.3, 1e-12


class TwoWeights(nn.Module):
    """``y = x @ w`` with two weights, squared error: its gradient is written out by hand in :func:`grad`."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.5, -1.0], dtype=torch.float64))

    def forward(self, batch):
        return batch[0] @ self.w

    def loss(self, outputs, batch):
        return ((outputs - batch[1]) ** 2).mean()


def data(n=16):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, 2, generator=gen, dtype=torch.float64)
    return x, x @ torch.tensor([2.0, 1.0], dtype=torch.float64) + 0.1 * torch.randn(
        n, generator=gen, dtype=torch.float64
    )


def grad(w, x, y):
    """d/dw mean((x @ w - y)^2) = 2/n x^T (x @ w - y)."""
    return 2.0 * x.T @ (x @ w - y) / len(y)


def loss(w, x, y):
    return float(((x @ w - y) ** 2).mean())


def hand_run(batches, interval):
    """SGD with SAM every ``interval`` steps, by the formulas; the weights after each step and the SAM logs."""
    w = torch.tensor([0.5, -1.0], dtype=torch.float64)
    after, logs = [], {}
    for step, (x, y) in enumerate(batches):
        g = grad(w, x, y)
        if (step + 1) % interval == 0:  # the interval-th step, the 2*interval-th, ...
            norm = g.norm()
            shifted = w + RHO * g / (norm + EPS)
            logs[step + 1] = (float(norm), loss(shifted, x, y))
            g = grad(shifted, x, y)
        w = w - LR * g
        after.append(w.clone())
    return after, logs


class Weights(Callback):
    def __init__(self):
        self.after = []

    def on_after_optimizer_step(self, state):
        if not isinstance(state.raw_model, TwoWeights):
            return
        w = state.raw_model.w.detach()
        self.after.append((w.full_tensor() if hasattr(w, "full_tensor") else w).clone())


def fit(tmp_path, model, loader, steps, sam, load_state=None, **kw):
    path = tmp_path / "metrics.jsonl"
    weights = Weights()
    trainer = Trainer(
        model,
        loader,
        f"{steps}ba",
        optimizers=lambda p: torch.optim.SGD(p, lr=LR),
        eval_interval=None,
        algorithms={"sam": sam},
        callbacks={"weights": weights, **kw.pop("callbacks", {})},
        loggers={"jsonl": JSONLLogger(str(path), rank_zero_only=False)},
        load_state=load_state,
        progress_bar=False,
        **kw,
    )
    trainer.fit()
    return trainer, weights, path


def logged(path):
    return {
        r["step"]: (r["metrics"]["sam/grad_norm"], r["metrics"]["sam/perturbed_loss"])
        for r in read_jsonl(path)
        if "sam/grad_norm" in r["metrics"]
    }


@pytest.mark.parametrize("micro", [None, 2])
def test_sam_steps_equal_the_hand_computation_plain_steps_between(tmp_path, micro):
    x, y = data()
    loader = build_dataloader(TensorDataset(x, y), 4, shuffle=False)
    _, weights, path = fit(
        tmp_path,
        TwoWeights(),
        loader,
        4,
        SAM(rho=RHO, epsilon=EPS, interval=2, log_every=3),
        device_train_microbatch_size=micro,
    )
    expected, logs = hand_run([(x[i : i + 4], y[i : i + 4]) for i in range(0, 16, 4)], interval=2)
    for step, (got, want) in enumerate(zip(weights.after, expected, strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=f"step {step + 1}")
    got_logs = logged(path)
    assert sorted(got_logs) == [2, 4]
    for step, (norm, perturbed) in logs.items():
        assert got_logs[step] == pytest.approx((norm, perturbed), rel=1e-6)  # logged as float32


def test_resumes_bit_exactly_mid_interval(tmp_path):
    def run(sub, steps, load_state=None, callbacks=None):
        torch.manual_seed(0)
        return fit(
            tmp_path / sub,
            MLPRegressor(),
            build_dataloader(SyntheticRegression(256), 16),
            steps,
            SAM(rho=0.05, interval=3),
            load_state=load_state,
            callbacks=callbacks or {},
        )[0]

    straight = run("a", 8)
    first = run("b", 8, callbacks={"stop": _StopAt(4)})  # stops between the SAM steps 3 and 6
    assert first.state.timestamp.batch == 4
    resumed = run("c", 8, load_state=copy.deepcopy(first.state.state_dict()))
    for (name, a), b in zip(
        straight.state.raw_model.state_dict().items(),
        resumed.state.raw_model.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b), name


class _StopAt(Callback):
    def __init__(self, batch):
        self.batch = batch

    def should_stop(self, state):
        return state.timestamp.batch >= self.batch or None


def test_fp16_is_refused_by_name():
    x, y = data()
    with pytest.raises(ConfigError, match=r"algorithms\.sam.*amp_fp16"):
        Trainer(
            TwoWeights(),
            build_dataloader(TensorDataset(x, y), 4),
            "1ba",
            precision="amp_fp16",
            algorithms={"sam": SAM()},
            loggers=[],
            progress_bar=False,
        ).fit()


@pytest.mark.parametrize(
    ("kw", "key"), [({"rho": 0}, "rho"), ({"interval": "2ep"}, "interval"), ({"epsilon": -1.0}, "epsilon")]
)
def test_bad_options_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=rf"algorithms\.sam\.{key}"):
        SAM(**kw)


def test_smalti_plugins_lists_it_with_its_config_path():
    out = io.StringIO()
    assert list_run_plugins(["algorithms=[sam]"], out=out) == 0
    assert "  sam: smalti.core.algorithms.SAM  (off: algorithms.sam=null)" in out.getvalue()


@pytest.mark.world_size(2)
def test_sam_on_fsdp2_equals_the_hand_computation_over_both_ranks(tmp_path):
    """Each rank holds one of the two weights: the norm must be the one over both shards."""
    import torch.distributed as dist

    from smalti.core.parallelism import FSDP

    rank = dist.get_rank()
    x, y = data()
    loader = build_dataloader(TensorDataset(x, y), 2, dp_rank=rank, dp_world_size=2, shuffle=False)
    mine = list(loader)
    everyone = [None, None]
    dist.all_gather_object(everyone, mine)
    batches = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(*everyone, strict=True)]
    _, weights, path = fit(
        tmp_path, TwoWeights(), loader, 4, SAM(rho=RHO, epsilon=EPS, interval=2), parallelism=FSDP()
    )
    expected, logs = hand_run(batches, interval=2)
    for step, (got, want) in enumerate(zip(weights.after, expected, strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=f"step {step + 1}")
    if rank:
        return  # the metrics file is rank 0's
    got_logs = logged(path)
    for step, (norm, perturbed) in logs.items():
        assert got_logs[step] == pytest.approx((norm, perturbed), rel=1e-6)  # logged as float32
