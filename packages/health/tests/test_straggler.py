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


@pytest.mark.parametrize("mode, factor, flagged", [("slow", "3", True), ("even", "1", False)])
def test_a_slowed_rank_is_flagged_and_an_even_run_is_not(tmp_path, mode, factor, flagged):
    out = run_torchrun(SCRIPT, 2, [mode, str(tmp_path), factor], timeout=120)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    reports = json.loads((tmp_path / "flagged-rank0.json").read_text())
    assert reports == json.loads((tmp_path / "flagged-rank1.json").read_text())  # every rank sees the same
    if flagged:
        assert len(reports) == 3  # every interval of 5 batches in 20, after the first (warm-up) one
        assert all(set(r) == {"rank1"} and 2.0 < r["rank1"] < 4.5 for r in reports), reports
    else:
        assert reports == []


@pytest.mark.parametrize("warmup_batches, flagged", [("default", False), ("0", True)])
def test_a_slow_first_step_is_warm_up_not_a_straggler(tmp_path, warmup_batches, flagged):
    # On CPU one rank's first forward often takes far longer than the other's (allocations, lazy init):
    # timed, it makes that rank a straggler in the first window; left out (the default), nothing is flagged.
    out = run_torchrun(SCRIPT, 2, ["warmup", str(tmp_path), warmup_batches], timeout=120)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    reports = json.loads((tmp_path / "flagged-rank0.json").read_text())
    if flagged:  # the same run timing its first batch: the warm-up alone is what flags rank 1
        assert len(reports) == 1 and set(reports[0]) == {"rank1"}
    else:
        assert reports == []


def test_bad_settings_name_the_key():
    with pytest.raises(ConfigError, match="factor=1"):
        StragglerDetector(factor=1)
    with pytest.raises(ConfigError, match="warmup_batches=-1"):
        StragglerDetector(warmup_batches=-1)
