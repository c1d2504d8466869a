"""The queued logger base: order, batching, retries while the destination is down, bounded loss, no blocking."""

import logging
import threading
import time

import pytest

from smalti.core.loggers import QueuedLoggerDestination


class Recorder(QueuedLoggerDestination):
    """A destination that is down (raises ``ConnectionError``) while ``down`` is set."""

    def __init__(self, **kwargs):
        kwargs.setdefault("flush_interval_s", 0.02)
        kwargs.setdefault("retry_initial_s", 0.01)
        kwargs.setdefault("retry_max_s", 0.05)
        super().__init__(**kwargs)
        self.down = threading.Event()
        self.batches = []
        self.connects = 0
        self.finished_with = None

    def _start(self):
        if self.down.is_set():
            raise ConnectionError("connection refused")
        self.connects += 1

    def _send(self, items):
        if self.down.is_set():
            raise ConnectionError("connection refused")
        self.batches.append(list(items))

    def _finish(self, status):
        self.finished_with = status

    def steps(self):
        return [item[1] for batch in self.batches for item in batch if item[0] == "metrics"]


def test_items_arrive_in_order_in_bounded_batches():
    dest = Recorder(max_batch=64)
    dest.log_hyperparameters({"lr": 0.1})
    for step in range(500):
        dest.log_metrics({"loss": 1.0 / (step + 1)}, step)
    assert dest.flush(timeout=10)
    dest.close()
    assert dest.steps() == list(range(500))
    assert dest.batches[0][0] == ("params", {"lr": 0.1})
    assert max(len(b) for b in dest.batches) <= 64 and len(dest.batches) < 500  # batched, not one per call
    assert dest.sent == 501 and dest.dropped == 0 and dest.failures == 0
    assert dest.connects == 1 and dest.finished_with == "FINISHED"


def test_outage_keeps_entries_and_delivers_them_once_back(caplog):
    caplog.set_level(logging.WARNING)
    dest = Recorder(warn_every=1000)
    dest.down.set()
    for step in range(200):
        dest.log_metrics({"loss": float(step)}, step)
    time.sleep(0.3)  # several failed attempts
    assert dest.failures >= 2 and dest.steps() == []
    assert not dest.flush(timeout=0.1)
    dest.down.clear()
    assert dest.flush(timeout=10)
    dest.close()
    assert dest.steps() == list(range(200)) and dest.dropped == 0
    warnings = [r for r in caplog.records if "could not connect" in r.getMessage()]
    assert len(warnings) == 1 and "connection refused" in warnings[0].getMessage()  # once, not per failure


def test_long_outage_drops_oldest_with_a_warning(caplog):
    caplog.set_level(logging.WARNING)
    dest = Recorder(max_batch=10, max_queue=50)
    dest.down.set()
    for step in range(200):
        dest.log_metrics({"loss": float(step)}, step)
    dest.down.clear()
    assert dest.flush(timeout=10)
    dest.close()
    assert dest.steps() == list(range(150, 200))  # the newest survive
    assert dest.dropped == 150
    assert "dropped the oldest" in caplog.text


def test_rejected_batch_is_dropped_and_the_rest_still_sent(caplog):
    class Picky(Recorder):
        def _send(self, items):
            if any(item[0] == "metrics" and item[1] == 3 for item in items):
                raise ValueError("invalid metric name")
            super()._send(items)

    caplog.set_level(logging.WARNING)
    dest = Picky(max_batch=1)
    for step in range(6):
        dest.log_metrics({"loss": 1.0}, step)
    assert dest.flush(timeout=10)
    dest.close()
    assert dest.steps() == [0, 1, 2, 4, 5]
    assert dest.dropped == 1 and dest.failures == 1
    assert "dropped that batch" in caplog.text and "invalid metric name" in caplog.text


def test_rejected_connection_disables_the_logger(caplog):
    class Unauthorized(Recorder):
        def _start(self):
            raise PermissionError("403: bad API key")

        def _is_transient(self, exc):
            return False

    caplog.set_level(logging.WARNING)
    dest = Unauthorized()
    for step in range(20):
        dest.log_metrics({"loss": 1.0}, step)
    assert dest.flush(timeout=10)
    dest.log_metrics({"loss": 1.0}, 20)  # ignored once given up
    dest.close()
    assert dest.batches == [] and dest.finished_with is None
    assert "gives up" in caplog.text and "bad API key" in caplog.text


def test_logging_never_waits_for_a_hung_destination():
    release = threading.Event()

    class Hung(Recorder):
        def _send(self, items):
            release.wait(30)  # a request stuck on the network
            super()._send(items)

    dest = Hung(close_timeout_s=0.5)
    dest.log_metrics({"warm": 1.0}, 0)
    time.sleep(0.1)  # the sender is now stuck inside _send
    calls = 20_000
    start = time.perf_counter()
    for step in range(1, calls + 1):
        dest.log_metrics({"loss": 0.5, "lr": 1e-3, "tokens_per_sec": 1e5}, step)
    per_call = (time.perf_counter() - start) / calls
    assert per_call < 100e-6, f"log_metrics took {per_call * 1e6:.1f} us per call while the sender was stuck"
    start = time.perf_counter()
    dest.close()  # bounded by close_timeout_s
    assert time.perf_counter() - start < 2.0
    release.set()


def test_exception_marks_the_run_failed():
    dest = Recorder()
    dest.log_metrics({"loss": 1.0}, 1)
    dest.on_exception(RuntimeError("boom"))
    dest.on_close()
    assert dest.finished_with == "FAILED" and dest.steps() == [1]


def test_only_rank_zero_sends(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    dest = Recorder()
    dest.log_metrics({"loss": 1.0}, 1)
    assert dest.flush(timeout=1)
    dest.close()
    assert dest.batches == [] and dest._thread is None
    everywhere = Recorder(rank_zero_only=False)
    everywhere.log_metrics({"loss": 1.0}, 1)
    everywhere.close()
    assert everywhere.steps() == [1]


@pytest.mark.parametrize("module,cls,extra", [("mlflow", "MLflowLogger", "mlflow"), ("wandb", "WandBLogger", "wandb")])
def test_missing_extra_says_what_to_install(monkeypatch, module, cls, extra):
    import smalti.core.loggers as loggers
    from smalti.core.errors import ConfigError

    monkeypatch.setitem(__import__("sys").modules, module, None)  # as if not installed
    with pytest.raises(ConfigError, match=rf"pip install 'smalti-core\[{extra}\]'"):
        getattr(loggers, cls)()


def test_system_metrics_without_psutil_says_what_to_install(monkeypatch):
    from smalti.core.errors import ConfigError
    from smalti.core.loggers import MLflowLogger

    monkeypatch.setitem(__import__("sys").modules, "psutil", None)
    with pytest.raises(ConfigError, match="log_system_metrics=true needs psutil.*pip install psutil"):
        MLflowLogger(log_system_metrics=True)


def test_importing_loggers_does_not_import_the_extras():
    import subprocess
    import sys

    code = ("import sys, smalti.core.loggers as l; l.ConsoleLogger; "
            "print(sorted(m for m in ('mlflow', 'wandb') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
