"""The health config group: every option composes and builds; the GPU monitor logs NVML metrics."""

import time
from importlib import resources

import pytest
import torch
from omegaconf import OmegaConf

from smalti.core import Trainer
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.health.gpu_monitor import GpuMonitor
from smalti.health.mfu_alarm import ThroughputAlarm
from smalti.health.straggler import StragglerDetector
from smalti.health.watchdog import HangWatchdog
from smalti.testing import MetricsRecorder

OPTIONS = {"watchdog": HangWatchdog, "straggler": StragglerDetector, "mfu_alarm": ThroughputAlarm,
           "gpu_monitor": GpuMonitor}


def test_every_option_composes_through_smalti_train():
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from smalti.core.config.build import build_group
    from smalti.core.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module("smalti.core.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"health=[{','.join(OPTIONS)}]"])
    built = build_group(cfg.health, "health")
    assert {name: type(obj) for name, obj in built.items()} == OPTIONS
    assert resources.files("smalti.health.conf").joinpath("health", "watchdog.yaml").is_file()


def test_gpu_monitor_logs_nvml_metrics_off_the_training_thread(recorded_nvml):
    fake = recorded_nvml({"name": "NVIDIA H100 80GB HBM3", "recovery": 0, "temperature": 61})
    monitor = GpuMonitor(interval_s=0.05, nvml=fake)
    sink = MetricsRecorder()

    class Pace(MLPRegressor):
        def forward(self, batch):
            time.sleep(0.02)
            return super().forward(batch)

    torch.manual_seed(0)
    Trainer(Pace(), build_dataloader(SyntheticRegression(128), 8), "10ba",
            optimizers=lambda p: torch.optim.SGD(p, lr=1e-2), callbacks={"gpu_monitor": monitor},
            loggers={"sink": sink}).fit()
    assert monitor.checks_run >= 2
    assert sink.values("health/gpu0/temperature_c")[0] == 61
    assert fake.calls[-1] == "nvmlShutdown"  # released at close


def test_gpu_monitor_on_a_cpu_machine_logs_no_gpu_once(recorded_nvml):
    import pynvml

    fake = recorded_nvml(init_error=pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    monitor = GpuMonitor(interval_s=0.01, nvml=fake)
    sink = MetricsRecorder()
    Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(64), 8), "4ba",
            optimizers=lambda p: torch.optim.SGD(p, lr=1e-2), callbacks={"gpu_monitor": monitor},
            loggers={"sink": sink}).fit()
    assert monitor.checks_run == 1
    assert sink.values("health/gpu/count") in ([0.0], [])  # logged once if the check finished before a batch end


@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_files_point_at_the_classes(name):
    text = resources.files("smalti.health.conf").joinpath("health", f"{name}.yaml").read_text()
    target = OmegaConf.create(text)[name]["_target_"]
    assert target.rsplit(".", 1)[1] == OPTIONS[name].__name__
