"""ICL evaluation as a trainer callback: runs the tasks on an interval and at the end of training."""

from __future__ import annotations

import logging
from typing import Any

from smalti.core import Callback
from smalti.core.config.types import TimeStr
from smalti.core.intervals import interval_fires
from smalti.core.time import Time
from smalti.llm.icl.gauntlet import load_gauntlet
from smalti.llm.icl.tasks import load_tasks
from smalti.llm.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class ICLEval(Callback):
    """Evaluate in-context-learning tasks every ``interval`` (and at fit end); metrics go to the loggers as
    ``icl/<label>/<n>shot/accuracy``.

    Args:
        tasks: a task-list YAML path, ``"default"`` (the shipped tasks) or a list of task mappings.
        tokenizer: name or path, as :func:`smalti.llm.tokenizer.load_tokenizer`.
        interval: a :class:`~smalti.core.time.Time` string (``"100ba"``, ``"1ep"``); null for fit end only.
        at_fit_end: also evaluate when training ends.
    """

    def __init__(self, tasks: Any = "default", tokenizer: str | None = "default", interval: TimeStr | None = "500ba",
                 at_fit_end: bool = True) -> None:
        self.tasks = load_tasks(tasks)
        self.tokenizer = load_tokenizer(tokenizer)
        self.interval = Time.from_input(interval) if interval else None
        self.at_fit_end = at_fit_end
        self.last_batch: int | None = None
        self.results: dict[str, float] = {}

    def _run(self, state: Any, logger: Any) -> None:
        from smalti.core.precision import autocast
        from smalti.llm.icl.evaluate import evaluate_tasks

        self.results = evaluate_tasks(
            self.tasks, state.model, self.tokenizer, state.device, raw_model=state.raw_model,
            autocast=autocast(state.precision, state.device),
        )
        self.last_batch = state.timestamp.batch
        logger.log_metrics(self.results)
        if state.rank == 0:
            log.info("ICL at batch %d: %s", state.timestamp.batch,
                     ", ".join(f"{k}={v:.3f}" for k, v in self.results.items()))

    def on_batch_end(self, state: Any, logger: Any) -> None:
        if self.interval is not None and interval_fires(self.interval, state, "batch_end"):
            self._run(state, logger)

    def on_epoch_end(self, state: Any, logger: Any) -> None:
        if self.interval is not None and interval_fires(self.interval, state, "epoch_end"):
            self._run(state, logger)

    def on_fit_end(self, state: Any, logger: Any) -> None:
        if self.at_fit_end and self.last_batch != state.timestamp.batch:
            self._run(state, logger)


class GauntletEval(ICLEval):
    """ICL evaluation folded into an evaluation gauntlet's category and composite scores (LLM Foundry's
    ``eval_gauntlet`` format, :mod:`smalti.llm.icl.gauntlet`), every ``interval`` in any time unit and at fit end.

    Logs each task's ``icl/<label>/<n>shot/accuracy`` and each category's and average's ``icl/gauntlet/<name>``.

    Args:
        gauntlet: a gauntlet YAML path or mapping (``categories``, ``weighting``, ``averages``, ...).
        tasks: the ICL tasks the benchmarks name (a task-list YAML path, as Foundry's ``icl_tasks``, or a list).
        tokenizer, interval, at_fit_end: as :class:`ICLEval`.
    """

    def __init__(self, gauntlet: Any, tasks: Any = "default", tokenizer: str | None = "default",
                 interval: TimeStr | None = "500ba", at_fit_end: bool = True) -> None:
        super().__init__(tasks=tasks, tokenizer=tokenizer, interval=interval, at_fit_end=at_fit_end)
        self.gauntlet = load_gauntlet(gauntlet)
        self.gauntlet.check_tasks({t.label: list(t.num_fewshot) for t in self.tasks})
        self.sizes = {t.label: len(t.examples()) for t in self.tasks}
        self.scores: dict[str, float] = {}

    def _run(self, state: Any, logger: Any) -> None:
        super()._run(state, logger)
        self.scores = self.gauntlet.scores(self.results, self.sizes)
        logger.log_metrics(self.scores)
        if state.rank == 0:
            log.info("gauntlet at batch %d: %s", state.timestamp.batch,
                     ", ".join(f"{k.removeprefix('icl/gauntlet/')}={v:.3f}" for k, v in self.scores.items()))
