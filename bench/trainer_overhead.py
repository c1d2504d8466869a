"""How much the smalti Trainer costs over a bare PyTorch loop, and what the MLflow logger adds.

Trains the same MLP on the same batches with (a) a bare PyTorch loop and (b) ``smalti.core.Trainer`` with
the console logger, speed monitor and progress bar on, alternating rounds so both see the same machine
noise. Prints the median step time of each and the ratio ``smalti / bare`` (goal: <= 1.03 for a ~10 ms
step on CPU). Then the same Trainer with an MLflow logger sending to a real ``mlflow server`` on loopback
against it without (goal: <= 1.02). Then the JSONL logger as shipped (every line handed to the OS at once,
so a SIGKILL loses at most the line being written) against the same logger buffering 100 lines between
flushes (what it did before): the end-to-end ratio, and the flush cost per step measured directly (the
time of the logger's writes with and without flushing, for the lines one step logs) as a share of the step
(goal < 1%).

    python bench/trainer_overhead.py [--steps 150] [--rounds 4] [--no-mlflow] [--no-jsonl]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from smalti.core import Callback, Trainer
from smalti.core.callbacks import ProgressBar, SpeedMonitor
from smalti.core.loggers import ConsoleLogger, JSONLLogger


class Net(nn.Module):
    """An MLP sized so that one step takes about 10 ms on two CPU cores."""

    def __init__(self, width: int = 1024, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 16)

    def forward(self, batch):
        x = batch[0]
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss(self, outputs, batch):
        return nn.functional.mse_loss(outputs, batch[1])


def make_loader(steps: int, batch: int, width: int) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, width, generator=gen)
    y = torch.randn(steps * batch, 16, generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False, drop_last=True)


def bare_loop(loader: DataLoader, width: int) -> list[float]:
    torch.manual_seed(0)
    model = Net(width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    last = time.perf_counter()
    for batch in loader:
        opt.zero_grad(set_to_none=True)
        loss = model.loss(model(batch), batch)
        loss.backward()
        opt.step()
        float(loss)  # a real loop logs its loss
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


class StepTimer(Callback):
    """Wall time between consecutive batch ends: the whole cost of a step, hooks and loggers included."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.last = 0.0

    def on_fit_start(self) -> None:
        self.last = time.perf_counter()

    def on_batch_end(self) -> None:
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now


def smalti_loop(loader: DataLoader, width: int, extra_loggers: dict | None = None) -> list[float]:
    torch.manual_seed(0)
    timer = StepTimer()
    loggers = {"console": ConsoleLogger(log_interval="50ba"), **(extra_loggers or {})}
    Trainer(
        Net(width),
        loader,
        f"{len(loader)}ba",
        optimizers=functools.partial(torch.optim.AdamW, lr=1e-4),
        callbacks={"speed_monitor": SpeedMonitor(window_size=50), "progress_bar": ProgressBar(force=True),
                   "timer": timer},
        loggers=loggers,
        eval_interval=None,
    ).fit()
    return timer.times


class BufferedJSONL(JSONLLogger):
    """The JSONL logger as it was: flushed every 100 lines only (a kill lost up to 99 lines)."""

    def _written(self, f) -> None:
        if self._lines % 100 == 0:
            f.flush()


class LineCounter(Callback):
    """Counts the metrics lines a step logs (the JSONL logger writes one line per ``log_metrics`` call)."""

    def __init__(self) -> None:
        self.calls = 0

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.calls += 1


def write_cost_us(logger_cls: type[JSONLLogger], path: Path, lines: int, metrics: dict) -> float:
    """Microseconds per ``log_metrics`` call of ``logger_cls`` writing ``lines`` lines to ``path``."""
    logger = logger_cls(str(path))
    logger.log_metrics(metrics, 0)  # opens the file
    start = time.perf_counter()
    for step in range(lines):
        logger.log_metrics(metrics, step)
    elapsed = time.perf_counter() - start
    logger.on_close()
    return elapsed / lines * 1e6


