"""Per-rank logs: a console filter so rank 0 speaks for the run, and a merged, followable view of every rank's file.

Each rank writes ``<run dir>/rank<N>.log`` with lines prefixed ``[rank<N>]`` (``hydra.job_logging`` in
``train.yaml``); a submitit node agent writes ``agent-node<N>.log``. On the console, rank 0 prints everything
and the other ranks only warnings and errors, so the console is the merged view a user reads; the full merge,
time-ordered, is ``smalti-launch logs RUN``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from smalti.core.launch.errors import LaunchError

LOG_PATTERNS = ("rank*.log", "agent-node*.log")
_TIME = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3}"
_PREFIXED = re.compile(rf"^\[(?P<label>[\w\-/]+)\]\[(?P<time>{_TIME})\]")
_TIMED = re.compile(rf"^\[(?P<time>{_TIME})\]")


class RankConsoleFilter(logging.Filter):
    """Pass every record on rank 0; on other ranks only records at ``other_ranks_level`` or above."""

    def __init__(self, other_ranks_level: str | int = "WARNING") -> None:
        super().__init__()
        self.rank = int(os.environ.get("RANK", "0"))
        level = logging.getLevelName(other_ranks_level) if isinstance(other_ranks_level, str) else other_ranks_level
        self.level = int(level)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= self.level


@dataclass
class LogRecordLines:
    """One log record (its first line and any continuation lines, e.g. a traceback) from one file."""

    label: str
    time: str
    lines: list[str]
    order: int

    def render(self) -> str:
        """The record's lines, each starting with its ``[label]``."""
        return "\n".join(line if line.startswith(f"[{self.label}]") else f"[{self.label}] {line}" for line in self.lines)


def find_run_dir(run: str, root: str | os.PathLike[str] = "outputs") -> Path:
    """The folder holding ``run``'s logs: ``run`` itself if it is a folder, else ``<root>/<run>``, else ``multirun/<run>``."""
    candidates = [Path(run), Path(root) / run, Path("multirun") / run]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    known = sorted(p.name for p in Path(root).iterdir() if p.is_dir()) if Path(root).is_dir() else []
    raise LaunchError(
        f"no run folder for {run!r}: looked at {', '.join(str(c) for c in candidates)}"
        + (f"; runs under {root}: {', '.join(known)}" if known else "")
    )


def log_files(run_dir: Path) -> list[Path]:
    """Every per-rank and agent log under ``run_dir`` (sweep points included), ranks in numeric order."""
    files = {p for pattern in LOG_PATTERNS for p in run_dir.rglob(pattern)}

    def key(p: Path) -> tuple[str, int, int, str]:
        number = int(re.sub(r"\D", "", p.stem) or 0)
        return (str(p.parent), 0 if p.stem.startswith("rank") else 1, number, p.name)

    return sorted(files, key=key)


def label_for(path: Path, run_dir: Path) -> str:
    """``rank3`` or ``agent-node0``, with the sweep point's sub-folder in front when there is one."""
    parent = path.parent.relative_to(run_dir) if path.parent != run_dir else None
    return f"{parent.as_posix()}/{path.stem}" if parent else path.stem


def parse_records(lines: Iterable[str], label: str, order: int) -> list[LogRecordLines]:
    """Group ``lines`` into records: a timestamped line starts one, other lines continue the previous one."""
    records: list[LogRecordLines] = []
    for line in lines:
        match = _PREFIXED.match(line) or _TIMED.match(line)
        if match or not records:
            records.append(LogRecordLines(label, match["time"] if match else "", [line], order))
        else:
            records[-1].lines.append(line)
    return records


def merged(records: Iterable[LogRecordLines]) -> list[LogRecordLines]:
    """Records in time order; ties keep rank order, then file order."""
    return sorted(records, key=lambda r: (r.time, r.order))


class LogFollower:
    """Reads what was appended to a run's log files since the last :meth:`poll`, picking up new files as they appear."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}

    def poll(self) -> list[LogRecordLines]:
        """New complete records from every file, merged in time order."""
        records: list[LogRecordLines] = []
        for order, path in enumerate(log_files(self.run_dir)):
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    f.seek(self._offsets.get(path, 0))
                    chunk = f.read()
                    self._offsets[path] = f.tell()
            except FileNotFoundError:
                continue
            text = self._partial.pop(path, "") + chunk
            complete, _, rest = text.rpartition("\n")
            if rest:
                self._partial[path] = rest
            if complete or text.endswith("\n"):
                lines = complete.split("\n") if complete else [""]
                records.extend(parse_records(lines, label_for(path, self.run_dir), order))
        return merged(records)


def show_logs(
    run_dir: Path,
    out: TextIO | None = None,
    follow: bool = True,
    interval_s: float = 0.5,
    stop: Callable[[], bool] | None = None,
) -> int:
    """Print the merged logs of ``run_dir``; with ``follow``, keep printing new lines until ``stop()`` or Ctrl-C."""
    out = out or sys.stdout
    follower = LogFollower(run_dir)
    if not log_files(run_dir) and not follow:
        raise LaunchError(f"no log files ({', '.join(LOG_PATTERNS)}) under {run_dir}")
    try:
        while True:
            for record in follower.poll():
                print(record.render(), file=out)
            out.flush()
            if not follow or (stop is not None and stop()):
                return 0
            time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0
