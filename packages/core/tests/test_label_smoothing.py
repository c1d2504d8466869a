"""label_smoothing as a user notices it: the logged loss is PyTorch's smoothed cross-entropy, resumes exactly,
and works on FSDP2 shards."""

import copy

import pytest
import torch
import torch.nn.functional as F

from smalti.core import Callback, Trainer
from smalti.core.algorithms import LabelSmoothing
from smalti.core.data import build_dataloader
from smalti.core.errors import ConfigError, TrainingError
from smalti.core.examples import CharCorpus, MLPRegressor, SyntheticRegression, TinyLM
from smalti.core.loggers import JSONLLogger
from smalti.core.loggers.jsonl import read_jsonl


class MaskedLM(TinyLM):
    """TinyLM whose targets tell which positions count: every fourth target is ignored."""

    def targets(self, batch):
        t = batch["input_ids"][:, 1:].clone()
        t[:, ::4] = -100
        return t

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs.float().reshape(-1, outputs.shape[-1]), self.targets(batch).reshape(-1))


class Expected(Callback):
    """PyTorch's own smoothed cross-entropy of each step's outputs (one microbatch per step)."""

    def __init__(self, smoothing):
        self.smoothing, self.values, self.plain = smoothing, [], []

    def on_after_forward(self, state):
        model, out = state.raw_model, state.outputs.detach()
        targets = model.targets(state.microbatch) if hasattr(model, "targets") else state.microbatch["input_ids"][:, 1:]
        logits, targets = out.float().reshape(-1, out.shape[-1]), targets.reshape(-1)
        self.values.append(float(F.cross_entropy(logits, targets, label_smoothing=self.smoothing)))
        self.plain.append(float(F.cross_entropy(logits, targets)))


def small_lm(cls=TinyLM):
    torch.manual_seed(0)
    return cls(d_model=32, n_heads=2, n_layers=1, max_seq_len=32)


def fit(tmp_path, model, duration="3ba", load_state=None, smoothing=0.2, extra=None, **kw):
    path = tmp_path / "metrics.jsonl"
    trainer = Trainer(model, build_dataloader(CharCorpus(seq_len=16), 4, seed=3), duration, eval_interval=None,
                      optimizers=lambda p: torch.optim.SGD(p, lr=0.1),
                      algorithms={"label_smoothing": LabelSmoothing(smoothing)}, callbacks=extra,
                      loggers={"jsonl": JSONLLogger(str(path))}, load_state=load_state, **kw)
    trainer.fit()
    return trainer, read_jsonl(path)


@pytest.mark.parametrize("cls", [TinyLM, MaskedLM])
def test_logged_loss_is_pytorchs_smoothed_cross_entropy(tmp_path, cls):
    expected = Expected(0.2)
    _, rows = fit(tmp_path, small_lm(cls), extra={"expected": expected})
    logged = [r["metrics"]["loss/train/total"] for r in rows if "loss/train/total" in r["metrics"]]
    assert logged == pytest.approx(expected.values, rel=1e-5)
    for value, plain in zip(logged, expected.plain):
        assert value != pytest.approx(plain, rel=1e-5)  # smoothing does change the loss


def test_resumes_bit_exactly_mid_run(tmp_path):
    straight, _ = fit(tmp_path / "a", small_lm(), duration="4ba")
    first, _ = fit(tmp_path / "b", small_lm(), duration="2ba")
    saved = copy.deepcopy(first.state.state_dict())
    resumed, _ = fit(tmp_path / "c", small_lm(), duration="4ba", load_state=saved)
    for (name, a), b in zip(straight.state.raw_model.state_dict().items(), resumed.state.raw_model.state_dict().values()):
        assert torch.equal(a, b), name


class Flat(MLPRegressor):
    """A regressor with one output, squeezed: its outputs are not class logits."""

    def __init__(self):
        super().__init__(out_features=1)

    def forward(self, batch):
        return super().forward(batch).squeeze(-1)

    def loss(self, outputs, batch):
        return F.mse_loss(outputs, batch[1][:, 0])


def test_outputs_that_are_not_logits_fail_naming_the_model():
    with pytest.raises(TrainingError, match=r"label_smoothing needs .* Flat returned Tensor of shape \(16,\)"):
        Trainer(Flat(), build_dataloader(SyntheticRegression(32), 16), "1ba", eval_interval=None,
                algorithms=[LabelSmoothing(0.1)]).fit()


def test_bad_smoothing_names_the_key():
    with pytest.raises(ConfigError, match=r"algorithms\.label_smoothing\.smoothing"):
        LabelSmoothing(1.0)


@pytest.mark.world_size(2)
def test_on_fsdp2_the_loss_is_the_mean_of_each_ranks_smoothed_loss(tmp_path):
    import torch.distributed as dist

    from smalti.core.parallelism import FSDP

    rank = dist.get_rank()
    expected = Expected(0.2)
    path = tmp_path / "metrics.jsonl"
    loader = build_dataloader(CharCorpus(seq_len=16), 4, dp_rank=rank, dp_world_size=2, seed=3)
    Trainer(small_lm(), loader, "2ba", eval_interval=None, parallelism=FSDP(),
            algorithms={"label_smoothing": LabelSmoothing(0.2)}, callbacks={"expected": expected},
            loggers={"jsonl": JSONLLogger(str(path), rank_zero_only=False)}).fit()
    mine = torch.tensor(expected.values)
    dist.all_reduce(mine)
    mine /= 2
    logged = path if rank == 0 else tmp_path / f"metrics.rank{rank}.jsonl"
    values = [r["metrics"]["loss/train/total"] for r in read_jsonl(logged) if "loss/train/total" in r["metrics"]]
    assert values == pytest.approx(mine.tolist(), rel=1e-5)
