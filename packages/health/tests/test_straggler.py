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
        assert len(reports) == 4  # every interval of 5 batches in 20
        assert all(set(r) == {"rank1"} and 2.0 < r["rank1"] < 4.5 for r in reports)
    else:
        assert reports == []


def test_bad_settings_name_the_key():
    with pytest.raises(ConfigError, match="factor=1"):
        StragglerDetector(factor=1)
