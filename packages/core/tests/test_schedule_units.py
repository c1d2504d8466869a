"""Schedules whose warmup and ``max_duration`` are in different units (tokens, samples, batches, fractions)."""

import functools

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from smalti.core import Callback, Trainer
from smalti.core.data import build_dataloader
from smalti.core.errors import TimeError
from smalti.core.examples import CharCorpus, TinyLM
from smalti.core.optim import CosineWithWarmup, LinearWithWarmup

# CharCorpus(seq_len=32) in batches of 8: 8 samples and 256 tokens per optimizer step; every run is 10 steps.
DECAY = [1 - (s - 3) / 7 for s in range(3, 10)]  # linear to 0 from step 3 (the end of a 3-step warmup) to step 10
BATCH_RAMP = [1 / 4, 2 / 4, 3 / 4] + DECAY  # (s + 1) / (warmup + 1)
# A tok/sp warmup ramps with what was seen: step 0 does not know a batch's size yet, so it starts at 0.
SEEN_RAMP = [0.0, (256 + 256) / (768 + 256), (512 + 256) / (768 + 256)] + DECAY
NO_WARMUP = [1 - s / 10 for s in range(10)]


class LRUsed(Callback):
    """The LR multiplier each optimizer step actually used."""

    def __init__(self):
        self.used = []

    def on_before_optimizer_step(self, state):
        self.used.append(state.optimizers[0].param_groups[0]["lr"] / 1e-3)


def run(max_duration, warmup, schedule=LinearWithWarmup):
    lrs = LRUsed()
    trainer = Trainer(TinyLM(d_model=16, n_layers=1), build_dataloader(CharCorpus(seq_len=32), 8), max_duration,
                      optimizers=functools.partial(torch.optim.SGD, lr=1e-3), schedulers=schedule(warmup),
                      eval_interval=None, callbacks={"lrs": lrs})
    trainer.fit()
    assert trainer.state.timestamp.batch == 10
    return lrs.used


@pytest.mark.parametrize("max_duration", ["2560tok", "80sp"])
@pytest.mark.parametrize("warmup,expected", [
    ("0ba", NO_WARMUP), ("0tok", NO_WARMUP), ("0sp", NO_WARMUP), ("0dur", NO_WARMUP), ("0ep", NO_WARMUP),
    ("3ba", BATCH_RAMP), ("0.3dur", SEEN_RAMP), ("768tok", SEEN_RAMP), ("24sp", SEEN_RAMP),
])
def test_warmup_in_any_unit_with_max_duration_in_tokens_or_samples(max_duration, warmup, expected):
    assert run(max_duration, warmup) == pytest.approx(expected)


@pytest.mark.parametrize("warmup,expected", [("768tok", SEEN_RAMP), ("24sp", SEEN_RAMP), ("0.3dur", BATCH_RAMP)])
def test_warmup_in_tokens_or_samples_with_max_duration_in_batches(warmup, expected):
    assert run("10ba", warmup) == pytest.approx(expected)


def test_cosine_with_a_fractional_warmup_and_max_duration_in_tokens():
    used = run("2560tok", "0.3dur", CosineWithWarmup)
    assert used[:3] == pytest.approx(SEEN_RAMP[:3]) and used[3] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(used[3:], used[4:])) and used[-1] < 0.1


class Endless(IterableDataset):
    def __iter__(self):
        while True:
            yield {"input_ids": torch.zeros(33, dtype=torch.long)}


def test_epoch_warmup_without_a_dataloader_length_fails_at_start_saying_what_is_allowed():
    loader = DataLoader(Endless(), batch_size=4)
    with pytest.raises(TimeError, match=r"scheduler.t_warmup=1ep .* ba, sp, tok or dur"):
        Trainer(TinyLM(d_model=16, n_layers=1), loader, "2560tok", schedulers=LinearWithWarmup("1ep"),
                eval_interval=None)
