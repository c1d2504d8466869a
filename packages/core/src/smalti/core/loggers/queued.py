"""A logger base that never blocks the training step: calls are queued and a background thread sends them."""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import time
import weakref
from typing import Any

from smalti.core import distributed
from smalti.core.plugins import LoggerDestination

log = logging.getLogger(__name__)

#: Every live queued logger, so a forked child (a DataLoader worker) can switch its copies off.
_LIVE: weakref.WeakSet[QueuedLoggerDestination] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for dest in list(_LIVE):
        dest._disable_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_at_exit(ref: weakref.ref[QueuedLoggerDestination]) -> None:
    dest = ref()
    if dest is not None and dest._thread is not None:
        dest.close(timeout=min(dest.close_timeout_s, 5.0))


class QueuedLoggerDestination(LoggerDestination):
    """Queues ``log_*`` calls; a daemon thread drains them in batches and calls :meth:`_send`.

    The training thread only appends to an in-memory buffer (a few microseconds, no I/O, no waiting).
    The sender thread wakes every ``flush_interval_s`` (or as soon as ``max_batch`` items wait), connects
    on first use with :meth:`_start`, and hands up to ``max_batch`` items at a time to :meth:`_send`.

    Failures never reach training. A *transient* failure (:meth:`_is_transient`: the network or the
    server is down) keeps the batch and retries it with exponential back-off from ``retry_initial_s`` up
    to ``retry_max_s``; a *permanent* one (the destination rejected the data) drops that batch. Either is
    counted in :attr:`failures` and logged with ``logging.warning`` on the first failure and then once every
    ``warn_every`` failures. The buffer holds at most ``max_queue`` items: while the destination is down
    for long, the oldest items are dropped (counted in :attr:`dropped`, with a warning).

    Subclasses implement :meth:`_start` (connect), :meth:`_send` and :meth:`_finish` (end the run). Items
    are ``("metrics", step, dict, unix_time)``, ``("params", dict)`` and ``("artifact", path, name)``.
    """

    def __init__(self, flush_interval_s: float = 1.0, max_batch: int = 1000, max_queue: int = 100_000,
                 rank_zero_only: bool = True, close_timeout_s: float = 30.0, retry_initial_s: float = 1.0,
                 retry_max_s: float = 60.0, warn_every: int = 100) -> None:
        self.flush_interval_s = flush_interval_s
        self.max_batch = max(1, max_batch)
        self.max_queue = max(self.max_batch, max_queue)
        self.rank_zero_only = rank_zero_only
        self.close_timeout_s = close_timeout_s
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.warn_every = max(1, warn_every)
        #: Sends (or connects) that raised; each is logged at most once per ``warn_every``.
        self.failures = 0
        #: Items lost: pushed out of a full buffer, rejected by the destination, or left over at close.
        self.dropped = 0
        #: Items the destination accepted.
        self.sent = 0
        #: The run's end status given to :meth:`_finish`: FINISHED, FAILED (exception) or KILLED (interrupt).
        self.status = "FINISHED"
        self._buffer: collections.deque[Any] = collections.deque()
        self._lock = threading.Lock()
        self._progress = threading.Condition(threading.Lock())
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._put_count = 0
        self._handled = 0
        self._started = False
        self._disabled = False
        self._active: bool | None = None
        self._drop_warnings = 0
        _LIVE.add(self)

    # ------------------------------------------------------------------ hooks (called on the training thread)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._put(("metrics", step, dict(metrics), time.time()))

    def log_hyperparameters(self, params: dict[str, Any]) -> None:
        self._put(("params", params))

    def log_artifact(self, local_path: str, name: str) -> None:
        self._put(("artifact", local_path, name))

    def on_exception(self, exc: BaseException) -> None:
        self.status = "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"

    def on_close(self) -> None:
        self.close()

    # ------------------------------------------------------------------ producer side

    def _is_active(self) -> bool:
        if self._active is None:
            self._active = not self.rank_zero_only or distributed.get_rank() == 0
        return self._active

    def _put(self, item: Any) -> None:
        if self._disabled or not self._is_active():
            return
        if self._thread is None:
            self._start_thread()
        dropped = False
        with self._lock:
            if len(self._buffer) >= self.max_queue:
                self._buffer.popleft()
                self.dropped += 1
                dropped = True
            self._buffer.append(item)
            self._put_count += 1
            waiting = len(self._buffer)
        if waiting == self.max_batch:
            self._wake.set()
        if dropped:
            self._mark_handled(1)
            self._warn_dropped()

    def _start_thread(self) -> None:
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name=f"{type(self).__name__}-sender", daemon=True)
        self._thread.start()
        atexit.register(_close_at_exit, weakref.ref(self))

    def _warn_dropped(self) -> None:
        self._drop_warnings += 1
        if self._drop_warnings == 1 or self._drop_warnings % (self.warn_every * 100) == 0:
            log.warning("%s: %d entries waiting and the destination is not taking them; dropped the oldest "
                        "(%d dropped so far)", type(self).__name__, self.max_queue, self.dropped)

    # ------------------------------------------------------------------ sender thread

    def _run(self) -> None:
        backoff = 0.0
        while True:
            stopping = self._stopping.is_set()
            if not stopping:
                self._wake.wait(backoff or self.flush_interval_s)
                self._wake.clear()
                stopping = self._stopping.is_set()
            if stopping:
                self._drain_at_close()
                break
            backoff = 0.0 if self._drain() else min(self.retry_max_s, max(self.retry_initial_s, 2 * backoff))
        if self._started:
            try:
                self._finish(self.status)
            except Exception as exc:
                self._failed("finish the run", exc)

    def _drain(self) -> bool:
        """Send everything waiting; ``False`` when a transient failure left items to retry later."""
        while not self._disabled:
            with self._lock:
                batch = [self._buffer.popleft() for _ in range(min(self.max_batch, len(self._buffer)))]
            if not batch:
                return True
            if not self._deliver(batch):
                self._requeue(batch)
                return False
        return True

    def _drain_at_close(self) -> None:
        """Keep trying (with back-off) until the buffer is empty or the close time-out is nearly spent."""
        deadline = time.monotonic() + 0.8 * self.close_timeout_s
        backoff = self.retry_initial_s
        while not self._drain() and time.monotonic() + backoff < deadline:
            time.sleep(backoff)
            backoff = min(self.retry_max_s, 2 * backoff)
        with self._lock:
            left = len(self._buffer)
            self._buffer.clear()
            self.dropped += left
        if left:
            self._mark_handled(left)
            log.warning("%s: closing with %d entries that could not be sent (destination unreachable); "
                        "they are lost", type(self).__name__, left)

    def _deliver(self, batch: list[Any]) -> bool:
        """Connect if needed and send; ``True`` when the batch is done with (sent or rejected for good)."""
        try:
            if not self._started:
                self._start()
                self._started = True
                if self.failures:
                    log.warning("%s connected after %d failed attempts", type(self).__name__, self.failures)
            self._send(batch)
        except Exception as exc:
            transient = self._is_transient(exc)
            self._failed("connect" if not self._started else "send", exc, transient)
            if transient:
                return False
            if not self._started:
                self._disabled = True
                log.error("%s gives up: connecting failed for a reason retrying will not fix (%r); it logs "
                          "nothing more this run", type(self).__name__, exc)
                with self._lock:
                    batch = batch + list(self._buffer)
                    self._buffer.clear()
            with self._lock:
                self.dropped += len(batch)
        else:
            self.sent += len(batch)
        self._mark_handled(len(batch))
        return True

    def _requeue(self, batch: list[Any]) -> None:
        with self._lock:
            self._buffer.extendleft(reversed(batch))
            over = len(self._buffer) - self.max_queue
            for _ in range(max(0, over)):
                self._buffer.popleft()
            self.dropped += max(0, over)
        if over > 0:
            self._mark_handled(over)
            self._warn_dropped()

    def _failed(self, what: str, exc: BaseException, transient: bool = False) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % self.warn_every == 0:
            log.warning("%s could not %s (failure %d; %s; training goes on): %r", type(self).__name__, what,
                        self.failures, "will retry" if transient else "dropped that batch", exc)

    def _mark_handled(self, count: int) -> None:
        with self._progress:
            self._handled += count
            self._progress.notify_all()

    def _disable_in_child(self) -> None:
        self._disabled = True
        self._thread = None

    # ------------------------------------------------------------------ public control

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything queued so far was sent, rejected or dropped; ``False`` on time-out."""
        target = self._put_count
        self._wake.set()
        deadline = time.monotonic() + timeout
        with self._progress:
            while self._handled < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._progress.wait(left)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued, finish the run and stop the thread, waiting at most ``close_timeout_s``."""
        thread = self._thread
        if thread is None:
            return
        self._stopping.set()
        self._wake.set()
        thread.join(self.close_timeout_s if timeout is None else timeout)
        if thread.is_alive():
            log.warning("%s: gave up waiting %.0f s for the sender thread at close; %d entries unsent",
                        type(self).__name__, self.close_timeout_s, len(self._buffer))
        self._thread = None

    # ------------------------------------------------------------------ for subclasses

    def _start(self) -> None:
        """Connect to the destination; runs on the sender thread before the first send, retried on failure."""

    def _send(self, items: list[Any]) -> None:
        """Deliver ``items`` (in the order they were logged). Raise to report a failure."""
        raise NotImplementedError

    def _finish(self, status: str) -> None:
        """Mark the run finished (``FINISHED``, ``FAILED`` or ``KILLED``) at close."""

    def _is_transient(self, exc: BaseException) -> bool:
        """Whether retrying later may succeed (default: connection, time-out and other OS errors)."""
        return isinstance(exc, OSError)


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
