"""goodput over a run cut short and resumed: two attempts (two Trainers in this process, or two real processes, the
first SIGKILLed) append to outputs/<run>/goodput.jsonl; the second resumes from the first one's checkpoint, so the
steps past it are redone; the categories add up to the wall time, fit end logs them to metrics.jsonl and
`smalti-launch logs RUN --goodput` prints them."""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from smalti.core import Callback, Trainer
from smalti.core.callbacks import Goodput
from smalti.core.callbacks.goodput import CATEGORIES, read_goodput
from smalti.core.cli.main import list_run_plugins
from smalti.core.errors import SmaltiError
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.core.launch.cli import main as launch_main
from smalti.core.loggers import JSONLLogger
from smalti.core.loggers.jsonl import read_jsonl

STEP_S, SAVE_S, LOAD_S, EVAL_S, DATA_S = 0.06, 0.25, 0.3, 0.2, 0.03


class SlowData(Dataset):
    def __init__(self):
        self.inner = SyntheticRegression(64)

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        if i % 4 == 0:
            time.sleep(DATA_S)  # one wait per batch of 4
        return self.inner[i]


class Checkpoints(Callback):
    """A checkpoint plugin of the test's own (torch.save of the whole state every 5 batches, loaded on restart),
    with known step, eval, save and load times; the attempt dies at ``kill_at``, by SIGKILL or an exception."""

    def __init__(self, path, kill_at, sigkill):
        self.path, self.kill_at, self.sigkill = path, kill_at, sigkill

    def should_checkpoint(self, state, event):
        return (str(event) == "batch_end" and state.timestamp.batch % 5 == 0) or None

    def on_before_load(self, state):
        if os.path.exists(self.path):
            time.sleep(LOAD_S)
            state.load_state_dict(torch.load(self.path, weights_only=False))

    def on_batch_start(self, state):
        self._t0 = time.perf_counter()

    def on_after_forward(self, state):
        time.sleep(STEP_S)

    def on_eval_start(self, state):
        time.sleep(EVAL_S)

    def on_after_optimizer_step(self, state):
        # What each step really took (the sleep plus the step's work, longer on a loaded machine), appended
        # as it happens so a killed attempt keeps its lines: the figures the report must account for.
        with open(os.path.join(os.path.dirname(self.path), "steps.jsonl"), "a") as f:
            f.write(json.dumps({"batch": state.timestamp.batch + 1, "s": time.perf_counter() - self._t0}) + "\n")

    def on_batch_checkpoint(self, state):
        if state.checkpoint_requested:
            time.sleep(SAVE_S)
            torch.save(state.state_dict(), self.path)

    def on_batch_end(self, state):
        if state.timestamp.batch == self.kill_at:
            if self.sigkill:
                os.kill(os.getpid(), signal.SIGKILL)  # no exception, no clean-up: a real kill
            raise RuntimeError("attempt crashed")


def train(out, kill_at, sigkill=False, started_at=None):
    """One attempt of run ``gp`` under ``out``: 10 batches, eval every 4, checkpoints at 5 and 10."""
    torch.manual_seed(0)
    Trainer(
        MLPRegressor(),
        DataLoader(SlowData(), batch_size=4),
        "10ba",
        run_name="gp",
        optimizers=lambda p: torch.optim.SGD(p, lr=1e-3),
        eval_interval="4ba",
        eval_dataloader=DataLoader(SyntheticRegression(4, seed=1), batch_size=4),
        callbacks={
            "goodput": Goodput(f"{out}/gp/goodput.jsonl", flush_interval_s=0, started_at=started_at),
            "ckpt": Checkpoints(f"{out}/gp/ckpt.pt", kill_at, sigkill),
        },
        loggers={"jsonl": JSONLLogger(f"{out}/gp/metrics.jsonl")},
    ).fit()


