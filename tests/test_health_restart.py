"""Health end to end with smalti-checkpoint: a rank hangs mid-run, the watchdog ends the group with its report,
torchrun's agent restarts it (``--max-restarts=1``), autoresume loads the last committed checkpoint, and the run
finishes with the same parameters as an uninterrupted one (the session's ``restart_reference`` run,
tests/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from smalti.testing.torchrun import torchrun_command  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROBES = [ROOT / "packages" / "core" / "tests" / "launch_fixtures", ROOT / "tests" / "fixtures"]
TIMEOUT = 240
#: the watchdog's configured time-out, which no legitimate step reaches, and the one armed at the hang
UNREACHED_S, ARMED_S = 120.0, 4.0


def train_cmd(run: tuple[str, ...], ckpt_dir: Path) -> list[str]:
    return ["-m", "smalti.core.cli.train", *run, f"checkpoint.save_folder={ckpt_dir}"]


def run(cmd: list[str], cwd: Path) -> tuple[int, str]:
    # autoresume needs a stable run name (a generated one is refused at start)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "SMALTI_RUN_NAME": cwd.name,
           "PYTHONPATH": os.pathsep.join(filter(None, [*map(str, PROBES), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=TIMEOUT)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    return proc.returncode, out


@pytest.mark.slow
def test_a_hung_rank_is_ended_by_the_watchdog_and_the_restart_resumes_from_the_checkpoint(tmp_path,
                                                                                         restart_reference):
    faulty = tmp_path / "faulty"
    faulty.mkdir()
    marker, reports = faulty / "hung.txt", faulty / "hang-reports"
    agent = torchrun_command(2, extra=["--rdzv-id=faulty", "--max-restarts=1", "--monitor-interval=0.5"])
    # The hang is deterministic, not a race against a short time-out: the watchdog runs with a time-out no
    # legitimate step reaches (checkpoint saves and the restart's resume included, on a loaded machine), and
    # HangOnce narrows it to ARMED_S on every rank at the end of batch 3 of attempt 0, as rank 1 starts to hang
    # there. A 4 s time-out for the whole run used to fire at a slow step under load.
    cmd = agent + train_cmd(restart_reference.overrides, faulty / "ckpt") + [
        "health=[watchdog]", f"health.watchdog.timeout_s={UNREACHED_S}", "health.watchdog.poll_s=0.2",
        "health.watchdog.grace_s=5", f"health.watchdog.report_dir={reports}",
        "+callbacks.hang._target_=health_probe.HangOnce", f"+callbacks.hang.marker={marker}",
        "+callbacks.hang.batch=3", f"+callbacks.hang.arm_watchdog_s={ARMED_S}"]
    code, out = run(cmd, faulty)
    assert code == 0, out[-4000:]
    assert marker.exists()
    # the hang was in attempt 0; the restarted attempt 1 finished without one, so it wrote no report
    assert not list(reports.glob("*attempt1*"))
    report = json.loads((reports / "hang-report-attempt0.json").read_text())
    # both ranks fired on the armed time-out (not the unreachable one), and both wrote their part
    assert {e["rank"]: e["timeout_s"] for e in report["ranks"]} == {0: ARMED_S, 1: ARMED_S}, report
    assert all(ARMED_S < e["seconds_without_progress"] < UNREACHED_S for e in report["ranks"]), report
    assert report["stuck_ranks"] == [1], report
    assert report["stuck_hooks"] == {"1": "on_batch_end"}
    assert report["stuck_plugins"] == {"1": "hang: HangOnce.on_batch_end"}

    from smalti.core.loggers import read_jsonl

    log_path = faulty / "outputs" / "faulty" / "metrics.jsonl"
    # the watchdog logged that it fired, and handed the report to the loggers, before rank 0 exited
    assert any(r["metrics"].get("health/watchdog/fired") == 1.0 for r in read_jsonl(log_path))
    assert {a["name"] for a in read_jsonl(log_path, kind="artifact")} >= {"hang-report-attempt0.txt",
                                                                           "hang-report-attempt0.json"}
    steps = [r["step"] for r in read_jsonl(log_path) if "loss/train/total" in r["metrics"]]
    # batches 1-3 ran, rank 1 hung after 3; the restart resumed after the batch-2 checkpoint, not from batch 0
    # (losses are read at the log interval, so batch 3's from the hung attempt may never have been logged)
    assert steps.count(1) == 1 and steps.count(2) == 1 and steps[-4:] == [3, 4, 5, 6], steps
    assert json.loads((faulty / "digest.json").read_text()) == restart_reference.digest
