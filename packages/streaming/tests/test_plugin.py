"""The core plugin: an import-light entry point whose config option builds a working StreamingDataset."""

import subprocess
import sys
from importlib import resources
from importlib.metadata import entry_points

import pytest


def test_entry_point_is_import_light_and_points_at_the_configs():
    (ep,) = [ep for ep in entry_points(group="smalti") if ep.name == "streaming"]
    assert ep.value == "smalti.streaming.plugin"
    code = "import sys, smalti.streaming.plugin as p; print(p.smalti_config_searchpath()); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["pkg://smalti.streaming.conf", "False"]
    assert resources.files("smalti.streaming.conf").joinpath("data", "streaming.yaml").is_file()


def test_config_option_instantiates_a_mix_of_streams(tmp_path, make_dataset):
    hydra_utils = pytest.importorskip("hydra.utils")
    from omegaconf import OmegaConf

    a, b = make_dataset(tmp_path / "a", n=30), make_dataset(tmp_path / "b", n=10)
    text = resources.files("smalti.streaming.conf").joinpath("data", "streaming.yaml").read_text()
    cfg = OmegaConf.create({"data": OmegaConf.create(text)})
    cfg.data.train.local = str(a)
    cfg.data.train.split = None
    cfg.data.train.batch_size = 4
    ds = hydra_utils.instantiate(cfg.data.train)
    assert ds.num_samples == 30 and ds.shuffle and ds.batch_size == 4
    mix = OmegaConf.masked_copy(cfg.data.train, [k for k in cfg.data.train if k not in ("remote", "local", "split")])
    mix.streams = [{"local": str(a), "proportion": 1}, {"local": str(b), "proportion": 3}]
    mix.epoch_size = 40
    ds = hydra_utils.instantiate(mix)
    order = ds.epoch_order(0)
    assert int((order >= 30).sum()) == 30  # b is a quarter of the dataset but three quarters of the mix
    # Curriculum through config: after 4 global batches of 4 samples, the mix becomes 1:1.
    mix.proportion_schedule = [{"at": "4ba", "proportions": [1, 1]}]
    order = hydra_utils.instantiate(mix).epoch_order(0)
    # b: 3 in 4 of the first 16 samples, half of the other 24
    assert [int((order[:16] >= 30).sum()), int((order[16:] >= 30).sum())] == [12, 12]
