"""A run SIGKILLed mid-way keeps every metrics line logged before the kill (at most the one being written lost)."""

import json
import os
import signal
import subprocess
import sys

KILLED_RUN = """
import os, signal, sys
from smalti.core import Callback, Trainer
from smalti.core.callbacks import LRMonitor, SpeedMonitor
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.core.loggers import JSONLLogger

KILL_AT = int(sys.argv[2])

class KillAt(Callback):
    def on_batch_end(self, state):
        if state.timestamp.batch == KILL_AT:  # the step's loss line was logged before batch end
            os.kill(os.getpid(), signal.SIGKILL)

Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(4096), 16), "100000ba", eval_interval=None,
        callbacks={"speed": SpeedMonitor(window_size=5), "lr": LRMonitor(), "kill": KillAt()},
        loggers={"jsonl": JSONLLogger(sys.argv[1])}, config={"optimizer": {"lr": 0.01}},
        log_interval="1ba").fit()  # every step's loss handed to the logger at once (default: every 10 steps)
"""


def test_sigkilled_run_keeps_every_metrics_line_logged_before_the_kill(tmp_path):
    script = tmp_path / "killed_run.py"
    script.write_text(KILLED_RUN)
    path = tmp_path / "metrics.jsonl"
    proc = subprocess.run([sys.executable, str(script), str(path), "37"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    lines = path.read_text().split("\n")
    complete, partial = lines[:-1], lines[-1]
    assert partial == ""  # killed between lines: nothing half-written either
    records = [json.loads(line) for line in complete]
    steps = [r["step"] for r in records if r["kind"] == "metrics" and "loss/train/total" in r["metrics"]]
    assert steps == list(range(1, 38))
    assert [r["kind"] for r in records].count("hparams") == 1
    lr_steps = [r["step"] for r in records if r["kind"] == "metrics" and any(k.startswith("lr-") for k in r["metrics"])]
    assert lr_steps == list(range(1, 37)) or lr_steps == list(range(1, 38))  # the lr line of step 37 follows the kill
