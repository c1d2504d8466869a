"""Elastic resume through the trainer: a streaming run checkpointed on 4 gloo ranks resumes on 2 and on 3 with
no sample of the epoch repeated or skipped (smalti-core + smalti-checkpoint + smalti-streaming)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("smalti.checkpoint")

from smalti.streaming import MDSWriter  # noqa: E402
from smalti.testing.torchrun import run_torchrun  # noqa: E402

SAMPLES, GLOBAL_BATCH, SAVED_AT = 150, 12, 4  # the epoch pads 150 to 156: 13 global batches

SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from smalti.checkpoint import Checkpointer
from smalti.core.data import build_dataloader
from smalti.core.trainer import Trainer
from smalti.streaming import StreamingDataset

data, folder, load, duration, out, global_batch = sys.argv[1:7]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


class RecordIds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.seen = []

    def forward(self, batch):
        self.seen += batch["id"].tolist()
        return self.lin(batch["x"])

    def loss(self, outputs, batch):
        return outputs.float().pow(2).mean()


per_rank = int(global_batch) // world
ds = StreamingDataset(local=data, batch_size=per_rank, shuffle=True, num_canonical_nodes=2, predownload=0)
model = RecordIds()
checkpoint = Checkpointer(folder, save_interval=duration if not load else None, save_on_fit_end=False,
                          load_path=load or None)
trainer = Trainer(model, build_dataloader(ds, per_rank), duration, progress_bar=False, loggers=[],
                  callbacks={"checkpoint": checkpoint})
trainer.fit()
json.dump(model.seen, open(f"{out}.{rank}.json", "w"))
dist.destroy_process_group()
"""


def _run(tmp_path, nproc, data, folder, load, duration, out):
    script = tmp_path / "elastic.py"
    script.write_text(SCRIPT)
    done = run_torchrun(script, nproc=nproc, args=[str(data), str(folder), load, duration, str(out),
                                                  str(GLOBAL_BATCH)], timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + (done.stderr or "")[-4000:]
    return [json.loads((tmp_path / f"{out.name}.{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.slow
def test_a_streaming_run_saved_on_4_ranks_resumes_on_2_and_on_3(tmp_path):
    data = tmp_path / "data"
    with MDSWriter(data, {"id": "int", "x": "ndarray:float32:4"}, compression="zstd", size_limit=800) as writer:
        for i in range(SAMPLES):
            writer.write({"id": i, "x": np.full(4, i, np.float32)})
    first = _run(tmp_path, 4, data, tmp_path / "ckpt", "", f"{SAVED_AT}ba", tmp_path / "first")
    read_first = [i for ids in first for i in ids]
    assert len(read_first) == SAVED_AT * GLOBAL_BATCH and len(set(read_first)) == len(read_first)
    saved = tmp_path / "ckpt" / f"ep0-ba{SAVED_AT}"
    assert json.loads((saved / "manifest.json").read_text())["dp_world_size"] == 4
    padded = -(-SAMPLES // GLOBAL_BATCH) * GLOBAL_BATCH
    for ranks in (2, 3):
        rest = _run(tmp_path, ranks, data, tmp_path / f"unused{ranks}", str(saved), "1ep", tmp_path / f"on{ranks}")
        read = Counter(read_first + [i for ids in rest for i in ids])
        assert sorted(read) == list(range(SAMPLES)), ranks  # nothing skipped ...
        repeated = sum(read.values()) - SAMPLES
        assert repeated == padded - SAMPLES, (ranks, repeated)  # ... and nothing repeated but the padding
