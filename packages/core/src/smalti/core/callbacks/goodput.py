"""Goodput across every restart of a run: productive step time over wall time, and where the rest went.

Google's ml-goodput-measurement is the anchor for the categories: start-up, checkpoint load and save, data
loading waits, evaluation, work redone after a restart (progress lost to a disruption), and the time between
attempts. Each attempt (one process, rank 0) appends timestamped records to ``outputs/<run>/goodput.jsonl``;
:func:`read_goodput` puts the attempts together and ``smalti-launch logs RUN --goodput`` prints the table.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smalti.core.config.types import NonNegativeFloat
from smalti.core.errors import ConfigError, SmaltiError
from smalti.core.plugins import Callback, hookimpl

log = logging.getLogger(__name__)

FILE_NAME = "goodput.jsonl"
#: Where one attempt's seconds go, from its process start to its last record (they add up to that span).
PHASES = ("startup", "checkpoint_load", "data", "step", "eval", "checkpoint_save", "other")
#: The run's breakdown: productive steps, the phases but ``step`` split into productive and redone, the gaps.
CATEGORIES = (
    "productive",
    "startup",
    "checkpoint_load",
    "checkpoint_save",
    "data",
    "eval",
    "redone",
    "idle",
    "other",
)
LABELS = {
    "productive": "productive steps",
    "startup": "start-up",
    "checkpoint_load": "checkpoint load",
    "checkpoint_save": "checkpoint save",
    "data": "data loading waits",
    "eval": "evaluation",
    "redone": "redone after a restart",
    "idle": "between attempts",
    "other": "other",
}


def process_start_time() -> float | None:
    """This process's start as a Unix time (Linux ``/proc``), or ``None`` where it cannot be read.

    Its age is measured on the boot clock (``/proc/uptime`` less the start tick in ``/proc/self/stat``), both
    read now, so the answer does not inherit ``btime``'s whole-second rounding or the wall clock's drift.
    """
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime: field 22 of stat, counted after the ")" ending the command name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class Goodput(Callback):
    """Records where this attempt's time goes and, at fit end, logs the goodput of every attempt of the run.

    Rank 0 appends a JSON line to ``path`` (default ``outputs/<run>/goodput.jsonl``) after the checkpoint
    load, after every checkpoint save and evaluation, every ``flush_interval_s`` seconds at a batch end, on an
    exception and at fit end; each line holds this attempt's cumulative seconds per phase since its process
    started, the batch reached and the batch it resumed from, and is flushed, so a killed attempt keeps
    everything up to its last line. Phases: ``startup`` (process start to the first batch request, less the
    load), ``checkpoint_load`` (all ``on_before_load`` hooks), ``data`` (waiting for the train dataloader),
    ``step`` (the rest of the loop), ``eval`` (``on_eval_before_all`` to ``on_eval_after_all``),
    ``checkpoint_save`` (checkpoint events and fit end when a checkpoint was requested), ``other``.

    At fit end it logs ``goodput/ratio`` (productive step seconds over wall seconds since the first attempt's
    process start) and ``goodput/<category>_s`` for each of :data:`CATEGORIES`, where ``redone`` is the step
    time an attempt spent past the batch that a later attempt resumed from, and ``idle`` the time between
    one attempt's last line and the next one's process start; plus ``goodput/wall_s`` and ``goodput/attempts``.

    ``started_at`` (a Unix time) replaces the process start as this attempt's start: for a launcher that knows
    when the job began, or for several attempts in one process (one ``Trainer`` each).
    """

    def __init__(
        self, path: str | None = None, flush_interval_s: NonNegativeFloat = 30.0, started_at: NonNegativeFloat | None = None
    ) -> None:
        if flush_interval_s < 0:
            raise ConfigError(f"callbacks.goodput.flush_interval_s={flush_interval_s} must be >= 0")
        self.path = Path(path) if path else None
        self.flush_interval_s = float(flush_interval_s)
        self.attempt = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        now_wall, now = time.time(), time.perf_counter()
        started = process_start_time() if started_at is None else float(started_at)
        self.process_start = started if started is not None and started <= now_wall else now_wall
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._phase = "startup"
        self._mark = now - (now_wall - self.process_start)  # perf_counter reading at the process start
        self._resumed_from: int | None = None
        self._file: Any = None
        self._active = True
        self._last_write = now
        self.report: GoodputReport | None = None

    # ------------------------------------------------------------------ phase accounting

    def _switch(self, phase: str) -> str:
        """Charge the time since the last switch to the current phase; start ``phase``. Returns the old one."""
        now = time.perf_counter()
        self.seconds[self._phase] += now - self._mark
        self._mark, previous, self._phase = now, self._phase, phase
        return previous

    def _during(self, phase: str) -> Iterator[None]:
        """A hook wrapper's body: every implementation of the wrapped hook runs in ``phase``."""
        previous = self._switch(phase)
        try:
            yield
        finally:
            self._switch(previous)

    # ------------------------------------------------------------------ the record file

    def on_init(self, state: Any) -> None:
        self._active = state.rank == 0
        if not self._active:
            return
        if self.path is None:
            self.path = Path(state.output_dir) / FILE_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole attempt

    def _write(self, state: Any, event: str) -> None:
        if self._file is None:
            return
        self._switch(self._phase)
        record = {
            "attempt": self.attempt,
            "event": event,
            "time": time.time(),
            "process_start": self.process_start,
            "batch": state.timestamp.batch,
            "resumed_from": self._resumed_from,
            "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
        }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._last_write = self._mark

    @hookimpl(wrapper=True, specname="on_before_load")
    def time_checkpoint_load(self) -> Any:
        """Every ``on_before_load`` implementation (a checkpoint plugin loads there) counts as checkpoint load."""
        yield from self._during("checkpoint_load")
        return None

    def on_after_load(self, state: Any) -> None:
        self._resumed_from = state.timestamp.batch
        self._write(state, "loaded")

    # ------------------------------------------------------------------ the loop

    def on_epoch_start(self) -> None:
        self._switch("data")  # iter(loader) (worker start-up) follows

    def on_before_dataloader(self) -> None:
        self._switch("data")

    def on_after_dataloader(self) -> None:
        self._switch("step")

    def on_batch_end(self, state: Any) -> None:
        if self._file is not None and time.perf_counter() - self._last_write >= self.flush_interval_s:
            self._write(state, "batch")

    @hookimpl(wrapper=True, specname="on_eval_before_all")
    def time_eval_start(self) -> Any:
        self._switch("eval")
        return (yield)

    @hookimpl(wrapper=True, specname="on_eval_after_all")
    def time_eval_end(self, state: Any) -> Any:
        try:
            return (yield)
        finally:
            self._switch("step")
            self._write(state, "eval")

    def _timed_save(self, state: Any) -> Iterator[None]:
        if not state.checkpoint_requested:
            yield
            return
        yield from self._during("checkpoint_save")
        self._write(state, "checkpoint")

    @hookimpl(wrapper=True, specname="on_batch_checkpoint")
    def time_batch_checkpoint(self, state: Any) -> Any:
        """Every ``on_batch_checkpoint`` implementation on a step that checkpoints counts as checkpoint save."""
        yield from self._timed_save(state)
        return None

    @hookimpl(wrapper=True, specname="on_epoch_checkpoint")
    def time_epoch_checkpoint(self, state: Any) -> Any:
        yield from self._timed_save(state)
        return None

    @hookimpl(wrapper=True, specname="on_fit_end")
    def time_fit_end(self, state: Any, logger: Any) -> Any:
        """Fit end's hooks are a checkpoint save when one was requested (and waits for async saves), else other;
        then the attempt's last record and the run's goodput."""
        self._switch("checkpoint_save" if state.checkpoint_requested else "other")
        try:
            yield
        finally:
            self._switch("other")
            self._write(state, "fit_end")
        if self._file is not None and self.path is not None:
            self.report = read_goodput(self.path)
            logger.log_metrics(self.report.metrics())
        return None

    def on_exception(self, state: Any) -> None:
        self._write(state, "exception")

    def on_close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ---------------------------------------------------------------------- reading the records


