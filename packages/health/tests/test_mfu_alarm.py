"""The throughput alarm: sustained low throughput runs the checks and stops the run when asked to."""

import pytest
import torch

from smalti.core import Trainer
from smalti.core.data import build_dataloader
from smalti.core.errors import ConfigError, TrainingError
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.health.mfu_alarm import ThroughputAlarm
from smalti.testing import MetricsRecorder


def fit(alarm, duration="12ba"):
    torch.manual_seed(0)
    sink = MetricsRecorder()
    Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(256), 8), duration,
            optimizers=lambda p: torch.optim.SGD(p, lr=1e-2), callbacks={"mfu_alarm": alarm},
            loggers={"sink": sink}).fit()
    return sink


def test_low_throughput_for_patience_intervals_runs_the_checks_and_stops():
    alarm = ThroughputAlarm(min_samples_per_sec=1e12, interval=2, patience=3, action="stop", check_seconds=0.05)
    with pytest.raises(TrainingError, match=r"throughput alarm at batch 6: .* samples/s < 1e\+12 for 3 intervals"):
        fit(alarm)
    (results,) = alarm.alarms
    assert {r.name.split("/")[0] for r in results} == {"compute", "all_reduce"}
    assert results[0].metrics["health/compute/tflops"] > 0


def test_warn_keeps_training_and_logs_the_checks():
    alarm = ThroughputAlarm(min_samples_per_sec=1e12, interval=2, patience=2, action="warn", check_seconds=0.05)
    sink = fit(alarm)
    assert len(alarm.alarms) == 3  # at batches 4, 8 and 12
    assert sink.values("health/mfu_alarm/alarms") == [1.0, 2.0, 3.0]
    assert sink.steps("health/compute/tflops") == [4, 8, 12]
    assert sink.values("health/mfu_alarm/low_intervals") == [1.0, 2.0] * 3


def test_a_normal_run_raises_no_alarm():
    alarm = ThroughputAlarm(min_samples_per_sec=1.0, interval=2, patience=1, action="stop")
    sink = fit(alarm)
    assert alarm.alarms == [] and len(sink.values("health/mfu_alarm/samples_per_sec")) == 6


def test_bad_settings_name_the_key():
    with pytest.raises(ConfigError, match="min_samples_per_sec or min_mfu"):
        ThroughputAlarm()
    with pytest.raises(ConfigError, match="action='restart'"):
        ThroughputAlarm(min_mfu=0.3, action="restart")


@pytest.mark.world_size(2, timeout=120)
def test_one_low_rank_makes_both_ranks_check_and_stop_together():
    # Rank 1's floor is out of reach and rank 0's is not: the ranks disagree on "low". Both must still run the
    # checks (which hold collectives: a rank left out would hang its peer) and both must stop at the same batch.
    import torch.distributed as dist

    rank = dist.get_rank()
    alarm = ThroughputAlarm(min_samples_per_sec=1e12 if rank == 1 else 1e-6, interval=2, patience=2,
                            action="stop", check_seconds=0.05)
    with pytest.raises(TrainingError, match="throughput alarm at batch 4: ") as raised:
        fit(alarm)
    (results,) = alarm.alarms
    assert {r.name.split("/")[0] for r in results} == {"compute", "all_reduce"}
    assert ("samples/s < 1e+12" if rank == 1 else "below the floor on another rank") in str(raised.value)
