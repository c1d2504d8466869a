"""Trains a small regressor on 2 gloo ranks (DDP) with health plugins; one rank is made slow or hung.

    slow_rank_run.py hang OUT_DIR      rank 1 sleeps 120 s inside batch 3: the watchdog must end the run
    slow_rank_run.py hang_late OUT_DIR rank 1 sleeps in on_batch_end of batch 3, in a callback dispatched after
                                       the watchdog's own on_batch_end (which has already counted the batch)
    slow_rank_run.py straggle OUT_DIR  four runs, one after the other in the same process group (one start-up
                                       for all), each writing OUT_DIR/<run>/flagged-rank{r}.json:
        slow-3          rank 1's forward takes 3 times longer: the straggler detector flags it
        even-1          nobody is slow
        warmup-default  rank 1's first forward takes 1 s longer (a warm-up), then nobody is slow; the detector
        warmup-0        leaves its default (one interval) or 0 batches out
"""

import json
import sys
import time
from pathlib import Path

import torch

from smalti.core import Callback, Trainer, distributed
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.core.loggers.jsonl import JSONLLogger
from smalti.health.straggler import StragglerDetector
from smalti.health.watchdog import HangWatchdog

mode, out = sys.argv[1], Path(sys.argv[2])
STRAGGLE_RUNS = ("slow-3", "even-1", "warmup-default", "warmup-0")


class PacedMLP(MLPRegressor):
    """The example regressor with a fixed wall time per forward (times ``factor`` on rank 1): stable timings."""

    def __init__(self, rank: int, mode: str, factor: float) -> None:
        super().__init__()
        # 50 ms steps, so that a loaded machine's jitter stays far below factor 1.5 (at 10 ms the slow run
        # missed a window now and then on a loaded 2-core host)
        self.pace = 0.05 * (factor if rank == 1 else 1.0)
        self.warmup = 1.0 if mode == "warmup" and rank == 1 else 0.0

    def forward(self, batch):
        time.sleep(self.pace + self.warmup)
        self.warmup = 0.0
        return super().forward(batch)


class HangOnRank1(Callback):
    def on_after_forward(self, state) -> None:
        if state.rank == 1 and state.timestamp.batch == 3:
            (out / "hang-started").write_text(str(time.time()))
            time.sleep(120)


class HangAtBatchEndOnRank1(Callback):
    def on_batch_end(self, state) -> None:
        if state.rank == 1 and state.timestamp.batch == 3:
            (out / "hang-started").write_text(str(time.time()))
            time.sleep(120)


def fit(mode: str, out: Path, factor: float = 1.0, warmup_batches: int | None = None) -> StragglerDetector:
    """One 20-batch run of the paced regressor, the callbacks ``mode`` asks for; returns its straggler detector."""
    loader = build_dataloader(SyntheticRegression(512), 8, dp_rank=rank, dp_world_size=2, seed=0)
    torch.manual_seed(0)
    straggler = StragglerDetector(interval=5, factor=1.5, warmup_batches=warmup_batches)
    watchdog = HangWatchdog(timeout_s=3, report_dir=str(out), poll_s=0.2, grace_s=2.0)
    # config order is dispatch order: "hang" runs before the watchdog's hooks, "late" after them
    callbacks = {"hang": HangOnRank1(), "watchdog": watchdog}
    if mode == "hang_late":
        callbacks = {"watchdog": watchdog, "late": HangAtBatchEndOnRank1()}
    elif mode != "hang":
        callbacks = {"straggler": straggler}
    loggers = {"jsonl": JSONLLogger(str(out / "metrics.jsonl"))} if mode.startswith("hang") else {}
    Trainer(PacedMLP(rank, mode, factor), loader, "20ba", optimizers=lambda p: torch.optim.SGD(p, lr=1e-2),
            callbacks=callbacks, loggers=loggers).fit()
    return straggler


torch.distributed.init_process_group("gloo")
rank = torch.distributed.get_rank()
if mode == "straggle":
    for run in STRAGGLE_RUNS:
        kind, arg = run.split("-")
        run_out = out / run
        run_out.mkdir(exist_ok=True)
        if kind == "warmup":
            straggler = fit(kind, run_out, warmup_batches=None if arg == "default" else int(arg))
        else:
            straggler = fit(kind, run_out, factor=float(arg))
        (run_out / f"flagged-rank{rank}.json").write_text(json.dumps(straggler.flagged))
else:
    fit(mode, out)
distributed.shutdown()  # gloo aborts at exit ("terminate called without an active exception") if left running
