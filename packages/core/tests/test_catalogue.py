"""Every algorithm and monitor of the catalogue is an option of its config group: `smalti plugins --run` lists it
with its config path, and the shipped yaml builds it."""

import io

import pytest
from hydra.utils import instantiate

from smalti.core.cli.main import list_run_plugins

CATALOGUE = [
    ("callbacks", "optimizer_monitor", "smalti.core.callbacks.OptimizerMonitor"),
    ("callbacks", "loss_spike", "smalti.core.callbacks.LossSpike"),
    ("callbacks", "runtime_estimator", "smalti.core.callbacks.RuntimeEstimator"),
    ("callbacks", "profiler", "smalti.core.callbacks.Profiler"),
    ("algorithms", "label_smoothing", "smalti.core.algorithms.LabelSmoothing"),
    ("algorithms", "layer_freezing", "smalti.core.algorithms.LayerFreezing"),
    ("algorithms", "seq_length_warmup", "smalti.core.algorithms.SeqLengthWarmup"),
]


@pytest.mark.parametrize(("group", "name", "target"), CATALOGUE)
def test_smalti_plugins_lists_the_option_with_its_config_path_and_it_builds(group, name, target):
    out = io.StringIO()
    assert list_run_plugins([f"{group}=[{name}]"], out=out) == 0
    assert f"  {name}: {target}  (off: {group}.{name}=null)" in out.getvalue()

    from hydra import compose, initialize_config_module

    from smalti.core.config.schema import register_configs

    register_configs()
    with initialize_config_module(config_module="smalti.core.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"{group}=[{name}]"])
    built = instantiate(cfg[group][name])
    assert f"{type(built).__module__.rsplit('.', 1)[0]}.{type(built).__name__}" == target
