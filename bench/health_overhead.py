"""What smalti-health's trainer plugins cost per step, and how fast the hang watchdog reports a hung rank.

1. Trains an MLP (about 10 ms a step on CPU) with every health plugin (hang watchdog, straggler detector,
   throughput alarm, GPU monitor) registered, and takes them out of the plugin manager and back in every
   ``--block`` batches, so "on" and "off" steps alternate within one run; prints the median step time of
   each phase and the ratio on/off (goal: <= 1.01). The same is done, in the same rounds, with one callback
   that does nothing, as a control: it shows how far the method itself moves the ratio on this machine.
2. Runs 2 gloo ranks under torchrun where rank 1 hangs inside a step, with the watchdog at ``--timeout``
   seconds; prints the time from the hang to the merged report on disk (the report file's mtime, i.e. when
   the last rank finished writing it; goal: within timeout + 5 s) and checks that it blames rank 1 alone.

Everything runs on the CPU (``device="cpu"``), also on a GPU host, so the gloo ranks never land on CUDA.

    python bench/health_overhead.py [--steps 400] [--rounds 6] [--block 20] [--timeout 5]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from smalti.core import Callback, Trainer
from smalti.health.gpu_monitor import GpuMonitor
from smalti.health.mfu_alarm import ThroughputAlarm
from smalti.health.straggler import StragglerDetector
from smalti.health.watchdog import HangWatchdog

sys.path.insert(0, str(Path(__file__).parent))
from trainer_overhead import Net, make_loader  # noqa: E402


def health_plugins(report_dir: str) -> dict[str, Callback]:
    return {
        "watchdog": HangWatchdog(timeout_s=600, report_dir=report_dir),
        "straggler": StragglerDetector(interval=50),
        "mfu_alarm": ThroughputAlarm(min_samples_per_sec=1.0, interval=50),
        "gpu_monitor": GpuMonitor(interval_s=60),
    }


class Toggle(Callback):
    """Takes the health plugins out of the plugin manager and puts them back every ``block`` batches.

    Both phases then run in one process on the same tensors, so a run's own speed (allocation, kernel choice,
    a neighbour on the machine) cancels out, which separate runs (spread of +-30% here) do not allow. Step
    times are wall time between consecutive batch ends, filed under the phase the step ran in.
    """

    def __init__(self, plugins: dict[str, Callback], block: int) -> None:
        self.plugins, self.block = plugins, block
        self.pm = None
        self.on = True
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self.last = 0.0

    def on_fit_start(self) -> None:
        self.last = time.perf_counter()

    def on_batch_end(self, state) -> None:
        step = time.perf_counter() - self.last
        if state.timestamp.batch > self.block:  # the first block is warm-up
            self.times[self.on].append(step)
        if state.timestamp.batch % self.block == 0:
            for name, plugin in self.plugins.items():
                if self.on:
                    self.pm.unregister(plugin)
                else:
                    self.pm.register(plugin, name=f"bench-{name}")
            self.on = not self.on
        self.last = time.perf_counter()


class NoOp(Callback):
    """The control: a callback that does nothing at batch end, toggled like the health plugins."""

    def on_batch_end(self) -> None:
        pass


def run(loader, width: int, plugins: dict[str, Callback], block: int) -> dict[bool, list[float]]:
    torch.manual_seed(0)
    toggle = Toggle(plugins, block)
    trainer = Trainer(Net(width), loader, f"{len(loader)}ba", optimizers=functools.partial(torch.optim.AdamW, lr=1e-4),
                      callbacks={**plugins, "toggle": toggle}, eval_interval=None, device="cpu")
    toggle.pm = trainer.pm
    trainer.fit()
    return toggle.times


def hang_worker(out: Path, timeout: float) -> None:
    """One rank of the hang measurement (run by torchrun): rank 1 sleeps in batch 5."""

    class Hang(Callback):
        def on_after_forward(self, state) -> None:
            if state.rank == 1 and state.timestamp.batch == 5:
                (out / "hang-started").write_text(str(time.time()))
                time.sleep(timeout * 10 + 60)

    torch.distributed.init_process_group("gloo")
    loader = make_loader(40, 8, 64)
    Trainer(Net(64), loader, "40ba", optimizers=functools.partial(torch.optim.SGD, lr=1e-3),
            callbacks={"hang": Hang(), "watchdog": HangWatchdog(timeout_s=timeout, report_dir=str(out), poll_s=0.2,
                                                                  grace_s=2.0)}, eval_interval=None,
            device="cpu").fit()


def time_to_report(timeout: float) -> float:
    from smalti.testing import run_torchrun

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        proc = run_torchrun(__file__, 2, ["--hang-worker", str(out), "--timeout", str(timeout)],
                            timeout=timeout * 4 + 120)
        if not (out / "hang-report.json").exists():
            raise SystemExit(f"no hang report; exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}")
        started = float((out / "hang-started").read_text())
        report = json.loads((out / "hang-report.json").read_text())
        reported = (out / "hang-report.json").stat().st_mtime
        print(f"watchdog: stuck ranks {report['stuck_ranks']} in {report['stuck_hooks']}, exit code {proc.returncode}")
        if report["stuck_ranks"] != [1]:
            raise SystemExit(f"the watchdog blamed {report['stuck_ranks']}, not [1]: {json.dumps(report)[:3000]}")
        return reported - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=6, help="training runs")
    parser.add_argument("--block", type=int, default=20, help="batches per on or off phase")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--hang-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hang_worker:
        hang_worker(Path(args.hang_worker), args.timeout)
        return
    loader = make_loader(args.steps, args.batch, args.width)
    health: dict[bool, list[float]] = {True: [], False: []}
    control: dict[bool, list[float]] = {True: [], False: []}
    health_runs, control_runs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for plugins, pooled, runs in ((health_plugins(tmp), health, health_runs),
                                          ({"noop": NoOp()}, control, control_runs)):
                times = run(loader, args.width, plugins, args.block)
                for phase in (True, False):
                    pooled[phase] += times[phase]
                runs.append(statistics.median(times[True]) / statistics.median(times[False]))
    o, n = statistics.median(health[False]) * 1e3, statistics.median(health[True]) * 1e3
    ratio = n / o
    control_ratio = statistics.median(control[True]) / statistics.median(control[False])
    print(f"health plugins off  median step {o:7.3f} ms  ({len(health[False])} steps)")
    print(f"health plugins on   median step {n:7.3f} ms  ({len(health[True])} steps; watchdog, straggler, mfu_alarm, "
          "gpu_monitor)")
    print("per-run ratios on / off: " + ", ".join(f"{r:.4f}" for r in health_runs))
    print(f"ratio on / off = {ratio:.4f} (pooled medians; median of runs {statistics.median(health_runs):.4f})"
          "   (goal <= 1.01)")
    print(f"control, one no-op callback toggled the same way: {control_ratio:.4f} (median of runs "
          f"{statistics.median(control_runs):.4f}); health beyond the control: {ratio / control_ratio:.4f}")
    seconds = time_to_report(args.timeout)
    print(f"hang to watchdog report: {seconds:.2f} s with timeout {args.timeout:g} s   (goal <= {args.timeout + 5:g} s)")


if __name__ == "__main__":
    main()