@dataclass
class Attempt:
    """One process's records: its id, start, last record and ``(batch, cumulative step seconds)`` points."""

    attempt: str
    process_start: float
    end: float = 0.0
    batch: int = 0
    resumed_from: int | None = None
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    steps: list[tuple[int, float]] = field(default_factory=list)
    finished: bool = False
    redone: float = 0.0
    idle_before: float = 0.0

    @property
    def wall(self) -> float:
        return self.end - self.process_start

    def step_seconds_after(self, batch: int) -> float:
        """Step seconds this attempt spent past ``batch`` (interpolated between records, exact at a record)."""
        total = self.seconds["step"]
        points = [(b, s) for b, s in self.steps if b <= batch]
        if not points:
            return total
        b0, s0 = points[-1]
        later = [(b, s) for b, s in self.steps if b > batch]
        if later and later[0][0] > b0:
            b1, s1 = later[0]
            s0 += (s1 - s0) * (batch - b0) / (b1 - b0)
        return max(0.0, total - s0)

    def categories(self) -> dict[str, float]:
        """This attempt's seconds by :data:`CATEGORIES`; they add up to its wall time plus the idle gap before it."""
        s = self.seconds
        return {
            "productive": s["step"] - self.redone,
            "startup": s["startup"],
            "checkpoint_load": s["checkpoint_load"],
            "checkpoint_save": s["checkpoint_save"],
            "data": s["data"],
            "eval": s["eval"],
            "redone": self.redone,
            "idle": self.idle_before,
            "other": s["other"] + max(0.0, self.wall - sum(s.values())),
        }


