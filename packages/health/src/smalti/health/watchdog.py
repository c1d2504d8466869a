"""Hang watchdog: when training makes no progress for ``timeout_s``, dump every rank's stacks and exit.

Every rank runs a daemon thread that watches the time since the last finished batch (train or eval). The
trainer hooks record where each rank was last: the batch count (``state.timestamp.batch``) and the event, so
positions compare across ranks as (step, phase). On a time-out each rank also reads its training thread's
hook-call record (:func:`smalti.core.dispatch.running_hooks`) to name the hook (and the plugin running it) it
is stuck in, then writes, into ``report_dir``,
its own stacks (``faulthandler``, every thread) and a JSON line of where it was, both named with the
torchelastic restart attempt (``rank{r}-attempt{a}.json``, ``stacks-rank{r}-attempt{a}.txt``). After a short
grace period (until every rank of this attempt has written) each rank merges this attempt's files into
``hang-report-attempt{a}.json``/``.txt`` (copied to ``hang-report.json``/``.txt``, the latest), naming the
rank(s) furthest behind and their hooks, logs ``health/watchdog/fired`` and the report through the loggers,
and exits with :data:`HANG_EXIT_CODE` so torchrun's elastic agent restarts the group (and autoresume picks
up the last checkpoint). Nothing here uses a collective: the process group is what is hung. ``kill -USR2 PID`` dumps
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
from typing import Annotated, Any

from smalti.core import Callback
from smalti.core.config.types import Field, NonNegativeFloat, PositiveFloat
from smalti.core.errors import ConfigError
from smalti.health.deadline import call_with_deadline

log = logging.getLogger(__name__)

#: Exit code of a rank the watchdog ended (any non-zero code makes torchrun restart the group).
HANG_EXIT_CODE = 124

#: The trainer events of one step, in the order they fire. Events up to ``after_optimizer_step`` run before the
#: trainer advances ``state.timestamp.batch``; the rest (from ``batch_end``) after it, so a rank's step is
#: ``timestamp.batch + 1`` in the first part and ``timestamp.batch`` in the second (see :func:`position`).
STEP_EVENTS = (
    "fit_start", "epoch_start", "before_dataloader", "after_dataloader", "batch_start", "before_train_batch",
    "microbatch_start", "before_forward", "after_forward", "before_loss", "after_loss", "before_backward",
    "after_backward", "microbatch_end", "after_train_batch", "before_optimizer_step", "after_optimizer_step",
    "batch_end", "eval_before_all", "eval_start", "eval_batch_start", "eval_before_forward", "eval_after_forward",
    "eval_batch_end", "eval_end", "eval_after_all", "batch_checkpoint", "epoch_end", "epoch_checkpoint", "fit_end",
)
_ADVANCED_FROM = STEP_EVENTS.index("batch_end")

#: The environment variable torchelastic sets to the restart attempt (0 on the first run).
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def restart_attempt() -> int:
    """This process's torchelastic restart attempt (``$TORCHELASTIC_RESTART_COUNT``; 0 outside torchrun)."""
    value = os.environ.get(RESTART_ENV, "0")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${RESTART_ENV}={value!r} is not an integer") from None


def position(batch: int, event: str) -> tuple[int, int]:
    """``(step, phase)`` of a rank whose ``state.timestamp.batch`` is ``batch`` at ``event``: ordered over the run."""
    if event not in STEP_EVENTS:
        return batch, -1
    phase = STEP_EVENTS.index(event)
    return (batch + 1 if phase < _ADVANCED_FROM else batch), phase


def _recorder(event: str):
    def hook(self: HangWatchdog, state: Any) -> None:
        self._last_event = event
        self._batch = state.timestamp.batch

    hook.__name__ = f"on_{event}"
    hook.__doc__ = f"Remember that this rank reached ``{event}`` (and its batch count)."
    return hook