def check_report(run, capsys, startup_at_least):
    """Two attempts, the first cut at batch 7 after its checkpoint at 5: what the file, metrics.jsonl and
    ``smalti-launch logs --goodput`` say."""
    report = read_goodput(run / "goodput.jsonl")
    one, two = report.attempts
    assert (one.finished, two.finished) == (False, True)
    assert (one.resumed_from, two.resumed_from) == (0, 5)
    assert (one.batch, two.batch) == (7, 10)
    totals = report.totals()
    assert sum(totals.values()) == pytest.approx(report.wall, abs=0.05)
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    first, second = steps[:7], steps[7:]
    assert [s["batch"] for s in first] == [1, 2, 3, 4, 5, 6, 7] and [s["batch"] for s in second] == [6, 7, 8, 9, 10]
    lost = sum(s["s"] for s in first[5:])  # batches 6 and 7 of the first attempt, trained again by the second
    kept = sum(s["s"] for s in first[:5]) + sum(s["s"] for s in second)
    assert lost >= 2 * STEP_S and totals["redone"] == pytest.approx(lost, rel=0.5)
    assert totals["productive"] == pytest.approx(kept, rel=0.5)
    assert totals["checkpoint_load"] == pytest.approx(LOAD_S, rel=0.5)
    assert totals["checkpoint_save"] == pytest.approx(2 * SAVE_S, rel=0.5)  # at batches 5 and 10
    assert totals["eval"] >= 3 * EVAL_S  # at 4 (first attempt), 8 (second) and at fit end after 10
    assert totals["data"] >= 12 * DATA_S
    assert totals["startup"] >= startup_at_least
    assert totals["idle"] >= 0.0
    assert report.ratio == pytest.approx(totals["productive"] / report.wall)

    logged = [r["metrics"] for r in read_jsonl(run / "metrics.jsonl") if "goodput/ratio" in r["metrics"]]
    assert len(logged) == 1
    assert logged[0]["goodput/attempts"] == 2
    assert logged[0]["goodput/redone_s"] == pytest.approx(totals["redone"])
    assert logged[0]["goodput/ratio"] == pytest.approx(report.ratio)
    assert set(logged[0]) >= {f"goodput/{c}_s" for c in CATEGORIES}

    capsys.readouterr()
    assert launch_main(["logs", "gp", "--root", str(run.parent), "--goodput"]) == 0
    text = capsys.readouterr().out
    assert "2 attempts" in text
    for label in (
        "productive steps",
        "redone after a restart",
        "checkpoint load",
        "checkpoint save",
        "evaluation",
        "data loading waits",
        "start-up",
        "between attempts",
        "wall time",
        "7 (cut)",
    ):
        assert label in text, text
    assert f"goodput {100 * report.ratio:.1f}%" in text, text


def test_a_crashed_and_resumed_run_reports_redone_work_and_categories_that_add_up(tmp_path, capsys):
    out = tmp_path / "outputs"
    with pytest.raises(RuntimeError, match="attempt crashed"):
        train(out, kill_at=7, started_at=time.time())  # checkpoint at 5; batches 6 and 7 are lost
    time.sleep(0.1)
    train(out, kill_at=-1, started_at=time.time())  # a second attempt in this process: its own start
    check_report(out / "gp", capsys, startup_at_least=0.0)


@pytest.mark.slow
def test_a_killed_process_and_its_resumed_run_report_redone_work(tmp_path, capsys):
    out = tmp_path / "outputs"
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_goodput as t; "
        "t.train(sys.argv[1], int(sys.argv[2]), sigkill=True)"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [
        subprocess.run(
            [sys.executable, "-c", code, str(out), str(kill_at)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        for kill_at in (7, -1)
    ]
    assert runs[0].returncode == -signal.SIGKILL, runs[0].stderr[-2000:]
    assert runs[1].returncode == 0, runs[1].stderr[-2000:]
    check_report(out / "gp", capsys, startup_at_least=0.5)  # two processes importing torch


def test_a_line_cut_short_by_a_kill_is_skipped_and_a_bad_line_named(tmp_path):
    record = {
        "attempt": "a",
        "event": "batch",
        "time": 11.0,
        "process_start": 10.0,
        "batch": 1,
        "resumed_from": 0,
        "seconds": {"startup": 0.5, "step": 0.5},
    }
    path = tmp_path / "goodput.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps(record)[:30])
    report = read_goodput(path)
    assert report.wall == 1.0 and report.ratio == 0.5
    path.write_text("{}\n" + json.dumps(record) + "\n")
    with pytest.raises(SmaltiError, match="goodput.jsonl:1: not a goodput record"):
        read_goodput(path)


def test_smalti_plugins_lists_both_monitors_with_their_config_paths():
    out = io.StringIO()
    assert list_run_plugins(["callbacks=[activation_monitor,goodput]"], out=out) == 0
    for name, target in (("activation_monitor", "ActivationMonitor"), ("goodput", "Goodput")):
        assert f"  {name}: smalti.core.callbacks.{target}  (off: callbacks.{name}=null)" in out.getvalue()
