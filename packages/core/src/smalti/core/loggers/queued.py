"""A logger base that never blocks the training step: calls are queued and a background thread sends them."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from smalti.core import distributed
from smalti.core.plugins import LoggerDestination

log = logging.getLogger(__name__)

_STOP = object()


class QueuedLoggerDestination(LoggerDestination):
    """Queues ``log_*`` calls; a daemon thread drains them in batches and calls :meth:`_send`.

    Subclasses implement ``_start`` (connect; runs in the thread, retried on failure), ``_send(items)``
    and ``_finish(status)``. A failure is logged and counted, never raised into training. The queue is
    bounded: when the destination is down for long, the oldest entries are dropped, with a warning.
    Items are ``("metrics", step, dict, unix_time)``, ``("params", dict)`` and ``("artifact", path, name)``.
    """

    def __init__(self, flush_interval_s: float = 1.0, max_batch: int = 1000, max_queue: int = 100_000,
                 rank_zero_only: bool = True, close_timeout_s: float = 30.0) -> None:
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self.rank_zero_only = rank_zero_only
        self.close_timeout_s = close_timeout_s
        self.failures = 0
        self.dropped = 0
        self.status = "FINISHED"
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        self._started = False
        self._pending = 0
        self._idle = threading.Condition()
        self._active: bool | None = None

    # ------------------------------------------------------------------ hooks (called on the training thread)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._put(("metrics", step, dict(metrics), time.time()))

    def log_hyperparameters(self, params: dict[str, Any]) -> None:
        self._put(("params", params))

    def log_artifact(self, local_path: str, name: str) -> None:
        self._put(("artifact", local_path, name))

    def on_exception(self, exc: BaseException) -> None:
        self.status = "FAILED"

    def on_close(self) -> None:
        self.close()

    # ------------------------------------------------------------------ queue

    def _is_active(self) -> bool:
        if self._active is None:
            self._active = not self.rank_zero_only or distributed.get_rank() == 0
        return self._active

    def _put(self, item: Any) -> None:
        if not self._is_active():
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"{type(self).__name__}-sender", daemon=True)
            self._thread.start()
        with self._idle:
            self._pending += 1
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            try:
                self._queue.get_nowait()
                with self._idle:
                    self._pending -= 1
            except queue.Empty:
                pass
            self.dropped += 1
            if self.dropped in (1, 10, 100, 1000) or self.dropped % 10_000 == 0:
                log.warning("%s: queue full, dropped %d entries so far", type(self).__name__, self.dropped)
            self._queue.put_nowait(item)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            items: list[Any] = []
            try:
                first = self._queue.get(timeout=self.flush_interval_s)
            except queue.Empty:
                continue
            deadline = time.monotonic() + self.flush_interval_s / 4
            if first is _STOP:
                stopping = True
            else:
                items.append(first)
            while len(items) < self.max_batch and not stopping:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                else:
                    items.append(item)
            if items:
                self._deliver(items)
        self._safely("finish", lambda: self._finish(self.status) if self._started else None)

    def _deliver(self, items: list[Any]) -> None:
        ok = True
        if not self._started:
            ok = self._safely("connect", self._start)
            self._started = ok
        if ok:
            self._safely("send", lambda: self._send(items))
        with self._idle:
            self._pending -= len(items)
            self._idle.notify_all()

    def _safely(self, what: str, fn: Any) -> bool:
        try:
            fn()
            return True
        except Exception as exc:  # a logger must never take training down
            self.failures += 1
            if self.failures in (1, 2, 5, 10, 100) or self.failures % 1000 == 0:
                log.warning("%s could not %s (failure %d; training goes on): %r",
                            type(self).__name__, what, self.failures, exc)
            return False

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything queued so far was handled (sent or failed); ``False`` on time-out."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        """Send what is queued, finish the run and stop the thread (bounded by ``close_timeout_s``)."""
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            log.warning("%s: gave up waiting %.0f s for the sender thread at close", type(self).__name__,
                        self.close_timeout_s)
        self._thread = None

    # ------------------------------------------------------------------ for subclasses

    def _start(self) -> None:
        """Connect to the destination; runs on the sender thread before the first send."""

    def _send(self, items: list[Any]) -> None:
        raise NotImplementedError

    def _finish(self, status: str) -> None:
        """Mark the run finished (``FINISHED`` or ``FAILED``) at close."""


def flatten_params(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``, for destinations that take flat parameters."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_params(value, name + "."))
        else:
            out[name] = value
    return out
