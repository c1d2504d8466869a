"""ICL evaluation as a trainer callback: runs the tasks on an interval and at the end of training."""

from __future__ import annotations

import logging
from typing import Any

from smalti.core import Callback
from smalti.core.intervals import interval_fires
from smalti.core.time import Time
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

    def __init__(self, tasks: Any = "default", tokenizer: str | None = "default", interval: str | None = "500ba",
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
