"""The straggler detector on 2 gloo ranks: a rank slowed by a factor is flagged, an even run is not."""

import json
from pathlib import Path

import pytest

from smalti.core.errors import ConfigError
from smalti.health.straggler import StragglerDetector, score_ranks
from smalti.testing import run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "slow_rank_run.py"


def test_scores_are_relative_to_the_lower_median():
    assert score_ranks([1.0, 1.0, 3.0, 1.1]) == pytest.approx([1.0, 1.0, 3.0, 1.1])
    assert score_ranks([2.0, 6.0]) == pytest.approx([1.0, 3.0])
    assert score_ranks([0.0, 0.0]) == [1.0, 1.0]


@pytest.fixture(scope="module")
def straggle_runs(tmp_path_factory):
    """The script's four straggler runs, trained one after the other in one 2-rank job: one start-up for all."""
    out = tmp_path_factory.mktemp("straggle")
    job = run_torchrun(SCRIPT, 2, ["straggle", str(out)], timeout=240)
    assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
    return out


def flagged(run_dir):
    reports = json.loads((run_dir / "flagged-rank0.json").read_text())
    assert reports == json.loads((run_dir / "flagged-rank1.json").read_text())  # every rank sees the same
    return reports


@pytest.mark.parametrize("run, flagged_expected", [("slow-3", True), ("even-1", False)])
def test_a_slowed_rank_is_flagged_and_an_even_run_is_not(straggle_runs, run, flagged_expected):
    reports = flagged(straggle_runs / run)
    if flagged_expected:
        assert len(reports) == 3  # every interval of 5 batches in 20, after the first (warm-up) one
        assert all(set(r) == {"rank1"} and 2.0 < r["rank1"] < 4.5 for r in reports), reports
    else:
        assert reports == []


@pytest.mark.parametrize("run, flagged_expected", [("warmup-default", False), ("warmup-0", True)])
def test_a_slow_first_step_is_warm_up_not_a_straggler(straggle_runs, run, flagged_expected):
    # On CPU one rank's first forward often takes far longer than the other's (allocations, lazy init):
    # timed, it makes that rank a straggler in the first window; left out (the default), nothing is flagged.
    reports = flagged(straggle_runs / run)
    if flagged_expected:  # the same run timing its first batch: the warm-up alone is what flags rank 1
        assert len(reports) == 1 and set(reports[0]) == {"rank1"}
    else:
        assert reports == []


def test_bad_settings_name_the_key():
    with pytest.raises(ConfigError, match="factor=1"):
        StragglerDetector(factor=1)
    with pytest.raises(ConfigError, match="warmup_batches=-1"):
        StragglerDetector(warmup_batches=-1)
