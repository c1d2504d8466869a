"""smalti-streaming with smalti-core installed: its config option through Hydra, and core ``Time`` in a schedule.

These need hydra and smalti-core, which smalti-streaming does not depend on, so they live here and run in the
venv that holds every package.
"""

from importlib import resources

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from smalti.core.time import Time
from smalti.streaming import MDSWriter, Stream, StreamingDataset


def write_ids(path, n, first=0):
    """An MDS dataset whose ``id`` column runs ``first, first + 1, ...``."""
    with MDSWriter(path, {"id": "int", "x": "ndarray:float32:4"}, compression="zstd", hashes=["xxh64"],
                   size_limit=600) as writer:
        for i in range(n):
            writer.write({"id": first + i, "x": np.full(4, i, np.float32)})
    return str(path)


def test_config_option_instantiates_a_mix_of_streams(tmp_path):
    a, b = write_ids(tmp_path / "a", 30), write_ids(tmp_path / "b", 10)
    text = resources.files("smalti.streaming.conf").joinpath("data", "streaming.yaml").read_text()
    cfg = OmegaConf.create({"data": OmegaConf.create(text)})
    cfg.data.train.local = a
    cfg.data.train.split = None
    cfg.data.train.batch_size = 4
    ds = instantiate(cfg.data.train)
    assert ds.num_samples == 30 and ds.shuffle and ds.batch_size == 4
    mix = OmegaConf.masked_copy(cfg.data.train, [k for k in cfg.data.train if k not in ("remote", "local", "split")])
    mix.streams = [{"local": a, "proportion": 1}, {"local": b, "proportion": 3}]
    mix.epoch_size = 40
    order = instantiate(mix).epoch_order(0)
    assert int((order >= 30).sum()) == 30  # b is a quarter of the dataset but three quarters of the mix
    # Curriculum through config: after 4 global batches of 4 samples, the mix becomes 1:1.
    mix.proportion_schedule = [{"at": "4ba", "proportions": [1, 1]}]
    order = instantiate(mix).epoch_order(0)
    # b: 3 in 4 of the first 16 samples, half of the other 24
    assert [int((order[:16] >= 30).sum()), int((order[16:] >= 30).sum())] == [12, 12]


def test_core_time_objects_are_accepted_in_a_schedule(tmp_path):
    a, b = write_ids(tmp_path / "a", 300), write_ids(tmp_path / "b", 100, first=1000)
    ds = StreamingDataset(streams=[Stream(local=a, proportion=3), Stream(local=b, proportion=1)], batch_size=10,
                          shuffle=True, epoch_size=400,
                          proportion_schedule=[{"at": Time.parse("10ba"), "proportions": [1, 3]}])
    order = ds.epoch_order(0)
    # 10 global batches of 10 at 3:1, then 300 samples at 1:3
    assert int((order[:100] >= 300).sum()) == 25 and int((order[100:] >= 300).sum()) == 225


class _RecordIds(torch.nn.Module):
    """Trains on ``x`` and records the ``id`` of every sample it sees."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.seen = []

    def forward(self, batch):
        self.seen += batch["id"].tolist()
        return self.lin(batch["x"])

    def loss(self, outputs, batch):
        return outputs.float().pow(2).mean()


def test_build_dataloader_gives_a_streaming_loader_that_resumes_through_the_trainer(tmp_path):
    from smalti.core.data import build_dataloader
    from smalti.core.trainer import Trainer
    from smalti.streaming import StreamingDataLoader

    data = write_ids(tmp_path / "d", 120)

    def loader():
        ds = StreamingDataset(local=data, batch_size=1, shuffle=True, num_canonical_nodes=1)
        return build_dataloader(ds, 4, num_workers=2)

    assert isinstance(loader(), StreamingDataLoader)
    whole = StreamingDataset(local=data, batch_size=4, shuffle=True, num_canonical_nodes=1).epoch_order(0)[:32]
    first = _RecordIds()
    trainer = Trainer(first, loader(), "3ba", progress_bar=False, loggers=[], callbacks=[])
    trainer.fit()
    saved = trainer.state.dataloader_state_dict()
    assert saved["loader"]["sample_in_epoch"] == 12
    rest = _RecordIds()
    resumed = Trainer(rest, loader(), "8ba", progress_bar=False, loggers=[], callbacks=[])
    resumed.state.timestamp = trainer.state.timestamp
    resumed.state.load_dataloader_state_dict(saved)
    resumed.fit()
    assert first.seen + rest.seen == whole.tolist()
