"""The hang watchdog on 2 gloo ranks: a rank asleep in a step is found, reported with stacks, and ended."""

import json
import time
from pathlib import Path

import pytest

from smalti.core.errors import ConfigError
from smalti.health.watchdog import HANG_EXIT_CODE, HangWatchdog, write_hang_report
from smalti.testing import run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "slow_rank_run.py"


def test_a_rank_asleep_in_a_step_is_reported_and_the_run_exits_nonzero(tmp_path):
    start = time.monotonic()
    out = run_torchrun(SCRIPT, 2, ["hang", str(tmp_path)], timeout=90)
    assert out.returncode != 0
    assert time.monotonic() - start < 60  # not the 120 s the rank sleeps
    report = json.loads((tmp_path / "hang-report.json").read_text())
    assert report["stuck_ranks"] == [1]
    by_rank = {e["rank"]: e for e in report["ranks"]}
    assert set(by_rank) == {0, 1} and by_rank[1]["batch"] == 3
    # rank 1 reached no further than its forward; rank 0 went on into backward and waits there for rank 1
    assert by_rank[1]["last_event"] in ("before_forward", "after_forward")
    assert by_rank[0]["last_event"] in ("before_backward", "after_backward")
    hang_started = float((tmp_path / "hang-started").read_text())
    assert by_rank[1]["time"] - hang_started < 3 + 5  # timeout + 5 s
    text = (tmp_path / "hang-report.txt").read_text()
    assert text.startswith("stuck rank(s): 1")
    assert "===== rank 0 stacks =====" in text and "===== rank 1 stacks =====" in text
    assert "on_after_forward" in (tmp_path / "stacks-rank1.txt").read_text()  # the sleeping hook, by name
    assert f"exitcode  : {HANG_EXIT_CODE}" in out.stdout + out.stderr


def test_report_with_every_rank_at_the_same_place_blames_none(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({
            "rank": rank, "world_size": 3, "host": "h", "pid": 1, "batch": 7, "last_event": "before_backward",
            "seconds_without_progress": 9.0}))
    report = write_hang_report(tmp_path)
    assert report["stuck_ranks"] == [2] and report["missing_ranks"] == [2]  # rank 2 never reported
    (tmp_path / "rank2.json").write_text(json.dumps({
        "rank": 2, "world_size": 3, "host": "h", "pid": 1, "batch": 7, "last_event": "before_backward",
        "seconds_without_progress": 9.0}))
    assert write_hang_report(tmp_path)["stuck_ranks"] == []
    assert "suspect a collective" in (tmp_path / "hang-report.txt").read_text()


def test_bad_settings_name_the_key():
    with pytest.raises(ConfigError, match="health.watchdog.timeout_s=0"):
        HangWatchdog(timeout_s=0)