class HangWatchdog(Callback):
    """Ends a run whose ranks stop making progress, with a report naming the stuck rank, its hook and stacks."""

    def __init__(self, timeout_s: PositiveFloat = 600.0, first_batch_timeout_s: PositiveFloat | None = None,
                 report_dir: str | None = None, poll_s: PositiveFloat = 1.0, grace_s: NonNegativeFloat = 3.0,
                 exit_code: Annotated[int, Field(ge=1, le=255)] = HANG_EXIT_CODE) -> None:
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
        self._train_thread: int | None = None
        self._state: Any = None
        self._logger: Any = None
        self._run_dir = Path("outputs") / "smalti-run"
        self.fired = False

    # ------------------------------------------------------------------ trainer hooks

    on_epoch_start = _recorder("epoch_start")
    on_before_dataloader = _recorder("before_dataloader")
    on_after_dataloader = _recorder("after_dataloader")
    on_batch_start = _recorder("batch_start")
    on_before_train_batch = _recorder("before_train_batch")
    on_before_forward = _recorder("before_forward")
    on_after_forward = _recorder("after_forward")
    on_before_backward = _recorder("before_backward")
    on_after_backward = _recorder("after_backward")
    on_after_train_batch = _recorder("after_train_batch")
    on_before_optimizer_step = _recorder("before_optimizer_step")
    on_after_optimizer_step = _recorder("after_optimizer_step")
    on_eval_start = _recorder("eval_start")
    on_eval_end = _recorder("eval_end")
    on_batch_checkpoint = _recorder("batch_checkpoint")
    on_epoch_end = _recorder("epoch_end")
    on_epoch_checkpoint = _recorder("epoch_checkpoint")

    def on_fit_start(self, state: Any, logger: Any) -> None:
        """Start watching; register the on-demand stack dump."""
        self._rank, self._world = state.rank, state.world_size
        self._run_dir = Path(getattr(state, "output_dir", Path("outputs") / state.run_name))
        self._state, self._logger = state, logger
        self._train_thread = threading.get_ident()
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

    def on_fit_end(self, state: Any) -> None:
        self._last_event = "fit_end"
        self._batch = state.timestamp.batch
        self._stop.set()

    def on_close(self) -> None:
        self._stop.set()

    def on_exception(self) -> None:
        self._stop.set()

    def set_timeout(self, timeout_s: float) -> None:
        """Use ``timeout_s`` from now on (for the first batch too), counting the time without progress from now.

        For a callback that knows what comes next: widen the time-out before a long pause it is about to make
        (a synchronous export, say) and narrow it again after. Counting from the call means a narrower time-out
        never fires at once for a pause that began under the old one.
        """
        if timeout_s <= 0:
            raise ConfigError(f"HangWatchdog.set_timeout: timeout_s={timeout_s} must be positive")
        self._last_progress = time.monotonic()  # first: _watch reads the limit first, so never new limit + old clock
        self.timeout_s = self.first_batch_timeout_s = float(timeout_s)

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
            limit = self._limit()  # before the clock: set_timeout writes them in the other order
            idle = time.monotonic() - self._last_progress
            if idle > limit:
                self._fire(idle)
                return

    def folder(self) -> Path:
        """Where the reports go: ``report_dir`` or ``smalti-health`` in the run's folder (``state.output_dir``)."""
        return Path(self.report_dir or self._run_dir / "smalti-health")

    def where(self, idle: float) -> dict[str, Any]:
        """This rank's entry of the report: its position, the hooks its training thread is in, and timing."""
        in_hooks = hooks_in_progress(self._train_thread) if self._train_thread else []
        batch = self._state.timestamp.batch if self._state is not None else self._batch
        # Within one event the plugins run in the same order on every rank: the place in that order breaks ties
        # (a rank stuck in an early plugin's hook is behind a peer waiting in a later plugin's collective).
        pos = (*position(self._batch, self._last_event), self._own_impl_index(self._last_event))
        stuck_in = next((h for h in in_hooks if h["hook"].removeprefix("on_") in STEP_EVENTS), None)
        if stuck_in is not None:  # the hook being run is at or past the last event the watchdog saw
            pos = max(pos, (*position(batch, stuck_in["hook"].removeprefix("on_")), stuck_in["impl_index"]))
        return {
            "rank": self._rank, "world_size": self._world, "host": socket.gethostname(), "pid": os.getpid(),
            "restart_attempt": restart_attempt(), "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "batch": batch, "step": pos[0], "phase": STEP_EVENTS[pos[1]] if pos[1] >= 0 else self._last_event,
            "impl_index": pos[2],
            "last_event": self._last_event, "in_hooks": in_hooks,
            "hook": in_hooks[-1]["hook"] if in_hooks else None,
            "plugin": in_hooks[-1]["plugin"] if in_hooks else None,
            "seconds_without_progress": round(idle, 3), "timeout_s": self._limit(), "time": time.time(),
        }

    def _plugin_manager(self) -> Any:
        pm = getattr(self._state, "plugin_manager", None)
        if pm is None:
            from smalti.core.plugins.manager import get_plugin_manager

            pm = get_plugin_manager()
        return pm

    def _own_impl_index(self, event: str) -> int:
        """Where this watchdog's implementation of ``on_<event>`` comes in that hook's call order (-1: none)."""
        caller = getattr(self._plugin_manager().hook, f"on_{event}", None)
        impls = caller.get_hookimpls() if caller is not None else []
        return next((len(impls) - 1 - i for i, impl in enumerate(impls) if impl.plugin is self), -1)

    def _fire(self, idle: float) -> None:
        self.fired = True
        folder = self.folder()
        folder.mkdir(parents=True, exist_ok=True)
        attempt = restart_attempt()
        where = self.where(idle)
        hook = f"in hook {where['hook']} ({where['plugin']})" if where["hook"] else "in no hook"
        with open(folder / f"stacks-rank{self._rank}-attempt{attempt}.txt", "w") as f:
            f.write(f"rank {self._rank} on {where['host']} pid {where['pid']}: no progress for {idle:.1f} s; "
                    f"step {where['step']} at {where['phase']}, {hook}; last event {self._last_event}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        _write_atomic(folder / f"rank{self._rank}-attempt{attempt}.json", json.dumps(where))
        log.error("hang watchdog: rank %d made no progress for %.1f s (step %d at %s, %s); stacks in %s",
                  self._rank, idle, where["step"], where["phase"], hook, folder)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and len(_entries(folder, attempt, where["run_id"])) < self._world:
            time.sleep(0.1)
        # Every rank writes the merged report (atomically): the first to exit makes torchrun stop the others.
        report = write_hang_report(folder, attempt, run_id=where["run_id"])
        self._log_report(folder, attempt, report)
        _flush_loggers(self.grace_s, self._plugin_manager())
        # The first rank to exit makes torchrun kill the rest: wait (bounded) until every rank has logged.
        _write_atomic(folder / f".done-rank{self._rank}-attempt{attempt}", str(time.time()))
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and len(list(folder.glob(f".done-rank*-attempt{attempt}"))) < self._world:
            time.sleep(0.05)
        sys.stderr.flush()
        os._exit(self.exit_code)

    def _log_report(self, folder: Path, attempt: int, report: dict[str, Any]) -> None:
        """``health/watchdog/fired`` and the report through the core logging hooks, bounded (a logger may hang)."""
        logger = self._logger
        if logger is None:
            return
        metrics = {"health/watchdog/fired": 1.0, "health/watchdog/stuck_ranks": float(len(report["stuck_ranks"])),
                   "health/watchdog/seconds_without_progress": float(time.monotonic() - self._last_progress)}

        def send() -> None:
            logger.log_metrics(metrics)
            if self._rank == 0 or self._rank in report["stuck_ranks"]:
                for suffix in ("txt", "json"):
                    logger.log_artifact(str(folder / f"hang-report-attempt{attempt}.{suffix}"))

        try:
            call_with_deadline(send, deadline_s=max(self.grace_s, 1.0), what="watchdog report logging")
        except Exception as exc:  # a logger stuck on the network must not keep a hung rank alive
            log.warning("hang watchdog: could not log the report: %s", exc)


def hooks_in_progress(thread_id: int) -> list[dict[str, Any]]:
    """The hooks thread ``thread_id`` is running now, outermost first, each with the plugin whose code runs
    (``name: Class.method``) and that plugin's place in the hook's call order (``impl_index``, 0 = called first).

    Read from :func:`smalti.core.dispatch.running_hooks`: the dispatcher records each implementation call as it
    makes it, so the report depends on no frame, local variable or file name of the dispatcher's.
    """
    from smalti.core.dispatch import running_hooks

    return [{"hook": call.hook, "plugin": f"{call.plugin_name}: {call.where}" if call.plugin_name else call.where,
             "impl_index": call.impl_index} for call in running_hooks(thread_id)]


def _flush_loggers(timeout_s: float, pm: Any) -> None:
    """Deliver what the run's queued loggers hold (best effort, bounded): the metrics up to the hang matter."""
    from smalti.core.plugins import LoggerDestination

    for plugin in pm.get_plugins():
        flush = getattr(plugin, "flush", None)
        if isinstance(plugin, LoggerDestination) and callable(flush):
            try:
                call_with_deadline(flush, timeout_s, deadline_s=timeout_s + 1, what="logger flush")
            except Exception as exc:  # a logger stuck on the network must not keep a hung rank alive
                log.warning("hang watchdog: could not flush %s: %s", type(plugin).__name__, exc)


def _position(entry: dict[str, Any]) -> tuple[int, int, int]:
    if "step" in entry and entry.get("phase") in STEP_EVENTS:
        return int(entry["step"]), STEP_EVENTS.index(entry["phase"]), int(entry.get("impl_index", -1))
    return (*position(int(entry.get("batch", 0)), entry.get("last_event", "")), -1)


def _entries(folder: Path, attempt: int, run_id: str | None = None) -> list[dict[str, Any]]:
    entries = []
    for path in folder.glob(f"rank*-attempt{attempt}.json"):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # replaced under us; the atomic writer makes this rare
        if run_id is None or entry.get("run_id") in (None, run_id):
            entries.append(entry)
    return sorted(entries, key=lambda e: e["rank"])


def write_hang_report(folder: Path, attempt: int | None = None, run_id: str | None = None) -> dict[str, Any]:
    """Merge restart ``attempt``'s rank files in ``folder`` into ``hang-report-attempt{a}.json`` and ``.txt``.

    ``attempt`` defaults to this process's (:func:`restart_attempt`); files of other attempts (an earlier hang
    that the agent restarted from) and, with ``run_id``, of other torchelastic runs are left out. The stuck
    ranks are those furthest behind by (step, phase, place in the hook's plugin order; see :func:`position`);
    when every rank is at the same place none is singled out (a collective or the network is the suspect). The report is also copied to
    ``hang-report.json``/``.txt`` (the latest). Returns the report.
    """
    attempt = restart_attempt() if attempt is None else attempt
    entries = _entries(folder, attempt, run_id)
    world = max((e.get("world_size", 1) for e in entries), default=1)
    missing = sorted(set(range(world)) - {e["rank"] for e in entries})
    positions = {e["rank"]: _position(e) for e in entries}
    behind = min(positions.values(), default=(0, 0, 0))
    stuck = [r for r, p in positions.items() if p == behind] if len(set(positions.values())) > 1 else []
    by_rank = {e["rank"]: e for e in entries}
    report = {"restart_attempt": attempt, "stuck_ranks": stuck + missing, "missing_ranks": missing,
              "stuck_hooks": {str(r): by_rank[r].get("hook") for r in stuck},
              "stuck_plugins": {str(r): by_rank[r].get("plugin") for r in stuck}, "ranks": entries}
    text = json.dumps(report, indent=2)
    _write_atomic(folder / f"hang-report-attempt{attempt}.json", text)
    _write_atomic(folder / "hang-report.json", text)
    lines = []
    if stuck or missing:
        named = [f"{r} (in {by_rank[r].get('hook') or 'no hook'}"
                 + (f", {by_rank[r]['plugin']}" if by_rank[r].get("plugin") else "") + ")" for r in stuck]
        lines.append(f"stuck rank(s): {', '.join(named + [str(r) for r in missing])}"
                     + (f" (no report from {', '.join(map(str, missing))})" if missing else ""))
    else:
        lines.append("every rank stopped at the same place: suspect a collective, the network or a shared resource")
    lines.append(f"restart attempt {attempt}")
    for e in entries:
        hooks = " > ".join(f"{h['hook']} [{h['plugin']}]" for h in e.get("in_hooks", [])) or "none"
        lines.append(f"rank {e['rank']} on {e['host']} (pid {e['pid']}): step {e.get('step', e['batch'])} at "
                     f"{e.get('phase', e['last_event'])}, last event {e['last_event']}, in hooks: {hooks}; "
                     f"{e['seconds_without_progress']} s without progress")
    for e in entries:
        stacks = folder / f"stacks-rank{e['rank']}-attempt{attempt}.txt"
        lines.append(f"\n===== rank {e['rank']} stacks =====\n" + (stacks.read_text() if stacks.exists() else "(none)"))
    _write_atomic(folder / f"hang-report-attempt{attempt}.txt", "\n".join(lines) + "\n")
    _write_atomic(folder / "hang-report.txt", "\n".join(lines) + "\n")
    return report


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # ranks may write the same report at once
    tmp.write_text(text)
    os.replace(tmp, path)
