"""seq_length_warmup as a user notices it: sequence lengths by step as scheduled, tokens counted as trained,
the same after a resume and on FSDP2."""

import copy

import pytest
import torch

from smalti.core import Callback, Trainer
from smalti.core.algorithms import SeqLengthWarmup
from smalti.core.data import build_dataloader
from smalti.core.errors import ConfigError
from smalti.core.examples import CharCorpus, TinyLM
from smalti.core.loggers import JSONLLogger
from smalti.core.loggers.jsonl import read_jsonl


class Seen(Callback):
    def __init__(self):
        self.shapes, self.tokens = [], []

    def on_batch_start(self, state):
        self.shapes.append(tuple(state.batch["input_ids"].shape))

    def on_batch_end(self, state):
        self.tokens.append(state.timestamp.token)


def fit(tmp_path, algo, duration="6ba", load_state=None, **kw):
    torch.manual_seed(0)
    path = tmp_path / "metrics.jsonl"
    seen = Seen()
    trainer = Trainer(TinyLM(d_model=32, n_heads=2, n_layers=1, max_seq_len=64),
                      kw.pop("loader", None) or build_dataloader(CharCorpus(seq_len=32), 4, seed=3), duration,
                      optimizers=lambda p: torch.optim.SGD(p, lr=0.1), eval_interval=None,
                      algorithms={"seq_length_warmup": algo}, callbacks={"seen": seen, **kw.pop("callbacks", {})},
                      loggers={"jsonl": JSONLLogger(str(path), rank_zero_only=False)}, load_state=load_state, **kw)
    trainer.fit()
    return trainer, seen, path


def test_lengths_grow_linearly_and_tokens_count_what_was_trained(tmp_path):
    # 33-long rows; 9 + step/4 * 24, down to a multiple of 8, at least 9
    algo = SeqLengthWarmup(duration="4ba", min_seq_length=9, max_seq_length=33, step_size=8)
    _, seen, path = fit(tmp_path, algo)
    expected = [9, 9, 16, 24, 32, 32]
    assert [s[1] for s in seen.shapes] == [min(33, e) for e in expected]
    logged = [(r["step"], r["metrics"]["seq_length_warmup/seq_length"]) for r in read_jsonl(path)
              if "seq_length_warmup/seq_length" in r["metrics"]]
    assert logged[0] == (1, 9.0) and [v for _, v in logged] == sorted({float(min(33, e)) for e in expected})
    # TinyLM counts a row of L ids as L - 1 predicted tokens; 4 rows a batch
    assert seen.tokens == list(torch.tensor([4 * (min(33, e) - 1) for e in expected]).cumsum(0).tolist())


def test_segmenting_makes_more_shorter_rows(tmp_path):
    _, seen, _ = fit(tmp_path, SeqLengthWarmup(duration="4ba", min_seq_length=11, max_seq_length=33, step_size=11,
                                               truncate=False), duration="2ba")
    assert seen.shapes == [(12, 11), (12, 11)]  # 33 = 3 x 11: each row becomes three


class _StopAt(Callback):
    def __init__(self, batch):
        self.batch = batch

    def should_stop(self, state):
        return state.timestamp.batch >= self.batch or None


def test_resumes_bit_exactly_mid_schedule(tmp_path):
    make = lambda: SeqLengthWarmup(duration="4ba", min_seq_length=9, max_seq_length=33, step_size=8)  # noqa: E731
    straight, _, _ = fit(tmp_path / "a", make())
    first, _, _ = fit(tmp_path / "b", make(), callbacks={"stop": _StopAt(2)})
    resumed, seen, _ = fit(tmp_path / "c", make(), load_state=copy.deepcopy(first.state.state_dict()))
    assert [s[1] for s in seen.shapes] == [16, 24, 32, 32]
    assert resumed.state.timestamp.token == straight.state.timestamp.token
    for (name, a), b in zip(straight.state.raw_model.state_dict().items(),
                            resumed.state.raw_model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(("kw", "key"), [({"min_seq_length": 0}, "min_seq_length"), ({"step_size": 0}, "step_size"),
                                         ({"duration": "x"}, "duration")])
def test_bad_options_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=rf"algorithms\.seq_length_warmup\.{key}"):
        SeqLengthWarmup(**kw)


@pytest.mark.world_size(2)
def test_on_fsdp2_every_rank_cuts_alike_and_tokens_sum_over_ranks(tmp_path):
    import torch.distributed as dist

    from smalti.core.parallelism import FSDP

    rank = dist.get_rank()
    loader = build_dataloader(CharCorpus(seq_len=32), 4, dp_rank=rank, dp_world_size=2, seed=3)
    trainer, seen, _ = fit(tmp_path, SeqLengthWarmup(duration="2ba", min_seq_length=9, max_seq_length=33,
                                                      step_size=8), duration="3ba", loader=loader,
                           parallelism=FSDP())
    assert [s[1] for s in seen.shapes] == [9, 16, 32]
    assert trainer.state.timestamp.token == 2 * 4 * (8 + 15 + 31)
