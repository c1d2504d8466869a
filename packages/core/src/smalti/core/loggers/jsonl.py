"""Writes every logged metric, the hyperparameters and artifact notes as JSON lines to a local file."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import IO, Any

from smalti.core import distributed
from smalti.core.plugins import LoggerDestination

log = logging.getLogger(__name__)


class JSONLLogger(LoggerDestination):
    """One JSON object per line: ``{"kind": "metrics", "step", "time", "metrics"}``, ``"hparams"`` and ``"artifact"``.

    The file is opened on first use (rank 0 only by default; other ranks write ``<stem>.rank<N>.jsonl`` when
    ``rank_zero_only`` is false). Each line is handed to the operating system as soon as it is written (one
    ``write`` call per line, a few microseconds: ``bench/trainer_overhead.py`` measures it), so a process
    killed with SIGKILL loses at most the line being written; no ``fsync``, so a power cut may lose more.
    """

    def __init__(self, path: str = "metrics.jsonl", rank_zero_only: bool = True) -> None:
        self.path = Path(path)
        self.rank_zero_only = rank_zero_only
        self._file: IO[str] | None = None
        self._lines = 0
        #: Writes that failed (disk full, path not writable); reported with a warning, never raised.
        self.failures = 0

    def _open(self) -> IO[str] | None:
        if self._file is None:
            rank = distributed.get_rank()
            if self.rank_zero_only and rank != 0:
                return None
            path = self.path if rank == 0 else self.path.with_name(f"{self.path.stem}.rank{rank}{self.path.suffix}")
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run
        return self._file

    def _write(self, record: dict[str, Any]) -> None:
        try:
            f = self._open()
            if f is None:
                return
            f.write(json.dumps(record, default=_jsonable) + "\n")
            self._lines += 1
            self._written(f)
        except (OSError, TypeError, ValueError) as exc:  # a full disk must not end training
            self.failures += 1
            if self.failures == 1 or self.failures % 1000 == 0:
                log.warning("JSONLLogger could not write %s (failure %d; training goes on): %r", self.path,
                            self.failures, exc)

    def _written(self, f: IO[str]) -> None:
        """After each line: push it to the OS, so a kill never loses a line that was complete."""
        f.flush()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._write({"kind": "metrics", "step": step, "time": time.time(), "metrics": metrics})

    def log_hyperparameters(self, params: dict[str, Any]) -> None:
        self._write({"kind": "hparams", "time": time.time(), "params": params})

    def log_artifact(self, local_path: str, name: str) -> None:
        self._write({"kind": "artifact", "time": time.time(), "name": name, "path": os.path.abspath(local_path)})

    def flush(self, timeout: float = 30.0) -> bool:
        """Push buffered lines to the file now (a watchdog about to end the process calls this)."""
        if self._file is not None:
            self._file.flush()
        return True

    def on_close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                log.warning("JSONLLogger could not flush %s at close: %r", self.path, exc)
            self._file = None


def _jsonable(value: Any) -> Any:
    """Tensors and NumPy scalars as numbers; anything else as its string."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def read_jsonl(path: str | os.PathLike[str], kind: str = "metrics") -> list[dict[str, Any]]:
    """The records of ``kind`` in a JSONL log, in order."""
    with open(path, encoding="utf-8") as f:
        return [rec for line in f if line.strip() and (rec := json.loads(line)).get("kind") == kind]
