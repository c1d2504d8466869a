"""The Trainer's own per-step work, counted in Python calls: a deterministic guard for bench/trainer_overhead.py.

Timing a few microseconds per step is noise on a shared machine; the number of Python-level calls (functions
and C builtins) a step makes beyond a bare PyTorch loop is not, and every call the loop adds shows up in it.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from smalti.core import Callback, Trainer
from smalti.core.callbacks import ProgressBar, SpeedMonitor
from smalti.core.loggers import ConsoleLogger

STEPS, COUNTED_FROM = 60, 20  # counted over steps 20..59: six log intervals of 10, warm caches
_TQDM = f"{os.sep}tqdm{os.sep}"

#: Calls per step beyond the bare loop with the console logger, speed monitor and progress bar on, not counting
#: the calls inside tqdm. Measured 52.5-53.9 (2026-11-27, second pass: one forward/backward path, no import per
#: should_eval, no should_eval call when core's rule is the only one and nothing is evaluated, the speed
#: monitor's metrics kept whole by the console logger, the losses stacked as they are, no call per tensor to
#: keep a CPU batch on the CPU); 71.3 before that pass (104.5 with tqdm's calls, 181 before the first pass).
#: 72.5 since the loop fires every hook through ``Events.fire``/``decide`` (2026-11-29): one Python call per
#: event or decision asked, implemented or not (20 a step here), where the loop used to test each hook's
#: implementation list inline. The bound leaves room for small changes, not for a hook called through pluggy's
#: machinery every step (+9) or a new per-step plugin call chain.
MAX_EXTRA_CALLS_PER_STEP = 78
#: tqdm's own calls per step: 33.3 measured, most of them measuring the bar's width when it is redrawn after
#: each console line; its timed redraws (every 0.5 s) add a few on a slow machine.
MAX_TQDM_CALLS_PER_STEP = 45


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, batch):
        return self.lin(batch[0])

    def loss(self, outputs, batch):
        return nn.functional.mse_loss(outputs, batch[1])


def _loader() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(STEPS * 4, 8, generator=gen), torch.randn(STEPS * 4, 4, generator=gen))
    return DataLoader(data, batch_size=4, shuffle=False, drop_last=True)


class _Counter:
    """Counts ``call`` and ``c_call`` profile events while on, those inside tqdm apart.

    tqdm redraws the bar every 0.5 s as well as after each console line, so how often it draws depends on the
    machine's speed; counted apart, the rest is the same number on every machine.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.tqdm_calls = 0

    def __call__(self, frame, event, arg) -> None:
        if event == "call" or event == "c_call":
            if _TQDM in frame.f_code.co_filename:  # a call into tqdm, or one tqdm makes
                self.tqdm_calls += 1
            else:
                self.calls += 1


class _CountSteps(Callback):
    """Counts the calls between the ends of batches ``COUNTED_FROM`` and ``STEPS``."""

    def __init__(self, counter: _Counter) -> None:
        self.counter = counter

    def on_batch_end(self, state) -> None:
        if state.timestamp.batch == COUNTED_FROM:
            sys.setprofile(self.counter)
        elif state.timestamp.batch == STEPS:
            sys.setprofile(None)


def _trainer_calls_per_step() -> tuple[float, float]:
    """(calls per step outside tqdm, calls per step inside tqdm) of a Trainer step."""
    counter = _Counter()
    torch.manual_seed(0)
    trainer = Trainer(
        Net(),
        _loader(),
        f"{STEPS}ba",
        optimizers=lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
        # Registered first so that its on_batch_end runs last (pluggy calls the last registered first): the
        # other plugins' batch-end work is counted.
        callbacks={
            "count": _CountSteps(counter),
            "speed_monitor": SpeedMonitor(),
            "progress_bar": ProgressBar(force=True),
        },
        loggers={"console": ConsoleLogger(log_interval="10ba")},
        eval_interval=None,
    )
    try:
        trainer.fit()
    finally:
        sys.setprofile(None)
    return counter.calls / (STEPS - COUNTED_FROM), counter.tqdm_calls / (STEPS - COUNTED_FROM)


def _bare_calls_per_step() -> float:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    batches = iter(_loader())
    running = torch.zeros(())
    logged = []
    counter = _Counter()

    def step(i: int) -> None:
        nonlocal running
        batch = next(batches)
        opt.zero_grad(set_to_none=True)
        loss = model.loss(model(batch), batch)
        loss.backward()
        opt.step()
        running += loss.detach()
        if i % 10 == 0:
            logged.append(float(running) / 10)
            running.zero_()

    for i in range(1, COUNTED_FROM + 1):
        step(i)
    sys.setprofile(counter)
    try:
        for i in range(COUNTED_FROM + 1, STEPS + 1):
            step(i)
    finally:
        sys.setprofile(None)
    return counter.calls / (STEPS - COUNTED_FROM)


def test_trainer_step_makes_few_calls_beyond_a_bare_loop(capsys):
    trainer, tqdm_calls = _trainer_calls_per_step()
    extra = trainer - _bare_calls_per_step()
    capsys.readouterr()
    assert 0 < extra <= MAX_EXTRA_CALLS_PER_STEP, (
        f"a Trainer step makes {extra:.1f} Python calls more than a bare loop (bound {MAX_EXTRA_CALLS_PER_STEP}); "
        "profile it with bench/trainer_overhead.py's method (README, trainer overhead) to find the new per-step work"
    )
    assert 0 < tqdm_calls <= MAX_TQDM_CALLS_PER_STEP, (
        f"tqdm makes {tqdm_calls:.1f} calls per step (bound {MAX_TQDM_CALLS_PER_STEP}): is the bar redrawn more often?"
    )
