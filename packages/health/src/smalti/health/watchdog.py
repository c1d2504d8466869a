"""Hang watchdog: when training makes no progress for ``timeout_s``, dump every rank's stacks and exit.

Every rank runs a daemon thread that watches the time since the last finished batch (train or eval). The
trainer hooks record which event each rank was last in. On a time-out each rank writes, into
``report_dir``, its own stacks (``faulthandler``, every thread) and a JSON line of where it was; after a
short grace period (until every rank has written) each rank merges what the ranks wrote into ``hang-report.json`` and
``hang-report.txt``, naming the rank(s) furthest behind as the stuck ones, and every rank exits with
:data:`HANG_EXIT_CODE` so torchrun's elastic agent restarts the group (and autoresume picks up the last
checkpoint). Nothing here uses a collective: the process group is what is hung. ``kill -USR2 PID`` dumps
a rank's stacks to stderr on demand (SIGUSR1 is left for checkpoint-on-signal).

Set ``timeout_s`` above the slowest legitimate pause between batches (a synchronous checkpoint save, an
eval pass with no batches); ``first_batch_timeout_s`` covers start-up (compilation, data download).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from smalti.core import Callback
from smalti.core.errors import ConfigError
from smalti.health.deadline import call_with_deadline

log = logging.getLogger(__name__)

#: Exit code of a rank the watchdog ended (any non-zero code makes torchrun restart the group).
HANG_EXIT_CODE = 124

#: The trainer events a step passes through, in order: a rank whose last event is earlier is further behind.
STEP_EVENTS = (
    "fit_start", "epoch_start", "before_dataloader", "after_dataloader", "batch_start", "before_forward",
    "after_forward", "before_backward", "after_backward", "before_optimizer_step", "after_optimizer_step",
    "batch_end", "eval_start", "eval_batch_end", "eval_end", "batch_checkpoint", "epoch_end",
)


def _recorder(event: str):
    def hook(self: HangWatchdog) -> None:
        self._last_event = event

    hook.__name__ = f"on_{event}"
    hook.__doc__ = f"Remember that this rank reached ``{event}``."
    return hook


class HangWatchdog(Callback):
    """Ends a run whose ranks stop making progress, with a report naming the stuck rank and its stacks."""

    def __init__(self, timeout_s: float = 600.0, first_batch_timeout_s: float | None = None,
                 report_dir: str | None = None, poll_s: float = 1.0, grace_s: float = 3.0,
                 exit_code: int = HANG_EXIT_CODE) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"health.watchdog.timeout_s={timeout_s} must be positive")
        if poll_s <= 0 or grace_s < 0:
            raise ConfigError(f"health.watchdog: poll_s={poll_s} must be positive and grace_s={grace_s} >= 0")
        self.timeout_s = float(timeout_s)
        self.first_batch_timeout_s = float(first_batch_timeout_s or timeout_s)
        self.report_dir = report_dir
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.exit_code = exit_code
        self._last_event = "init"
        self._last_progress = time.monotonic()
        self._batches_done = 0
        self._batch = 0
        self._rank, self._world = 0, 1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._run_name = "smalti-run"
        self.fired = False

    # ------------------------------------------------------------------ trainer hooks

    on_epoch_start = _recorder("epoch_start")
    on_before_dataloader = _recorder("before_dataloader")
    on_after_dataloader = _recorder("after_dataloader")
    on_batch_start = _recorder("batch_start")
    on_before_forward = _recorder("before_forward")
    on_after_forward = _recorder("after_forward")
    on_before_backward = _recorder("before_backward")
    on_after_backward = _recorder("after_backward")
    on_before_optimizer_step = _recorder("before_optimizer_step")
    on_after_optimizer_step = _recorder("after_optimizer_step")
    on_eval_start = _recorder("eval_start")
    on_eval_end = _recorder("eval_end")
    on_batch_checkpoint = _recorder("batch_checkpoint")
    on_epoch_end = _recorder("epoch_end")

    def on_fit_start(self, state: Any) -> None:
        """Start watching; register the on-demand stack dump."""
        self._rank, self._world = state.rank, state.world_size
        self._run_name = state.run_name
        self._last_event = "fit_start"
        self._batch = state.timestamp.batch
        self._last_progress = time.monotonic()
        if hasattr(signal, "SIGUSR2") and threading.current_thread() is threading.main_thread():
            faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="smalti-hang-watchdog", daemon=True)
        self._thread.start()

    def on_batch_end(self, state: Any) -> None:
        """A finished batch is progress."""
        self._progress("batch_end", state.timestamp.batch)

    def on_eval_batch_end(self, state: Any) -> None:
        """A finished eval batch is progress too (long evals must not look like hangs)."""
        self._progress("eval_batch_end", state.timestamp.batch)

    def on_fit_end(self) -> None:
        self._last_event = "fit_end"
        self._stop.set()

    def on_close(self) -> None:
        self._stop.set()

    def on_exception(self) -> None:
        self._stop.set()

    def _progress(self, event: str, batch: int) -> None:
        self._last_event = event
        self._batch = batch
        self._batches_done += 1
        self._last_progress = time.monotonic()

    # ------------------------------------------------------------------ the watching thread

    def _limit(self) -> float:
        return self.timeout_s if self._batches_done else self.first_batch_timeout_s

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self._last_progress
            if idle > self._limit():
                self._fire(idle)
                return

    def folder(self) -> Path:
        """Where the reports go: ``report_dir`` or ``./smalti-health/<run_name>``."""
        return Path(self.report_dir or Path("smalti-health") / self._run_name)

    def _fire(self, idle: float) -> None:
        self.fired = True
        folder = self.folder()
        folder.mkdir(parents=True, exist_ok=True)
        where = {
            "rank": self._rank, "world_size": self._world, "host": socket.gethostname(), "pid": os.getpid(),
            "batch": self._batch, "last_event": self._last_event, "seconds_without_progress": round(idle, 3),
            "timeout_s": self._limit(), "time": time.time(),
        }
        with open(folder / f"stacks-rank{self._rank}.txt", "w") as f:
            f.write(f"rank {self._rank} on {where['host']} pid {where['pid']}: no progress for {idle:.1f} s; "
                    f"last event {self._last_event} at batch {self._batch}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        _write_atomic(folder / f"rank{self._rank}.json", json.dumps(where))
        log.error("hang watchdog: rank %d made no progress for %.1f s (last event %s, batch %d); stacks in %s",
                  self._rank, idle, self._last_event, self._batch, folder)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and len(list(folder.glob("rank*.json"))) < self._world:
            time.sleep(0.1)
        # Every rank writes the merged report (atomically): the first to exit makes torchrun stop the others.
        write_hang_report(folder)
        _flush_loggers(self.grace_s)
        sys.stderr.flush()
        os._exit(self.exit_code)


def _flush_loggers(timeout_s: float) -> None:
    """Deliver what the run's queued loggers hold (best effort, bounded): the metrics up to the hang matter."""
    from smalti.core.plugins import LoggerDestination
    from smalti.core.plugins.manager import get_plugin_manager

    for plugin in get_plugin_manager().get_plugins():
        flush = getattr(plugin, "flush", None)
        if isinstance(plugin, LoggerDestination) and callable(flush):
            try:
                call_with_deadline(flush, timeout_s, deadline_s=timeout_s + 1, what="logger flush")
            except Exception as exc:  # a logger stuck on the network must not keep a hung rank alive
                log.warning("hang watchdog: could not flush %s: %s", type(plugin).__name__, exc)


