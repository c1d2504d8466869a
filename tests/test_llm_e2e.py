"""End to end: ``smalti-train experiment=gpt_tiny`` from the repository root trains (loss falls), evaluates
(eval metrics and ICL), checkpoints with smalti-checkpoint, and a second run resumes from the middle
checkpoint and continues with the losses of the uninterrupted run, bit for bit.

With ``trainer.deterministic=true`` three processes of the same command, run at the same time, give
bit-identical losses and final weights. The default mode's old occasional divergence (one float32 ulp at an early
step in 4 of ~36 runs, then a drift to ~1e-6 by step 20) came from PyTorch's fused CPU LayerNorm, whose weight
gradient is summed in one buffer per intra-op thread, so its bits depended on the run's thread count; smalti-llm's
LayerNorm sums it in a thread-count-independent order, and the last test here runs the default mode with 1 and 2
threads at once and requires the same losses bit for bit (with PyTorch's LayerNorm put back they part at step 4).
The investigation is in packages/core/README.md ("Bit-reproducible runs").
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _train(
    tmp_path: Path,
    name: str,
    *overrides: str,
    deterministic: bool = True,
    callbacks: str = "[icl_at_end]",
    threads: int = 2,
) -> tuple[str, dict[int, dict[str, float]]]:
    env = {
        **os.environ,
        "SMALTI_RUN_NAME": f"llm-e2e-{name}",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": str(threads),
        # Several of these runs share 2 cores: idle OpenMP threads sleep rather than spin (GNU OpenMP spins by
        # default, and the spinning threads take the cores from the working ones). How threads wait changes no
        # result: the losses are the same bit for bit; 3 runs at once, 8 batches each: 106 s CPU -> 39 s.
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    cmd = [
        sys.executable,
        "-m",
        "smalti.core.cli.train",
        "experiment=gpt_tiny",
        f"callbacks={callbacks}",
        "logger=[jsonl]",
        f"trainer.deterministic={str(deterministic).lower()}",
        f"hydra.run.dir={tmp_path / name}",
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    from smalti.core.loggers import read_jsonl

    metrics: dict[int, dict[str, float]] = {}
    for record in read_jsonl(tmp_path / name / "metrics.jsonl"):
        if "metrics" in record:
            metrics.setdefault(record["step"], {}).update(record["metrics"])
    return out, metrics


def _losses(metrics: dict[int, dict[str, float]]) -> dict[int, float]:
    return {step: m["loss/train/total"] for step, m in metrics.items() if "loss/train/total" in m}


def _saved_at(save_folder: Path, batch: int) -> Path:
    found = [p for p in save_folder.iterdir() if p.is_dir() and p.name.endswith(f"ba{batch}")]
    assert len(found) == 1, sorted(p.name for p in save_folder.iterdir())
    return found[0]


def _weights_digest(folder: Path) -> str:
    """SHA-256 over the model weights a DCP checkpoint folder holds (every tensor's bytes, in name order)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = folder.parent / f"{folder.name}-weights.pt"
    dcp_to_torch_save(str(folder), str(target))
    model = torch.load(target, weights_only=False)["model"]
    digest = hashlib.sha256()
    for key in sorted(model):
        digest.update(key.encode())
        digest.update(model[key].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# gpt_tiny's data and schedule on a narrower, shallower model: a step costs ~5x less and the runs still cross
# epoch boundaries (11 batches an epoch), fall to ~3 nats by batch 40 and resume mid-epoch at batch 20.
SMALL_MODEL = ("model.d_model=64", "model.n_layers=2")


# Three runs at once, then a resumed one: about 1 minute on an idle 2-core machine.
@pytest.mark.timeout(1200)
def test_smalti_train_gpt_tiny_is_bit_reproducible_checkpoints_resumes_and_evaluates(tmp_path):
    names = ["full", "again", "third"]

    def run(name: str) -> tuple[str, dict[int, dict[str, float]]]:
        return _train(
            tmp_path,
            name,
            "trainer.max_duration=40ba",
            "trainer.eval_interval=20ba",
            "checkpoint=dcp",
            f"checkpoint.save_folder={tmp_path / ('ckpt-' + name)}",
            "checkpoint.save_interval=20ba",
            *SMALL_MODEL,
        )

    with ThreadPoolExecutor(len(names)) as pool:  # the same command in three processes at once
        (out, full), *others = list(pool.map(run, names))
    losses = _losses(full)
    assert sorted(losses) == list(range(1, 41))
    for _, other in others:
        assert _losses(other) == losses  # bit for bit
    finals = [_weights_digest(_saved_at(tmp_path / f"ckpt-{name}", 40)) for name in names]
    assert len(set(finals)) == 1, finals

    final = float(re.search(r"with loss ([0-9.]+)", out).group(1))
    assert final < math.log(2048) - 3.0, out[-2000:]  # from ~7.6 nats (uniform) to well below
    assert re.search(r"icl/mc_phrases/0shot/accuracy=([0-9.]+)", out), out[-2000:]
    evals = {
        step: m["metrics/eval/LanguageCrossEntropy"]
        for step, m in full.items()
        if "metrics/eval/LanguageCrossEntropy" in m
    }
    assert sorted(evals) == [20, 40] and evals[40] < evals[20], evals
    ckpt = tmp_path / "ckpt-full"
    middle = [p for p in ckpt.iterdir() if p.is_dir() and p.name.endswith("ba20")]
    assert len(middle) == 1, sorted(p.name for p in ckpt.iterdir())

    # Same duration (the learning-rate schedule depends on it), no eval or ICL: only the training goes on.
    out, resumed = _train(
        tmp_path,
        "resumed",
        "trainer.max_duration=40ba",
        "trainer.eval_interval=null",
        "callbacks.icl=null",
        "checkpoint=dcp",
        f"checkpoint.load_path={middle[0]}",
        f"checkpoint.save_folder={tmp_path / 'ckpt2'}",
        "checkpoint.save_interval=null",
        *SMALL_MODEL,
    )
    assert re.search(r"resuming at epoch \d+, batch 20\b", out), out[-3000:]
    resumed_losses = _losses(resumed)
    assert sorted(resumed_losses) == list(range(21, 41))
    assert resumed_losses == {s: losses[s] for s in resumed_losses}  # bit for bit
    assert _weights_digest(_saved_at(tmp_path / "ckpt2", 40)) == finals[0]


@pytest.mark.timeout(1000)  # two short runs at once: ~20 s on an idle 2-core machine
def test_default_mode_losses_do_not_depend_on_the_process_or_the_thread_count(tmp_path):
    """Without ``trainer.deterministic``, the same command in two processes at once, one with 1 intra-op thread
    and one with 2, gives the same losses bit for bit. A kernel whose result depends on the thread count (as
    PyTorch's fused LayerNorm weight gradient does), on the process or on the memory layout would show here."""

    def run(threads: int) -> dict[int, float]:
        _, metrics = _train(
            tmp_path,
            f"default-{threads}-threads",
            "trainer.max_duration=6ba",
            "trainer.eval_interval=null",
            "data.eval=null",
            deterministic=False,
            callbacks="[]",
            threads=threads,
        )
        return _losses(metrics)

    with ThreadPoolExecutor(2) as pool:
        one, two = pool.map(run, [1, 2])
    assert sorted(one) == list(range(1, 7))
    assert two == one  # bit for bit