def jsonl_section(loader: DataLoader, width: int, rounds: int, warmup: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        buffered, flushed, counts = [], [], []
        for i in range(rounds):
            counter = LineCounter()
            buffered += smalti_loop(loader, width, {"jsonl": BufferedJSONL(f"{tmp}/b{i}.jsonl")})[warmup:]
            flushed += smalti_loop(loader, width, {"jsonl": JSONLLogger(f"{tmp}/f{i}.jsonl"),
                                                   "counter": counter})[warmup:]
            counts.append(counter.calls / len(loader))
        metrics = {"loss/train/total": 0.123456, "throughput/samples_per_sec": 1234.5, "lr-AdamW/group0": 1e-4}
        per_line = []
        for i in range(rounds):
            b = write_cost_us(BufferedJSONL, Path(tmp) / f"mb{i}.jsonl", 20000, metrics)
            f = write_cost_us(JSONLLogger, Path(tmp) / f"mf{i}.jsonl", 20000, metrics)
            per_line.append(f - b)
    b_ms, f_ms = median_ms(buffered, 0), median_ms(flushed, 0)
    lines_per_step = statistics.median(counts)
    flush_us = statistics.median(per_line)
    share = flush_us * lines_per_step / (f_ms * 1e3)
    print(f"\nsmalti + JSONL buffered (100 lines)  median step {b_ms:7.3f} ms")
    print(f"smalti + JSONL flushed every line    median step {f_ms:7.3f} ms")
    print(f"ratio flushed / buffered = {f_ms / b_ms:.3f}   (end to end: on a busy machine its noise exceeds the flush "
          "cost; the line below measures the flush directly)")
    print(f"flush cost: {flush_us:.2f} us per line x {lines_per_step:.1f} lines per step = "
          f"{flush_us * lines_per_step:.1f} us per step = {100 * share:.3f}% of the step   (goal < 1%)")


def median_ms(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--no-mlflow", action="store_true")
    parser.add_argument("--no-jsonl", action="store_true")
    args = parser.parse_args()
    loader = make_loader(args.steps, args.batch, args.width)
    warmup = 10

    bare, ours = [], []
    for _ in range(args.rounds):
        bare += bare_loop(loader, args.width)[warmup:]
        ours += smalti_loop(loader, args.width)[warmup:]
    b, s = median_ms(bare, 0), median_ms(ours, 0)
    print(f"\nbare PyTorch loop   median step {b:7.3f} ms")
    print(f"smalti Trainer      median step {s:7.3f} ms  (console logger, speed monitor, progress bar)")
    print(f"ratio smalti / bare = {s / b:.3f}   (goal <= 1.03)")

    if not args.no_jsonl:
        jsonl_section(loader, args.width, args.rounds, warmup)
    if args.no_mlflow:
        return
    from smalti.core.loggers import MLflowLogger
    from smalti.testing.servers import start_mlflow_server

    with tempfile.TemporaryDirectory() as tmp:
        server = start_mlflow_server(Path(tmp))
        try:
            off, on = [], []
            for i in range(args.rounds):
                off += smalti_loop(loader, args.width)[warmup:]
                mlflow = MLflowLogger(tracking_uri=server.tracking_uri, experiment_name="bench", run_name=f"r{i}")
                on += smalti_loop(loader, args.width, {"mlflow": mlflow})[warmup:]
        finally:
            server.stop()
    off_ms, on_ms = median_ms(off, 0), median_ms(on, 0)
    print(f"\nsmalti without MLflow  median step {off_ms:7.3f} ms")
    print(f"smalti with MLflow     median step {on_ms:7.3f} ms  (real mlflow server on loopback, sqlite)")
    print(f"ratio mlflow on / off = {on_ms / off_ms:.3f}   (goal <= 1.02)")


if __name__ == "__main__":
    main()