def _position(entry: dict[str, Any]) -> tuple[int, int]:
    event = entry.get("last_event", "")
    return int(entry.get("batch", 0)), STEP_EVENTS.index(event) if event in STEP_EVENTS else -1


def write_hang_report(folder: Path) -> dict[str, Any]:
    """Merge the ranks' files in ``folder`` into ``hang-report.json`` and ``.txt``; return the report.

    The stuck ranks are those furthest behind (lowest batch, then earliest event in :data:`STEP_EVENTS`);
    when every rank is at the same place none is singled out (a collective or the network is the suspect).
    """
    entries = sorted((json.loads(p.read_text()) for p in folder.glob("rank*.json")), key=lambda e: e["rank"])
    world = max((e.get("world_size", 1) for e in entries), default=1)
    missing = sorted(set(range(world)) - {e["rank"] for e in entries})
    positions = {e["rank"]: _position(e) for e in entries}
    behind = min(positions.values(), default=(0, 0))
    stuck = [r for r, p in positions.items() if p == behind] if len(set(positions.values())) > 1 else []
    report = {"stuck_ranks": stuck + missing, "missing_ranks": missing, "ranks": entries}
    _write_atomic(folder / "hang-report.json", json.dumps(report, indent=2))
    lines = []
    if stuck or missing:
        lines.append(f"stuck rank(s): {', '.join(map(str, stuck + missing))}"
                     + (f" (no report from {', '.join(map(str, missing))})" if missing else ""))
    else:
        lines.append("every rank stopped at the same place: suspect a collective, the network or a shared resource")
    for e in entries:
        lines.append(f"rank {e['rank']} on {e['host']} (pid {e['pid']}): batch {e['batch']}, last event "
                     f"{e['last_event']}, {e['seconds_without_progress']} s without progress")
    for e in entries:
        stacks = folder / f"stacks-rank{e['rank']}.txt"
        lines.append(f"\n===== rank {e['rank']} stacks =====\n" + (stacks.read_text() if stacks.exists() else "(none)"))
    _write_atomic(folder / "hang-report.txt", "\n".join(lines) + "\n")
    return report


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # ranks may write the same report at once
    tmp.write_text(text)
    os.replace(tmp, path)
