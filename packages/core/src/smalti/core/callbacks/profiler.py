"""``torch.profiler`` over a wait/warmup/active schedule: a Chrome trace per rank, and a summary across ranks."""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, TextIO

import torch

from smalti.core.config.types import NonNegativeInt, PositiveInt
from smalti.core.errors import ConfigError, SmaltiError
from smalti.core.plugins import Callback

log = logging.getLogger(__name__)

TRACE_GLOB = "rank*.step*.trace.json*"
#: Chrome-trace event categories summed by ``smalti profile summary``: CPU operators, GPU kernels, NCCL and memcpy.
OP_CATEGORIES = ("cpu_op", "user_annotation", "kernel", "gpu_memcpy", "gpu_memset")


class Profiler(Callback):
    """Profiles training steps with ``torch.profiler`` on a schedule of steps, as its ``schedule`` counts them.

    The first ``skip_first`` steps are ignored; then each cycle waits ``wait`` steps, warms up for ``warmup``
    (traced, discarded) and records ``active`` steps; ``repeat`` cycles (0: until the end). Each cycle writes
    ``<trace_dir>/rank<R>.step<N>.trace.json`` (a Chrome trace: open it in ``chrome://tracing`` or Perfetto;
    ``N`` is the last step recorded), logs it as an artifact, and logs ``profiler/traces`` (how many this
    rank wrote). CPU operators always; CUDA kernels, NCCL and memory copies on a GPU. ``profile_memory``
    adds allocations (shapes and sizes) to the trace. ``trace_dir`` defaults to ``traces`` in the run's folder (``state.output_dir``).
    Outside the active steps the profiler does no tracing; the steps it records run slower.
    ``smalti profile summary outputs/<run>`` lists the top operators by time over every rank's traces.
    """

    def __init__(self, wait: NonNegativeInt = 5, warmup: NonNegativeInt = 1, active: PositiveInt = 3, repeat: NonNegativeInt = 1, skip_first: NonNegativeInt = 0,
                 profile_memory: bool = False, record_shapes: bool = False, with_stack: bool = False,
                 trace_dir: str | None = None, gzip_traces: bool = False) -> None:
        for key, value, low in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1),
                                ("repeat", repeat, 0), ("skip_first", skip_first, 0)):
            if int(value) < low:
                raise ConfigError(f"callbacks.profiler.{key}={value} must be >= {low}")
        self.wait, self.warmup, self.active = int(wait), int(warmup), int(active)
        self.repeat, self.skip_first = int(repeat), int(skip_first)
        self.profile_memory = profile_memory
        self.record_shapes = record_shapes or profile_memory
        self.with_stack = with_stack
        self.trace_dir = trace_dir
        self.gzip_traces = gzip_traces
        self.traces: list[Path] = []
        self._prof: Any = None
        self._state: Any = None
        self._logger: Any = None

    def on_fit_start(self, state: Any, logger: Any) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self._state, self._logger = state, logger
        folder = Path(self.trace_dir) if self.trace_dir else Path(state.output_dir) / "traces"
        folder.mkdir(parents=True, exist_ok=True)
        self._folder = folder
        activities = [ProfilerActivity.CPU]
        if state.device.type == "cuda" and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat,
                              skip_first=self.skip_first),
            on_trace_ready=self._write,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        self._prof.start()

    def _write(self, prof: Any) -> None:
        state = self._state
        suffix = ".trace.json.gz" if self.gzip_traces else ".trace.json"
        path = self._folder / f"rank{state.rank}.step{state.timestamp.batch}{suffix}"
        partial = path.with_name(path.name + ".partial")
        prof.export_chrome_trace(str(partial))
        if self.gzip_traces:  # export_chrome_trace gzips by the name's ending; written under .partial, it did not
            with open(partial, "rb") as src, gzip.open(f"{partial}.gz", "wb") as dst:
                dst.write(src.read())
            os.replace(f"{partial}.gz", partial)
        os.replace(partial, path)  # a trace is never seen half-written
        self.traces.append(path)
        log.info("profiler trace of rank %d written to %s", state.rank, path)
        self._logger.log_artifact(str(path), name=f"traces/{path.name}")
        self._logger.log_metrics({"profiler/traces": float(len(self.traces))})

    def on_batch_end(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def on_fit_end(self) -> None:
        self._stop()

    def on_close(self) -> None:
        self._stop()

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.stop()


# ---------------------------------------------------------------------------------------------- summary


def _events(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return data.get("traceEvents", []) if isinstance(data, dict) else data


def summarize(run_dir: str | os.PathLike[str], top: int = 20) -> list[dict[str, Any]]:
    """The ``top`` operators by total time over every trace under ``run_dir`` (the run folder or its ``traces``).

    Each row: ``name``, ``category``, ``calls``, ``total_ms`` (summed over ranks and steps), ``mean_us`` per
    call, ``ranks`` (how many ranks ran it) and ``share`` of the category's total time.
    """
    root = Path(run_dir)
    files = sorted(root.rglob(TRACE_GLOB))
    if not files:
        raise SmaltiError(
            f"no profiler traces ({TRACE_GLOB}) under {root}; run with callbacks=[profiler] (its trace_dir "
            "defaults to outputs/<run>/traces) and give that run's folder"
        )
    calls: dict[tuple[str, str], int] = defaultdict(int)
    total: dict[tuple[str, str], float] = defaultdict(float)
    ranks: dict[tuple[str, str], set[str]] = defaultdict(set)
    by_category: dict[str, float] = defaultdict(float)
    for path in files:
        rank = path.name.split(".", 1)[0]
        try:
            events = _events(path)
        except (OSError, ValueError) as exc:
            raise SmaltiError(f"cannot read the profiler trace {path}: {exc}; delete it or profile again") from exc
        for ev in events:
            cat = ev.get("cat")
            if ev.get("ph") != "X" or cat not in OP_CATEGORIES:
                continue
            key = (str(ev.get("name")), str(cat))
            dur = float(ev.get("dur", 0.0))
            calls[key] += 1
            total[key] += dur
            ranks[key].add(rank)
            by_category[key[1]] += dur
    # user annotations (ProfilerStep#N, the optimizer's step) enclose operators: rank them after operators
    order = sorted(total, key=lambda k: (k[1] == "user_annotation", -total[k]))
    return [
        {"name": k[0], "category": k[1], "calls": calls[k], "total_ms": total[k] / 1000,
         "mean_us": total[k] / calls[k], "ranks": len(ranks[k]),
         "share": total[k] / by_category[k[1]] if by_category[k[1]] else 0.0}
        for k in order[:top]
    ]


def print_summary(rows: list[dict[str, Any]], out: TextIO) -> None:
    """A fixed-width table of :func:`summarize`'s rows."""
    print(f"{'total ms':>10} {'share':>6} {'calls':>7} {'mean us':>9} {'ranks':>5}  {'category':<15} name", file=out)
    for r in rows:
        print(f"{r['total_ms']:>10.2f} {r['share']:>6.1%} {r['calls']:>7d} {r['mean_us']:>9.1f} {r['ranks']:>5d}  "
              f"{r['category']:<15} {r['name']}", file=out)


def profile_main(argv: list[str], out: TextIO | None = None) -> int:
    """``smalti profile summary RUN_DIR [--top N]``: print the top operators across every rank's traces."""
    import sys

    parser = argparse.ArgumentParser(prog="smalti profile", description="read the traces the profiler callback wrote")
    verbs = parser.add_subparsers(dest="verb", required=True)
    summary = verbs.add_parser("summary", help="the top operators by time across every rank's traces")
    summary.add_argument("run_dir", help="the run's folder (outputs/<run>) or its traces folder")
    summary.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    try:
        rows = summarize(args.run_dir, args.top)
    except SmaltiError as exc:
        print(f"smalti profile summary: {exc}", file=sys.stderr)
        return 1
    print_summary(rows, out or sys.stdout)
    return 0
