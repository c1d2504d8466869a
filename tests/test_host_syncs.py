"""No host synchronisation inside a training step (issue 17, part 2).

On a GPU a step that reads a value on the host (``loss.item()``, ``int(mask.sum())``, ``nonzero``, printing a
tensor, ...) waits for every queued kernel: a pipeline stall per batch. ``smalti.testing.host_sync`` counts
those calls on a CPU, and a probe counts them from the moment a batch leaves the data loader to the request for
the next one, for real ``smalti-train`` configs built in this process: ``experiment=gpt_tiny`` and
``experiment=moe_tiny`` (the ``torch`` MoE backend here, the ``triton`` one in Triton's CPU interpreter in a
subprocess), with the console logger, speed monitor, LR monitor, progress bar and smalti-checkpoint on.

A steady-state step (no log, eval or checkpoint interval firing) makes no such call; a step where the loss is
logged makes one (all the steps' losses since the last log, read in one transfer).

The Triton run is shorter (5 batches, no checkpoint: steady-state steps 2 and 3, the loss logged at 4): in the
interpreter each step costs seconds, and the steps after a checkpoint go through the same trainer code as on
the ``torch`` backend, which the 7-batch runs cover.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from smalti.core import Callback
from smalti.testing.host_sync import count_host_syncs

ROOT = Path(__file__).resolve().parent.parent

# 7 batches: the console logs at 4, the checkpoint is saved at 5; 2, 3 and 6 are steady-state steps.
BATCHES, STEADY, LOGGED = 7, (2, 3, 6), 4
# The Triton interpreter's run: 5 batches (a batch is probed until the next one is asked for), no checkpoint.
SHORT_BATCHES, SHORT_STEADY = 5, (2, 3)


class SyncProbe(Callback):
    """Counts host syncs per batch, from after the data loader to the request for the next batch."""

    def __init__(self) -> None:
        self.by_batch: dict[int, list[str]] = {}
        self._block = None
        self._counter = None
        self._batch = 0

    def on_after_dataloader(self, state) -> None:
        self._batch = state.timestamp.batch + 1
        self._block = count_host_syncs()
        self._counter = self._block.__enter__()

    def on_before_dataloader(self) -> None:
        if self._block is not None:
            self._block.__exit__(None, None, None)
            self.by_batch[self._batch] = [str(s) for s in self._counter.syncs]
            self._block = None


def build(tmp_path: Path, *overrides: str, batches: int = BATCHES, checkpoint: bool = True):
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from smalti.core.config.build import build_trainer
    from smalti.core.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module("smalti.core.conf", version_base="1.3"):
        cfg = compose("train", overrides=[
            *overrides, f"trainer.max_duration={batches}ba", "trainer.eval_interval=null",
            "data.global_train_batch_size=8", "logger=[console]", f"logger.console.log_interval={LOGGED}ba",
            "callbacks.progress_bar.force=true", "run_name=host-syncs",
            *(["checkpoint=dcp", f"checkpoint.save_folder={tmp_path / 'ckpt'}", "checkpoint.save_interval=5ba",
               "checkpoint.save_on_fit_end=false"] if checkpoint else []),
        ])
    GlobalHydra.instance().clear()
    return build_trainer(cfg)


def probe_run(tmp_path: Path, *overrides: str, **kwargs) -> dict[int, list[str]]:
    trainer = build(tmp_path, *overrides, **kwargs)
    probe = SyncProbe()
    trainer.pm.register_run_plugins([("algorithms", {"probe": probe})])  # algorithms run first in every event
    trainer.fit()
    return probe.by_batch


def check(by_batch: dict[int, list[str]], steady: tuple[int, ...] = STEADY) -> None:
    for batch in steady:
        assert by_batch[batch] == [], f"batch {batch} synced with the host:\n" + "\n".join(by_batch[batch])
    logged = by_batch[LOGGED]
    assert len(logged) == 1 and logged[0].startswith("tolist at ") and "trainer.py" in logged[0], logged


@pytest.mark.timeout(300)
@pytest.mark.parametrize("experiment", ["gpt_tiny", "moe_tiny"])
def test_training_steps_do_not_wait_for_the_device(experiment, tmp_path, monkeypatch):
    from smalti.core import cpu_gemm
    from smalti.moe import ops

    # A GPU step is modelled: smalti-core's OpenBLAS products (which smalti-llm also gives smalti-moe's CPU expert
    # GEMMs, a loop over the experts that reads their row offsets on the host) apply to CPU tensors only.
    monkeypatch.setattr(cpu_gemm, "backend", lambda: "torch")
    overrides = [f"experiment={experiment}"]
    if experiment == "gpt_tiny":
        overrides.append("callbacks.icl=null")  # an evaluation at the end of the run, after the probed steps
    if experiment == "moe_tiny":
        overrides.append("model.n_layers=2")
    with ops.cpu_matmul(None):
        check(probe_run(tmp_path, *overrides))


TRITON_RUN = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from test_host_syncs import SHORT_BATCHES, SHORT_STEADY, check, probe_run
# Small enough for Triton's interpreter, which runs every kernel program in NumPy.
check(probe_run(Path(sys.argv[2]), "experiment=moe_tiny", "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
                "model.ffn_hidden_size=64", "model.max_seq_len=16", "+model.moe.backend=triton",
                batches=SHORT_BATCHES, checkpoint=False), steady=SHORT_STEADY)
print("OK")
"""


@pytest.mark.timeout(600)
def test_moe_tiny_on_the_triton_backend_does_not_wait_for_the_device(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}  # set before triton is imported
    proc = subprocess.run([sys.executable, "-c", TRITON_RUN, str(Path(__file__).parent), str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0 and "OK" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]