@dataclass
class GoodputReport:
    """Every attempt of a run, in start order, with the redone work and gaps between them worked out."""

    attempts: list[Attempt]

    def totals(self) -> dict[str, float]:
        out = dict.fromkeys(CATEGORIES, 0.0)
        for attempt in self.attempts:
            for key, value in attempt.categories().items():
                out[key] += value
        return out

    @property
    def wall(self) -> float:
        """Seconds from the first attempt's process start to the last record of the last attempt."""
        return self.attempts[-1].end - self.attempts[0].process_start if self.attempts else 0.0

    @property
    def ratio(self) -> float:
        return self.totals()["productive"] / self.wall if self.wall > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        """``goodput/ratio``, ``goodput/wall_s``, ``goodput/attempts`` and ``goodput/<category>_s``."""
        metrics = {
            "goodput/ratio": self.ratio,
            "goodput/wall_s": self.wall,
            "goodput/attempts": len(self.attempts),
        }
        metrics.update({f"goodput/{k}_s": v for k, v in self.totals().items()})
        return metrics


def read_goodput(path: str | os.PathLike[str]) -> GoodputReport:
    """Read ``goodput.jsonl`` (a run's records, every attempt appending) into a :class:`GoodputReport`.

    A truncated last line (an attempt killed while writing) is skipped; any other bad line raises a
    :class:`~smalti.core.errors.SmaltiError` naming the file and line.
    """
    path = Path(path)
    attempts: dict[str, Attempt] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            key = record["attempt"]
            attempt = attempts.setdefault(key, Attempt(key, float(record["process_start"])))
            attempt.end = float(record["time"])
            attempt.batch = int(record["batch"])
            attempt.resumed_from = record.get("resumed_from", attempt.resumed_from)
            attempt.seconds = {k: float(record["seconds"].get(k, 0.0)) for k in PHASES}
            attempt.steps.append((attempt.batch, attempt.seconds["step"]))
            attempt.finished = attempt.finished or record.get("event") == "fit_end"
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if number == len(lines):
                log.warning("%s: skipping its last line, cut short (%s)", path, exc)
                continue
            raise SmaltiError(f"{path}:{number}: not a goodput record ({exc}): {line[:120]!r}") from None
    ordered = sorted(attempts.values(), key=lambda a: a.process_start)
    for before, after in zip(ordered, ordered[1:]):
        after.idle_before = max(0.0, after.process_start - before.end)
        if after.resumed_from is not None:
            before.redone = before.step_seconds_after(after.resumed_from)
    return GoodputReport(ordered)


def run_goodput_files(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Every ``goodput.jsonl`` under a run folder (a sweep's points each have one)."""
    return sorted(Path(run_dir).rglob(FILE_NAME))
